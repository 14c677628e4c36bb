"""GRPO over gateway episodes that come in segments: one reward per episode in the group statistics,
each segment's tokens with its episode's advantage (the step-wise "broadcast" of rLLM and SkyRL)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from agentrl.config import AlgorithmConfig, TrainerConfig
from agentrl.records.metrics import segment_metrics
from agentrl.trainer.backend import PolicyBatch, TrainerBackend, UpdateResult
from agentrl.trainer.step import train_step
from agentrl.types import Segment, TokenOrigin, Trajectory, final_segments


def _traj(episode: str, reward: float, response: list[int], *, segment: tuple[int, int] | None = None) -> Trajectory:
    t = Trajectory(reward=reward, group_id="g", episode_id=episode)
    t.extend([1, 2], TokenOrigin.PROMPT, 0)
    t.extend(response, TokenOrigin.SAMPLED, 1, logprobs=[-1.0] * len(response), version=0)
    if segment is not None:
        t.segment = Segment(index=segment[0], of=segment[1])
        if segment[0] == segment[1] - 1:
            t.metrics.update({"llm_calls": 3.0, "segments": float(segment[1]), "rewrites": segment[1] - 1.0})
    return t


class _Recorder(TrainerBackend):
    has_reference = False  # type: ignore[assignment]
    has_critic = False  # type: ignore[assignment]
    global_step = 0  # type: ignore[assignment]

    def __init__(self) -> None:
        self.batches: list[PolicyBatch] = []

    def compute_logprobs(self, trajectories: Sequence[Trajectory], *, temperature: float = 1.0) -> torch.Tensor:
        from agentrl.trainer.packing import pad_trajectories

        return pad_trajectories(trajectories).rollout_logprobs

    def update_policy(self, batch: PolicyBatch, algorithm: Any) -> UpdateResult:
        self.batches.append(batch)
        return UpdateResult()

    def compute_ref_logprobs(self, trajectories: Any, *, temperature: float = 1.0) -> Any:  # pragma: no cover
        raise AssertionError

    def compute_values(self, trajectories: Any) -> Any:  # pragma: no cover
        raise AssertionError

    def update_critic(self, batch: Any, algorithm: Any) -> dict[str, float]:  # pragma: no cover
        raise AssertionError

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:  # pragma: no cover
        yield from ()

    def save(self, path: Any, data_position: Any = None) -> None:  # pragma: no cover
        pass

    def load(self, path: Any) -> dict[str, Any]:  # pragma: no cover
        return {}


def test_a_segmented_episode_counts_once_in_its_group_and_every_segment_gets_its_advantage() -> None:
    # Episode a (reward 1) came in three segments, b (reward 0) in one, c (reward 1) in one.
    batch = [
        _traj("a", 1.0, [5], segment=(0, 3)), _traj("a", 1.0, [6, 6], segment=(1, 3)),
        _traj("a", 1.0, [7], segment=(2, 3)), _traj("b", 0.0, [8, 8], segment=(0, 1)), _traj("c", 1.0, [9]),
    ]
    backend = _Recorder()
    metrics = train_step(backend, batch, AlgorithmConfig(advantage="grpo", rollout_is="none"), TrainerConfig())
    (policy,) = backend.batches
    # Per episode: rewards 1, 0, 1 -> mean 2/3, unbiased std sqrt(1/3).
    std = math.sqrt(1 / 3)
    up, down = (1 - 2 / 3) / (std + 1e-6), (0 - 2 / 3) / (std + 1e-6)
    expected = torch.tensor([up, up, up, up, down, down, up])  # every sampled token, in batch order
    torch.testing.assert_close(policy.advantages[policy.loss_mask > 0], expected, atol=1e-5, rtol=0)
    assert metrics["batch/segments"] == 5 and metrics["batch/episodes"] == 3
    # Counted per segment instead, episode a would have moved the group mean to 0.8.
    assert final_segments(batch) == [batch[2], batch[3], batch[4]]


def test_without_segments_the_estimator_runs_as_before() -> None:
    batch = [_traj("a", 1.0, [5]), _traj("b", 0.0, [6])]
    backend = _Recorder()
    metrics = train_step(backend, batch, AlgorithmConfig(advantage="grpo", rollout_is="none"), TrainerConfig())
    assert "batch/segments" not in metrics
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    policy = backend.batches[0]
    torch.testing.assert_close(policy.advantages[policy.loss_mask > 0], torch.tensor([a, -a]), atol=1e-5, rtol=0)


def test_segment_metrics_are_per_episode() -> None:
    batch = [_traj("a", 1.0, [5], segment=(0, 2)), _traj("a", 1.0, [6], segment=(1, 2)),
             _traj("b", 0.0, [7], segment=(0, 1))]
    m = segment_metrics(batch)
    assert m["gateway/segments_per_episode"] == 1.5 and m["gateway/rewrites_per_episode"] == 0.5
    assert m["gateway/rewritten_frac"] == 0.5 and m["gateway/llm_calls_per_episode"] == 3.0
    assert segment_metrics([_traj("c", 0.0, [1])]) == {}
