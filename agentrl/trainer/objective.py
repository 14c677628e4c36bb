"""The loss of one packed micro-batch, assembled from `algos` the way `AlgorithmConfig` says.

A backend runs the model and calls `policy_objective` (or `critic_objective`) with the per-token
tensors of one packed micro-batch, shape `(1, tokens)`, and the count the whole mini-batch is
normalised by, so that the micro-batch losses of every rank add up to the mini-batch loss (see
`algos.aggregate_loss`). Returned metrics are masked means over the micro-batch's own tokens plus
extremes; `MetricSums` weights them by token counts so a backend can combine micro-batches and
ranks exactly. No model, optimizer or process group lives here.

On-policy shortcut: when a batch is used for exactly one optimizer step, the policy that sampled
it (after the rollout engine) is the one being updated, so the "old" logprobs equal the update
forward's own logprobs. `PolicyBatch.old_logprobs` is then None: `policy_objective` takes
`logprobs.detach()` as the old logprobs (the PPO ratio is exactly 1) and forms the TIS weights
from them and the rollout logprobs, and the update returns the detached logprobs (`ScoredRows`,
`UpdateResult.old_logprobs`) so the step reports the same mismatch metrics as with a separate
scoring pass.
That saves one forward over the whole batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypedDict

import torch

from agentrl.config import AlgorithmConfig
from agentrl.trainer import algos
from agentrl.trainer.offline_objective import offline_objective
from agentrl.trainer.packing import PackedBatch
from agentrl.types import Trajectory

__all__ = [
    "AllReduce",
    "MetricSums",
    "ScoredRows",
    "critic_objective",
    "loss_denominator",
    "policy_objective",
    "zero_loss_rows",
]

AllReduce = Callable[[torch.Tensor, str], None]
"""`all_reduce(tensor, op)`: combine `tensor` in place over ranks, `op` "sum" or "max"."""


class _Aggregation(TypedDict):
    """How the `algos` losses aggregate one micro-batch (their shared keyword arguments)."""

    loss_agg_mode: str
    max_len: int | None
    segment_ids: torch.Tensor
    denominator: float


# Metrics combined by max / min instead of a token-weighted mean.
_MAX_METRICS = ("ratio_max",)
_MIN_METRICS = ("ratio_min",)
# Metrics that are already a share of the mini-batch loss: summed, not averaged.
_SUM_METRICS = ("pg_loss", "kl_loss", "entropy_loss", "vf_loss", "loss")


def loss_denominator(loss_mask: torch.Tensor, mode: str) -> float:
    """What a mini-batch is normalised by: its loss tokens (`token-mean`) or its sequences with at
    least one loss token (the `seq-mean-*` modes). `loss_mask` is `(batch, max_len)`."""
    if mode == "token-mean":
        return float(loss_mask.sum().item())
    return float((loss_mask.sum(-1) > 0).sum().item())


def zero_loss_rows(advantages: torch.Tensor, loss_mask: torch.Tensor, algorithm: AlgorithmConfig) -> torch.Tensor | None:
    """(batch,) bool: the trajectories whose policy loss and gradient are exactly zero, because
    every loss token has advantage 0 (a GRPO group whose rewards are all equal); None when the
    loss has another term that still moves them (an entropy bonus, a KL loss)."""
    if algorithm.objective == "sft" or algorithm.entropy_coef or (algorithm.kl_coef > 0 and not algorithm.kl_in_reward):
        return None
    return ~((advantages != 0) & (loss_mask > 0)).any(-1)


def policy_objective(
    logprobs: torch.Tensor,
    tokens: dict[str, torch.Tensor],
    algorithm: AlgorithmConfig,
    *,
    denominator: float,
    entropy: torch.Tensor | None = None,
    max_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Policy loss (+ KL loss, - entropy bonus) of one micro-batch and its metrics
    (with `algorithm.objective` other than `rl`, `offline_objective.offline_objective`'s instead).

    `tokens` holds `loss_mask`, `advantages`, `old_logprobs`, `segment_ids` and optionally
    `ref_logprobs` and `is_weights`, all `(1, N)`. `entropy` is required when
    `algorithm.entropy_coef` is non-zero (and then must carry a gradient); otherwise it is only
    reported. GSPO takes no token importance weights: with it the rollout correction acts only
    through `loss_mask` (the tokens or sequences it masked out).

    Without `old_logprobs` (the on-policy shortcut, see the module) they are `logprobs.detach()`,
    and with `algorithm.rollout_is == "tis"` the importance weights are the TIS weights of those
    against `tokens["rollout_logprobs"]`; masking corrections (ICEPOP, seq-mask-TIS) change the
    loss's normaliser, so they need the old logprobs before the update and are refused here.
    """
    if algorithm.objective != "rl":  # SFT and the DPO family: their own micro-batch loss, same update loop
        return offline_objective(logprobs, tokens, algorithm, denominator=denominator, entropy=entropy, max_len=max_len)
    mask = tokens["loss_mask"]
    if tokens.get("old_logprobs") is None:
        tokens = {**tokens, "old_logprobs": logprobs.detach()}
        if algorithm.rollout_is not in ("none", "tis"):
            raise ValueError(
                f"algorithm.rollout_is='{algorithm.rollout_is}' masks tokens by the old logprobs, which "
                "must then be scored before the update; pass old_logprobs (train_step does)."
            )
        if algorithm.rollout_is == "tis":
            cap = algorithm.rollout_is_cap
            weights, _, _ = algos.rollout_correction(
                tokens["old_logprobs"], tokens["rollout_logprobs"], mask, mode="tis", low=1.0 / cap, high=cap
            )
            tokens["is_weights"] = weights
    seg = tokens["segment_ids"]
    agg = _Aggregation(loss_agg_mode=algorithm.loss_agg, max_len=max_len, segment_ids=seg, denominator=denominator)
    if algorithm.policy_loss == "gspo":
        loss, metrics = algos.gspo_policy_loss(
            logprobs, tokens["old_logprobs"], tokens["advantages"], mask,
            clip_low=algorithm.clip_low, clip_high=algorithm.clip_high, **agg,
        )  # fmt: skip
    else:
        loss, metrics = algos.ppo_policy_loss(
            logprobs, tokens["old_logprobs"], tokens["advantages"], mask,
            clip_low=algorithm.clip_low, clip_high=algorithm.clip_high, clip_c=algorithm.dual_clip_c,
            is_weights=tokens.get("is_weights"), **agg,
        )  # fmt: skip
    metrics = {k: v.detach() for k, v in metrics.items()}
    log_ratio = (logprobs.detach() - tokens["old_logprobs"]).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    has = mask.sum() > 0
    metrics["ratio_max"] = torch.where(has, torch.where(mask > 0, ratio, 0.0).max(), 1.0)
    metrics["ratio_min"] = torch.where(has, torch.where(mask > 0, ratio, float("inf")).min(), 1.0)
    metrics["ratio_mean"] = algos.masked_mean(ratio, mask)
    total = loss
    if entropy is not None:
        metrics["entropy"] = algos.masked_mean(entropy.detach(), mask)
    if algorithm.entropy_coef:
        if entropy is None:
            raise ValueError("algorithm.entropy_coef is non-zero but no entropy was computed for the loss.")
        entropy_loss = algos.aggregate_loss(
            entropy, mask, algorithm.loss_agg, max_len=max_len, segment_ids=seg, denominator=denominator
        )
        total = total - algorithm.entropy_coef * entropy_loss
        metrics["entropy_loss"] = entropy_loss.detach()
    ref = tokens.get("ref_logprobs")
    if ref is not None:
        kl_tok = algos.kl_penalty(logprobs.detach(), ref, algorithm.kl_estimator)
        metrics["kl_ref"] = algos.masked_mean(kl_tok, mask)
        if algorithm.kl_coef > 0 and not algorithm.kl_in_reward:
            kl = algos.kl_loss(logprobs, ref, mask, kind=algorithm.kl_estimator, **agg)
            total = total + algorithm.kl_coef * kl
            metrics["kl_loss"] = kl.detach()
    metrics["loss"] = total.detach()
    return total, metrics


def critic_objective(
    values: torch.Tensor,
    tokens: dict[str, torch.Tensor],
    algorithm: AlgorithmConfig,
    *,
    denominator: float,
    max_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss of one micro-batch; `tokens` holds `loss_mask`, `returns`,
    `old_values`, `segment_ids`."""
    mask = tokens["loss_mask"]
    loss, metrics = algos.value_loss(
        values, tokens["old_values"], tokens["returns"], mask,
        clip_range=algorithm.value_clip, loss_agg_mode=algorithm.loss_agg, max_len=max_len,
        segment_ids=tokens["segment_ids"], denominator=denominator,
    )  # fmt: skip
    metrics = {k: v.detach() for k, v in metrics.items()}
    metrics["values_mean"] = algos.masked_mean(values.detach(), mask)
    return loss, metrics


class ScoredRows:
    """Per-token values of packed micro-batches put back into `(batch, max_len)` rows.

    `add(packed, values)` writes a micro-batch's `(1, N)` (or `(N,)`) values into the rows its
    `indices` name (`PackedBatch.scatter`: shared prefixes go to every trajectory that has them,
    each sequence's last position, which predicts nothing, is kept 0); `result`
    sums over ranks with `all_reduce(tensor, op)` when given (each row is written by one rank).
    """

    def __init__(self, trajectories: Sequence[Trajectory]) -> None:
        width = max((len(t.token_ids) for t in trajectories), default=0)
        self.rows = torch.zeros((len(trajectories), width), dtype=torch.float32)

    def add(self, packed: PackedBatch, values: torch.Tensor) -> None:
        packed.scatter(values, self.rows)

    def result(self, all_reduce: AllReduce | None = None) -> torch.Tensor:
        if all_reduce is not None:
            all_reduce(self.rows, "sum")
        return self.rows


@dataclass
class MetricSums:
    """Combines micro-batch metrics: token-weighted means, sums of loss shares, max and min."""

    weighted: dict[str, float] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    extreme: dict[str, float] = field(default_factory=dict)

    def add(self, metrics: dict[str, torch.Tensor], tokens: float) -> None:
        for name, value in metrics.items():
            v = float(value)
            if name in _MAX_METRICS or name in _MIN_METRICS:
                if tokens > 0:
                    pick = max if name in _MAX_METRICS else min
                    self.extreme[name] = pick(self.extreme.get(name, v), v)
            elif name in _SUM_METRICS:
                self.weighted[name] = self.weighted.get(name, 0.0) + v
                self.weights[name] = 1.0
            else:
                self.weighted[name] = self.weighted.get(name, 0.0) + v * tokens
                self.weights[name] = self.weights.get(name, 0.0) + tokens

    def reduce(self, all_reduce: AllReduce | None = None, *, loss_scale: float = 1.0) -> dict[str, float]:
        """The combined metrics; `all_reduce(tensor, op)` (if given) combines ranks in place.
        `loss_scale` multiplies the loss shares (the normaliser they were divided by, corrected).

        Every rank must hold the same metric names (they run the same objective)."""
        names = sorted(self.weighted)
        sums = torch.tensor(
            [self.weighted[n] for n in names] + [self.weights[n] for n in names], dtype=torch.float64
        )
        if all_reduce is not None:
            all_reduce(sums, "sum")
        out = {}
        for i, n in enumerate(names):
            w = sums[len(names) + i].item()
            if n in _SUM_METRICS:
                out[n] = sums[i].item() * loss_scale
            elif w > 0:  # a mean over no token (every row skipped) is left out, not reported as 0
                out[n] = sums[i].item() / w
        for n in sorted(set(_MAX_METRICS) | set(_MIN_METRICS)):
            big = float("inf")
            local = self.extreme.get(n, -big if n in _MAX_METRICS else big)
            t = torch.tensor([local if n in _MAX_METRICS else -local], dtype=torch.float64)
            if all_reduce is not None:
                all_reduce(t, "max")
            value = t.item() if n in _MAX_METRICS else -t.item()
            if abs(value) != big:
                out[n] = value
        return out
