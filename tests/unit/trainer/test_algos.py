"""Hand-checked values for agentrl.trainer.algos.

Every expected number is worked out in the comment beside it from the formula in the function's
docstring, on tensors small enough to follow by hand. The edge cases the trainer relies on are
here too: masked tokens, empty masks, equal-reward and single-sample groups.
"""

from __future__ import annotations

import math

import pytest
import torch

import agentrl.trainer as trainer
from agentrl.registry import ADVANTAGE_ESTIMATORS
from agentrl.trainer import algos

LN2 = math.log(2.0)


def close(actual: torch.Tensor, expected, atol: float = 1e-5) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


# ── masked reductions and aggregation ───────────────────────────────────────────────────────────
def test_masked_mean_ignores_masked_nan_and_is_zero_on_empty_mask():
    x = torch.tensor([1.0, float("nan"), 3.0])
    close(algos.masked_mean(x, torch.tensor([1, 0, 1])), 2.0)  # (1 + 3) / 2
    close(algos.masked_mean(x, torch.zeros(3)), 0.0)


def test_masked_whiten_of_a_single_or_constant_entry_is_zero():
    close(algos.masked_whiten(torch.tensor([5.0, 7.0]), torch.tensor([1, 0])), [0.0, 0.0])
    close(algos.masked_whiten(torch.tensor([2.0, 2.0, 2.0]), torch.ones(3)), [0.0, 0.0, 0.0])
    # (1, 3) -> mean 2, unbiased std √2; the masked NaN stays out and comes back as 0
    out = algos.masked_whiten(torch.tensor([1.0, float("nan"), 3.0]), torch.tensor([1, 0, 1]))
    close(out, [-1 / math.sqrt(2), 0.0, 1 / math.sqrt(2)])


LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [7.0, 7.0, 7.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # row 2 is an infra-masked sequence


def test_aggregate_token_mean():
    # (1 + 2 + 3 + 4) / 4 tokens
    close(algos.aggregate_loss(LOSS, MASK, "token-mean"), 2.5)


def test_aggregate_seq_mean_token_mean_skips_empty_sequences():
    # row means 2 and 4; row 2 has no token and does not count: (2 + 4) / 2
    close(algos.aggregate_loss(LOSS, MASK, "seq-mean-token-mean"), 3.0)


def test_aggregate_seq_mean_token_sum_norm_divides_by_the_constant():
    # (6/4 + 4/4) / 2 with max_len = 4
    close(algos.aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", max_len=4), 1.25)
    with pytest.raises(ValueError, match="max_len"):
        algos.aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm")


def test_aggregate_packed_segments_match_rows():
    flat = torch.tensor([1.0, 2.0, 3.0, 4.0])
    segments = torch.tensor([0, 0, 0, 1])
    close(algos.aggregate_loss(flat, torch.ones(4), "seq-mean-token-mean", segment_ids=segments), 3.0)
    close(
        algos.aggregate_loss(flat, torch.ones(4), "seq-mean-token-sum-norm", max_len=4, segment_ids=segments),
        1.25,
    )


@pytest.mark.parametrize(("mode", "count"), [("token-mean", 4), ("seq-mean-token-mean", 2)])
def test_micro_batch_losses_add_up_to_the_full_batch_loss(mode, count):
    # split LOSS into micro-batches {row 0} and {rows 1, 2}; each divides by the whole batch's
    # count (4 tokens, or 2 non-empty sequences), so their sum is the full-batch loss
    full = algos.aggregate_loss(LOSS, MASK, mode)
    parts = algos.aggregate_loss(LOSS[:1], MASK[:1], mode, denominator=count) + algos.aggregate_loss(
        LOSS[1:], MASK[1:], mode, denominator=count
    )
    close(parts, full)
    with pytest.raises(ValueError, match="denominator"):
        algos.aggregate_loss(LOSS, MASK, mode, denominator=0)


@pytest.mark.parametrize("mode", algos.LOSS_AGG_MODES)
def test_aggregate_empty_mask_is_zero(mode):
    out = algos.aggregate_loss(LOSS, torch.zeros_like(MASK), mode, max_len=4)
    close(out, 0.0)


def test_aggregate_unknown_mode_names_the_choices():
    with pytest.raises(ValueError, match="token-mean"):
        algos.aggregate_loss(LOSS, MASK, "mean")


# ── advantage estimators ────────────────────────────────────────────────────────────────────────
# Groups: "a" = [1, 0, 1] (varied), "b" = [2, 2] (equal), "c" = [5] (single sample).
SCORES = torch.tensor([1.0, 0.0, 1.0, 2.0, 2.0, 5.0])
INDEX = ["a", "a", "a", "b", "b", "c"]
RMASK = torch.tensor([[1, 1, 0]] * 6)  # the third token of each row is not a response token


def test_grpo_normalises_by_group_mean_and_unbiased_std():
    adv, returns = algos.grpo(SCORES, RMASK, INDEX)
    # group a: mean 2/3, deviations (1/3, -2/3, 1/3), unbiased var (1/9 + 4/9 + 1/9) / 2 = 1/3,
    # std 0.57735 -> 0.57735, -1.15470, 0.57735; groups b and c -> 0
    per_seq = [0.57735, -1.15470, 0.57735, 0.0, 0.0, 0.0]
    close(adv, [[a, a, 0.0] for a in per_seq], atol=1e-4)
    close(returns, adv)


def test_dr_grpo_only_subtracts_the_group_mean():
    adv, _ = algos.dr_grpo(SCORES, RMASK, INDEX)
    per_seq = [1 / 3, -2 / 3, 1 / 3, 0.0, 0.0, 0.0]
    close(adv[:, 0], per_seq)
    close(adv[:, 2], [0.0] * 6)


def test_rloo_uses_the_mean_of_the_other_samples():
    adv, _ = algos.rloo(SCORES, RMASK, INDEX)
    # group a: 1 - (0+1)/2 = 0.5, 0 - (1+1)/2 = -1, 1 - (1+0)/2 = 0.5; single sample c -> 0
    close(adv[:, 0], [0.5, -1.0, 0.5, 0.0, 0.0, 0.0])


def test_group_ids_may_be_a_tensor_and_token_rewards_are_summed():
    token_rewards = torch.zeros(6, 3)
    token_rewards[:, 1] = SCORES  # the outcome reward sits on the last response token
    adv_t, _ = algos.dr_grpo(token_rewards, RMASK, torch.tensor([7, 7, 7, 3, 3, 9]))
    adv_s, _ = algos.dr_grpo(SCORES, RMASK, INDEX)
    close(adv_t, adv_s)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"])
def test_group_estimators_give_zero_to_equal_and_single_groups(name):
    fn = ADVANTAGE_ESTIMATORS.resolve(name)
    scores = torch.tensor([3.0, 3.0, 3.0, 1.0])
    adv, returns = fn(scores, torch.ones(4, 2), [0, 0, 0, 1])
    close(adv, torch.zeros(4, 2))
    assert not torch.isnan(returns).any()


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"])
def test_estimators_survive_an_empty_response_mask(name):
    fn = ADVANTAGE_ESTIMATORS.resolve(name)
    adv, returns = fn(torch.tensor([1.0, 0.0]), torch.zeros(2, 3), [0, 0])
    close(adv, torch.zeros(2, 3))
    close(returns, torch.zeros(2, 3))


def test_gae_empty_mask_is_zero():
    adv, returns = algos.gae(torch.zeros(1, 3), torch.zeros(1, 3), values=torch.ones(1, 3))
    close(adv, torch.zeros(1, 3))
    close(returns, torch.zeros(1, 3))


def test_reinforce_pp_discounts_then_whitens_over_the_batch():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, returns = algos.reinforce_pp(rewards, mask, gamma=0.5)
    # row 0: G2 = 1, G1 = 0 + 0.5·1 = 0.5, G0 = 0.25; row 1: G1 = 2, G0 = 1, G2 masked
    close(returns, [[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]])
    # mean of (0.25, 0.5, 1, 1, 2) = 0.95; deviations (-0.7, -0.45, 0.05, 0.05, 1.05);
    # unbiased var = (0.49 + 0.2025 + 0.0025 + 0.0025 + 1.1025) / 4 = 0.45, std = 0.670820
    close(adv, [[-1.043498, -0.670820, 0.074536], [0.074536, 1.565248, 0.0]], atol=1e-5)
    centred, _ = algos.reinforce_pp(rewards, mask, gamma=0.5, divide_std=False)
    close(centred, [[-0.7, -0.45, 0.05], [0.05, 1.05, 0.0]])


def test_reinforce_pp_carries_returns_across_tool_tokens():
    # token 1 is a tool result (masked): G0 = 0 + 0.5·G2 = 0.5, not reset to 0 by the gap
    _, returns = algos.reinforce_pp(torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[1, 0, 1]]), gamma=0.5)
    close(returns, [[0.5, 0.0, 1.0]])


def test_reinforce_pp_places_scalar_scores_on_the_last_response_token():
    _, returns = algos.reinforce_pp(torch.tensor([1.0]), torch.tensor([[1, 1, 0]]), gamma=0.5)
    close(returns, [[0.5, 1.0, 0.0]])


def test_reinforce_pp_baseline_subtracts_group_mean_then_divides_by_batch_std():
    scores = torch.tensor([1.0, 0.0, 3.0, 3.0])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 0]])
    adv, _ = algos.reinforce_pp_baseline(scores, mask, [0, 0, 1, 1])
    # centred per token: 0.5, 0.5 | -0.5 | 0, 0 | 0  -> token mean 1/12,
    # Σ(x - m)² = 0.75 - 6/144 = 0.708333, /5 = 0.141667, std = 0.376386; 0.5 / std = 1.328422
    close(adv, [[1.328422, 1.328422], [-1.328422, 0.0], [0.0, 0.0], [0.0, 0.0]], atol=1e-5)


def test_gae_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[1.0, 2.0, 3.0]])
    adv, returns = algos.gae(rewards, torch.ones(1, 3), values=values, gamma=0.9, lam=0.5, whiten=False)
    # δ2 = 1 + 0 - 3 = -2, A2 = -2
    # δ1 = 0 + 0.9·3 - 2 = 0.7, A1 = 0.7 + 0.45·(-2) = -0.2
    # δ0 = 0 + 0.9·2 - 1 = 0.8, A0 = 0.8 + 0.45·(-0.2) = 0.71
    close(adv, [[0.71, -0.2, -2.0]])
    close(returns, [[1.71, 1.8, 1.0]])


def test_gae_skips_masked_tool_tokens():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[1.0, 99.0, 3.0]])  # the tool token's value must not be used
    adv, returns = algos.gae(
        rewards, torch.tensor([[1, 0, 1]]), values=values, gamma=0.9, lam=0.5, whiten=False
    )
    # A2 = -2; δ0 = 0 + 0.9·3 - 1 = 1.7, A0 = 1.7 + 0.45·(-2) = 0.8
    close(adv, [[0.8, 0.0, -2.0]])
    close(returns, [[1.8, 0.0, 1.0]])


# ── policy losses ───────────────────────────────────────────────────────────────────────────────
# Token a: A=+1, ρ=1.5.  Token b: A=-1, ρ=0.5.  Token c: A=-1, ρ=5.  Token d: masked, A=+1, ρ=e^10.
RATIOS = torch.tensor([[1.5, 0.5, 5.0, math.exp(10.0)]])
ADV = torch.tensor([[1.0, -1.0, -1.0, 1.0]])
PMASK = torch.tensor([[1, 1, 1, 0]])


def _ppo(**kwargs):
    log_prob = RATIOS.log().clone().requires_grad_(True)
    loss, metrics = algos.ppo_policy_loss(log_prob, torch.zeros_like(log_prob), ADV, PMASK, **kwargs)
    loss.backward()
    return loss, metrics, log_prob.grad


def test_ppo_clip_by_hand():
    loss, metrics, grad = _ppo(clip_low=0.2)
    # a: max(-1.5, -1.2) = -1.2 (clipped)   b: max(0.5, 0.8) = 0.8 (clipped)   c: max(5, 1.2) = 5
    close(loss, (-1.2 + 0.8 + 5.0) / 3)
    close(metrics["pg_clipfrac"], 2 / 3)
    close(metrics["pg_clipfrac_lower"], 0.0)
    # ppo_kl = mean(-log ρ) = -(ln 1.5 + ln 0.5 + ln 5) / 3
    close(metrics["ppo_kl"], -(math.log(1.5) + math.log(0.5) + math.log(5.0)) / 3)
    # clipped tokens have no gradient; c: d(-A·ρ)/dlogρ / 3 = ρ / 3 = 5/3; masked d gets none
    close(grad, [[0.0, 0.0, 5.0 / 3, 0.0]])


def test_clip_higher_changes_only_the_upper_clip():
    loss, _, _ = _ppo(clip_low=0.2, clip_high=0.28)
    # a now clips at 1.28: (-1.28 + 0.8 + 5) / 3 ; b still clips at 1 - 0.2
    close(loss, (-1.28 + 0.8 + 5.0) / 3)
    base, _, _ = _ppo(clip_low=0.2)
    assert loss < base


def test_dual_clip_bounds_negative_advantage_tokens():
    loss, metrics, grad = _ppo(clip_low=0.2, clip_c=3.0)
    # c: min(5, -A·c = 3) = 3 -> (-1.2 + 0.8 + 3) / 3 and no gradient through c any more
    close(loss, (-1.2 + 0.8 + 3.0) / 3)
    close(metrics["pg_clipfrac_lower"], 1 / 3)
    close(grad, [[0.0, 0.0, 0.0, 0.0]])


def test_dual_clip_leaves_positive_advantages_alone():
    log_prob = torch.tensor([[math.log(5.0)]])
    args = (log_prob, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1))
    plain, _ = algos.ppo_policy_loss(*args, clip_low=0.2)
    dual, _ = algos.ppo_policy_loss(*args, clip_low=0.2, clip_c=3.0)
    close(dual, plain)  # max(-5, -1.2) = -1.2 both times
    close(dual, -1.2)


def test_dual_clip_constant_must_exceed_one():
    with pytest.raises(ValueError, match="clip_c"):
        _ppo(clip_c=0.9)


def test_ppo_empty_mask_gives_zero_loss_and_zero_gradient():
    log_prob = torch.zeros(2, 3, requires_grad=True)
    loss, metrics = algos.ppo_policy_loss(log_prob, torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3))
    loss.backward()
    close(loss, 0.0)
    close(log_prob.grad, torch.zeros(2, 3))
    assert all(not torch.isnan(v).any() for v in metrics.values())


def test_ppo_is_weights_scale_the_token_loss():
    log_prob = torch.zeros(1, 2)
    loss, _ = algos.ppo_policy_loss(
        log_prob, log_prob, torch.ones(1, 2), torch.ones(1, 2), is_weights=torch.tensor([[2.0, 0.5]])
    )
    close(loss, (-2.0 - 0.5) / 2)  # ρ = 1: -A·ρ·w


def test_gspo_clips_the_geometric_mean_ratio():
    log_prob = torch.tensor([[LN2, 0.0]], requires_grad=True)
    loss, metrics = algos.gspo_policy_loss(
        log_prob, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2), clip_low=0.1, clip_high=0.1
    )
    # s = exp((ln 2 + 0) / 2) = √2 = 1.41421 for both tokens; clipped to 1.1 -> loss -1.1, no grad
    close(loss, -1.1)
    close(metrics["pg_clipfrac"], 1.0)
    loss.backward()
    close(log_prob.grad, [[0.0, 0.0]])


def test_gspo_gradient_is_the_sequence_ratio_gradient():
    log_prob = torch.tensor([[LN2, 0.0, 5.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0]])
    loss, _ = algos.gspo_policy_loss(
        log_prob, torch.zeros(1, 3), torch.ones(1, 3), mask, clip_low=1.0, clip_high=1.0
    )
    # loss = -s with s = √2; ds/dlogπ_t = s / |y| = √2 / 2 on each of the two response tokens
    close(loss, -math.sqrt(2.0))
    loss.backward()
    close(log_prob.grad, [[-math.sqrt(2.0) / 2, -math.sqrt(2.0) / 2, 0.0]])


def test_gspo_on_packed_segments_equals_gspo_on_rows():
    g = torch.Generator().manual_seed(0)
    log_prob = torch.randn(2, 3, generator=g) * 0.1
    old_log_prob = torch.randn(2, 3, generator=g) * 0.1
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    rows, _ = algos.gspo_policy_loss(log_prob, old_log_prob, adv, mask, clip_low=0.05, clip_high=0.05)
    keep = mask.bool()  # packing drops the padding: 5 tokens in segments 0, 0, 0, 1, 1
    packed, _ = algos.gspo_policy_loss(
        log_prob[keep][None],
        old_log_prob[keep][None],
        adv[keep][None],
        torch.ones(1, 5),
        clip_low=0.05,
        clip_high=0.05,
        segment_ids=torch.tensor([[0, 0, 0, 1, 1]]),
    )
    close(packed, rows)


def test_value_loss_by_hand():
    values = torch.tensor([[1.0, 2.0]])
    old = torch.tensor([[1.0, 1.0]])
    returns = torch.tensor([[3.0, 3.0]])
    loss, metrics = algos.value_loss(values, old, returns, torch.ones(1, 2), clip_range=0.5)
    # token 0: V = V_clip = 1, ½·(1-3)² = 2
    # token 1: V = 2 -> (2-3)² = 1; V_clip = 1.5 -> (1.5-3)² = 2.25; ½·max = 1.125 (clipped wins)
    close(loss, (2.0 + 1.125) / 2)
    close(metrics["vf_clipfrac"], 0.5)


# ── KL ──────────────────────────────────────────────────────────────────────────────────────────
def test_kl_estimators_by_hand():
    log_prob = torch.zeros(2)
    ref = torch.tensor([LN2, -LN2])  # π_ref/π = 2 and 0.5
    # x = ln 2:   k1 = -0.693147, k2 = 0.240227, k3 = (2 - 1) - 0.693147 = 0.306853
    # x = -ln 2:  k1 =  0.693147, k2 = 0.240227, k3 = (0.5 - 1) + 0.693147 = 0.193147
    close(algos.kl_penalty(log_prob, ref, "k1"), [-0.693147, 0.693147])
    close(algos.kl_penalty(log_prob, ref, "k2"), [0.240227, 0.240227])
    close(algos.kl_penalty(log_prob, ref, "k3"), [0.306853, 0.193147])
    with pytest.raises(ValueError, match="k3"):
        algos.kl_penalty(log_prob, ref, "k4")


def test_kl_in_reward_only_touches_response_tokens():
    rewards = torch.tensor([[0.0, 1.0]])
    log_prob = torch.tensor([[0.5, 0.2]])
    new, metrics = algos.apply_kl_penalty(
        rewards, log_prob, torch.zeros(1, 2), torch.tensor([[1, 0]]), kl_coef=0.1, kind="k1"
    )
    # token 0: 0 - 0.1·0.5; token 1 is masked and keeps its reward
    close(new, [[-0.05, 1.0]])
    close(metrics["kl"], 0.5)


def test_kl_loss_is_aggregated_and_zero_on_empty_mask():
    log_prob = torch.zeros(1, 2)
    ref = torch.tensor([[LN2, -LN2]])
    close(algos.kl_loss(log_prob, ref, torch.ones(1, 2)), (0.306853 + 0.193147) / 2)
    close(algos.kl_loss(log_prob, ref, torch.zeros(1, 2)), 0.0)


def test_adaptive_kl_controller_moves_towards_target():
    ctl = algos.AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    ctl.update(current_kl=9.0, n_steps=256)
    # e = clip(9/6 - 1, ±0.2) = 0.2 -> β = 0.1·(1 + 0.2·256/10000) = 0.100512
    assert ctl.value == pytest.approx(0.100512)
    ctl.update(current_kl=3.0, n_steps=256)
    # e = clip(-0.5) = -0.2 -> β = 0.100512·(1 - 0.00512)
    assert ctl.value == pytest.approx(0.100512 * 0.99488)
    fixed = algos.FixedKLController(0.05)
    fixed.update(100.0, 256)
    assert fixed.value == 0.05


# ── rollout / trainer mismatch ──────────────────────────────────────────────────────────────────
# ρ = π_train/π_rollout per token: row 0 (3, 0.25, 1), row 1 (1.2, 1.5, masked), row 2 (4, 4, masked)
IS_RATIOS = torch.tensor([[3.0, 0.25, 1.0], [1.2, 1.5, 1.0], [4.0, 4.0, 1.0]])
IS_MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 0]])


def _correct(mode):
    return algos.rollout_correction(IS_RATIOS.log(), torch.zeros(3, 3), IS_MASK, mode=mode, low=0.5, high=2.0)


def test_tis_truncates_token_ratios():
    weights, mask, metrics = _correct("tis")
    close(weights, [[2.0, 0.25, 1.0], [1.2, 1.5, 0.0], [2.0, 2.0, 0.0]])
    close(mask, IS_MASK.float())
    close(metrics["masked_fraction"], 0.0)


def test_icepop_masks_tokens_outside_the_band():
    weights, mask, metrics = _correct("icepop")
    # only 1, 1.2 and 1.5 lie in [0.5, 2]
    close(mask, [[0, 0, 1], [1, 1, 0], [0, 0, 0]])
    close(weights, [[0.0, 0.0, 1.0], [1.2, 1.5, 0.0], [0.0, 0.0, 0.0]])
    close(metrics["masked_fraction"], 4 / 7)


def test_seq_mask_tis_masks_whole_sequences_by_geometric_mean():
    weights, mask, metrics = _correct("seq-mask-tis")
    # geometric means: (3·0.25·1)^(1/3) = 0.9086 kept, √(1.2·1.5) = 1.342 kept, √(4·4) = 4 masked
    close(mask, [[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    close(weights, [[2.0, 0.25, 1.0], [1.2, 1.5, 0.0], [0.0, 0.0, 0.0]])
    close(metrics["masked_fraction"], 2 / 7)


def test_seq_mask_tis_on_packed_segments_equals_rows():
    keep = IS_MASK.bool()  # packing drops padding: 7 tokens in segments 0,0,0,1,1,2,2
    weights, mask, _ = algos.rollout_correction(
        IS_RATIOS.log()[keep][None],
        torch.zeros(1, 7),
        torch.ones(1, 7),
        mode="seq-mask-tis",
        segment_ids=torch.tensor([[0, 0, 0, 1, 1, 2, 2]]),
    )
    close(mask, [[1, 1, 1, 1, 1, 0, 0]])
    close(weights, [[2.0, 0.25, 1.0, 1.2, 1.5, 0.0, 0.0]])


def test_mismatch_metrics_by_hand():
    _, _, m = _correct("tis")
    # ratios 3, .25, 1, 1.2, 1.5, 4, 4: Σρ = 14.95, Σρ² = 45.7525
    close(m["is_ratio_mean"], 14.95 / 7)
    close(m["is_ratio_min"], 0.25)
    close(m["is_ratio_max"], 4.0)
    close(m["is_ess"], 14.95**2 / (7 * 45.7525))  # 0.697859
    # k3 = ρ - 1 - ln ρ: 0.901388 + 0.636294 + 0 + 0.017678 + 0.094535 + 2·1.613706 = 4.877306
    close(m["rollout_kl_k3"], 4.877306 / 7)


def test_rollout_correction_empty_mask_has_no_nan():
    for mode in ("tis", "icepop", "seq-mask-tis"):
        weights, _, metrics = algos.rollout_correction(
            torch.zeros(2, 2), torch.ones(2, 2), torch.zeros(2, 2), mode=mode
        )
        close(weights, torch.zeros(2, 2))
        for value in metrics.values():
            close(value, 0.0)


def test_rollout_correction_rejects_bad_bounds():
    with pytest.raises(ValueError, match="low"):
        algos.rollout_correction(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), low=1.5)


# ── reward shaping and filtering ────────────────────────────────────────────────────────────────
def test_overlong_penalty_by_hand():
    lengths = torch.tensor([5, 6, 8, 10, 12])
    out = algos.overlong_penalty(lengths, max_response_length=10, buffer_length=4)
    # free up to 10 - 4 = 6; 8 -> (6 - 8)/4 = -0.5; 10 -> -1; past 10 -> -1
    close(out, [0.0, 0.0, -0.5, -1.0, -1.0])


def test_stop_properly_penalty_scales_or_replaces_truncated_scores():
    scores = torch.tensor([1.0, 1.0, 0.5])
    stopped = torch.tensor([True, False, False])
    close(algos.stop_properly_penalty(scores, stopped, coef=0.0), [1.0, 0.0, 0.0])
    close(algos.stop_properly_penalty(scores, stopped, coef=0.5), [1.0, 0.5, 0.25])
    close(algos.stop_properly_penalty(scores, stopped, coef=-1.0), [1.0, -1.0, -1.0])
    with pytest.raises(ValueError, match="coef"):
        algos.stop_properly_penalty(scores, stopped, coef=2.0)


def test_dynamic_group_filter_keeps_only_varied_groups():
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 0.5])
    # a varied -> keep 0, 1; b all equal, c and d single samples -> dropped
    kept = algos.dynamic_group_filter(scores, ["a", "a", "b", "b", "c", "d"])
    assert kept.tolist() == [0, 1]
    assert algos.dynamic_group_filter(torch.ones(4), torch.tensor([0, 0, 1, 1])).tolist() == []


# ── empty masks everywhere ──────────────────────────────────────────────────────────────────────
def _masked_losses(x: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    other = torch.full_like(x, -3.0)
    return {
        "ppo": algos.ppo_policy_loss(x, other, torch.ones_like(x), mask, clip_c=3.0)[0],
        "gspo": algos.gspo_policy_loss(x, other, torch.ones_like(x), mask)[0],
        "value": algos.value_loss(x, other, torch.ones_like(x), mask)[0],
        "kl": algos.kl_loss(x, other, mask),
        "sum-norm": algos.aggregate_loss(x, mask, "seq-mean-token-sum-norm", max_len=8),
        "whiten": algos.masked_whiten(x, mask).sum(),
    }


def test_every_masked_loss_is_zero_with_zero_gradient_on_an_empty_mask():
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0)).requires_grad_(True)
    for name, loss in _masked_losses(x, torch.zeros(3, 4)).items():
        (grad,) = torch.autograd.grad(loss, x, allow_unused=True)
        assert loss.item() == 0.0, name
        assert grad is None or (grad == 0).all(), name


# ── package surface ─────────────────────────────────────────────────────────────────────────────
def _isort_key(name: str) -> tuple[int, str]:
    # ruff's RUF022 order: CONSTANTS, then Classes, then functions
    return (0 if name.isupper() else 1 if name[0].isupper() else 2, name)


def test_trainer_exports_are_sorted_and_importable():
    assert trainer.__all__ == sorted(trainer.__all__, key=_isort_key)
    for name in trainer.__all__:
        assert getattr(trainer, name) is not None


def test_every_registered_estimator_lives_in_algos():
    assert set(ADVANTAGE_ESTIMATORS.names()) == {
        "gae",
        "grpo",
        "dr_grpo",
        "rloo",
        "reinforce_pp",
        "reinforce_pp_baseline",
    }
    for name in ADVANTAGE_ESTIMATORS:
        assert ADVANTAGE_ESTIMATORS.resolve(name) is getattr(algos, name)
