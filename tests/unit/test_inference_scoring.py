"""The scoring call of the inference contract: the wire types, the server layer (`POST /score` held by
a pause, refused on incomplete weights, 400 from an engine that cannot score), the HTTP, colocated and
SGLang clients' translation, and the router's `score` / `score_each`. Fakes stand in for engines."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from pydantic import ValidationError

from agentrl.errors import InferenceError, ServerUnavailableError
from agentrl.inference.client import HTTPServerClient, ScoringClient
from agentrl.inference.colocated_client import ColocatedClient
from agentrl.inference.protocol import (
    GenerateRequest,
    GenerateResponse,
    HealthResponse,
    ScoreRequest,
    ScoreResponse,
    WeightLoadReport,
)
from agentrl.inference.router import Router
from agentrl.inference.server_app import ServerEngine, ServerState, WeightLoadError, build_app
from agentrl.inference.sglang import SGLangClient, sglang_score_request


class ScoringEngine(ServerEngine):
    """Scores id i as -i/10 (so answers are checkable); cannot generate."""

    engine_name = "fake"
    model_name = "m"

    def __init__(self) -> None:
        self.scored: list[list[int]] = []

    async def generate(self, request: GenerateRequest, version: int) -> GenerateResponse:
        raise NotImplementedError

    async def score(self, request: ScoreRequest, version: int) -> ScoreResponse:
        self.scored.append(request.token_ids)
        return ScoreResponse(logprobs=[-t / 10 for t in request.token_ids[request.start:]], weight_version=version)

    async def abort_all(self) -> None:
        pass

    async def load_weights(self, source: str, *, version: int, token: str | None) -> WeightLoadReport:
        raise WeightLoadError("bucket 0 failed its check", touched=True)


def test_score_request_scores_from_start_and_rejects_nothing_to_score():
    assert ScoreRequest(token_ids=[5, 6, 7]).start == 1
    assert ScoreRequest(token_ids=[5, 6, 7], start=2).start == 2
    with pytest.raises(ValidationError, match="start=3 leaves nothing to score in 3 token ids"):
        ScoreRequest(token_ids=[5, 6, 7], start=3)
    with pytest.raises(ValidationError):
        ScoreRequest(token_ids=[5])  # one id has no scored position
    with pytest.raises(ValidationError):
        ScoreRequest(token_ids=[5, 6], start=0)  # position 0 has no context
    with pytest.raises(ValidationError):
        ScoreResponse(logprobs=[-1.0], weight_version=1, extra=1)


def test_server_state_holds_a_score_while_paused_and_refuses_incomplete_weights():
    async def go():
        engine = ScoringEngine()
        state = ServerState(engine, weight_version=4)
        await state.pause(abort=False)
        held = asyncio.create_task(state.score(ScoreRequest(token_ids=[1, 2, 3])))
        await asyncio.sleep(0.02)
        assert not held.done() and state.health().load == 1
        state.resume()
        answer = await held
        assert answer.logprobs == [-0.2, -0.3] and answer.weight_version == 4
        assert state.metrics.scored_tokens == 2
        with pytest.raises(WeightLoadError):
            await state.update_weights("/w/5", 5)
        from agentrl.inference.server_app import WeightsIncompleteError

        with pytest.raises(WeightsIncompleteError, match="weight version 5 from /w/5 failed part-way"):
            await state.score(ScoreRequest(token_ids=[1, 2]))

    asyncio.run(go())


def test_score_route_answers_scores_400_for_an_engine_that_cannot_score_and_too_long_ids():
    from fastapi.testclient import TestClient

    class NoScore(ScoringEngine):
        max_model_len = 4
        score = ServerEngine.score  # the default: cannot score

    with TestClient(build_app(ScoringEngine(), weight_version=2)) as http:
        ok = http.post("/score", json={"token_ids": [10, 20, 30], "start": 2})
        assert ok.status_code == 200 and ok.json() == {"logprobs": [-3.0], "weight_version": 2}
        bad = http.post("/score", json={"token_ids": [10, 20], "start": 2})
        assert bad.status_code == 422
    with TestClient(build_app(NoScore())) as http:
        refused = http.post("/score", json={"token_ids": [1, 2]})
        assert refused.status_code == 400 and "the fake engine cannot score token ids" in refused.json()["detail"]
        too_long = http.post("/score", json={"token_ids": [1, 2, 3, 4, 5]})
        assert too_long.status_code == 400 and "5 token ids to score" in too_long.json()["detail"]


def test_http_client_sends_the_score_request_and_reads_the_answer():
    seen: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/score"
        body = json.loads(request.content)
        seen.append(body)
        return httpx.Response(200, json={"logprobs": [-0.5, -0.25], "weight_version": 7})

    async def go():
        client = HTTPServerClient("http://s1", transport=httpx.MockTransport(handler))
        assert isinstance(client, ScoringClient)
        answer = await client.score([3, 4, 5], start=1, session_id="probe")
        await client.aclose()
        return answer

    answer = asyncio.run(go())
    assert answer == ScoreResponse(logprobs=[-0.5, -0.25], weight_version=7)
    assert seen == [{"token_ids": [3, 4, 5], "start": 1, "session_id": "probe"}]


def test_colocated_client_scores_through_its_host():
    calls: list[tuple] = []

    async def host(method, *args):
        calls.append((method, *args))
        return ScoreResponse(logprobs=[-1.5], weight_version=3)

    client = ColocatedClient(host, "colocated-0")
    answer = asyncio.run(client.score([8, 9]))
    assert answer.logprobs == [-1.5] and answer.weight_version == 3
    assert calls == [("engine_score", ScoreRequest(token_ids=[8, 9], start=1))]


def test_sglang_score_reads_input_token_logprobs_from_the_documented_answer():
    request = ScoreRequest(token_ids=[11, 12, 13], start=1)
    body = sglang_score_request(request)
    assert body["input_ids"] == [11, 12, 13] and body["return_logprob"] is True
    assert body["logprob_start_len"] == 0 and body["sampling_params"]["max_new_tokens"] == 1

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"text": "x", "meta_info": {
            "input_token_logprobs": [[None, 11, "a"], [-0.75, 12, "b"], [-2.0, 13, "c"]],
            "output_token_logprobs": [[-0.1, 5, "d"]], "weight_version": "6"}})

    async def go():
        client = SGLangClient("http://sg", transport=httpx.MockTransport(handler))
        try:
            return await client.score([11, 12, 13], start=2), await client.score([11, 12, 14])
        finally:
            await client.aclose()

    with pytest.raises(InferenceError, match="input logprob at position 2 is \\[-2.0, 13\\], not a logprob of id 14"):
        asyncio.run(go())

    async def one():
        client = SGLangClient("http://sg", transport=httpx.MockTransport(handler))
        try:
            return await client.score([11, 12, 13], start=2)
        finally:
            await client.aclose()

    assert asyncio.run(one()) == ScoreResponse(logprobs=[-2.0], weight_version=6)


class FakeScorer:
    """A routed server that scores every id as `offset` and reports `version`."""

    def __init__(self, server_id: str, *, version: int = 1, offset: float = -1.0) -> None:
        self.server_id = server_id
        self.version = version
        self.offset = offset
        self.dead = False
        self.asked: list[tuple[list[int], int]] = []

    async def generate(self, prompt_ids, sampling, *, session_id, timeout_s=None):
        raise NotImplementedError

    async def score(self, token_ids, *, start=1, session_id="", timeout_s=None):
        if self.dead:
            raise ServerUnavailableError(f"{self.server_id} refused the connection")
        self.asked.append((list(token_ids), start))
        return ScoreResponse(logprobs=[self.offset] * (len(token_ids) - start), weight_version=self.version)

    async def health(self, timeout_s=None):
        return HealthResponse(status="ok", weight_version=self.version, model="m", engine="fake", load=0)

    async def aclose(self):
        pass


def test_router_scores_on_a_named_server_even_one_behind_the_current_version():
    a, b = FakeScorer("a", version=1, offset=-1.0), FakeScorer("b", version=0, offset=-2.0)
    router = Router([a, b], current_version=1)

    async def go():
        await router.check_health()  # the router learns each server's version from /health
        named = await router.score([1, 2, 3], server_id="b")
        anyone = await router.score([1, 2, 3], start=2)
        with pytest.raises(InferenceError, match="No server 'c' behind this router"):
            await router.score([1, 2], server_id="c")
        return named, anyone

    named, anyone = asyncio.run(go())
    assert named.logprobs == [-2.0, -2.0] and named.weight_version == 0
    assert anyone.logprobs == [-1.0] and a.asked == [([1, 2, 3], 2)]  # b is not eligible at version 1
    assert all(s.load == 0 for s in router.servers)


def test_router_scores_on_every_healthy_server_and_names_the_ones_that_fail():
    a, b, c = FakeScorer("a", version=3), FakeScorer("b", version=2, offset=-4.0), FakeScorer("c")
    router = Router([a, b, c])
    router.give_up(2, "could not restart")

    async def go():
        each = await router.score_each([1, 2, 3])
        b.dead = True
        with pytest.raises(InferenceError, match="1 of 2 server\\(s\\) failed to score: b: b refused the connection"):
            await router.score_each([1, 2, 3])
        return each

    each = asyncio.run(go())
    assert {sid: (r.weight_version, r.logprobs) for sid, r in each.items()} == {
        "a": (3, [-1.0, -1.0]), "b": (2, [-4.0, -4.0])}
    assert c.asked == []


def test_router_refuses_to_score_on_a_server_without_a_score_call():
    class NoScore:
        server_id = "ext"

        async def generate(self, prompt_ids, sampling, *, session_id, timeout_s=None):
            raise NotImplementedError

        async def aclose(self):
            pass

    router = Router([NoScore()])
    with pytest.raises(InferenceError, match="Server ext cannot score token ids"):
        asyncio.run(router.score_each([1, 2]))
