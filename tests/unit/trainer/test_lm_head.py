"""The chunked scoring head gives the logprobs, entropies and gradients of the full-logits path."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from agentrl.trainer.lm_head import install_scoring_head, scoring
from agentrl.trainer.packing import compute_entropy, compute_token_logprobs, pack_trajectories
from agentrl.types import TokenOrigin, Trajectory

TINY_QWEN2 = Path("/work/shared/assets/tiny-random-qwen2")


def _batch():
    trajs = []
    for n in (5, 9, 3):
        t = Trajectory()
        t.extend(list(range(10, 10 + n)), TokenOrigin.PROMPT, 0)
        t.extend([7, 8, 9], TokenOrigin.SAMPLED, 0, logprobs=[-1.0] * 3, version=0)
        trajs.append(t)
    return pack_trajectories(trajs)


@pytest.mark.skipif(not TINY_QWEN2.is_dir(), reason="tiny Qwen2 not found in shared assets")
@pytest.mark.parametrize("chunk_size", [7, 1000])  # chunks that cut across sequences; one chunk
@pytest.mark.parametrize("entropy_grad", [True, False])
def test_chunked_head_matches_full_logits_values_and_gradients(chunk_size, entropy_grad):
    from transformers import AutoModelForCausalLM

    full = AutoModelForCausalLM.from_pretrained(TINY_QWEN2, dtype=torch.float32)
    chunked = AutoModelForCausalLM.from_pretrained(TINY_QWEN2, dtype=torch.float32)
    head = install_scoring_head(chunked, chunk_size=chunk_size)
    assert head is not None and chunked.lm_head.weight is chunked.model.embed_tokens.weight
    assert set(chunked.state_dict()) == set(full.state_dict())
    b = _batch()
    logits = full(**b.model_inputs()).logits
    lp_full = compute_token_logprobs(logits, b.labels, 0.7)
    ent_full = compute_entropy(logits, 0.7)
    with scoring(head, b.labels, 0.7, with_entropy=True, entropy_grad=entropy_grad):
        out = chunked(**b.model_inputs()).logits
    torch.testing.assert_close(out[..., 0], lp_full, atol=1e-5, rtol=0)
    torch.testing.assert_close(out[..., 1], ent_full, atol=1e-5, rtol=0)
    if not entropy_grad:  # the entropy is a metric: the same loss differentiates only the logprobs
        ent_full = ent_full.detach()
    ((lp_full - 0.1 * ent_full) * b.loss_mask).sum().backward()
    ((out[..., 0] - 0.1 * out[..., 1]) * b.loss_mask).sum().backward()
    for (name, p), q in zip(full.named_parameters(), chunked.parameters(), strict=True):
        scale = p.grad.abs().max().item()  # fp32 sums in another order: compare relative to the largest
        assert (q.grad - p.grad).abs().max().item() <= 2e-5 * scale, name
    # outside a request the head is the plain head again
    with torch.no_grad():
        torch.testing.assert_close(chunked(**b.model_inputs()).logits, logits.detach())


def test_models_that_transform_logits_keep_their_own_head():
    class Capped(nn.Module):
        config = SimpleNamespace(final_logit_softcapping=30.0)

        def get_output_embeddings(self):
            return nn.Linear(4, 8)

    assert install_scoring_head(Capped()) is None
