"""Where a Ray worker's log lines go: the run's log files, and only what needs the user to the console.

Ray forwards whatever its workers write to stderr and stdout to the driver's console
(`ray.init(log_to_driver=True)`, so that a trainer rank's failure is seen where the run was
started). A trainer rank that hosts the colocated vLLM engine would forward vLLM's whole start-up
too: about forty INFO and WARNING lines per engine start. `route_worker_logs`, called first thing
in such a process, sends every record at INFO and above to `logs/<name>.log` in the run directory
and keeps on stderr (so on the console) agentrl's own warnings and anyone's errors. vLLM is told
not to install its own stdout handler (`VLLM_CONFIGURE_LOGGING=0`, read when vLLM is imported:
later in this process), so its records reach the root logger and the file; Python warnings
become log records too (`logging.captureWarnings`), and the progress bars of libraries are turned
off in the worker (`TQDM_DISABLE`, `HF_HUB_DISABLE_PROGRESS_BARS`). torch logs through a stderr
handler of its own (its "Triton not available" notice): that handler is removed so its records take
the same path. What C++ code writes straight to the process's stderr (torch's NUMA-binding notice)
is not a log record: `route_native_stderr` points file descriptor 2 at the same log file, while
Python's `sys.stderr` (tracebacks, and the console handler above) keeps the stream Ray forwards. So a native crash's last
words are in `logs/<name>.log`, not on the console; the driver still reports the actor's death.
This module does not touch the driver's logging (`agentrl.cli` and `agentrl.records.library_logs`
configure that).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from pathlib import Path

__all__ = ["route_native_stderr", "route_worker_logs"]

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _NeedsTheUser(logging.Filter):
    """agentrl's warnings and errors, and other libraries' errors: what the console shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or (
            record.levelno >= logging.WARNING and record.name.split(".", 1)[0] == "agentrl")


def route_worker_logs(log_dir: str | Path, name: str) -> Path | None:
    """Send this worker process's log records to `log_dir/<name>.log` and only those that need the
    user to stderr (module docstring); return the file, or None when it cannot be written (then
    everything stays on stderr, as before). Calling it again in the same process changes nothing."""
    root = logging.getLogger()
    if any(getattr(h, "_agentrl_worker_log", False) for h in root.handlers):
        return None
    path = Path(log_dir) / f"{name}.log"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        to_file: logging.Handler = logging.FileHandler(path)
    except OSError as exc:
        logging.getLogger(__name__).warning("cannot write worker log %s (%s); logging to stderr", path, exc)
        return None
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' "Loading weights" bar
    logging.captureWarnings(True)  # libraries' FutureWarnings: to the file, as "py.warnings" records
    to_file.setLevel(logging.INFO)
    to_file.setFormatter(logging.Formatter(_FORMAT))
    to_console = logging.StreamHandler(sys.stderr)
    to_console.addFilter(_NeedsTheUser())
    to_console.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    for handler in (to_file, to_console):
        handler._agentrl_worker_log = True  # type: ignore[attr-defined]  # our mark on a stdlib handler
        root.addHandler(handler)
    root.setLevel(logging.INFO)
    _adopt_torch_logger()
    return path


def route_native_stderr(path: str | Path) -> bool:
    """Point this process's file descriptor 2 at `path` (appended), so what native code writes
    there (torch's NUMA-binding notice) goes to the log file, while Python's `sys.stderr`, and the
    console handler `route_worker_logs` installed, keep the stream Ray forwards to the driver.
    For a worker process that lives to its end: nothing undoes it. False when it could not be done."""
    try:
        forwarded = os.dup(2)
        native = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError:
        return False
    sys.stderr.flush()
    stream = os.fdopen(forwarded, "w", buffering=1)
    os.dup2(native, 2)
    os.close(native)
    sys.stderr = stream
    for handler in logging.getLogger().handlers:
        if getattr(handler, "_agentrl_worker_log", False) and isinstance(handler, logging.StreamHandler) \
                and not isinstance(handler, logging.FileHandler):
            handler.setStream(stream)
    return True


def _adopt_torch_logger() -> None:
    """torch prints its log records through a stderr handler of its own, installed when it is
    imported: import it now (this is a trainer process) and let its records reach the root's handlers."""
    if importlib.util.find_spec("torch") is None:
        return
    import torch  # noqa: F401  (installs the handler that is taken away below)

    logger = logging.getLogger("torch")
    for handler in [h for h in logger.handlers if isinstance(h, logging.StreamHandler)
                    and not isinstance(h, logging.FileHandler)]:
        logger.removeHandler(handler)
    logger.propagate = True
