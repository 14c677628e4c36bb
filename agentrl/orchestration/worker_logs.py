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
off in the worker (`TQDM_DISABLE`, `HF_HUB_DISABLE_PROGRESS_BARS`). What C++ code writes straight
to the process's stderr (torch's NUMA notice) is not a log record and still reaches the console.
This module does not touch the driver's logging (`agentrl.cli` configures that).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

__all__ = ["route_worker_logs"]

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
        handler._agentrl_worker_log = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    root.setLevel(logging.INFO)
    return path
