"""Per-sandbox control groups: a memory ceiling, a process ceiling, an OOM counter and a kill switch.

`LocalSandbox` puts each sandbox's process tree in its own cgroup when the host lets it (usually
as root): `memory` caps resident memory including tmpfs files (and swap), `pids` caps the number
of processes, the OOM-kill counter tells a memory kill from any other SIGKILL, and killing every
process listed in the group ends a tree whatever it did to detach. Both cgroup v1 (one hierarchy
per controller) and v2 (the unified hierarchy) are handled; the groups are made beneath the
caller's own group, so they respect whatever limits the host already imposes on it.

Where no hierarchy is writable, `create_cgroup` returns None and the sandbox falls back to rlimits
alone. This module does not start or isolate processes; `agentrl.sandboxes.local` does.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import time
from dataclasses import dataclass, field

__all__ = ["Cgroup", "cgroup_mounts", "create_cgroup"]

_log = logging.getLogger(__name__)
_counter = itertools.count()
_CONTROLLERS = ("memory", "pids")


def cgroup_mounts() -> dict[str, tuple[str, int]]:
    """For each of memory and pids: (the directory of this process's group, cgroup version)."""
    own: dict[str, str] = {}
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                for c in controllers.split(",") if controllers else ["<v2>"]:
                    own[c] = path
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return {}
    found: dict[str, tuple[str, int]] = {}
    for parts in mounts:
        sep = parts.index("-")
        fstype, mount_point, root = parts[sep + 1], parts[4], parts[3]
        if fstype == "cgroup":
            options = parts[sep + 3].split(",")
            for c in _CONTROLLERS:
                if c in options and c in own and c not in found:
                    found[c] = (_join(mount_point, root, own[c]), 1)
        elif fstype == "cgroup2" and "<v2>" in own:
            base = _join(mount_point, root, own["<v2>"])
            try:
                with open(os.path.join(base, "cgroup.controllers")) as f:
                    available = f.read().split()
            except OSError:
                continue
            for c in _CONTROLLERS:
                if c in available and c not in found:
                    found[c] = (base, 2)
    return found


def _join(mount_point: str, mount_root: str, own_path: str) -> str:
    rel = own_path
    if mount_root != "/" and own_path.startswith(mount_root):
        rel = own_path[len(mount_root):]
    return os.path.join(mount_point, rel.lstrip("/"))


@dataclass(eq=False)
class Cgroup:
    """One sandbox's groups (one directory per v1 controller, or one v2 directory)."""

    dirs: dict[str, tuple[str, int]] = field(default_factory=dict)

    @property
    def procs_files(self) -> list[str]:
        """The `cgroup.procs` files a process must join (write "0" to each: the lifeline does, for the
        sandbox worker it starts, `agentrl.lifeline.lifeline_argv(cgroup_procs=...)`)."""
        return sorted({os.path.join(d, "cgroup.procs") for d, _ in self.dirs.values()})

    def oom_kills(self) -> int:
        """How many processes the kernel's OOM killer has ended in this group so far."""
        if "memory" not in self.dirs:
            return 0
        d, version = self.dirs["memory"]
        name = "memory.oom_control" if version == 1 else "memory.events"
        try:
            with open(os.path.join(d, name)) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def pids(self) -> list[int]:
        out: set[int] = set()
        for path in self.procs_files:
            with contextlib.suppress(OSError), open(path) as f:
                out.update(int(p) for p in f.read().split())
        return sorted(out)

    def kill_all(self, timeout_s: float = 2.0) -> bool:
        """SIGKILL every process in the group until it is empty; True if it emptied in time."""
        end = time.monotonic() + timeout_s
        while True:
            pids = self.pids()
            if not pids:
                return True
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            if time.monotonic() > end:
                return False
            time.sleep(0.002)

    def remove(self) -> None:
        """Kill what is left and delete the group directories."""
        self.kill_all()
        for d in sorted({d for d, _ in self.dirs.values()}):
            for _ in range(50):
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)  # the last exiting processes still count for a moment


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


_swept = False


def _remove_stale(mounts: dict[str, tuple[str, int]]) -> None:
    """Delete empty groups left by agentrl processes that died without cleaning up (once per process)."""
    global _swept
    if _swept:
        return
    _swept = True
    for base, _ in set(mounts.values()):
        with contextlib.suppress(OSError):
            for name in os.listdir(base):
                parts = name.split("-")
                if len(parts) == 3 and parts[0] == "agentrl" and parts[1].isdigit():
                    if not os.path.exists(f"/proc/{parts[1]}"):
                        with contextlib.suppress(OSError):
                            os.rmdir(os.path.join(base, name))  # fails, harmlessly, if not empty


def create_cgroup(memory_bytes: int | None, pids_max: int | None) -> Cgroup | None:
    """A new group limiting memory and process count, or None where cgroups are not writable."""
    mounts = cgroup_mounts()
    if not mounts:
        return None
    _remove_stale(mounts)
    name = f"agentrl-{os.getpid()}-{next(_counter)}"
    cg = Cgroup()
    try:
        for controller, (base, version) in mounts.items():
            d = os.path.join(base, name)
            if version == 2:
                with contextlib.suppress(OSError):
                    _write(os.path.join(base, "cgroup.subtree_control"), f"+{controller}")
            if d not in {x for x, _ in cg.dirs.values()}:
                os.mkdir(d)
            cg.dirs[controller] = (d, version)
            if controller == "memory" and memory_bytes:
                if version == 1:
                    _write(os.path.join(d, "memory.limit_in_bytes"), str(memory_bytes))
                    with contextlib.suppress(OSError):  # absent without swap accounting
                        _write(os.path.join(d, "memory.memsw.limit_in_bytes"), str(memory_bytes))
                else:
                    _write(os.path.join(d, "memory.max"), str(memory_bytes))
                    with contextlib.suppress(OSError):
                        _write(os.path.join(d, "memory.swap.max"), "0")
            if controller == "pids" and pids_max:
                _write(os.path.join(d, "pids.max"), str(pids_max))
    except OSError as exc:
        _log.debug("cgroups not usable here (%s); relying on rlimits", exc)
        cg.remove()
        return None
    return cg
