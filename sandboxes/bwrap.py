"""The bubblewrap command line of one local sandbox: what the sandboxed process can see and do.

`bwrap_argv` builds the argument list; `LocalSandbox` appends the fork server's command and runs
it, and MCP stdio servers (`agentrl.tools.mcp`) run under the same list. The layout is deliberately
small: the host's /usr (and the /bin, /lib... links into it), a few files of /etc that programs need
to start, the Python interpreter's own prefix, all read-only; a fresh /proc, a minimal /dev, and
three private tmpfs mounts that are the only writable places (`/workspace`, the work dir; `/tmp`;
`/dev/shm`: `PRIVATE_MOUNTS`). Nothing else of the host is visible: not /root, /home, the host's
/tmp, nor any project directory. The root itself is remounted read-only.

Paths a caller lists (`extra_ro`: a user's `ro_paths`, a venv) are bound read-only at the same
place, after the private mounts are made, so one under /tmp shows inside the private /tmp, and only
it: its siblings are not there. A listed path that resolves through symlinks is shown at its listed
place and at its target's. The folders leading to a listed path deeper in a private mount (the `a`
and `b` of /tmp/a/b/data) live on a small tmpfs of their own that is remounted read-only, so a job
cannot write beside the bound path where the wipe between jobs would not look. `ro_path_problem`
refuses what would undo the isolation: a path that does not exist, `/`, a private mount itself
(or a folder holding one), anything under /proc or /dev (but /dev/shm), and a home folder of the
host (or one holding it); symlinks are resolved first and their target is held to the same rules.

New namespaces: IPC, PID, network (loopback only), UTS and cgroup. As root, no user namespace is
made, so the fork server can keep CAP_SETUID/CAP_SETGID/CAP_KILL/CAP_CHOWN and run each job as
an unprivileged uid of its own (real, per-sandbox uids make RLIMIT_NPROC work and stop a job from
signalling or tracing the server); every other capability is dropped. As a normal user a user
namespace is made instead and the job keeps the server's uid. Bubblewrap always sets
no_new_privs, so set-uid binaries and file capabilities confer nothing.
"""

from __future__ import annotations

import os
import pwd
import shutil
import sys
from collections.abc import Iterable

from agentrl.errors import ConfigError

__all__ = ["PRIVATE_MOUNTS", "SANDBOX_HOME", "bwrap_argv", "check_ro_paths", "find_bwrap", "ro_path_problem",
           "sandbox_python"]

SANDBOX_HOME = "/workspace"
"""The work dir inside every local sandbox (a private tmpfs)."""

PRIVATE_MOUNTS = ("/dev/shm", "/tmp", SANDBOX_HOME)
"""The sandbox's own empty, writable tmpfs mounts (the host's folders of these names never show)."""

_FRESH = ("/proc", "/dev")  # made anew inside the sandbox; the host's never show (but /dev/shm/...)
_TOP_LEVEL = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
_ETC = (
    "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "localtime", "timezone",
    "nsswitch.conf", "hosts", "host.conf", "protocols", "services", "mime.types", "ssl/certs",
    "ca-certificates", "inputrc", "bash.bashrc", "profile", "os-release", "debian_version",
)
_CAPS = ("CAP_SETUID", "CAP_SETGID", "CAP_KILL", "CAP_CHOWN")


def find_bwrap() -> str | None:
    """The path of the `bwrap` binary, or None if it is not installed."""
    return shutil.which("bwrap") or next(
        (p for p in ("/usr/bin/bwrap", "/usr/local/bin/bwrap") if os.access(p, os.X_OK)), None
    )


def sandbox_python() -> tuple[str, str]:
    """The host's real Python interpreter (not a venv shim) and its installation prefix."""
    exe = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    return exe, os.path.realpath(sys.base_prefix)


def _within(path: str, top: str) -> bool:
    """Whether `path` is `top` or lies under it (both absolute and normalised)."""
    return path == top or path.startswith(top.rstrip("/") + "/")


def _homes() -> set[str]:
    """The host's home folders: this user's (by $HOME and by the password database), /root and /home."""
    homes = {"/root", "/home"}
    candidates = [os.environ.get("HOME", "")]
    try:
        candidates.append(pwd.getpwuid(os.getuid()).pw_dir)
    except KeyError:  # a uid with no entry (some containers)
        pass
    homes.update(os.path.realpath(h) for h in candidates if h)
    return homes


def _hidden_reason(path: str) -> str | None:
    """Why binding the absolute, normalised `path` would undo the sandbox's isolation, or None."""
    if path == "/":
        return "is the root: it would show the whole host"
    if path in PRIVATE_MOUNTS:
        return f"is the sandbox's private {path}: list the files or folders under it that are needed"
    for fresh in _FRESH:
        if _within(path, fresh) and not _within(path, "/dev/shm"):
            return f"is {'' if path == fresh else 'under '}{fresh}, which the sandbox makes anew and never shows the host's"
    for mount in PRIVATE_MOUNTS:
        if _within(mount, path):
            return f"holds the sandbox's private {mount}: list the files or folders that are needed instead"
    for home in sorted(_homes()):
        if _within(home, path):
            what = "is" if path == home else "holds"
            return f"{what} the host's home folder {home}: list the files or folders under it that are needed"
    return None


def ro_path_problem(path: str) -> str | None:
    """Why the host path `path` (absolute, or relative to the current directory) cannot be shown
    read-only in a sandbox, or None when it can. A path reached through symlinks is judged at its
    listed place and at its target (both are shown inside)."""
    if not path:
        return "is empty: give a host path"
    literal = os.path.abspath(path)
    if not os.path.exists(literal):  # follows symlinks: a dangling link does not exist either
        where = "" if os.path.isabs(path) else f" (relative to {os.getcwd()})"
        return f"{path!r} does not exist on this machine{where}: give an existing file or folder"
    reason = _hidden_reason(literal)
    if reason is not None:
        return f"{path!r} {reason}"
    target = os.path.realpath(literal)
    reason = _hidden_reason(target)
    if reason is not None:
        return f"{path!r} leads through symlinks to {target!r}, which {reason}"
    return None


def check_ro_paths(paths: Iterable[str], key: str) -> None:
    """Raise a ConfigError naming `key[i]` for each of `paths` that `ro_path_problem` refuses."""
    problems = [f"{key}[{i}]: {problem}" for i, path in enumerate(paths)
                if (problem := ro_path_problem(path)) is not None]
    if problems:
        raise ConfigError("\n".join(problems), errors=problems)


def _binds(extra_ro: Iterable[str]) -> dict[str, str]:
    """Where each of `extra_ro` goes inside (its listed place and its symlinks' target) -> the host
    path bound there; parents before children, places already shown by a bind above left out."""
    binds: dict[str, str] = {}
    for path in extra_ro:
        literal = os.path.abspath(path)
        target = os.path.realpath(literal)
        reason = _hidden_reason(literal) or _hidden_reason(target)
        if reason is not None:  # callers check first (`ro_path_problem`); this is the last line
            raise ConfigError(f"Cannot show {path!r} (-> {target!r}) in a sandbox: it {reason}.")
        for dest in (literal, target):
            if not _within(dest, "/usr"):  # all of /usr is shown already
                binds.setdefault(dest, target)
    shown: dict[str, str] = {}
    for dest in sorted(binds, key=lambda d: d.split("/")):
        if not any(_within(dest, above) for above in shown):
            shown[dest] = binds[dest]
    return shown


def bwrap_argv(
    bwrap: str,
    *,
    privileged: bool,
    extra_ro: tuple[str, ...] = (),
    tmpfs_bytes: int | None = None,
    passwd_fd: int | None = None,
    group_fd: int | None = None,
    setenv: dict[str, str] | None = None,
    data_files: dict[str, int] | None = None,
    network: bool = False,
) -> list[str]:
    """The bwrap arguments (up to and including `--`) for one sandbox; see the module docstring.
    `extra_ro` are host paths shown read-only at the same place (after the private mounts are made,
    so ones under them show too). `network=True` keeps the host's network (for a tool server its
    config allows it); the default is a private namespace with loopback only."""
    argv = [bwrap, "--unshare-ipc", "--unshare-pid", *([] if network else ["--unshare-net"]), "--unshare-uts",
            "--unshare-cgroup-try", "--die-with-parent", "--new-session", "--hostname", "sandbox"]
    if not privileged:
        argv.append("--unshare-user")
    argv += ["--ro-bind", "/usr", "/usr"]
    for name in _TOP_LEVEL:
        host = f"/{name}"
        if os.path.islink(host):
            argv += ["--symlink", os.readlink(host), host]
        elif os.path.isdir(host):
            argv += ["--ro-bind", host, host]
    argv += ["--perms", "0755", "--dir", "/etc"]
    for name in _ETC:
        argv += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    if passwd_fd is not None:
        argv += ["--perms", "0644", "--ro-bind-data", str(passwd_fd), "/etc/passwd"]
    if group_fd is not None:
        argv += ["--perms", "0644", "--ro-bind-data", str(group_fd), "/etc/group"]
    for dest, fd in (data_files or {}).items():
        argv += ["--perms", "0444", "--ro-bind-data", str(fd), dest]
    # The private mounts first: a tmpfs mounted over a bound path would hide it.
    size = ["--size", str(tmpfs_bytes)] if tmpfs_bytes else []
    argv += ["--proc", "/proc", "--dev", "/dev",
             *size, "--perms", "1777", "--tmpfs", "/dev/shm",
             *size, "--perms", "1777", "--tmpfs", "/tmp",
             *size, "--perms", "0755", "--tmpfs", SANDBOX_HOME]
    made: set[str] = {"/", "/usr", "/etc", "/dev", "/proc", *PRIVATE_MOUNTS}
    locked: list[str] = []  # tmpfs folders holding the parents of a bind in a private mount
    for dest, source in _binds(extra_ro).items():
        mount = next((m for m in PRIVATE_MOUNTS if _within(dest, m + "/")), None)
        if mount is not None:
            first = mount + "/" + dest[len(mount) + 1:].split("/")[0]
            if first != dest and first not in made:
                # a read-only tmpfs of its own (below), not a folder of the writable private one
                argv += ["--perms", "0755", "--tmpfs", first]
                made.add(first)
                locked.append(first)
        # Parents are created world-traversable, so a host /root (0700) does not lock the job out.
        parent = os.path.dirname(dest)
        chain = []
        while parent not in made:
            chain.append(parent)
            parent = os.path.dirname(parent)
        for d in reversed(chain):
            argv += ["--perms", "0755", "--dir", d]
            made.add(d)
        argv += ["--ro-bind", source, dest]
        made.add(dest)
    for first in locked:
        argv += ["--remount-ro", first]
    argv += ["--remount-ro", "/", "--chdir", SANDBOX_HOME, "--clearenv"]
    for key, value in (setenv or {}).items():
        argv += ["--setenv", key, value]
    if privileged:
        argv += ["--cap-drop", "ALL"]
        for cap in _CAPS:
            argv += ["--cap-add", cap]
    argv.append("--")
    return argv
