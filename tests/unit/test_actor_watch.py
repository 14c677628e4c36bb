"""The watch on the colocated trainer's process: Ray's death message read into a cause, the run's
work cancelled (its books closed naming the death) the moment the watch fails, and nothing left
running however `run_watched` ends. The real actor, killed mid-step, is in
tests/faults/test_driver.py (`test_a_killed_colocated_trainer_...`)."""

from __future__ import annotations

import asyncio

import pytest

from agentrl.errors import TrainerError
from agentrl.orchestration.actor_watch import death_cause, run_watched
from agentrl.orchestration.ledger import PromptLedger, PromptSampler, journal_balance, read_journal
from agentrl.orchestration.schedule import Scheduler
from agentrl.types import Trajectory

# What Ray 2.60 said to an outstanding call when the actor's process was SIGKILLed (verbatim).
SIGKILLED = (
    "The actor died unexpectedly before finishing this task.\n\tclass_name: ColocatedTrainerWorker\n"
    "\tactor_id: d50025d1efe8d909e8c3bd0b01000000\n\tpid: 15285\n\tnamespace: e86f8bd2\n\tip: 192.0.2.2\n"
    "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit "
    "detail: Worker unexpectedly exits with a connection error code 2. End of file. Some common causes "
    "include: (1) the process was killed by the OOM killer due to high memory usage, (2) ray stop --force "
    "was called, or (3) the worker crashed unexpectedly due to SIGSEGV or another unexpected error."
)


def test_the_cause_names_the_pid_and_rays_exit_type_and_detail() -> None:
    cause = death_cause(RuntimeError(SIGKILLED))
    assert cause == ("pid 15285; worker exit type SYSTEM_ERROR: Worker unexpectedly exits with a connection "
                     "error code 2. End of file.")


def test_without_an_exit_type_the_cause_is_rays_reason_or_its_last_line() -> None:
    created = "The actor died because of an error raised in its creation task, ray::A.__init__()\n\tpid: 7"
    assert death_cause(RuntimeError(created)) == (
        "pid 7; it died because of an error raised in its creation task, ray::A.__init__()")
    assert death_cause(RuntimeError("first\nthe last line")) == "the last line"
    assert death_cause(RuntimeError()) == ""


class Work:
    """A long piece of work that records how it ended."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.ended = ""

    async def __call__(self, seconds: float = 60.0) -> str:
        self.started.set()
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            self.ended = "cancelled"
            raise
        self.ended = "finished"
        return "done"


async def dies_after(work: Work, error: BaseException) -> None:
    await work.started.wait()
    raise error


def test_a_failed_watch_cancels_the_work_tells_it_why_and_raises_its_error() -> None:
    work = Work()
    told: list[BaseException] = []
    death = TrainerError("the trainer process died")

    async def main() -> None:
        await run_watched(work(), dies_after(work, death), on_death=told.append)

    with pytest.raises(TrainerError, match="the trainer process died"):
        asyncio.run(main())
    assert work.ended == "cancelled" and told == [death]


def test_work_that_ends_first_returns_and_the_watch_is_cancelled() -> None:
    work = Work()
    watch_ended: list[str] = []

    async def watch() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            watch_ended.append("cancelled")
            raise

    async def main() -> str:
        return await run_watched(work(0.01), watch())

    assert asyncio.run(main()) == "done"
    assert work.ended == "finished" and watch_ended == ["cancelled"]


def test_an_error_of_the_work_is_raised_as_it_is() -> None:
    async def fails() -> None:
        raise ValueError("a bug in a step")

    async def watch() -> None:
        await asyncio.sleep(60)

    with pytest.raises(ValueError, match="a bug in a step"):
        asyncio.run(run_watched(fails(), watch()))


def test_cancelling_the_watched_run_cancels_both() -> None:
    work = Work()
    watch_work = Work()

    async def main() -> None:
        task = asyncio.ensure_future(run_watched(work(), watch_work()))
        await work.started.wait()
        await watch_work.started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert work.ended == "cancelled" and watch_work.ended == "cancelled"


def test_a_death_mid_rollout_closes_the_prompts_in_flight_naming_it(tmp_path) -> None:
    """The scheduler's rollouts wait on a dead engine; the watch stops the run and the ledger balances."""
    rolling = asyncio.Event()

    async def rollout(ref) -> list[Trajectory]:
        rolling.set()
        await asyncio.sleep(60)  # a request to an engine that will never answer
        raise AssertionError("unreachable")

    async def train(step, groups) -> dict[str, float]:
        raise AssertionError("nothing reaches training")

    async def push(version: int) -> None:
        return None

    scheduler = Scheduler(mode="sync", prompts_per_step=3, sampler=PromptSampler(10, seed=1),
                          ledger=PromptLedger(), rollout=rollout, train=train, push=push)
    scheduler.ledger.path = tmp_path / "ledger.jsonl"

    async def watch() -> None:
        await rolling.wait()
        raise TrainerError("The trainer process (rank 0) died, and the vLLM engine it hosted with it")

    async def main() -> None:
        await run_watched(scheduler.run(0, 2), watch(), on_death=scheduler.stop_because)

    with pytest.raises(TrainerError, match="vLLM engine it hosted"):
        asyncio.run(main())
    assert journal_balance(tmp_path / "ledger.jsonl") == {"taken": 3, "unfinished": 3}
    reasons = {r["reason"] for r in read_journal(tmp_path / "ledger.jsonl") if r["status"] == "unfinished"}
    assert reasons == {"the run stopped (TrainerError) while it was in flight"}
