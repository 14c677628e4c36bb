"""The bubblewrap command line of one local sandbox: what the sandboxed process can see and do.

`bwrap_argv` builds the argument list; `LocalSandbox` appends the fork server's command and runs
it. The layout is deliberately small: the host's /usr (and the /bin, /lib... links into it), a few
files of /etc that programs need to start, the Python interpreter's own prefix, all read-only; a
fresh /proc, a minimal /dev, and three private tmpfs mounts that are the only writable places
(`/workspace`, the work dir; `/tmp`; `/dev/shm`). Nothing else of the host is visible: not /root,
/home, the host's /tmp, nor any project directory. The root itself is remounted read-only.

New namespaces: IPC, PID, network (loopback only), UTS and cgroup. As root, no user namespace is
made, so the fork server can keep CAP_SETUID/CAP_SETGID/CAP_KILL/CAP_CHOWN and run each job as
an unprivileged uid of its own (real, per-sandbox uids make RLIMIT_NPROC work and stop a job from
signalling or tracing the server); every other capability is dropped. As a normal user a user
namespace is made instead and the job keeps the server's uid. Bubblewrap always sets
no_new_privs, so set-uid binaries and file capabilities confer nothing.
"""

from __future__ import annotations

import os
import shutil
import sys

__all__ = ["SANDBOX_HOME", "bwrap_argv", "find_bwrap", "sandbox_python"]

SANDBOX_HOME = "/workspace"
"""The work dir inside every local sandbox (a private tmpfs)."""

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


def _under_usr(path: str) -> bool:
    return path == "/usr" or path.startswith("/usr/")


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
    `network=True` keeps the host's network (for a tool server its config allows it); the default
    is a private namespace with loopback only."""
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
    made: set[str] = {"/", "/usr", "/etc", "/tmp", "/dev", "/proc", SANDBOX_HOME}
    for path in extra_ro:
        if _under_usr(path):
            continue
        # Parents are created world-traversable, so a host /root (0700) does not lock the job out.
        parent = os.path.dirname(path)
        chain = []
        while parent not in made and parent != "/":
            chain.append(parent)
            parent = os.path.dirname(parent)
        for d in reversed(chain):
            argv += ["--perms", "0755", "--dir", d]
            made.add(d)
        argv += ["--ro-bind", path, path]
        made.add(path)
    size = ["--size", str(tmpfs_bytes)] if tmpfs_bytes else []
    argv += ["--proc", "/proc", "--dev", "/dev",
             *size, "--perms", "1777", "--tmpfs", "/dev/shm",
             *size, "--perms", "1777", "--tmpfs", "/tmp",
             *size, "--perms", "0755", "--tmpfs", SANDBOX_HOME,
             "--remount-ro", "/", "--chdir", SANDBOX_HOME, "--clearenv"]
    for key, value in (setenv or {}).items():
        argv += ["--setenv", key, value]
    if privileged:
        argv += ["--cap-drop", "ALL"]
        for cap in _CAPS:
            argv += ["--cap-add", cap]
    argv.append("--")
    return argv
