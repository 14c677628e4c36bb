"""A lifeline: run a command so that it, and every process it starts, dies with the process that asked.

`lifeline_argv(command)` wraps a command line: `python lifeline.py -- command...`. Started with
`start_new_session=True`, the lifeline leads a process group of its own; it starts the command in
that group and then watches two things:

- its parent (the agentrl driver), by polling `getppid()` twice a second: when the parent dies, by
  any means, SIGKILL included, the lifeline is re-parented and sees it. It then sends SIGTERM to
  the whole group, waits up to `--grace` seconds for the command to exit, and SIGKILLs what is
  left. (A parent-death signal, `prctl(PR_SET_PDEATHSIG)`, would fire when the parent *thread*
  that started it ends, which would kill a server started from a worker thread that finished.)
- the command. When it exits, whatever it left behind in the group (vLLM's engine core, workers)
  is SIGKILLed, and the lifeline ends the way the command ended (same exit code, or the same
  signal), so the parent's `Popen.returncode` reads as the command's own.

A SIGTERM from the parent (`killpg`, as `ServerProcess.stop` does) is treated like the parent's
death: the group stops, gracefully first. Nothing survives the lifeline except processes that left
its process group (`setsid`) on purpose. It is run as a script by path, with `python -I`, and
imports nothing but the standard library, so it starts in milliseconds under any interpreter.
This is not `atexit`: it needs no cooperation from the parent, which may be gone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["LIFELINE_PATH", "group_members", "lifeline_argv"]

LIFELINE_PATH = str(Path(__file__).resolve())
_POLL_S = 0.5


def lifeline_argv(command: list[str], *, grace_s: float = 10.0, python: str | None = None) -> list[str]:
    """`command` run under a lifeline (see the module docstring); start it with `start_new_session=True`."""
    return [python or sys.executable, "-I", LIFELINE_PATH, "--parent", str(os.getpid()), "--grace", str(grace_s),
            "--", *command]


def group_members(pgid: int) -> list[int]:
    """The pids in process group `pgid` (Linux: read from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # the fields after the command name (which may hold spaces and parentheses)
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 2 and int(fields[2]) == pgid:
            out.append(int(entry))
    return out


def _kill_others(signum: int) -> None:
    me = os.getpid()
    for _ in range(50):  # members may fork while we kill; go round until the group is empty
        others = [p for p in group_members(os.getpgrp()) if p != me]
        if not others:
            return
        for pid in others:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signum)
        if signum != signal.SIGKILL:
            return
        time.sleep(0.02)


def _watch(command: list[str], grace_s: float, parent: int) -> int:
    stop = {"asked": False}

    def on_term(signum: int, frame: object) -> None:
        stop["asked"] = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    if os.getppid() != parent:  # the parent died before we started looking
        stop["asked"] = True
    child = subprocess.Popen(command, stdin=subprocess.DEVNULL)  # same session and group as us
    deadline: float | None = None
    while True:
        code = child.poll()
        if code is not None:
            _kill_others(signal.SIGKILL)
            return code
        if not stop["asked"] and os.getppid() != parent:
            stop["asked"] = True
        if stop["asked"] and deadline is None:
            deadline = time.monotonic() + grace_s
            _kill_others(signal.SIGTERM)
        if deadline is not None and time.monotonic() > deadline:
            _kill_others(signal.SIGKILL)
            child.wait()
            return -signal.SIGKILL
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=_POLL_S if deadline is None else 0.1)


def main(argv: list[str]) -> None:
    grace_s, parent = 10.0, os.getppid()
    while argv[:1] in (["--grace"], ["--parent"]):
        if argv[0] == "--grace":
            grace_s = float(argv[1])
        else:
            parent = int(argv[1])
        argv = argv[2:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        sys.exit("usage: lifeline.py [--parent PID] [--grace S] -- command [args...]")
    code = _watch(argv, grace_s, parent)
    sys.stdout.flush()
    if code < 0:  # end by the same signal, so the parent sees what the command saw
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        time.sleep(1.0)
    sys.exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main(sys.argv[1:])
