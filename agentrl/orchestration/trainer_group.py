"""The trainer as Ray actors: one actor per trainer rank, driven as one group.

`TrainerWorker` is one rank: it builds the configured backend (`make_backend`), runs `train_step`
on the batches it is sent, exports the policy's weights through the files checkpoint engine (rank
0 writes, every rank takes part in gathering the shards), and saves and loads checkpoints. With
`trainer.num_processes > 1` the ranks form a torch.distributed group (gloo on CPU, NCCL on GPU)
whose address the group picks. `TrainerGroup` starts the actors and calls every rank alike, which
is what FSDP2 needs; it returns rank 0's answer. The calls are Ray futures, so the asyncio driver
awaits them while rollouts go on.

Nothing here decides when to train or push: that is `schedule.py`.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path
from typing import Any

from agentrl.config import AgentRLConfig
from agentrl.errors import AgentRLError, TrainerError
from agentrl.types import Trajectory

__all__ = ["TrainerGroup", "TrainerWorker"]


class TrainerWorker:
    """One trainer rank (see the module docstring); plain class, wrapped by `ray.remote`."""

    def __init__(
        self, config: dict[str, Any], model_path: str, weights_dir: str, *, rank: int = 0, world_size: int = 1,
        master: tuple[str, int] | None = None, threads: int | None = None,
    ) -> None:
        if world_size > 1:
            assert master is not None  # TrainerGroup always passes it for several ranks
            os.environ.update({
                "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                "MASTER_ADDR": master[0], "MASTER_PORT": str(master[1]),
            })  # fmt: skip
        import torch

        if threads:
            torch.set_num_threads(threads)
        from agentrl.trainer.backend import make_backend
        from agentrl.weights import make_checkpoint_engine

        self.config = AgentRLConfig.model_validate(config)
        self.config.model.path = model_path
        self.rank = rank
        self.backend = make_backend(self.config)
        self.engine = make_checkpoint_engine(
            "files", directory=weights_dir, keep_last=3, bucket_bytes=self.config.weights.bucket_mb << 20
        )
        from agentrl.trainer.step import make_kl_controller

        # Kept across steps (adaptive when algorithm.kl_target is set) and saved in checkpoints.
        self.kl_controller = make_kl_controller(self.config.algorithm)
        rollout = self.config.rollout
        self.max_response_tokens = min(rollout.max_total_tokens, rollout.max_turns * rollout.max_tokens_per_turn)

    def ready(self) -> int:
        return self.rank

    def train(self, trajectories: list[Trajectory]) -> dict[str, float]:
        from agentrl.trainer.step import train_step

        return train_step(
            self.backend, trajectories, self.config.algorithm, self.config.trainer,
            temperature=self.config.rollout.temperature, max_response_tokens=self.max_response_tokens,
            kl_controller=self.kl_controller,
        )  # fmt: skip

    def export(self, version: int) -> tuple[str, float]:
        """Write the policy's weights as `version`; return (directory, seconds)."""
        start = time.perf_counter()
        named = self.backend.export_weights()
        if self.rank == 0:
            self.engine.send(named, version)
        else:
            for _ in named:  # take part in gathering every shard; rank 0 writes
                pass
        return str(self.engine.path_for(version)), time.perf_counter() - start

    def save(self, path: str, data_position: dict[str, Any]) -> float:
        start = time.perf_counter()
        self.backend.save(path, {**data_position, "kl_coef": self.kl_controller.value})
        return time.perf_counter() - start

    def load(self, path: str) -> dict[str, Any]:
        position = self.backend.load(path)
        if "kl_coef" in position:
            self.kl_controller.value = float(position["kl_coef"])
        return position


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class TrainerGroup:
    """`trainer.num_processes` TrainerWorker actors called as one (see the module docstring)."""

    def __init__(self, config: AgentRLConfig, model_path: str, weights_dir: str | Path) -> None:
        import ray

        n = config.trainer.num_processes
        use_gpu = config.trainer.device == "cuda" or (
            config.trainer.device == "auto" and bool(ray.cluster_resources().get("GPU"))
        )
        cpus = os.cpu_count() or 1
        actor_cls = ray.remote(num_cpus=0 if not use_gpu else 1, num_gpus=1 if use_gpu else 0)(TrainerWorker)
        master = ("127.0.0.1", _free_port()) if n > 1 else None
        payload = config.model_dump(mode="json")
        self.actors = [
            actor_cls.remote(  # type: ignore[attr-defined]
                payload, model_path, str(weights_dir), rank=r, world_size=n, master=master,
                threads=max(1, cpus // n),
            )
            for r in range(n)
        ]

    async def _all(self, method: str, *args: Any) -> Any:
        import ray.exceptions

        refs = [getattr(a, method).remote(*args) for a in self.actors]
        try:
            results = await asyncio.gather(*refs)
        except ray.exceptions.OutOfMemoryError as exc:
            raise TrainerError(
                f"A trainer process was killed for lack of memory during '{method}'. Lower "
                "trainer.micro_batch_tokens (packed attention on CPU is quadratic in it) or turn on "
                "trainer.gradient_checkpointing=true, then continue with resume=true run.name=... "
                f"(Ray said: {str(exc).splitlines()[0]})"
            ) from exc
        except ray.exceptions.RayActorError as exc:
            raise TrainerError(
                f"A trainer process died during '{method}' ({type(exc).__name__}); its log is in the run's "
                "driver.log. Fix the cause and continue with resume=true run.name=..."
            ) from exc
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            if isinstance(cause, AgentRLError):
                raise cause from None
            raise TrainerError(f"The trainer failed during '{method}': {type(cause).__name__}: {cause}") from exc
        return results[0]

    async def ready(self) -> None:
        await self._all("ready")

    async def train(self, trajectories: list[Trajectory]) -> dict[str, float]:
        return await self._all("train", trajectories)

    async def export(self, version: int) -> tuple[str, float]:
        return await self._all("export", version)

    async def save(self, path: str, data_position: dict[str, Any]) -> float:
        return await self._all("save", path, data_position)

    async def load(self, path: str) -> dict[str, Any]:
        return await self._all("load", path)

    def shutdown(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor)
