"""The trainer as Ray actors: one actor per trainer rank, driven as one group.

`TrainerWorker` is one rank: it builds the configured backend (`make_backend`), runs `train_step`
on the batches it is sent, exports the policy's weights through the run's checkpoint engine (rank
0 sends, every rank takes part in gathering the shards), and saves and loads checkpoints. With
`trainer.num_processes > 1` the ranks form a torch.distributed group (gloo on CPU, NCCL on GPU)
whose address the group picks. `TrainerGroup` starts the actors and calls every rank alike, which
is what FSDP2 needs; it returns rank 0's answer. The calls are Ray futures, so the asyncio driver
awaits them while rollouts go on.

Weights (`weights_backend` resolves `weights.backend`):
- `files`: each export is `weights/version-N` in the run directory, a complete Hugging Face model
  directory (safetensors with per-shard checksums, config.json, generation_config.json, the
  tokenizer and the chat template the run used), which the servers read. The newest three are
  kept, plus every version a checkpoint was taken at.
- `http`: rank 0 publishes each export on an HTTP endpoint bound to its node's address (as Ray
  reports it; no address is assumed) and the servers pull it; nothing is written per step. At
  every checkpoint the current version is also written to `weights/version-N` as above, so the
  policy of every checkpoint, and the final one, is a directory `agentrl eval model.path=...` loads.
At start the servers prove they can reach the weights (`check_servers`): they read back a nonce the
trainer wrote into its weights directory, or asked of its endpoint.

With placement `colocated` each rank is a `ColocatedTrainerWorker`: it holds the rank's `TrainerWorker`
and hosts the vLLM engine (`inference.colocated.ColocatedServer`) in the same process, and answers the
same calls as async methods (the blocking trainer calls run on threads, generation on its event loop). The router reaches the engine through
`TrainerGroup.engine_clients()` (`engine_*` actor methods). Around every update the engine sleeps
(frees its KV cache, and in `sync` mode its weights) and wakes after; `update_engines(version)`
streams the trainer's tensors into the engine through the in-process checkpoint engine (checksummed
buckets, no files). The engine's weights change only at that push, so a batch's version labels stay
true; an update waits until the previous one has reached the engine, so a push never carries newer
weights than its version says (async mode trains the next batch only after the last push). The
process is the trainer and every server of the run at once, so the driver keeps a `watch` call
outstanding on each rank, which Ray fails the moment the process dies: the run stops within seconds
naming the trainer, its engine and Ray's cause (`actor_watch.py`), instead of waiting for a server.

On a Ray cluster (`cluster.address`; `cluster.Reservation`), each rank is placed in its bundle of
the run's placement group; rank 0 is on the driver's node, where the run directory is, and the
ranks rendezvous at that node's address on a port free there (gloo on CPU, NCCL for GPU tensors;
the GPU path is written but has not run on a multi-node GPU cluster). A rank on another node
resolves the model there, and writes its checkpoint shard into a directory of its own node, whose
files it returns; `TrainerGroup.save` writes them into the checkpoint on the driver's node, so a
checkpoint is whole without a shared filesystem. On resume such a rank gets the checkpoint's
files from the driver (`TrainerGroup.load`) and loads them from a directory of its node.

Nothing here decides when to train or push: that is `schedule.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentrl.chat import ChatTemplate
from agentrl.config import AgentRLConfig
from agentrl.errors import AgentRLError, ServerUnavailableError, TrainerError, WeightSyncError
from agentrl.orchestration.actor_watch import death_cause
from agentrl.orchestration.placement import PlacementPlan, weights_backend
from agentrl.orchestration.ray_calls import cluster_resources, node_ip
from agentrl.orchestration.run_commands import resume_command
from agentrl.orchestration.worker_logs import route_native_stderr, route_worker_logs
from agentrl.sampling import kept_set_rule
from agentrl.types import StepReport, Trajectory

__all__ = ["ColocatedTrainerWorker", "TrainerGroup", "TrainerWorker", "export_assets"]

log = logging.getLogger(__name__)

SHIP_PIECE_BYTES = 64 << 20

_PROBE_VERSIONS_KEPT = 4
"""The served-policy probe's scores are kept for this many recent versions: an `async` run exports
the next version while the last push is still being checked, never more than one ahead."""
"""Largest piece of a checkpoint file sent between the driver and a rank of another node in one
Ray call: a shard never passes whole through the object store."""

FILES_KEEP_LAST = 3
"""Versions the files engine keeps in `weights/` (besides those a checkpoint was taken at)."""


def export_assets(template: ChatTemplate, model_path: str) -> dict[str, bytes]:
    """The files besides the weights that make an export a complete Hugging Face model directory:
    config.json and generation_config.json of `model_path`, and the run's tokenizer saved with the
    chat template it renders with (`template`, as `build_job` loaded it)."""
    import copy

    tokenizer = template.tokenizer
    if template.template is not None:  # a copy carries it: the run's own tokenizer stays as it is
        tokenizer = copy.copy(tokenizer)
        tokenizer.chat_template = template.template
    assets: dict[str, bytes] = {}
    with tempfile.TemporaryDirectory(prefix="agentrl-assets-") as tmp:
        tokenizer.save_pretrained(tmp)
        for path in sorted(Path(tmp).iterdir()):
            if path.is_file():
                assets[path.name] = path.read_bytes()
    for name in ("config.json", "generation_config.json"):
        if (Path(model_path) / name).is_file():
            assets[name] = (Path(model_path) / name).read_bytes()
    return assets


class TrainerWorker:
    """One trainer rank (see the module docstring); plain class, wrapped by `ray.remote`."""

    def __init__(
        self, config: dict[str, Any], model_path: str, weights_dir: str, *, rank: int = 0, world_size: int = 1,
        master: tuple[str, int] | None = None, threads: int | None = None, weights: str = "files",
        local_rank: int | None = None, ship_checkpoints: bool = False, assets: dict[str, bytes] | None = None,
    ) -> None:
        # Before anything imports vLLM: its start-up goes to the run's logs/, not through Ray to the console.
        log = route_worker_logs(Path(weights_dir).parent / "logs", f"trainer-{rank}")
        if log is not None:
            route_native_stderr(log)  # torch's NUMA notice, written by C++ straight to stderr
        # Ray carries the config as a dict: validated here, once; the backend and train_step take the model.
        self.config = AgentRLConfig.model_validate(config)
        if world_size > 1:
            if master is None:
                raise TrainerError(f"trainer rank {rank} of {world_size} was given no rendezvous address.")
            os.environ.update({
                "RANK": str(rank), "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": str(rank if local_rank is None else local_rank),
                "MASTER_ADDR": master[0], "MASTER_PORT": str(master[1]),
            })  # fmt: skip
        if ship_checkpoints or (master is not None and master[0] != "127.0.0.1"):
            # gloo (and NCCL's bootstrap) bind to the address this host's name resolves to, and fall
            # back to loopback where it resolves to none: on a cluster the peers could not connect.
            # Name the interface that holds this node's address instead.
            iface = _interface_of(_node_ip())
            if iface:
                os.environ.setdefault("GLOO_SOCKET_IFNAME", iface)
                os.environ.setdefault("NCCL_SOCKET_IFNAME", iface)
        if not Path(model_path).is_dir():  # a rank on another node: the built-in model is converted there
            from agentrl.models import resolve_model_path

            model_path = resolve_model_path(self.config.model.path)
        self.ship_checkpoints = ship_checkpoints
        self._outbox: Path | None = None  # a saved checkpoint waiting for the driver (`read_shipped`)
        self._inbox: Path | None = None  # checkpoint files the driver sent for a load (`receive_file`)
        import torch

        if threads:
            torch.set_num_threads(threads)
        from agentrl.trainer.backend import make_backend

        self.model_path = model_path
        self.rank = rank
        self.backend = make_backend(self.config, model_path)
        self.weights = weights
        self.version: int | None = None  # the version of the last export
        self.probe: list[list[int]] | None = None  # the served-policy probe (`set_probe`)
        self.probe_scores: dict[int, list[list[float]]] = {}  # the probe's scores at each recent version
        self.files: Any = None  # rank 0: weights/version-N directories
        self.http: Any = None  # rank 0 with the http engine: the endpoint servers pull from
        self.nonce = ""
        if rank == 0:
            from agentrl.weights import FilesCheckpointEngine, HTTPCheckpointEngine, write_probe

            bucket_bytes = self.config.weights.bucket_mb << 20
            self.files = FilesCheckpointEngine(directory=weights_dir, keep_last=FILES_KEEP_LAST,
                                               bucket_bytes=bucket_bytes, assets=assets or {})
            if weights == "http":
                self.http = HTTPCheckpointEngine(host=node_ip(), bucket_bytes=bucket_bytes)
                self.nonce = self.http.nonce
            elif weights == "files":  # colocated ("inprocess") weights never touch the disk
                self.nonce = write_probe(weights_dir)
        from agentrl.trainer.step import make_kl_controller

        # Kept across steps (adaptive when algorithm.kl_target is set) and saved in checkpoints.
        self.kl_controller = make_kl_controller(self.config.algorithm)
        rollout = self.config.rollout
        self.max_response_tokens = min(rollout.max_total_tokens, rollout.max_turns * rollout.max_tokens_per_turn)
        self.last_tokens: Any = None  # rank 0: the last step's `StepTokens`, for the kept rollouts

    def ready(self) -> int:
        return self.rank

    def weight_endpoint(self) -> dict[str, Any]:
        """Rank 0: where servers find the weights (`location`, `token`) and the probe `nonce` there."""
        if self.http is not None:
            return {"backend": "http", "location": self.http.url, "token": self.http.token, "nonce": self.nonce}
        return {"backend": "files", "location": str(self.files.directory), "token": None, "nonce": self.nonce}

    def train(self, trajectories: list[Trajectory], policy_version: int | None = None,
              allowed_staleness: int = 0) -> StepReport:
        from agentrl.trainer.step import train_step_with_tokens

        # Every rank alike (the entropy is gathered over ranks); rank 0 keeps the per-token values
        # until the next step, for the few kept rollouts the driver asks for (`trainer_tokens`).
        self.last_tokens = None  # the last batch goes before the next one is trained on
        report, tokens = train_step_with_tokens(
            self.backend, trajectories, self.config.algorithm, self.config.trainer,
            temperature=self.config.rollout.temperature, max_response_tokens=self.max_response_tokens,
            kl_controller=self.kl_controller, kept_rule=kept_set_rule(self.config.rollout),
            policy_version=policy_version, allowed_staleness=allowed_staleness, distill=self.config.distill,
        )  # fmt: skip
        self.last_tokens = tokens if self.rank == 0 else None
        return report

    def trainer_tokens(self, indices: list[int]) -> dict[int, tuple[list[float | None], list[float | None] | None]]:
        """Rank 0: the trainer's per-token (logprobs, entropy or None) of the last batch's
        `trajectories[i]` for each i of `indices` (its trainable ones, the only ones a driver sends),
        each as long as the trajectory's ledger, None where not scored. {} before the first step."""
        if self.last_tokens is None:
            return {}
        return {i: self.last_tokens.of(i) for i in indices if 0 <= i < len(self.last_tokens.trained)}

    def score_probe(self, sequences: list[list[int]]) -> list[list[float]]:
        """The trainer's logprob of every id after the first of each sequence (temperature 1), at its
        current weights. Every rank alike (the scoring is sharded)."""
        from agentrl.orchestration.served_policy import probe_trajectories

        rows = self.backend.compute_logprobs(probe_trajectories(sequences))
        # the trainer's rows are shifted: position j holds the logprob of id j + 1 (`pad_trajectories`)
        return [[float(x) for x in rows[i, : len(seq) - 1].tolist()] for i, seq in enumerate(sequences)]

    def set_probe(self, sequences: list[list[int]]) -> None:
        """The served-policy probe (`served_policy`): from now on every export scores it at the
        weights it publishes, before any later update can move them."""
        self.probe = sequences

    def keep_probe_scores(self, version: int) -> None:
        if self.probe is not None:
            self.probe_scores[version] = self.score_probe(self.probe)
            for old in sorted(self.probe_scores)[:-_PROBE_VERSIONS_KEPT]:
                del self.probe_scores[old]

    def probe_scores_at(self, version: int) -> list[list[float]]:
        """The trainer's side of the served-policy check at `version`: the scores kept when `version`
        was exported or pushed (in `async` mode the next export may come before this push's check), or,
        for the weights the trainer holds now and never published (those it started from), scored now."""
        if self.probe is None:
            raise RuntimeError("set_probe comes before probe_scores_at")
        if version not in self.probe_scores:
            if self.probe_scores and version < max(self.probe_scores):
                raise TrainerError(f"the trainer's probe scores at weight version {version} were not kept (it "
                                   f"keeps versions {sorted(self.probe_scores)}): they cannot be scored again")
            self.keep_probe_scores(version)
        return self.probe_scores[version]

    def _send(self, engine: Any, version: int) -> None:
        named = self.backend.export_weights()
        if self.rank == 0:
            engine.send(named, version)
        else:
            for _ in named:  # take part in gathering every shard; rank 0 sends
                pass

    def export(self, version: int) -> tuple[str, float]:
        """Publish the policy's weights as `version` through the run's engine; return (source, seconds):
        the version's directory (files) or the endpoint's URL (http)."""
        start = time.perf_counter()
        self._send(self.http or self.files, version)
        self.version = version
        self.keep_probe_scores(version)  # at the weights just published, before an update moves them
        source = "" if self.rank else (self.http.url if self.http is not None else str(self.files.path_for(version)))
        return source, time.perf_counter() - start

    def save(self, path: str, data_position: dict[str, Any], *,
             weights_version: int | None = None) -> tuple[float, dict[str, int]]:
        """Save the trainer's state, and keep the current version as a complete HF directory in `weights/`.

        `weights_version` is the version the trainer's tensors carry now; by default the last one
        exported (none before the first export: then no weights are kept).
        Returns (seconds, files): a rank on another node than the driver's (`ship_checkpoints`) saves
        into an outbox directory of its own node and returns what it wrote there (relative path ->
        size), which the driver reads piece by piece (`read_shipped`, then `drop_shipped`) into
        `path`, so no shard passes whole through Ray's object store; the others write `path`
        directly and return no files.
        """
        start = time.perf_counter()
        self.drop_shipped()
        if self.ship_checkpoints:
            self._outbox = Path(tempfile.mkdtemp(prefix="agentrl-shard-"))
        target = str(self._outbox) if self._outbox is not None else path
        shipped: dict[str, int] = {}
        try:
            self.backend.save(target, {**data_position, "kl_coef": self.kl_controller.value})
        except BaseException:
            self.drop_shipped()
            raise
        if self._outbox is not None:
            shipped = {str(f.relative_to(self._outbox)): f.stat().st_size
                       for f in sorted(self._outbox.rglob("*")) if f.is_file()}
        version = self.version if weights_version is None else weights_version
        if version is not None:
            if self.weights != "files":  # http, inprocess: nothing was written per step: write this one
                self._send(self.files, version)
            if self.rank == 0:
                self.files.keep(version)
        return time.perf_counter() - start, shipped

    def read_shipped(self, name: str, offset: int, size: int) -> bytes:
        """`size` bytes at `offset` of file `name` of the last checkpoint this rank saved to ship."""
        if self._outbox is None:
            raise TrainerError("read_shipped: this rank holds no checkpoint to ship (save first).")
        with open(self._outbox / name, "rb") as f:
            f.seek(offset)
            return f.read(size)

    def drop_shipped(self) -> None:
        """Remove the outbox of a shipped checkpoint (the driver has written it)."""
        import shutil

        if self._outbox is not None:
            shutil.rmtree(self._outbox, ignore_errors=True)
            self._outbox = None

    def receive_file(self, name: str, offset: int, data: bytes) -> None:
        """Write a piece of a checkpoint file the driver sends (a rank of another node resuming)."""
        if self._inbox is None:
            self._inbox = Path(tempfile.mkdtemp(prefix="agentrl-resume-"))
        target = self._inbox / name
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "r+b" if offset else "wb") as f:
            f.seek(offset)
            f.write(data)

    def load(self, path: str, received: bool = False) -> dict[str, Any]:
        """Load a checkpoint: from `path`, or, on a rank of another node (`received`), from the
        files the driver sent it piece by piece (`receive_file`), removed after the load."""
        import shutil

        local = self._inbox if received else None
        if received and local is None:
            raise TrainerError("load: no checkpoint files were received on this rank's node.")
        try:
            position = self.backend.load(str(local) if local is not None else path)
        finally:
            if local is not None:
                shutil.rmtree(local, ignore_errors=True)
                self._inbox = None
        if "kl_coef" in position:
            self.kl_controller.value = float(position["kl_coef"])
        return position


class ColocatedTrainerWorker:
    """A trainer rank that hosts the inference engine too (placement `colocated`; see the module
    docstring). An async Ray actor that holds the rank's `TrainerWorker` (`trainer`) and the engine's
    server (`server`): generation requests are served on its event loop while the blocking trainer
    calls run on threads."""

    def __init__(self, config: dict[str, Any], model_path: str, weights_dir: str, *,
                 release_weights: bool = False, **kwargs: Any) -> None:
        self.trainer = TrainerWorker(config, model_path, weights_dir, **kwargs)
        from agentrl.inference.colocated import ColocatedServer, InProcessVLLM

        cfg = self.trainer.config
        inf = cfg.inference
        engine = InProcessVLLM(
            self.trainer.model_path, max_model_len=inf.max_model_len, kv_cache_bytes=int(inf.cpu_kv_cache_gb * 2**30),
            prefix_caching=inf.prefix_caching, enforce_eager=inf.enforce_eager, dtype=cfg.model.dtype,
            seed=cfg.run.seed, gpu_memory_utilization=inf.gpu_memory_utilization,
            trust_remote_code=cfg.model.trust_remote_code,
        )  # fmt: skip
        engine.start_blocking()  # the engine loads while the driver sets up; calls queue behind it
        self.server = ColocatedServer(engine)
        self.release_weights = release_weights
        self.trainer_version = 0  # the version of the trainer's tensors (set by a push, +1 per update)
        self._pushed: asyncio.Event | None = None

    async def ready(self) -> int:
        return self.trainer.rank

    async def watch(self) -> None:
        """Never answers: the driver keeps this call outstanding (`TrainerGroup.watch`) so that Ray
        fails it the moment this process, and the engine in it, dies."""
        await asyncio.Event().wait()

    async def weight_endpoint(self) -> dict[str, Any]:
        return self.trainer.weight_endpoint()

    async def train(self, trajectories: list[Trajectory], policy_version: int | None = None,
                    allowed_staleness: int = 0) -> StepReport:
        from agentrl.inference.colocated import trim_heap

        start = time.perf_counter()
        while self.server.weight_version != self.trainer_version:  # the last update has not reached the engine
            self._pushed = self._pushed or asyncio.Event()
            self._pushed.clear()
            await self._pushed.wait()
        waited = time.perf_counter() - start
        await self.server.sleep(weights=self.release_weights)
        try:
            report = await asyncio.to_thread(self.trainer.train, trajectories, policy_version, allowed_staleness)
        finally:
            trim_heap()  # the activations' pages go back before the engine takes its KV cache again
            if not self.release_weights:
                await self.server.wake()
        self.trainer_version += 1
        phases = self.server.engine.phase_s
        report.metrics.update({"time/engine_sleep_s": phases.get("sleep_s", 0.0), "time/wait_push_s": waited})
        if not self.release_weights:
            report.metrics["time/engine_wake_s"] = phases.get("wake_s", 0.0)
        return report

    async def trainer_tokens(self, indices: list[int]) -> dict[int, tuple[list[float | None], list[float | None] | None]]:
        return self.trainer.trainer_tokens(indices)

    async def set_probe(self, sequences: list[list[int]]) -> None:
        self.trainer.set_probe(sequences)

    async def probe_scores_at(self, version: int) -> list[list[float]]:
        return await asyncio.to_thread(self.trainer.probe_scores_at, version)

    async def update_engines(self, version: int) -> dict[str, float]:
        """Stream the trainer's weights into this rank's engine as `version` (in memory, checksummed
        buckets). Requests running on the old weights finish first. Returns the push's phases in
        seconds: `pause_s` (waiting for those requests), `load_s` (sending and loading, which run at
        once), `total_s`."""
        from agentrl.weights import make_checkpoint_engine

        start = time.perf_counter()
        sender = make_checkpoint_engine("inprocess", bucket_bytes=self.trainer.config.weights.bucket_mb << 20)
        async with self.server.weight_update(version):
            paused = time.perf_counter()
            # Sender and receiver run at once on two threads; buckets are copied out as they land
            # (vLLM holds a layer's tensors until the layer is complete).
            await asyncio.gather(
                asyncio.to_thread(sender.send, self.trainer.backend.export_weights(), version),
                self.server.engine.load_tensors(lambda: sender.receive(copy=True)),
            )
            loaded = time.perf_counter()
            # inside the block: no update can start before the engine serves `version`
            await asyncio.to_thread(self.trainer.keep_probe_scores, version)
        self.trainer_version = version
        if self._pushed is not None:
            self._pushed.set()
        return {"pause_s": paused - start, "load_s": loaded - paused, "total_s": time.perf_counter() - start}

    async def export(self, version: int) -> tuple[str, float]:
        return await asyncio.to_thread(self.trainer.export, version)

    async def save(self, path: str, data_position: dict[str, Any]) -> tuple[float, dict[str, int]]:
        # Weights reach the engine in memory, so a checkpoint is the only place they are written:
        # the trainer's tensors as they are now (version `trainer_version`), a complete HF directory
        # `agentrl eval model.path=runs/NAME/weights/version-N` loads.
        return await asyncio.to_thread(self.trainer.save, path, data_position, weights_version=self.trainer_version)

    async def load(self, path: str, received: bool = False) -> dict[str, Any]:
        return await asyncio.to_thread(self.trainer.load, path, received)

    # ── the engine's server contract, for `ColocatedClient` ──
    async def engine_generate(self, request: Any) -> Any:
        return await self.server.generate(request)

    async def engine_score(self, request: Any) -> Any:
        return await self.server.score(request)

    async def engine_health(self) -> Any:
        return self.server.health()

    async def engine_pause(self, abort: bool) -> Any:
        await self.server.pause(abort=abort)
        return self.server.health()

    async def engine_resume(self) -> Any:
        self.server.resume()
        return self.server.health()

    async def engine_metrics(self) -> Any:
        queried, hits = self.server.engine.prefix_cache_stats()
        return self.server.metrics.model_copy(update={"prefix_cache_queries": queried, "prefix_cache_hits": hits})


async def _actor_call(actor: Any, server_id: str, method: str, *args: Any,
                      on_death: Callable[[BaseException], None] | None = None) -> Any:
    """Run `actor.method(*args)` for a `ColocatedClient`; a dead actor is an unavailable server (and
    is reported to `on_death`, `TrainerGroup.watch`'s ear), and a cancelled call cancels the remote
    one (the engine then aborts the request)."""
    import ray
    import ray.exceptions

    ref = getattr(actor, method).remote(*args)
    try:
        return await ref
    except asyncio.CancelledError:
        ray.cancel(ref)
        raise
    except ray.exceptions.RayActorError as exc:
        if on_death is not None and isinstance(exc, ray.exceptions.ActorDiedError):
            on_death(exc)
        raise ServerUnavailableError(f"{server_id}: the trainer process hosting this engine is gone "
                                     f"({type(exc).__name__}); see the run's driver.log.") from exc
    except ray.exceptions.RayTaskError as exc:
        cause = exc.cause if getattr(exc, "cause", None) is not None else exc
        if isinstance(cause, AgentRLError):
            raise cause from None
        raise ServerUnavailableError(f"{server_id}: {method} failed: {type(cause).__name__}: {cause}") from exc


async def _awaited(ref: Any) -> Any:
    """Await a Ray object ref (a coroutine, so that `asyncio.wait` can take it as a task)."""
    return await ref


def _node_ip() -> str:
    return node_ip()


def _interface_of(ip: str) -> str | None:
    """The network interface whose (first IPv4) address is `ip` on this machine (None if none; Linux)."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                raw = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name[:15].encode()))
            except OSError:  # no IPv4 address on it
                continue
        if socket.inet_ntoa(raw[20:24]) == ip:
            return name
    return None


def _free_port(host: str) -> int:
    """A port free on `host`, an address of this (the driver's) node."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class TrainerGroup:
    """`trainer.num_processes` TrainerWorker actors called as one (see the module docstring)."""

    colocated = False
    """Whether the ranks host the run's vLLM engines (placement colocated); set by `__init__`."""
    _reported_death: tuple[int, BaseException] | None = None
    """(rank, Ray's error) of the first engine call that found a rank's process dead (`_died`)."""
    _death_reported: asyncio.Event | None = None
    """Set by `_died` while `watch` waits."""

    def __init__(self, config: AgentRLConfig, model_path: str, template: ChatTemplate, weights_dir: str | Path, *,
                 plan: PlacementPlan | None = None, reservation: Any | None = None) -> None:
        """`model_path`, `template`: the model directory and chat template `build_job` resolved (the
        exports carry that tokenizer and template). `weights_dir` is `weights/` in the run directory,
        whose command to continue the run (`resume_command`) the trainer's errors name."""
        import ray
        import ray.util

        colocated_plan = plan if plan is not None and plan.colocated else None
        self.colocated = colocated_plan is not None
        self.weights = "inprocess" if self.colocated else weights_backend(config)
        self.weights_dir = Path(weights_dir)
        self.resume_command = resume_command(config, self.weights_dir.parent)
        self.endpoint: dict[str, Any] = {}
        n = config.trainer.num_processes
        use_gpu = config.trainer.device == "cuda" or (
            config.trainer.device == "auto" and bool(cluster_resources().get("GPU"))
        )
        cpus = os.cpu_count() or 1
        worker_cls = ColocatedTrainerWorker if self.colocated else TrainerWorker
        extra: dict[str, Any] = (
            {"release_weights": colocated_plan.release_weights_while_training, "weights": self.weights}
            if colocated_plan is not None
            else {"weights": self.weights}
        )
        actor_cls = ray.remote(num_cpus=0 if not use_gpu else 1, num_gpus=1 if use_gpu else 0)(worker_cls)
        payload = config.model_dump(mode="json")
        assets = export_assets(template, model_path)  # rank 0 writes them beside every export
        self.ships = [False] * n  # which ranks run on another node than the driver's
        self.nodes: list[str | None] = [None] * n  # each rank's node on a cluster (None: the driver's machine)
        if reservation is None:
            # One machine: the ranks stay on the driver's node (Ray may be a cluster through RAY_ADDRESS
            # without a `cluster` section), so loopback is their rendezvous and the run directory theirs.
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
            master = ("127.0.0.1", _free_port("127.0.0.1")) if n > 1 else None
            # Ray actor handles: their methods are called as `.remote(...)`, which ray leaves untyped
            self.actors: list[Any] = [
                actor_cls.options(scheduling_strategy=here).remote(
                    payload, model_path, str(weights_dir), rank=r, world_size=n, master=master,
                    # Ray shows an actor with num_gpus=1 only its own GPU (CUDA_VISIBLE_DEVICES): cuda:0
                    threads=max(1, cpus // n), local_rank=0 if use_gpu else r, assets=assets if r == 0 else None,
                    **extra,
                )
                for r in range(n)
            ]
        else:
            # Rank 0 is pinned to the driver's node (`cluster.reserve`): the port is taken free here.
            head = reservation.node_ip("trainer", 0)
            master = (head, _free_port(head)) if n > 1 else None
            nodes = [reservation.node_ip("trainer", r) for r in range(n)]
            self.nodes = list(nodes)
            slot_cpus = int(config.cluster.trainer.cpus) or 1
            self.ships = [node != head for node in nodes]
            self.actors = [
                actor_cls.options(**reservation.options("trainer", r)).remote(
                    payload, model_path, str(weights_dir), rank=r, world_size=n, master=master,
                    threads=slot_cpus, local_rank=0 if use_gpu else nodes[:r].count(nodes[r]),
                    ship_checkpoints=self.ships[r], assets=assets if r == 0 else None, **extra,
                )
                for r in range(n)
            ]  # fmt: skip
        self.request_timeout_s = config.rollout.request_timeout_s

    async def _all(self, method: str, *args: Any) -> Any:
        """Call `method` on every rank; rank 0's answer."""
        return (await self._all_results(method, *args))[0]

    async def _all_results(self, method: str, *args: Any) -> list[Any]:
        return await self._gather(method, [getattr(a, method).remote(*args) for a in self.actors])

    async def _gather(self, method: str, refs: list[Any]) -> list[Any]:
        import ray.exceptions

        try:
            results = await asyncio.gather(*refs)
        except ray.exceptions.OutOfMemoryError as exc:
            raise TrainerError(
                f"A trainer process was killed for lack of memory during '{method}'. {_memory_advice(method)} "
                f"(Ray said: {str(exc).splitlines()[0]}), then continue with: {self.resume_command}"
            ) from exc
        except ray.exceptions.RayActorError as exc:
            # Ray's message ends with the error that ended the actor (an exception in its constructor,
            # a signal, ...): name it here, since the actor's own output reaches only the console.
            said = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
            errors = [ln for ln in said if "Error:" in ln or "Exception:" in ln]
            reason = errors[-1][:500] if errors else (death_cause(exc) or (said or [""])[-1][:500])
            hosted = " and the vLLM engine it hosted (placement colocated) with it" if self.colocated else ""
            raise TrainerError(
                f"A trainer process died during '{method}'{hosted} ({self._which(exc)}{type(exc).__name__}: "
                f"{reason}). Fix the "
                f"cause and continue with: {self.resume_command}"
            ) from exc
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            if isinstance(cause, AgentRLError):
                raise cause from None
            raise TrainerError(f"The trainer failed during '{method}': {type(cause).__name__}: {cause}") from exc
        return list(results)

    def _which(self, exc: BaseException) -> str:
        """Which rank `exc` (a `RayActorError`) is about, as `rank R on node N; ` (on a cluster the node
        is where that rank's own output and the cause are); "" when Ray did not say which actor."""
        dead = getattr(exc, "actor_id", None)
        if not dead:
            return ""
        for rank, actor in enumerate(self.actors):
            with contextlib.suppress(AttributeError):  # a handle without an id: Ray's internals changed
                if actor._actor_id.hex() == dead:
                    node = self.nodes[rank]
                    return f"rank {rank} on node {node}; " if node else f"rank {rank}; "
        return ""

    async def ready(self) -> None:
        await self._all("ready")
        rank0: Any = self.actors[0]
        self.endpoint = await rank0.weight_endpoint.remote()

    def weight_source(self, version: int) -> tuple[str, str | None]:
        """(source, token) the servers load `version` from: its directory (files) or the endpoint (http)."""
        if not self.endpoint:
            raise TrainerError("weight_source() before ready(): the trainer has not started yet.")
        if self.endpoint["backend"] == "http":
            return self.endpoint["location"], self.endpoint["token"]
        return str(self.weights_dir / f"version-{version:08d}"), None

    async def check_servers(self, router: Any) -> None:
        """Check at start that every server reaches the trainer's weights; raise with the fix if not."""
        location, token = self.endpoint["location"], self.endpoint["token"]
        try:
            await router.check_weight_source(location, self.endpoint["nonce"], token=token)
        except WeightSyncError as exc:
            fix = ("the files engine needs a directory that the trainer and every server share: use "
                   "weights.backend=http, or a run directory (run.output_dir) every node mounts"
                   if self.weights == "files" else
                   "the servers must reach the trainer node's address over TCP (firewall, routes)")
            raise WeightSyncError(f"weights.backend={self.weights}: {exc}. Fix: {fix}.") from exc

    async def train(self, trajectories: list[Trajectory], policy_version: int | None = None,
                    allowed_staleness: int = 0) -> StepReport:
        """One update on every rank (rank 0's report); `policy_version` and `allowed_staleness` feed
        the on-policy gate."""
        report: StepReport = await self._all("train", trajectories, policy_version, allowed_staleness)
        return report

    async def export(self, version: int) -> tuple[str, float]:
        exported: tuple[str, float] = await self._all("export", version)
        return exported

    async def trainer_tokens(self, indices: list[int]) -> dict[int, tuple[list[float | None], list[float | None] | None]]:
        """The trainer's per-token values of the last batch's trajectories `indices` (rank 0 keeps them)."""
        rank0: Any = self.actors[0]
        values: dict[int, tuple[list[float | None], list[float | None] | None]] = (
            await self._gather("trainer_tokens", [rank0.trainer_tokens.remote(indices)]))[0]
        return values

    async def set_probe(self, sequences: list[list[int]]) -> None:
        """Every rank keeps the served-policy probe and scores it at each export or push (`TrainerWorker.set_probe`)."""
        await self._all("set_probe", sequences)

    async def probe_scores_at(self, version: int) -> list[list[float]]:
        """The trainer's scores of the served-policy probe at weight `version` (`TrainerWorker.probe_scores_at`)."""
        scores: list[list[float]] = await self._all("probe_scores_at", version)
        return scores

    async def save(self, path: str, data_position: dict[str, Any]) -> float:
        """Every rank saves; the shards of ranks on other nodes are copied into `path` here, a
        piece of at most `SHIP_PIECE_BYTES` at a time."""
        results = await self._all_results("save", path, data_position)
        for actor, (_seconds, files) in zip(self.actors, results, strict=True):
            if not files:
                continue
            for name, size in files.items():
                target = Path(path) / name
                target.parent.mkdir(parents=True, exist_ok=True)
                with open(target, "wb") as out:
                    for offset in range(0, size, SHIP_PIECE_BYTES):
                        piece = await self._gather("save", [actor.read_shipped.remote(name, offset, SHIP_PIECE_BYTES)])
                        out.write(piece[0])
            await self._gather("save", [actor.drop_shipped.remote()])
        return float(results[0][0])

    # ── placement colocated ──
    def engine_clients(self) -> list[Any]:
        """One `ColocatedClient` per rank's engine, for the router."""
        import functools

        from agentrl.inference.colocated_client import ColocatedClient

        if not self.colocated:
            raise TrainerError("engine_clients() needs placement=colocated: these trainer ranks host no engine.")
        clients = []
        for rank, actor in enumerate(self.actors):
            server_id = f"colocated-rank-{rank}"
            call = functools.partial(_actor_call, actor, server_id, on_death=functools.partial(self._died, rank))
            clients.append(ColocatedClient(call, server_id, timeout_s=self.request_timeout_s))
        return clients

    def _died(self, rank: int, error: BaseException) -> None:
        """An engine call found rank `rank`'s process dead: wake `watch`, in case Ray has not yet failed
        its own outstanding call (it can lag behind under load, and the run must not wait meanwhile)."""
        if self._reported_death is None:
            self._reported_death = (rank, error)
        if self._death_reported is not None:
            self._death_reported.set()

    async def watch(self) -> None:
        """Wait for a rank's process to die, then raise `TrainerError` naming the trainer and the engine
        it hosted, Ray's cause and the command that continues the run; never returns otherwise.

        Placement colocated only (`actor_watch`): one `ColocatedTrainerWorker.watch` call per rank stays
        outstanding, and Ray fails it as soon as the rank's process is gone; an engine call that Ray
        fails with `ActorDiedError` first (`_died`) ends the wait too, as the same death. A split trainer's ranks
        answer one call at a time, so there its death shows at the next call instead."""
        import ray
        import ray.exceptions

        if not self.colocated:
            raise TrainerError("watch() needs placement=colocated: a split trainer rank answers one call at a "
                               "time, so a call left outstanding would block it.")
        refs = [a.watch.remote() for a in self.actors]
        waits = {asyncio.ensure_future(_awaited(ref)): rank for rank, ref in enumerate(refs)}
        self._death_reported = asyncio.Event()
        if self._reported_death is not None:
            self._death_reported.set()
        reported = asyncio.ensure_future(self._death_reported.wait())
        try:
            done, _ = await asyncio.wait({*waits, reported}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (*waits, reported):
                task.cancel()
            for ref in refs:
                with contextlib.suppress(Exception):  # the actor may be gone already
                    ray.cancel(ref)
        answered = [task for task in done if task is not reported]
        if answered or self._reported_death is None:
            task = answered[0] if answered else next(iter(done))
            rank, error = waits.get(task, -1), task.exception()
        else:
            rank, error = self._reported_death
            log.warning("trainer rank %d: an engine call found its process dead before the watch call did", rank)
        if isinstance(error, ray.exceptions.RayActorError):
            raise TrainerError(
                f"The trainer process (rank {rank}) died, and the vLLM engine it hosted (placement colocated) "
                f"with it ({type(error).__name__}: {death_cause(error) or 'Ray gave no cause'}); the prompts in "
                f"flight are closed as unfinished in ledger.jsonl. If it was killed for lack of memory, lower "
                f"trainer.micro_batch_tokens or inference.cpu_kv_cache_gb. Fix the cause and continue with: "
                f"{self.resume_command}") from error
        raise TrainerError(f"The watch on trainer rank {rank} ended unexpectedly ({error!r}); the trainer may still "
                           f"run. Continue with: {self.resume_command}") from error

    async def update_engines(self, version: int) -> dict[str, float]:
        """Every rank's engine loads that rank's trainer weights as `version`, in memory; the phases
        of the slowest rank's push (`ColocatedTrainerWorker.update_engines`)."""
        phases: list[dict[str, float]] = await self._all_results("update_engines", version)
        return max(phases, key=lambda p: p["total_s"])

    async def load(self, path: str) -> dict[str, Any]:
        """Every rank loads the checkpoint at `path`; ranks on other nodes get its files from here."""
        if not any(self.ships):
            loaded: dict[str, Any] = await self._all("load", path)
            return loaded
        root = Path(path)
        for actor, ship in zip(self.actors, self.ships, strict=True):
            if not ship:
                continue
            for f in sorted(root.rglob("*")):
                if not f.is_file():
                    continue
                name = str(f.relative_to(root))
                with open(f, "rb") as src:
                    offset = 0
                    while True:
                        piece = src.read(SHIP_PIECE_BYTES)
                        if not piece and offset:
                            break
                        await self._gather("load", [actor.receive_file.remote(name, offset, piece)])
                        offset += len(piece)
                        if len(piece) < SHIP_PIECE_BYTES:
                            break
        refs = [a.load.remote(path, ship) for a, ship in zip(self.actors, self.ships, strict=True)]
        state: dict[str, Any] = (await self._gather("load", refs))[0]
        return state

    def shutdown(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor)


def _memory_advice(method: str) -> str:
    """What frees memory for the trainer call `method` that ran out of it."""
    if method in ("save", "load", "export"):
        return ("Writing or reading a checkpoint holds the model and its optimizer state in memory at once: "
                "leave the trainer's node more memory (fewer servers or sandbox hosts on it, a smaller "
                "inference.cpu_kv_cache_gb when the engine shares its node)")
    return ("Lower trainer.micro_batch_tokens (packed attention on CPU is quadratic in it) or turn on "
            "trainer.gradient_checkpointing=true")

