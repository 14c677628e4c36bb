"""Per-turn credit: per-turn rewards reach the advantages as documented (values worked out by hand).

A turn's advantage is the outcome advantage plus Σ_{j≥k} γ^{j-k} (r_j - b_j), b_j the group's mean
reward at turn position j over the episodes given one; a missing reward (None) is masked, never 0.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch

from agentrl.chat import ChatTemplate
from agentrl.config import AlgorithmConfig, RolloutConfig, TrainerConfig
from agentrl.envs.recall import RecallEnv, make_recall_row
from agentrl.rollout import AgentLoop
from agentrl.tools.parsers import HermesParser
from agentrl.trainer import algos
from agentrl.trainer.step import train_step
from agentrl.types import Segment, TokenOrigin, Trajectory

NAN = float("nan")
# three episodes of one group, two turns each; episode 1 was given no reward for its turn 2
REWARDS = torch.tensor([[1.0, 0.0], [0.0, NAN], [1.0, 1.0]])
# per row: a prompt token, turn 1's two tokens, a tool token, turn 2's token
TOKEN_TURNS = torch.tensor([[0, 1, 1, 0, 2]] * 3)


def _per_token(a1: float, a2: float) -> list[float]:
    return [0.0, a1, a1, 0.0, a2]


def test_turn_advantages_are_discounted_sums_of_rewards_less_their_position_baseline() -> None:
    adv = algos.turn_advantages(algos.TurnRewards(REWARDS, TOKEN_TURNS, gamma=0.5), ["g"] * 3)
    # position 1: mean 2/3 over all three; position 2: mean 1/2 over episodes 0 and 2 only (1 is masked)
    # ep 0: turn 2 = 0 - 1/2, turn 1 = (1 - 2/3) + 0.5 * (-1/2); ep 1: turn 2 adds nothing; ep 2: 1/3 + 0.5 * 1/2
    expected = torch.tensor([_per_token(1 / 12, -0.5), _per_token(-2 / 3, 0.0), _per_token(7 / 12, 0.5)])
    torch.testing.assert_close(adv, expected)


def test_a_missing_turn_reward_is_masked_not_read_as_zero() -> None:
    masked = algos.turn_advantages(algos.TurnRewards(REWARDS, TOKEN_TURNS), ["g"] * 3)
    zeroed = algos.turn_advantages(algos.TurnRewards(torch.nan_to_num(REWARDS), TOKEN_TURNS), ["g"] * 3)
    assert masked[1, 4] == 0.0  # no reward: no credit either way
    assert zeroed[1, 4] == pytest.approx(-1 / 3)  # a 0 would have been scored below the position's mean
    # one episode alone at a position, or a group of one, has no baseline: 0, as GRPO gives a group of one
    alone = algos.turn_advantages(algos.TurnRewards(torch.tensor([[1.0, NAN], [0.0, 2.0]]), TOKEN_TURNS[:2]),
                                  ["g", "g"])
    assert alone[:, 4].tolist() == [0.0, 0.0]


def test_std_normalisation_and_leave_one_out_per_position() -> None:
    grpo_like = algos.turn_advantages(algos.TurnRewards(REWARDS, TOKEN_TURNS), ["g"] * 3, norm_by_std=True, eps=0.0)
    std1, std2 = math.sqrt(1 / 3), math.sqrt(0.5)  # unbiased, over the given rewards of each position
    assert grpo_like[0, 1].item() == pytest.approx((1 / 3) / std1 + (-0.5) / std2)
    assert grpo_like[2, 4].item() == pytest.approx(0.5 / std2)
    loo = algos.turn_advantages(algos.TurnRewards(REWARDS, TOKEN_TURNS), ["g"] * 3, leave_one_out=True)
    # r - mean of the others: position 1: 1 - 1/2, 0 - 1, 1 - 1/2; position 2: 0 - 1, (none), 1 - 0
    torch.testing.assert_close(loo[:, [1, 4]], torch.tensor([[0.5 - 1.0, -1.0], [-1.0, 0.0], [0.5 + 1.0, 1.0]]))


def test_groups_have_their_own_baselines_and_segments_share_their_episode_row() -> None:
    rewards = torch.tensor([[1.0], [0.0], [5.0], [7.0]])
    adv = algos.turn_advantages(algos.TurnRewards(rewards, torch.tensor([[1]] * 4)), ["a", "a", "b", "b"])
    assert adv[:, 0].tolist() == [0.5, -0.5, -1.0, 1.0]
    # two sequences (segments) of episode 0 and one of episode 1: turns numbered over the episode
    seg = algos.TurnRewards(torch.tensor([[1.0, 2.0], [0.0, 0.0]]), torch.tensor([[1, 0], [2, 0], [1, 2]]),
                            episode_of=torch.tensor([0, 0, 1]))
    assert algos.turn_advantages(seg, ["g", "g", "g"]).tolist() == [[1.5, 0.0], [1.0, 0.0], [-1.5, -1.0]]


def test_grpo_adds_turn_credit_to_the_outcome_and_token_estimators_get_token_rewards() -> None:
    mask = (TOKEN_TURNS > 0).float()
    turns = algos.TurnRewards(REWARDS, TOKEN_TURNS)
    outcome, _ = algos.dr_grpo(torch.tensor([1.0, 0.0, 0.5]), mask, ["g"] * 3)
    both, _ = algos.dr_grpo(torch.tensor([1.0, 0.0, 0.5]), mask, ["g"] * 3, turns=turns)
    torch.testing.assert_close(both - outcome, algos.turn_advantages(turns, ["g"] * 3) * mask)
    placed = algos.turn_token_rewards(turns)
    assert placed.tolist() == [[0, 0, 1, 0, 0], [0, 0, 0, 0, 0], [0, 0, 1, 0, 1]]  # on each turn's last token


def _two_turns(episode: str, reward: float, turn_rewards: list[float | None], *,
               segment: Segment | None = None) -> Trajectory:
    t = Trajectory(reward=reward, group_id="g", episode_id=episode, segment=segment, turn_rewards=turn_rewards)
    t.extend([1, 2], TokenOrigin.PROMPT, 0)
    t.extend([5], TokenOrigin.SAMPLED, 1, logprobs=[-1.0], version=0)
    t.extend([3], TokenOrigin.TOOL, 1)
    t.extend([6], TokenOrigin.SAMPLED, 2, logprobs=[-1.0], version=0)
    return t


def test_train_step_reads_turn_rewards_numbering_turns_over_an_episodes_segments() -> None:
    from test_gateway_grpo import _Recorder

    # episode a in two segments of two turns each (its turns 1-4), episode b in one of two turns
    batch = [_two_turns("a", 1.0, [1.0, None], segment=Segment(0, 2)), _two_turns("a", 1.0, [0.0], segment=Segment(1, 2)),
             _two_turns("b", 0.0, [0.0, 1.0])]
    backend = _Recorder()
    metrics = train_step(backend, batch, AlgorithmConfig(advantage="dr_grpo", rollout_is="none"), TrainerConfig())
    (policy,) = backend.batches
    # outcome (dr_grpo, per episode): a +0.5, b -0.5. Turn positions 1..4 (gamma 1):
    # position 1: a 1, b 0 -> +0.5 / -0.5; position 2: a missing, b 1 -> alone: 0; position 3: a 0 alone: 0
    expected = [0.5 + 0.5, 0.5 + 0.0, 0.5 + 0.0, 0.5 + 0.0, -0.5 - 0.5, -0.5 + 0.0]
    torch.testing.assert_close(policy.advantages[policy.loss_mask > 0], torch.tensor(expected))
    assert metrics["batch/turn_rewards_given"] == 4.0


@pytest.fixture(scope="module")
def template(assets: Path) -> ChatTemplate:
    return ChatTemplate.from_pretrained(assets / "qwen2.5-0.5b-instruct")


def test_an_env_steps_turn_reward_lands_in_the_turns_entry(template: ChatTemplate) -> None:
    from test_compaction import RecallClient

    config = RolloutConfig(max_turns=10, max_total_tokens=2048, compaction={"policy": "summary"})
    client = RecallClient(template, config.compaction.summary_prompt, pages=3)
    segments = asyncio.run(AgentLoop(client, template, HermesParser(), config).run_episode_segments(
        RecallEnv(pages=3, turn_rewards=True), row=make_recall_row(1, pages=3)))
    (traj,) = segments  # three pages fit one context
    # turns 1-3 read a new page each (1.0); turn 4 answers: its step gives no turn reward (the outcome scores it)
    assert (traj.reward, traj.num_turns, traj.turn_rewards) == (1.0, 4, [1.0, 1.0, 1.0])
    traj.validate()


class _JudgedRecall(RecallEnv):
    """Per-turn rewards from a judge that failed on turn 2 (None), and on turn 3 gave no number at all."""

    def __init__(self, third: object) -> None:
        super().__init__(pages=3, turn_rewards=True)
        self.third = third

    async def astep(self, action):  # type: ignore[no-untyped-def]
        obs, reward, terminated, truncated, info = await super().astep(action)
        if info.get("turn") == 2:
            info["turn_reward"] = None
        if info.get("turn") == 3:
            info["turn_reward"] = self.third
        return obs, reward, terminated, truncated, info


def test_a_missing_turn_reward_stays_missing_and_a_bad_one_masks_the_episode(template: ChatTemplate) -> None:
    from test_compaction import RecallClient

    def play(third: object) -> Trajectory:
        loop = AgentLoop(RecallClient(template, pages=3), template, HermesParser(), RolloutConfig(max_turns=10))
        return asyncio.run(loop.run_episode(_JudgedRecall(third), row=make_recall_row(1, pages=3)))

    traj = play(0.25)
    assert (traj.reward, traj.turn_rewards) == (1.0, [1.0, None, 0.25])
    bad = play("good")
    assert (bad.fault, bad.reward, bad.trainable) == ("infra", None, False)
    assert "info['turn_reward'] must be a finite number" in (bad.error or "")
