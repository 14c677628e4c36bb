"""`algorithm.objective` picks the micro-batch loss of the shared update loop, and refuses the keys it does not read."""

from __future__ import annotations

import pytest
import torch

from agentrl.config import AlgorithmConfig, load_config
from agentrl.errors import ConfigError
from agentrl.trainer.objective import policy_objective, zero_loss_rows


def tokens(**extra: torch.Tensor) -> dict[str, torch.Tensor]:
    base = {"loss_mask": torch.tensor([[0.0, 1.0, 1.0, 1.0]]), "segment_ids": torch.tensor([[0, 0, 1, 1]]),
            "advantages": torch.tensor([[0.0, 0.5, -0.25, -0.25]]), "old_logprobs": torch.zeros(1, 4)}
    return {**base, **extra}


def test_sft_micro_batch_loss_is_its_share_of_the_mini_batch_nll():
    logprobs = torch.tensor([[-9.0, -1.0, -2.0, -3.0]])
    loss, metrics = policy_objective(logprobs, tokens(), AlgorithmConfig(objective="sft"), denominator=6.0)
    assert float(loss) == pytest.approx((1 + 2 + 3) / 6)  # the mini-batch has 6 loss tokens, this part 3
    assert float(metrics["nll"]) == pytest.approx(2.0)
    assert "ratio_max" not in metrics  # no PPO ratio: nothing of the RL loss runs


def test_preference_micro_batch_loss_is_minus_the_weighted_logprobs():
    logprobs = torch.tensor([[-9.0, -1.0, -2.0, -3.0]], requires_grad=True)
    loss, _ = policy_objective(logprobs, tokens(), AlgorithmConfig(objective="dpo"), denominator=123.0)
    assert float(loss.detach()) == pytest.approx(-(0.5 * -1 + -0.25 * -2 + -0.25 * -3))  # -0.75, whatever the denominator
    loss.backward()
    assert logprobs.grad.tolist() == [[0.0, -0.5, 0.25, 0.25]]


def test_sft_rows_are_never_skipped_as_zero_advantage():
    mask, zeros = torch.ones(2, 3), torch.zeros(2, 3)
    assert zero_loss_rows(zeros, mask, AlgorithmConfig(objective="sft")) is None
    assert zero_loss_rows(zeros, mask, AlgorithmConfig(objective="dpo")).tolist() == [True, True]


@pytest.mark.parametrize(("overrides", "message"), [
    (["algorithm.objective=sft", "algorithm.kl_coef=0.1"], "objective=sft does not read algorithm.kl_coef"),
    (["algorithm.objective=dpo", "algorithm.advantage=rloo", "algorithm.entropy_coef=0.01"],
     "does not read algorithm.advantage, algorithm.entropy_coef"),
    (["algorithm.beta=0.5"], "algorithm.beta is read by the preference objectives (dpo, ipo, dpo_norm) only"),
    (["algorithm.objective=ipo", "algorithm.loss_agg=seq-mean-token-mean"], "algorithm.loss_agg is not read"),
    (["algorithm.objective=kto"], "algorithm.objective"),
])
def test_keys_the_objective_does_not_read_are_refused(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert message in str(err.value)


def test_objective_defaults_to_rl_and_takes_beta_under_the_preference_ones():
    assert load_config(None, []).algorithm.objective == "rl"
    config = load_config(None, ["algorithm.objective=dpo_norm", "algorithm.beta=0.5"])
    assert (config.algorithm.objective, config.algorithm.beta) == ("dpo_norm", 0.5)
