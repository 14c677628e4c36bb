"""CpuGate: CPU sections of many tasks run in slices, first come first served, with the loop's
timers and sockets served between slices; cancelled waiters never wedge it."""

from __future__ import annotations

import asyncio
import time

import pytest

from agentrl.rollout.pacing import CpuGate


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def _burst(gate: CpuGate, n: int, section_s: float, log: list[str]) -> None:
    async def episode(i: int) -> None:
        async with gate:
            log.append(f"s{i}")
            spin(section_s)

    async def timer() -> None:
        await asyncio.sleep(0)
        log.append("timer")

    tasks = [asyncio.create_task(episode(i)) for i in range(n)]
    clock = asyncio.create_task(timer())
    await asyncio.gather(*tasks, clock)


def test_a_burst_runs_in_slices_in_arrival_order() -> None:
    gate = CpuGate(slice_s=0.002)
    log: list[str] = []
    asyncio.run(_burst(gate, 40, 0.0005, log))
    sections = [x for x in log if x != "timer"]
    assert sections == [f"s{i}" for i in range(40)]
    # 40 x 0.5 ms = 20 ms of work in slices of about 2 ms: several slices, and the timer task
    # (ready right after the burst began) ran long before the last section.
    assert gate.slices >= 5
    assert log.index("timer") < 20
    assert gate.queued > 0


def test_uncontended_sections_do_not_queue() -> None:
    gate = CpuGate(slice_s=1.0)

    async def main() -> None:
        for _ in range(50):
            async with gate:
                pass
            await asyncio.sleep(0)

    asyncio.run(main())
    assert gate.queued == 0 and gate.slices == 0


def test_cancelled_waiters_do_not_wedge_the_gate() -> None:
    gate = CpuGate(slice_s=0.001)
    done: list[int] = []

    async def episode(i: int) -> None:
        async with gate:
            spin(0.0005)
            done.append(i)

    async def main() -> None:
        tasks = [asyncio.create_task(episode(i)) for i in range(30)]
        await asyncio.sleep(0)  # all of them are in, or queued at, the gate
        for t in tasks[5:15]:
            t.cancel()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5)

    asyncio.run(main())
    assert done == [i for i in range(30) if not 5 <= i < 15]


def test_exceptions_leave_the_gate_usable() -> None:
    gate = CpuGate(slice_s=0.001)

    async def main() -> int:
        with pytest.raises(RuntimeError):
            async with gate:
                raise RuntimeError("boom")
        async with gate:
            return 1

    assert asyncio.run(main()) == 1
    assert gate._entered == {}


def test_slice_must_be_positive() -> None:
    with pytest.raises(ValueError, match="slice_s"):
        CpuGate(slice_s=0)


def test_slices_stay_bounded_when_section_lengths_vary(monkeypatch: pytest.MonkeyPatch) -> None:
    """Many tiny sections make the wake-up estimate too generous for the long ones that follow;
    a woken section that finds its slice spent waits for the next (on a fake clock)."""
    from agentrl.rollout import pacing

    now = [0.0]
    monkeypatch.setattr(pacing.time, "perf_counter", lambda: now[0])
    gate = CpuGate(slice_s=0.002)
    per_slice: dict[int, float] = {}
    order: list[int] = []

    async def episode(i: int, cost: float) -> None:
        async with gate:
            order.append(i)
            now[0] += cost
            per_slice[gate.slices] = per_slice.get(gate.slices, 0.0) + cost

    async def main() -> None:
        tasks = [asyncio.create_task(episode(i, 1e-6)) for i in range(200)]
        tasks += [asyncio.create_task(episode(200 + i, 0.001)) for i in range(40)]
        await asyncio.gather(*tasks)

    asyncio.run(main())
    assert order == list(range(240))
    assert max(per_slice.values()) <= 0.002 + 0.001 + 1e-9
    assert gate.slices >= 19  # 40 ms of long sections, two per 2 ms slice
