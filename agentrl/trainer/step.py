"""One RL training step over a batch of trajectories, for any `TrainerBackend`.

`train_step` is the algorithm-level recipe of DESIGN.md §3: drop infrastructure failures (they
are masked out, never scored 0), shape the rewards, filter equal-reward groups if asked, score
the batch with the current policy (old logprobs), the reference (when `kl_coef > 0`) and the
critic (GAE), form advantages with the configured estimator (`ADVANTAGE_ESTIMATORS`), weigh the
rollout/trainer mismatch, then run `ppo_epochs` x `mini_batches` optimizer steps. It returns the
metrics an RL practitioner watches, named `group/metric`.

It owns no model and no process group: every rank calls it with the same batch and the backend
splits the work. It does not collect trajectories or push weights (the orchestration layer does).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

import torch

from agentrl.errors import ConfigError
from agentrl.registry import ADVANTAGE_ESTIMATORS
from agentrl.trainer import algos
from agentrl.trainer.backend import CriticBatch, PolicyBatch, TrainerBackend
from agentrl.trainer.packing import pad_trajectories
from agentrl.types import Trajectory

__all__ = ["mini_batch_indices", "train_step"]


def mini_batch_indices(n: int, parts: int) -> list[list[int]]:
    """Split range(n) into `parts` contiguous, near-equal chunks (empty chunks dropped), so that
    the samples of one prompt (adjacent in a batch) mostly land in the same mini-batch."""
    bounds = [round(k * n / parts) for k in range(parts + 1)]
    return [list(range(a, b)) for a, b in itertools.pairwise(bounds) if b > a]


def _on_last_token(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) scores -> (B, L) token rewards with each score on its sequence's last loss token."""
    positions = torch.arange(mask.shape[1]).expand_as(mask)
    last = torch.where(mask > 0, positions, -1).max(-1).values
    out = torch.zeros(mask.shape, dtype=torch.float32)
    rows = (last >= 0).nonzero().squeeze(-1)
    out[rows, last[rows]] = scores[rows].float()
    return out


def _stats(prefix: str, values: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    kept = values[mask > 0]
    if kept.numel() == 0:
        return {}
    return {
        f"{prefix}/mean": kept.mean().item(),
        f"{prefix}/std": kept.std().item() if kept.numel() > 1 else 0.0,
        f"{prefix}/min": kept.min().item(),
        f"{prefix}/max": kept.max().item(),
    }


def train_step(
    backend: TrainerBackend,
    trajectories: Sequence[Trajectory],
    algorithm: Any,
    trainer: Any,
    *,
    temperature: float = 1.0,
    max_response_tokens: int | None = None,
) -> dict[str, float]:
    """Train the backend's policy (and critic) on one batch; return the step's metrics.

    `algorithm` is an `AlgorithmConfig`, `trainer` a `TrainerConfig` (`ppo_epochs`,
    `mini_batches`). `temperature` is the rollout sampling temperature (logprobs are scored at
    it). `max_response_tokens` is the response length limit: the DAPO overlong penalty needs it,
    and `seq-mean-token-sum-norm` divides by it (by the batch's longest response when None).
    """
    start = time.perf_counter()
    metrics: dict[str, float] = {"batch/trajectories": float(len(trajectories))}
    trajs = [t for t in trajectories if t.trainable]
    metrics["batch/infra_masked"] = float(len(trajectories) - len(trajs))
    if not trajs:
        return {**metrics, "batch/skipped": 1.0}

    # ── rewards ─────────────────────────────────────────────────────────────────────────────
    scores = torch.tensor([float(t.reward or 0.0) for t in trajs])
    metrics.update(_stats("reward", scores, torch.ones_like(scores)))
    if algorithm.overlong_buffer_tokens > 0:
        if max_response_tokens is None:
            raise ConfigError(
                "algorithm.overlong_buffer_tokens > 0 needs the response length limit; pass "
                "max_response_tokens to train_step (or set overlong_buffer_tokens=0)."
            )
        lengths = torch.tensor([t.num_sampled for t in trajs])
        penalty = algos.overlong_penalty(
            lengths, max_response_length=max_response_tokens, buffer_length=algorithm.overlong_buffer_tokens
        )
        metrics["reward/overlong_penalty_mean"] = penalty.mean().item()
        scores = scores + penalty
    groups = [t.group_id for t in trajs]
    if algorithm.filter_groups:
        keep = algos.dynamic_group_filter(scores, groups).tolist()
        metrics["batch/filtered_out"] = float(len(trajs) - len(keep))
        trajs, scores, groups = [trajs[i] for i in keep], scores[keep], [groups[i] for i in keep]
        if not trajs:
            return {**metrics, "batch/skipped": 1.0}

    # ── scoring with the current models ─────────────────────────────────────────────────────
    layout = pad_trajectories(trajs)
    mask, rollout_logprobs = layout.loss_mask, layout.rollout_logprobs
    old_logprobs = backend.compute_logprobs(trajs, temperature=temperature)
    ref_logprobs = None
    if algorithm.kl_coef > 0:
        ref_logprobs = backend.compute_ref_logprobs(trajs, temperature=temperature)
    rewards: torch.Tensor = scores
    if ref_logprobs is not None and algorithm.kl_in_reward:
        rewards, kl_metrics = algos.apply_kl_penalty(
            _on_last_token(scores, mask), old_logprobs, ref_logprobs, mask,
            kl_coef=algorithm.kl_coef, kind=algorithm.kl_estimator,
        )  # fmt: skip
        metrics["actor/kl_in_reward"] = kl_metrics["kl"].item()

    # ── advantages ──────────────────────────────────────────────────────────────────────────
    estimator = ADVANTAGE_ESTIMATORS.resolve(algorithm.advantage)
    kwargs: dict[str, Any] = {}
    values = None
    if algorithm.advantage == "gae":
        values = backend.compute_values(trajs)
        kwargs = {"values": values, "gamma": algorithm.gamma, "lam": algorithm.lam}
    elif algorithm.advantage == "reinforce_pp":
        kwargs = {"gamma": algorithm.gamma}
    advantages, returns = estimator(rewards, mask, groups, **kwargs)
    metrics.update(_stats("adv", advantages, mask))
    if values is not None:
        metrics.update(_stats("critic/returns", returns, mask))

    # ── rollout / trainer mismatch ──────────────────────────────────────────────────────────
    mode = "tis" if algorithm.rollout_is == "none" else algorithm.rollout_is.replace("_", "-")
    is_weights, loss_mask, is_metrics = algos.rollout_correction(
        old_logprobs, rollout_logprobs, mask, mode=mode,
        low=1.0 / algorithm.rollout_is_cap, high=algorithm.rollout_is_cap,
    )  # fmt: skip
    metrics.update({f"rollout/{k}": float(v) for k, v in is_metrics.items()})
    metrics["rollout/logprob_abs_diff"] = algos.masked_mean(
        (old_logprobs - rollout_logprobs).abs(), mask
    ).item()
    if algorithm.rollout_is == "none":
        is_weights, loss_mask = None, mask

    # ── updates ─────────────────────────────────────────────────────────────────────────────
    max_len = max_response_tokens or max(1, int(mask.sum(-1).max().item()))
    policy_batch = PolicyBatch(
        trajectories=list(trajs), loss_mask=loss_mask, advantages=advantages, old_logprobs=old_logprobs,
        rollout_logprobs=rollout_logprobs, ref_logprobs=ref_logprobs, is_weights=is_weights,
        temperature=temperature, max_len=max_len,
    )  # fmt: skip
    critic_batch = None
    if values is not None:
        critic_batch = CriticBatch(
            trajectories=list(trajs), loss_mask=mask, returns=returns, old_values=values, max_len=max_len
        )
    metrics["batch/loss_tokens"] = float(loss_mask.sum().item())
    tokens = sum(len(t.token_ids) for t in trajs)
    metrics["batch/tokens"] = float(tokens)

    updates: list[dict[str, float]] = []
    update_start = time.perf_counter()
    for _ in range(trainer.ppo_epochs):
        for idx in mini_batch_indices(len(trajs), trainer.mini_batches):
            result = {
                f"actor/{k}": v for k, v in backend.update_policy(policy_batch.select(idx), algorithm).items()
            }
            if critic_batch is not None:
                result.update(backend.update_critic(critic_batch.select(idx), algorithm))
            updates.append(result)
    update_s = time.perf_counter() - update_start
    for name in sorted({k for u in updates for k in u}):
        seen = [u[name] for u in updates if name in u]
        pick = max if name.endswith("_max") else min if name.endswith("_min") else None
        metrics[name] = pick(seen) if pick else sum(seen) / len(seen)
    metrics["actor/updates"] = float(len(updates))
    metrics["perf/update_tokens_per_s"] = tokens * trainer.ppo_epochs / max(update_s, 1e-9)
    step_s = time.perf_counter() - start
    metrics["perf/step_s"] = step_s
    metrics["perf/step_tokens_per_s"] = tokens / max(step_s, 1e-9)
    return metrics
