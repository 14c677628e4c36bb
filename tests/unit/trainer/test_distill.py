"""On-policy distillation's per-token signal against hand-computed values (within 1e-6): the gap
`teacher - rollout` on sampled tokens only, in the trainer's next-token alignment; the advantage of
each mode; and a `train_step` that hands those advantages to the backend."""

from __future__ import annotations

import math

import pytest
import torch

from agentrl.config import DistillConfig, TrainerConfig
from agentrl.errors import TrainerError
from agentrl.trainer.distill import distill_advantages, distill_metrics, teacher_gaps
from agentrl.trainer.step import train_step
from agentrl.types import TokenOrigin, Trajectory
from tests.unit.trainer.test_step import AlgorithmConfig, FakeBackend


def two_turns(reward: float, teacher: tuple[float, float, float], group: str = "g") -> Trajectory:
    """prompt [1, 2], sampled [5, 6] (rollout -1.0, -2.0), tool [7], sampled [8] (rollout -0.5)."""
    t = Trajectory(reward=reward, group_id=group, episode_id=f"e{reward}")
    t.extend([1, 2], TokenOrigin.PROMPT, 0)
    t.extend([5, 6], TokenOrigin.SAMPLED, 1, logprobs=[-1.0, -2.0], version=0)
    t.extend([7], TokenOrigin.TOOL, 1)
    t.extend([8], TokenOrigin.SAMPLED, 2, logprobs=[-0.5], version=0)
    t.teacher_logprobs = [0.0, 0.0, teacher[0], teacher[1], 0.0, teacher[2]]
    t.validate()
    return t


def test_the_gap_is_teacher_minus_rollout_on_sampled_tokens_in_next_token_alignment() -> None:
    t = two_turns(1.0, (-0.25, -2.5, -0.125))
    gaps = teacher_gaps([t], (1, 6))
    # column c holds token c+1: tokens 2, 3 and 5 are sampled; the prompt and the tool token get 0
    expected = torch.tensor([[0.0, 0.75, -0.5, 0.0, 0.375, 0.0]])
    torch.testing.assert_close(gaps, expected, atol=1e-6, rtol=0)


def test_each_mode_forms_its_advantage_on_the_loss_tokens_only() -> None:
    gaps = torch.tensor([[0.0, 0.75, -0.5, 0.0, 0.375, 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0, 1.0, 0.0]])
    env = torch.tensor([[0.0, 0.7, 0.7, 0.0, 0.7, 0.0]])
    alone = distill_advantages(env, gaps, mask, mode="advantage", coef=2.0)
    torch.testing.assert_close(alone, torch.tensor([[0.0, 1.5, -1.0, 0.0, 0.75, 0.0]]), atol=1e-6, rtol=0)
    mixed = distill_advantages(env, gaps, mask, mode="mixed", coef=0.5)
    torch.testing.assert_close(mixed, torch.tensor([[0.0, 1.075, 0.45, 0.0, 0.8875, 0.0]]), atol=1e-6, rtol=0)
    m = distill_metrics(gaps, mask)
    assert m["distill/teacher_gap_mean"] == pytest.approx((0.75 - 0.5 + 0.375) / 3, abs=1e-6)
    assert m["distill/reverse_kl"] == pytest.approx(-(0.75 - 0.5 + 0.375) / 3, abs=1e-6)
    assert (m["distill/teacher_gap_min"], m["distill/teacher_gap_max"]) == (-0.5, 0.75)


def _distill(mode: str, coef: float) -> DistillConfig:
    return DistillConfig.model_validate({"teacher": {"url": "http://127.0.0.1:1"}, "mode": mode, "coef": coef})


def test_a_step_hands_the_backend_the_mixed_advantage_and_reports_the_gap() -> None:
    trajs = [two_turns(1.0, (-0.25, -2.5, -0.125)), two_turns(0.0, (-1.0, -1.0, -1.5))]
    backend = FakeBackend()
    m = train_step(backend, trajs, AlgorithmConfig(advantage="grpo", rollout_is="none"), TrainerConfig(),
                   distill=_distill("mixed", 0.5))
    (batch,) = backend.policy_batches
    a = 0.5 / (math.sqrt(0.5) + 1e-6)  # GRPO over rewards 1, 0: ±0.5 / (unbiased std + eps)
    # gaps: episode 1 (0.75, -0.5, 0.375); episode 2 (0.0, 1.0, -1.0)
    expected = torch.tensor([[0.0, 0.375 + a, -0.25 + a, 0.0, 0.1875 + a, 0.0],
                             [0.0, 0.0 - a, 0.5 - a, 0.0, -0.5 - a, 0.0]])
    torch.testing.assert_close(batch.advantages, expected, atol=1e-6, rtol=0)
    assert m["distill/teacher_gap_mean"] == pytest.approx((0.75 - 0.5 + 0.375 + 0.0 + 1.0 - 1.0) / 6, abs=1e-6)
    assert m["distill/coef"] == 0.5
    assert m["adv/max"] == pytest.approx(0.375 + a, abs=1e-6)  # the advantages the loss used


def test_the_signal_alone_ignores_the_reward() -> None:
    trajs = [two_turns(1.0, (-0.25, -2.5, -0.125)), two_turns(1.0, (-1.0, -1.0, -1.5))]  # equal rewards
    backend = FakeBackend()
    train_step(backend, trajs, AlgorithmConfig(advantage="grpo", rollout_is="none"), TrainerConfig(),
               distill=_distill("advantage", 1.0))
    (batch,) = backend.policy_batches
    expected = torch.tensor([[0.0, 0.75, -0.5, 0.0, 0.375, 0.0], [0.0, 0.0, 1.0, 0.0, -1.0, 0.0]])
    torch.testing.assert_close(batch.advantages, expected, atol=1e-6, rtol=0)


def test_a_trained_episode_without_the_teachers_score_stops_the_step() -> None:
    t = two_turns(1.0, (-0.25, -2.5, -0.125))
    t.teacher_logprobs = []
    with pytest.raises(TrainerError, match="has 3 sampled tokens but no teacher logprobs"):
        train_step(FakeBackend(), [t], AlgorithmConfig(rollout_is="none"), TrainerConfig(),
                   distill=_distill("advantage", 1.0))
