"""One shape for every process agentrl starts: `ChildProcess` (a child that lives a while) and `run_probe` (a one-shot).

A `ChildProcess` is started under a lifeline (`agentrl.lifeline`: `lifeline_argv`, in a process
group of its own, `start_new_session=True`), so it and everything it starts die with the process
that started it, SIGKILL included. Its output goes to a log (a named file, or an unlinked temporary
file) whose tail `log_tail` quotes in errors; stdin, stdout and stderr may instead be pipes for the
callers that speak a protocol over them. `wait_ready` (threads) and `await_ready` (event loops)
wait for one `ReadySignal` within a deadline: `HealthURL` (GET answers 200), `LogLine` (a line of
the log matches), `Condition` (a callable, e.g. a reader thread's future). `stop` ends the group:
SIGTERM, a grace period, SIGKILL. How a child ended is said in one vocabulary (`exit_cause`:
"exited with code N", "was killed by signal S (NAME)"; `not_ready_cause`: "did not become ready
within T s"), carried by the one error the waits raise, `ChildNotReadyError` (with `cause`,
`returncode` and `tail`), which callers turn into their own error, adding the fix. `run_probe` runs a
short command under a lifeline with a timeout and captured output; on timeout the whole group is
killed and the result says so (`arun_probe`: the same for an event loop, the group ended when the
awaiting task is cancelled). A program that cannot be started raises OSError at the start, as
`Popen` would. Processes that must outlive their starter on purpose (the Docker
watchdog) pass `lifeline=False`; that is the only way around the lifeline, and it is explicit.

Not here: who owns a process (the job's resources, a server's supervisor), restarting one, or what
the child says on its pipes.

The processes that are started elsewhere, each with its reason (`EXEMPT_MODULES`, which the
unit test that scans the library for process starts reads):
- `agentrl/lifeline.py`: the lifeline itself starts the command it watches, and the reaper; it
  must import nothing of agentrl and run as a plain script.
- `sandboxes/forkserver.py`: runs inside the sandbox; it forks and execs the sandbox's jobs, whose
  isolation and ends are the sandbox's (namespaces, cgroup, its own process-group kills).
- `tools/mcp.py`'s stdio servers are started by the `mcp` SDK's `stdio_client`, which owns their
  pipes; the command it runs is `lifeline_argv(...)`, so they are under a lifeline all the same.
- The trainer's ranks (`torch.multiprocessing`, `agentrl/trainer/distributed.py`) and Ray's processes
  are started by those libraries; the driver's reaper (`start_reaper`) ends them.

Layer L0 (DESIGN.md §2): it imports nothing of agentrl but `lifeline` and `errors`.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import inspect
import os
import re
import shutil
import signal
import ssl
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Generic, Protocol, TypeVar

from agentrl.errors import ChildNotReadyError
from agentrl.lifeline import lifeline_argv

__all__ = [
    "EXEMPT_MODULES",
    "ChildProcess",
    "Condition",
    "HealthURL",
    "LogLine",
    "ProbeResult",
    "ReadySignal",
    "arun_probe",
    "exit_cause",
    "not_ready_cause",
    "run_probe",
]

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)

EXEMPT_MODULES: dict[str, str] = {
    "agentrl/child_process.py": "the one place that starts processes",
    "agentrl/lifeline.py": "the lifeline starts the command it watches (and the reaper); it imports nothing of agentrl",
    "sandboxes/forkserver.py": "runs inside the sandbox and forks its jobs, which the sandbox isolates and ends",
}
"""Files (relative to the repository root) that may start processes without `ChildProcess`, and why."""

_TAIL_BYTES = 65536


def _require_program(argv: list[str], env: dict[str, str] | None, cwd: str | None) -> None:
    """Raise the OSError `Popen(argv)` would raise for a program that is missing or not executable:
    under a lifeline the exec happens in the lifeline, which cannot raise into this process."""
    if not argv:
        raise ValueError("an empty command line")
    program = argv[0]
    if "/" in program:
        path = program if os.path.isabs(program) or cwd is None else os.path.join(cwd, program)
    else:
        search = (env if env is not None else os.environ).get("PATH", os.defpath)
        found = shutil.which(program, path=search)
        if found is None:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory (not on PATH)", program)
        path = found
    if not os.path.isfile(path):
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", program)
    if not os.access(path, os.X_OK):
        raise PermissionError(errno.EACCES, "Permission denied", program)


def exit_cause(returncode: int) -> str:
    """How a process ended, in the words every error uses: "exited with code N" or "was killed by signal S (NAME)"."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "unknown"
        return f"was killed by signal {-returncode} ({name})"
    return f"exited with code {returncode}"


def not_ready_cause(timeout_s: float) -> str:
    """What a child that did not get ready in time did: "did not become ready within T s"."""
    return f"did not become ready within {timeout_s:g} s"


# ── ready signals ───────────────────────────────────────────────────────────────────────────


class ReadySignal(Protocol[T_co]):
    """What says a child is ready: `check` returns a value (the child is ready) or None (not yet)."""

    def check(self, child: ChildProcess) -> T_co | None: ...

    async def acheck(self, child: ChildProcess) -> T_co | None: ...


@functools.cache
def _tls() -> ssl.SSLContext:
    """The verifying TLS context every health poll shares. A client made without one loads the CA
    bundle again (about 0.1 s of CPU per poll, 4 polls a second), which on a small machine takes a core
    from the very server being waited for."""
    return ssl.create_default_context()


@dataclass(frozen=True)
class HealthURL:
    """Ready when `GET url` answers 200; the value is the URL."""

    url: str
    timeout_s: float = 2.0

    def check(self, child: ChildProcess) -> str | None:
        import httpx

        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(self.url, timeout=self.timeout_s, trust_env=False, verify=_tls()).status_code == 200:
                return self.url
        return None

    async def acheck(self, child: ChildProcess) -> str | None:
        import httpx

        with contextlib.suppress(httpx.HTTPError):
            async with httpx.AsyncClient(timeout=self.timeout_s, trust_env=False, verify=_tls()) as http:
                if (await http.get(self.url)).status_code == 200:
                    return self.url
        return None


@dataclass(frozen=True)
class LogLine:
    """Ready when a line of the child's log matches `pattern`; the value is the match's first group
    (or the whole match when the pattern has no group)."""

    pattern: str

    def check(self, child: ChildProcess) -> str | None:
        found = re.search(self.pattern, child.log_text(), re.MULTILINE)
        if found is None:
            return None
        return found.group(1) if found.re.groups else found.group(0)

    async def acheck(self, child: ChildProcess) -> str | None:
        return self.check(child)


class Condition(Generic[T]):
    """Ready when `fn()` returns something other than None (what it raises ends the wait)."""

    def __init__(self, fn: Callable[[], T | None]) -> None:
        self.fn = fn

    def check(self, child: ChildProcess) -> T | None:
        return self.fn()

    async def acheck(self, child: ChildProcess) -> T | None:
        value = self.fn()
        return await value if inspect.isawaitable(value) else value


# ── the child ───────────────────────────────────────────────────────────────────────────────


class ChildProcess:
    """One child process under a lifeline, its log, its ready wait and its stop (see the module docstring).

    `log_path`: where stdout and stderr go (appended to); None: an unlinked temporary file, read for
    the tail and gone with this object. `stdin`, `stdout`, `stderr` True: a pipe instead (stdin
    False: /dev/null). `grace_s`: how long the child has to end after SIGTERM (the lifeline's grace
    too). `pass_fds`: descriptors the command inherits. `cgroup_procs`: `cgroup.procs` files the
    command (not its lifeline) is moved into. `on_exit`: called (in a thread of its own) as soon as
    the child has ended, however it ended. `lifeline=False` starts it detached (see the module
    docstring: only on purpose).
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        name: str,
        env: dict[str, str] | None = None,
        cwd: str | Path | None = None,
        log_path: str | Path | None = None,
        stdin: bool = False,
        stdout: bool = False,
        stderr: bool = False,
        text: bool = False,
        grace_s: float = 10.0,
        lifeline: bool = True,
        pass_fds: Sequence[int] = (),
        cgroup_procs: Sequence[str] = (),
        on_exit: Callable[[ChildProcess], None] | None = None,
    ) -> None:
        self.argv = [str(a) for a in argv]
        self.name = name
        self.env = env
        self.cwd = str(cwd) if cwd is not None else None
        self.log_path = Path(log_path) if log_path is not None else None
        self.pipes = (stdin, stdout, stderr)
        self.text = text
        self.grace_s = grace_s
        self.lifeline = lifeline
        self.pass_fds = tuple(pass_fds)
        self.cgroup_procs = tuple(cgroup_procs)
        self.on_exit = on_exit
        self.popen: subprocess.Popen[Any] | None = None
        self._log: IO[bytes] | None = None
        self._started_at = 0.0

    def __repr__(self) -> str:
        return f"ChildProcess({self.name!r}, pid={self.pid}, alive={self.alive})"

    # ── starting ────────────────────────────────────────────────────────────────────────────
    def start(self) -> ChildProcess:
        """Start the child (OSError when its program cannot be started, as from `Popen`)."""
        if self.popen is not None:
            raise RuntimeError(f"{self!r} was already started")
        want_in, want_out, want_err = self.pipes
        if not (want_out and want_err):
            if self.log_path is not None:
                self.log_path.parent.mkdir(parents=True, exist_ok=True)
                self._log = open(self.log_path, "a+b")
            else:
                self._log = tempfile.TemporaryFile(prefix=f"agentrl-{re.sub(r'[^A-Za-z0-9]+', '-', self.name)}-")
        argv = self.argv
        _require_program(argv, self.env, self.cwd)
        if self.lifeline:
            argv = lifeline_argv(argv, grace_s=self.grace_s, keep_stdin=want_in, pass_fds=self.pass_fds,
                                 cgroup_procs=self.cgroup_procs)
        elif self.cgroup_procs:
            raise ValueError(f"{self!r}: cgroup_procs needs the lifeline (it moves the command into them)")
        self.popen = subprocess.Popen(
            argv, stdin=subprocess.PIPE if want_in else subprocess.DEVNULL,
            stdout=subprocess.PIPE if want_out else self._log,
            stderr=subprocess.PIPE if want_err else (self._log if want_out else subprocess.STDOUT),
            env=self.env, cwd=self.cwd, text=self.text, bufsize=1 if self.text else -1, start_new_session=True,
            pass_fds=self.pass_fds,
        )  # fmt: skip
        self._started_at = time.monotonic()
        if self.on_exit is not None:
            threading.Thread(target=self._watch_exit, name=f"exit of {self.name}", daemon=True).start()
        return self

    def _watch_exit(self) -> None:
        assert self.popen is not None and self.on_exit is not None
        self.popen.wait()  # reaped at once: no zombie waits for the next look
        self.on_exit(self)

    # ── what it is doing ────────────────────────────────────────────────────────────────────
    @property
    def pid(self) -> int | None:
        """The lifeline's pid, which is also the child's process group; None before the start."""
        return self.popen.pid if self.popen is not None else None

    @property
    def command_pid(self) -> int | None:
        """The command's own pid (the lifeline's child) while it runs, else None."""
        if not self.alive or self.popen is None:
            return None
        if not self.lifeline:
            return self.popen.pid
        with contextlib.suppress(OSError, ValueError, IndexError):
            return int(Path(f"/proc/{self.popen.pid}/task/{self.popen.pid}/children").read_text().split()[0])
        return None

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        """How the child ended (negative: the signal that killed it); None while it runs or before it started."""
        return self.popen.poll() if self.popen is not None else None

    @property
    def uptime_s(self) -> float:
        return time.monotonic() - self._started_at

    @property
    def stdin(self) -> Any:
        return self.popen.stdin if self.popen is not None else None

    @property
    def stdout(self) -> Any:
        return self.popen.stdout if self.popen is not None else None

    @property
    def stderr(self) -> Any:
        return self.popen.stderr if self.popen is not None else None

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the child to end; its return code (subprocess.TimeoutExpired past `timeout`)."""
        if self.popen is None:
            raise RuntimeError(f"{self!r} was never started")
        return self.popen.wait(timeout)

    def exit_cause(self) -> str | None:
        """`exit_cause` of the child's return code, or None while it runs."""
        code = self.returncode
        return exit_cause(code) if code is not None else None

    def log_text(self) -> str:
        """The end of the log (its last 64 KiB), '' when there is none."""
        log = self._log
        if log is None or log.closed:
            return ""
        try:
            size = os.fstat(log.fileno()).st_size
            start = max(0, size - _TAIL_BYTES)
            return os.pread(log.fileno(), size - start, start).decode(errors="replace")
        except (OSError, ValueError):
            return ""

    def log_tail(self, lines: int = 30, chars: int = 4000) -> str:
        """The last `lines` lines of the log, at most `chars` characters."""
        return "\n".join(self.log_text().splitlines()[-lines:])[-chars:].strip()

    def failure(self, cause: str) -> ChildNotReadyError:
        """The error for this child with `cause`, its return code and log tail."""
        return ChildNotReadyError(self.name, cause, returncode=self.returncode, tail=self.log_tail(),
                                  log_path=str(self.log_path) if self.log_path else None)

    # ── waiting until it is ready ───────────────────────────────────────────────────────────
    def wait_ready(self, signal_: ReadySignal[T], timeout_s: float, *, interval_s: float = 0.25) -> T:
        """Block until `signal_` answers; ChildNotReadyError (the exit cause, or not ready within
        `timeout_s`, in which case the child is stopped) with the log tail otherwise."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = signal_.check(self)
            if value is not None:
                return value
            self._raise_if_not_starting(deadline, timeout_s)
            time.sleep(interval_s)

    async def await_ready(self, signal_: ReadySignal[T], timeout_s: float, *, interval_s: float = 0.25) -> T:
        """`wait_ready` for an event loop (the checks run on it; a stop past the deadline runs in a thread)."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = await signal_.acheck(self)
            if value is not None:
                return value
            if not self.alive or time.monotonic() > deadline:
                await asyncio.to_thread(self._raise_if_not_starting, deadline, timeout_s)
            await asyncio.sleep(interval_s)

    def _raise_if_not_starting(self, deadline: float, timeout_s: float) -> None:
        code = self.returncode
        if code is not None:
            raise self.failure(exit_cause(code))
        if time.monotonic() > deadline:
            self.stop()
            raise ChildNotReadyError(self.name, not_ready_cause(timeout_s), returncode=None, tail=self.log_tail(),
                                     log_path=str(self.log_path) if self.log_path else None, timed_out=True)

    # ── stopping ────────────────────────────────────────────────────────────────────────────
    def signal_group(self, signum: int) -> None:
        """Send `signum` to the child's whole process group (nothing when it is gone)."""
        if self.popen is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.popen.pid, signum)

    def kill_now(self) -> None:
        """SIGKILL the command without waiting: its lifeline reaps it, SIGKILLs the rest of the group
        and ends as it did (a group SIGKILL would leave the command to be reaped by init). Before the
        lifeline has started it, the whole group is SIGKILLed."""
        if self.popen is None or self.popen.poll() is not None:
            return
        command = self.command_pid if self.lifeline else None
        if command is None:
            self.signal_group(signal.SIGKILL)
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(command, signal.SIGKILL)

    def kill(self) -> None:
        """SIGKILL the command and the whole group (`kill_now`), and reap the lifeline."""
        if self.popen is None:
            return
        self.kill_now()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=2.0)
        self.signal_group(signal.SIGKILL)  # a lifeline that did not answer, and what it left
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=5.0)

    def stop(self, grace_s: float | None = None) -> int | None:
        """SIGTERM the group, SIGKILL what is left after the grace (the lifeline's plus a margin);
        then close its stdin. Its return code; stopping twice is harmless. The log stays readable
        until `close_log`."""
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            self.signal_group(signal.SIGTERM)
            try:
                self.popen.wait(timeout=(self.grace_s if grace_s is None else grace_s) + 2.0)
            except subprocess.TimeoutExpired:
                self.kill()
        self.signal_group(signal.SIGKILL)  # what outlived the leader (an engine's workers) goes too
        if self.popen.stdin is not None:  # stdout and stderr are left to their readers, which see EOF
            with contextlib.suppress(OSError, ValueError):
                self.popen.stdin.close()
        return self.popen.returncode

    async def astop(self, grace_s: float | None = None) -> int | None:
        """`stop`, off the event loop."""
        return await asyncio.to_thread(self.stop, grace_s)

    def close_log(self) -> None:
        """Close the log file (an unlinked one is then gone); the tail reads '' afterwards."""
        log, self._log = self._log, None
        if log is not None:
            with contextlib.suppress(OSError):
                log.close()

    def __enter__(self) -> ChildProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self.close_log()


# ── one-shot probes ─────────────────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class ProbeResult:
    """What a one-shot command did: its return code (None when it timed out), output and cause."""

    argv: list[str]
    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    timeout_s: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def cause(self) -> str:
        """"exited with code 0", "was killed by signal 9 (SIGKILL)" or "did not finish within T s"."""
        if self.timed_out or self.returncode is None:
            return f"did not finish within {self.timeout_s:g} s"
        return exit_cause(self.returncode)


def _start_probe(argv: list[str], input: str | bytes | None, env: dict[str, str] | None, cwd: str | None,
                 text: bool, grace_s: float = 1.0) -> subprocess.Popen[Any]:
    _require_program(argv, env, cwd)
    return subprocess.Popen(
        lifeline_argv(argv, grace_s=grace_s, keep_stdin=input is not None),
        stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=text, env=env, cwd=cwd, start_new_session=True,
    )  # fmt: skip


def _kill_probe(proc: subprocess.Popen[Any], signum: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signum)


def run_probe(argv: Sequence[str], *, timeout_s: float, input: str | None = None, env: dict[str, str] | None = None,
              cwd: str | None = None) -> ProbeResult:
    """Run `argv` under a lifeline, its output captured as text; past `timeout_s` its whole group is
    killed and the result says `timed_out`. OSError when the program cannot be started."""
    argv = [str(a) for a in argv]
    proc = _start_probe(argv, input, env, cwd, text=True)
    try:
        out, err = proc.communicate(input, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_probe(proc)
        out, err = proc.communicate()
        return ProbeResult(argv, None, out or "", err or "", True, timeout_s)
    except BaseException:
        _kill_probe(proc)
        proc.wait()
        raise
    return ProbeResult(argv, proc.returncode, out, err, False, timeout_s)


async def arun_probe(argv: Sequence[str], *, input: bytes | None = None, env: dict[str, str] | None = None,
                     cwd: str | None = None, timeout_s: float | None = None,
                     grace_s: float = 1.0) -> tuple[int | None, bytes, bytes]:
    """`run_probe` for an event loop, in bytes: (return code or None past `timeout_s`, stdout, stderr).
    Cancelled (the caller's deadline), it sends its group SIGTERM before it re-raises; the lifeline
    SIGKILLs what is left after `grace_s`."""
    argv = [str(a) for a in argv]
    proc = _start_probe(argv, input, env, cwd, text=False, grace_s=grace_s)
    try:
        out, err = await asyncio.to_thread(proc.communicate, input, timeout_s)
    except subprocess.TimeoutExpired:
        _kill_probe(proc)
        out, err = await asyncio.to_thread(proc.communicate)
        return None, out or b"", err or b""
    except BaseException:
        _kill_probe(proc, signal.SIGTERM)  # the thread's communicate then returns: the group's pipes close
        raise
    return proc.returncode, out, err
