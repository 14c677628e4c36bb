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

Two ways to the same decision: `gate_sequences` gates a padded batch whose old logprobs a scoring
pass gave before the update; `SequenceGate` is handed to a one-optimizer-step update, which judges
each micro-batch's rows from its own forward before their backward (every per-sequence figure
depends on its row alone) and decides the batch's ESS after the last one. Both compute the figures
and reasons with the same functions, so they agree wherever the logprobs do.

The gate decides per sequence only; whether a step with too many gated sequences stops the run is
the orchestration's call (`agentrl.orchestration.onpolicy_gate`). The per-sequence decisions travel
back typed, as the `gated` rows of the step's `agentrl.types.StepReport` (`GatedRow`: which row,
why, its figures); the metrics carry only the batch's numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from agentrl.config import MismatchGateConfig
from agentrl.errors import TrainerError
from agentrl.types import GATE_REASONS, GatedRow, GateReason, Trajectory

__all__ = ["GateDecision", "SequenceGate", "gate_sequences"]


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
    log_ratio_all = (old_logprobs.float() - rollout_logprobs.float()).detach()
    figures_of = [
        _row_figures(t, log_ratio_all[i], mask[i], policy_version, allowed_staleness)
        for i, t in enumerate(trajectories)
    ]
    return _decide(figures_of, config, policy_version)


class SequenceGate:
    """The gate decided inside a one-optimizer-step update, from the update's own forward.

    The update's forward gives exactly the old logprobs a separate scoring pass would, so the
    update loop asks `judge` about the rows of each micro-batch as soon as their logprobs exist,
    before that micro-batch's backward: every per-sequence figure and reason depends on its row
    alone. Only the batch's ESS needs every row; it can only gate all the rows still kept, which
    the loop learns from `decide` after the last backward (and then drops the step, as it does for
    a batch with no loss token). `decide` combines the rows judged on each rank and returns the
    `GateDecision` that `gate_sequences` gives on the same logprobs. Not for several optimizer
    steps per batch: after the first, the forward no longer sees the weights that the gate compares.
    """

    def __init__(
        self, trajectories: Sequence[Trajectory], rollout_logprobs: torch.Tensor, mask: torch.Tensor,
        config: MismatchGateConfig, *, policy_version: int | None = None, allowed_staleness: int = 0,
    ) -> None:  # fmt: skip
        self.trajectories = list(trajectories)
        self.rollout_logprobs = rollout_logprobs
        self.mask = mask
        self.config = config
        self.policy_version = policy_version
        self.allowed_staleness = allowed_staleness
        # Per row: its figures in `_FIGURES` order, then 1.0 once judged (summed over ranks in `decide`).
        self._rows = torch.zeros((len(self.trajectories), len(_FIGURES) + 1), dtype=torch.float64)
        self.keep = torch.ones(len(self.trajectories))
        """(B,) 1.0 for the rows kept so far, 0.0 for those a per-sequence figure gated."""

    def judge(self, rows: Sequence[int], old_logprobs: torch.Tensor) -> None:
        """Judge `rows` from `old_logprobs` (B, L), whose those rows hold the trainer's logprobs;
        a gated row reads 0 in `keep` from then on."""
        for i in rows:
            log_ratio = (old_logprobs[i].float() - self.rollout_logprobs[i].float()).detach()
            figures = _row_figures(self.trajectories[i], log_ratio, self.mask[i], self.policy_version,
                                   self.allowed_staleness)
            self._rows[i] = torch.tensor([*(figures[name] for name in _FIGURES), 1.0], dtype=torch.float64)
            self.keep[i] = 0.0 if _reason(figures, self.config) else 1.0

    def decide(self, all_reduce: Callable[[torch.Tensor, str], None] | None = None) -> GateDecision:
        """The batch's decision from every row judged on any rank (`all_reduce(tensor, "sum")`
        combines them; each row is judged on one rank). Every rank must call it alike."""
        rows = self._rows.clone()
        if all_reduce is not None:
            all_reduce(rows, "sum")
        missing = (rows[:, -1] != 1.0).nonzero().flatten().tolist()
        if missing:
            raise TrainerError(
                f"the update judged {len(self.trajectories) - len(missing)} of {len(self.trajectories)} rows "
                f"for the on-policy gate (row {missing[0]} never, or on several ranks); a backend must "
                "run every row's forward exactly once in an update with a gate, or score the old "
                "logprobs first (trainer.score_in_update=false)."
            )
        figures_of = [dict(zip(_FIGURES, row[:-1].tolist(), strict=True)) for row in rows]
        return _decide(figures_of, self.config, self.policy_version)


# ── the figures and the decision, shared by both ways of gating ─────────────────────────────────
_FIGURES = ("logprob_gap", "mean_logprob_gap", "log_ratio_spread", "ess", "out_of_window_tokens",
            "template_mismatches", "log_ratio_sum")  # fmt: skip


def _row_figures(
    t: Trajectory, log_ratio: torch.Tensor, mask: torch.Tensor, policy_version: int | None, allowed_staleness: int
) -> dict[str, float]:
    """One sequence's figures (GatedRow's fields, and the sum of its log ratios for the batch's ESS)
    from its row of log ratios (trainer - rollout) and of the loss mask."""
    width = mask.shape[0]
    row = mask > 0
    stale = 0
    if policy_version is not None:
        # Engine and trainer can only agree where they had the same weights: a token sampled by an
        # older version (as async modes allow) differs by the policy's own change, which the IS
        # correction weighs. Position j of the padded batch scores token j + 1.
        shifted = torch.tensor([*t.versions[1:], -1][:width] + [-1] * max(0, width - len(t.versions)))
        row = row & (shifted == policy_version)
        low = policy_version - allowed_staleness
        stale = sum(1 for v, m in zip(t.versions, t.response_mask, strict=True) if m and not low <= v <= policy_version)
    r = log_ratio[row]
    return {
        "logprob_gap": float(r.abs().max()) if r.numel() else 0.0,
        "mean_logprob_gap": float(r.abs().mean()) if r.numel() else 0.0,
        "log_ratio_spread": float(r.max() - r.min()) if r.numel() else 0.0,
        "ess": _ess(r),
        "out_of_window_tokens": float(stale),
        "template_mismatches": float(t.metrics.get("template_mismatch", 0.0)),
        "log_ratio_sum": float(r.sum()),
    }


def _reason(figures: dict[str, float], config: MismatchGateConfig) -> GateReason | None:
    """The first figure over its threshold, in the order of `GATE_REASONS` (None: kept)."""
    tripped = {
        "template": figures["template_mismatches"] > config.max_template_mismatches,
        "version": figures["out_of_window_tokens"] > 0,
        "logprob_gap": figures["logprob_gap"] > config.max_logprob_gap,
        "mean_logprob_gap": figures["mean_logprob_gap"] > config.max_mean_logprob_gap,
        "log_ratio_spread": figures["log_ratio_spread"] > config.max_log_ratio_spread,
        "ess": figures["ess"] < config.min_ess,
    }
    return next((name for name in GATE_REASONS if tripped[name]), None)


def _decide(figures_of: list[dict[str, float]], config: MismatchGateConfig, policy_version: int | None) -> GateDecision:
    """The batch's decision from every row's figures: each row's reason, then the batch's ESS."""
    reasons = [_reason(f, config) for f in figures_of]
    # The batch's ESS over the sequences still kept: weights piled on a few sequences gate them all.
    kept_rows = [i for i, reason in enumerate(reasons) if reason is None]
    batch_ess = 1.0
    if kept_rows:
        batch_ess = _ess(torch.tensor([figures_of[i]["log_ratio_sum"] for i in kept_rows], dtype=torch.float64))
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
        metrics["onpolicy/out_of_window_tokens"] = float(sum(f["out_of_window_tokens"] for f in figures_of))
    for name in GATE_REASONS:
        metrics[f"onpolicy/gated_sequences/{name}"] = float(sum(r == name for r in reasons))
    return GateDecision(len(reasons), gated, metrics)
