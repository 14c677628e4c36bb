"""A step's books: every sampled token of a trained trajectory is in the loss or out of it with its cause.

`batch/loss_tokens` must equal `batch/sampled_tokens` less `batch/masked_tokens/<cause>`, and each
row's causes (`StepReport.masked_tokens`) must say which tokens went where: the first token no logit
predicts, kept-set overflows, a masking rollout correction (ICEPOP), the on-policy gate; segments of
one episode are rows like any other. The trajectory file writes them per trained episode.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from test_step import FakeBackend

from agentrl.config import AlgorithmConfig, TrainerConfig
from agentrl.records.trajectory_log import trajectory_record
from agentrl.trainer.packing import pad_trajectories
from agentrl.trainer.step import train_step_with_tokens
from agentrl.types import MASK_CAUSES, Segment, TokenOrigin, Trajectory


class ShiftedBackend(FakeBackend):
    """The trainer's logprobs are the rollout's plus `deltas[(row, token)]` on those sampled tokens."""

    def __init__(self, deltas: dict[tuple[int, int], float]) -> None:
        super().__init__()
        self.deltas = deltas

    def compute_logprobs(self, trajectories: Sequence[Trajectory], *, temperature: float = 1.0) -> torch.Tensor:
        out = pad_trajectories(trajectories).rollout_logprobs.clone()
        for (row, token), delta in self.deltas.items():
            out[row, token - 1] += delta  # column t holds token t + 1
        return out


def sampled(t: Trajectory, n: int, *, kept: list[list[int]] | None = None) -> Trajectory:
    t.extend([7] * n, TokenOrigin.SAMPLED, 1, logprobs=[-1.0] * n, version=0, kept_sets=kept)
    return t


def episode(reward: float, *, episode: str = "", segment: Segment | None = None) -> Trajectory:
    t = Trajectory(reward=reward, group_id="g", episode_id=episode, segment=segment)
    t.extend([1, 2, 3], TokenOrigin.PROMPT, 0)
    return t


def batch() -> list[Trajectory]:
    """Seven rows, one per way a sampled token leaves the loss, and two segments of one episode."""
    first_sampled = Trajectory(reward=1.0, group_id="g")  # its first token is sampled: nothing predicts it
    rows = [
        sampled(episode(1.0), 4),  # 0: all in the loss
        sampled(episode(0.0), 12),  # 1: token 3+5 is 1.1 nats off: ICEPOP masks it, the gate keeps the row
        sampled(episode(1.0), 5),  # 2: its template re-render differed: the gate masks it
        sampled(episode(0.0), 3, kept=[[7, 8], [], [7]]),  # 3: one kept set overflowed the cap
        sampled(first_sampled, 4),  # 4: the first token
        sampled(episode(1.0, episode="e", segment=Segment(0, 2)), 6),  # 5, 6: one episode in two segments
        sampled(episode(1.0, episode="e", segment=Segment(1, 2)), 2),
    ]
    rows[2].metrics["template_mismatch"] = 1.0
    return rows


def test_every_sampled_token_is_in_the_loss_or_masked_with_its_cause():
    backend = ShiftedBackend({(1, 3 + 5): math.log(3.0)})
    algo = AlgorithmConfig(rollout_is="icepop", rollout_is_cap=2.0)
    report, _ = train_step_with_tokens(backend, batch(), algo, TrainerConfig(), policy_version=0)
    assert [(g.row, g.reason) for g in report.gated] == [(2, "template")]
    assert report.masked_tokens == [
        {}, {"rollout_is": 1}, {"gate": 5}, {"kept_set_overflow": 1}, {"unpredicted": 1}, {}, {},
    ]  # fmt: skip
    m = report.metrics
    assert m["batch/sampled_tokens"] == 4 + 12 + 5 + 3 + 4 + 6 + 2 == 36
    assert {c: m[f"batch/masked_tokens/{c}"] for c in MASK_CAUSES} == {
        "unpredicted": 1.0, "kept_set_overflow": 1.0, "rollout_is": 1.0, "gate": 5.0,
    }  # fmt: skip
    (trained,) = backend.policy_batches
    assert m["batch/loss_tokens"] == trained.loss_mask.sum().item() == 36 - 8
    assert m["batch/segments"] == 7.0 and m["batch/episodes"] == 6.0


def test_the_books_hold_when_nothing_is_masked_and_when_everything_is():
    backend = FakeBackend()
    trajs = [sampled(episode(1.0), 3), sampled(episode(0.0), 2)]
    report, _ = train_step_with_tokens(backend, trajs, AlgorithmConfig(), TrainerConfig(), policy_version=0)
    assert report.masked_tokens == [{}, {}] and report.metrics["batch/loss_tokens"] == 5.0
    assert all(report.metrics[f"batch/masked_tokens/{c}"] == 0.0 for c in MASK_CAUSES)
    for t in trajs:
        t.metrics["template_mismatch"] = 1.0
    report, _ = train_step_with_tokens(FakeBackend(), trajs, AlgorithmConfig(), TrainerConfig(), policy_version=0)
    assert report.masked_tokens == [{"gate": 3}, {"gate": 2}]
    assert report.metrics["batch/loss_tokens"] == 0.0 and report.metrics["batch/masked_tokens/gate"] == 5.0


def test_a_trained_episode_line_says_its_loss_tokens_and_the_masked_ones_by_cause():
    t = sampled(episode(1.0), 5)
    line = trajectory_record(t, None, source="train", step=1, status="trained", masked_tokens={"gate": 5})
    assert (line["num_sampled"], line["loss_tokens"], line["masked_tokens"]) == (5, 0, {"gate": 5})
    line = trajectory_record(t, None, source="train", step=1, status="trained", masked_tokens={})
    assert (line["loss_tokens"], line["masked_tokens"]) == (5, {})
    for status in ("filtered", "eval"):  # not trained: no books
        line = trajectory_record(t, None, source="train", step=1, status=status, masked_tokens={"gate": 5})
        assert "loss_tokens" not in line and "masked_tokens" not in line
    t.fault = "infra"
    line = trajectory_record(t, None, source="train", step=1, status="trained", masked_tokens={})
    assert not line["trained"] and "loss_tokens" not in line
