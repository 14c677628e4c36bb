"""The cluster plan: the `cluster` section as one placement group's bundles, refused where a
cluster run is not built, and checked against a cluster's resources before anything starts."""

from __future__ import annotations

import pytest

from agentrl.config import AgentRLConfig, load_config
from agentrl.errors import ConfigError, FeatureUnavailableError, PreflightError
from agentrl.orchestration.cluster import build_cluster_plan, check_fits
from agentrl.orchestration.placement import build_plan

GB = float(1 << 30)


def cfg(*overrides: str) -> AgentRLConfig:
    return load_config(None, ["env=arithmetic", "trainer.device=cpu", "inference.engine=hf", *overrides])


def two_by_two(*overrides: str) -> AgentRLConfig:
    return cfg(
        "cluster.address=10.77.0.1:6379",
        "cluster.strategy=SPREAD",
        "trainer.num_processes=2",
        "inference.num_servers=2",
        *overrides,
    )


def test_without_a_cluster_section_one_machine_plans_as_before() -> None:
    config = cfg()
    assert build_cluster_plan(config) is None
    plan = build_plan(config)
    assert plan.cluster is None and plan.weight_sync == "files"
    assert [r.name for r in plan.roles] == ["trainer", "hf server", "rollouts"]


def test_a_cluster_plan_has_one_bundle_per_process_and_pulls_weights_over_http() -> None:
    config = two_by_two(
        "cluster.server.cpus=0.5",
        "cluster.server.memory_gb=2",
        "cluster.sandbox_hosts=1",
        "cluster.sandbox_cpus=0.25",
    )
    plan = build_plan(config)
    assert plan.placement == "split" and plan.weight_sync == "http"  # auto: no shared filesystem assumed
    cluster = plan.cluster
    assert cluster is not None and cluster.strategy == "SPREAD" and cluster.address == "10.77.0.1:6379"
    assert [s.name for s in cluster.slots] == [
        "trainer rank 0",
        "trainer rank 1",
        "server 0",
        "server 1",
        "sandbox 0",
    ]
    assert [s.bundle() for s in cluster.slots] == [
        {"CPU": 1.0}, {"CPU": 1.0}, {"CPU": 0.5, "memory": 2 * GB}, {"CPU": 0.5, "memory": 2 * GB},
        {"CPU": 0.25},
    ]  # fmt: skip
    assert cluster.index("server", 1) == 3 and cluster.count("trainer") == 2
    text = "\n".join(plan.describe())
    assert "one placement group of 5 bundles, strategy SPREAD" in text
    assert "server 1: 0.5 CPU, 2 GiB" in text
    nodes = ["10.77.0.1", "10.77.0.2", "10.77.0.1", "10.77.0.2", "10.77.0.2"]
    assert cluster.describe(nodes)[4] == "  server 1: 0.5 CPU, 2 GiB -> node 10.77.0.2"
    # auto never colocates on a cluster; files stay possible (checked at start against the servers)
    assert build_plan(two_by_two("placement=auto")).placement == "split"
    assert build_plan(two_by_two("weights.backend=files")).weight_sync == "files"


@pytest.mark.parametrize(("overrides", "error", "key"), [
    (["placement=colocated"], FeatureUnavailableError, "placement=colocated"),
    (["trainer.backend=megatron"], FeatureUnavailableError, "trainer.backend=megatron"),
    (["inference.engine=sglang"], FeatureUnavailableError, "inference.engine=sglang"),
    (["inference.urls=[http://10.77.0.2:8000]"], ConfigError, "inference.urls"),
    (["cluster.server.cpus=0"], ConfigError, "cluster.server"),
    (["cluster.address=' '"], ConfigError, "cluster.address is empty"),
])  # fmt: skip
def test_what_a_cluster_run_cannot_do_is_refused_naming_the_key(overrides, error, key) -> None:
    with pytest.raises(error, match=key.replace(".", r"\.").replace("[", r"\[")):
        build_plan(two_by_two(*overrides))


def test_eval_on_a_cluster_is_refused() -> None:
    with pytest.raises(FeatureUnavailableError, match="agentrl eval"):
        build_plan(two_by_two(), "eval")


NODES = {"10.77.0.1": {"CPU": 2.0, "memory": 6 * GB}, "10.77.0.2": {"CPU": 2.0, "memory": 6 * GB}}
TOTAL = {"CPU": 4.0, "memory": 12 * GB}


def test_a_plan_the_cluster_holds_passes() -> None:
    plan = build_cluster_plan(two_by_two())
    assert plan is not None
    check_fits(plan, TOTAL, NODES, "10.77.0.1")


def test_too_few_cpus_in_total_names_the_resource_and_each_role() -> None:
    plan = build_cluster_plan(two_by_two("cluster.sandbox_hosts=1"))
    assert plan is not None
    with pytest.raises(PreflightError) as info:
        check_fits(plan, TOTAL, NODES, "10.77.0.1")
    text = str(info.value)
    assert (
        "CPU: the plan needs 5 (cluster.trainer 2, cluster.server 2, cluster.sandbox_cpus 1), the cluster has 4"
        in text
    )
    assert "nothing was started" in text and "ray start --address" in text


def test_a_process_no_single_node_can_hold_is_named() -> None:
    plan = build_cluster_plan(
        two_by_two(
            "trainer.num_processes=1",
            "inference.num_servers=1",
            "cluster.server.cpus=3",
            "cluster.trainer.cpus=0.5",
        )
    )
    assert plan is not None
    with pytest.raises(PreflightError, match=r"server 0 \(CPU 3, from cluster.server\) fits on no node"):
        check_fits(plan, {"CPU": 4.0}, NODES, "10.77.0.1")


def test_trainer_rank_0_must_fit_on_the_drivers_node() -> None:
    plan = build_cluster_plan(
        two_by_two("cluster.trainer.memory_gb=5", "inference.num_servers=1", "trainer.num_processes=1")
    )
    assert plan is not None
    nodes = {"10.77.0.1": {"CPU": 2.0, "memory": 4 * GB}, "10.77.0.2": {"CPU": 2.0, "memory": 8 * GB}}
    with pytest.raises(PreflightError, match="trainer rank 0 .* the driver's node 10.77.0.1 cannot hold it"):
        check_fits(plan, {"CPU": 4.0, "memory": 12 * GB}, nodes, "10.77.0.1")
    check_fits(plan, {"CPU": 4.0, "memory": 12 * GB}, nodes, "10.77.0.2")  # driven from the big node: fits


def test_a_server_actor_that_died_is_reported_with_its_own_error_and_node() -> None:
    import ray.exceptions

    from agentrl.orchestration.server_actor import actor_death_reason

    raised = ray.exceptions.RayActorError(None, (
        "The actor died because of an error raised in its creation task, ray::ServerActor.__init__() "
        "(pid=1, ip=10.0.0.2)\n  File \"server_actor.py\", line 54, in __init__\n    raise ConfigError(\n"
        "agentrl.errors.ConfigError: model.path 'm' is not a directory on node 10.0.0.2"), True)
    assert actor_death_reason(raised) == "agentrl.errors.ConfigError: model.path 'm' is not a directory on node 10.0.0.2"
    killed = ray.exceptions.RayActorError(None, (
        "The actor died unexpectedly before finishing this task.\n\tclass_name: ServerActor\n\tactor_id: ab\n"
        "\tpid: 5\n\tip: 10.0.0.2\nThe actor's worker process was killed by SIGABRT"), False)
    assert actor_death_reason(killed) == ("The actor died unexpectedly before finishing this task.; ip: 10.0.0.2; "
                                          "The actor's worker process was killed by SIGABRT")


def test_a_server_that_fails_to_start_on_its_node_is_reported_with_the_node_and_its_own_account() -> None:
    import asyncio

    import ray.exceptions

    from agentrl.errors import ServerUnavailableError, StartupError
    from agentrl.orchestration.server_actor import PlacedServer
    from agentrl.orchestration.startup import starting

    said = ServerUnavailableError(
        "The vllm server exited with code 1 before it became healthy; command: python -m "
        "agentrl.inference.vllm_server\nlast lines of /tmp/work/runs/r/logs/vllm-1.log:\nRuntimeError: no memory")

    class Method:
        def __init__(self, result: object) -> None:
            self.result = result

        def remote(self, *args: object) -> object:
            async def answer() -> object:
                if isinstance(self.result, BaseException):
                    raise self.result
                return self.result

            return answer()

    class Actor:  # the actor started, and its server process died before /health answered
        url = Method("http://10.0.0.2:8000")
        wait_healthy = Method(ray.exceptions.RayTaskError("wait_healthy", "Traceback ...", said))

    server = PlacedServer(lambda port: Actor(), 1, "10.0.0.2", "/tmp/work/runs/r/logs/vllm-1.log")

    async def start() -> None:
        with starting("the inference engine (vllm, model.path=m)", "Check the engine"):
            await server.started(60.0)

    with pytest.raises(StartupError) as raised:
        asyncio.run(start())
    message = str(raised.value)
    assert message.startswith("Could not start the inference engine (vllm, model.path=m): server 1 on node 10.0.0.2: "
                              "The vllm server exited with code 1 before it became healthy")
    assert "last lines of /tmp/work/runs/r/logs/vllm-1.log:\nRuntimeError: no memory" in message
    assert message.endswith("Check the engine.")


def test_a_server_killed_for_lack_of_memory_while_starting_is_reported_with_its_node_and_memory() -> None:
    import asyncio

    import ray.exceptions

    from agentrl.errors import StartupError
    from agentrl.orchestration.server_actor import PlacedServer
    from agentrl.orchestration.startup import starting

    ray_said = ("Task was killed due to the node running low on memory. Memory on the node (IP: 10.0.0.2, ID: ab) "
                "was 22.20GB used / 23.54GB limit (0.943177).\nRefer to the documentation on how to address the out "
                "of memory issue: https://docs.ray.io/en/latest/ray-observability/user-guides/debug-apps/debug-memory.html.")

    class Actor:
        class wait_healthy:  # the actor's method, as its handle has it
            @staticmethod
            def remote(*args: object) -> object:
                async def killed() -> None:
                    raise ray.exceptions.OutOfMemoryError(ray_said)

                return killed()

    server = PlacedServer(lambda port: Actor(), 1, "10.0.0.2", "/tmp/work/runs/r/logs/vllm-1.log")

    async def wait() -> None:
        with starting("the inference engine (vllm, model.path=m)", "Check the engine"):
            await server._call("wait_healthy", 60.0)

    with pytest.raises(StartupError) as raised:
        asyncio.run(wait())
    message = str(raised.value)
    assert message.startswith("Could not start the inference engine (vllm, model.path=m): server 1 on node 10.0.0.2: "
                              "its actor was killed for lack of memory during wait_healthy (Task was killed due to the "
                              "node running low on memory. Memory on the node (IP: 10.0.0.2, ID: ab) was 22.20GB used")
    assert "cluster.server.memory_gb" in message and "docs.ray.io" not in message


def test_gpu_processes_that_reserve_no_gpu_are_warned_about_and_cuda_is_checked_on_the_node() -> None:
    from agentrl.config import load_config
    from agentrl.orchestration.cluster import gpu_sharing_warnings, model_on_node

    base = ["env=arithmetic", "cluster.address=10.0.0.1:6379", "trainer.device=cuda", "trainer.num_processes=2"]
    warned = gpu_sharing_warnings(load_config(None, base))
    assert len(warned) == 2
    assert warned[0].startswith("trainer.device=cuda but cluster.trainer.gpus=0: Ray reserves no GPU for the 2")
    assert "cluster.server.gpus=0" in warned[1] and "cuda:0 beside the trainer ranks" in warned[1]
    reserved = load_config(None, [*base, "cluster.trainer.gpus=1", "cluster.server.gpus=1"])
    assert gpu_sharing_warnings(reserved) == []
    assert gpu_sharing_warnings(load_config(None, base[:2])) == []  # CPU trainers share no device
    # this machine has no GPU: a cuda trainer rank placed here is refused with the reason
    import torch

    if not torch.cuda.is_available():
        assert model_on_node("smollm2-135m-instruct", need_cuda=True) == (
            "trainer.device=cuda but no CUDA device is visible on this node; use auto or cpu")


@pytest.mark.parametrize(("model", "handed"), [
    ("smollm2-135m-instruct", "smollm2-135m-instruct"),  # a built-in: each node converts it into its own cache
    ("/models/mine", "/driver/resolved/mine"),  # a directory: the one build_job resolved, at the same path there
])  # fmt: skip
def test_placed_servers_are_handed_a_built_in_model_by_name_not_the_drivers_directory(
    model: str, handed: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio

    import ray

    from agentrl.errors import ServerUnavailableError
    from agentrl.orchestration.server_actor import start_placed_servers

    made: list[tuple] = []

    class Handle:  # the actor does not answer: the test is over once it was made
        class url:  # an actor method, as the handle has it
            @staticmethod
            def remote() -> object:
                async def gone() -> None:
                    raise ServerUnavailableError("no server here")

                return gone()

        class stop:
            @staticmethod
            def remote() -> None:
                return None

    class ActorClass:
        def options(self, **opts: object) -> ActorClass:
            return self

        def remote(self, *args: object) -> Handle:
            made.append(args)
            return Handle()

    class Reservation:
        def options(self, role: str, i: int) -> dict:
            return {}

        def node_ip(self, role: str, i: int) -> str:
            return "10.0.0.2"

    monkeypatch.setattr(ray, "remote", lambda **kw: lambda cls: ActorClass())
    monkeypatch.setattr(ray, "get", lambda *a, **kw: None)  # no Ray here: nothing to start or stop
    monkeypatch.setattr(ray, "kill", lambda *a, **kw: None)
    config = two_by_two(f"model.path={model}", "inference.num_servers=1")
    with pytest.raises(ServerUnavailableError):
        asyncio.run(start_placed_servers(config, Reservation(), "/driver/resolved/mine", log_dir="/tmp/x"))
    assert [args[1] for args in made] == [handed]
