"""Placing a rollout worker on Ray: `RolloutActor`, built from a config and the servers' URLs.

`make_rollout_actor(config, urls)` starts a Ray actor that owns its own router (over the given
server URLs), chat template, parser and `RolloutWorker`, and runs batches on its own event loop
(Ray async actor). It returns trajectories as plain dicts (`Trajectory.to_dict`), which pickle
cheaply and rebuild with `Trajectory.from_dict`. Ray is imported only when an actor is made, so the
rest of the rollout layer stays importable without it. Scheduling many actors and weight pushes
belong to the orchestration layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["RolloutActor", "make_rollout_actor"]


class RolloutActor:
    """The body of the Ray actor (usable in-process too, which is how it is unit-tested)."""

    def __init__(self, config: dict[str, Any], urls: Sequence[str]) -> None:
        from agentrl.config import validate_config
        from agentrl.inference import HTTPServerClient, Router
        from agentrl.orchestration.components import build_agent_loop, env_factory
        from agentrl.rollout.worker import RolloutWorker

        self.config = validate_config(config)
        self.router = Router([HTTPServerClient(u) for u in urls],
                             overload_threshold=self.config.inference.overload_threshold,
                             request_timeout_s=self.config.rollout.request_timeout_s)
        loop = build_agent_loop(self.config, self.router)
        self.worker = RolloutWorker(loop, env_factory(self.config),
                                    max_concurrent=self.config.rollout.max_concurrent_episodes)
        self._started = False

    async def run_batch(
        self, rows: Sequence[dict[str, Any] | None], samples_per_prompt: int, seed: int = 0, first_index: int = 0
    ) -> list[list[dict[str, Any]]]:
        """Roll out every group of `rows`; trajectories come back as dicts, in row order."""
        if not self._started:
            await self.router.start()
            self._started = True
        groups = await self.worker.run_batch(rows, samples_per_prompt, seed=seed, first_index=first_index)
        return [[t.to_dict() for t in g] for g in groups]

    def set_version(self, version: int) -> None:
        """Only servers that report at least `version` get requests from now on."""
        self.router.set_version(version)

    async def aclose(self) -> None:
        from agentrl.tools.session import close_default_sandbox

        await self.router.aclose()
        await close_default_sandbox()


def make_rollout_actor(config: Any, urls: Sequence[str], **ray_options: Any) -> Any:
    """Start a `RolloutActor` on Ray (`ray.init` must have run) and return its handle."""
    import ray

    options = {"num_cpus": 1, "max_concurrency": 1000, **ray_options}
    data = config.model_dump(mode="json") if hasattr(config, "model_dump") else dict(config)
    return ray.remote(RolloutActor).options(**options).remote(data, list(urls))
