"""What a run does with the trainer's on-policy gate: ledger the gated sequences, stop when too many trip.

The trainer (`agentrl.trainer.mismatch_gate`) masks each sequence whose rollout logprobs, template
re-render or policy versions do not match, and reports each masked row typed, in the step's
`StepReport.gated` (`agentrl.types.GatedRow`: which row, why, its figures). Here, after each update:
`gated_groups` turns those rows into the text each prompt's ledger line carries (`trained`, with "gated: 1 of 4 sequences
(template)"), and `check_gated_share` stops the run with `OnPolicyMismatchError` when more than
`algorithm.mismatch_gate.max_gated_share` of the step's sequences tripped, or when the trainer's
kept-set disagreement (`onpolicy/kept_set_disagreement`, reported by kept-set replay) is over its
threshold. The message names the likely cause from the figure that tripped and the command that
checks the configuration, `agentrl check onpolicy RUN_DIR/config.yaml`. `allowed_staleness` is
how many policy versions older than the trained version a sampled token may be, as the run's mode
decides it. This module computes nothing from tensors and starts nothing.
"""

from __future__ import annotations

import shlex
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from agentrl.config import AgentRLConfig
from agentrl.errors import AgentRLError
from agentrl.types import GATE_REASONS, GatedRow

__all__ = [
    "LIKELY_CAUSES",
    "OnPolicyMismatchError",
    "allowed_staleness",
    "check_command",
    "check_gated_share",
    "gated_groups",
]

KEPT_SET_METRIC = "onpolicy/kept_set_disagreement"

LIKELY_CAUSES: dict[str, str] = {
    "template": "template re-tokenisation: re-rendering the conversation with the chat template does not give "
                "the tokens the model sampled and saw (model.chat_template, or the tokenizer, differs from "
                "what the server renders)",
    "version": "stale cache / version: sampled tokens carry a policy version outside what the run's staleness "
               "allows (a server kept old weights or served a stale prefix cache after a weight push)",
    "logprob_gap": "sampling settings: some sampled tokens are far less likely under the trainer than the "
                   "engine said (top_p/top_k/min_p truncation or temperature not replayed by the trainer, or "
                   "a different model on the server)",
    "mean_logprob_gap": "dtype: every token's logprob is off a little (the engine and the trainer compute in "
                        "different precision: model.dtype, the server's dtype)",
    "log_ratio_spread": "dtype or sampling settings: the per-token importance ratios spread wide",
    "ess": "dtype or sampling settings: the importance weights pile on a few tokens or sequences (low "
           "effective sample size)",
    "kept_set": "sampling settings: sampled tokens fall outside the trainer's own kept set (top_p/top_k/min_p "
                "differ between the engine and the trainer's kept-set replay)",
}


class OnPolicyMismatchError(AgentRLError):
    """Too many of a step's sequences failed the on-policy gate: training on them would be off-policy."""


def allowed_staleness(config: AgentRLConfig) -> int:
    """Versions a sampled token may lag the trained version: 0 in `sync`, 1 in `one_step_off`,
    `run.max_staleness` in `async` (the scheduler's bound)."""
    mode = config.run.mode
    return 0 if mode == "sync" else 1 if mode == "one_step_off" else config.run.max_staleness


def check_command(run_dir: str | Path) -> str:
    """The conformance check of the run's own resolved config (which carries every override)."""
    return shlex.join(["agentrl", "check", "onpolicy", str(Path(run_dir) / "config.yaml")])


def gated_groups(group_sizes: Sequence[int], gated: Sequence[GatedRow]) -> list[str]:
    """Per group (the batch's rows are the groups' trajectories in order): the ledger text for the
    sequences the gate masked (`StepReport.gated`), "" where none was."""
    reason_of = {g.row: g.reason for g in gated}
    out: list[str] = []
    start = 0
    for size in group_sizes:
        reasons = Counter(reason_of[i] for i in range(start, start + size) if i in reason_of)
        n = sum(reasons.values())
        out.append(f"gated: {n} of {size} sequences masked out of the loss ("
                   + ", ".join(f"{r} {c}" for r, c in sorted(reasons.items())) + ")" if n else "")
        start += size
    return out


def check_gated_share(config: AgentRLConfig, metrics: dict[str, float], step: int, run_dir: str | Path) -> None:
    """Raise `OnPolicyMismatchError` when the step's gated share or kept-set disagreement is over its
    threshold (module docstring); the message names the likely cause and the check command."""
    gate = config.algorithm.mismatch_gate
    if not gate.enabled:
        return
    share, max_share = metrics.get("onpolicy/gated_share"), gate.max_gated_share
    disagreement, max_disagreement = metrics.get(KEPT_SET_METRIC), gate.max_kept_set_disagreement
    counts = {r: int(metrics.get(f"onpolicy/gated_sequences/{r}", 0)) for r in GATE_REASONS}
    if disagreement is not None and disagreement > max_disagreement:
        cause, what = "kept_set", (f"{disagreement:.3f} of the sampled tokens are outside the trainer's kept set "
                                   f"(algorithm.mismatch_gate.max_kept_set_disagreement={max_disagreement:g})")
    elif share is not None and share > max_share:
        cause = max(counts, key=lambda r: counts[r])
        total = int(metrics.get("onpolicy/gated_sequences", 0))
        what = (f"{total} of {int(metrics.get('batch/trajectories', 0)) or '?'} sequences ({share:.0%}) failed the "
                f"on-policy gate, more than algorithm.mismatch_gate.max_gated_share={max_share:g} "
                f"(by figure: {', '.join(f'{r} {c}' for r, c in counts.items() if c)}; largest token gap "
                f"{metrics.get('onpolicy/logprob_gap_max', 0.0):.3g}, largest mean gap "
                f"{metrics.get('onpolicy/mean_logprob_gap_max', 0.0):.3g}, batch ESS "
                f"{metrics.get('onpolicy/batch_ess', 1.0):.3g})")
    else:
        return
    raise OnPolicyMismatchError(
        f"Step {step}: {what}. Likely cause: {LIKELY_CAUSES[cause]}. Training on these sequences would be "
        f"off-policy, so the run stops. Check the configuration with: {check_command(run_dir)} "
        "(docs/onpolicy.md explains each check); fix what it reports, or raise the threshold in "
        "algorithm.mismatch_gate if the gap is expected."
    )
