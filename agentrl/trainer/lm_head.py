"""A stand-in for a causal LM's output head that scores labels a chunk of tokens at a time.

With a 150k-token vocabulary the fp32 logits of a micro-batch (and their gradient) are the
trainer's largest tensors by far: 0.6 MB per token each. `ScoringHead` replaces the model's
`lm_head` and, while a `scoring` request is active, returns per-token `(logprob, entropy)` at the
sampling temperature instead of logits, computing logits for `chunk_size` tokens at a time (by
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
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["ScoringHead", "install_scoring_head", "scoring"]

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
        self.request: tuple[torch.Tensor, float, bool, torch.Tensor | None, bool] | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.request is None:
            return F.linear(hidden, self.weight, self.bias)
        labels, temperature, with_entropy, select, entropy_grad = self.request
        flat = hidden.reshape(-1, hidden.shape[-1])
        flat_labels = labels.reshape(-1)
        picked = None
        if select is not None:
            # Only the selected tokens (the sampled ones) are scored; in RL the prompt and tool
            # tokens usually outnumber them, and the head is the costliest part of a small model.
            picked = select.reshape(-1).nonzero().squeeze(-1)
            flat, flat_labels = flat.index_select(0, picked), flat_labels.index_select(0, picked)

        def score(h: torch.Tensor, lab: torch.Tensor) -> torch.Tensor:
            if with_entropy:
                return self._entropy_and_logprob(h, lab, temperature, entropy_grad)
            return self._logprob(h, lab, temperature)

        outs = []
        starts = range(0, flat.shape[0], self.chunk_size)
        for start in starts:
            args = (flat[start : start + self.chunk_size], flat_labels[start : start + self.chunk_size])
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
            out = (flat[:, :1].float() * 0.0).expand(-1, 2)
        if picked is not None:
            full = out.new_zeros((hidden.reshape(-1, hidden.shape[-1]).shape[0], 2))
            return full.index_copy(0, picked, out).reshape(*hidden.shape[:-1], 2).clone()
        # A fresh tensor, not a view: FSDP2 hooks its backward on the root module's outputs.
        return out.reshape(*hidden.shape[:-1], 2).clone()

    def _logits(self, h: torch.Tensor, temperature: float) -> torch.Tensor:
        return F.linear(h, self.weight, self.bias).float() / temperature

    def _logprob(self, h: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
        z = self._logits(h, temperature)
        lp = z.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)
        return torch.stack([lp, torch.zeros_like(lp)], dim=-1)

    def _entropy_and_logprob(
        self, h: torch.Tensor, labels: torch.Tensor, temperature: float, entropy_grad: bool
    ) -> torch.Tensor:
        z = self._logits(h, temperature)
        lse = torch.logsumexp(z, dim=-1)
        lp = z.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1) - lse
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            zz, ll = (z, lse) if entropy_grad else (z.detach(), lse.detach())
            entropy = ll - (torch.softmax(zz, dim=-1) * zz).sum(-1)
        return torch.stack([lp, entropy], dim=-1)


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


@contextlib.contextmanager
def scoring(
    head: ScoringHead, labels: torch.Tensor, temperature: float, with_entropy: bool,
    select: torch.Tensor | None = None, entropy_grad: bool = True,
) -> Iterator[Any]:
    """While open, the model's `.logits` output is `(..., 2)`: per-token logprob of `labels`
    and entropy (0 when `with_entropy` is False), both at `temperature`, in fp32. With `select`
    (a mask shaped like `labels`), only the selected tokens are scored; the others read 0. With
    `entropy_grad=False` the entropy carries no gradient (a metric, not a loss term)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to score tokens, got {temperature}.")
    head.request = (labels, temperature, with_entropy, select, entropy_grad)
    try:
        yield head
    finally:
        head.request = None
