"""The fork server that runs *inside* a sandbox: one warm Python that forks a child per job.

`LocalSandbox` starts this file's source with `python -I -c <source> <config-json>`, usually under
bubblewrap, and talks to it over its stdin/stdout with length-prefixed JSON frames (4-byte
big-endian length, then UTF-8 JSON; bytes travel base64-encoded). Forking a warm interpreter costs
about a millisecond, where starting a fresh sandbox and interpreter costs tens, which is what makes
thousands of snippets per training step affordable.

For each `exec` request the server forks a child that sets rlimits, drops to the job's uid (when
it has one), writes the job's files and then either `exec`s a command or runs Python code in the
forked interpreter. The server enforces the wall-clock deadline and the output cap, then kills
every other process in the PID namespace (`kill(-1)`, only when it owns one) and wipes the scratch
directories, so the next job starts clean. It also serves `read`/`write` of files in the work dir.

This module is stdlib-only and self-contained: it is never imported by the host process in
normal use (it is imported by tests) and must not import anything from agentrl.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import gc
import io
import json
import math
import os
import resource
import select
import shutil
import signal
import struct
import sys
import time
import traceback  # imported here, once: importing it in every child would cost ~5 ms a job

__all__ = ["main"]

_HEADER = struct.Struct(">I")
_MEMORY_MARK = b"M"
_PR_SET_DUMPABLE = 4
_LIBC: list = []


def _libc():
    """The C library, loaded once in the server (a dlopen per job would cost every job)."""
    if not _LIBC:
        _LIBC.append(ctypes.CDLL(None, use_errno=True))
    return _LIBC[0]


# ── framing ─────────────────────────────────────────────────────────────────────────────────
def _read_exact(fd: int, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, n - got)
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _recv(fd: int) -> dict | None:
    head = _read_exact(fd, _HEADER.size)
    if head is None:
        return None
    body = _read_exact(fd, _HEADER.unpack(head)[0])
    return None if body is None else json.loads(body)


def _send(fd: int, msg: dict) -> None:
    body = json.dumps(msg).encode()
    data = _HEADER.pack(len(body)) + body
    while data:
        data = data[os.write(fd, data):]


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


# ── the server ──────────────────────────────────────────────────────────────────────────────
class ForkServer:
    """Serves jobs one at a time (see the module docstring)."""

    def __init__(self, config: dict) -> None:
        self.workdir: str = config["workdir"]
        self.scratch: list[str] = config.get("scratch", [])
        self.uid: int | None = config.get("uid")
        self.gid: int | None = config.get("gid")
        self.pidns: bool = bool(config.get("pidns"))
        self.env: dict[str, str] = dict(config.get("env", {}))
        self.rlimits: dict[str, list[int]] = config.get("rlimits", {})
        self.cpu_limit_s: float | None = config.get("cpu_limit_s")
        # Only ever kill(-1) inside a fresh PID namespace, where the server is PID 2 under
        # bubblewrap's init: on a host, kill(-1) as root would kill the whole machine.
        self.may_kill_all = self.pidns and os.getpid() <= 3
        os.makedirs(self.workdir, exist_ok=True)
        if self.uid is not None:
            for path in (self.workdir, *self.scratch):
                with contextlib.suppress(OSError):
                    os.chown(path, self.uid, self.gid if self.gid is not None else self.uid)

    # ── files ───────────────────────────────────────────────────────────────────────────────
    @contextlib.contextmanager
    def _as_job_user(self):
        """File operations run with the job's own permissions, so they grant nothing new."""
        if self.uid is None or os.geteuid() != 0:
            yield
            return
        os.setegid(self.gid if self.gid is not None else self.uid)
        os.seteuid(self.uid)
        try:
            yield
        finally:
            os.seteuid(0)
            os.setegid(0)

    def _confined(self, path: str) -> str:
        full = os.path.realpath(os.path.join(self.workdir, path))
        root = os.path.realpath(self.workdir)
        if full != root and not full.startswith(root + os.sep):
            raise PermissionError(f"path {path!r} is outside the work dir {self.workdir}")
        return full

    def read(self, req: dict) -> dict:
        try:
            with self._as_job_user():
                full = self._confined(req["path"])
                size = os.path.getsize(full)
                if size > req.get("max_bytes", 1 << 30):
                    raise OSError(f"file is {size} bytes, over the {req['max_bytes']} byte limit")
                with open(full, "rb") as f:
                    return {"ok": True, "data": _b64(f.read())}
        except (OSError, ValueError) as exc:
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}

    def write(self, req: dict) -> dict:
        try:
            with self._as_job_user():
                full = self._confined(req["path"])
                os.makedirs(os.path.dirname(full), exist_ok=True)
                full = self._confined(req["path"])  # a parent may have been a symlink
                with open(full, "wb") as f:
                    f.write(base64.b64decode(req["data"]))
            return {"ok": True}
        except (OSError, ValueError) as exc:
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}

    # ── jobs ────────────────────────────────────────────────────────────────────────────────
    def exec(self, req: dict) -> dict:
        start = time.monotonic()
        deadline = start + float(req["timeout"])
        max_output = int(req["max_output"])
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        st_r, st_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child
            try:
                self._child(req, in_r, out_w, err_w, st_w)
            finally:
                os._exit(127)
        for fd in (in_r, out_w, err_w, st_w):
            os.close(fd)
        stdin = base64.b64decode(req["stdin"]) if req.get("stdin") else b""
        self.cpu_limit_s = req.get("cpu_limit_s", self.cpu_limit_s)
        result = self._supervise(pid, deadline, max_output, in_w, out_r, err_r, st_r, stdin)
        result["duration"] = time.monotonic() - start
        if req.get("wipe"):
            self._wipe()
        result["clean"] = self._is_clean()
        return result

    def _supervise(self, pid, deadline, max_output, in_w, out_r, err_r, st_r, stdin) -> dict:
        # poll(2) rather than a selector object: no epoll fd to create and close per job.
        poller = select.poll()
        tags: dict[int, str] = {}

        def watch(fd: int, tag: str, mask: int = select.POLLIN) -> None:
            tags[fd] = tag
            poller.register(fd, mask)

        def drop(fd: int) -> None:
            poller.unregister(fd)
            del tags[fd]
            os.close(fd)

        watch(os.pidfd_open(pid), "exit")
        watch(out_r, "out")
        watch(err_r, "err")
        watch(st_r, "status")
        if stdin:
            os.set_blocking(in_w, False)
            watch(in_w, "in", select.POLLOUT)
        else:
            os.close(in_w)
        bufs = {"out": bytearray(), "err": bytearray()}
        status = bytearray()
        swept = False
        killed = None
        exited = False
        total = 0
        while tags:
            if exited and not any(t in ("out", "err", "status") for t in tags.values()):
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0 and killed is None:
                killed = "timeout"
                self._kill_job(pid)
            wait_ms = max(remaining, 0) * 1000 if killed is None else 1000
            events = poller.poll(math.ceil(wait_ms))
            if not events and killed is not None:
                break  # killed, and the pipes did not close within a second: give up on them
            for fd, _ in events:
                tag = tags.get(fd)
                if tag is None:
                    continue
                if tag == "exit":
                    drop(fd)
                    exited = True
                    # Whatever the main process left behind (daemons, setsid children) dies with
                    # it, so the pipes reach EOF and the next job starts from nothing.
                    swept = self._kill_rest(pid)
                elif tag == "in":
                    try:
                        n = os.write(fd, stdin[:65536])
                        stdin = stdin[n:]
                    except OSError:
                        stdin = b""
                    if not stdin:
                        drop(fd)
                elif tag == "status":
                    chunk = os.read(fd, 64)
                    status += chunk
                    if not chunk:
                        drop(fd)
                else:
                    chunk = os.read(fd, 65536)
                    if not chunk:
                        drop(fd)
                        continue
                    if killed == "output":
                        continue
                    take = max(0, min(len(chunk), max_output - total))
                    bufs[tag] += chunk[:take]
                    total += len(chunk)
                    if total > max_output and killed is None:
                        killed = "output"
                        self._kill_job(pid)
        for fd in list(tags):
            drop(fd)
        _, wstatus, usage = os.wait4(pid, 0)
        if not swept or killed is not None:
            self._kill_rest(pid)
        exit_code: int | None
        sig = None
        if os.WIFSIGNALED(wstatus):
            sig = os.WTERMSIG(wstatus)
            exit_code = -sig
        else:
            exit_code = os.WEXITSTATUS(wstatus)
        cpu = usage.ru_utime + usage.ru_stime
        if killed is None:
            if _MEMORY_MARK in status:
                killed = "memory"
            elif sig == signal.SIGXCPU or (
                sig == signal.SIGKILL and self.cpu_limit_s is not None and cpu >= self.cpu_limit_s
            ):
                killed = "cpu"
            elif sig is not None:
                killed = "signal"
        if killed in ("timeout", "output"):
            exit_code = None
        return {
            "stdout": _b64(bytes(bufs["out"])),
            "stderr": _b64(bytes(bufs["err"])),
            "exit_code": exit_code,
            "signal": sig,
            "killed_reason": killed,
            "cpu_s": cpu,
        }

    def _kill_job(self, pid: int) -> None:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        self._kill_rest(pid)

    def _kill_rest(self, pid: int) -> bool:
        """Kill every process the job started, however it detached itself; True once none is left."""
        if not self.may_kill_all:
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)  # the job's own session; setsid escapees survive
            return False
        me = os.getpid()
        for _ in range(200):
            with contextlib.suppress(OSError):
                os.kill(-1, signal.SIGKILL)  # everyone but us and PID 1 in this namespace
            alive = False
            for name in os.listdir("/proc"):
                if not name.isdigit() or int(name) in (1, me):
                    continue
                try:
                    with open(f"/proc/{name}/stat", "rb") as f:
                        state = f.read().rsplit(b")", 1)[1].split()[0]
                except (OSError, IndexError):
                    continue
                if state not in (b"Z", b"X"):
                    alive = True
                    break
            if not alive:
                return True
            time.sleep(0.001)
        return False

    def _wipe(self) -> None:
        def fix_and_retry(func, path, _exc):
            with contextlib.suppress(OSError):
                os.chmod(os.path.dirname(path), 0o700)
                os.chmod(path, 0o700)
                func(path)

        with self._as_job_user():
            for root in (self.workdir, *self.scratch):
                with contextlib.suppress(OSError):
                    for name in os.listdir(root):
                        path = os.path.join(root, name)
                        if os.path.isdir(path) and not os.path.islink(path):
                            shutil.rmtree(path, onerror=fix_and_retry)
                        else:
                            with contextlib.suppress(OSError):
                                os.unlink(path)

    def _is_clean(self) -> bool:
        """False when the job left state a wipe cannot remove (SysV IPC objects, stray files)."""
        for kind in ("shm", "msg", "sem"):
            try:
                with open(f"/proc/sysvipc/{kind}", "rb") as f:
                    if len(f.read().splitlines()) > 1:
                        return False
            except OSError:
                pass
        return True

    # ── the child ───────────────────────────────────────────────────────────────────────────
    def _child(self, req: dict, in_r: int, out_w: int, err_w: int, st_w: int) -> None:  # pragma: no cover
        os.setsid()
        os.dup2(in_r, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.dup2(st_w, 3)
        os.closerange(4, 1 << 16)
        for name, (soft, hard) in {**self.rlimits, **(req.get("rlimits") or {})}.items():
            with contextlib.suppress(ValueError, OSError):
                resource.setrlimit(getattr(resource, name), (soft, hard))
        if self.uid is not None and os.getuid() == 0:
            gid = self.gid if self.gid is not None else self.uid
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(self.uid, self.uid, self.uid)
            # Changing uid made the process non-dumpable, which hides its own /proc files from
            # it; an exec would reset that, a fork does not. Nothing privileged shares its uid.
            with contextlib.suppress(Exception):
                _libc().prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)
        cwd = req.get("cwd") or self.workdir
        os.chdir(cwd)
        env = dict(self.env)
        os.environ.clear()
        os.environ.update(env)
        for rel, data in (req.get("files") or {}).items():
            path = self._confined(os.path.join(cwd, rel))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(base64.b64decode(data))
        if req.get("argv"):
            for sig in (signal.SIGPIPE, signal.SIGXFSZ):
                signal.signal(sig, signal.SIG_DFL)
            try:
                os.execve(req["argv"][0], req["argv"], env)
            except OSError as exc:
                os.write(2, f"cannot run {req['argv'][0]}: {exc}\n".encode())
                os._exit(127)
        os._exit(_run_code(req.get("code") or "", cwd))


def _run_code(code: str, cwd: str) -> int:  # pragma: no cover - runs in the child
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", write_through=False)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8",
                                  errors="backslashreplace", line_buffering=True)
    sys.argv = ["-c"]
    sys.path.insert(0, cwd)
    # A forked child inherits the server's random state: reseed, or every job draws the same numbers.
    if "random" in sys.modules:
        sys.modules["random"].seed()
    if "numpy" in sys.modules:
        with contextlib.suppress(Exception):
            sys.modules["numpy"].random.seed()
    status = 0
    try:
        exec(compile(code, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as exc:
        if exc.code is None:
            status = 0
        elif isinstance(exc.code, int):
            status = exc.code & 0xFF
        else:
            with contextlib.suppress(Exception):
                sys.stderr.write(f"{exc.code}\n")
            status = 1
    except BaseException as exc:
        if isinstance(exc, MemoryError):
            with contextlib.suppress(OSError):
                os.write(3, _MEMORY_MARK)
        with contextlib.suppress(Exception):
            tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
            traceback.print_exception(type(exc), exc, tb)
        status = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            status = status or 120
    return status


def main(argv: list[str]) -> None:
    config = json.loads(argv[1])
    for name in config.get("preload", []):
        with contextlib.suppress(Exception):
            __import__(name)
    # The control channel moves off fds 0/1 so that nothing a job prints can reach it.
    ctl_in, ctl_out = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    os.close(devnull)
    os.set_inheritable(ctl_in, False)
    os.set_inheritable(ctl_out, False)
    server = ForkServer(config)
    _libc()
    # Everything imported so far is shared with every child: keep the collector off those pages,
    # or each child's first collection copies them all (copy-on-write) at the child's expense.
    gc.collect()
    gc.freeze()
    _send(ctl_out, {"ready": True, "pid": os.getpid()})
    handlers = {"exec": server.exec, "read": server.read, "write": server.write,
                "ping": lambda req: {"ok": True}}
    while True:
        req = _recv(ctl_in)
        if req is None or req.get("op") == "exit":
            return
        handler = handlers.get(req.get("op", ""))
        _send(ctl_out, handler(req) if handler else {"ok": False, "error": f"unknown op {req.get('op')!r}"})


if __name__ == "__main__":
    main(sys.argv)
