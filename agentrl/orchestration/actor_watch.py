"""Noticing at once that an actor the run cannot live without has died, and saying why.

With placement `colocated` the vLLM engine lives inside the trainer's Ray actor, so the death of
that one process (the OOM killer, a `kill -9`, a segfault) takes the trainer and every server of
the run with it. The driver learns of an actor's death only through a call to it: Ray fails every
outstanding call of a dead actor with `ActorDiedError` (a `RayActorError`) as soon as its control
store knows, which on one machine is milliseconds after a SIGKILL. So `TrainerGroup.watch` keeps one
call outstanding on each rank (`ColocatedTrainerWorker.watch`, which never answers) and turns its
failure into the run's `TrainerError`; without it, generation requests to the dead engine would wait
for a healthy server until `rollout.request_timeout_s`. Ray's state API
(`ray.util.state.get_actor(...).death_cause`) says the same, but it needs Ray's dashboard, which a
run starts without; the failed call's own message carries the dead process's pid and Ray's exit type
and detail, which `death_cause` reads.

`run_watched` runs the run's work (its steps) until it ends or a watch fails first; then the work
is told why (`on_death`), cancelled, and waited for (its own clean-up runs: the scheduler closes its
in-flight prompts as `unfinished`), and the watch's error is raised. This module restarts nothing:
a dead colocated actor stops the run, which `resume=true` continues from its last checkpoint. It
imports nothing of Ray (the watch itself is `TrainerGroup.watch`).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

__all__ = ["death_cause", "run_watched"]

T = TypeVar("T")

log = logging.getLogger(__name__)

_PID = re.compile(r"\bpid: (\d+)")
_EXIT = re.compile(r"Worker exit type: (\S+)(?:\s+Worker exit detail: (.*?))?(?:\s+Some common causes|\s*$)", re.S)
_BECAUSE = re.compile(r"The actor (?:is dead|died) because ([^\n]*)")


def death_cause(error: BaseException) -> str:
    """What ended an actor, read from Ray's `RayActorError` message: the process's pid and Ray's
    exit type and detail (`pid 123; worker exit type SYSTEM_ERROR: Worker unexpectedly exits ...`),
    else Ray's sentence on why it died, else the message's last line; "" when Ray said nothing."""
    text = str(error)
    parts = []
    pid = _PID.search(text)
    if pid:
        parts.append(f"pid {pid.group(1)}")
    exit_ = _EXIT.search(text)
    if exit_:
        detail = " ".join((exit_.group(2) or "").split())
        parts.append(f"worker exit type {exit_.group(1)}" + (f": {detail}" if detail else ""))
    else:
        because = _BECAUSE.search(text)
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        if because:
            parts.append(f"it died because {because.group(1).strip()}")
        elif lines and not (pid and len(lines) == 1):
            parts.append(lines[-1])
    return "; ".join(parts)[:600]


async def run_watched(work: Awaitable[T], watch: Awaitable[Any],
                      on_death: Callable[[BaseException], None] | None = None) -> T:
    """Await `work` while `watch` waits for a death (see the module docstring).

    `watch` must only ever end by raising (the error that stops the run). If it does before `work`
    ends, `on_death(error)` is called, `work` is cancelled and awaited, and the error is raised. If
    `work` ends first, `watch` is cancelled and `work`'s result (or error) returned. If this
    coroutine is cancelled (Ctrl-C), both are cancelled and awaited before the cancellation goes on.
    """
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(watch)
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        for task in (work_task, watch_task):
            task.cancel()
        await asyncio.gather(work_task, watch_task, return_exceptions=True)
        raise
    error = watch_task.exception() if watch_task.done() and not watch_task.cancelled() else None
    if error is not None:
        if not work_task.done():
            log.warning("a watched actor died; stopping the run's work: %s", error)
            if on_death is not None:
                on_death(error)
            work_task.cancel()
            cancelled_at = time.monotonic()
            await asyncio.gather(work_task, return_exceptions=True)
            log.info("the run's work ended %.1f s after it was cancelled", time.monotonic() - cancelled_at)
        raise error
    watch_task.cancel()
    await asyncio.gather(watch_task, return_exceptions=True)
    if not work_task.done():  # the watch returned (it must not): keep working, unwatched
        return await work_task
    return work_task.result()
