"""The on-policy gate decided in the update against a separate scoring pass: a training step's time.

    python bench/gate_pass.py [--prompts 8] [--samples 4] [--prompt 160] [--tokens 64] [--repeats 3]

The default job's training phase (`bench/vs_trl.py`'s single-turn workload): SmolLM2-135M-Instruct
in fp32 on the CPU (the tiny random Qwen2 when SmolLM2 is not in agentrl's model cache), `--prompts`
x `--samples` trajectories of a `--prompt`-token prompt and `--tokens` sampled tokens (token ids
drawn at random: the cost does not depend on them), 512-token micro-batches, `--flat` groups with
equal rewards (no backward, as `trainer.zero_advantage_rows=score` does), the gate on (its default
thresholds), the rollout logprobs set to the model's own so that it keeps every row. One
`train_step` with `trainer.score_in_update=true` (the gate decided in the update, from its own
forward) and one with `false` (what every step did before: a scoring pass first), alternated
`--repeats` times on two backends built alike, each step on the weights the previous one left.
Printed: the median wall and process-CPU seconds of each, the machine's load average before and
after (other processes on a shared machine make wall times noisy; CPU time does not count waiting
for a core), and the peak resident set each path added over the process's peak before it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from trainer import MODEL, peak_rss_bytes, reset_peak_rss

from agentrl.config import AlgorithmConfig, TrainerConfig
from agentrl.types import TokenOrigin, Trajectory


def default_job_batch(backend, prompts: int, samples: int, prompt: int, tokens: int, flat: int) -> list[Trajectory]:
    """GRPO-shaped: each group's prompt once, `samples` answers; rollout logprobs from `backend` itself."""
    rng = np.random.default_rng(0)
    drafts = []
    for g in range(prompts):
        ids = rng.integers(10, 5000, size=prompt).tolist()
        for k in range(samples):
            t = Trajectory(reward=1.0 if g < flat else float(k % 2), group_id=f"g{g}")
            t.extend(ids, TokenOrigin.PROMPT, 0)
            t.extend(rng.integers(10, 5000, size=tokens).tolist(), TokenOrigin.SAMPLED, 1,
                     logprobs=[-12.0] * tokens, version=0)  # fmt: skip
            drafts.append(t)
    own = backend.compute_logprobs(drafts)
    out = []
    for i, d in enumerate(drafts):
        t = Trajectory(reward=d.reward, group_id=d.group_id)
        t.extend(d.token_ids[:prompt], TokenOrigin.PROMPT, 0)
        t.extend(d.token_ids[prompt:], TokenOrigin.SAMPLED, 1, logprobs=own[i, prompt - 1 : prompt - 1 + tokens].tolist(),
                 version=0)  # fmt: skip
        out.append(t)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=160, help="prompt tokens")
    parser.add_argument("--tokens", type=int, default=64, help="sampled tokens per trajectory")
    parser.add_argument("--flat", type=int, default=2, help="groups whose rewards are all equal")
    parser.add_argument("--budget", type=int, default=512, help="micro-batch token budget")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from agentrl.models import cache_dir
    from agentrl.trainer.fsdp2 import FSDP2Backend
    from agentrl.trainer.step import train_step

    cached = cache_dir() / "smollm2-135m-instruct"
    model = cached if (cached / "config.json").is_file() else MODEL
    trainer = {True: TrainerConfig(device="cpu", lr=1e-6, micro_batch_tokens=args.budget, score_in_update=True)}
    trainer[False] = trainer[True].model_copy(update={"score_in_update": False})
    backends = {mode: FSDP2Backend(model, trainer[mode], AlgorithmConfig(), seed=0) for mode in (True, False)}
    trajs = default_job_batch(backends[True], args.prompts, args.samples, args.prompt, args.tokens, args.flat)
    algo = AlgorithmConfig(rollout_is="tis")
    load_before = os.getloadavg()
    times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    peaks: dict[bool, list[float]] = {True: [], False: []}
    gated = {}
    for k in range(args.repeats + 1):  # the first round warms both up (optimizer state, allocator pools)
        for mode in (True, False) if k % 2 == 0 else (False, True):
            reset_peak_rss()
            base = peak_rss_bytes()
            wall, cpu = time.perf_counter(), time.process_time()
            metrics = train_step(backends[mode], trajs, algo, trainer[mode], policy_version=0)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            if k:
                times[mode].append((wall, cpu))
                peaks[mode].append((peak_rss_bytes() - base) / 2**20)
            assert metrics["batch/scored_in_update"] == float(mode)
            gated[mode] = metrics["onpolicy/gated_sequences"]
    load_after = os.getloadavg()
    print(f"model {Path(model).name}: {len(trajs)} trajectories of {args.prompt} + {args.tokens} tokens, "
          f"{args.flat} flat groups, {args.budget}-token micro-batches; gated rows: in update {gated[True]:.0f}, "
          f"separate {gated[False]:.0f}")  # fmt: skip
    print(f"load average before {', '.join(f'{x:.1f}' for x in load_before)}, after "
          f"{', '.join(f'{x:.1f}' for x in load_after)}; {os.cpu_count()} cores")  # fmt: skip
    for mode, label in ((False, "separate pass (before)"), (True, "gate in the update")):
        wall = statistics.median(w for w, _ in times[mode])
        cpu = statistics.median(c for _, c in times[mode])
        print(f"{label:24} train_step median wall {wall:6.2f} s, cpu {cpu:6.2f} s over {args.repeats} "
              f"[{', '.join(f'{w:.2f}' for w, _ in times[mode])}]; peak RSS rise {max(peaks[mode]):,.0f} MiB")
    wall = {m: statistics.median(w for w, _ in times[m]) for m in (True, False)}
    cpu = {m: statistics.median(c for _, c in times[m]) for m in (True, False)}
    print(f"speed-up: wall {wall[False] / wall[True]:.2f}x, cpu {cpu[False] / cpu[True]:.2f}x")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
