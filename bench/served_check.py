"""What the served-policy check costs the default job: step time with the check on and off, side by side.

    python bench/served_check.py                       # colocated, 4 steps per run, 2 runs per side
    python bench/served_check.py --placements colocated split --steps 4 --repeats 2
    python bench/served_check.py --report bench-served # re-read finished runs, run nothing

Each run is the default job as shipped (`agentrl run env=retool`), shortened to `--steps` steps with
no held-out evaluation, with `weights.check_served=true` or `false`; runs alternate (on, off, on, off,
...) one at a time, so load from anything else on the machine falls on both sides alike. From each
run's `metrics.jsonl` it reads every step's `time/step_s`, `time/split/weights_s` (the push, which the
step awaits: it holds the check and, colocated, the trainer's scoring of the probe) and, with the check
on, `sync/verify_s` (the replicas' side of the check). The first step of each run is
left out (it pays for warm-up). Printed: per placement and side, the median step time over all
kept steps, the median check time, and the cost: median step time on over off, minus 1, beside
the push's median seconds with the check on minus off, and that as a share of the step.

Target: the check adds at most 5% to the default job's step time. The load average is printed;
a step's time moves by tens of percent with what the policy samples, so the push's difference is
the steadier figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def run_one(out: Path, placement: str, check: bool, index: int, steps: int) -> Path:
    name = f"{placement}-{'on' if check else 'off'}-{index}"
    command = [sys.executable, "-m", "agentrl.cli", "run", "env=retool", f"placement={placement}",
               f"run.total_steps={steps}", "run.eval_every=0", "data.num_val_rows=1", "eval.k=1", "run.save_every=0",
               f"weights.check_served={str(check).lower()}", f"run.name={name}", f"run.output_dir={out}"]
    start = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True)
    (out / f"{name}.log").write_text(done.stdout + "\n--- stderr ---\n" + done.stderr)
    print(f"{name}: exit {done.returncode} in {time.monotonic() - start:.0f} s", flush=True)
    return out / name


def read_run(run_dir: Path) -> tuple[list[float], list[float], list[float]]:
    """(step seconds, check seconds, push seconds) of every step after the first; empty if the run did
    not finish. The push's seconds (`time/split/weights_s`) hold the check and, colocated, the trainer's
    scoring of the probe inside the push."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return [], [], []
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "time/step_s" in r][1:]
    return ([r["time/step_s"] for r in rows], [r["sync/verify_s"] for r in rows if "sync/verify_s" in r],
            [r["time/split/weights_s"] for r in rows if "time/split/weights_s" in r])


def report(out: Path, placements: list[str]) -> str:
    lines = ["| placement | check | runs | steps | median step | median push | median check | cost (step on/off - 1) | "
             "push on - off, share of the step |", "|---|---|---|---|---|---|---|---|---|"]
    for placement in placements:
        sides = {}
        for check in ("on", "off"):
            runs = sorted(out.glob(f"{placement}-{check}-*/"))
            steps: list[float] = []
            verify: list[float] = []
            pushes: list[float] = []
            for r in runs:
                s, v, p = read_run(r)
                steps += s
                verify += v
                pushes += p
            sides[check] = (len(runs), steps, verify, pushes)
        off = sides["off"]
        for check, (n, steps, verify, pushes) in sides.items():
            if not steps:
                lines.append(f"| {placement} | {check} | {n} | 0 | not measured (no finished run) | | | | |")
                continue
            step = statistics.median(steps)
            cost = share = ""
            if check == "on" and off[1]:
                cost = f"{step / statistics.median(off[1]) - 1:+.1%}"
                if pushes and off[3]:
                    extra = statistics.median(pushes) - statistics.median(off[3])
                    share = f"{extra:+.2f} s, {extra / step:.1%}"
            check_s = f"{statistics.median(verify):.2f} s" if verify else ""
            push_s = f"{statistics.median(pushes):.2f} s" if pushes else ""
            lines.append(f"| {placement} | {check} | {n} | {len(steps)} | {step:.1f} s | {push_s} | {check_s} | {cost} | "
                         f"{share} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--placements", nargs="+", default=["colocated"], choices=["colocated", "split"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="bench-served")
    parser.add_argument("--report", metavar="DIR", help="only re-read the runs under DIR")
    args = parser.parse_args()
    if args.report:
        print(report(Path(args.report), args.placements))
        return
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(f"load average at start: {os.getloadavg()}", flush=True)
    for placement in args.placements:
        for i in range(args.repeats):
            for check in (True, False):
                run_one(out, placement, check, i, args.steps)
    print(f"load average at end: {os.getloadavg()}")
    print(report(out, args.placements))


if __name__ == "__main__":
    main()
