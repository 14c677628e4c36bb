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
death: the group stops, gracefully first.

`start_reaper()` starts the other kind of lifeline, once per process: it runs no command, but
records, every second, every process descended from its parent (the driver): Ray's head and
agents, trainer actors, servers, sandboxes. When the parent dies it ends them all (SIGTERM, then
SIGKILL after the grace), checking each one's start time so that a reused pid is never hit.
Ray's own processes do not all die with the driver that started them (its dashboard and
runtime-env agents outlive a SIGKILL of the driver), which is why this exists. Nothing survives the lifeline except processes that left
its process group (`setsid`) on purpose. It is run as a script by path, with `python -I`, and
imports nothing but the standard library, so it starts in milliseconds under any interpreter.
This is not `atexit`: it needs no cooperation from the parent, which may be gone.

Layer L0 (DESIGN.md §2): process management only; it imports nothing of agentrl, so it runs as a
plain script (`python lifeline.py -- command...`) in any environment.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["LIFELINE_PATH", "group_members", "lifeline_argv", "start_reaper"]

LIFELINE_PATH = str(Path(__file__).resolve())
_POLL_S = 0.5


def lifeline_argv(command: list[str], *, grace_s: float = 10.0, python: str | None = None,
                  keep_stdin: bool = False, pass_fds: tuple[int, ...] | list[int] = (),
                  cgroup_procs: tuple[str, ...] | list[str] = ()) -> list[str]:
    """`command` run under a lifeline (see the module docstring); start it with `start_new_session=True`.
    `keep_stdin`: the command reads the lifeline's stdin (a stdio tool server) instead of /dev/null.
    `pass_fds`: descriptors the command inherits (start the lifeline with the same `pass_fds`).
    `cgroup_procs`: `cgroup.procs` files the command is moved into before it starts (the lifeline
    stays out, so a kill of the whole cgroup leaves it to reap the command and end as it did)."""
    fds = [arg for fd in pass_fds for arg in ("--fd", str(fd))]
    groups = [arg for path in cgroup_procs for arg in ("--cgroup-procs", path)]
    return [python or sys.executable, "-I", LIFELINE_PATH, "--parent", str(os.getpid()), "--grace", str(grace_s),
            *(["--stdin"] if keep_stdin else []), *fds, *groups, "--", *command]


_reaper: subprocess.Popen[bytes] | None = None


def start_reaper(*, grace_s: float = 10.0) -> int:
    """Start (once per process) the reaper that ends this process's descendants when it dies; return its pid."""
    global _reaper
    if _reaper is None or _reaper.poll() is not None:
        argv = [sys.executable, "-I", LIFELINE_PATH, "--parent", str(os.getpid()), "--grace", str(grace_s),
                "--reap-tree"]
        _reaper = subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True)
    return _reaper.pid


def _stat(pid: int | str) -> tuple[int, int, str] | None:
    """(ppid, start time, state) of a process, or None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    return int(fields[1]), int(fields[19]), fields[0]


def _reap_tree(parent: int, grace_s: float) -> int:
    me = os.getpid()
    seen: dict[int, int] = {}  # pid -> start time, of every descendant of `parent` ever seen
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while os.getppid() == parent:
        children: dict[int, list[int]] = {}
        starts: dict[int, int] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit() and (st := _stat(entry)) is not None:
                children.setdefault(st[0], []).append(int(entry))
                starts[int(entry)] = st[1]
        todo = list(children.get(parent, []))
        while todo:
            pid = todo.pop()
            if pid != me and pid in starts:
                seen[pid] = starts[pid]
                todo.extend(children.get(pid, []))
        time.sleep(1.0)

    def alive() -> list[int]:
        out = []
        for pid, start in seen.items():
            st = _stat(pid)
            if st is not None and st[1] == start and st[2] != "Z":
                out.append(pid)
        return out

    deadline = time.monotonic() + grace_s
    for signum in (signal.SIGTERM, signal.SIGKILL):
        for pid in alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signum)
        while alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        deadline = time.monotonic() + 5.0
    return 0


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
        # the fields after the command name (which may hold spaces and parentheses): state, ppid, pgrp
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":  # zombies are dead already
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


def _join_cgroups(procs_files: tuple[str, ...]) -> None:
    for path in procs_files:  # between fork and exec: the child moves itself
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)


def _watch(command: list[str], grace_s: float, parent: int, keep_stdin: bool = False,
           pass_fds: tuple[int, ...] = (), cgroup_procs: tuple[str, ...] = ()) -> int:
    stop = {"asked": False}

    def on_term(signum: int, frame: object) -> None:
        stop["asked"] = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    if os.getppid() != parent:  # the parent died before we started looking
        stop["asked"] = True
    # same session and group as us
    try:
        child = subprocess.Popen(command, stdin=None if keep_stdin else subprocess.DEVNULL, pass_fds=pass_fds,
                                 preexec_fn=(lambda: _join_cgroups(cgroup_procs)) if cgroup_procs else None)
    except OSError as exc:  # as a shell says it: 127 not found, 126 not runnable
        sys.stderr.write(f"lifeline: cannot start {command[0]!r}: {exc}\n")
        return 127 if isinstance(exc, FileNotFoundError) else 126
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
    grace_s, parent, keep_stdin, fds, groups = 10.0, os.getppid(), False, [], []
    while argv[:1] in (["--grace"], ["--parent"], ["--stdin"], ["--fd"], ["--cgroup-procs"]):
        if argv[0] == "--stdin":
            keep_stdin, argv = True, argv[1:]
            continue
        if argv[0] == "--grace":
            grace_s = float(argv[1])
        elif argv[0] == "--fd":
            fds.append(int(argv[1]))
        elif argv[0] == "--cgroup-procs":
            groups.append(argv[1])
        else:
            parent = int(argv[1])
        argv = argv[2:]
    if argv == ["--reap-tree"]:
        sys.exit(_reap_tree(parent, grace_s))
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        sys.exit("usage: lifeline.py [--parent PID] [--grace S] [--stdin] [--fd N]... [--cgroup-procs PATH]... (-- command [args...] | --reap-tree)")
    code = _watch(argv, grace_s, parent, keep_stdin, tuple(fds), tuple(groups))
    sys.stdout.flush()
    if code < 0:  # end by the same signal, so the parent sees what the command saw
        with contextlib.suppress(OSError, ValueError):  # SIGKILL and SIGSTOP have no handler to reset
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        time.sleep(1.0)
    sys.exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main(sys.argv[1:])
