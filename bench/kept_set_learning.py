"""Does kept-set replay learn like unrestricted sampling? Short `agentrl run`s side by side.

Trains the same small config with `rollout.top_p=0.9 rollout.top_k=20` (the engine samples from a
truncated distribution, the trainer replays the kept sets: docs/on-policy-sampling.md) and with
`top_p=1` (nothing truncated), over the same seeds, one run after another (each run is a
subprocess of `agentrl run`; running them in parallel would only make each slower on a small
machine). It then reads each run's `metrics.jsonl` and writes, per step, the reward, the
rollout/trainer mismatch figures (IS ratios, logprob gap, kept-set disagreement and overflow) and
the policy entropy, setting by setting, as a markdown table (stdout and `--out`) and as JSON
(`--json`).

A few steps are not a learning curve: this shows that the replayed run trains on-policy (IS ratios
at 1, gaps at float noise, nothing gated) and that its reward and entropy stay in the range of the
unrestricted run's, not that the two converge alike.

    python bench/kept_set_learning.py --seeds 0 1 --steps 5 --out /tmp/kept_set.md
    python bench/kept_set_learning.py --env retool --seeds 0 --steps 3 --run-dir runs/kept_set_retool
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SETTINGS = {
    "top_p=0.9+top_k=20": ["rollout.top_p=0.9", "rollout.top_k=20"],
    "top_p=1": ["rollout.top_p=1.0", "rollout.top_k=0"],
}
# The small configs, both with SmolLM2-135M-Instruct: the arithmetic preset with fewer prompts and
# turns (the 135M model solves none of its problems: every reward is 0, so GRPO has no signal), and
# the retool preset as it is (its shaped reward gives signal from the first step), each with a
# held-out evaluation of 4 problems before and after instead of the preset's.
ENVS = {
    "arithmetic": [
        "env=arithmetic", "data.prompts_per_step=4", "rollout.samples_per_prompt=4", "rollout.max_turns=2",
        "rollout.max_tokens_per_turn=96", "rollout.max_total_tokens=768", "trainer.micro_batch_tokens=2048",
        "trainer.gradient_checkpointing=true", "inference.cpu_kv_cache_gb=0.5",
    ],
    "retool": ["env=retool"],
}
COMMON = ["run.eval_every=0", "data.num_val_rows=4", "eval.k=1", "run.save_every=0", "run.loggers=[jsonl]"]
# (column title, metric key) shown per step and setting.
COLUMNS = (
    ("reward", "episodes/reward_mean"),
    ("solved", "episodes/solved_frac"),
    ("entropy", "actor/entropy"),
    ("IS mean", "rollout/is_ratio_mean"),
    ("IS min", "rollout/is_ratio_min"),
    ("IS max", "rollout/is_ratio_max"),
    ("gap mean", "rollout/logprob_abs_diff"),
    ("gap max", "onpolicy/logprob_gap_max"),
    ("kept-set disagr.", "onpolicy/kept_set_disagreement"),
    ("overflow", "onpolicy/kept_set_overflow_share"),
    ("gated", "onpolicy/gated_share"),
    ("s", "time/step_s"),
)


def run_name(setting: str, seed: int) -> str:
    return f"kept-{setting.replace('=', '').replace('+', '-').replace('.', '')}-s{seed}"


def run_one(env: str, setting: str, seed: int, steps: int, out_dir: Path, extra: list[str],
            timeout_s: float) -> dict:
    """One `agentrl run`; returns its per-step metrics (or the error that stopped it)."""
    name = run_name(setting, seed)
    args = [*ENVS[env], *COMMON, *SETTINGS[setting], f"run.seed={seed}", f"run.total_steps={steps}",
            f"run.output_dir={out_dir}", f"run.name={name}", *extra]  # fmt: skip
    start = time.perf_counter()
    log_path = out_dir / f"{name}.log"
    with log_path.open("w") as log:
        done = subprocess.run([sys.executable, "-m", "agentrl.cli", "run", *args], stdout=log, stderr=subprocess.STDOUT,
                              timeout=timeout_s, cwd=REPO)  # fmt: skip
    return read_run(setting, seed, out_dir, seconds=time.perf_counter() - start, returncode=done.returncode)


def read_run(setting: str, seed: int, out_dir: Path, *, seconds: float | None = None,
             returncode: int | None = None) -> dict:
    """A run's per-step metrics from its `metrics.jsonl` (and the last log line when it failed)."""
    name = run_name(setting, seed)
    log_path = out_dir / f"{name}.log"
    metrics_path = out_dir / name / "metrics.jsonl"
    steps_seen: dict[int, dict] = {}
    if metrics_path.exists():
        for line in metrics_path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                steps_seen[int(record.get("step", -1))] = record
    result = {"setting": setting, "seed": seed, "seconds": seconds, "returncode": returncode,
              "log": str(log_path), "steps": [steps_seen[s] for s in sorted(steps_seen)]}  # fmt: skip
    if returncode:
        tail = log_path.read_text().strip().splitlines()[-1:] if log_path.exists() else []
        result["error"] = (tail or [f"exit {returncode}"])[0][:300]
    return result


def cell(record: dict, key: str) -> str:
    value = record.get(key)
    if value is None:
        return "–"  # not logged at this step: never shown as 0
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def table(results: list[dict]) -> str:
    head = ("setting", "seed", "step", *(title for title, _ in COLUMNS))
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        if "error" in r and not r["steps"]:
            lines.append(f"| {r['setting']} | {r['seed']} | – | error: {r['error']} |")
            continue
        for record in r["steps"]:
            values = [cell(record, key) for _, key in COLUMNS]
            lines.append("| " + " | ".join([r["setting"], str(r["seed"]), str(record.get("step")), *values]) + " |")
    return "\n".join(lines) + "\n"


def summary(results: list[dict]) -> str:
    """Per setting, the mean over seeds and steps of each column, and the first and last step's reward."""
    lines = ["| setting | runs | steps | " + " | ".join(t for t, _ in COLUMNS[:-1]) + " | reward first → last step |",
             "|" + "---|" * (len(COLUMNS) + 3)]  # fmt: skip
    for setting in SETTINGS:
        runs = [r for r in results if r["setting"] == setting and r["steps"]]
        records = [rec for r in runs for rec in r["steps"]]
        if not records:
            continue
        means = []
        for _, key in COLUMNS[:-1]:
            values = [rec[key] for rec in records if isinstance(rec.get(key), (int, float))]
            means.append(f"{sum(values) / len(values):.3g}" if values else "–")
        first = [r["steps"][0].get("episodes/reward_mean") for r in runs]
        last = [r["steps"][-1].get("episodes/reward_mean") for r in runs]
        trend = ", ".join(f"{a:.3g} → {b:.3g}" for a, b in zip(first, last, strict=True) if a is not None and b is not None)
        lines.append(f"| {setting} | {len(runs)} | {len(records)} | " + " | ".join(means) + f" | {trend} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--env", default="arithmetic", choices=list(ENVS), help="which small config to train")
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--run-dir", default="runs/kept_set_learning", help="parent of the runs and their logs")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    p.add_argument("--out", default=None, help="write the markdown tables here too")
    p.add_argument("--json", default=None, help="write every run's per-step metrics here")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: write the tables from the runs already under --run-dir")
    p.add_argument("overrides", nargs="*", help="more key=value overrides for every run")
    ns = p.parse_args(argv)
    out_dir = Path(ns.run_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for seed in ns.seeds:
        for setting in ns.settings:
            if ns.report_only:
                results.append(read_run(setting, seed, out_dir))
                continue
            r = run_one(ns.env, setting, seed, ns.steps, out_dir, ns.overrides, ns.timeout)
            results.append(r)
            print(f"{setting} seed {seed}: {len(r['steps'])} steps in {r['seconds'] or 0:.0f} s"
                  + (f", error: {r['error']}" if "error" in r else ""), file=sys.stderr, flush=True)  # fmt: skip
            if ns.json:
                Path(ns.json).write_text(json.dumps(results, indent=1))
    text = summary(results) + "\n" + table(results)
    sys.stdout.write(text)
    if ns.out:
        Path(ns.out).write_text(text)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
