"""Where other libraries' log records go: the run's log file, not the console.

A default `agentrl run` should print agentrl's own lines only. Libraries it loads log notices of
their own at WARNING through Python's logging: math-verify says once per process that its timeouts
are off, Ray says that token authentication is on. Python prints such a record on stderr when no
handler takes it (logging's "last resort"), and Ray prints through a handler of its own.

`quiet_libraries()` (the CLI calls it when it sets up the console) puts one handler on the root
logger for every record of a logger outside `agentrl`: an ERROR or worse still goes to the console
(a library's error can be what the user must see), anything milder is kept, in order, for the run's
log file. `attach(path)` (the driver calls it once the run directory exists, with `driver.log`)
writes what was kept there and every later record; `detach()` stops. Until a file is attached at
most `KEPT_RECORDS` records are kept, the oldest dropped first, and a command that never attaches
one (`agentrl validate`) shows them nowhere: they were notices, not results. `adopt_logger(name)`
takes a library logger that prints through its own stream handler (Ray's `ray`) into the same path.

Worker processes (Ray actors) route their records with `agentrl.orchestration.worker_logs`; this
module is for the driver. It starts nothing and imports only the standard library.
"""

from __future__ import annotations

import collections
import logging
import sys
from pathlib import Path
from typing import TextIO

__all__ = ["KEPT_RECORDS", "LibraryRecords", "adopt_logger", "attach", "detach", "quiet_libraries"]

KEPT_RECORDS = 500
"""How many records of other libraries are kept while no log file is attached."""

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _ours(record: logging.LogRecord) -> bool:
    return record.name == "agentrl" or record.name.startswith("agentrl.")


class LibraryRecords(logging.Handler):
    """The root logger's handler for other libraries' records (see the module docstring)."""

    def __init__(self, console: TextIO) -> None:
        super().__init__(logging.DEBUG)
        self.console = console
        self.kept: collections.deque[logging.LogRecord] = collections.deque(maxlen=KEPT_RECORDS)
        self.file: logging.FileHandler | None = None
        self.setFormatter(logging.Formatter(_FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        if _ours(record):  # agentrl's own records have their console handler on the `agentrl` logger
            return
        if record.levelno >= logging.ERROR:
            try:
                self.console.write(self.format(record) + "\n")
                self.console.flush()
            except (OSError, ValueError):  # a closed console: the record still reaches the file below
                pass
        if self.file is not None:
            self.file.handle(record)
        else:
            self.kept.append(record)

    def attach(self, path: str | Path) -> None:
        """Write the kept records and every later one to `path` (appended)."""
        self.detach()
        handler = logging.FileHandler(path)
        handler.setFormatter(logging.Formatter(_FORMAT))
        while self.kept:
            handler.handle(self.kept.popleft())
        self.file = handler

    def detach(self) -> None:
        """Stop writing to the attached file (later records are kept again)."""
        if self.file is not None:
            self.file.close()
            self.file = None


def _installed() -> LibraryRecords | None:
    return next((h for h in logging.getLogger().handlers if isinstance(h, LibraryRecords)), None)


def quiet_libraries(console: TextIO | None = None) -> LibraryRecords:
    """Install (once per process) the root handler that keeps other libraries' notices off the
    console; return it. `console`: where their errors go (default: stderr at the time of the call)."""
    handler = _installed()
    if handler is None:
        handler = LibraryRecords(console or sys.stderr)
        logging.getLogger().addHandler(handler)
    else:
        handler.console = console or sys.stderr
    return handler


def adopt_logger(name: str) -> None:
    """Take the library logger `name`, which prints through a stream handler of its own, into the
    root handler's path: its stream handlers are removed and its records propagate. Does nothing
    while `quiet_libraries` has not been called (the library's own printing stays)."""
    if _installed() is None:
        return
    logger = logging.getLogger(name)
    for handler in [h for h in logger.handlers if type(h) is not logging.NullHandler]:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            logger.removeHandler(handler)
    logger.propagate = True


def attach(path: str | Path) -> bool:
    """Send other libraries' records to `path` from now on (what was kept first); False when
    `quiet_libraries` was not called in this process (nothing is routed then)."""
    handler = _installed()
    if handler is None:
        return False
    handler.attach(path)
    return True


def detach() -> None:
    """Stop writing other libraries' records to the attached file."""
    handler = _installed()
    if handler is not None:
        handler.detach()
