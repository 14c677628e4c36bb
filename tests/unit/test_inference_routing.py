"""Router: placement, stickiness, moves off overloaded or dead servers, retries, version gating,
health checks. All servers are in-process fakes; nothing touches the network."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from agentrl.errors import InferenceError, ServerUnavailableError, WeightSyncError
from agentrl.inference import HTTPServerClient, Router
from agentrl.inference.protocol import HealthResponse
from agentrl.types import Generation, SamplingParams

SP = SamplingParams(max_tokens=4)


class FakeServer:
    """Answers generate after `delay_s`; `dead` makes every call fail like a refused connection."""

    def __init__(
        self, server_id: str, *, version: int = 0, delay_s: float = 0.0, external_load: int = 0
    ) -> None:
        self.server_id = server_id
        self.version = version
        self.delay_s = delay_s
        self.external_load = external_load
        self.dead = False
        self.reject = False
        self.calls: list[str] = []
        self.inflight = 0
        self.pushes: list[tuple] = []
        self.failing_pushes = 0  # this many pushes fail before one succeeds

    async def generate(self, prompt_ids, sampling, *, session_id, timeout_s=None):
        if self.dead:
            raise ServerUnavailableError(f"{self.server_id} refused the connection")
        if self.reject:
            raise InferenceError(f"{self.server_id}: HTTP 400 prompt too long")
        self.calls.append(session_id)
        self.inflight += 1
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.inflight -= 1
        if self.dead:
            raise ServerUnavailableError(f"{self.server_id} died mid-request")
        return Generation([1, 2], [-0.1, -0.2], "stop", self.version)

    async def health(self, timeout_s=None):
        if self.dead:
            raise ServerUnavailableError(f"{self.server_id} is down")
        return HealthResponse(
            status="ok",
            weight_version=self.version,
            model="m",
            engine="fake",
            load=self.inflight + self.external_load,
        )

    async def update_weights(self, source, version, token=None):
        self.pushes.append((source, version, token))
        if self.failing_pushes:
            self.failing_pushes -= 1
            raise InferenceError(f"{self.server_id}: ChecksumError: bucket 2 failed its check")
        self.version = version

    async def aclose(self):
        pass


def run(coro):
    return asyncio.run(coro)


def test_new_sessions_go_to_least_loaded_and_later_turns_stick():
    a, b, c = FakeServer("a"), FakeServer("b"), FakeServer("c")
    router = Router([a, b, c], health_interval_s=60)
    # three sessions held open: each new one lands on an idle server
    held = [router.acquire(f"s{i}") for i in range(3)]
    assert sorted(s.server_id for s in held) == ["a", "b", "c"]
    for s in held:
        router.release(s)

    async def turns():
        for _ in range(5):
            for i in range(3):
                await router.generate([1], SP, session_id=f"s{i}")
        await router.aclose()

    run(turns())
    for i, s in enumerate(held):
        assert router.server_of(f"s{i}") == s.server_id
        assert {x.server_id: x for x in (a, b, c)}[s.server_id].calls.count(f"s{i}") == 5
    assert router.counters["moves"] == 0 and router.counters["new_sessions"] == 3


def test_session_moves_when_its_server_is_overloaded():
    a, b = FakeServer("a"), FakeServer("b")
    router = Router([a, b], overload_threshold=2.0, health_interval_s=60)
    first = router.acquire("s")
    router.release(first)
    # load the session's server with 5 in-flight requests of other sessions, the other is idle
    busy = [router.acquire("s")] + [
        router.acquire(f"o{i}", exclude=[router.servers[1 - router.servers.index(first)]]) for i in range(4)
    ]
    assert all(x is first for x in busy)
    moved = router.acquire("s")
    assert moved is not first and router.counters["moves"] == 1
    # modest imbalance (2 vs 1) does not move a session
    for x in busy:
        router.release(x)
    router.release(moved)
    x1, x2 = router.acquire("t1"), router.acquire("t2")
    router.release(x2)
    y = router.acquire("t1")
    assert y is x1


def test_dead_server_fails_over_and_every_request_completes():
    a, b = FakeServer("a", delay_s=0.01), FakeServer("b", delay_s=0.01)
    router = Router([a, b], health_interval_s=0.05)

    async def scenario():
        await router.start()
        first = await asyncio.gather(*(router.generate([1], SP, session_id=f"s{i}") for i in range(10)))
        a.dead = True
        second = await asyncio.gather(
            *(router.generate([1], SP, session_id=f"s{i}", timeout_s=5) for i in range(10))
        )
        await router.aclose()
        return first, second

    first, second = run(scenario())
    assert {g.server_id for g in first} == {"a", "b"}
    assert {g.server_id for g in second} == {"b"}
    assert all(router.server_of(f"s{i}") == "b" for i in range(10))
    assert not router.servers[0].healthy


def test_request_fails_over_when_server_dies_mid_request(caplog):
    a, b = FakeServer("a", delay_s=0.2), FakeServer("b")
    router = Router([a, b], health_interval_s=60)

    async def scenario():
        s = router.acquire("s")  # place the session on a
        router.release(s)
        assert s.server_id == "a"
        task = asyncio.create_task(router.generate([1], SP, session_id="s"))
        await asyncio.sleep(0.05)
        a.dead = True
        gen = await task
        await router.aclose()
        return gen

    with caplog.at_level("WARNING", logger="agentrl.inference.router"):
        gen = run(scenario())
    assert gen.server_id == "b" and router.counters["retries"] == 1
    assert "inference server a failed (a died mid-request); routing around it" in caplog.text  # says why


def test_no_server_left_raises_after_the_deadline():
    a = FakeServer("a")
    a.dead = True
    router = Router([a], health_interval_s=0.02)

    async def scenario():
        try:
            with pytest.raises(ServerUnavailableError, match="within 0.2 s"):
                await router.generate([1], SP, session_id="s", timeout_s=0.2)
        finally:
            await router.aclose()

    run(scenario())


def test_rejected_request_is_not_retried():
    a, b = FakeServer("a"), FakeServer("b")
    a.reject = b.reject = True
    router = Router([a, b], health_interval_s=60)

    async def scenario():
        try:
            with pytest.raises(InferenceError, match="HTTP 400"):
                await router.generate([1], SP, session_id="s")
        finally:
            await router.aclose()

    run(scenario())
    assert router.counters["retries"] == 0


def test_servers_behind_current_version_get_no_requests_until_they_catch_up():
    a, b = FakeServer("a", version=1), FakeServer("b", version=0)
    router = Router([a, b], health_interval_s=0.02)

    async def scenario():
        await router.start()
        router.set_version(1)
        gens = await asyncio.gather(*(router.generate([1], SP, session_id=f"s{i}") for i in range(6)))
        assert {g.server_id for g in gens} == {"a"} and not b.calls
        router.set_version(2)  # nobody has v2 yet: requests wait instead of failing
        waiting = asyncio.create_task(router.generate([1], SP, session_id="s0", timeout_s=5))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        b.version = 2  # b finishes its weight update; the next health check sees it
        gen = await waiting
        await router.aclose()
        return gen

    gen = run(scenario())
    assert gen.server_id == "b" and gen.weight_version == 2


def test_health_checks_see_external_load_and_recovery():
    a, b = FakeServer("a", external_load=10), FakeServer("b")
    router = Router([a, b], health_interval_s=0.02)

    async def scenario():
        await router.start()
        gens = await asyncio.gather(*(router.generate([1], SP, session_id=f"s{i}") for i in range(4)))
        assert {g.server_id for g in gens} == {"b"}  # a is busy with someone else's requests
        b.dead = True
        await asyncio.sleep(0.1)
        assert not router.servers[1].healthy
        b.dead = False
        await asyncio.sleep(0.1)
        assert router.servers[1].healthy
        await router.aclose()

    run(scenario())


def test_update_weights_pushes_to_every_server_and_gates_on_the_new_version():
    a, b = FakeServer("a"), FakeServer("b")
    router = Router([a, b], health_interval_s=60)

    async def scenario():
        await router.update_weights("/tmp/w", 3)
        await router.aclose()

    run(scenario())
    assert a.version == b.version == 3 and router.current_version == 3
    assert all(s.eligible for s in router.servers)
    assert a.pushes == [("/tmp/w", 3, None)]


def test_a_failed_push_is_retried_and_a_server_that_keeps_failing_stops_the_push():
    a, b = FakeServer("a"), FakeServer("b")
    router = Router([a, b], health_interval_s=60)
    b.failing_pushes = 1  # a corrupted bucket once: the second attempt loads

    async def flaky():
        await router.update_weights("http://trainer:9/", 4, token="tok")

    run(flaky())
    assert b.pushes == [("http://trainer:9/", 4, "tok")] * 2 and b.version == 4 and router.current_version == 4

    b.failing_pushes = 5
    with pytest.raises(WeightSyncError, match=r"did not load on 1 of 2 server\(s\) after 2 attempt.*b: .*bucket 2"):
        run(router.update_weights("http://trainer:9/", 5, token="tok"))
    assert router.current_version == 4  # the version is not switched to one a server lacks
    assert len(b.pushes) == 4

    b.failing_pushes = 0  # a server that comes back is brought to the last pushed version
    b.version = 0
    run(router.sync_server("b"))
    assert b.version == 5 and b.pushes[-1] == ("http://trainer:9/", 5, "tok")


def test_session_table_is_bounded_and_sessions_can_end():
    router = Router([FakeServer("a"), FakeServer("b")], max_sessions=100, health_interval_s=60)
    for i in range(250):
        router.release(router.acquire(f"s{i}"))
    assert router.num_sessions == 100
    assert sum(s.sessions for s in router.servers) == 100
    router.end_session("s249")
    assert router.server_of("s249") is None and router.num_sessions == 99


def test_router_over_http_clients_with_a_mock_transport():
    seen: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(
                200, json={"status": "ok", "weight_version": 4, "model": "m", "engine": "hf", "load": 0}
            )
        import json

        seen.append(json.loads(request.content))
        return httpx.Response(
            200,
            json={
                "token_ids": [7, 8],
                "logprobs": [-1.0, -2.0],
                "finish_reason": "length",
                "weight_version": 4,
            },
        )

    transport = httpx.MockTransport(handler)
    clients = [HTTPServerClient(f"http://s{i}:1", transport=transport) for i in range(2)]
    router = Router(clients, current_version=4, health_interval_s=60)

    async def scenario():
        await router.start()
        gen = await router.generate(
            [1, 2, 3], SamplingParams(temperature=0.5, max_tokens=2, seed=3), session_id="x"
        )
        await router.aclose()
        return gen

    gen = run(scenario())
    assert gen.token_ids == [7, 8] and gen.weight_version == 4 and gen.server_id.startswith("http://s")
    assert seen[0]["prompt_ids"] == [1, 2, 3] and seen[0]["session_id"] == "x"
    assert seen[0]["sampling"]["seed"] == 3 and seen[0]["sampling"]["temperature"] == 0.5


def test_a_request_that_outlives_its_deadline_does_not_mark_the_server_failed():
    class SlowServer(FakeServer):
        async def generate(self, prompt_ids, sampling, *, session_id, timeout_s=None):
            await asyncio.sleep(timeout_s)
            raise ServerUnavailableError(f"{self.server_id}: no answer within {timeout_s} s")

    router = Router([SlowServer("a"), FakeServer("b")], health_interval_s=60)

    async def scenario():
        try:
            with pytest.raises(ServerUnavailableError, match="deadline"):
                await router.generate([1], SP, session_id="s", timeout_s=0.1)
        finally:
            await router.aclose()

    run(scenario())
    assert router.servers[0].healthy and router.counters["failures"] == 0


# ── faults: request errors, dead servers, re-sync ──────────────────────────────────


def test_a_refused_request_does_not_mark_the_server_failed():
    from agentrl.errors import InferenceRequestError

    a = FakeServer("a")
    router = Router([a], health_interval_s=60)

    async def refuse(prompt_ids, sampling, *, session_id, timeout_s=None):
        raise InferenceRequestError("HTTP 400 the prompt has 936 tokens; max_model_len is 768")

    a.generate = refuse

    async def scenario():
        with pytest.raises(InferenceRequestError, match="936 tokens"):
            await router.generate([1] * 936, SP, session_id="s")
        await router.aclose()

    run(scenario())
    assert router.servers[0].healthy and router.counters["rejected"] == 1
    assert router.counters["failures"] == 0 and router.counters["retries"] == 0


def test_a_request_answered_5xx_again_and_again_is_given_up_not_retried_forever():
    from agentrl.inference.router import MAX_SERVER_ERRORS

    a = FakeServer("a")
    answers = []

    async def crash(prompt_ids, sampling, *, session_id, timeout_s=None):
        answers.append(session_id)
        exc = ServerUnavailableError("HTTP 500 internal error")
        exc.status_code = 500
        raise exc

    a.generate = crash
    router = Router([a], health_interval_s=0.01)

    async def scenario():
        await router.start()
        with pytest.raises(ServerUnavailableError, match="HTTP 5xx error 3 times"):
            await router.generate([1], SP, session_id="s", timeout_s=30)
        await router.aclose()

    run(scenario())
    assert len(answers) == MAX_SERVER_ERRORS


def test_a_server_back_from_the_dead_is_resynced_before_it_serves():
    a = FakeServer("a")
    pushed: list[tuple[str, int]] = []

    async def update_weights(path, version):
        pushed.append((path, version))
        a.version = version

    a.update_weights = update_weights
    router = Router([a], health_interval_s=0.02)

    async def scenario():
        await router.start()
        await router.update_weights("/w/v3", 3)
        a.dead = True  # the server dies ...
        router.server_down(0)
        waiting = asyncio.create_task(router.generate([1], SP, session_id="s", timeout_s=5))
        await asyncio.sleep(0.1)
        assert not waiting.done(), "while the only server is down, requests wait"
        a.dead, a.version = False, 0  # ... and comes back with its initial weights
        router.server_restarted(0)
        gen = await waiting
        await router.aclose()
        return gen

    gen = run(scenario())
    assert pushed == [("/w/v3", 3), ("/w/v3", 3)], "the restarted server got the last push again"
    assert gen.weight_version == 3 and router.counters["resyncs"] == 1


def test_a_push_to_a_dying_server_does_not_fail_the_push_and_the_server_catches_up():
    a, b = FakeServer("a"), FakeServer("b")

    async def dies(path, version):
        raise ServerUnavailableError("b died during the push")

    b.update_weights = dies
    router = Router([a, b], health_interval_s=0.02)

    async def scenario():
        await router.start()
        await router.update_weights("/w/v1", 1)
        assert a.version == 1 and not router.servers[1].healthy
        del b.update_weights  # back to the class's method: b can load weights again
        await asyncio.sleep(0.2)  # health checks find b alive at version 0, behind: re-synced
        await router.aclose()

    run(scenario())
    assert b.version == 1 and router.servers[1].eligible


def test_once_every_server_is_given_up_requests_fail_at_once_with_the_reason():
    a = FakeServer("a")
    router = Router([a], health_interval_s=0.02, request_timeout_s=300)

    async def scenario():
        await router.start()
        a.dead = True
        router.server_down(0)
        waiting = asyncio.create_task(router.generate([1], SP, session_id="s"))
        await asyncio.sleep(0.05)
        router.give_up(0, "it exited (code -9); not restarted again after 3 restart(s)")
        with pytest.raises(ServerUnavailableError, match="could not be restarted.*not restarted again"):
            await asyncio.wait_for(waiting, 2)
        with pytest.raises(ServerUnavailableError, match="could not be restarted"):
            await asyncio.wait_for(router.generate([1], SP, session_id="t"), 2)
        await router.aclose()

    run(scenario())
    assert router.fatal is not None


def test_with_verified_serving_a_server_serves_a_version_only_once_admitted_there_and_a_restarted_one_is_checked():
    a, b = FakeServer("a"), FakeServer("b")
    checked: list[tuple[str, int]] = []
    release = asyncio.Event()
    router = Router([a, b], health_interval_s=0.02)

    async def verify(server_id: str, version: int) -> None:
        checked.append((server_id, version))
        await release.wait()
        if not (server_id == "b" and version == 3):  # b fails its check at version 3
            router.admit(server_id, version)

    async def scenario():
        await router.start()
        await router.check_health()
        router.require_verified(verify)
        assert not any(s.eligible for s in router.servers), "nothing is admitted before its first check"
        waiting = asyncio.create_task(router.generate([1], SP, session_id="s0", timeout_s=5))
        await asyncio.sleep(0.1)
        assert not waiting.done(), "no request is admitted before the check passed"
        assert sorted(checked) == [("a", 0), ("b", 0)], "the router checks servers it has not admitted by itself"
        release.set()
        first = await waiting
        checked.clear()
        await router.update_weights("/w/v3", 3)  # loaded, not yet admitted at 3: the run checks right after
        router.admit("a", 3)
        eligible_after_push = [s.eligible for s in router.servers]
        b.dead = True  # b dies, comes back with its first weights, is re-synced to 3, then fails its check
        router.server_down(1)
        b.dead, b.version = False, 0
        router.server_restarted(1)
        for _ in range(100):
            await asyncio.sleep(0.02)
            if ("b", 3) in checked and not router.servers[1].verifying:
                break
        gens = [await router.generate([1], SP, session_id=f"s{i}", timeout_s=5) for i in range(4)]
        await router.aclose()
        return first, eligible_after_push, gens

    first, eligible_after_push, gens = run(scenario())
    assert first.weight_version == 0
    assert eligible_after_push == [True, False]
    assert ("b", 3) in checked and b.version == 3, "re-synced, then checked at the version it was re-synced to"
    assert [s.eligible for s in router.servers] == [True, False], "the server that failed its check serves nothing"
    assert {g.weight_version for g in gens} == {3} and len(b.calls) <= 1  # b's one call at most, before the push
