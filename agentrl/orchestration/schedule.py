"""When rollout, training and weight pushes happen: the synchronous, one-step-off and async modes.

The scheduler is the part of the driver that decides *when*; it knows nothing of Ray, servers or
models. It is given three coroutines: `rollout(prompt)` plays one prompt's group of episodes,
`train(step, groups)` runs one optimizer step on a batch of groups (after it returns, the new
weights are ready to push) and `push(version)` makes every server serve that weight version. A
group's *version* is the server weight version when its first episode started; a batch trained
at trainer version `s` has staleness `s - version` per group.

- `sync`: take `P` prompts, roll them out, train, push, repeat. Staleness 0.
- `one_step_off`: the rollout of batch `s+1` runs (on weights `s`) while batch `s` trains; the
  push waits for that rollout, so no episode mixes versions. Staleness 1.
- `async`: a producer keeps admitting prompts one at a time while the trainer takes batches
  as groups complete. Two rules keep it honest: while the servers hold version `v`, admission stops
  once `(v - v0 + K + 1) * P` groups have been taken in all (v0: the version the run started at), or
  the remaining steps are covered, or a push is pending, so the rollout side pauses rather than
  over-generates; and a batch at trainer version `s` must include every group of version
  `<= s - K` (waiting for it if it is still running), so no trained group is ever more than `K`
  versions old. Batches are filled oldest version first. With `partial_rollout`, a push happens
  at once and in-flight episodes continue on the new weights (each token keeps its version);
  without it, admission stops and the push waits until in-flight episodes finish.

Every prompt taken goes through the `PromptLedger`: trained, filtered, requeued (all its episodes
failed for infrastructure reasons), failed, or unfinished when the run ended or stopped, in every
mode and however it stopped. A step with nothing to train is skipped (and counted); after
`max_skipped_steps` of them in a row the run stops with `NoProgressError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

from agentrl.errors import AgentRLError, RunWriteError
from agentrl.orchestration.ledger import PromptLedger, PromptRef, PromptSampler
from agentrl.types import Trajectory

__all__ = ["GroupResult", "NoProgressError", "Scheduler", "StepRecord", "default_classify"]

log = logging.getLogger(__name__)


class NoProgressError(AgentRLError):
    """`run.max_skipped_steps` steps in a row had nothing to train: the run stops."""

Mode = Literal["sync", "one_step_off", "async"]


@dataclass
class GroupResult:
    """One prompt's episodes and the weight version they started on."""

    prompt: PromptRef
    trajectories: list[Trajectory]
    version: int
    seconds: float = 0.0
    note: str = ""
    """What the update left out of the group (sequences the on-policy gate masked), for its ledger line."""

    @property
    def token_versions(self) -> list[int]:
        return [
            v for t in self.trajectories for v, m in zip(t.versions, t.response_mask, strict=True) if m
        ]


@dataclass
class StepRecord:
    """What one training step consumed and how long its parts took."""

    step: int
    trainer_version: int
    groups: list[GroupResult]
    train_metrics: dict[str, float]
    timings: dict[str, float] = field(default_factory=dict)
    discarded: list[GroupResult] = field(default_factory=list)
    refused: int = 0
    """Prompts filtered before rollout (`Scheduler(admit=...)`) since the previous step's record."""

    @property
    def staleness(self) -> list[int]:
        return [self.trainer_version - g.version for g in self.groups]

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for g in self.groups for t in g.trajectories]


Verdict = tuple[Literal["ok", "filtered", "infra"], str]


def default_classify(group: GroupResult) -> Verdict:
    """`ok` when an episode of the group is trainable; else `filtered` when the servers refused its
    requests (a prompt too long for their context: retrying would not help), else `infra`."""
    if not any(t.trainable for t in group.trajectories):
        refused = sorted({t.error or "" for t in group.trajectories if t.fault == "request"})
        if refused:
            return "filtered", "; ".join(refused)[:300]
        errors = sorted({t.error or (t.finish_reason.value if t.finish_reason else "?") for t in group.trajectories})
        return "infra", "; ".join(errors)[:300]
    return "ok", ""


class Scheduler:
    """Runs training steps in one of three modes (see the module docstring)."""

    def __init__(
        self,
        *,
        mode: Mode,
        prompts_per_step: int,
        sampler: PromptSampler,
        ledger: PromptLedger,
        rollout: Callable[[PromptRef], Awaitable[list[Trajectory]]],
        train: Callable[[int, list[GroupResult]], Awaitable[dict[str, float]]],
        push: Callable[[int], Awaitable[None]],
        after_step: Callable[[StepRecord], Awaitable[None]] | None = None,
        classify: Callable[[GroupResult], Verdict] = default_classify,
        max_staleness: int = 1,
        partial_rollout: bool = False,
        version: int = 0,
        max_skipped_steps: int = 0,
        resume_command: str = "",
        admit: Callable[[PromptRef], str | None] | None = None,
    ) -> None:
        """`resume_command`: the command that continues this run (`run_commands.resume_command`),
        named in the message of a run that stops for lack of progress. `admit(prompt)`: why a prompt
        must not be rolled out (it is then filtered in the ledger and replaced), or None."""
        if mode not in ("sync", "one_step_off", "async"):
            raise AgentRLError(f"run.mode '{mode}' is not one of sync, one_step_off, async.")
        self.mode = mode
        self.P = prompts_per_step
        self.K = 0 if mode == "sync" else (1 if mode == "one_step_off" else max_staleness)
        self.partial_rollout = partial_rollout
        self.sampler, self.ledger = sampler, ledger
        self._rollout, self._train, self._push = rollout, train, push
        self._after_step = after_step
        self._classify = classify
        self.server_version = version
        self.trainer_version = version
        self.push_lock = asyncio.Lock()  # held by a push; the driver's evaluation holds it too
        self.generated_groups = 0
        self.max_staleness_seen = 0
        self.max_skipped_steps = max_skipped_steps
        self.resume_command = resume_command
        self.skipped_in_a_row = 0
        self.steps_skipped = 0
        self.steps_trained = 0
        # async-mode state
        self._in_system: dict[str, tuple[PromptRef, int]] = {}
        self._completed: list[GroupResult] = []
        self._running: set[asyncio.Task[None]] = set()
        self._in_flight = 0
        self._push_pending = False
        self._consumed = 0
        self._batches_left = 0
        self._base_version = version
        self._cond: asyncio.Condition | None = None
        self._admit = admit
        self._refused_since_record = 0  # prompts `admit` refused since the last step's record
        self._refused_in_a_row = 0
        self._fatal: BaseException | None = None
        self.stopped_by: BaseException | None = None
        """Why `run` is being cancelled from outside when not for an interruption (`stop_because`)."""

    # ── shared pieces ───────────────────────────────────────────────────────────────────────
    async def _play(self, ref: PromptRef) -> GroupResult:
        version = self.server_version
        start = time.perf_counter()
        trajectories = await self._rollout(ref)
        self.generated_groups += 1
        return GroupResult(ref, trajectories, version, time.perf_counter() - start)

    def _settle(self, group: GroupResult, step: int) -> bool:
        """Ledger the group's fate; True when it may be trained."""
        verdict, reason = self._classify(group)
        if verdict == "ok":
            return True
        if verdict == "filtered":
            self.ledger.filtered(group.prompt, reason, step)
        else:
            retry = self.ledger.infra_failed(group.prompt, reason)
            if retry is not None:
                self.sampler.requeue([retry], front=True)
            log.warning("every episode of prompt %s failed (%s); %s", group.prompt.key, reason,
                        "requeued" if retry else "giving up on it")
        return False

    def _take(self, n: int, step: int | None = None) -> list[PromptRef]:
        """`n` prompts to roll out (for `step`, where known). One that `admit` refuses is filtered
        in the ledger and another taken in its place; a whole epoch's worth refused in a row means
        no row can be rolled out, and the run stops."""
        refs: list[PromptRef] = []
        while len(refs) < n:
            [ref] = self.sampler.take(1)
            self.ledger.taken(ref)
            reason = self._admit(ref) if self._admit is not None else None
            if reason is None:
                self._refused_in_a_row = 0
                refs.append(ref)
                continue
            self.ledger.filtered(ref, reason, step)
            self._refused_since_record += 1
            self._refused_in_a_row += 1
            if self._refused_in_a_row >= self.sampler.usable_rows:
                raise NoProgressError(
                    f"{self._refused_in_a_row} prompts in a row were filtered before rollout (the last: {reason}); "
                    f"no row of the dataset can be rolled out. Shorten the prompts or raise the budget the "
                    "reason names, then start the run again.")
        return refs

    async def _train_and_record(
        self, step: int, groups: list[GroupResult], discarded: list[GroupResult], timings: dict[str, float]
    ) -> StepRecord:
        start = time.perf_counter()
        if groups:
            metrics = await self._train(step, groups)
            for g in groups:
                self.ledger.trained(g.prompt, step, g.note)
            self.max_staleness_seen = max([self.max_staleness_seen, *(self.trainer_version - g.version for g in groups)])
        else:
            metrics = {"batch/skipped": 1.0}
        timings["train_s"] = time.perf_counter() - start
        record = StepRecord(step, self.trainer_version, groups, metrics, timings, discarded,
                            refused=self._refused_since_record)
        self._refused_since_record = 0
        if groups:
            self.trainer_version += 1
            self.steps_trained += 1
            self.skipped_in_a_row = 0
        else:
            self.steps_skipped += 1
            self.skipped_in_a_row += 1
            log.warning("step %d had nothing to train (%d groups discarded: %s); skipped", step, len(discarded),
                        self._discard_reasons(record)[:300])
        return record

    def _discard_reasons(self, record: StepRecord) -> str:
        reasons = sorted({self.ledger.entries[g.prompt.key].reason for g in record.discarded
                          if g.prompt.key in self.ledger.entries})
        return "; ".join(reasons) or "no group completed"

    def _check_progress(self, record: StepRecord) -> None:
        if record.groups or not self.max_skipped_steps or self.skipped_in_a_row < self.max_skipped_steps:
            return
        raise NoProgressError(
            f"{self.skipped_in_a_row} steps in a row had nothing to train (run.max_skipped_steps="
            f"{self.max_skipped_steps}), so the run is making no progress and stops here. Why the last "
            f"step's groups were discarded: {self._discard_reasons(record)[:500]}. See ledger.jsonl for "
            "every prompt's fate; fix the cause and continue "
            + (f"with: {self.resume_command}" if self.resume_command else "the run with resume=true and its run.name.")
        )

    async def _push_now(self, version: int) -> float:
        start = time.perf_counter()
        async with self.push_lock:
            if version > self.server_version:
                await self._push(version)
                self.server_version = version
        return time.perf_counter() - start

    def stop_because(self, cause: BaseException) -> None:
        """Say why `run` is about to be cancelled from outside (the trainer's process died): the
        prompts in flight are then closed as `unfinished` naming `cause`, not an interruption."""
        self.stopped_by = cause

    # ── entry point ─────────────────────────────────────────────────────────────────────────
    async def run(self, start_step: int, total_steps: int) -> None:
        """Run steps `start_step .. total_steps - 1`. However it ends (done, an exception, Ctrl-C,
        cancelled), every prompt still in flight is closed as `unfinished` and requeued first."""
        if start_step >= total_steps:
            return
        runner = {"sync": self._run_sync, "one_step_off": self._run_one_step_off, "async": self._run_async}
        reason = "the run ended first"
        try:
            await runner[self.mode](start_step, total_steps)
        except BaseException as exc:
            cause = self.stopped_by or exc
            what = "interrupted" if isinstance(cause, (KeyboardInterrupt, asyncio.CancelledError)) else type(cause).__name__
            reason = f"the run stopped ({what}) while it was in flight"
            try:
                self.sampler.requeue(self.ledger.close_in_flight(reason), front=True)
            except RunWriteError as closing:  # the journal cannot take them (a full disk): the next session will
                log.error("the prompts in flight could not be closed in the ledger (%s); the next session of the "
                          "run closes them as unfinished before it takes any", closing.cause)
            raise
        self.sampler.requeue(self.ledger.close_in_flight(reason), front=True)

    # ── sync ────────────────────────────────────────────────────────────────────────────────
    async def _round(self, refs: list[PromptRef]) -> list[GroupResult]:
        tasks = [asyncio.ensure_future(self._play(r)) for r in refs]
        try:
            return list(await asyncio.gather(*tasks))
        finally:  # one group's error (or Ctrl-C) stops the others too, rather than leaving them running
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _run_sync(self, start_step: int, total_steps: int) -> None:
        for step in range(start_step, total_steps):
            t0 = time.perf_counter()
            results = await self._round(self._take(self.P, step))
            timings = {"rollout_s": time.perf_counter() - t0}
            usable = [g for g in results if self._settle(g, step)]
            discarded = [g for g in results if g not in usable]
            record = await self._train_and_record(step, usable, discarded, timings)
            timings["weight_sync_s"] = await self._push_now(self.trainer_version)
            timings["step_s"] = time.perf_counter() - t0
            await self._hook(record)

    # ── one step off ────────────────────────────────────────────────────────────────────────
    async def _run_one_step_off(self, start_step: int, total_steps: int) -> None:
        pending: asyncio.Task[list[GroupResult]] | None = asyncio.create_task(self._round(self._take(self.P, start_step)))
        try:
            for step in range(start_step, total_steps):
                t0 = time.perf_counter()
                assert pending is not None  # created before the loop and at every step but the last
                results = await pending
                timings = {"idle_s": time.perf_counter() - t0}
                usable = [g for g in results if self._settle(g, step)]
                discarded = [g for g in results if g not in usable]
                pending = (
                    asyncio.create_task(self._round(self._take(self.P, step + 1))) if step + 1 < total_steps else None
                )
                record = await self._train_and_record(step, usable, discarded, timings)
                if pending is not None:
                    t1 = time.perf_counter()
                    await asyncio.wait([pending])  # the push must not change weights under it
                    timings["wait_rollout_s"] = time.perf_counter() - t1
                timings["weight_sync_s"] = await self._push_now(self.trainer_version)
                timings["step_s"] = time.perf_counter() - t0
                await self._hook(record)
        finally:
            if pending is not None and not pending.done():
                pending.cancel()
                with contextlib.suppress(BaseException):
                    await pending

    # ── async ───────────────────────────────────────────────────────────────────────────────
    def _can_admit(self) -> bool:
        """Admit one more group? Groups of server version `v` can be trained up to step `v + K`,
        and the steps up to then take `(v - v0 + K + 1) * P` groups in all (v0: the version this
        run started at): admit no more than that (counting those already trained), and no more
        than the remaining steps need."""
        if self._push_pending or self._fatal is not None:
            return False
        admitted = self._consumed + len(self._in_system)
        bound = (self.server_version - self._base_version + self.K + 1) * self.P
        return admitted < bound and len(self._in_system) < self._batches_left * self.P

    def _must_take(self) -> list[str]:
        """Keys of groups that would be too stale after this step: they belong in this batch."""
        limit = self.trainer_version - self.K
        return [k for k, (_, v) in self._in_system.items() if v <= limit]

    def _batch_ready(self) -> bool:
        if self._fatal is not None:
            return True
        done = {g.prompt.key for g in self._completed}
        return all(k in done for k in self._must_take()) and len(self._completed) >= self.P

    async def _producer(self) -> None:
        assert self._cond is not None
        while True:
            async with self._cond:
                await self._cond.wait_for(self._can_admit)
                try:
                    [ref] = self._take(1)
                except NoProgressError as exc:  # no row can be rolled out: the trainer side raises it
                    self._fatal = exc
                    self._cond.notify_all()
                    return
                self._in_system[ref.key] = (ref, self.server_version)
                self._in_flight += 1
                task = asyncio.create_task(self._async_group(ref))
                self._running.add(task)
                task.add_done_callback(self._running.discard)

    async def _async_group(self, ref: PromptRef) -> None:
        assert self._cond is not None
        try:
            group = await self._play(ref)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a rollout bug must stop the run loudly, not hang it
            async with self._cond:
                self._fatal = exc
                self._in_flight -= 1
                self._cond.notify_all()
            return
        async with self._cond:
            self._in_flight -= 1
            if self._settle(group, self.trainer_version):
                self._completed.append(group)
            else:
                self._in_system.pop(ref.key, None)
            self._cond.notify_all()

    def _select(self) -> list[GroupResult]:
        must = set(self._must_take())
        chosen = [g for g in self._completed if g.prompt.key in must]
        rest = sorted((g for g in self._completed if g.prompt.key not in must), key=lambda g: g.version)
        chosen += rest[: max(0, self.P - len(chosen))]
        for g in chosen:
            self._completed.remove(g)
            self._in_system.pop(g.prompt.key, None)
        self._consumed += len(chosen)
        return chosen

    async def _drain_and_push(self, version: int) -> None:
        assert self._cond is not None
        async with self._cond:
            self._push_pending = True
            if not self.partial_rollout:
                await self._cond.wait_for(lambda: self._in_flight == 0)
        try:
            await self._push_now(version)
        finally:
            async with self._cond:
                self._push_pending = False
                self._cond.notify_all()

    async def _run_async(self, start_step: int, total_steps: int) -> None:
        self._cond = asyncio.Condition()
        self._batches_left = total_steps - start_step
        self._consumed = 0
        self._base_version = self.server_version
        producer = asyncio.create_task(self._producer())
        push_task: asyncio.Task[None] | None = None
        try:
            for step in range(start_step, total_steps):
                t0 = time.perf_counter()
                async with self._cond:
                    await self._cond.wait_for(self._batch_ready)
                    if isinstance(self._fatal, AgentRLError):  # e.g. too many infrastructure failures
                        raise self._fatal
                    if self._fatal is not None:
                        raise AgentRLError(f"a rollout failed unexpectedly: {self._fatal!r}") from self._fatal
                    batch = self._select()
                    self._batches_left -= 1
                    self._cond.notify_all()
                timings = {"idle_s": time.perf_counter() - t0}
                record = await self._train_and_record(step, batch, [], timings)
                if push_task is not None:
                    t1 = time.perf_counter()
                    await push_task
                    timings["wait_push_s"] = time.perf_counter() - t1
                t1 = time.perf_counter()
                push_task = asyncio.create_task(self._drain_and_push(self.trainer_version))
                if self.partial_rollout:
                    await push_task
                    push_task = None
                timings["weight_sync_s"] = time.perf_counter() - t1
                timings["step_s"] = time.perf_counter() - t0
                await self._hook(record)
            if push_task is not None:
                await push_task
        finally:
            producer.cancel()
            running = list(self._running)
            for task in running:
                task.cancel()
            await asyncio.gather(producer, *running, return_exceptions=True)
            if push_task is not None and not push_task.done():
                push_task.cancel()
                await asyncio.gather(push_task, return_exceptions=True)
            self._in_system.clear()  # their ledger entries are still in flight: `run` closes them
            self._completed.clear()

    async def _hook(self, record: StepRecord) -> None:
        if self._after_step is not None:
            await self._after_step(record)
        self._check_progress(record)

    # ── checkpoint support ──────────────────────────────────────────────────────────────────
    def in_system(self) -> list[PromptRef]:
        """Prompts admitted but not yet trained (async mode), for the data position of a checkpoint."""
        return [ref for ref, _ in self._in_system.values()]
