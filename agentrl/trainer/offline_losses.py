"""The supervised and preference losses as pure tensor functions: SFT, DPO, IPO, length-normalised DPO.

`sft_loss` is the negative log-likelihood of the assistant's tokens (the mask), averaged as
`algos.aggregate_loss` says (`token-mean`: over every assistant token of the batch).
`preference_loss` takes, per pair, the summed logprobs of the chosen and the rejected completion
under the policy and under the reference, and the completions' token counts, and returns the mean
loss over pairs of one of `PREFERENCE_OBJECTIVES`:

- `dpo` (Rafailov et al. 2023, TRL's `sigmoid`): h = beta * ((s_c - r_c) - (s_r - r_r)), loss -log sigmoid(h).
- `ipo` (Azar et al. 2023, as TRL computes it): the log-ratios are per-token means,
  h = (s_c - r_c) / n_c - (s_r - r_r) / n_r, loss (h - 1 / (2 beta))^2.
- `dpo_norm` (length-normalised DPO, the LN-DPO baseline of Meng et al. 2024): h = beta * ((s_c - r_c) / n_c
  - (s_r - r_r) / n_r), loss -log sigmoid(h).

`preference_weights` turns a preference loss into per-sequence weights: dL/ds for each
completion's summed policy logprob, at the current values. A sequence loss that depends on the
tokens only through the sums s has the gradient sum_t (dL/ds) dlogp_t/dtheta, so a micro-batch loss
`sum_t w * logp_t` over the completion's tokens, with `w` held constant, has exactly DPO's gradient
when `w` is taken at the parameters being differentiated: chosen and rejected completions need not
share a forward pass, a micro-batch or a rank. This module owns no model; `offline_step` runs them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from agentrl.trainer import algos

__all__ = ["PREFERENCE_OBJECTIVES", "preference_loss", "preference_weights", "sequence_logprobs", "sft_loss"]

PREFERENCE_OBJECTIVES = ("dpo", "ipo", "dpo_norm")


def sft_loss(
    logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    max_len: int | None = None,
    segment_ids: torch.Tensor | None = None,
    denominator: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Negative log-likelihood of the masked tokens, aggregated like the RL losses.

    `logprobs` and `mask` are `(batch, seq_len)` (or one packed `(1, N)` micro-batch with
    `segment_ids` and the mini-batch's `denominator`, see `algos.aggregate_loss`). Metrics: `nll`,
    the token-mean NLL of this call's tokens (for token-weighted combination across micro-batches)."""
    loss = algos.aggregate_loss(
        -logprobs, mask, loss_agg_mode, max_len=max_len, segment_ids=segment_ids, denominator=denominator
    )
    return loss, {"nll": algos.masked_mean(-logprobs.detach(), mask)}


def sequence_logprobs(logprobs: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed logprob, token count) of each row's masked tokens, each `(batch,)`."""
    return algos.masked_sum(logprobs, mask, dim=-1), mask.to(logprobs.dtype).sum(-1)


def _h(
    chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor,
    n_chosen: torch.Tensor, n_rejected: torch.Tensor, kind: str, beta: float,
) -> torch.Tensor:  # fmt: skip
    """The per-pair quantity each loss is a function of (module docstring)."""
    if kind == "dpo":
        return beta * ((chosen - ref_chosen) - (rejected - ref_rejected))
    per_token = (chosen - ref_chosen) / n_chosen.clamp(min=1) - (rejected - ref_rejected) / n_rejected.clamp(min=1)
    if kind == "ipo":
        return per_token
    if kind == "dpo_norm":
        return beta * per_token
    raise ValueError(f"Unknown preference objective '{kind}'; use one of {', '.join(PREFERENCE_OBJECTIVES)}.")


def preference_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    n_chosen: torch.Tensor,
    n_rejected: torch.Tensor,
    *,
    kind: str = "dpo",
    beta: float = 0.1,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean loss over pairs of `kind` (module docstring) and its metrics, all `(pairs,)` inputs.

    `chosen`/`rejected` are the policy's summed logprobs of each completion's loss tokens,
    `ref_*` the reference's, `n_*` the token counts. Metrics (means over pairs, detached):
    `margin` (the h of the loss: the implicit reward margin for `dpo`), `accuracy` (share of pairs
    with h > 0), `chosen_reward` and `rejected_reward` (beta times the summed log-ratio, TRL's
    `rewards/chosen`), `logp_margin` (s_c - s_r, the policy's own preference, no reference)."""
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}.")
    h = _h(chosen, rejected, ref_chosen, ref_rejected, n_chosen, n_rejected, kind, beta)
    losses = (h - 1.0 / (2.0 * beta)) ** 2 if kind == "ipo" else -F.logsigmoid(h)
    if losses.numel() == 0:
        zero = chosen.sum() * 0.0
        return zero, {}
    metrics = {
        "margin": h.detach().mean(),
        "accuracy": (h.detach() > 0).float().mean(),
        "chosen_reward": (beta * (chosen - ref_chosen)).detach().mean(),
        "rejected_reward": (beta * (rejected - ref_rejected)).detach().mean(),
        "logp_margin": (chosen - rejected).detach().mean(),
    }
    return losses.mean(), metrics


def preference_weights(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    n_chosen: torch.Tensor,
    n_rejected: torch.Tensor,
    *,
    kind: str = "dpo",
    beta: float = 0.1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(dL/d chosen, dL/d rejected, loss, metrics) of `preference_loss` at these values.

    The gradients are `(pairs,)`: the weight each completion's summed policy logprob carries in
    the loss's gradient (see the module docstring), with the mean over the pairs included."""
    c = chosen.detach().double().requires_grad_(True)
    r = rejected.detach().double().requires_grad_(True)
    loss, metrics = preference_loss(
        c, r, ref_chosen.double(), ref_rejected.double(), n_chosen.double(), n_rejected.double(), kind=kind, beta=beta
    )
    if c.numel() == 0:
        return torch.zeros_like(chosen), torch.zeros_like(rejected), loss.detach().float(), metrics
    grad_c, grad_r = torch.autograd.grad(loss, (c, r))
    metrics = {k: v.float() for k, v in metrics.items()}
    return grad_c.to(chosen.dtype), grad_r.to(rejected.dtype), loss.detach().float(), metrics
