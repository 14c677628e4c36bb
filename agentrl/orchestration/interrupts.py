"""How a run hears that it must stop: Ctrl-C (SIGINT), a scheduler's SIGTERM and SIGHUP, all alike.

`StopSignals` is installed for the length of one run (`installed()`, main thread only; it replaces
asyncio's own SIGINT handler, which then stays out). The first of the three signals cancels the
run's task (`watch`): the run closes its in-flight prompts as unfinished, logs the command that
continues it and closes everything it started, as it does for Ctrl-C. Inside a blocking start
(`raising()`: Ray joining, a placement group being granted, the trainer and servers loading) the
signal raises KeyboardInterrupt at once instead, since a cancelled task would hear of it only after
the start returned; a second signal does the same anywhere. Ray's driver installs a SIGTERM handler
of its own in `ray.init` (it exits with status 15 and closes nothing): `install()` again after it.

`RunInterrupted` is what a run stopped by one of them raises in the end: a KeyboardInterrupt (every
`except KeyboardInterrupt` clean-up still applies) that names the signal and the command that
continues the run, with the exit status a shell expects for a signal: 128 + its number (130 for
SIGINT, 143 for SIGTERM, 129 for SIGHUP). This module starts nothing and knows nothing of a run's
pieces.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

__all__ = ["STOP_SIGNALS", "RunInterrupted", "StopSignals", "signal_name"]

STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""The signals that stop a run the way Ctrl-C does."""


def signal_name(signum: int) -> str:
    """`SIGTERM` for 15, and so on; the number itself when it names no signal."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class RunInterrupted(KeyboardInterrupt):
    """A run stopped by SIGINT, SIGTERM or SIGHUP; `exit_status` is 128 + the signal's number."""

    def __init__(self, signum: int, resume: str = "") -> None:
        super().__init__(int(signum), resume)  # the arguments, so that it pickles and copies
        self.signum = int(signum)
        self.resume = resume

    def __str__(self) -> str:
        how = f"continue it with: {self.resume}" if self.resume else "nothing was started yet"
        return f"the run was interrupted ({signal_name(self.signum)}); {how}"

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


class StopSignals:
    """SIGINT, SIGTERM and SIGHUP of one run, handled alike (see the module docstring)."""

    def __init__(self) -> None:
        self.received: int | None = None
        """The first stop signal the run received, or None."""
        self._task: asyncio.Task[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._raising = 0
        self._previous: dict[int, Any] = {}

    # ── installing ──────────────────────────────────────────────────────────────────────────
    def install(self) -> None:
        """Handle the stop signals here (again, after something such as `ray.init` took one over).
        Does nothing off the main thread, where Python delivers no signal."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in STOP_SIGNALS:
            previous = signal.signal(sig, self.handle)
            self._previous.setdefault(sig, previous)

    def restore(self) -> None:
        """Give each stop signal back the handler it had before the first `install`."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopSignals]:
        self.install()
        try:
            yield self
        finally:
            self.restore()

    def watch(self, task: asyncio.Task[Any] | None, loop: asyncio.AbstractEventLoop) -> None:
        """The run's task, which the first stop signal cancels, and the loop it runs on."""
        self._task, self._loop = task, loop

    @contextlib.contextmanager
    def raising(self) -> Iterator[None]:
        """While a blocking call runs on the loop's thread, a stop signal raises KeyboardInterrupt in it."""
        self._raising += 1
        try:
            yield
        finally:
            self._raising -= 1

    # ── the handler ─────────────────────────────────────────────────────────────────────────
    def handle(self, signum: int, frame: FrameType | None) -> None:
        first = self.received is None
        if first:
            self.received = signum
        task, loop = self._task, self._loop
        if not first or self._raising or task is None or loop is None or task.done():
            raise KeyboardInterrupt
        task.cancel(f"{signal_name(signum)} received")
        loop.call_soon_threadsafe(lambda: None)  # wake the loop if it sleeps in select() with a long timeout
