"""The loss of one packed micro-batch for the objectives that learn from rows, not rewards: SFT and the DPO family.

`objective.policy_objective` hands a micro-batch here when `algorithm.objective` is not `rl`, so the
backends' update loop (micro-batches, gradient accumulation against the whole mini-batch's
normaliser, clipping, the optimizer step, metrics over ranks) is the one RL uses; nothing else of
the RL loss runs (no ratio, clipping, KL, entropy bonus or rollout correction).

- `sft`: `offline_losses.sft_loss` on the micro-batch's assistant tokens, normalised by the
  mini-batch's count (`loss_agg`), so the micro-batches add up to the mini-batch's NLL.
- `dpo`, `ipo`, `dpo_norm`: the step (`offline_step.preference_step`) has already scored the pairs
  and put each completion's weight dL/ds (`offline_losses.preference_weights`, the mean over pairs
  included) on its tokens as `advantages` (negated, as an advantage is); the micro-batch loss is
  `-sum_t advantages_t * logp_t` over its loss tokens, whose gradient summed over micro-batches and
  ranks is the preference loss's. Its value is not the preference loss (the step reports that).
"""

from __future__ import annotations

import torch

from agentrl.config import AlgorithmConfig
from agentrl.trainer import algos
from agentrl.trainer.offline_losses import sft_loss

__all__ = ["offline_objective"]


def offline_objective(
    logprobs: torch.Tensor,
    tokens: dict[str, torch.Tensor],
    algorithm: AlgorithmConfig,
    *,
    denominator: float,
    entropy: torch.Tensor | None = None,
    max_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, metrics) of one `(1, N)` micro-batch under `algorithm.objective` (see the module)."""
    mask = tokens["loss_mask"]
    if algorithm.objective == "sft":
        loss, metrics = sft_loss(logprobs, mask, loss_agg_mode=algorithm.loss_agg, max_len=max_len,
                                 segment_ids=tokens["segment_ids"], denominator=denominator)
        metrics["loss"] = loss.detach()
    else:
        loss = -algos.masked_sum(tokens["advantages"] * logprobs, mask)
        metrics = {"nll": algos.masked_mean(-logprobs.detach(), mask)}
    if entropy is not None:
        metrics["entropy"] = algos.masked_mean(entropy.detach(), mask)
    return loss, metrics
