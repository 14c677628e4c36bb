"""The on-policy mismatch gate: which sequences of a batch are too far off-policy to train on.

`gate_sequences` reads only the token ledger (`Trajectory`: rollout logprobs, policy versions, the
chat-template mismatches `rollout.verify_template` counted) and the trainer's old logprobs, and
computes per sequence, over its sampled tokens (those sampled by the version being trained, when
the step says which; older ones differ by the policy's own change): the max and mean |rollout -
trainer| logprob gap, the spread (max - min) of the log importance ratios and their normalised effective sample size
(ESS, 1 when every ratio is equal); per batch, the ESS over the sequences it keeps; and how many
tokens carry a policy version outside the window the run's staleness allows. A sequence over a
threshold of `algorithm.mismatch_gate` gets a reason (the first figure that tripped, in the order
of `GATE_REASONS`), and the step masks it out of the loss.

The gate decides per sequence only; whether a step with too many gated sequences stops the run is
the orchestration's call (`agentrl.orchestration.onpolicy_gate`). The per-sequence decisions travel
back typed, as the `gated` rows of the step's `agentrl.types.StepReport` (`GatedRow`: which row,
why, its figures); the metrics carry only the batch's numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from agentrl.config import MismatchGateConfig
from agentrl.types import GATE_REASONS, GatedRow, GateReason, Trajectory

__all__ = ["GateDecision", "gate_sequences"]


@dataclass
class GateDecision:
    """The gate's verdict on a batch of `rows` sequences: the gated ones (`GatedRow`, by row) and
    the batch's figures as metrics (numbers only)."""

    rows: int
    gated: list[GatedRow] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def reasons(self) -> list[GateReason | None]:
        """Per row of the batch: why it is gated (None: kept)."""
        out: list[GateReason | None] = [None] * self.rows
        for g in self.gated:
            out[g.row] = g.reason
        return out

    @property
    def keep(self) -> torch.Tensor:
        """(B,) 1.0 for kept rows, 0.0 for gated ones."""
        return torch.tensor([0.0 if r else 1.0 for r in self.reasons])


def _ess(log_ratios: torch.Tensor) -> float:
    """Normalised ESS (sum w)^2 / (n sum w^2) of weights exp(log_ratios), computed stably."""
    if log_ratios.numel() == 0:
        return 1.0
    w = torch.exp(log_ratios.double() - log_ratios.double().max())
    return float(w.sum() ** 2 / (w.numel() * (w * w).sum()))


def gate_sequences(
    trajectories: Sequence[Trajectory], old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
    mask: torch.Tensor, config: MismatchGateConfig, *, policy_version: int | None = None,
    allowed_staleness: int = 0,
) -> GateDecision:  # fmt: skip
    """Gate the rows of a padded batch (module docstring). `mask` (B, L) is 1 on sampled tokens;
    `policy_version` is the trainer version this step trains at (None: versions are not checked),
    and a token may be at most `allowed_staleness` versions older than it."""
    figures_of: list[dict[str, float]] = []  # per row: its figures, GatedRow's fields
    reasons: list[GateReason | None] = []
    stale_tokens = 0
    log_ratio_all = (old_logprobs.float() - rollout_logprobs.float()).detach()
    width = mask.shape[1]
    used: list[torch.Tensor] = []  # per row, the positions the figures are computed over
    for i, t in enumerate(trajectories):
        row = mask[i] > 0
        if policy_version is not None:
            # Engine and trainer can only agree where they had the same weights: a token sampled by an
            # older version (as async modes allow) differs by the policy's own change, which the IS
            # correction weighs. Position j of the padded batch scores token j + 1.
            shifted = torch.tensor([*t.versions[1:], -1][:width] + [-1] * max(0, width - len(t.versions)))
            row = row & (shifted == policy_version)
        used.append(row)
        r = log_ratio_all[i][row]
        stale = 0
        if policy_version is not None:
            low = policy_version - allowed_staleness
            stale = sum(1 for v, m in zip(t.versions, t.response_mask, strict=True)
                        if m and not low <= v <= policy_version)
            stale_tokens += stale
        figures = {
            "logprob_gap": float(r.abs().max()) if r.numel() else 0.0,
            "mean_logprob_gap": float(r.abs().mean()) if r.numel() else 0.0,
            "log_ratio_spread": float(r.max() - r.min()) if r.numel() else 0.0,
            "ess": _ess(r),
            "out_of_window_tokens": stale,
            "template_mismatches": float(t.metrics.get("template_mismatch", 0.0)),
        }
        figures_of.append(figures)
        tripped = {
            "template": figures["template_mismatches"] > config.max_template_mismatches,
            "version": stale > 0,
            "logprob_gap": figures["logprob_gap"] > config.max_logprob_gap,
            "mean_logprob_gap": figures["mean_logprob_gap"] > config.max_mean_logprob_gap,
            "log_ratio_spread": figures["log_ratio_spread"] > config.max_log_ratio_spread,
            "ess": figures["ess"] < config.min_ess,
        }
        reasons.append(next((name for name in GATE_REASONS if tripped[name]), None))
    # The batch's ESS over the sequences still kept: weights piled on a few sequences gate them all.
    kept_rows = [i for i, reason in enumerate(reasons) if reason is None]
    batch_ess = 1.0
    if kept_rows:
        seq_log_ratio = torch.stack([log_ratio_all[i][used[i]].sum() for i in kept_rows])
        batch_ess = _ess(seq_log_ratio)
        if batch_ess < config.min_ess:
            for i in kept_rows:
                reasons[i] = "ess"
    gated = [GatedRow(row=i, reason=reason, logprob_gap=f["logprob_gap"], mean_logprob_gap=f["mean_logprob_gap"],
                      log_ratio_spread=f["log_ratio_spread"], ess=f["ess"],
                      out_of_window_tokens=int(f["out_of_window_tokens"]), template_mismatches=f["template_mismatches"])
             for i, (reason, f) in enumerate(zip(reasons, figures_of, strict=True)) if reason is not None]
    metrics: dict[str, float] = {
        "onpolicy/gated_sequences": float(len(gated)),
        "onpolicy/gated_share": len(gated) / max(1, len(reasons)),
        "onpolicy/logprob_gap_max": max((f["logprob_gap"] for f in figures_of), default=0.0),
        "onpolicy/mean_logprob_gap_max": max((f["mean_logprob_gap"] for f in figures_of), default=0.0),
        "onpolicy/log_ratio_spread_max": max((f["log_ratio_spread"] for f in figures_of), default=0.0),
        "onpolicy/ess_min": min((f["ess"] for f in figures_of), default=1.0),
        "onpolicy/batch_ess": batch_ess,
    }
    if policy_version is not None:
        metrics["onpolicy/out_of_window_tokens"] = float(stale_tokens)
    for name in GATE_REASONS:
        metrics[f"onpolicy/gated_sequences/{name}"] = float(sum(r == name for r in reasons))
    return GateDecision(len(reasons), gated, metrics)
