"""The lock that makes one live `agentrl run` the owner of its run directory: `RunLock`.

Two runs writing one directory (the same `run.name` started twice, or two `resume=true` at once)
would interleave one ledger and metrics file and prune each other's checkpoints. `RunLock.acquire`
takes `run.lock` in the directory before the run writes anything there: an exclusive
`fcntl.flock` on an open descriptor, held for the run's life, plus the owner's JSON (`pid`,
`host`, `started_at`, `command`) in the file for the message a second run gets. The kernel drops a
flock when its process dies, however it dies, so a lock cannot outlive its run: a file whose flock
is free but which still names an owner was left by a run that was killed, and is taken over with a
log line. `release` empties the file and drops the flock; the file itself stays (unlinking it
would let two later runs lock two different files). Where the filesystem has no flock, the pid
named in the file is checked instead (alive on this host: the directory is taken).

It is not a lock for `agentrl eval` output directories, nor across machines on a filesystem whose
flock is local to each machine.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shlex
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl.errors import ConfigError

__all__ = ["LOCK_FILE", "RunLock"]

log = logging.getLogger("agentrl.run")

LOCK_FILE = "run.lock"
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def _read_owner(fd: int) -> dict[str, Any]:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = b""
    while chunk := os.read(fd, 65536):
        raw += chunk
    try:
        owner = json.loads(raw) if raw.strip() else {}
    except ValueError:
        return {"unreadable": raw[:200].decode("utf-8", "replace")}
    return owner if isinstance(owner, dict) else {}


def _describe(owner: dict[str, Any]) -> str:
    if not owner or "pid" not in owner:
        return "a run whose details are not in the lock file"
    return (f"pid {owner.get('pid')} on host {owner.get('host')}, started {owner.get('started_at')}"
            + (f" ({owner['command']})" if owner.get("command") else ""))


@dataclass
class RunLock:
    """`run.lock` of one run directory, held by this process (see the module docstring)."""

    path: Path
    fd: int | None
    owner: dict[str, Any]
    took_over: dict[str, Any] | None = None
    """The owner named by a stale lock file this lock replaced (its run was killed), else None."""

    @classmethod
    def acquire(cls, run_dir: Path, command: str | None = None) -> RunLock:
        """Own `run_dir` (created if missing) until `release`; raise ConfigError naming the live
        owner when another run holds it."""
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by the processes the run starts
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise cls._refusal(run_dir, _read_owner(fd)) from None
            except OSError as exc:
                if exc.errno not in _NO_FLOCK:
                    raise
                previous = _read_owner(fd)
                if cls._owner_alive(previous):
                    raise cls._refusal(run_dir, previous) from None
                log.warning("%s: this filesystem has no flock (%s); the lock file's pid is checked instead, which "
                            "cannot see a run on another host", path, exc)
            else:
                previous = _read_owner(fd)
            owner = {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "command": command if command is not None else shlex.join(["agentrl", *sys.argv[1:]]),
            }
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(owner) + "\n").encode(), 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        lock = cls(path, fd, owner, took_over=previous or None)
        if previous:
            log.warning("%s was left by a run that ended without releasing it (%s: killed, or its machine went "
                        "down); this run (pid %d) takes the directory over", path, _describe(previous), os.getpid())
        return lock

    @staticmethod
    def _owner_alive(owner: dict[str, Any]) -> bool:
        """Without flock: whether the owner named in the file may still run (another host: assume so)."""
        if not owner or not isinstance(owner.get("pid"), int):
            return False
        if owner.get("host") != socket.gethostname():
            return True
        return owner["pid"] != os.getpid() and _pid_alive(owner["pid"])

    @staticmethod
    def _refusal(run_dir: Path, owner: dict[str, Any]) -> ConfigError:
        return ConfigError(
            f"The run directory '{run_dir}' is in use by another live run: {_describe(owner)}. Nothing was "
            f"started and nothing in it was changed. Wait for that run to end (or stop it) before you resume "
            f"it, or choose another run.name for a new run. (The lock is {run_dir / LOCK_FILE}; it is held only "
            "while its run lives.)"
        )

    def release(self) -> None:
        """Empty the lock file and let go of it (the file stays). Releasing twice is harmless."""
        fd, self.fd = self.fd, None
        if fd is None:
            return
        try:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # an empty lock file: its last run ended cleanly
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
