"""`ProgressTicker`: a line that says what a run is doing while a step or an evaluation takes minutes.

Between two step lines a run can be silent for minutes (the rollouts of a step, the update, a
held-out evaluation). The ticker names the phase the run is in (`begin`), counts its episodes
(`advance`, or `set` from an evaluation's progress), and, once the phase has lasted a while,
writes where it stands to stderr: on a terminal one line rewritten in place at most every 10 s,
otherwise a plain line at most every 30 s (a log file or CI output is not flooded). `end` clears
a line drawn in place, so the step line that follows starts on a clean line. `run` is the asyncio
task that ticks; the ticker prints nothing for a phase shorter than its period.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from typing import TextIO

__all__ = ["ProgressTicker"]

TTY_EVERY_S = 10.0
PLAIN_EVERY_S = 30.0


class ProgressTicker:
    """Where a long phase of a run stands, on stderr (see the module docstring)."""

    def __init__(self, stream: TextIO | None = None, *, tty: bool | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.every_s = TTY_EVERY_S if self.tty else PLAIN_EVERY_S
        self.clock = clock
        self.what: str | None = None
        self.done = 0
        self.total = 0
        self._since = 0.0
        self._last = 0.0
        self._drawn = False  # a line drawn in place is on the terminal

    def begin(self, what: str, total: int = 0) -> None:
        """A new phase (`total` episodes, or 0 when it counts none): the clock starts again."""
        self.end()
        self.what, self.done, self.total = what, 0, total
        self._since = self._last = self.clock()

    def advance(self, n: int = 1) -> None:
        self.done += n

    def set(self, done: int, total: int) -> None:
        self.done, self.total = done, total

    def end(self) -> None:
        """The phase is over: clear the line drawn in place, if any."""
        if self._drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._drawn = False
        self.what = None

    def line(self, now: float) -> str:
        text = f"{self.what}: {now - self._since:.0f} s"
        if self.total:
            text += f", {self.done}/{self.total} episodes done"
        return text

    def tick(self) -> str | None:
        """Write where the phase stands if its period has passed since the last line; the line written."""
        now = self.clock()
        if self.what is None or now - self._last < self.every_s:
            return None
        self._last = now
        text = self.line(now)
        if self.tty:
            self.stream.write(f"\r\x1b[K{text}")
            self._drawn = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
        return text

    async def run(self, poll_s: float = 1.0) -> None:
        """Tick until cancelled."""
        try:
            while True:
                await asyncio.sleep(poll_s)
                self.tick()
        finally:
            self.end()
