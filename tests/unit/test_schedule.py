"""The scheduler's three modes with fake rollouts and a fake trainer: ledger, staleness, overlap."""

from __future__ import annotations

import asyncio
import random

import pytest

from agentrl.orchestration.ledger import LedgerError, PromptLedger, PromptRef, PromptSampler
from agentrl.orchestration.schedule import GroupResult, Scheduler, StepRecord
from agentrl.types import FinishReason, TokenOrigin, Trajectory


class FakeWorld:
    """Rollouts that take `durations[i]` seconds, sample at the current server version, and can fail."""

    def __init__(self, *, seed: int = 0, fail: set[int] = frozenset(), equal: set[int] = frozenset(),
                 train_s: float = 0.02, slow_every: int = 0) -> None:
        self.rng = random.Random(seed)
        self.fail, self.equal = fail, equal
        self.train_s = train_s
        self.slow_every = slow_every
        self.version = 0
        self.trained: list[list[str]] = []
        self.pushed: list[int] = []
        self.records: list[StepRecord] = []
        self.calls = 0
        self.scheduler: Scheduler | None = None

    async def rollout(self, ref: PromptRef) -> list[Trajectory]:
        self.calls += 1
        slow = self.slow_every and ref.index % self.slow_every == 0
        trajs = []
        for i in range(2):
            t = Trajectory(group_id=ref.key, episode_id=f"{ref.key}-{i}")
            t.extend([1, 2], TokenOrigin.PROMPT, 0)
            await asyncio.sleep(0.03 if slow else self.rng.uniform(0.001, 0.01))
            t.extend([3], TokenOrigin.SAMPLED, 1, [-0.5], version=self.version)
            await asyncio.sleep(0.001)
            t.extend([4], TokenOrigin.SAMPLED, 2, [-0.5], version=self.version)
            t.reward = 1.0 if ref.index in self.equal else float(i)
            t.finish_reason = FinishReason.DONE
            if ref.index in self.fail:
                t.fault, t.finish_reason, t.error = "infra", FinishReason.ERROR, "sandbox died"
            trajs.append(t)
        return trajs

    async def train(self, step: int, groups: list[GroupResult]) -> dict[str, float]:
        await asyncio.sleep(self.train_s)
        self.trained.append([g.prompt.key for g in groups])
        return {"loss": 0.1}

    async def push(self, version: int) -> None:
        await asyncio.sleep(0.002)
        self.version = version
        self.pushed.append(version)

    async def after(self, record: StepRecord) -> None:
        self.records.append(record)


def classify_equal(group: GroupResult):
    if not any(t.trainable for t in group.trajectories):
        return "infra", "sandbox died"
    if len({t.reward for t in group.trajectories}) == 1:
        return "filtered", "equal rewards"
    return "ok", ""


def make(world: FakeWorld, mode: str, *, rows: int = 20, P: int = 3, K: int = 1, partial: bool = False,
         max_attempts: int = 3, admit=None) -> Scheduler:
    s = Scheduler(
        mode=mode, prompts_per_step=P, sampler=PromptSampler(rows, seed=1), ledger=PromptLedger(max_attempts=max_attempts),
        rollout=world.rollout, train=world.train, push=world.push, after_step=world.after,
        classify=classify_equal, max_staleness=K, partial_rollout=partial, admit=admit,
    )  # fmt: skip
    world.scheduler = s
    return s


@pytest.mark.parametrize("mode", ["sync", "one_step_off", "async"])
def test_every_mode_trains_full_batches_and_balances_the_ledger(mode):
    world = FakeWorld()
    s = make(world, mode)
    asyncio.run(s.run(0, 5))
    assert len(world.trained) == 5
    assert all(len(b) == 3 for b in world.trained)
    assert world.pushed == [1, 2, 3, 4, 5]
    summary = s.ledger.check(allow_in_flight=False)
    assert summary["trained"] == 15
    assert summary["taken"] == summary["trained"] + summary["unfinished"]
    expected = {"sync": 0, "one_step_off": 1, "async": 1}[mode]
    assert max(max(r.staleness) for r in world.records) <= expected
    if mode == "sync":
        assert all(st == 0 for r in world.records for st in r.staleness)


def test_one_step_off_reaches_staleness_one_after_the_first_step():
    world = FakeWorld()
    s = make(world, "one_step_off")
    asyncio.run(s.run(0, 4))
    assert [max(r.staleness) for r in world.records] == [0, 1, 1, 1]
    # every trajectory of a group was sampled on one version (the push waits for the rollout)
    for r in world.records:
        for g in r.groups:
            assert len(set(g.token_versions)) == 1


@pytest.mark.parametrize("K", [0, 1, 2])
@pytest.mark.parametrize("partial", [False, True])
def test_async_never_trains_a_group_older_than_the_bound(K, partial):
    world = FakeWorld(slow_every=4, train_s=0.01)
    s = make(world, "async", rows=40, P=4, K=K, partial=partial)
    asyncio.run(s.run(0, 8))
    staleness = [st for r in world.records for st in r.staleness]
    assert max(staleness) <= K
    assert s.max_staleness_seen <= K
    summary = s.ledger.check(allow_in_flight=False)
    assert summary["unfinished"] == 0  # nothing generated was thrown away
    assert summary["trained"] == sum(len(b) for b in world.trained)
    assert world.calls == summary["taken"]
    if not partial:
        for r in world.records:
            for g in r.groups:
                assert len(set(g.token_versions)) == 1, "without partial rollout no episode spans a push"


def test_async_with_partial_rollout_keeps_each_tokens_version():
    world = FakeWorld(slow_every=2, train_s=0.005)
    s = make(world, "async", rows=40, P=2, K=2, partial=True)
    asyncio.run(s.run(0, 10))
    mixed = [g for r in world.records for g in r.groups if len(set(g.token_versions)) > 1]
    for g in mixed:
        assert min(g.token_versions) >= g.version
    assert s.max_staleness_seen <= 2


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_infra_failures_are_requeued_then_failed_and_never_trained(mode):
    world = FakeWorld(fail={0, 1})
    s = make(world, mode, rows=6, P=2, max_attempts=2)
    asyncio.run(s.run(0, 6))
    trained = {k for b in world.trained for k in b}
    assert not any(k.startswith(("e0-r0-", "e0-r1-")) for k in trained)
    summary = s.ledger.check(allow_in_flight=False)
    failed = {e.uid for e in s.ledger.entries.values() if e.status == "failed"}
    requeued = {e.uid for e in s.ledger.entries.values() if e.status == "requeued"}
    assert {"e0-r0", "e0-r1"} <= failed | requeued
    assert summary["failed"] >= 2 or mode == "async"
    assert summary["taken"] == sum(summary[k] for k in summary if k != "taken")


def test_filtered_groups_are_counted_and_not_trained():
    world = FakeWorld(equal={2, 3})
    s = make(world, "sync", rows=6, P=6)
    asyncio.run(s.run(0, 1))
    assert len(world.trained[0]) == 4
    assert s.ledger.check()["filtered"] == 2
    reasons = {e.reason for e in s.ledger.entries.values() if e.status == "filtered"}
    assert reasons == {"equal rewards"}


def test_sampler_is_seeded_requeue_first_and_resumes_at_the_same_place():
    a = PromptSampler(5, seed=3)
    first = a.take(7)
    assert sorted(r.index for r in first[:5]) == list(range(5))
    assert first[5].epoch == 1
    a.requeue([PromptRef(0, 4, 1)], front=True)
    state = a.state()
    b = PromptSampler(5, seed=3)
    b.load_state(state)
    assert b.take(4) == a.take(4)
    assert b.take(1)[0].attempt == 0


def test_ledger_refuses_impossible_transitions():
    ledger = PromptLedger()
    ref = PromptRef(0, 1)
    with pytest.raises(LedgerError, match="never taken"):
        ledger.trained(ref, 0)
    ledger.taken(ref)
    ledger.trained(ref, 0)
    with pytest.raises(LedgerError, match="already trained"):
        ledger.filtered(ref, "x")
    with pytest.raises(LedgerError, match="taken twice"):
        ledger.taken(ref)
    ledger.taken(PromptRef(0, 2))
    with pytest.raises(LedgerError, match="unaccounted"):
        ledger.check(allow_in_flight=False)


# ── faults: whatever stops the run, every prompt taken gets a final state ─────────


@pytest.mark.parametrize("mode", ["sync", "one_step_off", "async"])
def test_a_run_that_fails_mid_step_closes_every_prompt_in_the_journal(tmp_path, mode):
    from agentrl.errors import TrainerError
    from agentrl.orchestration.ledger import journal_balance, read_journal

    world = FakeWorld(seed=3)

    async def dies(step, groups):
        if step == 1:
            raise TrainerError("a trainer process died during 'train'")
        return await FakeWorld.train(world, step, groups)

    world.train = dies
    s = make(world, mode)
    s.ledger.path = tmp_path / "ledger.jsonl"
    with pytest.raises(TrainerError):
        asyncio.run(s.run(0, 4))
    counts = journal_balance(tmp_path / "ledger.jsonl")  # raises unless every attempt has one final line
    assert counts["trained"] == 3 and counts["unfinished"] >= 3
    unfinished = [r for r in read_journal(tmp_path / "ledger.jsonl") if r["status"] == "unfinished"]
    assert all("the run stopped (TrainerError)" in r["reason"] for r in unfinished)
    assert s.ledger.check(allow_in_flight=False)["in_flight"] == 0
    assert [r.uid for r in s.sampler.requeued][:3] == [r["uid"] for r in unfinished][:3], "they are retaken first"


def test_a_killed_session_is_closed_by_the_next_one(tmp_path):
    from agentrl.orchestration.ledger import close_orphans, journal_balance, next_session

    path = tmp_path / "ledger.jsonl"
    ledger = PromptLedger(path, session=0)
    a, b = PromptRef(0, 1), PromptRef(0, 2)
    ledger.taken(a)
    ledger.taken(b)
    ledger.trained(a, 0)
    with path.open("a") as f:
        f.write('{"key": "e0-r3-a0", "status": "ta')  # SIGKILL in the middle of a line
    assert next_session(path) == 1
    assert close_orphans(path, "killed; closed when session 1 started") == 1
    counts = journal_balance(path)
    assert counts == {"taken": 2, "trained": 1, "unfinished": 1}
    ledger2 = PromptLedger(path, session=1)
    ledger2.taken(b)  # the resumed session retakes it under its own session number
    ledger2.trained(b, 0)
    assert journal_balance(path) == {"taken": 3, "trained": 2, "unfinished": 1}


def test_steps_with_nothing_to_train_stop_the_run_after_max_skipped_steps():
    from agentrl.orchestration.schedule import NoProgressError

    world = FakeWorld(equal=set(range(20)))  # every group filtered (equal rewards)
    s = make(world, "sync")
    s.max_skipped_steps = 2
    s.resume_command = "agentrl run runs/mine/config.yaml resume=true run.name=mine"
    with pytest.raises(NoProgressError, match="2 steps in a row had nothing to train.*equal rewards") as caught:
        asyncio.run(s.run(0, 5))
    assert str(caught.value).endswith("continue with: agentrl run runs/mine/config.yaml resume=true run.name=mine")
    assert s.steps_skipped == 2 and len(world.records) == 2 and world.trained == []
    assert s.ledger.check(allow_in_flight=False)["filtered"] == 6


def test_a_group_whose_requests_the_server_refused_is_filtered_with_the_reason():
    from agentrl.orchestration.schedule import default_classify

    trajs = []
    for i in range(2):
        t = Trajectory(group_id="g", episode_id=f"g-{i}")
        t.fault, t.finish_reason = "request", FinishReason.ERROR
        t.error = "the server refused the request: HTTP 400 the prompt has 936 tokens"
        trajs.append(t)
    verdict, reason = default_classify(GroupResult(PromptRef(0, 0), trajs, 0))
    assert verdict == "filtered" and "936 tokens" in reason


@pytest.mark.parametrize("mode", ["sync", "one_step_off", "async"])
def test_a_prompt_refused_before_rollout_is_filtered_replaced_and_never_rolled_out(mode):
    world = FakeWorld()
    rolled: list[int] = []
    rollout = world.rollout

    async def counting(ref: PromptRef) -> list[Trajectory]:
        rolled.append(ref.index)
        return await rollout(ref)

    world.rollout = counting  # type: ignore[method-assign]
    s = make(world, mode, rows=6, P=3,
             admit=lambda ref: "prompt of 900 tokens over rollout.max_total_tokens=512" if ref.index == 2 else None)
    asyncio.run(s.run(0, 4))
    assert 2 not in rolled and all(len(batch) == 3 for batch in world.trained)  # replaced, full batches
    filtered = [e for e in s.ledger.entries.values() if e.status == "filtered"]
    assert filtered and {e.index for e in filtered} == {2}
    assert {e.reason for e in filtered} == {"prompt of 900 tokens over rollout.max_total_tokens=512"}
    assert sum(r.refused for r in world.records) == len(filtered)
    s.ledger.check(allow_in_flight=mode == "async")


@pytest.mark.parametrize("mode", ["sync", "one_step_off", "async"])
def test_a_dataset_whose_every_prompt_is_refused_stops_the_run(mode):
    from agentrl.orchestration.schedule import NoProgressError

    world = FakeWorld()
    s = make(world, mode, rows=4, P=2, admit=lambda ref: "prompt of 900 tokens over rollout.max_total_tokens=512")
    with pytest.raises(NoProgressError, match="4 prompts in a row were filtered before rollout .the last: prompt "
                                              "of 900 tokens.*no row of the dataset can be rolled out"):
        asyncio.run(asyncio.wait_for(s.run(0, 3), 10))
    assert world.calls == 0 and world.trained == []
    assert s.ledger.check(allow_in_flight=False)["filtered"] == 4
