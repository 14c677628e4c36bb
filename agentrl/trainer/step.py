"""One RL training step over a batch of trajectories, for any `TrainerBackend`.

`train_step` is the algorithm-level recipe of DESIGN.md §3: drop infrastructure failures (they
are masked out, never scored 0), shape the rewards (DAPO overlong penalty, stop-properly penalty
for episodes truncated at the length limit), filter equal-reward groups if asked, score
the batch with the current policy (old logprobs), the reference (when `kl_coef > 0`) and the
critic (GAE), form advantages with the configured estimator (`ADVANTAGE_ESTIMATORS`), weigh the
rollout/trainer mismatch, then run `ppo_epochs` x `mini_batches` optimizer steps. It returns the
metrics an RL practitioner watches, named `group/metric`. The KL coefficient comes from a
controller (`make_kl_controller`) that the caller keeps across steps: fixed, or adaptive when
`algorithm.kl_target` is set, updated after each step with the batch's KL to the reference.

An episode an external agent played through the gateway may arrive as several trajectory segments
(`info["segment"]`, same `group_id` and `episode_id`, same reward). The group-relative estimators
(grpo, dr_grpo, rloo, reinforce_pp_baseline) then count each episode once: the group statistics use
one reward per episode and every segment's tokens get its episode's advantage (the step-wise
"broadcast" of rLLM and SkyRL), so an agent that rewrites its history more often does not weigh
more in its group. Token-level estimators (gae, reinforce_pp) see each segment as a sequence that
ends with the episode's reward.

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
from agentrl.types import FinishReason, Trajectory

__all__ = ["make_kl_controller", "mini_batch_indices", "train_step"]


def make_kl_controller(algorithm: Any) -> algos.FixedKLController | algos.AdaptiveKLController:
    """The KL coefficient controller an `AlgorithmConfig` asks for, starting at `kl_coef`."""
    if algorithm.kl_target is None:
        return algos.FixedKLController(algorithm.kl_coef)
    return algos.AdaptiveKLController(algorithm.kl_coef, algorithm.kl_target, algorithm.kl_horizon)


def mini_batch_indices(n: int, parts: int) -> list[list[int]]:
    """Split range(n) into `parts` contiguous, near-equal chunks (empty chunks dropped), so that
    the samples of one prompt (adjacent in a batch) mostly land in the same mini-batch."""
    bounds = [round(k * n / parts) for k in range(parts + 1)]
    return [list(range(a, b)) for a, b in itertools.pairwise(bounds) if b > a]


_PER_EPISODE_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")


def _episode_index(trajs: Sequence[Trajectory]) -> list[int] | None:
    """Each trajectory's episode number when some episodes come in segments (module docstring), else None."""
    seen: dict[Any, int] = {}
    index = []
    for i, t in enumerate(trajs):
        segmented = isinstance(t.info.get("segment"), dict) and t.episode_id
        key = (t.group_id, t.episode_id) if segmented else i
        index.append(seen.setdefault(key, len(seen)))
    return index if len(seen) < len(trajs) else None


def _per_episode_advantages(
    estimator: Any, rewards: torch.Tensor, mask: torch.Tensor, groups: list[str], episode_of: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """A group estimator over one score per episode, each segment given its episode's advantage."""
    n_episodes = max(episode_of) + 1
    of = torch.tensor(episode_of)
    first: dict[int, int] = {}
    for i, e in enumerate(episode_of):
        first.setdefault(e, i)
    # Segments share the reward. Shaping that differs per segment is combined: token rewards (a KL
    # penalty in the reward) add up over the episode, per-sequence scores (overlong penalty) average.
    total = rewards.float().sum(-1) if rewards.dim() == 2 else rewards.float()
    per_episode = total.new_zeros(n_episodes).index_add(0, of, total)
    if rewards.dim() == 1:
        per_episode = per_episode / torch.bincount(of, minlength=n_episodes).float()
    adv, _ = estimator(per_episode, torch.ones(n_episodes, 1), [groups[first[e]] for e in range(n_episodes)])
    advantages = adv[:, 0][of].unsqueeze(-1) * mask.to(adv.dtype)
    return advantages, advantages


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


def _rollout_mismatch(
    metrics: dict[str, float],
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    algorithm: Any,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Record the rollout/trainer mismatch metrics; return (importance weights or None, loss mask)."""
    mode = "tis" if algorithm.rollout_is == "none" else algorithm.rollout_is.replace("_", "-")
    is_weights, loss_mask, is_metrics = algos.rollout_correction(
        old_logprobs, rollout_logprobs, mask, mode=mode,
        low=1.0 / algorithm.rollout_is_cap, high=algorithm.rollout_is_cap,
    )  # fmt: skip
    metrics.update({f"rollout/{k}": float(v) for k, v in is_metrics.items()})
    metrics["rollout/logprob_abs_diff"] = algos.masked_mean((old_logprobs - rollout_logprobs).abs(), mask).item()
    if algorithm.rollout_is == "none":
        return None, mask
    return is_weights, loss_mask


def train_step(
    backend: TrainerBackend,
    trajectories: Sequence[Trajectory],
    algorithm: Any,
    trainer: Any,
    *,
    temperature: float = 1.0,
    max_response_tokens: int | None = None,
    kl_controller: algos.FixedKLController | algos.AdaptiveKLController | None = None,
) -> dict[str, float]:
    """Train the backend's policy (and critic) on one batch; return the step's metrics.

    `algorithm` is an `AlgorithmConfig`, `trainer` a `TrainerConfig` (`ppo_epochs`,
    `mini_batches`). `temperature` is the rollout sampling temperature (logprobs are scored at
    it). `max_response_tokens` is the response length limit: the DAPO overlong penalty needs it,
    and `seq-mean-token-sum-norm` divides by it (by the batch's longest response when None).
    `kl_controller` (from `make_kl_controller`, kept by the caller across steps and saved with its
    checkpoints) gives this step's KL coefficient and is updated at the end; it is required when
    `algorithm.kl_target` is set, and without it the coefficient is `algorithm.kl_coef`.
    """
    if algorithm.kl_target is not None and (kl_controller is None or algorithm.kl_coef <= 0):
        raise ConfigError(
            "algorithm.kl_target needs algorithm.kl_coef > 0 (the starting coefficient) and a "
            "kl_controller=make_kl_controller(algorithm) kept across train_step calls."
        )
    kl_coef = kl_controller.value if kl_controller is not None else algorithm.kl_coef
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
    if algorithm.stop_properly_penalty is not None:
        stopped = torch.tensor([t.finish_reason != FinishReason.MAX_LENGTH for t in trajs])
        scores = algos.stop_properly_penalty(scores, stopped, coef=algorithm.stop_properly_penalty)
        metrics["reward/truncated_fraction"] = 1.0 - stopped.float().mean().item()
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
    # On-policy shortcut (see `objective`): one optimizer step on this batch and nothing needs
    # the old logprobs before it, so the update's forward scores them.
    in_update = (
        trainer.score_in_update
        and backend.scores_in_update
        and trainer.ppo_epochs == 1
        and trainer.mini_batches == 1
        and algorithm.rollout_is in ("none", "tis")
        and not (algorithm.kl_coef > 0 and algorithm.kl_in_reward)
    )
    old_logprobs = None if in_update else backend.compute_logprobs(trajs, temperature=temperature)
    metrics["batch/scored_in_update"] = float(in_update)
    ref_logprobs = None
    if algorithm.kl_coef > 0:
        ref_logprobs = backend.compute_ref_logprobs(trajs, temperature=temperature)
    rewards: torch.Tensor = scores
    current_kl = None
    if ref_logprobs is not None:
        metrics["actor/kl_coef"] = kl_coef
    if ref_logprobs is not None and old_logprobs is not None:
        shaped, kl_metrics = algos.apply_kl_penalty(
            _on_last_token(scores, mask), old_logprobs, ref_logprobs, mask,
            kl_coef=kl_coef, kind=algorithm.kl_estimator,
        )  # fmt: skip
        current_kl = kl_metrics["kl"].item()
        if algorithm.kl_in_reward:
            rewards = shaped
            metrics["actor/kl_in_reward"] = current_kl

    # ── advantages ──────────────────────────────────────────────────────────────────────────
    estimator = ADVANTAGE_ESTIMATORS.resolve(algorithm.advantage)
    kwargs: dict[str, Any] = {}
    values = None
    if algorithm.advantage == "gae":
        values = backend.compute_values(trajs)
        kwargs = {"values": values, "gamma": algorithm.gamma, "lam": algorithm.lam}
    elif algorithm.advantage == "reinforce_pp":
        kwargs = {"gamma": algorithm.gamma}
    episode_of = _episode_index(trajs)
    if episode_of is not None and algorithm.advantage in _PER_EPISODE_ESTIMATORS:
        advantages, returns = _per_episode_advantages(estimator, rewards, mask, groups, episode_of)
        metrics["batch/segments"] = float(len(trajs))
        metrics["batch/episodes"] = float(max(episode_of) + 1)
    else:
        advantages, returns = estimator(rewards, mask, groups, **kwargs)
    metrics.update(_stats("adv", advantages, mask))
    if values is not None:
        metrics.update(_stats("critic/returns", returns, mask))

    # ── rollout / trainer mismatch ──────────────────────────────────────────────────────────
    is_weights, loss_mask = None, mask
    if old_logprobs is not None:
        is_weights, loss_mask = _rollout_mismatch(metrics, old_logprobs, rollout_logprobs, mask, algorithm)

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
    # Rows whose loss and gradient are exactly zero (`trainer.zero_advantage_rows`): every loss
    # token has advantage 0 and the loss has no entropy or KL term that would still move them.
    skip_rows = None
    if (
        trainer.zero_advantage_rows != "train"
        and not algorithm.entropy_coef
        and not (algorithm.kl_coef > 0 and not algorithm.kl_in_reward)
    ):
        skip_rows = ~((advantages != 0) & (loss_mask > 0)).any(-1)
        policy_batch.skip_rows = skip_rows
        policy_batch.score_skipped = trainer.zero_advantage_rows == "score"
        metrics["batch/zero_adv_skipped"] = float(skip_rows.sum().item())
    metrics["batch/loss_tokens"] = float(loss_mask.sum().item())
    tokens = sum(len(t.token_ids) for t in trajs)
    metrics["batch/tokens"] = float(tokens)

    updates: list[dict[str, float]] = []
    update_start = time.perf_counter()
    # The backends read the loss's KL weight from the config: hand them this step's coefficient.
    step_algorithm = (
        algorithm if kl_coef == algorithm.kl_coef else algorithm.model_copy(update={"kl_coef": kl_coef})
    )
    for _ in range(trainer.ppo_epochs):
        for idx in mini_batch_indices(len(trajs), trainer.mini_batches):
            mini = policy_batch if in_update else policy_batch.select(idx)
            result = {f"actor/{k}": v for k, v in backend.update_policy(mini, step_algorithm).items()}
            if critic_batch is not None:
                result.update(backend.update_critic(critic_batch.select(idx), algorithm))
            updates.append(result)
    update_s = time.perf_counter() - update_start
    if in_update:
        # The update scored the old logprobs (zeros if it skipped an all-masked batch).
        old_logprobs = policy_batch.old_logprobs
        if old_logprobs is None:
            old_logprobs = torch.zeros_like(rollout_logprobs)
        scored = mask  # rows left out entirely (`skip`) have no old logprobs: they read 0
        if skip_rows is not None and not policy_batch.score_skipped:
            scored = mask * (~skip_rows)[:, None]
        if scored.sum() > 0:
            _rollout_mismatch(metrics, old_logprobs, rollout_logprobs, scored, algorithm)
            if ref_logprobs is not None:
                _, kl_metrics = algos.apply_kl_penalty(
                    torch.zeros_like(scored), old_logprobs, ref_logprobs, scored, kl_coef=kl_coef,
                    kind=algorithm.kl_estimator,
                )  # fmt: skip
                current_kl = kl_metrics["kl"].item()
    for name in sorted({k for u in updates for k in u}):
        seen = [u[name] for u in updates if name in u]
        pick = max if name.endswith("_max") else min if name.endswith("_min") else None
        metrics[name] = pick(seen) if pick else sum(seen) / len(seen)
    metrics["actor/updates"] = float(len(updates))
    if kl_controller is not None and current_kl is not None:
        kl_controller.update(current_kl, n_steps=len(trajs))
        metrics["actor/kl_coef_next"] = kl_controller.value
    metrics["perf/update_tokens_per_s"] = tokens * trainer.ppo_epochs / max(update_s, 1e-9)
    step_s = time.perf_counter() - start
    metrics["perf/step_s"] = step_s
    metrics["perf/step_tokens_per_s"] = tokens / max(step_s, 1e-9)
    return metrics
