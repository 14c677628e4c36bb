"""Packing trajectories: layouts by hand, micro-batch splitting, logprob/entropy maths, and the
claim that matters: a packed batch gives the same loss and gradients as a padded one on a real
(tiny, random) Qwen2 model, with no attention leaking across packed sequences.

What transformers 5.19 does on CPU (read in transformers/masking_utils.py): with no attention
mask and no cache, `_preprocess_mask_arguments` calls `find_packed_sequence_indices(position_ids)`
and `create_causal_mask` ANDs a same-sequence mask into the causal mask, for `sdpa` and `eager`
alike. A 4D mask is used as given. A cache (the config's `use_cache=True` default) turns the
detection off, which `test_default_use_cache_leaks_across_sequences` pins down.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.trainer import algos
from agentrl.trainer.packing import (
    block_causal_mask,
    compute_entropy,
    compute_token_logprobs,
    pack_micro_batches,
    pack_trajectories,
    packed_to_padded,
    pad_trajectories,
    padded_to_packed,
    prefix_units,
    split_micro_batches,
)
from agentrl.types import TokenOrigin, Trajectory

TINY_QWEN2 = Path("/work/shared/assets/tiny-random-qwen2")


def make_traj(*parts: tuple[TokenOrigin, list[int]], fault: str | None = None) -> Trajectory:
    traj = Trajectory(fault=fault)
    for turn, (origin, ids) in enumerate(parts):
        if origin == TokenOrigin.SAMPLED:
            traj.extend(ids, origin, turn, logprobs=[-0.1 * (k + 1) for k in range(len(ids))], version=0)
        else:
            traj.extend(ids, origin, turn)
    return traj


P, S, T = TokenOrigin.PROMPT, TokenOrigin.SAMPLED, TokenOrigin.TOOL


# ── layouts by hand ─────────────────────────────────────────────────────────────────────────────
def two_trajectories() -> list[Trajectory]:
    return [
        make_traj((P, [10, 11]), (S, [12, 13])),  # rollout logprobs -0.1, -0.2
        make_traj((P, [20]), (S, [21]), (T, [22]), (S, [23])),  # -0.1 | -0.1
    ]


def test_pack_layout_by_hand():
    b = pack_trajectories(two_trajectories())
    assert b.input_ids.tolist() == [[10, 11, 12, 13, 20, 21, 22, 23]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]
    assert b.cu_seqlens.tolist() == [0, 4, 8]
    assert b.cu_seqlens.dtype == torch.int32
    assert b.segment_ids.tolist() == [[0, 0, 0, 0, 1, 1, 1, 1]]
    # position t is scored against token t+1 of the same sequence; each sequence's last slot is dead
    assert b.labels.tolist() == [[11, 12, 13, 0, 21, 22, 23, 0]]
    # response masks (0,0,1,1) and (0,1,0,1) shifted left by one
    assert b.loss_mask.tolist() == [[0, 1, 1, 0, 1, 0, 1, 0]]
    torch.testing.assert_close(
        b.rollout_logprobs, torch.tensor([[0.0, -0.1, -0.2, 0.0, -0.1, 0.0, -0.1, 0.0]])
    )
    assert b.max_seqlen == 4 and b.num_tokens == 8


def test_pad_layout_matches_pack_layout():
    trajs = [make_traj((P, [1, 2, 3]), (S, [4, 5])), *two_trajectories()]
    packed, padded = pack_trajectories(trajs), pad_trajectories(trajs, pad_token_id=7)
    assert padded.input_ids.tolist()[1] == [10, 11, 12, 13, 7]
    assert padded.attention_mask.tolist() == [[1] * 5, [1, 1, 1, 1, 0], [1, 1, 1, 1, 0]]
    for name in ("labels", "loss_mask", "rollout_logprobs"):
        from_packed = packed_to_padded(getattr(packed, name), packed.cu_seqlens)
        torch.testing.assert_close(from_packed, getattr(padded, name))
        torch.testing.assert_close(
            padded_to_packed(getattr(padded, name), packed.cu_seqlens), getattr(packed, name)
        )


def test_untrainable_trajectory_is_masked_out():
    b = pack_trajectories([make_traj((P, [1]), (S, [2, 3]), fault="infra")])
    assert b.loss_mask.tolist() == [[0.0, 0.0, 0.0]]


def test_empty_inputs_are_refused_with_a_reason():
    with pytest.raises(ValueError, match="empty"):
        pack_trajectories([])
    with pytest.raises(ValueError, match="no tokens"):
        pad_trajectories([Trajectory()])


def test_block_causal_mask_by_hand():
    mask = block_causal_mask(torch.tensor([0, 2, 3], dtype=torch.int32))
    allowed = (mask[0, 0] == 0).int().tolist()
    assert allowed == [[1, 0, 0], [1, 1, 0], [0, 0, 1]]


# ── micro-batches ───────────────────────────────────────────────────────────────────────────────
def test_split_micro_batches_balances_by_hand():
    # total 36 over budget 12 -> 3 bins overflow (11, 11, 11 then +2), so 4 bins:
    # 8+1, 7+2, 6+3, 5+4 = 9 tokens each
    bins = split_micro_batches([8, 7, 6, 5, 4, 3, 2, 1], max_tokens=12)
    assert bins == [[0, 7], [1, 6], [2, 5], [3, 4]]


def test_split_micro_batches_puts_a_sequence_over_budget_on_its_own():
    assert split_micro_batches([3, 20, 4, 30], max_tokens=10) == [[0, 2], [1], [3]]
    assert split_micro_batches([], max_tokens=10) == []


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 50), max_size=40), budget=st.integers(50, 200))
def test_split_micro_batches_covers_everything_within_budget(lengths, budget):
    bins = split_micro_batches(lengths, budget)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= budget for b in bins)
    if lengths:
        # never more than twice the ideal number of bins (each pair of bins holds > budget)
        assert len(bins) <= max(1, 2 * math.ceil(sum(lengths) / budget))


def test_pack_micro_batches_keeps_the_original_indices():
    trajs = [make_traj((P, [k] * n), (S, [k])) for k, n in enumerate([7, 1, 5, 3])]  # 8, 2, 6, 4 tokens
    batches = pack_micro_batches(trajs, max_tokens=10)
    # total 20 -> 2 bins: 8 then 6 go to separate bins, 4 joins the 6, 2 joins the 8
    assert [b.indices for b in batches] == [[0, 1], [2, 3]]
    assert [b.num_tokens for b in batches] == [10, 10]
    assert batches[1].input_ids[0, :6].tolist() == [2] * 6  # trajectory 2 leads its micro-batch


# ── logprobs and entropy ────────────────────────────────────────────────────────────────────────
def test_token_logprobs_and_entropy_by_hand():
    logits = torch.tensor([[0.0, math.log(3.0)]])  # softmax = (1/4, 3/4)
    lp = compute_token_logprobs(logits, torch.tensor([1]))
    torch.testing.assert_close(lp, torch.tensor([math.log(0.75)]))
    # H = -(1/4·ln 1/4 + 3/4·ln 3/4) = 0.562335
    torch.testing.assert_close(compute_entropy(logits), torch.tensor([0.562335]), atol=1e-6, rtol=0)
    # at T = 0.5 logits double: softmax = (1/10, 9/10)
    lp_t = compute_token_logprobs(logits, torch.tensor([1]), temperature=0.5)
    torch.testing.assert_close(lp_t, torch.tensor([math.log(0.9)]))
    with pytest.raises(ValueError, match="temperature"):
        compute_token_logprobs(logits, torch.tensor([1]), temperature=0.0)


def test_chunked_scoring_matches_the_plain_formula_with_gradients():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 7, 11, generator=g, requires_grad=True)
    labels = torch.randint(0, 11, (2, 7), generator=g)
    z = logits / 0.7
    ref_lp = torch.log_softmax(z, -1).gather(-1, labels[..., None]).squeeze(-1)
    ref_h = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
    (ref_grad,) = torch.autograd.grad((ref_lp * 1.3 + ref_h).sum(), logits)
    lp = compute_token_logprobs(logits, labels, 0.7, chunk_size=3)  # 14 tokens: chunks 3,3,3,3,2
    h = compute_entropy(logits, 0.7, chunk_size=3)
    (grad,) = torch.autograd.grad((lp * 1.3 + h).sum(), logits)
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(h, ref_h)
    torch.testing.assert_close(grad, ref_grad)


def test_bf16_logits_are_scored_in_fp32():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 300, generator=g).to(torch.bfloat16)
    labels = torch.randint(0, 300, (5,), generator=g)
    lp = compute_token_logprobs(logits, labels)
    assert lp.dtype == torch.float32
    ref = torch.log_softmax(logits.float(), -1).gather(-1, labels[:, None]).squeeze(-1)
    torch.testing.assert_close(lp, ref)


# ── packed == padded on a real model ────────────────────────────────────────────────────────────
needs_model = pytest.mark.skipif(not TINY_QWEN2.exists(), reason=f"{TINY_QWEN2} is not on this machine")


@functools.cache
def load_tiny(attn: str):
    # one model per attention path for the whole module; every test zeroes the gradients it uses
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(TINY_QWEN2, dtype=torch.float32, attn_implementation=attn)
    model.train()  # dropout is 0.0 in this config, so train mode stays deterministic
    return model


def model_trajectories() -> list[Trajectory]:
    g = torch.Generator().manual_seed(1)

    def ids(n: int) -> list[int]:
        return torch.randint(0, 5000, (n,), generator=g).tolist()

    return [
        make_traj((P, ids(4)), (S, ids(5))),
        make_traj((P, ids(3)), (S, ids(3)), (T, ids(4)), (S, ids(2))),  # multi-turn, tool gap
        make_traj((P, ids(2)), (S, ids(3))),
        make_traj((P, ids(3)), (S, ids(2)), fault="infra"),  # must contribute nothing
    ]


def policy_loss(logits, logprobs, batch, advantages, mode, segment_ids=None):
    # The first PPO step of a batch (old = current policy, ρ = 1) plus an entropy bonus: gradients
    # of order one reach every parameter, so comparing them at atol 1e-5 means something.
    loss, _ = algos.ppo_policy_loss(
        logprobs,
        logprobs.detach(),
        advantages,
        batch.loss_mask,
        clip_low=0.2,
        clip_high=0.28,
        loss_agg_mode=mode,
        segment_ids=segment_ids,
    )
    entropy = compute_entropy(logits, temperature=0.8, chunk_size=8)
    return loss - 0.01 * algos.aggregate_loss(entropy, batch.loss_mask, mode, segment_ids=segment_ids)


def padded_step(model, trajs, mode):
    batch = pad_trajectories(trajs)
    model.zero_grad()
    logits = model(**batch.model_inputs()).logits
    lp = compute_token_logprobs(logits, batch.labels, temperature=0.8)
    advantages = torch.linspace(-1.0, 1.0, lp.numel()).reshape(lp.shape)
    loss = policy_loss(logits, lp, batch, advantages, mode)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return batch, lp.detach(), advantages, loss.detach(), grads


@needs_model
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_packed_loss_and_gradients_equal_padded(attn, mode):
    model = load_tiny(attn)
    trajs = model_trajectories()
    padded, lp_pad, adv_pad, loss_pad, grads_pad = padded_step(model, trajs, mode)

    packed = pack_trajectories(trajs)
    model.zero_grad()
    logits = model(**packed.model_inputs()).logits
    lp = compute_token_logprobs(logits, packed.labels, temperature=0.8)
    adv = padded_to_packed(adv_pad, packed.cu_seqlens)
    loss = policy_loss(logits, lp, packed, adv, mode, segment_ids=packed.segment_ids)
    loss.backward()

    # per-token logprobs agree wherever a real token is scored
    valid = padded.attention_mask.bool()
    torch.testing.assert_close(
        packed_to_padded(lp.detach(), packed.cu_seqlens)[valid], lp_pad[valid], atol=1e-5, rtol=0
    )
    torch.testing.assert_close(loss.detach(), loss_pad, atol=1e-5, rtol=0)
    assert loss_pad.abs() > 1e-3  # a loss of 0 would make the comparison vacuous
    for name, p in model.named_parameters():
        torch.testing.assert_close(
            p.grad, grads_pad[name], atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
        )
    assert max(g.abs().max() for g in grads_pad.values()) > 1e-2


@needs_model
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_explicit_block_mask_equals_position_id_detection(attn):
    model = load_tiny(attn)
    packed = pack_trajectories(model_trajectories())
    with torch.no_grad():
        detected = model(**packed.model_inputs()).logits
        explicit = model(
            input_ids=packed.input_ids,
            position_ids=packed.position_ids,
            attention_mask=block_causal_mask(packed.cu_seqlens),
            use_cache=False,
        ).logits
    torch.testing.assert_close(explicit, detected, atol=1e-5, rtol=0)


@needs_model
def test_no_attention_leaks_across_packed_sequences():
    model = load_tiny("sdpa")
    trajs = model_trajectories()
    changed = [make_traj((P, [1, 2, 3, 4]), (S, [5, 6, 7, 8, 9])), *trajs[1:]]
    with torch.no_grad():
        a = pack_trajectories(trajs)
        b = pack_trajectories(changed)
        la, lb = model(**a.model_inputs()).logits, model(**b.model_inputs()).logits
    first = a.seq_lengths[0]
    assert (la[0, :first] - lb[0, :first]).abs().max() > 1e-3  # the edit did change sequence 0
    torch.testing.assert_close(la[0, first:], lb[0, first:], atol=1e-5, rtol=0)


@needs_model
def test_default_use_cache_leaks_across_sequences():
    # Why model_inputs() passes use_cache=False: with the config default a DynamicCache is built,
    # packed-sequence detection is skipped, and later sequences attend to earlier ones.
    model = load_tiny("sdpa")
    packed = pack_trajectories(model_trajectories())
    with torch.no_grad():
        safe = model(**packed.model_inputs()).logits
        leaky = model(input_ids=packed.input_ids, position_ids=packed.position_ids).logits
    first = packed.seq_lengths[0]
    torch.testing.assert_close(leaky[0, :first], safe[0, :first], atol=1e-5, rtol=0)
    assert (leaky[0, first:] - safe[0, first:]).abs().max() > 1e-3


# ── shared prefixes ─────────────────────────────────────────────────────────────────────────────
def group_trajectories() -> list[Trajectory]:
    """Two prompts, three samples each (one multi-turn with a tool gap), plus a lone trajectory
    with a one-token prompt (nothing to share); the groups are interleaved."""
    g = torch.Generator().manual_seed(2)

    def ids(n: int) -> list[int]:
        return torch.randint(0, 5000, (n,), generator=g).tolist()

    a, b = ids(6), ids(4)
    return [
        make_traj((P, a), (S, ids(3))),
        make_traj((P, b), (S, ids(5))),
        make_traj((P, a), (S, ids(2)), (T, ids(3)), (S, ids(2))),
        make_traj((P, [7]), (S, ids(4))),
        make_traj((P, b), (S, ids(2))),
        make_traj((P, a), (S, ids(4))),
        make_traj((P, b), (S, ids(1))),
    ]


def test_shared_prefix_layout_by_hand():
    trajs = [make_traj((P, [1, 2, 3]), (S, [4, 5])), make_traj((P, [1, 2, 3]), (S, [6]))]
    packed = pack_trajectories(trajs, share_prefixes=True)
    # the prompt minus its last token once, then each trajectory from its last prompt token on
    assert packed.input_ids.tolist() == [[1, 2, 3, 4, 5, 3, 6]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 2, 3]]
    assert packed.labels.tolist() == [[2, 3, 4, 5, 0, 6, 0]]
    assert packed.loss_mask.tolist() == [[0, 0, 1, 1, 0, 1, 0]]
    assert packed.token_rows.tolist() == [0, 0, 0, 0, 0, 1, 1]
    assert packed.token_cols.tolist() == [0, 1, 2, 3, 4, 2, 3]
    assert packed.shared == [(0, 1, 2)]
    visible = packed.attention_mask[0, 0].int().tolist()
    assert visible[5] == [1, 1, 0, 0, 0, 1, 0]  # the second answer sees the prefix, not the first
    assert visible[6] == [1, 1, 0, 0, 0, 1, 1]
    # values move in and out of (batch, len) rows; shared tokens reach every trajectory
    rows = torch.arange(10.0).reshape(2, 5)
    assert packed.gather(rows).tolist() == [[0, 1, 2, 3, 4, 7, 8]]
    out = torch.full((2, 5), -1.0)
    packed.scatter(torch.tensor([[10.0, 11, 12, 13, 14, 15, 16]]), out)
    assert out.tolist() == [[10, 11, 12, 13, 0], [10, 11, 15, 0, -1]]


def test_prefix_units_keep_groups_together_and_respect_the_budget():
    trajs = group_trajectories()
    units = prefix_units(trajs, max_tokens=1000)
    assert [m for m, _ in units] == [[0, 2, 5], [1, 4, 6], [3]]
    lengths = [len(t.token_ids) for t in trajs]
    assert units[0][1] == sum(lengths[i] for i in (0, 2, 5)) - 2 * 5  # the 5-token prefix once
    # a group over the budget is cut, and units are halved until every rank gets one
    small = prefix_units(trajs, max_tokens=16)
    assert sorted(i for m, _ in small for i in m) == list(range(len(trajs)))
    assert all(c <= 16 or len(m) == 1 for m, c in small)
    assert len(prefix_units(trajs[:3], max_tokens=1000, min_units=3)) == 3


@needs_model
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_shared_prefix_loss_and_gradients_equal_separate_packing(mode):
    model = load_tiny("sdpa")
    trajs = group_trajectories()
    results = []
    for share in (False, True):
        packed = pack_trajectories(trajs, share_prefixes=share)
        assert packed.shares_prefixes == share
        model.zero_grad()
        logits = model(**packed.model_inputs()).logits
        lp = compute_token_logprobs(logits, packed.labels, temperature=0.8)
        width = max(len(t.token_ids) for t in trajs)
        adv = packed.gather(torch.linspace(-1.0, 1.0, len(trajs) * width).reshape(len(trajs), width))
        loss = policy_loss(logits, lp, packed, adv, mode, segment_ids=packed.segment_ids)
        loss.backward()
        rows = torch.zeros(len(trajs), width)
        packed.scatter(lp, rows)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results.append((packed.num_tokens, rows, loss.detach(), grads))
    (n_sep, lp_sep, loss_sep, g_sep), (n_sh, lp_sh, loss_sh, g_sh) = results
    assert n_sh == n_sep - 2 * 5 - 2 * 3  # each group's prefix packed once instead of three times
    torch.testing.assert_close(lp_sh, lp_sep, atol=1e-5, rtol=0)
    torch.testing.assert_close(loss_sh, loss_sep, atol=1e-5, rtol=0)
    assert loss_sep.abs() > 1e-3
    for name in g_sep:
        torch.testing.assert_close(g_sh[name], g_sep[name], atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
