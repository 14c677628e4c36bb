"""`LocalSandbox`: run model-written code on this machine, isolated by bubblewrap, from a warm pool.

Each sandbox is one bubblewrap instance (see `agentrl.sandboxes.bwrap` for its view of the host)
running a warm Python fork server (`agentrl.sandboxes.forkserver`) that forks a child per job, so a
short snippet costs about what a fork does. `exec` takes a warm sandbox from a pool, runs the job,
wipes the sandbox's writable directories, kills whatever the job left running, and puts the sandbox
back; a session (`await sandbox.session()`) keeps one sandbox, and its files, until `close`.
At most `max_concurrency` jobs run at once (default: one per core); other callers wait their turn.

Threats covered (each has a test in tests/integration/test_sandbox_adversarial.py):
- Network egress, including the cloud metadata address: a private network namespace with only
  loopback, so every outside connection fails at once.
- Reading or writing the host's files: only /usr, a few /etc files, the interpreter and the
  `ro_paths` listed are visible, read-only; /root, /home, the host's /tmp and project directories
  are not there at all, nor is anything beside a listed path (tests/integration/test_sandbox_ro_paths.py).
- Host secrets in the environment: the job starts from an empty environment (PATH, HOME, LANG...).
- Fork bombs: a per-sandbox uid with RLIMIT_NPROC and a cgroup `pids.max`; the host stays usable.
- Memory bombs: a cgroup memory ceiling (and RLIMIT_AS), reported as killed_reason "memory".
- Runaway CPU, sleeps and hangs: killed at the wall-clock deadline (and RLIMIT_CPU, reported as
  "cpu"); every other process in the sandbox's PID namespace is killed with it, daemons and
  setsid children included.
- Output floods: output is read up to `max_output_bytes`, then the job is killed ("output").
- Sandboxes seeing each other: separate mount, PID, IPC and network namespaces and uids; a pooled
  sandbox is wiped between jobs and retired if a job leaves SysV IPC objects behind.
- A job reading an earlier job's code, input, files or output out of the memory it inherits from
  the fork server: job data only passes through reused buffers that are zeroed after each job.
- Leftovers: `close` kills the namespace and the cgroup, and the tmpfs files vanish with them.

Not covered: kernel exploits (there is no seccomp filter and no VM boundary; use the `docker` or
`remote` backends on separate machines for hostile code at scale), CPU starvation of other host
work below the process limit (there is no CPU quota), side channels, disk use of read-only host
files, and POSIX message queues, keyrings or other per-uid kernel state that successive jobs of
one pooled sandbox share (SysV IPC objects are detected and retire the sandbox).
A sandbox process that dies mid-job is the job's fault when the OOM killer took it ("memory");
with root, where jobs run under another uid and cannot signal it, any other death is an
infrastructure failure (`SandboxError`). Without root, jobs share the fork server's uid (a job can
kill its own server, which is then replaced, and that is reported as the job's "signal") and
limits fall back to rlimits if no cgroup is writable. `isolation="none"` covers
nothing but the rlimits, the deadline and the output cap, and says so in a warning.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import json
import logging
import math
import os
import posixpath
import struct
import tempfile
import time
import weakref
from collections.abc import Awaitable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from agentrl.child_process import ChildProcess
from agentrl.errors import ConfigError, SandboxClosedError, SandboxError, SandboxUnavailableError
from agentrl.sandboxes import forkserver
from agentrl.sandboxes.bwrap import SANDBOX_HOME, bwrap_argv, check_ro_paths, find_bwrap, sandbox_python
from agentrl.sandboxes.cgroups import Cgroup, create_cgroup
from agentrl.types import ExecResult

__all__ = ["LocalSandbox", "LocalSession"]
_T = TypeVar("_T")

_log = logging.getLogger(__name__)
_HEADER = struct.Struct(">I")
_SERVER_FILE = Path(forkserver.__file__)
_SERVER_IN_SANDBOX = "/.agentrl-forkserver.py"
_SPAWN_TIMEOUT_S = 30.0
_GRACE_S = 5.0
_uids = itertools.count()
_UID_BASE = 100_000 + (os.getpid() % 4000) * 1000
_live_cgroups: set[Cgroup] = set()


@atexit.register
def _remove_live_cgroups() -> None:
    for cg in list(_live_cgroups):
        with contextlib.suppress(Exception):
            cg.remove()


def _check_relative(path: str) -> str:
    """A path inside the work dir, written relative to it; anything that could escape is refused."""
    if not isinstance(path, str) or not path or "\x00" in path:
        raise ValueError(f"Invalid path {path!r}: give a non-empty path inside {SANDBOX_HOME}.")
    norm = posixpath.normpath(path)
    if norm.startswith(SANDBOX_HOME + "/"):
        norm = norm[len(SANDBOX_HOME) + 1:]
    if norm.startswith("/") or norm == ".." or norm.startswith("../"):
        raise ValueError(f"Path {path!r} is outside the sandbox work dir {SANDBOX_HOME}; use a relative path.")
    return norm


class _PipedProcess:
    """A sandbox worker (an `agentrl.child_process.ChildProcess`, under a lifeline) with asyncio streams
    on its pipes, started without asyncio's child watcher.

    `asyncio.create_subprocess_exec` cannot be cancelled safely while it is starting a child: on
    Python 3.11 a task cancelled there (as `asyncio.run` does to leftover tasks, such as a pool
    refill, when it ends) waits for the child to exit by itself, which a sandbox worker never does,
    so the program hangs at exit. Here the fork/exec is one synchronous start that cannot be
    interrupted halfway, the pipes become asyncio streams, and the exit is watched through a pidfd
    on the event loop, so nothing is left to hang on. `pid` is the worker's own (the outer bwrap),
    once the lifeline started it; `kill` ends the lifeline's whole group.
    """

    def __init__(self, child: ChildProcess, stdin: asyncio.StreamWriter,
                 stdout: asyncio.StreamReader, stderr: asyncio.StreamReader) -> None:
        assert child.popen is not None  # started by `start`
        self._child = child
        self._popen = child.popen
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self._exited = asyncio.get_running_loop().create_future()
        self._pidfd = os.pidfd_open(child.popen.pid)
        asyncio.get_running_loop().add_reader(self._pidfd, self._on_exit)

    @property
    def pid(self) -> int:
        return self._child.command_pid or self._popen.pid

    @classmethod
    async def start(cls, argv: list[str], *, env: dict[str, str], pass_fds: list[int], cwd: str,
                    cgroup: Cgroup | None = None) -> _PipedProcess:
        loop = asyncio.get_running_loop()
        child = ChildProcess(argv, name="the local sandbox worker", env=env, cwd=cwd, stdin=True, stdout=True,
                             stderr=True, grace_s=1.0, pass_fds=pass_fds,
                             cgroup_procs=cgroup.procs_files if cgroup is not None else ()).start()
        popen = child.popen
        assert popen is not None and popen.stdin is not None and popen.stdout is not None and popen.stderr is not None
        try:
            stdout = asyncio.StreamReader(limit=2**26)
            await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdout), popen.stdout)
            stderr = asyncio.StreamReader()
            await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stderr), popen.stderr)
            transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, popen.stdin)
            stdin = asyncio.StreamWriter(transport, protocol, None, loop)
            return cls(child, stdin, stdout, stderr)
        except BaseException:
            child.kill()
            raise

    def _on_exit(self) -> None:
        asyncio.get_running_loop().remove_reader(self._pidfd)
        os.close(self._pidfd)
        self._popen.wait()  # the pidfd is readable: the child has exited, so this returns at once
        if not self._exited.done():
            self._exited.set_result(self._popen.returncode)

    @property
    def returncode(self) -> int | None:
        return self._popen.returncode if self._exited.done() else None

    def kill(self) -> None:
        """SIGKILL the worker, without waiting; its lifeline ends the rest of its group (`ChildProcess.kill_now`)."""
        if not self._exited.done():
            self._child.kill_now()

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)


class _Worker:
    """One sandbox process (bwrap + fork server) and the pipe protocol to it."""

    def __init__(self, proc: _PipedProcess, cgroup: Cgroup | None, tmpdir: str | None) -> None:
        self.proc = proc
        self.cgroup = cgroup
        self.tmpdir = tmpdir
        self.healthy = True
        self.closed = False  # set when its session is closed on purpose: a job cut short then is not a fault
        self._stderr = bytearray()
        self._drain = asyncio.ensure_future(self._drain_stderr())

    async def _drain_stderr(self) -> None:
        assert self.proc.stderr is not None
        while chunk := await self.proc.stderr.read(4096):
            self._stderr = (self._stderr + chunk)[-4096:]

    @property
    def stderr_tail(self) -> str:
        return self._stderr.decode(errors="replace").strip()

    async def recv(self) -> tuple[dict[str, Any], list[bytes]]:
        """One frame: the JSON header and the raw blobs it announces."""
        assert self.proc.stdout is not None
        head = await self.proc.stdout.readexactly(_HEADER.size)
        header = json.loads(await self.proc.stdout.readexactly(_HEADER.unpack(head)[0]))
        blobs = [await self.proc.stdout.readexactly(n) if n else b"" for n in header.get("blobs", [])]
        return header, blobs

    async def request(self, header: dict[str, Any], blobs: list[bytes],
                      timeout_s: float) -> tuple[dict[str, Any], list[bytes]]:
        """Send one request and await its answer; the worker is unusable after any failure."""
        assert self.proc.stdin is not None
        body = json.dumps({**header, "blobs": [len(b) for b in blobs]}).encode()
        try:
            self.proc.stdin.write(_HEADER.pack(len(body)) + body)
            for blob in blobs:
                self.proc.stdin.write(blob)
            await self.proc.stdin.drain()
            return await asyncio.wait_for(self.recv(), timeout_s)
        except BaseException:
            self.healthy = False
            raise

    async def kill(self) -> None:
        self.healthy = False
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        if self.cgroup is not None:
            await asyncio.to_thread(self.cgroup.kill_all)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.proc.wait(), 5)
        self._drain.cancel()
        self._cleanup_files()

    def kill_now(self) -> None:
        """Synchronous kill, for a worker whose event loop is gone."""
        self.healthy = False
        with contextlib.suppress(ProcessLookupError, OSError):
            self.proc.kill()
        self._cleanup_files()

    def _cleanup_files(self) -> None:
        if self.cgroup is not None:
            self.cgroup.remove()
            _live_cgroups.discard(self.cgroup)
            self.cgroup = None
        if self.tmpdir is not None:
            import shutil

            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None


class LocalSandbox:
    """Isolated local code execution with a warm pool (see the module docstring).

    Args:
        isolation: "bwrap" (the default) or "none" (no isolation at all; logs a warning).
        max_concurrency: Jobs running at once; default one per CPU core. Others wait.
        pool_size: Warm sandboxes kept ready; default `max_concurrency`.
        memory_mb: Memory ceiling of one sandbox (cgroup), including files in its tmpfs.
        max_processes: Processes one sandbox may have (RLIMIT_NPROC and cgroup pids.max).
        max_output_bytes: Stdout plus stderr kept per job; more kills the job ("output").
        max_file_mb: Largest file a job may write (RLIMIT_FSIZE).
        address_space_mb: RLIMIT_AS per job; default 4x `memory_mb` with cgroups, else `memory_mb`.
        cpu_time_s: RLIMIT_CPU per job; default the job's timeout plus one second.
        python: Interpreter to run code with; default this process's base interpreter.
        preload: Modules the fork server imports once, so jobs importing them start warm.
        ro_paths: Extra host paths (files or folders; relative ones from the current directory) to make
            visible, read-only, at the same place, under /tmp too, without their siblings. A path that
            does not exist, or that would undo the isolation (`/`, /tmp, /proc, /dev, a home folder...;
            see `agentrl.sandboxes.bwrap`), is refused here with a ConfigError naming `ro_paths[i]`.
    """

    def __init__(
        self,
        *,
        isolation: str = "bwrap",
        max_concurrency: int | None = None,
        pool_size: int | None = None,
        memory_mb: int = 512,
        max_processes: int = 64,
        max_output_bytes: int = 1_000_000,
        max_file_mb: int = 64,
        address_space_mb: int | None = None,
        cpu_time_s: float | None = None,
        python: str | None = None,
        preload: tuple[str, ...] | list[str] = (),
        ro_paths: tuple[str, ...] | list[str] = (),
    ) -> None:
        if isolation not in ("bwrap", "none"):
            raise ValueError(f"isolation must be 'bwrap' or 'none', got {isolation!r}.")
        if isinstance(ro_paths, str):
            raise ConfigError(f"ro_paths: give a list of paths, e.g. [{ro_paths}], not one string.")
        check_ro_paths(ro_paths, "ro_paths")
        self.isolation = isolation
        self._bwrap = find_bwrap() if isolation == "bwrap" else None
        if isolation == "bwrap" and self._bwrap is None:
            raise SandboxUnavailableError(
                "LocalSandbox needs bubblewrap (the 'bwrap' binary) and it is not installed: run "
                "'bash scripts/install.sh' (it installs it), or 'apt-get install bubblewrap' (Debian/Ubuntu) "
                "or 'dnf install bubblewrap'; or use another sandbox (sandbox=docker); or pass "
                "isolation='none' (sandbox.kwargs.isolation=none) to run code with no isolation at all "
                "(trusted code only)."
            )
        if isolation == "none":
            _log.warning("LocalSandbox(isolation='none'): code runs UNISOLATED on this machine, with "
                         "only rlimits, a deadline and an output cap. Never use it for untrusted code.")
        cores = os.cpu_count() or 1
        self.max_concurrency = max(1, max_concurrency or cores)
        self.pool_size = max(0, self.max_concurrency if pool_size is None else pool_size)
        self.memory_mb = memory_mb
        self.max_processes = max_processes
        self.max_output_bytes = max_output_bytes
        self.max_file_mb = max_file_mb
        self.cpu_time_s = cpu_time_s
        exe, prefix = sandbox_python()
        self.python = python or exe
        self._ro_paths = tuple(dict.fromkeys([*map(os.path.abspath, ro_paths), *([] if python else [prefix])]))
        self.preload = tuple(preload)
        self._privileged = os.geteuid() == 0 and isolation == "bwrap"
        self._address_space_mb = address_space_mb
        self._idle: list[_Worker] = []
        self._busy = 0
        self._refilling = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sem: asyncio.Semaphore | None = None
        self._sessions: weakref.WeakSet[LocalSession] = weakref.WeakSet()
        self._refills: set[asyncio.Future[None]] = set()
        self._closed = False

    # ── spawning ────────────────────────────────────────────────────────────────────────────
    def _rlimits(self, cgroup: Cgroup | None) -> dict[str, list[int]]:
        mb = 1 << 20
        space = self._address_space_mb or (4 * self.memory_mb if cgroup is not None else self.memory_mb)
        limits = {
            "RLIMIT_AS": [space * mb, space * mb],
            "RLIMIT_FSIZE": [self.max_file_mb * mb, self.max_file_mb * mb],
            "RLIMIT_NOFILE": [1024, 1024],
            "RLIMIT_CORE": [0, 0],
        }
        if self._privileged:  # a uid of its own, so the per-uid process count is this sandbox's
            limits["RLIMIT_NPROC"] = [self.max_processes, self.max_processes]
        return limits

    async def _spawn(self) -> _Worker:
        cgroup = create_cgroup(self.memory_mb << 20, self.max_processes + 8)
        if cgroup is not None:
            _live_cgroups.add(cgroup)
        uid = _UID_BASE + next(_uids) % 1000 if self._privileged else None
        tmpdir = None
        fds: list[int] = []
        # The sandbox's interpreter comes first, so `python` in a shell job is the same Python.
        path = ":".join(dict.fromkeys([os.path.dirname(self.python), "/usr/local/bin", "/usr/bin", "/bin"]))
        env = {"PATH": path, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
        try:
            if self.isolation == "bwrap":
                assert self._bwrap is not None
                passwd_fd = group_fd = None
                if uid is not None:
                    passwd_fd = self._data_fd(fds, f"root:x:0:0:root:/root:/bin/sh\n"
                                                   f"sandbox:x:{uid}:{uid}:sandbox:{SANDBOX_HOME}:/bin/bash\n")
                    group_fd = self._data_fd(fds, f"root:x:0:\nsandbox:x:{uid}:\n")
                # The server's source goes in as a read-only file of its own (not the whole package).
                source_fd = self._data_fd(fds, _SERVER_FILE.read_text())
                argv = bwrap_argv(self._bwrap, privileged=self._privileged, extra_ro=self._ro_paths,
                                  tmpfs_bytes=self.memory_mb << 20, passwd_fd=passwd_fd, group_fd=group_fd,
                                  data_files={_SERVER_IN_SANDBOX: source_fd})
                script = _SERVER_IN_SANDBOX
                workdir, scratch = SANDBOX_HOME, ["/tmp", "/dev/shm"]
            else:
                tmpdir = tempfile.mkdtemp(prefix="agentrl-sandbox-")
                argv, workdir, scratch, script = [], tmpdir, [], str(_SERVER_FILE)
            job_env = {**env, "HOME": workdir, "TMPDIR": "/tmp" if scratch else workdir,
                       "USER": "sandbox", "LOGNAME": "sandbox", "PYTHONDONTWRITEBYTECODE": "1"}
            config = {"workdir": workdir, "scratch": scratch, "uid": uid, "gid": uid,
                      "pidns": self.isolation == "bwrap", "env": job_env,
                      "rlimits": self._rlimits(cgroup), "preload": list(self.preload)}
            argv += [self.python, "-I", script, json.dumps(config)]
            proc = await _PipedProcess.start(
                argv, env=env, pass_fds=fds, cwd=tmpdir or "/",
                cgroup=cgroup,
            )
        except OSError as exc:
            if cgroup is not None:
                cgroup.remove()
            raise SandboxUnavailableError(f"Cannot start a local sandbox ({argv[:1]}): {exc}") from exc
        finally:
            for fd in fds:
                os.close(fd)
        worker = _Worker(proc, cgroup, tmpdir)
        try:
            hello, _ = await asyncio.wait_for(worker.recv(), _SPAWN_TIMEOUT_S)
            if not hello.get("ready"):
                raise SandboxError(f"unexpected greeting {hello!r}")
        except (TimeoutError, asyncio.IncompleteReadError, SandboxError, ValueError) as exc:
            await asyncio.sleep(0.05)
            await worker.kill()
            raise SandboxUnavailableError(
                f"The local sandbox did not start ({type(exc).__name__}). bubblewrap said: "
                f"{worker.stderr_tail or '(nothing)'}. bwrap needs root or unprivileged user namespaces "
                "(sysctl kernel.unprivileged_userns_clone=1); in a container, run it with "
                "--security-opt seccomp=unconfined or use the docker/remote backends."
            ) from exc
        return worker

    @staticmethod
    def _data_fd(fds: list[int], text: str) -> int:
        r, w = os.pipe()
        os.write(w, text.encode())
        os.close(w)
        fds.append(r)
        return r

    # ── the pool ────────────────────────────────────────────────────────────────────────────
    def _bind_loop(self) -> asyncio.Semaphore:
        if self._closed:
            raise SandboxClosedError("This LocalSandbox is closed; create a new one.")
        loop = asyncio.get_running_loop()
        if self._loop is not loop or self._sem is None:
            # Pipes belong to the loop that made them: a new loop starts a fresh pool.
            for w in self._idle:
                w.kill_now()
            self._idle.clear()
            self._loop, self._sem, self._refilling, self._busy = loop, asyncio.Semaphore(self.max_concurrency), 0, 0
        return self._sem

    def _refill(self) -> None:
        missing = self.pool_size - len(self._idle) - self._busy - self._refilling
        for _ in range(max(0, missing)):
            self._refilling += 1
            task = asyncio.ensure_future(self._refill_one())
            self._refills.add(task)
            task.add_done_callback(self._refills.discard)

    async def _refill_one(self) -> None:
        try:
            worker = await self._spawn()
        except Exception as exc:
            _log.warning("could not refill the sandbox pool: %s", exc)
            return
        finally:
            self._refilling -= 1
        if self._closed or len(self._idle) >= self.pool_size:
            await worker.kill()
        else:
            self._idle.append(worker)

    async def _take(self) -> _Worker:
        self._busy += 1
        try:
            while self._idle:
                worker = self._idle.pop()
                if worker.healthy and worker.proc.returncode is None:
                    return worker
                await worker.kill()
            return await self._spawn()
        except BaseException:
            self._busy -= 1
            raise
        finally:
            self._refill()

    async def _give_back(self, worker: _Worker, keep: bool) -> None:
        self._busy -= 1
        if keep and worker.healthy and not self._closed and len(self._idle) < self.pool_size:
            self._idle.append(worker)
        else:
            await worker.kill()
            if not self._closed:
                self._refill()

    async def start(self) -> None:
        """Warm the pool now (otherwise it warms in the background on first use)."""
        self._bind_loop()
        need = self.pool_size - len(self._idle)
        workers = await asyncio.gather(*(self._spawn() for _ in range(max(0, need))))
        self._idle.extend(workers)

    # ── running jobs ────────────────────────────────────────────────────────────────────────
    def _request(self, command: str | None, code: str | None, timeout_s: float,
                 stdin: str | bytes | None, files: Mapping[str, str | bytes] | None,
                 wipe: bool) -> tuple[dict[str, Any], list[bytes]]:
        """The fork server's exec header and blobs: program, stdin, then (path, content) pairs."""
        program = command if code is None else code if command is None else None
        if program is None:
            raise ValueError("Pass exactly one of `command` (a shell command) or `code` (Python source).")
        if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s < math.inf):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}.")
        blobs = [program.encode("utf-8", errors="surrogateescape"),
                 stdin.encode() if isinstance(stdin, str) else bytes(stdin or b"")]
        for path, data in (files or {}).items():
            blobs.append(_check_relative(path).encode())
            blobs.append(data.encode() if isinstance(data, str) else bytes(data))
        cpu = self.cpu_time_s if self.cpu_time_s is not None else math.ceil(timeout_s) + 1
        cpu_soft = max(1, math.ceil(cpu))
        header = {
            "op": "exec",
            "kind": "shell" if command is not None else "python",
            "timeout": float(timeout_s),
            "max_output": self.max_output_bytes,
            "wipe": wipe,
            "rlimits": {"RLIMIT_CPU": [cpu_soft, cpu_soft + 1]},
            "cpu_limit_s": cpu_soft,
        }
        return header, blobs

    async def _run(self, worker: _Worker, req: tuple[dict[str, Any], list[bytes]]) -> tuple[ExecResult, bool]:
        """Run one exec request; returns the result and whether the worker may be reused."""
        header, blobs = req
        oom_before = worker.cgroup.oom_kills() if worker.cgroup else 0
        start = time.monotonic()
        try:
            res, (out, err) = await worker.request(header, blobs, header["timeout"] + _GRACE_S)
        except TimeoutError:
            await worker.kill()
            return ExecResult("", "", None, True, "timeout", time.monotonic() - start), False
        except (asyncio.IncompleteReadError, ConnectionError, BrokenPipeError):
            # The sandbox itself died mid-job: the OOM killer (the job's memory: its fault), the job
            # killing it (possible only without root, where job and server share a uid), or
            # something outside the sandbox (an infrastructure failure, never the model's fault).
            if worker.closed:  # the session was closed while the job ran: the caller's doing
                return ExecResult("", "[sandbox session closed]", None, False, "closed",
                                  time.monotonic() - start), False
            await worker.kill()
            oom = worker.cgroup is not None and worker.cgroup.oom_kills() > oom_before
            if oom or (worker.cgroup is None and "MemoryError" in worker.stderr_tail):
                return ExecResult("", "[sandbox process died: memory]", None, False, "memory",
                                  time.monotonic() - start), False
            if self._privileged:
                raise SandboxError(
                    "The sandbox process died mid-job, and not by the job's doing (jobs run under "
                    f"another uid and cannot signal it): {worker.stderr_tail or 'no message'}"
                ) from None
            return ExecResult("", "[sandbox process died: signal]", None, False, "signal",
                              time.monotonic() - start), False
        duration = time.monotonic() - start
        if "error" in res:
            await worker.kill()
            raise SandboxError(f"The local sandbox failed to run the job: {res['error']}")
        killed = res["killed_reason"]
        if killed in (None, "signal") and res.get("signal") == 9 and worker.cgroup is not None \
                and worker.cgroup.oom_kills() > oom_before:
            killed = "memory"
        result = ExecResult(
            stdout=out.decode("utf-8", errors="replace"), stderr=err.decode("utf-8", errors="replace"),
            exit_code=res["exit_code"],
            timed_out=killed == "timeout", killed_reason=killed, duration_s=duration,
        )
        return result, bool(res.get("clean", True))

    async def exec(
        self,
        command: str | None = None,
        *,
        code: str | None = None,
        timeout_s: float,
        stdin: str | bytes | None = None,
        files: Mapping[str, str | bytes] | None = None,
    ) -> ExecResult:
        """Run a shell `command` or Python `code` in a fresh-state sandbox; see `Sandbox.exec`."""
        req = self._request(command, code, timeout_s, stdin, files, wipe=True)
        async with self._bind_loop():
            worker = await self._take()
            keep = False
            try:
                result, keep = await self._run(worker, req)
            finally:
                await self._give_back(worker, keep)
        return result

    async def session(self) -> LocalSession:
        """A sandbox of your own whose files persist across `exec` calls until `close()`."""
        self._bind_loop()
        if self._idle:
            worker = self._idle.pop()
            self._refill()
        else:
            worker = await self._spawn()
        sess = LocalSession(self, worker)
        self._sessions.add(sess)
        return sess

    async def close(self) -> None:
        """Kill every pooled sandbox and every open session. Closing twice is a no-op."""
        if self._closed:
            return
        self._closed = True
        if self._refills:
            await asyncio.gather(*self._refills, return_exceptions=True)
        idle, self._idle = self._idle, []
        sessions = list(self._sessions)
        await asyncio.gather(*(w.kill() for w in idle), *(s.close() for s in sessions),
                             return_exceptions=True)

    async def is_alive(self) -> bool:
        return not self._closed

    def __repr__(self) -> str:
        return (f"LocalSandbox(isolation={self.isolation!r}, max_concurrency={self.max_concurrency}, "
                f"memory_mb={self.memory_mb}, idle={len(self._idle)})")


class LocalSession:
    """One `LocalSandbox` sandbox kept for a multi-step task; see `SandboxSession`."""

    def __init__(self, owner: LocalSandbox, worker: _Worker) -> None:
        self._owner = owner
        self._worker: _Worker | None = worker
        self._lock = asyncio.Lock()
        self._pending: asyncio.Future[Any] | None = None
        self.workdir = SANDBOX_HOME if owner.isolation == "bwrap" else (worker.tmpdir or SANDBOX_HOME)

    async def _guarded(self, coro: Awaitable[_T]) -> _T:
        """Await a request to the sandbox; if the caller is cancelled, the request still completes.

        The pipe protocol is one request, one answer: abandoning an answer would leave the next
        request reading the wrong one. So a cancelled call's job runs on to its own deadline in the
        background, and the session's next call waits for it first.
        """
        if self._pending is not None:
            with contextlib.suppress(BaseException):
                await self._pending
            self._pending = None
        task = asyncio.ensure_future(coro)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            self._pending = task
            raise

    def _live(self) -> _Worker:
        if self._worker is None:
            raise SandboxClosedError("This sandbox session is closed; open a new one with `await sandbox.session()`.")
        if not self._worker.healthy or self._worker.proc.returncode is not None:
            raise SandboxError(
                f"This sandbox session's process has died ({self._worker.stderr_tail or 'no message'}); "
                "open a new session."
            )
        return self._worker

    async def exec(
        self,
        command: str | None = None,
        *,
        code: str | None = None,
        timeout_s: float,
        stdin: str | bytes | None = None,
        files: Mapping[str, str | bytes] | None = None,
    ) -> ExecResult:
        """Run in this session's work dir; background processes are killed when the call returns."""
        req = self._owner._request(command, code, timeout_s, stdin, files, wipe=False)
        async with self._owner._bind_loop(), self._lock:
            if self._pending is not None:
                await self._guarded(asyncio.sleep(0))
            worker = self._live()
            result, _ = await self._guarded(self._owner._run(worker, req))
            return result

    async def _file_op(self, header: dict[str, Any], blobs: list[bytes]) -> tuple[dict[str, Any], list[bytes]]:
        async with self._lock:
            if self._pending is not None:
                await self._guarded(asyncio.sleep(0))
            worker = self._live()
            try:
                return await self._guarded(worker.request(header, blobs, 60))
            except (TimeoutError, asyncio.IncompleteReadError, ConnectionError) as exc:
                await worker.kill()
                raise SandboxError(f"The sandbox session stopped answering ({type(exc).__name__}).") from exc

    async def read_file(self, path: str) -> bytes:
        """The bytes of `path` (relative to the work dir); FileNotFoundError/PermissionError if it fails."""
        res, blobs = await self._file_op({"op": "read", "max_bytes": 256 << 20}, [_check_relative(path).encode()])
        if not res["ok"]:
            raise _file_error(path, res["error"])
        return blobs[0]

    async def write_file(self, path: str, data: str | bytes) -> None:
        """Write `data` to `path` (relative to the work dir), creating parent directories."""
        raw = data.encode() if isinstance(data, str) else bytes(data)
        res, _ = await self._file_op({"op": "write"}, [_check_relative(path).encode(), raw])
        if not res["ok"]:
            raise _file_error(path, res["error"])

    async def close(self) -> None:
        """Kill every process of the session and delete its files. Closing twice is a no-op."""
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.closed = True
            await worker.kill()

    async def is_alive(self) -> bool:
        return self._worker is not None and self._worker.healthy and self._worker.proc.returncode is None


def _file_error(path: str, error: str) -> OSError:
    if error.startswith("FileNotFoundError") or error.startswith("IsADirectoryError"):
        return FileNotFoundError(f"{path}: {error}")
    if error.startswith("PermissionError"):
        return PermissionError(f"{path}: {error}")
    return OSError(f"{path}: {error}")
