"""Two real `hf` servers behind the router; one is killed mid-run and every request still completes."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from agentrl.inference import Router, launch_server
from agentrl.types import SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def servers(assets):
    model = str(assets / "tiny-random-qwen2")
    procs = [launch_server("hf", model, startup_timeout_s=300, num_threads=1) for _ in range(2)]
    yield procs
    for p in procs:
        p.stop()
    assert not any(p.alive for p in procs)


def test_every_request_completes_when_a_server_is_killed_mid_run(servers):
    sp = SamplingParams(temperature=1.0, max_tokens=8, stop_token_ids=(), seed=0)
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
        router = Router([p.url for p in servers], health_interval_s=0.5)
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
