"""What keeping rollouts costs a training step: the trajectory writer against the step it writes.

    python bench/rollout_log.py --run                       # a short real run (SmolLM2, arithmetic), then measure it
    python bench/rollout_log.py --run model.path=DIR ...    # the same with your overrides
    python bench/rollout_log.py runs/NAME                   # measure a run that kept its rollouts

Side by side in one run:
1. In the run: each step's `time/rollout_log_s` (the driver timing `RolloutLog.write_step`, token
   texts, JSON and the file included) against its `time/step_s`, and the bytes written.
2. The worst case, on the same episodes: every kept episode is written again with `keep=all`,
   once with a cold token-text cache (the first step of a run) and once warm; the cost per token
   times the tokens of a whole step (`episodes/count` x `episodes/total_tokens_mean`) is what
   `run.keep_rollouts=all` would add to that step.
Target: the writer takes under 1% of a step at the default (`run.keep_rollouts=4`) and under 2%
with `all`, cold cache included. `--run` uses `run.keep_rollouts=all`, so part 1 is the worst case.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

RUN_OVERRIDES = [
    "env=arithmetic", "run.total_steps=3", "data.prompts_per_step=4", "rollout.samples_per_prompt=4",
    "rollout.max_tokens_per_turn=96", "run.eval_every=0", "data.num_val_rows=2", "eval.k=1",
    "run.keep_rollouts=all", "run.loggers=[console,jsonl]", "inference.cpu_kv_cache_gb=0.5",
]  # fmt: skip


def make_run(overrides: list[str]) -> Path:
    out = Path(tempfile.mkdtemp(prefix="agentrl-bench-rollout-log-"))
    command = [sys.executable, "-m", "agentrl.cli", "run", *RUN_OVERRIDES, *overrides,
               f"run.output_dir={out}", "run.name=bench"]
    print("running:", " ".join(command[2:]), flush=True)
    done = subprocess.run(command)
    if done.returncode != 0:  # e.g. stopped by infrastructure failures: measure the steps it made
        print(f"the run exited with status {done.returncode}; measuring the steps it completed", flush=True)
    return out / "bench"


def load_tokenizer(config: dict):
    from transformers import AutoTokenizer

    from agentrl.models import resolve_model_path

    model = config["model"]
    return AutoTokenizer.from_pretrained(resolve_model_path(model.get("tokenizer") or model["path"]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", nargs="?", help="a run directory with rollouts/ and metrics.jsonl")
    parser.add_argument("--run", nargs="*", metavar="OVERRIDE", help="make a short real run first")
    ns = parser.parse_args()
    if ns.run is None and not ns.run_dir:
        parser.error("give a run directory or --run")
    run_dir = make_run(ns.run) if ns.run is not None else Path(ns.run_dir)

    from agentrl.records.metrics import read_metrics
    from agentrl.records.trajectory_log import RolloutLog, read_trajectory_file, trajectory_from_record

    records = read_metrics(run_dir / "metrics.jsonl")
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    keep = config["run"].get("keep_rollouts")
    print(f"\n{run_dir}  (run.keep_rollouts={keep})")
    print("1. in the run")
    print(f"{'step':>4} {'step_s':>9} {'write_s':>9} {'share':>8} {'episodes':>9} {'tokens':>8} {'file':>9}")
    shares = []
    for r in records:
        step = int(r["step"]) + 1
        path = run_dir / "rollouts" / f"step-{step:06d}.jsonl"
        if "time/rollout_log_s" not in r or not path.is_file():
            continue
        kept = read_trajectory_file(path)
        share = r["time/rollout_log_s"] / r["time/step_s"]
        shares.append(share)
        print(f"{step:>4} {r['time/step_s']:>9.2f} {r['time/rollout_log_s']:>9.4f} {share:>8.3%} {len(kept):>9} "
              f"{sum(k['num_tokens'] for k in kept):>8} {path.stat().st_size / 1024:>8.0f}K")
    if not shares:
        print("this run kept no rollouts (run.keep_rollouts=0, or a run from before they were kept)")
        return 1

    print("2. every kept episode written again (keep=all), per step of the run")
    tokenizer = load_tokenizer(config)
    worst = []
    with tempfile.TemporaryDirectory() as tmp:
        warm = RolloutLog(tmp, tokenizer, "all")
        for r in records:
            step = int(r["step"]) + 1
            path = run_dir / "rollouts" / f"step-{step:06d}.jsonl"
            if not path.is_file():
                continue
            trajs = [trajectory_from_record(k) for k in read_trajectory_file(path)]
            tokens = sum(len(t) for t in trajs)

            class Group:
                trajectories = trajs
                prompt = None

            cold = RolloutLog(tmp, tokenizer, "all")
            t0 = time.perf_counter()
            cold.write_step(step, [Group()])
            cold_s = time.perf_counter() - t0
            warm.write_step(step, [Group()])
            t0 = time.perf_counter()
            warm.write_step(step, [Group()])
            warm_s = time.perf_counter() - t0
            # the step's episodes (the metrics count trained groups; the file also has the discarded)
            step_tokens = max(tokens, r.get("episodes/count", 0) * r.get("episodes/total_tokens_mean", 0))
            whole = cold_s / max(tokens, 1) * step_tokens
            worst.append(whole / r["time/step_s"])
            print(f"  step {step}: {tokens} tokens: cold {cold_s * 1e3:.1f} ms, warm {warm_s * 1e3:.1f} ms "
                  f"({tokens / max(warm_s, 1e-9) / 1e3:.0f}k tokens/s); a whole step ({step_tokens:.0f} tokens) cold: "
                  f"{whole * 1e3:.1f} ms = {whole / r['time/step_s']:.3%} of its {r['time/step_s']:.1f} s")
    median, top = statistics.median(shares), max(worst)
    print(f"\nwriter's share of a step in the run: median {median:.3%}, max {max(shares):.3%}")
    print(f"keep=all with a cold cache, worst step: {top:.3%}")
    ok = max(shares) < (0.02 if keep == "all" else 0.01) and top < 0.02
    print("target (under 1% at the default, under 2% with all):", "met" if ok else "NOT met")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
