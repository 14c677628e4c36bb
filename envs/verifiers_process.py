"""`VerifiersWorker`: agentrl's side of the process that runs verifiers tasksets (`verifiers_worker.py`).

verifiers 0.4 lives in a folder of its own beside agentrl's environment (`verifiers_folder()`,
filled by `bash scripts/install.sh verifiers`), because it pins `openai<3` and `mcp==2.0.0`; it is
only ever imported in the worker process, whose `sys.path` starts with that folder. This object
starts that process on first use, an `agentrl.child_process.ChildProcess` (under a lifeline: it dies
with the process that started it, SIGKILL included), sends it requests (`load`, `score`, `play`: see the worker's
docstring) as JSON lines and hands back the answers. Requests from any thread or event loop may be
in flight at once: a reader thread matches answers to requests by number, and async callers await
them through `asyncio.wrap_future`.

A worker that dies (killed, out of memory, a taskset that calls `os._exit`) fails the requests it
was serving with `EnvServerError`, and the next request starts a fresh one. One that does not
answer a score within its timeout plus `_WEDGED_GRACE_S` is taken to be wedged (a rubric that
blocks its event loop) and is killed the same way. `close`/`aclose` ends it (a later request,
as gymnasium allows after `close`, starts another); closing twice is harmless. It is not a pool: one process serves every episode of a run (`agentrl.orchestration.build`
gives each env the job's one worker; an env built alone starts its own).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from agentrl.child_process import ChildProcess, Condition
from agentrl.errors import ChildNotReadyError, ConfigError, EnvError, EnvServerError, FeatureUnavailableError

__all__ = ["INSTALL_HINT", "WORKER_PATH", "VerifiersWorker", "checked_answer", "require_verifiers", "verifiers_folder"]

log = logging.getLogger(__name__)

INSTALL_HINT = "bash scripts/install.sh verifiers"
WORKER_PATH = str(Path(__file__).resolve().parent / "verifiers_worker.py")
_WEDGED_GRACE_S = 10.0
_STOP_GRACE_S = 5.0


def verifiers_folder() -> Path:
    """Where `bash scripts/install.sh verifiers` installs verifiers and its pinned dependencies:
    `agentrl-extras/verifiers` under this environment's prefix (the virtualenv or conda env)."""
    return Path(sys.prefix) / "agentrl-extras" / "verifiers"


def require_verifiers() -> Path:
    """The verifiers folder, or `FeatureUnavailableError` saying how to install it."""
    folder = verifiers_folder()
    if not (folder / "verifiers" / "v1").is_dir():
        raise FeatureUnavailableError(
            f"env=verifiers needs the 'verifiers' package (0.4) in its own folder, {folder}, which is missing. "
            f"Install it with: {INSTALL_HINT} (it pins openai<3 and mcp==2.0.0, so it is kept apart from "
            "agentrl's own packages; `dev` installs it too)."
        )
    return folder


class _Process:
    """One worker process (an `agentrl.child_process.ChildProcess`: stdin and stdout are the protocol's,
    stderr its log), and the requests it was sent."""

    def __init__(self, folder: Path) -> None:
        self.child = ChildProcess([sys.executable, "-I", WORKER_PATH, "--path", str(folder)], name="the verifiers worker",
                                  stdin=True, stdout=True, grace_s=_STOP_GRACE_S).start()
        self.pending: dict[int, concurrent.futures.Future[dict[str, Any]]] = {}
        self.ready: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        self.write_lock = threading.Lock()
        self.reader: threading.Thread | None = None

    @property
    def pid(self) -> int:
        return self.child.pid or 0

    def log_tail(self, chars: int = 2000) -> str:
        return self.child.log_tail(lines=400, chars=chars)

    def send(self, obj: dict[str, Any]) -> None:
        assert self.child.stdin is not None  # started with a stdin pipe
        with self.write_lock:
            self.child.stdin.write((json.dumps(obj) + "\n").encode())
            self.child.stdin.flush()

    def kill(self) -> None:
        """SIGKILL the worker now, without waiting (the reader sees the exit; the lifeline ends the rest)."""
        self.child.kill_now()

    def stop(self) -> None:
        """Close stdin (the worker exits), then TERM and KILL the lifeline's group if it lingers."""
        with contextlib.suppress(OSError, ValueError), self.write_lock:
            if self.child.stdin is not None:
                self.child.stdin.close()
        try:
            self.child.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            self.child.stop()
        if self.reader is not None and self.reader is not threading.current_thread():
            self.reader.join(timeout=5.0)  # it closes stdout and fails what was still pending
        self.child.close_log()


class VerifiersWorker:
    """The worker process that runs verifiers tasksets for env=verifiers (see the module docstring)."""

    def __init__(self, *, startup_timeout_s: float = 120.0) -> None:
        self.folder = require_verifiers()
        self.startup_timeout_s = startup_timeout_s
        self.version: str | None = None
        self._lock = threading.Lock()  # the state below
        self._start_lock = threading.Lock()  # one start at a time (a start waits for the worker's hello)
        self._process: _Process | None = None
        self._next = 0
        self._tasks: dict[str, dict[str, Any]] = {}

    # ── the process ─────────────────────────────────────────────────────────────────────────
    @property
    def pid(self) -> int | None:
        """The pid of the worker itself (the lifeline's child), or None when none runs."""
        process = self._process
        return process.child.command_pid if process is not None else None

    def _started(self) -> _Process:
        """The running worker, started (and waited for) when there is none. Blocks; call it off the loop."""
        with self._start_lock:
            with self._lock:
                process = self._process
                if process is not None and process.child.alive:
                    return process
                process = self._process = _Process(self.folder)
            process.reader = threading.Thread(target=self._read, args=(process,), name="verifiers-worker-reader",
                                              daemon=True)
            process.reader.start()
            ready = process.ready
            try:
                hello = process.child.wait_ready(Condition(lambda: ready.result() if ready.done() else None),
                                                 self.startup_timeout_s, interval_s=0.05)
            except ChildNotReadyError as exc:
                if exc.timed_out:  # wait_ready stopped it
                    raise EnvServerError(
                        f"the verifiers worker {exc.cause} (it imports verifiers from {self.folder}); its stderr "
                        f"ends:\n{exc.tail}") from None
                raise EnvServerError(f"the verifiers worker (pid {process.pid}) {exc.cause}; its stderr ends:\n"
                                     f"{exc.tail or '(nothing)'}") from None
            except EnvServerError:
                raise
            if not hello.get("ready"):
                process.stop()
                raise FeatureUnavailableError(
                    f"verifiers does not import from {self.folder}: {hello.get('message')}. Reinstall it with: "
                    f"{INSTALL_HINT}")
            self.version = str(hello.get("verifiers"))
            log.info("verifiers worker pid %s started (verifiers %s from %s)", process.pid, self.version, self.folder)
            return process

    def _read(self, process: _Process) -> None:
        """The reader thread of one process: answers to their requests; at EOF, every open one fails."""
        assert process.child.stdout is not None  # started with a stdout pipe
        for raw in process.child.stdout:
            try:
                answer = json.loads(raw)
            except ValueError:
                log.warning("verifiers worker: a line that is not JSON: %r", raw[:200])
                continue
            if "ready" in answer and not process.ready.done():
                process.ready.set_result(answer)
                continue
            with self._lock:
                future = process.pending.pop(answer.get("n"), None)
            if future is not None and not future.done():
                future.set_result(answer)
        process.child.stdout.close()
        with contextlib.suppress(OSError, ValueError), process.write_lock:
            if process.child.stdin is not None:
                process.child.stdin.close()  # BrokenPipe now: no one reads it
        process.child.wait()
        error = EnvServerError(f"the verifiers worker (pid {process.pid}) {process.child.exit_cause()}; its stderr ends:\n"
                               f"{process.log_tail() or '(nothing)'}")
        if not process.ready.done():  # first: a start waiting for the hello must not wait for the lock
            process.ready.set_exception(error)
        with self._lock:
            if self._process is process:
                self._process = None
            failed, process.pending = list(process.pending.values()), {}
        for future in failed:
            if not future.done():
                future.set_exception(error)
        process.child.close_log()

    def _submit(self, request: dict[str, Any]) -> tuple[_Process, concurrent.futures.Future[dict[str, Any]]]:
        process = self._started()
        future: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        with self._lock:
            self._next += 1
            n = self._next
            if self._process is not process:  # it died between the start and now; its reader is done
                future.set_exception(EnvServerError(f"the verifiers worker (pid {process.pid}) died; its stderr "
                                                    f"ends:\n{process.log_tail() or '(nothing)'}"))
                return process, future
            process.pending[n] = future
        try:
            process.send({"n": n, **request})
        except (OSError, ValueError):  # the worker died as we wrote; its reader fails the future
            pass
        return process, future

    # ── requests ────────────────────────────────────────────────────────────────────────────
    async def arequest(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Send `request` and await its answer; a worker that does not answer within `timeout_s` is
        killed (it is wedged) and `EnvServerError` raised."""
        process, future = await asyncio.to_thread(self._submit, request)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
        except TimeoutError:
            process.kill()
            raise EnvServerError(
                f"the verifiers worker (pid {process.pid}) did not answer within {timeout_s:.0f} s, so it was "
                "restarted: a rubric blocks its event loop (sync code in an async reward?)."
            ) from None

    def request(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """`arequest` for callers without an event loop (building the dataset, `check_env`)."""
        process, future = self._submit(request)
        try:
            return future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            process.kill()
            raise EnvServerError(f"the verifiers worker (pid {process.pid}) did not answer within "
                                 f"{timeout_s:.0f} s, so it was restarted.") from None

    def taskset(self, taskset_id: str, taskset_kwargs: dict[str, Any], max_rows: int) -> dict[str, Any]:
        """The worker's `load` answer, loaded once per worker object: the taskset's first `max_rows`
        tasks (`tasks`: `{"data": ..., "key": ...}`) and whether verifiers plays it in turns
        (`multi_turn`, with the `env` class that does)."""
        key = json.dumps([taskset_id, taskset_kwargs, max_rows], sort_keys=True)
        if key not in self._tasks:
            answer = self.request({"op": "load", "taskset": taskset_id, "kwargs": taskset_kwargs,
                                   "max_rows": max_rows}, self.startup_timeout_s)
            self._tasks[key] = checked_answer(answer)
        return self._tasks[key]

    async def ataskset(self, taskset_id: str, taskset_kwargs: dict[str, Any], max_rows: int) -> dict[str, Any]:
        """`taskset`, off the event loop."""
        return await asyncio.to_thread(self.taskset, taskset_id, taskset_kwargs, max_rows)

    def tasks(self, taskset_id: str, taskset_kwargs: dict[str, Any], max_rows: int) -> list[dict[str, Any]]:
        """The taskset's first `max_rows` tasks (`{"data": ..., "key": ...}`)."""
        return list(self.taskset(taskset_id, taskset_kwargs, max_rows)["tasks"])

    async def atasks(self, taskset_id: str, taskset_kwargs: dict[str, Any], max_rows: int) -> list[dict[str, Any]]:
        """`tasks`, off the event loop."""
        return list((await self.ataskset(taskset_id, taskset_kwargs, max_rows))["tasks"])

    # ── closing ─────────────────────────────────────────────────────────────────────────────
    def close(self) -> None:
        """Stop the worker process; a later request starts a new one. Closing twice is harmless."""
        with self._lock:
            process, self._process = self._process, None
        if process is not None:
            process.stop()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)


def checked_answer(answer: dict[str, Any]) -> dict[str, Any]:
    """`answer` when it is ok, else the error its `kind` stands for (see the worker's docstring)."""
    if answer.get("ok"):
        return answer
    kind, message = answer.get("kind"), str(answer.get("message"))
    if kind == "config":
        raise ConfigError(message)
    if kind == "unavailable":
        raise FeatureUnavailableError(message)
    if kind == "task":
        raise EnvError(message)
    raise EnvServerError(f"the verifiers worker failed: {message}")

