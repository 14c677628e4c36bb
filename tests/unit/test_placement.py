"""The placement plan: who runs where, decided and checked before anything starts, and the
router's client of a colocated engine against a fake host."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from agentrl.config import AgentRLConfig, load_config
from agentrl.errors import ConfigError, FeatureUnavailableError, ServerUnavailableError
from agentrl.inference.colocated_client import ColocatedClient
from agentrl.inference.protocol import GenerateRequest, GenerateResponse, HealthResponse
from agentrl.orchestration.placement import build_plan
from agentrl.types import SamplingParams


def cfg(*overrides: str) -> AgentRLConfig:
    return load_config(None, ["env=arithmetic", "trainer.device=cpu", *overrides])


def test_split_is_the_default_and_colocated_puts_the_engine_in_the_trainer() -> None:
    split = build_plan(cfg())
    assert split.placement == "split" and not split.colocated and split.weight_sync == "files"
    assert [r.name for r in split.roles] == ["trainer", "vllm server", "rollouts"]

    sync = build_plan(cfg("placement=colocated"))
    assert sync.colocated and sync.weight_sync == "inprocess" and sync.device == "cpu"
    assert [r.name for r in sync.roles] == ["trainer + vLLM engine", "rollouts"]
    assert sync.release_weights_while_training, "in sync mode a push always follows the update"
    text = "\n".join(sync.describe())
    assert "placement colocated on cpu" in text and "frees its weights and KV cache" in text

    # Overlapped modes go on generating on the old weights while the trainer updates: KV cache only.
    for mode in ("one_step_off", "async"):
        plan = build_plan(cfg("placement=colocated", f"run.mode={mode}"))
        assert plan.colocated and not plan.release_weights_while_training
        assert "frees its KV cache while" in "\n".join(plan.describe())


def test_auto_is_colocated_on_a_cpu_trainer_and_eval_always_starts_servers() -> None:
    plan = build_plan(cfg("placement=auto"))
    assert plan.colocated and "placement=auto on a CPU trainer" in plan.describe()[0]
    # servers someone started cannot move into the trainer: auto keeps them
    assert not build_plan(cfg("placement=auto", "inference.urls=[http://127.0.0.1:1]")).colocated
    assert build_plan(cfg("placement=colocated"), "eval").placement == "split"


@pytest.mark.parametrize("override", [
    "inference.engine=hf", "inference.urls=[http://127.0.0.1:1]", "inference.num_servers=2",
    "weights.backend=files", "weights.backend=http", "trainer.num_processes=2", "trainer.backend=megatron",
])  # fmt: skip
def test_auto_takes_split_where_colocated_cannot_work_and_names_the_key(override: str) -> None:
    plan = build_plan(cfg("placement=auto", override))
    assert plan.placement == "split"
    assert f"split because of {override.split('=[')[0]}" in plan.describe()[0]


@pytest.mark.parametrize(("overrides", "error", "match"), [
    (["inference.engine=hf"], ConfigError, "inference.engine=hf cannot be colocated"),
    (["inference.urls=[http://127.0.0.1:1]"], ConfigError, "inference.urls"),
    (["inference.num_servers=2"], ConfigError, "inference.num_servers=2"),
    (["weights.backend=files"], ConfigError, "weights.backend=files"),
    (["trainer.num_processes=2"], FeatureUnavailableError, "not built yet"),
])  # fmt: skip
def test_what_cannot_be_colocated_is_refused_naming_the_key(overrides, error, match) -> None:
    with pytest.raises(error, match=match):
        build_plan(cfg("placement=colocated", *overrides))


def test_split_runs_refuse_the_in_memory_weight_backend() -> None:
    with pytest.raises(ConfigError, match="weights.backend: 'inprocess'"):
        build_plan(cfg("weights.backend=inprocess"))
    assert build_plan(cfg("weights.backend=inprocess"), "eval").weight_sync == "none"


def test_roles_are_sized_from_the_model(assets: Path) -> None:
    model = str(assets / "tiny-random-qwen2")
    split = build_plan(cfg(f"model.path={model}"), "run", model)
    colocated = build_plan(cfg(f"model.path={model}", "placement=colocated"), "run", model)
    trainer = split.role("trainer")
    engine = colocated.role("trainer + vLLM engine")
    assert trainer is not None and engine is not None
    # one process holding the trainer and the engine: more than the trainer alone, less than trainer + server
    server = split.role("vllm server")
    assert server is not None
    assert trainer.resources["memory_gb"] < engine.resources["memory_gb"]
    assert engine.resources["memory_gb"] < trainer.resources["memory_gb"] + server.resources["memory_gb"]


# ── ColocatedClient against a fake host ─────────────────────────────────────────────────────


class FakeHost:
    """Stands in for the trainer actor's `engine_*` methods."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.requests: list[GenerateRequest] = []

    async def __call__(self, method: str, *args):
        if method == "engine_generate":
            (request,) = args
            self.requests.append(request)
            await asyncio.sleep(self.delay_s)
            return GenerateResponse(token_ids=[7, 8], logprobs=[-0.5, -0.25], finish_reason="stop", weight_version=3)
        if method == "engine_health":
            return HealthResponse(status="paused", weight_version=3, model="m", engine="vllm-colocated", load=1)
        raise AssertionError(method)


def test_the_client_speaks_the_server_protocol_through_its_host() -> None:
    host = FakeHost()
    client = ColocatedClient(host, "colocated-rank-0")

    async def scenario():
        gen = await client.generate([1, 2, 3], SamplingParams(temperature=0.5, max_tokens=4, stop_token_ids=(9,)),
                                    session_id="s1")
        return gen, await client.health()

    gen, health = asyncio.run(scenario())
    assert gen.token_ids == [7, 8] and gen.logprobs == [-0.5, -0.25] and gen.finish_reason == "stop"
    assert gen.weight_version == 3 and gen.server_id == "colocated-rank-0"
    sent = host.requests[0]
    assert sent.prompt_ids == [1, 2, 3] and sent.session_id == "s1"
    assert sent.sampling.temperature == 0.5 and sent.sampling.stop_token_ids == [9]
    assert health.status == "paused" and health.engine == "vllm-colocated"


def test_a_host_that_does_not_answer_in_time_is_an_unavailable_server() -> None:
    client = ColocatedClient(FakeHost(delay_s=5.0), "colocated-rank-0")
    with pytest.raises(ServerUnavailableError, match="no answer within 0.05 s"):
        asyncio.run(client.generate([1], SamplingParams(max_tokens=1), session_id="s", timeout_s=0.05))
