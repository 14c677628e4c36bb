"""Hand-checked values for agentrl.trainer.offline_losses: SFT, DPO, IPO, length-normalised DPO.

Each expected number is worked out in the comment beside it from the formula in the module
docstring, and compared within 1e-6.
"""

from __future__ import annotations

import math

import pytest
import torch

from agentrl.trainer.offline_losses import preference_loss, preference_weights, sequence_logprobs, sft_loss


def close(actual: torch.Tensor, expected: float, atol: float = 1e-6) -> None:
    assert abs(float(actual) - expected) <= atol, (float(actual), expected)


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_sft_loss_is_the_token_mean_nll_of_the_masked_tokens_only():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -4.0, -9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 0, 1], [1, 1, 0]])
    loss, metrics = sft_loss(logprobs, mask)
    close(loss, (1 + 3 + 0.5 + 4) / 4)  # 2.125: the -2 and -9 (not assistant tokens) are left out
    close(metrics["nll"], 2.125)
    # seq-mean-token-mean: each row's mean, then their mean: ((1+3)/2 + (0.5+4)/2) / 2 = 2.125 as well here
    loss, _ = sft_loss(logprobs, mask, loss_agg_mode="seq-mean-token-mean")
    close(loss, 2.125)
    # an unbalanced row tells the two apart: token-mean (1 + 0.5 + 4) / 3 = 1.8333..., seq-mean (1 + 2.25) / 2 = 1.625
    mask = torch.tensor([[1, 0, 0], [1, 1, 0]])
    close(sft_loss(logprobs, mask)[0], 5.5 / 3)
    close(sft_loss(logprobs, mask, loss_agg_mode="seq-mean-token-mean")[0], 1.625)


def test_sequence_logprobs_sum_and_count_the_masked_tokens():
    total, count = sequence_logprobs(torch.tensor([[-1.0, -2.0, -3.0]]), torch.tensor([[1, 0, 1]]))
    close(total[0], -4.0)
    close(count[0], 2.0)


def test_dpo_is_minus_log_sigmoid_of_beta_times_the_log_ratio_margin():
    # pair 0: chosen -10 vs ref -11 (+1), rejected -12 vs ref -11 (-1): h = 0.1 * (1 - -1) = 0.2
    # pair 1: the reverse: h = -0.2
    loss, m = preference_loss(t(-10, -12), t(-12, -10), t(-11, -11), t(-11, -11), t(3, 3), t(4, 4), kind="dpo", beta=0.1)
    expected = (math.log1p(math.exp(-0.2)) + math.log1p(math.exp(0.2))) / 2  # 0.5981389 and 0.7981389
    close(loss, expected)
    close(m["margin"], 0.0)
    close(m["accuracy"], 0.5)
    close(m["chosen_reward"], (0.1 * 1 + 0.1 * -1) / 2)
    close(m["logp_margin"], ((-10 - -12) + (-12 - -10)) / 2)


def test_dpo_at_the_reference_is_log_two():
    loss, m = preference_loss(t(-5), t(-7), t(-5), t(-7), t(2), t(2), kind="dpo", beta=0.5)
    close(loss, math.log(2.0))
    close(m["margin"], 0.0)
    close(m["logp_margin"], 2.0)


def test_ipo_squares_the_per_token_margin_minus_one_over_two_beta():
    # pair 0: chosen -6 over 3 tokens, ref -9: +1 per token; rejected -8 over 4 tokens, ref -4: -1 per token
    # h = 1 - (-1) = 2 = 1 / (2 * 0.25): loss 0. Pair 1 at the reference: h = 0, loss (0 - 2)^2 = 4
    loss, m = preference_loss(t(-6, -3), t(-8, -3), t(-9, -3), t(-4, -3), t(3, 1), t(4, 1), kind="ipo", beta=0.25)
    close(loss, (0.0 + 4.0) / 2)
    close(m["margin"], 1.0)


def test_length_normalised_dpo_takes_beta_times_the_per_token_margin():
    # the IPO pair 0 above: per-token margin 2, beta 0.5: h = 1, loss log(1 + e^-1) = 0.3132617
    loss, m = preference_loss(t(-6), t(-8), t(-9), t(-4), t(3), t(4), kind="dpo_norm", beta=0.5)
    close(loss, math.log1p(math.exp(-1.0)))
    close(m["margin"], 1.0)
    # plain DPO on the same numbers: beta * (3 - -4) = 3.5 (long rejected completions weigh more)
    close(preference_loss(t(-6), t(-8), t(-9), t(-4), t(3), t(4), kind="dpo", beta=0.5)[0], math.log1p(math.exp(-3.5)))


def test_unknown_kind_and_bad_beta_are_refused():
    with pytest.raises(ValueError, match="dpo, ipo, dpo_norm"):
        preference_loss(t(-1), t(-1), t(-1), t(-1), t(1), t(1), kind="kto")
    with pytest.raises(ValueError, match="beta"):
        preference_loss(t(-1), t(-1), t(-1), t(-1), t(1), t(1), beta=0.0)


def test_dpo_weights_are_the_derivative_of_the_loss_in_each_summed_logprob():
    # dpo, one of two pairs: dL/ds_c = -beta * sigmoid(-h) / 2 and dL/ds_r = +beta * sigmoid(-h) / 2
    gc, gr, loss, _ = preference_weights(t(-10, -12), t(-12, -10), t(-11, -11), t(-11, -11), t(3, 3), t(4, 4),
                                         kind="dpo", beta=0.1)
    sig = 1 / (1 + math.exp(0.2))  # sigmoid(-0.2) = 0.4501660
    close(gc[0], -0.1 * sig / 2)
    close(gr[0], 0.1 * sig / 2)
    close(gc[1], -0.1 * (1 - sig) / 2)
    close(loss, (math.log1p(math.exp(-0.2)) + math.log1p(math.exp(0.2))) / 2)
    # ipo, one pair: dL/ds_c = 2 (h - 1/(2 beta)) / n_c; at h = 0, beta 0.25: 2 * -2 / 3
    gc, gr, _, _ = preference_weights(t(-3), t(-3), t(-3), t(-3), t(3), t(4), kind="ipo", beta=0.25)
    close(gc[0], -4 / 3)
    close(gr[0], 4 / 4)


def test_weighted_token_logprobs_give_the_same_gradient_as_the_loss_itself():
    """The surrogate sum_t w * logp_t (w the sequence's weight, held constant) has DPO's gradient."""
    torch.manual_seed(0)
    logits = torch.randn(4, 5, 7, dtype=torch.float64, requires_grad=True)  # chosen 0,1 and rejected 2,3
    targets = torch.randint(0, 7, (4, 5))
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [0, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    logprobs = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    sums, counts = sequence_logprobs(logprobs, mask)
    ref = sums.detach() + torch.tensor([0.3, -0.2, 0.1, 0.4], dtype=torch.float64)
    for kind in ("dpo", "ipo", "dpo_norm"):
        args = (sums[:2], sums[2:], ref[:2], ref[2:], counts[:2], counts[2:])
        (direct,) = torch.autograd.grad(preference_loss(*args, kind=kind, beta=0.3)[0], logits, retain_graph=True)
        gc, gr, _, _ = preference_weights(*args, kind=kind, beta=0.3)
        weights = torch.cat([gc, gr])[:, None]
        (surrogate,) = torch.autograd.grad((weights * logprobs * mask).sum(), logits, retain_graph=True)
        torch.testing.assert_close(surrogate, direct, atol=1e-9, rtol=0)


def test_sft_loss_of_a_multi_turn_row_counts_only_the_assistant_tokens():
    """A row laid out as a ledger (prompt 3, call 2, template 1, tool 2, template 1, answer 2 tokens),
    in the trainer's next-token alignment: the loss is the mean NLL of the four sampled tokens."""
    from agentrl.trainer.packing import pad_trajectories
    from agentrl.types import TokenOrigin, Trajectory

    row = Trajectory()
    row.extend([1, 2, 3], TokenOrigin.PROMPT, 0)
    row.extend([10, 11], TokenOrigin.SAMPLED, 1, logprobs=[0.0, 0.0], version=0)
    row.extend([4], TokenOrigin.TEMPLATE, 1)
    row.extend([5, 6], TokenOrigin.TOOL, 1)
    row.extend([7], TokenOrigin.TEMPLATE, 1)
    row.extend([12, 13], TokenOrigin.SAMPLED, 2, logprobs=[0.0, 0.0], version=0)
    padded = pad_trajectories([row])
    # column t scores token t + 1: the sampled tokens 10, 11, 12, 13 sit at ledger positions 3, 4, 9, 10
    assert padded.loss_mask[0].nonzero().flatten().tolist() == [2, 3, 8, 9]
    logprobs = -torch.arange(1, 12, dtype=torch.float64)[None, :]  # -1 at column 0, ..., -11 at column 10
    loss, _ = sft_loss(logprobs, padded.loss_mask)
    close(loss, (3 + 4 + 9 + 10) / 4)  # 6.5: the prompt, template and tool tokens carry no loss
