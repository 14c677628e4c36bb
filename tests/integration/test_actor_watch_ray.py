"""`TrainerGroup.watch` against a real Ray actor process: SIGKILL of the actor fails the outstanding
watch call and the watch raises a `TrainerError` naming the trainer, the engine it hosted, the dead
process's pid, Ray's exit type and the resume command; a watch that is cancelled (the run ended)
leaves the actor alive. The actor is a small stand-in with the two methods the watch uses, so no
model loads; the whole colocated run, killed mid-rollout, is in tests/faults/test_driver.py."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from agentrl.errors import TrainerError

pytestmark = pytest.mark.slow

RESUME = "agentrl run runs/x/config.yaml resume=true run.name=x"


@pytest.fixture(scope="module")
def ray_here() -> Iterator[None]:
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR")
    yield
    if started:
        ray.shutdown()


def watched_group() -> tuple[Any, Any]:
    import ray

    from agentrl.orchestration.trainer_group import TrainerGroup

    class EngineHost:  # defined here so that Ray ships it by value (workers cannot import this module)
        """What `TrainerGroup.watch` calls of a `ColocatedTrainerWorker`: `watch`, plus its pid."""

        async def pid(self) -> int:
            return os.getpid()

        async def watch(self) -> None:
            await asyncio.Event().wait()

    actor = ray.remote(num_cpus=0)(EngineHost).remote()
    group = object.__new__(TrainerGroup)  # the watch needs only its actors and the resume command
    group.actors, group.colocated, group.resume_command = [actor], True, RESUME
    return group, actor


def test_a_killed_actor_fails_the_watch_with_its_cause_and_the_resume_command(ray_here: None) -> None:
    group, actor = watched_group()

    async def main() -> tuple[int, str]:
        pid = await actor.pid.remote()
        watch = asyncio.ensure_future(group.watch())
        await asyncio.sleep(0.5)
        assert not watch.done()  # alive: the watch waits
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(TrainerError) as caught:
            await asyncio.wait_for(watch, 120)  # a deadline for a broken watch, not a timing check
        return pid, str(caught.value)

    pid, message = asyncio.run(main())
    assert message.startswith("The trainer process (rank 0) died, and the vLLM engine it hosted")
    assert f"(ActorDiedError: pid {pid}; worker exit type SYSTEM_ERROR" in message
    assert "closed as unfinished in ledger.jsonl" in message and message.endswith(f"continue with: {RESUME}")


def test_an_engine_call_that_finds_the_actor_dead_ends_the_watch_at_once(ray_here: None) -> None:
    """Under load Ray can fail a call to the dead engine before it fails the outstanding watch call; the
    engine call's `ActorDiedError` then ends the watch, naming that rank and its process, so the run
    does not route around a dead colocated engine until its requests time out. Here the watch's own
    actor stays alive, so only the engine call can end it."""
    import functools

    from agentrl.errors import ServerUnavailableError
    from agentrl.orchestration.trainer_group import _actor_call

    group, _watched = watched_group()
    _, engine_host = watched_group()

    async def main() -> tuple[int, str, str]:
        pid = await engine_host.pid.remote()
        watch = asyncio.ensure_future(group.watch())
        await asyncio.sleep(0.5)
        os.kill(pid, signal.SIGKILL)
        call = functools.partial(_actor_call, engine_host, "colocated-rank-0", on_death=functools.partial(group._died, 0))
        with pytest.raises(ServerUnavailableError) as engine_error:
            await asyncio.wait_for(call("pid"), 120)
        with pytest.raises(TrainerError) as caught:
            await asyncio.wait_for(watch, 5)
        return pid, str(engine_error.value), str(caught.value)

    pid, engine_message, message = asyncio.run(main())
    assert "the trainer process hosting this engine is gone (ActorDiedError)" in engine_message
    assert message.startswith("The trainer process (rank 0) died, and the vLLM engine it hosted")
    assert f"(ActorDiedError: pid {pid}; worker exit type SYSTEM_ERROR" in message
    assert message.endswith(f"continue with: {RESUME}")


def test_a_cancelled_watch_leaves_the_actor_alive(ray_here: None) -> None:
    group, actor = watched_group()

    async def main() -> tuple[int, int]:
        pid = await actor.pid.remote()
        watch = asyncio.ensure_future(group.watch())
        await asyncio.sleep(0.5)
        watch.cancel()
        with pytest.raises(asyncio.CancelledError):
            await watch
        return pid, await asyncio.wait_for(actor.pid.remote(), 60)

    before, after = asyncio.run(main())
    assert before == after


def test_split_trainers_are_not_watched() -> None:
    from agentrl.orchestration.trainer_group import TrainerGroup

    group = object.__new__(TrainerGroup)
    with pytest.raises(TrainerError, match="needs placement=colocated"):
        asyncio.run(group.watch())
