"""Where a run's roles go on a Ray cluster: the `cluster` section as a plan, reserved in one placement group.

`build_cluster_plan(config)` reads `config.cluster` and returns a `ClusterPlan` (None without
`cluster.address`: one machine, exactly as before): one `Slot` per process the run places, the
trainer ranks (`trainer.num_processes`, each reserving `cluster.trainer`), the LLM servers
(`inference.num_servers`, each `cluster.server`) and the sandbox hosts (`cluster.sandbox_hosts`, each
`cluster.sandbox_cpus`), laid out with `cluster.strategy` (`PACK` or `SPREAD`). What a cluster run
cannot do yet is refused here, naming the key (`FeatureUnavailableError`), so `agentrl validate` finds
it in seconds.

`reserve(plan)` runs in a driver connected to the cluster: it checks the plan against
`ray.cluster_resources()` and each node's resources first (`check_fits`, a `PreflightError` naming
the role and the resource that does not fit, before any actor starts), then creates the one
placement group and waits for it. Trainer rank 0 is pinned to the driver's node (its `node:IP`
resource): the run directory lives there, and rank 0 writes the weight versions and checkpoints
into it. The returned `Reservation` tells each role's actor where to go (`options`) and which node
address it got (`node_ip`), and releases the group at the end. `trial_placement` reserves and
releases the plan for `agentrl validate`, which prints each process's node, and
`unauthenticated_join` tells it whether the cluster lets in a client that has no Ray auth token
(a plain `ray start --head` does: anyone who reaches its port runs code on every node). Nothing
here starts a process of the run.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from agentrl.child_process import run_probe
from agentrl.config import AgentRLConfig
from agentrl.errors import ConfigError, FeatureUnavailableError, PreflightError

__all__ = [
    "ClusterPlan",
    "Reservation",
    "Slot",
    "build_cluster_plan",
    "check_fits",
    "gpu_sharing_warnings",
    "model_on_node",
    "reserve",
    "trial_placement",
    "unauthenticated_join",
]

log = logging.getLogger(__name__)

_GB = 1 << 30
PIN = 0.001
"""How much of a node's `node:IP` resource pins a bundle to that node."""


@dataclass(frozen=True)
class Slot:
    """One process the plan places: its role, its index within the role, and what it reserves."""

    role: str  # "trainer", "server", "sandbox"
    index: int
    cpus: float
    gpus: float = 0.0
    memory_gb: float = 0.0
    key: str = ""
    """The config key its resources come from, for messages."""

    @property
    def name(self) -> str:
        return f"trainer rank {self.index}" if self.role == "trainer" else f"{self.role} {self.index}"

    def bundle(self) -> dict[str, float]:
        """Its Ray bundle (`CPU`, `GPU`, `memory` in bytes; zeros left out)."""
        out = {"CPU": self.cpus, "GPU": self.gpus, "memory": float(int(self.memory_gb * _GB))}
        return {k: v for k, v in out.items() if v > 0}

    def describe(self) -> str:
        parts = [f"{self.cpus:g} CPU"] + ([f"{self.gpus:g} GPU"] if self.gpus else [])
        parts += [f"{self.memory_gb:g} GiB"] if self.memory_gb else []
        return ", ".join(parts)


@dataclass(frozen=True)
class ClusterPlan:
    """The roles of a cluster run and the placement group that holds them (see the module docstring)."""

    address: str
    strategy: str
    slots: tuple[Slot, ...]

    def index(self, role: str, i: int) -> int:
        """The bundle index of the `i`-th process of `role`."""
        for n, slot in enumerate(self.slots):
            if slot.role == role and slot.index == i:
                return n
        raise KeyError(f"the cluster plan has no {role} {i}")

    def count(self, role: str) -> int:
        return sum(s.role == role for s in self.slots)

    def describe(self, nodes: list[str] | None = None) -> list[str]:
        """Lines for `agentrl validate`: the cluster, then each process and, once reserved, its node."""
        lines = [
            f"cluster {self.address}: one placement group of {len(self.slots)} bundles, strategy "
            f"{self.strategy}; the driver, the run directory and trainer rank 0 on the driver's node"
        ]
        for n, slot in enumerate(self.slots):
            where = f" -> node {nodes[n]}" if nodes else ""
            lines.append(f"  {slot.name}: {slot.describe()}{where}")
        lines.append(
            "  rollouts: asyncio tasks in the driver, through the router to each server's node address"
        )
        return lines


def build_cluster_plan(config: AgentRLConfig, purpose: str = "run") -> ClusterPlan | None:
    """The plan `config.cluster` describes, checked; None when `cluster.address` is unset."""
    cluster = config.cluster
    if cluster.address is None:
        return None
    address = cluster.address.strip()
    if not address:
        raise ConfigError("cluster.address is empty; give the Ray head's HOST:PORT (or auto), or remove it.")
    _refuse_what_is_not_built(config, purpose)
    slots: list[Slot] = []
    for role, count, res, key in (
        ("trainer", config.trainer.num_processes, cluster.trainer, "cluster.trainer"),
        ("server", config.inference.num_servers, cluster.server, "cluster.server"),
    ):
        if res.cpus + res.gpus + res.memory_gb <= 0:
            raise ConfigError(
                f"{key}: a process must reserve something (cpus, gpus or memory_gb) so that Ray "
                "can place it; give it cpus=1 at least."
            )
        slots += [Slot(role, i, res.cpus, res.gpus, res.memory_gb, key) for i in range(count)]
    slots += [
        Slot("sandbox", i, cluster.sandbox_cpus, key="cluster.sandbox_cpus")
        for i in range(cluster.sandbox_hosts)
    ]
    return ClusterPlan(address, cluster.strategy, tuple(slots))


def _refuse_what_is_not_built(config: AgentRLConfig, purpose: str) -> None:
    key = f"cluster.address={config.cluster.address}"
    if purpose != "run":
        raise FeatureUnavailableError(
            f"{key} with 'agentrl eval': not built yet (evaluation starts its own servers on this machine). "
            "Evaluate on one machine (remove cluster.address), or serve on the cluster and give inference.urls."
        )
    if config.placement == "colocated":
        raise FeatureUnavailableError(
            f"placement=colocated with {key}: not built yet (a trainer rank hosting its own vLLM engine has "
            "not been placed across nodes); use placement=split on a cluster."
        )
    if config.inference.urls:
        raise ConfigError(
            f"inference.urls with {key}: on a cluster the run places and starts its own servers "
            "(cluster.server); remove inference.urls, or remove cluster.address."
        )
    if config.inference.engine not in ("hf", "vllm"):
        raise FeatureUnavailableError(
            f"inference.engine={config.inference.engine} with {key}: not built yet; servers placed on a "
            "cluster are agentrl's hf or vllm servers (they pull new weights over HTTP)."
        )
    if config.trainer.backend != "fsdp2":
        raise FeatureUnavailableError(
            f"trainer.backend={config.trainer.backend} with {key}: not built yet (only FSDP2 ranks have "
            "been run across nodes); use trainer.backend=fsdp2."
        )


# ── against the running cluster ─────────────────────────────────────────────────────────────


def check_fits(
    plan: ClusterPlan, total: dict[str, float], nodes: dict[str, dict[str, float]], driver_ip: str
) -> None:
    """Raise `PreflightError` naming each role and resource the cluster cannot hold.

    `total` is `ray.cluster_resources()`, `nodes` each alive node's resources by address, and
    `driver_ip` the node trainer rank 0 is pinned to.
    """
    problems: list[str] = []
    for resource, unit in (("CPU", 1.0), ("GPU", 1.0), ("memory", float(_GB))):
        need = sum(s.bundle().get(resource, 0.0) for s in plan.slots)
        have = float(total.get(resource, 0.0))
        if need > have + 1e-9:
            by_role: dict[str, float] = {}
            for s in plan.slots:
                by_role[s.key] = by_role.get(s.key, 0.0) + s.bundle().get(resource, 0.0) / unit
            parts = ", ".join(f"{k} {v:g}" for k, v in by_role.items() if v)
            problems.append(
                f"{resource}: the plan needs {need / unit:g} ({parts}), the cluster has {have / unit:g}"
            )
    for n, slot in enumerate(plan.slots):
        candidates = {driver_ip: nodes.get(driver_ip, {})} if n == plan.index("trainer", 0) else nodes
        if not any(_holds(res, slot.bundle()) for res in candidates.values()):
            where = f"the driver's node {driver_ip}" if len(candidates) == 1 else "any single node"
            short = ", ".join(f"{k} {v / (_GB if k == 'memory' else 1):g}" for k, v in slot.bundle().items())
            problems.append(f"{slot.name} ({short}, from {slot.key}) fits on no node: {where} cannot hold it")
    if problems:
        nodes_text = "; ".join(
            f"{ip}: " + ", ".join(f"{k} {v:g}" for k, v in sorted(r.items()) if k in ("CPU", "GPU"))
            for ip, r in sorted(nodes.items())
        )
        raise PreflightError(
            f"The Ray cluster at {plan.address} cannot hold the run's plan; nothing was started:\n  "
            + "\n  ".join(problems)
            + f"\nNodes: {nodes_text}.\nFix: lower what each role reserves (cluster.trainer, cluster.server, "
            "cluster.sandbox_cpus) or how many there are (trainer.num_processes, inference.num_servers, "
            "cluster.sandbox_hosts), or add nodes with 'ray start --address=HEAD:PORT'."
        )


def _holds(node: dict[str, float], bundle: dict[str, float]) -> bool:
    return all(node.get(k, 0.0) + 1e-9 >= v for k, v in bundle.items())


@dataclass
class Reservation:
    """The placement group of a cluster plan: where each role's actor goes, and on which node it landed."""

    plan: ClusterPlan
    group: Any
    nodes: list[str]
    """The address of the node each bundle landed on, in the plan's slot order."""

    def options(self, role: str, i: int) -> dict[str, Any]:
        """`actor_cls.options(**...)` that places the `i`-th process of `role` in its bundle."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        n = self.plan.index(role, i)
        slot = self.plan.slots[n]
        opts: dict[str, Any] = {
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                self.group, placement_group_bundle_index=n, placement_group_capture_child_tasks=False),
            "num_cpus": slot.cpus, "num_gpus": slot.gpus,
        }  # fmt: skip
        if slot.memory_gb:
            opts["memory"] = int(slot.memory_gb * _GB)
        return opts

    def node_ip(self, role: str, i: int) -> str:
        return self.nodes[self.plan.index(role, i)]

    def release(self) -> None:
        import ray.util

        if self.group is not None:
            ray.util.remove_placement_group(self.group)
            self.group = None


def cluster_view() -> tuple[dict[str, float], dict[str, dict[str, float]], str]:
    """(cluster resources, each alive node's resources by address, this driver's node address)."""
    from agentrl.orchestration.ray_calls import cluster_resources, node_ip, nodes

    alive = {str(n["NodeManagerAddress"]): dict(n["Resources"]) for n in nodes() if n.get("Alive")}
    return cluster_resources(), alive, node_ip()


def reserve(plan: ClusterPlan, *, timeout_s: float = 120.0) -> Reservation:
    """Check `plan` against the connected cluster and reserve it in one placement group (see the
    module docstring); raise `PreflightError` when it does not fit or is not granted in `timeout_s`."""
    import ray
    import ray.util

    from agentrl.orchestration.ray_calls import nodes

    total, alive, driver_ip = cluster_view()
    check_fits(plan, total, alive, driver_ip)
    bundles = [s.bundle() for s in plan.slots]
    bundles[plan.index("trainer", 0)][f"node:{driver_ip}"] = PIN
    group = ray.util.placement_group(bundles, strategy=plan.strategy, name=f"agentrl-{int(time.time())}")
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(group)
        raise PreflightError(
            f"The Ray cluster at {plan.address} has the resources the plan needs in total, but did not grant "
            f"them within {timeout_s:.0f} s (other jobs hold them, or no node can take a bundle under strategy "
            f"{plan.strategy}); nothing was started. See 'ray status'."
        ) from None
    table = ray.util.placement_group_table(group)
    by_id = {str(n["NodeID"]): str(n["NodeManagerAddress"]) for n in nodes()}
    placed = [by_id.get(str(table["bundles_to_node_id"][i]), "?") for i in range(len(bundles))]
    for slot, ip in zip(plan.slots, placed, strict=True):
        log.info("cluster: %s on node %s (%s)", slot.name, ip, slot.describe())
    return Reservation(plan, group, placed)


def gpu_sharing_warnings(config: AgentRLConfig) -> list[str]:
    """What `agentrl validate` warns about a cluster plan whose GPU processes reserve no GPU.

    Ray hides the GPUs a process has not reserved from nothing: a trainer rank or server with
    `cluster.*.gpus=0` on a GPU node sees every device and starts on cuda:0, the same one as its
    neighbours, so ranks and the vLLM server share (and overfill) one device."""
    cluster, out = config.cluster, []
    if config.trainer.device == "cuda" and cluster.trainer.gpus <= 0:
        out.append(f"trainer.device=cuda but cluster.trainer.gpus=0: Ray reserves no GPU for the "
                   f"{config.trainer.num_processes} trainer rank(s), so every rank on a node uses its cuda:0; "
                   "give cluster.trainer.gpus=1")
    if config.inference.engine in ("vllm", "sglang") and config.trainer.device == "cuda" and cluster.server.gpus <= 0:
        out.append(f"the {config.inference.engine} servers reserve no GPU (cluster.server.gpus=0): on a GPU node "
                   "each starts on cuda:0 beside the trainer ranks there; give cluster.server.gpus=1 (or CPU servers "
                   "on CPU-only nodes)")
    return out


def model_on_node(model: str, need_cuda: bool = False) -> str | None:
    """Why this node cannot run its part of the run with `model` (a built-in name or a directory),
    or None when it can.

    A built-in name needs its package here (the node converts it at start); a path must be a
    directory on this node; `need_cuda` (a trainer rank with `trainer.device=cuda`) needs a CUDA
    device visible here. Run in each trainer and server bundle by `trial_placement`."""
    if need_cuda:
        import torch

        if not torch.cuda.is_available():
            return "trainer.device=cuda but no CUDA device is visible on this node; use auto or cpu"
    from pathlib import Path

    from agentrl.models import BUILTIN_MODELS, cache_dir, find_packaged_gguf

    if Path(model).expanduser().is_dir():
        return None
    if model in BUILTIN_MODELS:
        if (cache_dir() / model / "config.json").is_file():
            return None
        try:
            find_packaged_gguf(model)
        except Exception as exc:  # FeatureUnavailableError names the package and the install command
            return str(exc)
        return None
    return (f"model.path '{model}' is not a directory here: every node that runs a server or a trainer "
            "rank needs the model at the same path (or give a built-in model name, converted on each node)")


def trial_placement(plan: ClusterPlan, *, model: str | None = None, trainer_cuda: bool = False,
                    timeout_s: float = 60.0) -> list[str]:
    """For `agentrl validate`: join the cluster, reserve the plan, note where each bundle landed,
    check that each trainer and server bundle's node can load `model` (`model_on_node`), release
    it; the plan's lines with each process's node. Starts no process of the run (the run reserves
    again, and Ray may then choose other nodes under `SPREAD`)."""
    import ray

    joined = not ray.is_initialized()
    if joined:
        try:
            ray.init(
                address=plan.address, include_dashboard=False, configure_logging=False, log_to_driver=False
            )
        except (ConnectionError, RuntimeError) as exc:
            raise PreflightError(
                f"cluster.address={plan.address}: cannot join the Ray cluster there ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}). Start its head with 'ray start --head' and "
                "validate from a node of the cluster."
            ) from exc
    try:
        reservation = reserve(plan, timeout_s=timeout_s)
        try:
            problems = _model_problems(plan, reservation, model, trainer_cuda) if model else []
        finally:
            reservation.release()
        if problems:
            raise PreflightError("Not every node can run its part of the run; nothing was started:\n"
                                 + "\n".join(f"  node {node} ({who}): {why}" for node, who, why in problems))
        return plan.describe(reservation.nodes)
    finally:
        if joined:
            ray.shutdown()


_JOIN_WITHOUT_TOKEN = (
    "import sys, ray\n"
    "ray.init(address=sys.argv[1], include_dashboard=False, logging_level='ERROR', log_to_driver=False)\n"
    "print('JOINED', len(ray.nodes()))\n"
)


def unauthenticated_join(address: str, *, timeout_s: float = 90.0) -> str | None:
    """A warning when a client with no Ray auth token can join the cluster at `address`, else None.

    Tried for real: a Python process with every `RAY_AUTH_*` variable removed and a HOME without
    `.ray/auth_token` joins the address. Token auth on (`RAY_AUTH_MODE=token` when the head was
    started) refuses it; a cluster started without it lets it in.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env["HOME"] = os.environ.get("TMPDIR", "/tmp")  # not the user's ~/.ray/auth_token
    done = run_probe([sys.executable, "-c", _JOIN_WITHOUT_TOKEN, address], env=env, timeout_s=timeout_s)
    if done.timed_out:
        return None  # not let in within the deadline: it did not join
    if done.returncode != 0 or "JOINED" not in done.stdout:
        return None
    return (f"the Ray cluster at {address} lets in clients without an auth token: anyone who reaches "
            "its port can run code on every node. Restart it with token auth on (RAY_AUTH_MODE=token "
            "and the same token on every node; docs/placement.md, 'Run on a cluster').")


def _model_problems(
    plan: ClusterPlan, reservation: Reservation, model: str, trainer_cuda: bool
) -> list[tuple[str, str, str]]:
    """(node, role, why) for each trainer rank and server whose node cannot run it (`model_on_node`)."""
    import ray

    check: Any = ray.remote(model_on_node)  # Ray types remote functions by arity; this one has a default
    who = [(slot.role, slot.index) for slot in plan.slots if slot.role in ("trainer", "server")]
    refs = [check.options(**reservation.options(role, i)).remote(model, trainer_cuda and role == "trainer")
            for role, i in who]
    answers = ray.get(refs, timeout=120)
    return [(reservation.node_ip(role, i), f"{role} {i}", why)
            for (role, i), why in zip(who, answers, strict=True) if why]

