"""The engine-independent server layer: pause waits or aborts, paused requests wait, weight
updates pause, swap and report the new version, and a push that failed part-way stops the server
serving until a push succeeds. A fake engine stands in for hf/vLLM."""

from __future__ import annotations

import asyncio

import pytest

from agentrl.inference.protocol import GenerateRequest, GenerateResponse, SamplingSpec, WeightLoadReport
from agentrl.inference.server_app import (
    ServerEngine,
    ServerState,
    WeightLoadError,
    WeightsIncompleteError,
    build_app,
)


class FakeEngine(ServerEngine):
    engine_name = "fake"
    model_name = "m"

    def __init__(self) -> None:
        self.aborted = asyncio.Event()
        self.loaded: list[str] = []
        self.fail: WeightLoadError | None = None  # the next load raises this
        self.load_delay_s = 0.0

    async def generate(self, request: GenerateRequest, version: int) -> GenerateResponse:
        steps = request.sampling.max_tokens
        ids = []
        for i in range(steps):
            if self.aborted.is_set():
                return GenerateResponse(
                    token_ids=ids, logprobs=[-1.0] * len(ids), finish_reason="abort", weight_version=version
                )
            ids.append(i)
            await asyncio.sleep(0.01)
        return GenerateResponse(
            token_ids=ids, logprobs=[-1.0] * len(ids), finish_reason="length", weight_version=version
        )

    async def abort_all(self) -> None:
        self.aborted.set()

    async def load_weights(self, source: str, *, version: int, token: str | None) -> WeightLoadReport:
        await asyncio.sleep(self.load_delay_s)
        if self.fail is not None:
            fail, self.fail = self.fail, None
            raise fail
        self.loaded.append(source)
        return WeightLoadReport(version=version, source=source, buckets=3, verified_buckets=3, bytes=300,
                                checksum="sum64", seconds=0.01)


def req(n: int) -> GenerateRequest:
    return GenerateRequest(prompt_ids=[1], sampling=SamplingSpec(max_tokens=n))


def test_pause_waits_for_in_flight_and_holds_new_requests():
    async def go():
        state = ServerState(FakeEngine())
        running = asyncio.create_task(state.generate(req(10)))
        await asyncio.sleep(0.02)
        await state.pause(abort=False)  # returns only once `running` has finished
        assert running.done() and running.result().finish_reason == "length"
        held = asyncio.create_task(state.generate(req(2)))
        await asyncio.sleep(0.05)
        assert not held.done() and state.health().load == 1 and state.health().status == "paused"
        state.resume()
        assert (await held).finish_reason == "length"

    asyncio.run(go())


def test_pause_with_abort_ends_in_flight_requests():
    async def go():
        engine = FakeEngine()
        state = ServerState(engine)
        running = asyncio.create_task(state.generate(req(1000)))
        await asyncio.sleep(0.05)
        await state.pause(abort=True)
        out = running.result()
        assert out.finish_reason == "abort" and 0 < len(out.token_ids) < 1000
        assert state.metrics.aborted == 1

    asyncio.run(go())


def test_update_weights_drains_swaps_and_reports_the_version():
    async def go():
        engine = FakeEngine()
        state = ServerState(engine, weight_version=0)
        before = asyncio.create_task(state.generate(req(5)))
        await asyncio.sleep(0.01)
        report = await state.update_weights("/w/1", 1)
        assert before.done() and before.result().weight_version == 0
        # the request in flight had 4 of its 5 tokens (10 ms each) to go: the load waited for them
        assert 0.02 <= report.pause_seconds < 1.0 and report.seconds == 0.01
        assert engine.loaded == ["/w/1"] and state.health().weight_version == 1
        assert not state.paused  # it resumes by itself when it was not paused before
        assert (await state.generate(req(1))).weight_version == 1
        await state.pause(abort=False)
        await state.update_weights("/w/2", 2)
        assert state.paused  # a server paused by the caller stays paused
        assert state.metrics.weight_updates == 2

    asyncio.run(go())


def test_a_push_that_failed_part_way_stops_serving_until_a_push_succeeds():
    async def go():
        engine = FakeEngine()
        state = ServerState(engine, weight_version=4)
        await state.update_weights("/w/5", 5)
        assert state.metrics.weight_buckets_verified == 3 and state.metrics.weight_bytes_received == 300
        engine.fail = WeightLoadError("ChecksumError: bucket 1 failed its sum64 check", touched=True)
        engine.load_delay_s = 0.05
        push = asyncio.create_task(state.update_weights("/w/6", 6))
        await asyncio.sleep(0.01)
        queued = asyncio.create_task(state.generate(req(1)))  # arrives while the push is loading
        with pytest.raises(WeightLoadError):
            await push
        with pytest.raises(WeightsIncompleteError):  # it waited for the push, and is refused now
            await queued
        health = state.health()
        assert health.status == "loading" and "bucket 1" in (health.detail or "") and health.weight_version == 5
        assert state.metrics.weight_load_failures == 1
        with pytest.raises(WeightsIncompleteError):  # never served on the mix of versions 5 and 6
            await state.generate(req(1))
        await state.update_weights("/w/6", 6)  # a good push heals it
        assert state.health().status == "ok" and state.health().detail is None
        assert (await state.generate(req(1))).weight_version == 6

    asyncio.run(go())


def test_a_push_that_failed_before_touching_the_model_keeps_serving_the_old_version():
    async def go():
        engine = FakeEngine()
        state = ServerState(engine, weight_version=2)
        engine.fail = WeightLoadError("WeightSyncError: cannot reach the endpoint", touched=False)
        with pytest.raises(WeightLoadError):
            await state.update_weights("http://trainer:1", 3)
        assert state.health().status == "ok" and state.health().weight_version == 2
        assert (await state.generate(req(1))).weight_version == 2

    asyncio.run(go())


def test_http_routes_answer_422_for_a_failed_push_and_503_while_weights_are_incomplete():
    from fastapi.testclient import TestClient

    engine = FakeEngine()
    with TestClient(build_app(engine)) as http:
        ok = http.post("/update_weights", json={"source": "/w/1", "version": 1}).json()
        assert ok["weight_version"] == 1 and ok["push"]["verified_buckets"] == 3
        engine.fail = WeightLoadError("ChecksumError: bucket 0", touched=True)
        bad = http.post("/update_weights", json={"path": "/w/2", "version": 2, "token": "t"})
        assert bad.status_code == 422 and "bucket 0" in bad.json()["detail"]
        assert http.get("/health").json()["status"] == "loading"
        refused = http.post("/generate", json={"prompt_ids": [1], "sampling": {"max_tokens": 1}})
        assert refused.status_code == 503 and "not serving" in refused.json()["detail"]
        assert http.get("/metrics").json()["weight_load_failures"] == 1


def test_request_errors_are_http_400_and_a_dead_engine_fails_health_with_503():
    from fastapi.testclient import TestClient

    from agentrl.inference.server_app import RequestRejected, build_app

    class Picky(FakeEngine):
        max_model_len = 8
        dead = False

        async def generate(self, request: GenerateRequest, version: int) -> GenerateResponse:
            if request.sampling.max_tokens > 100:
                raise RequestRejected("max_tokens is too large")
            return await super().generate(request, version)

        async def check_health(self) -> None:
            if self.dead:
                raise RuntimeError("EngineCore died")

    engine = Picky()
    with TestClient(build_app(engine)) as http:
        ok = http.post("/generate", json=req(2).model_dump())
        assert ok.status_code == 200 and ok.json()["token_ids"] == [0, 1]
        too_long = http.post("/generate", json={"prompt_ids": list(range(8)), "sampling": {"max_tokens": 2}})
        assert too_long.status_code == 400 and "the prompt has 8 tokens" in too_long.json()["detail"]
        bad = http.post("/generate", json=req(500).model_dump())
        assert bad.status_code == 400 and "max_tokens is too large" in bad.json()["detail"]
        health = http.get("/health")
        assert health.status_code == 200 and health.json()["max_model_len"] == 8
        engine.dead = True
        dead = http.get("/health")
        assert dead.status_code == 503 and "EngineCore died" in dead.json()["detail"]


def test_with_a_token_every_route_but_health_needs_it():
    import httpx
    from fastapi.testclient import TestClient

    from agentrl.inference.client import HTTPServerClient

    engine = FakeEngine()
    with TestClient(build_app(engine, token="s3cret")) as http:
        assert http.get("/health").status_code == 200  # launchers poll it without the token
        anonymous = http.post("/generate", json=req(1).model_dump())
        assert anonymous.status_code == 401 and "AGENTRL_SERVER_TOKEN" in anonymous.json()["detail"]
        wrong = {"Authorization": "Bearer guess"}
        assert http.post("/update_weights", json={"source": "/w/1", "version": 1}, headers=wrong).status_code == 401
        assert http.post("/pause", headers=wrong).status_code == 401 and http.get("/metrics").status_code == 401
        assert engine.loaded == [] and http.get("/health").json()["status"] == "ok"
        right = {"Authorization": "Bearer s3cret"}
        assert http.post("/generate", json=req(1).model_dump(), headers=right).json()["token_ids"] == [0]

    # The client sends the token it is given (or AGENTRL_SERVER_TOKEN from its environment).
    seen: list[str | None] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        return httpx.Response(200, json={"status": "ok", "weight_version": 0, "load": 0, "model": "m", "engine": "fake"})

    async def go(**kwargs):
        client = HTTPServerClient("http://server", transport=httpx.MockTransport(answer), **kwargs)
        try:
            await client.health()
        finally:
            await client.aclose()

    asyncio.run(go(token="s3cret"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AGENTRL_SERVER_TOKEN", "from-env")
        asyncio.run(go())
        mp.delenv("AGENTRL_SERVER_TOKEN")
        asyncio.run(go())
    assert seen == ["Bearer s3cret", "Bearer from-env", None]
