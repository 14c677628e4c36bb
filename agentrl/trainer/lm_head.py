"""A stand-in for a causal LM's output head that scores labels a chunk of tokens at a time.

With a 150k-token vocabulary the fp32 logits of a micro-batch (and their gradient) are the
trainer's largest tensors by far: 0.6 MB per token each. `ScoringHead` replaces the model's
`lm_head` and, while a `scoring` request is active, returns per-token `(logprob, entropy, outside)`
at the sampling temperature instead of logits (over each token's kept set when the rollout
recorded one: `agentrl.kept_set`), computing logits for `chunk_size` tokens at a time (by
default as many as make 32M logits) and recomputing each chunk but the last in the backward pass,
so full-vocabulary logits never exist for the whole micro-batch. The last chunk keeps what its
backward needs: the backward starts with it, so this saves its recomputation (a head-sized matmul;
with SmolLM2's 49k vocabulary and 512-token micro-batches, every micro-batch is one chunk) without
raising the peak. Entropy is differentiated only when asked (`entropy_grad`, for an entropy bonus);
otherwise it is computed without a graph, as a metric. Outside a request it is the plain linear
head, so generation and ordinary forwards see the usual logits. It keeps the head's parameter names
(`lm_head.weight`) and any weight tying.

This is not a general logits processor: models that transform logits after the head (soft-capping,
scaling) are left with their own head (`install_scoring_head` returns None for them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from agentrl.kept_set import entropy_of, masked_logits, outside_kept_set
from agentrl.sampling import KeptSetRule

__all__ = ["SCORE_COLUMNS", "ScoringHead", "ScoringRequest", "install_scoring_head", "scoring"]

SCORE_COLUMNS = 3
"""Per-token columns of a scoring forward: logprob, entropy, outside the trainer's kept set."""

# Config attributes of models whose logits are changed after the LM head.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier_scale", "logits_scaling")


_CHUNK_ELEMENTS = 1 << 25


class ScoringHead(nn.Module):
    """The LM head's weight (and bias), plus an optional request to score labels in chunks."""

    bias: torch.Tensor | None  # registered as a parameter (None when the head has no bias)

    def __init__(self, head: nn.Linear, chunk_size: int | None = None) -> None:
        super().__init__()
        if chunk_size is None:
            # ~32M logits (128 MB in fp32) per chunk: a 150k vocabulary gives 220-token chunks.
            chunk_size = max(16, _CHUNK_ELEMENTS // head.weight.shape[0])
        self.weight = head.weight
        self.register_parameter("bias", head.bias)
        self.chunk_size = chunk_size
        self.request: ScoringRequest | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.request is None:
            return F.linear(hidden, self.weight, self.bias)
        r = self.request
        flat = hidden.reshape(-1, hidden.shape[-1])
        flat_labels = r.labels.reshape(-1)
        flat_kept = r.kept_ids.reshape(flat_labels.shape[0], -1) if r.kept_ids is not None else None
        picked = None
        if r.select is not None:
            # Only the selected tokens (the sampled ones) are scored; in RL the prompt and tool
            # tokens usually outnumber them, and the head is the costliest part of a small model.
            picked = r.select.reshape(-1).nonzero().squeeze(-1)
            flat, flat_labels = flat.index_select(0, picked), flat_labels.index_select(0, picked)
            flat_kept = flat_kept.index_select(0, picked) if flat_kept is not None else None

        def score(h: torch.Tensor, lab: torch.Tensor, kept: torch.Tensor | None) -> torch.Tensor:
            z = self._logits(h, r.temperature)
            outside = outside_kept_set(z, lab, r.rule) if r.rule is not None else torch.zeros_like(lab, dtype=z.dtype)
            if kept is not None:
                z = masked_logits(z, kept)
            lp = z.gather(-1, lab.long().unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)
            if not r.with_entropy:
                return torch.stack([lp, torch.zeros_like(lp), outside], dim=-1)
            with torch.set_grad_enabled(r.entropy_grad and torch.is_grad_enabled()):
                entropy = entropy_of(z if r.entropy_grad else z.detach())
            return torch.stack([lp, entropy, outside], dim=-1)

        outs = []
        starts = range(0, flat.shape[0], self.chunk_size)
        for start in starts:
            args = (flat[start : start + self.chunk_size], flat_labels[start : start + self.chunk_size],
                    flat_kept[start : start + self.chunk_size] if flat_kept is not None else None)
            if torch.is_grad_enabled() and flat.requires_grad and start != starts[-1]:
                outs.append(checkpoint(score, *args, use_reentrant=False))
            else:
                outs.append(score(*args))
        if outs:
            out = torch.cat(outs)
        else:
            # Nothing to score (a rank's padding micro-batch): an empty result that still hangs
            # off the hidden states, so backward runs through the model and FSDP2's gradient
            # collectives happen on this rank as on the others.
            out = (flat[:, :1].float() * 0.0).expand(-1, SCORE_COLUMNS)
        if picked is not None:
            full = out.new_zeros((hidden.reshape(-1, hidden.shape[-1]).shape[0], SCORE_COLUMNS))
            return full.index_copy(0, picked, out).reshape(*hidden.shape[:-1], SCORE_COLUMNS).clone()
        # A fresh tensor, not a view: FSDP2 hooks its backward on the root module's outputs.
        return out.reshape(*hidden.shape[:-1], SCORE_COLUMNS).clone()

    def _logits(self, h: torch.Tensor, temperature: float) -> torch.Tensor:
        return F.linear(h, self.weight, self.bias).float() / temperature


def install_scoring_head(model: nn.Module, chunk_size: int | None = None) -> ScoringHead | None:
    """Swap the model's output head for a `ScoringHead` (before sharding); None where unsafe."""
    config = getattr(model, "config", None)
    if any(getattr(config, name, None) not in (None, 1.0) for name in _LOGIT_TRANSFORMS):
        return None
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if get_head is not None else None
    if not isinstance(head, nn.Linear):
        return None
    set_head = getattr(model, "set_output_embeddings", None)
    if set_head is None:
        return None
    scoring_head = ScoringHead(head, chunk_size)
    set_head(scoring_head)
    return scoring_head


@dataclass(frozen=True)
class ScoringRequest:
    """What an active `scoring` asks the head for (see `scoring`)."""

    labels: torch.Tensor
    temperature: float
    with_entropy: bool
    select: torch.Tensor | None = None
    entropy_grad: bool = True
    kept_ids: torch.Tensor | None = None
    rule: KeptSetRule | None = None


@contextlib.contextmanager
def scoring(
    head: ScoringHead, labels: torch.Tensor, temperature: float, with_entropy: bool,
    select: torch.Tensor | None = None, entropy_grad: bool = True, *,
    kept_ids: torch.Tensor | None = None, rule: KeptSetRule | None = None,
) -> Iterator[Any]:
    """While open, the model's `.logits` output is `(..., 3)`: per-token logprob of `labels`,
    entropy (0 when `with_entropy` is False), both at `temperature`, in fp32, and 1.0 where the
    label lies outside the kept set `rule` computes from the trainer's own logits (0 without a
    rule: `onpolicy/kept_set_disagreement`). With `kept_ids` (shaped like `labels` plus a last
    dimension of kept token ids, padded with -1; `PackedBatch.kept_ids`) each token is scored over
    its kept set, renormalised (logits outside it at -inf before the log-softmax), as it was
    sampled. With `select` (a mask shaped like `labels`), only the selected tokens are scored; the
    others read 0. With `entropy_grad=False` the entropy carries no gradient (a metric, not a loss
    term)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to score tokens, got {temperature}.")
    head.request = ScoringRequest(labels, temperature, with_entropy, select, entropy_grad, kept_ids, rule)
    try:
        yield head
    finally:
        head.request = None
