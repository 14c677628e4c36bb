"""Two real `hf` servers behind the router, started by serve_from_config; one is killed mid-run and
every request still completes."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from agentrl.config import AgentRLConfig
from agentrl.inference import serve_from_config
from agentrl.types import SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def service(assets, tmp_path_factory):
    cfg = AgentRLConfig()
    cfg.model.path = str(assets / "tiny-random-qwen2")
    cfg.inference.engine = "hf"
    cfg.inference.num_servers = 2
    cfg.inference.startup_timeout_s = 300
    svc = serve_from_config(cfg, log_dir=tmp_path_factory.mktemp("logs"))
    yield svc
    svc.stop()
    assert not any(p.alive for p in svc.servers)


def test_the_servers_answer_only_the_clients_of_the_run_that_started_them(service, monkeypatch):
    from agentrl.errors import InferenceRequestError
    from agentrl.inference.client import HTTPServerClient

    monkeypatch.delenv("AGENTRL_SERVER_TOKEN", raising=False)
    sp = SamplingParams(temperature=1.0, max_tokens=2, seed=0)

    async def scenario():
        stranger = HTTPServerClient(service.servers[0].url)
        try:
            health = await stranger.health()  # open: launchers and context checks poll it
            with pytest.raises(InferenceRequestError, match="HTTP 401"):
                await stranger.generate([151644, 872], sp, session_id="s")
            with pytest.raises(InferenceRequestError, match="HTTP 401"):
                await stranger.pause(abort=True)
        finally:
            await stranger.aclose()
        own = service.servers[0].client()
        try:
            return health, await own.generate([151644, 872], sp, session_id="s")
        finally:
            await own.aclose()

    health, gen = asyncio.run(scenario())
    assert health.status == "ok" and len(gen.token_ids) == 2


def test_every_request_completes_when_a_server_is_killed_mid_run(service):
    servers = service.servers
    sp = SamplingParams(temperature=1.0, max_tokens=8, seed=0)
    n_sessions, n_turns = 8, 4

    async def episode(router, i, kill_event):
        ctx = [151644, 872, 198, 100 + i]
        placed = []
        for turn in range(n_turns):
            gen = await router.generate(ctx, sp, session_id=f"ep{i}", timeout_s=120)
            assert len(gen.token_ids) == 8 and gen.finish_reason == "length"
            placed.append(gen.server_id)
            ctx = ctx + gen.token_ids + [198, 200 + turn]
            if turn == 1:
                kill_event.set()
        return placed

    async def scenario():
        router = service.client
        router.health_interval_s = 0.5
        await router.start()
        kill = asyncio.Event()

        async def killer():
            await kill.wait()
            servers[0].kill()  # SIGKILL, mid-run: other episodes still have requests in flight

        k = asyncio.create_task(killer())
        placements = await asyncio.gather(*(episode(router, i, kill) for i in range(n_sessions)))
        await k
        stats = router.stats()
        await router.aclose()
        return placements, stats

    placements, stats = asyncio.run(scenario())
    dead = servers[0].url
    assert not servers[0].alive
    assert any(dead in p for p in placements)  # the dead server did serve before it died
    assert all(p[-1] == servers[1].url for p in placements)  # and every session ended on the survivor
    # sessions stuck to their server until it died: at most one move per session
    for p in placements:
        assert sum(a != b for a, b in itertools.pairwise(p)) <= 1
    assert stats["requests"] == n_sessions * n_turns
    print(
        f"router stats after the kill: moves={stats['moves']} retries={stats['retries']} failures={stats['failures']}"
    )
