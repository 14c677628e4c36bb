"""The fork server that runs *inside* a sandbox: one warm Python that forks a child per job.

`LocalSandbox` runs this file with `python -I forkserver.py <config-json>`, usually under bubblewrap, and talks to it over its stdin/stdout. A frame is a 4-byte big-endian length, a JSON
header, then the raw byte blobs whose lengths the header lists under "blobs". Forking a warm
interpreter costs about a millisecond, where starting a fresh sandbox and interpreter costs tens,
which is what makes thousands of snippets per training step affordable.

For each `exec` request the server forks a child that sets rlimits, drops to the job's uid (when
it has one), writes the job's files and then either `exec`s a command or runs Python code in the
forked interpreter. The server enforces the wall-clock deadline and the output cap, then kills
every other process of the job (`kill(-1)` as the job's uid, only inside a PID namespace) and
wipes the scratch directories (all but the host paths bound into them before it started, which are
read-only), so the next job starts clean. `read`/`write` of work-dir files run
in a forked child too, as the job's uid, which answers the host itself.

Every job is forked from this server's memory, so the server never lets a job's data become a
Python object: code, input, files and output are read into preallocated buffers, written out from
them, and zeroed afterwards; only metadata (timeouts, lengths, exit codes) is decoded. A later job
therefore cannot find an earlier job's data in the memory it inherits.

This module is stdlib-only and self-contained: it is never imported by the host process in
normal use (it is imported by tests) and must not import anything from agentrl.
"""

from __future__ import annotations

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
from collections.abc import Callable
from typing import Any

__all__ = ["main"]

_HEADER = struct.Struct(">I")
_MEMORY_MARK = b"M"
_PR_SET_DUMPABLE = 4
_EMPTY_TMPFS_DIR_SIZE = 40  # st_size of an empty directory on tmpfs
_LIBC: list[ctypes.CDLL] = []


def _libc() -> ctypes.CDLL:
    """The C library, loaded once in the server (a dlopen per job would cost every job)."""
    if not _LIBC:
        _LIBC.append(ctypes.CDLL(None, use_errno=True))
    return _LIBC[0]


# ── buffers that hold job data and are zeroed after use ─────────────────────────────────────
class Buffer:
    """A reusable bytearray, read into and written from without copies, zeroed after each use."""

    def __init__(self, size: int = 0) -> None:
        self._data = bytearray(max(size, 1))
        self._c = (ctypes.c_char * len(self._data)).from_buffer(self._data)
        self.view = memoryview(self._data)
        self.used = 0

    def ensure(self, size: int) -> None:
        if size > len(self._data):
            self.clear()
            self.view.release()
            del self._c
            self._data = bytearray(size)
            self._c = (ctypes.c_char * size).from_buffer(self._data)
            self.view = memoryview(self._data)

    def clear(self) -> None:
        if self.used:
            ctypes.memset(ctypes.addressof(self._c), 0, self.used)
            self.used = 0

    def read_from(self, fd: int, n: int) -> bool:
        """Fill the first `n` bytes from `fd`; False at end of input."""
        self.ensure(n)
        got = 0
        while got < n:
            k = os.readv(fd, [self.view[got:n]])
            if k == 0:
                return False
            got += k
            self.used = max(self.used, got)
        return True


def _split(view: memoryview, lengths: list[int]) -> list[memoryview]:
    out, at = [], 0
    for n in lengths:
        out.append(view[at:at + n])
        at += n
    return out


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


def _recv_header(fd: int) -> dict[str, Any] | None:
    head = _read_exact(fd, _HEADER.size)
    if head is None:
        return None
    body = _read_exact(fd, _HEADER.unpack(head)[0])
    if body is None:
        return None
    header: dict[str, Any] = json.loads(body)
    return header


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _send(fd: int, header: dict[str, Any], blobs: tuple[bytes | memoryview, ...] = ()) -> None:
    header = {**header, "blobs": [len(b) for b in blobs]}
    body = json.dumps(header).encode()
    _write_all(fd, _HEADER.pack(len(body)) + body)
    for blob in blobs:
        _write_all(fd, blob)


# ── the server ──────────────────────────────────────────────────────────────────────────────
class ForkServer:
    """Serves requests one at a time (see the module docstring)."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.workdir: str = config["workdir"]
        self.scratch: list[str] = config.get("scratch", [])
        self.uid: int | None = config.get("uid")
        self.gid: int | None = config.get("gid")
        self.pidns: bool = bool(config.get("pidns"))
        self.env: dict[str, str] = dict(config.get("env", {}))
        self.rlimits: dict[str, list[int]] = config.get("rlimits", {})
        self.cpu_limit_s: float | None = None
        # Only ever kill(-1) inside a fresh PID namespace, where the server is PID 2 under
        # bubblewrap's init: on a host, kill(-1) as root would kill the whole machine.
        self.may_kill_all = self.pidns and os.getpid() <= 3
        self.server_pid = os.getpid()
        self.inbox = Buffer(1 << 16)
        self.out = {"out": Buffer(), "err": Buffer()}
        self.overflow = Buffer(1 << 16)
        os.makedirs(self.workdir, exist_ok=True)
        if self.uid is not None:
            for path in (self.workdir, *self.scratch):
                with contextlib.suppress(OSError):
                    os.chown(path, self.uid, self.gid if self.gid is not None else self.uid)
        # What each root holds before any job ran: the host paths bound into it (mount points, which
        # a job can neither remove nor write into). A wipe keeps them and measures "clean" by them.
        self.kept: dict[str, frozenset[str]] = {}
        self.clean_size: dict[str, int] = {}
        for path in (self.workdir, *self.scratch):
            with contextlib.suppress(OSError):
                self.kept[path] = frozenset(os.listdir(path))
                self.clean_size[path] = os.stat(path).st_size

    def handle(self, header: dict[str, Any], ctl_in: int, ctl_out: int) -> bool:
        """Serve one request; False when the server should stop."""
        op = header.get("op")
        lengths = [int(n) for n in header.get("blobs", [])]
        if not self.inbox.read_from(ctl_in, sum(lengths)):
            return False
        try:
            blobs = _split(self.inbox.view, lengths)
            if op == "exec":
                self.exec(header, blobs, ctl_out)
            elif op in ("read", "write"):
                self.file_op(op, header, blobs, ctl_out)
            elif op == "ping":
                _send(ctl_out, {"ok": True})
            elif op == "exit":
                return False
            else:
                _send(ctl_out, {"ok": False, "error": f"unknown op {op!r}"})
        finally:
            self.inbox.clear()
        return True

    # ── becoming the job's user ─────────────────────────────────────────────────────────────
    def _drop_to_job_user(self) -> None:
        """In a forked child: become the job's uid for good (no capabilities left)."""
        if self.uid is None or os.getuid() != 0:
            return
        gid = self.gid if self.gid is not None else self.uid
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(self.uid, self.uid, self.uid)
        # Changing uid made the process non-dumpable, which hides its own /proc files from
        # it; an exec would reset that, a fork does not. Nothing privileged shares its uid.
        with contextlib.suppress(Exception):
            _libc().prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)

    def _confined(self, path: str) -> str:
        full = os.path.realpath(os.path.join(self.workdir, path))
        root = os.path.realpath(self.workdir)
        if full != root and not full.startswith(root + os.sep):
            raise PermissionError(f"path {path!r} is outside the work dir {self.workdir}")
        return full

    def _in_child(self, work: Callable[[], None]) -> bool:
        """Run `work()` in a forked child as the job's user and wait for it; it answers the host."""
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child
            code = 1
            try:
                self._drop_to_job_user()
                work()
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        return os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0

    # ── files ───────────────────────────────────────────────────────────────────────────────
    def file_op(self, op: str, header: dict[str, Any], blobs: list[memoryview], ctl_out: int) -> None:
        def work() -> None:  # pragma: no cover - runs in the child
            try:
                full = self._confined(bytes(blobs[0]).decode())
                if op == "read":
                    size = os.path.getsize(full)
                    if size > header.get("max_bytes", 1 << 30):
                        raise OSError(f"file is {size} bytes, over the {header['max_bytes']} byte limit")
                    with open(full, "rb") as f:
                        data = f.read()
                    _send(ctl_out, {"ok": True}, (data,))
                else:
                    os.makedirs(os.path.dirname(full), exist_ok=True)
                    full = self._confined(bytes(blobs[0]).decode())  # a parent may have been a symlink
                    with open(full, "wb") as f:
                        f.write(blobs[1])
                    _send(ctl_out, {"ok": True})
            except (OSError, ValueError) as exc:
                _send(ctl_out, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})

        if not self._in_child(work):
            _send(ctl_out, {"ok": False, "error": "OSError: the file operation failed in the sandbox"})

    # ── jobs ────────────────────────────────────────────────────────────────────────────────
    def exec(self, header: dict[str, Any], blobs: list[memoryview], ctl_out: int) -> None:
        start = time.monotonic()
        deadline = start + float(header["timeout"])
        max_output = int(header["max_output"])
        for buf in self.out.values():
            buf.ensure(max_output)
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        st_r, st_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child
            try:
                self._child(header, blobs, in_r, out_w, err_w, st_w)
            finally:
                os._exit(127)
        for fd in (in_r, out_w, err_w, st_w):
            os.close(fd)
        self.cpu_limit_s = header.get("cpu_limit_s")
        result = self._supervise(pid, deadline, max_output, in_w, out_r, err_r, st_r, blobs[1])
        result["duration"] = time.monotonic() - start
        if header.get("wipe"):
            self._wipe()
        result["clean"] = self._is_clean()
        out, err = self.out["out"], self.out["err"]
        try:
            _send(ctl_out, result, (out.view[:out.used], err.view[:err.used]))
        finally:
            out.clear()
            err.clear()

    def _supervise(self, pid: int, deadline: float, max_output: int, in_w: int, out_r: int, err_r: int, st_r: int,
                   stdin: memoryview) -> dict[str, Any]:
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
        if len(stdin):
            os.set_blocking(in_w, False)
            watch(in_w, "in", select.POLLOUT)
        else:
            os.close(in_w)
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
                        stdin = stdin[os.write(fd, stdin[:65536]):]
                    except OSError:
                        stdin = stdin[:0]
                    if not len(stdin):
                        drop(fd)
                elif tag == "status":
                    chunk = os.read(fd, 64)
                    status += chunk
                    if not chunk:
                        drop(fd)
                else:
                    buf = self.out[tag]
                    space = min(max_output - total, max_output - buf.used)
                    if space > 0:
                        n = os.readv(fd, [buf.view[buf.used:buf.used + space]])
                        buf.used += n
                    else:
                        n = os.readv(fd, [self.overflow.view])
                        self.overflow.used = n
                        self.overflow.clear()
                    if n == 0:
                        drop(fd)
                        continue
                    total += n
                    if space <= 0 and killed is None:
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
        return {"exit_code": exit_code, "signal": sig, "killed_reason": killed, "cpu_s": cpu}

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
        spared = {1, os.getpid()}
        for _ in range(200):
            self._kill_once(spared)
            alive = False
            for name in os.listdir("/proc"):
                if not name.isdigit() or int(name) in spared:
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

    def _kill_once(self, spared: set[int]) -> None:
        if self.uid is not None and os.getuid() == 0:
            with contextlib.suppress(OSError):
                os.kill(-1, signal.SIGKILL)  # everyone but us and PID 1 in this namespace
            return
        for name in os.listdir("/proc"):  # the job shares our uid: spare ourselves by PID
            if name.isdigit() and int(name) not in spared:
                with contextlib.suppress(OSError):
                    os.kill(int(name), signal.SIGKILL)

    def _wipe(self) -> None:
        """Empty the work dir and scratch dirs; in a child, so no file name enters this process."""
        roots = [self.workdir, *self.scratch]
        dirty = []
        for root in roots:
            try:
                st = os.stat(root)
            except OSError:
                continue
            if self.pidns:  # a tmpfs directory grows by a fixed size per entry
                empty = st.st_size == self.clean_size.get(root, _EMPTY_TMPFS_DIR_SIZE)
            else:  # a host directory (isolation="none", which promises nothing here)
                empty = not os.listdir(root)
            if not empty:
                dirty.append(root)
        if not dirty:
            return

        def work() -> None:  # pragma: no cover - runs in the child
            def fix_and_retry(func: Callable[..., Any], path: str, _exc: object) -> None:
                with contextlib.suppress(OSError):
                    os.chmod(os.path.dirname(path), 0o700)
                    os.chmod(path, 0o700)
                    func(path)

            for root in dirty:
                kept = self.kept.get(root, frozenset())
                with contextlib.suppress(OSError):
                    for entry in os.scandir(root):
                        if entry.name in kept:
                            continue
                        if entry.is_dir(follow_symlinks=False):
                            shutil.rmtree(entry.path, onerror=fix_and_retry)
                        else:
                            with contextlib.suppress(OSError):
                                os.unlink(entry.path)

        self._in_child(work)

    def _is_clean(self) -> bool:
        """False when the job left state a wipe cannot remove (SysV IPC objects)."""
        for kind in ("shm", "msg", "sem"):
            try:
                with open(f"/proc/sysvipc/{kind}", "rb") as f:
                    if f.read().count(b"\n") > 1:
                        return False
            except OSError:
                pass
        return True

    # ── the child ───────────────────────────────────────────────────────────────────────────
    def _child(self, header: dict[str, Any], blobs: list[memoryview], in_r: int, out_w: int, err_w: int,
               st_w: int) -> None:  # pragma: no cover - runs in the child
        os.setsid()
        os.dup2(in_r, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.dup2(st_w, 3)
        os.closerange(4, 1 << 16)
        for name, (soft, hard) in {**self.rlimits, **(header.get("rlimits") or {})}.items():
            with contextlib.suppress(ValueError, OSError):
                resource.setrlimit(getattr(resource, name), (soft, hard))
        self._drop_to_job_user()
        cwd = self.workdir
        os.chdir(cwd)
        env = dict(self.env)
        os.environ.clear()
        os.environ.update(env)
        files = blobs[2:]
        for i in range(0, len(files) - 1, 2):
            path = self._confined(bytes(files[i]).decode())
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(files[i + 1])
        program = bytes(blobs[0]).decode("utf-8", errors="surrogateescape")
        if header.get("kind") == "shell":
            for sig in (signal.SIGPIPE, signal.SIGXFSZ):
                signal.signal(sig, signal.SIG_DFL)
            argv = ["/bin/bash", "-c", program]
            try:
                os.execve(argv[0], argv, env)
            except OSError as exc:
                os.write(2, f"cannot run {argv[0]}: {exc}\n".encode())
                os._exit(127)
        os._exit(_run_code(program, cwd))


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
    # Nothing may be imported from the (job-writable) work dir, nor from next to this script.
    here = os.path.dirname(os.path.abspath(argv[0]))
    sys.path[:] = [p for p in sys.path if p not in ("", ".", here) and not p.startswith(os.getcwd())]
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
    while True:
        header = _recv_header(ctl_in)
        if header is None or not server.handle(header, ctl_in, ctl_out):
            return


if __name__ == "__main__":
    main(sys.argv)
