"""The README's headline, measured the way a user meets it: `agentrl run env=retool` over several seeds.

    python bench/retool_seeds.py                      # seeds 0..4 (0 is the default), one after the other
    python bench/retool_seeds.py --seeds 1 2 3        # chosen seeds
    python bench/retool_seeds.py --report runs-seeds  # re-read finished runs, run nothing

Each seed runs the default job exactly as shipped (`agentrl run env=retool`), adding only
`run.seed=S`, `run.name=seed-S` and `run.output_dir`, one after the other (never two at once: on a
small machine they would slow each other down and the wall times would mean nothing). From each
run's `result.json` it reads held-out pass@1 before and after training and the wall time, and prints
a Markdown table with every run and the spread: how many gained at least +0.10, the smallest gain,
the median. A run that fails is a row saying so, never a gain of 0.

Targets for the README's headline: a median gain of at least +0.15 over seeds 0-4, none below +0.05,
each run within 15 minutes on an idle machine. Run it with nothing else running.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def run_seed(seed: int, out: Path, extra: list[str]) -> dict:
    """Run the default job with `seed`; return what its result.json says (or why it has none)."""
    name = f"seed-{seed}"
    command = [sys.executable, "-m", "agentrl.cli", "run", "env=retool", f"run.seed={seed}", f"run.name={name}",
               f"run.output_dir={out}", *extra]
    start = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.monotonic() - start
    (out / f"{name}.log").write_text(done.stdout + "\n--- stderr ---\n" + done.stderr)
    return read_seed(out / name, seconds, done.returncode, done.stderr)


def read_seed(run_dir: Path, seconds: float | None = None, returncode: int = 0, stderr: str = "") -> dict:
    result_file = run_dir / "result.json"
    if returncode != 0 or not result_file.is_file():
        tail = stderr.strip().splitlines()[-1:] or ["no result.json"]
        return {"run": run_dir.name, "error": f"exit {returncode}: {tail[0]}"}
    result = json.loads(result_file.read_text())
    before, after = result["eval_before"].get("pass_at_1"), result["eval_after"].get("pass_at_1")
    row = {"run": run_dir.name, "steps": result["steps_done"], "before": before, "after": after,
           "seconds": seconds if seconds is not None else result["seconds"]}
    if before is None or after is None:
        row["error"] = "pass@1 not measured (infrastructure failures)"
    else:
        row["gain"] = after - before
    return row


def table(rows: list[dict]) -> str:
    lines = ["| run | steps | pass@1 before → after | gain | wall time |", "|---|---|---|---|---|"]
    for r in rows:
        if "gain" in r:
            lines.append(f"| {r['run']} | {r['steps']} | {r['before']:.3f} → {r['after']:.3f} | "
                         f"**{r['gain']:+.3f}** | {r['seconds'] / 60:.1f} min |")
        else:
            lines.append(f"| {r['run']} | | | failed: {r['error']} | |")
    gains = [r["gain"] for r in rows if "gain" in r]
    if gains:
        lines.append("")
        lines.append(f"{len(gains)} of {len(rows)} runs measured; gain ≥ +0.10 in {sum(g >= 0.10 for g in gains)}, "
                     f"smallest {min(gains):+.3f}, median {statistics.median(gains):+.3f}, largest {max(gains):+.3f}; "
                     f"longest run {max(r['seconds'] for r in rows if 'gain' in r) / 60:.1f} min.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--out", type=Path, default=Path("runs-seeds"))
    parser.add_argument("--report", type=Path, help="read the runs in this directory; run nothing")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = parser.parse_args()
    if args.report:
        rows = [read_seed(d) for d in sorted(args.report.iterdir()) if d.is_dir() and d.name.startswith("seed-")]
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        rows = []
        for seed in args.seeds:
            rows.append(run_seed(seed, args.out.resolve(), args.overrides))
            print(json.dumps(rows[-1]), flush=True)
    print(table(rows))


if __name__ == "__main__":
    main()
