"""The kept set of a sampled token: which tokens truncated sampling drew it from, computed one way.

A token sampled with `top_p < 1`, `top_k > 0` or `min_p > 0` was drawn from a subset of the
vocabulary, renormalised. The engine records that subset (the *kept set*) and the trainer scores
the token over the same subset, so the importance ratio compares like with like. This module is
the one rule both sides apply to logits: the `hf` engine samples with it, the trainer masks its
logits to the recorded sets with it and checks whether its own logits would have kept the sampled
token (`onpolicy/kept_set_disagreement`). Which truncations apply (`KeptSetRule`) is read from the
config in `agentrl.sampling`, which imports no torch; this module is imported only by the trainer
and the servers, where torch is (layer L0, DESIGN.md §2).

The order is vLLM's (`vllm/v1/sample/sampler.py::Sampler.sample`): divide the logits by the
temperature; then `min_p` (drop tokens whose probability is below `min_p` times the largest, an
argmax-invariant logits processor); then `top_k` (drop logits below the k-th largest; ties with it
stay); then `top_p` over what is left (sort ascending, drop the tokens whose cumulative probability
is at most `1 - top_p`; the most likely token always stays), as in
`vllm/v1/sample/ops/topk_topp_sampler.py::apply_top_k_top_p_pytorch`. Following vLLM's order makes
the `hf` engine's kept sets the ones vLLM would keep for the same logits.

It is torch only; it knows nothing of servers, requests or trajectories.
"""

from __future__ import annotations

import torch

from agentrl.sampling import KeptSetRule

__all__ = ["entropy_of", "kept_mask", "kept_sets_of", "masked_logits", "outside_kept_set"]


def kept_mask(scaled_logits: torch.Tensor, *, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """Boolean `(..., vocab)`: True on the tokens sampling keeps, given logits already divided by
    the temperature (see the module docstring for the order). `top_k <= 0`, `top_p >= 1` and
    `min_p <= 0` are off; with all three off every token is kept."""
    z = scaled_logits.float()
    keep = torch.ones_like(z, dtype=torch.bool)
    if min_p > 0:
        probs = torch.softmax(z, dim=-1)
        keep &= probs >= probs.amax(dim=-1, keepdim=True) * min_p
    if 0 < top_k < z.shape[-1]:
        masked = z.masked_fill(~keep, float("-inf"))
        kth = torch.topk(masked, top_k, dim=-1).values[..., -1:]
        keep &= masked >= kth
    if top_p < 1.0:
        masked = z.masked_fill(~keep, float("-inf"))
        ascending, order = masked.sort(dim=-1, descending=False)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= 1 - top_p
        drop_sorted[..., -1] = False  # the most likely token always stays
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        keep &= ~drop
    return keep


def kept_sets_of(mask: torch.Tensor, max_kept_set: int) -> list[list[int]]:
    """The sorted token ids of each row of a `(n, vocab)` kept mask; `[]` for a row with more
    than `max_kept_set` members (overflowed: too large to record)."""
    sizes = mask.sum(dim=-1).tolist()
    out: list[list[int]] = []
    for row, size in zip(mask, sizes, strict=True):
        out.append(row.nonzero().squeeze(-1).tolist() if size <= max_kept_set else [])
    return out


def masked_logits(scaled_logits: torch.Tensor, kept_ids: torch.Tensor, *, vocab_start: int = 0) -> torch.Tensor:
    """`scaled_logits` `(n, V)` with every token outside its row's kept set at -inf.

    `kept_ids` `(n, K)` holds each row's kept token ids, padded with -1; a row of -1 only has no
    kept set (the whole vocabulary was kept, or the token is not scored) and is left as it is.
    `vocab_start`: the logits are the vocabulary slice `[vocab_start, vocab_start + V)` (one
    tensor-parallel rank's shard); a row may then keep none of its tokens (all -inf).
    """
    width = scaled_logits.shape[-1]
    local = kept_ids - vocab_start
    valid = (kept_ids >= 0) & (local >= 0) & (local < width)
    has_set = (kept_ids >= 0).any(dim=-1, keepdim=True)
    keep = torch.zeros(scaled_logits.shape, dtype=torch.uint8, device=scaled_logits.device)
    # amax: several padding entries may land on one index; a kept one must win, whatever the order.
    keep.scatter_reduce_(-1, local.clamp(0, width - 1), valid.to(torch.uint8), reduce="amax")
    return scaled_logits.masked_fill((keep == 0) & has_set, float("-inf"))


def entropy_of(scaled_logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax over each row of logits that may hold -inf (tokens outside a kept set):
    logsumexp(z) - sum softmax(z) * z, with the excluded tokens contributing nothing (and no NaN
    to the gradient)."""
    finite = torch.isfinite(scaled_logits)
    safe = scaled_logits.masked_fill(~finite, 0.0)
    probs = torch.softmax(scaled_logits, dim=-1)
    return torch.logsumexp(scaled_logits, dim=-1) - (probs * safe).sum(-1)


def outside_kept_set(scaled_logits: torch.Tensor, labels: torch.Tensor, rule: KeptSetRule) -> torch.Tensor:
    """1.0 where `labels` (n,) lies outside the kept set `rule` computes from `scaled_logits` (n, V)
    (full vocabulary, divided by the temperature), else 0.0; no gradient."""
    with torch.no_grad():
        keep = kept_mask(scaled_logits.detach(), top_k=rule.top_k, top_p=rule.top_p, min_p=rule.min_p)
        return (~keep.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)).float()
