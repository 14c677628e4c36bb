"""A rollout worker placed as a Ray actor, against a real `hf` server on loopback."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentrl.config import AgentRLConfig
from agentrl.inference import launch_server
from agentrl.rollout.ray_actor import make_rollout_actor
from agentrl.types import FinishReason, Trajectory

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray")


def test_rollout_actor_returns_every_trajectory(assets: Path) -> None:
    model = str(assets / "tiny-random-qwen2")
    server = launch_server("hf", model, startup_timeout_s=600)
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        cfg = AgentRLConfig()
        cfg.model.path = model
        cfg.env.name = "arithmetic"
        cfg.rollout.max_turns = 2
        cfg.rollout.max_tokens_per_turn = 8
        actor = make_rollout_actor(cfg, [server.url])
        groups = ray.get(actor.run_batch.remote([None, None], 2, 5), timeout=600)
        trajs = [Trajectory.from_dict(d) for g in groups for d in g]
        assert [len(g) for g in groups] == [2, 2]
        for t in trajs:
            t.validate()
            assert t.fault is None and t.finish_reason in (FinishReason.DONE, FinishReason.MAX_LENGTH)
            assert t.num_sampled > 0 and t.group_id in ("g0", "g1")
        ray.get(actor.aclose.remote(), timeout=60)
    finally:
        ray.shutdown()
        server.stop()
