"""Trainer throughput: packed vs padded forward+backward, and the FSDP2 trainer's memory per token.

    python bench/trainer.py [--sequences 16] [--budget 1024] [--pad-batch 2] [--repeats 2]

Sequence lengths are drawn from a skewed (lognormal) distribution clipped to 32..1024 tokens, the
shape multi-turn agent episodes have. The tiny random Qwen2 runs forward + backward of the
token-logprob loss over all of them twice: packed into token-budget micro-batches (no padding)
and right-padded in fixed-size batches (the layout most trainers fall back to). Throughput counts
real tokens only. Padding wastes a fraction p of the padded layout's compute, so the ideal
speed-up of packing is 1/(1-p); the figure of merit is measured speed-up / ideal (target >= 0.9).

Then `FSDP2Backend.update_policy` over the same batch measures the trainer's peak memory per
token of micro-batch budget, with full-vocabulary logits and with the chunked scoring head
(`lm_head.ScoringHead`, the backend's default): CUDA's max_memory_allocated on a GPU, the rise of the process's peak
resident set (Linux VmHWM, reset through /proc/self/clear_refs) on CPU. Every figure comes from
this one run. Other processes on a shared machine make wall times noisy, so each layout is timed
`--repeats` times, the best run is kept, and process CPU time is printed beside wall time.

Last, shared prefixes: `--groups` prompts of `--prompt` tokens with `--samples` answers each (a
GRPO batch), one `FSDP2Backend.update_policy` with `trainer.share_prefixes` on and off, on
SmolLM2-135M-Instruct when it is in agentrl's model cache (`--prefix-model tiny` for the tiny Qwen2,
whose cost is almost all its 152k-word LM head, which sharing does not touch: it scores the same
answer tokens either way). The ideal speed-up is the ratio of packed tokens (each prompt once
instead of once per sample); the figure of merit is measured / ideal.

Then flat groups: the same GRPO batch with `--flat` of its groups given equal rewards (advantage 0,
an exactly-zero gradient), one `train_step` per `trainer.zero_advantage_rows` mode on the same
model. The ideal speed-up over `train` counts packed tokens, a forward as a third of a forward +
backward: `skip` runs only the other groups, `score` adds a forward of the flat ones.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
import torch

from agentrl.config import AlgorithmConfig, TrainerConfig
from agentrl.trainer.packing import compute_token_logprobs, pack_micro_batches, pad_trajectories
from agentrl.types import TokenOrigin, Trajectory

ASSETS = Path(os.environ.get("AGENTRL_ASSETS", Path(__file__).resolve().parents[2] / "shared" / "assets"))
MODEL = ASSETS / "tiny-random-qwen2"


def skewed_batch(n: int, seed: int = 0) -> list[Trajectory]:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(mean=np.log(160), sigma=0.8, size=n), 32, 1024).astype(int)
    out = []
    for i, length in enumerate(lengths):
        prompt = 16
        ids = rng.integers(10, 5000, size=int(length)).tolist()
        traj = Trajectory(reward=float(i % 2), group_id=f"g{i // 4}")
        traj.extend(ids[:prompt], TokenOrigin.PROMPT, 0)
        traj.extend(ids[prompt:], TokenOrigin.SAMPLED, 0, logprobs=[-12.0] * (length - prompt), version=0)
        out.append(traj)
    return out


def timed(fn, repeats: int) -> tuple[float, float]:
    """Best (wall seconds, process CPU seconds) over `repeats` runs. CPU time is the steadier
    figure on a machine other processes share: it does not count time spent waiting for a core."""
    best_wall = best_cpu = float("inf")
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        best_wall = min(best_wall, time.perf_counter() - wall)
        best_cpu = min(best_cpu, time.process_time() - cpu)
    return best_wall, best_cpu


def run_layout(model, batches, repeats: int) -> tuple[float, float]:
    def once() -> None:
        for b in batches:
            logits = model(**b.model_inputs()).logits
            lp = compute_token_logprobs(logits, b.labels)
            (-(lp * b.loss_mask).sum()).backward()
        model.zero_grad(set_to_none=True)

    return timed(once, repeats)


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def trainer_memory(trajs: list[Trajectory], budget: int, chunked_head: bool) -> tuple[float, str]:
    from agentrl.trainer.backend import PolicyBatch
    from agentrl.trainer.fsdp2 import FSDP2Backend

    device = "cuda" if torch.cuda.is_available() else "cpu"
    trainer = TrainerConfig(device=device, micro_batch_tokens=budget)
    backend = FSDP2Backend(MODEL, trainer, AlgorithmConfig(), chunked_head=chunked_head)
    layout = pad_trajectories(trajs)
    old = backend.compute_logprobs(trajs)
    batch = PolicyBatch(
        trajectories=trajs, loss_mask=layout.loss_mask, advantages=layout.loss_mask * 0.5,
        old_logprobs=old, rollout_logprobs=layout.rollout_logprobs,
    )  # fmt: skip
    backend.update_policy(batch, AlgorithmConfig())  # warm: optimizer state, allocator pools
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        backend.update_policy(batch, AlgorithmConfig())
        return (torch.cuda.max_memory_allocated() - base) / budget, "cuda max_memory_allocated"
    if not reset_peak_rss():
        return float("nan"), "unavailable (cannot reset VmHWM)"
    base = peak_rss_bytes()
    backend.update_policy(batch, AlgorithmConfig())
    return (peak_rss_bytes() - base) / budget, "peak RSS rise (VmHWM)"


def group_batch(groups: int, samples: int, prompt: int, seed: int = 1) -> list[Trajectory]:
    """GRPO-shaped: `groups` prompts, `samples` answers each of 32..128 tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        ids = rng.integers(10, 5000, size=prompt).tolist()
        for k in range(samples):
            n = int(rng.integers(32, 129))
            traj = Trajectory(reward=float(k % 2), group_id=f"g{g}")
            traj.extend(ids, TokenOrigin.PROMPT, 0)
            traj.extend(rng.integers(10, 5000, size=n).tolist(), TokenOrigin.SAMPLED, 0, logprobs=[-12.0] * n, version=0)
            out.append(traj)
    return out


def shared_prefix_speedup(trajs: list[Trajectory], budget: int, repeats: int, model: Path) -> None:
    from agentrl.trainer.backend import PolicyBatch
    from agentrl.trainer.fsdp2 import FSDP2Backend
    from agentrl.trainer.packing import prefix_units

    real = sum(len(t) for t in trajs)
    shared_tokens = sum(cost for _, cost in prefix_units(trajs, budget))
    ideal = real / shared_tokens
    layout = pad_trajectories(trajs)
    times = {}
    for share in (False, True):
        trainer = TrainerConfig(device="cpu", micro_batch_tokens=budget, share_prefixes=share)
        backend = FSDP2Backend(model, trainer, AlgorithmConfig())
        batch = PolicyBatch(
            trajectories=trajs, loss_mask=layout.loss_mask, advantages=layout.loss_mask * 0.5,
            old_logprobs=None, rollout_logprobs=layout.rollout_logprobs,
        )  # fmt: skip
        times[share] = timed(lambda b=backend, pb=batch: b.update_policy(pb, AlgorithmConfig()), repeats)
    print(f"shared prefixes ({model.name}): {len(trajs)} sequences, {real} tokens, {shared_tokens} packed with each prompt once; "
          f"ideal speed-up {ideal:.2f}x")  # fmt: skip
    for k, clock in enumerate(("wall", "cpu")):
        speedup = times[False][k] / times[True][k]
        print(
            f"[{clock:4}] update_policy shared {real / times[True][k]:,.0f} tokens/s | repeated "
            f"{real / times[False][k]:,.0f} tokens/s | speed-up {speedup:.2f}x, {speedup / ideal:.2f} of ideal"
        )


def zero_advantage_speedup(
    trajs: list[Trajectory], flat: int, budget: int, repeats: int, model: Path
) -> None:
    from agentrl.trainer.fsdp2 import FSDP2Backend
    from agentrl.trainer.packing import prefix_units
    from agentrl.trainer.step import train_step

    groups = list(dict.fromkeys(t.group_id for t in trajs))
    flat_groups = set(groups[:flat])
    for t in trajs:
        if t.group_id in flat_groups:
            t.reward = 0.0
    cost = {g: sum(c for _, c in prefix_units([t for t in trajs if t.group_id == g], budget)) for g in groups}
    every, flat_cost = sum(cost.values()), sum(cost[g] for g in flat_groups)
    ideal = {"skip": every / (every - flat_cost), "score": 3 * every / (3 * (every - flat_cost) + flat_cost)}
    times = {}
    for mode in ("train", "score", "skip"):
        trainer = TrainerConfig(device="cpu", micro_batch_tokens=budget, zero_advantage_rows=mode)
        backend = FSDP2Backend(model, trainer, AlgorithmConfig())
        times[mode] = timed(lambda b=backend, tr=trainer: train_step(b, trajs, AlgorithmConfig(), tr), repeats)
    print(f"flat groups ({model.name}): {flat} of {len(groups)} groups with equal rewards, {flat_cost} of {every} "
          f"packed tokens; ideal speed-up over `train`: score {ideal['score']:.2f}x, skip {ideal['skip']:.2f}x")  # fmt: skip
    for k, clock in enumerate(("wall", "cpu")):
        print(f"[{clock:4}] train_step " + " | ".join(
            f"{mode} {times[mode][k]:.2f} s" + ("" if mode == "train" else
            f" ({times['train'][k] / times[mode][k]:.2f}x, {times['train'][k] / times[mode][k] / ideal[mode]:.2f} of ideal)")
            for mode in ("train", "score", "skip")))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--budget", type=int, default=1024, help="packed micro-batch token budget")
    parser.add_argument("--pad-batch", type=int, default=2, help="sequences per padded batch")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--groups", type=int, default=4, help="shared prefixes: prompts")
    parser.add_argument("--samples", type=int, default=4, help="shared prefixes: answers per prompt")
    parser.add_argument("--prompt", type=int, default=256, help="shared prefixes: prompt tokens")
    parser.add_argument("--flat", type=int, default=3, help="flat groups: groups (of --groups) with equal rewards")
    parser.add_argument("--prefix-model", default="smollm2", choices=["smollm2", "tiny"],
                        help="shared prefixes: the model (smollm2 falls back to tiny when not cached)")
    args = parser.parse_args()
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    trajs = skewed_batch(args.sequences)
    lengths = [len(t) for t in trajs]
    real = sum(lengths)
    packed = pack_micro_batches(trajs, args.budget)
    padded = [pad_trajectories(trajs[i : i + args.pad_batch]) for i in range(0, len(trajs), args.pad_batch)]
    padded_tokens = sum(b.input_ids.numel() for b in padded)
    pad_fraction = 1 - real / padded_tokens
    ideal = 1 / (1 - pad_fraction)

    packed_s = run_layout(model, packed, args.repeats)
    padded_s = run_layout(model, padded, args.repeats)
    print(f"lengths: n={len(lengths)} min={min(lengths)} median={int(np.median(lengths))} max={max(lengths)}")
    print(f"tokens: real={real} padded layout={padded_tokens} padding fraction={pad_fraction:.3f}")
    print(f"ideal packing speed-up 1/(1-p) = {ideal:.2f}x (target: measured/ideal >= 0.9)")
    for k, clock in enumerate(("wall", "cpu")):
        speedup = padded_s[k] / packed_s[k]
        print(
            f"[{clock:4}] packed ({len(packed)} micro-batches <= {args.budget} tokens) "
            f"{real / packed_s[k]:,.0f} tokens/s | padded ({len(padded)} batches of {args.pad_batch}) "
            f"{real / padded_s[k]:,.0f} tokens/s | speed-up {speedup:.2f}x, {speedup / ideal:.2f} of ideal"
        )
    for chunked in (False, True):
        per_token, how = trainer_memory(trajs, args.budget, chunked)
        label = "chunked scoring head" if chunked else "full logits"
        print(
            f"FSDP2 update_policy peak memory per budget token, {label}: {per_token / 1024:,.0f} KiB ({how})"
        )
    prefix_model = MODEL
    if args.prefix_model == "smollm2":
        from agentrl.models import cache_dir

        cached = cache_dir() / "smollm2-135m-instruct"
        prefix_model = cached if (cached / "config.json").is_file() else MODEL
    shared_prefix_speedup(group_batch(args.groups, args.samples, args.prompt), args.budget, args.repeats, prefix_model)
    zero_advantage_speedup(
        group_batch(args.groups, args.samples, args.prompt), min(args.flat, args.groups), args.budget, args.repeats,
        prefix_model,
    )


if __name__ == "__main__":
    main()
