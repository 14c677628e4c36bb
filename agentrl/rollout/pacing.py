"""`CpuGate`: time slices for the CPU-bound sections of many episodes sharing one event loop.

asyncio runs every callback that is ready before it looks at sockets and timers again. When a
thousand episodes wake in the same iteration (their generations finished together) and each does
a few hundred microseconds of chat-template and parsing work, the loop answers nothing else for
the whole burst: server replies, tool sandboxes and heartbeats wait for hundreds of milliseconds.

The gate cuts such bursts into slices of about `slice_s` of wall time. An episode wraps its CPU
work in `async with gate:`; while the current slice has time left and nobody is queued, it goes
straight in (no suspension, about a microsecond). Otherwise it queues; at the next iteration of
the loop the gate opens a new slice and wakes as many queued episodes, first come first served,
as the last slice held; one that finds the slice already spent when it runs goes back to the
head of the queue. A slice is measured from when it opened, not by summing the sections, so the
work a task does between two sections (an env reset, creating tasks) counts against it too. A
gate that is not busy opens a slice at once, but only after the loop has polled since the last
one opened. Between two slices the loop polls its sockets and runs its due timers, so no stall is
much longer than a slice plus one task's work between two sections.

This paces work, it does not lock: sections never overlap anyway on one thread, and a section
that awaits inside merely counts its waiting as CPU (which makes slices shorter, never longer).
It does not move work to threads or processes: for more than one core, run several rollout
workers. A gate serves whichever loop runs it, but one loop at a time.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any

__all__ = ["CpuGate"]


class CpuGate:
    """Cooperative time slicing of CPU-bound sections on one event loop (see the module doc)."""

    def __init__(self, slice_s: float = 0.002) -> None:
        if slice_s <= 0:
            raise ValueError(f"slice_s must be positive, got {slice_s}")
        self.slice_s = slice_s
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._start = -float("inf")  # when the current slice opened (perf_counter)
        self._entries = 0  # sections that entered the current slice
        self._granted = 0  # woken waiters that have not entered yet
        self._room = 8  # how many waiters a new slice wakes, adapted to what the last ones held
        self._late = False  # a woken waiter found the current slice spent
        self._polled = True  # the loop polled sockets and timers since the current slice opened
        self._tick_pending = False
        self._front = 0  # waiters put back at the head of the queue since the last slice opened
        self._entered: dict[Any, float] = {}  # task -> when its section began
        self.slices = 0
        self.queued = 0
        self.longest_slice_s = 0.0

    def _open(self) -> None:
        self._start, self._entries, self._polled = time.perf_counter(), 0, False
        asyncio.get_running_loop().call_soon(self._mark_polled)

    def _mark_polled(self) -> None:
        self._polled = True

    def _spent(self) -> bool:
        return time.perf_counter() - self._start >= self.slice_s

    async def __aenter__(self) -> None:
        if self._polled and not (self._granted or self._waiters) and self._spent():
            self._open()  # the loop has polled since the last slice opened: start one at once
        elif self._granted or self._waiters or self._spent():
            await self._wait_turn()
            # Woken into a slice that earlier work already spent (the wake-up count is only an
            # estimate): wait for the next one, ahead of everybody who queued later.
            while self._spent():
                self._late = True
                await self._wait_turn(front=True)
        self._entries += 1
        self._entered[asyncio.current_task()] = time.perf_counter()

    async def __aexit__(self, *exc: object) -> None:
        now = time.perf_counter()
        del self._entered[asyncio.current_task()]
        if now - self._start > self.longest_slice_s:
            self.longest_slice_s = now - self._start
        if self._waiters or now - self._start >= self.slice_s:
            self._schedule_tick()

    async def _wait_turn(self, front: bool = False) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        if front:
            self._waiters.insert(self._front, fut)
            self._front += 1
        else:
            self._waiters.append(fut)
            self.queued += 1
        self._schedule_tick()
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # woken, then cancelled before it ran
                self._granted -= 1
                self._schedule_tick()
            raise
        self._granted -= 1

    def _schedule_tick(self) -> None:
        if self._tick_pending or self._granted or not self._waiters:
            return
        self._tick_pending = True
        asyncio.get_running_loop().call_soon(self._tick)

    def _tick(self, *_: Any) -> None:
        """Open a new slice: wake as many waiters as it is expected to hold (at least one)."""
        # The last slice held `_entries` sections if one woken waiter came too late; if none did,
        # it could have held more.
        self._room = max(1, self._entries) if self._late else min(2 * self._room, 4096)
        self._tick_pending = False
        self._late = False
        self._open()
        self._front = 0
        self.slices += 1
        room = self._room
        while room and self._waiters:
            fut = self._waiters.popleft()
            if fut.cancelled():
                continue
            fut.set_result(None)
            self._granted += 1
            room -= 1
