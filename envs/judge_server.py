"""`JudgeServer`: the judge model a run serves itself (`reward.judge.model_path`), in a process of its own.

When `reward.judge.url` is not given, the judge is a separate model that agentrl serves: on the first
judge request of a process, this starts the gateway service of `agentrl gateway` (its module,
`python -m agentrl.orchestration.gateway_service model.path=MODEL_PATH inference.engine=ENGINE
SERVER_ARGS... --port 0`) as an `agentrl.child_process.ChildProcess`: under a lifeline (it dies with
the process that started it, SIGKILL included, and takes its inference servers with it). It waits up
to `startup_timeout_s` (from the start; past it the server is stopped) for the log to say where it
listens, and sends the judge's chat completions there: the gateway's own router over its own servers, which generate token in, token out, as the policy's do. Each judge request is a gateway
session of its own (`/s/judge-N/v1`), ended once its verdict is read, so the gateway holds nothing
between requests and appends every exchange, tokens and all, to `OUT/trajectories.jsonl`; OUT is a
fresh directory under the system's temp directory, named in the log, and never deleted.

A judge server that fails to start, or dies, is not restarted: every later judge reward is missing
(`infra`, naming its exit code and its log), so a run stops past `run.max_infra_failure_rate` with
that cause instead of training on a judge that comes and goes (as `RewardModelScorer` does). Each
process that scores starts its own server; `close` (or the process's exit) stops it.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import sys
import tempfile
import threading
from pathlib import Path

from agentrl.child_process import ChildProcess, LogLine, not_ready_cause
from agentrl.errors import ChildNotReadyError

__all__ = ["JudgeServer", "JudgeServerError"]

log = logging.getLogger(__name__)

_LISTENING = r"gateway at (http://\S+)/v1\b"
_SERVICE = "agentrl.orchestration.gateway_service"


class JudgeServerError(RuntimeError):
    """The judge server could not be had: it failed to start, or died (the message says which and why)."""


class JudgeServer:
    """One gateway service of the judge model, started on first use (see the module docstring)."""

    def __init__(self, model_path: str, engine: str, server_args: list[str], startup_timeout_s: float) -> None:
        self.model_path = model_path
        self.engine = engine
        self.server_args = list(server_args)
        self.startup_timeout_s = startup_timeout_s
        self.out_dir: Path | None = None
        self._child: ChildProcess | None = None
        self._base: str | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._timed_out = False
        self._keys = itertools.count()

    def __repr__(self) -> str:
        return f"JudgeServer({self.model_path!r}, engine={self.engine!r})"

    @property
    def command(self) -> list[str]:
        """The command line of the judge's gateway service (with `--port 0` and `--out` added at start)."""
        return [sys.executable, "-m", _SERVICE, f"model.path={self.model_path}", f"inference.engine={self.engine}",
                *self.server_args, "--host", "127.0.0.1"]

    def _start(self) -> ChildProcess:
        with self._lock:
            if self._child is not None:  # started once: one that died stays dead (see the module docstring)
                return self._child
            self.out_dir = Path(tempfile.mkdtemp(prefix="agentrl-judge-"))
            command = [*self.command, "--port", "0", "--out", str(self.out_dir)]
            log.info("starting the judge server: %s (log %s)", " ".join(command[1:]), self.log_path)
            self._child = ChildProcess(command, name="the judge server", log_path=self.log_path, grace_s=25.0,
                                       on_exit=self._exited).start()
            atexit.register(self.close)
            return self._child

    def _exited(self, child: ChildProcess) -> None:
        if not self._closed and self._base is not None:  # it served, and was not closed on purpose
            log.error("%s", self.failure)

    async def session_url(self) -> tuple[str, str]:
        """(base URL of a fresh session's `/v1`, the gateway's base URL), starting the server first if
        needed; raises `JudgeServerError` (it failed or died) or TimeoutError (past `startup_timeout_s`
        from its start, when it is stopped)."""
        child = self._start()
        if self._base is None:
            left = self.startup_timeout_s - child.uptime_s
            try:
                self._base = await child.await_ready(LogLine(_LISTENING), max(left, 0.0))
            except ChildNotReadyError as exc:
                if exc.timed_out:
                    self._timed_out = True
                    raise TimeoutError(f"the judge server {not_ready_cause(self.startup_timeout_s)}") from None
                raise JudgeServerError(self.failure or str(exc)) from None
        if self.failure is not None:
            raise JudgeServerError(self.failure)
        return f"{self._base}/s/judge-{next(self._keys)}/v1", self._base

    @property
    def log_path(self) -> Path | None:
        """Where the server's output goes (`OUT/judge-server.log`), once it was started."""
        return self.out_dir / "judge-server.log" if self.out_dir is not None else None

    @property
    def failure(self) -> str | None:
        """Why the server is gone (exit cause and log), or None while it runs or before it starts."""
        child = self._child
        if child is None or child.alive:
            return None
        cause = (not_ready_cause(self.startup_timeout_s) + " and was stopped" if self._timed_out
                 else child.exit_cause())
        return (f"the judge server the run started ({self.model_path}, engine {self.engine}) {cause}; its log is "
                f"{self.log_path}, ending:\n{child.log_tail()}")

    @property
    def pid(self) -> int | None:
        """The lifeline's pid (it leads the server's process group), or None when none runs."""
        child = self._child
        return child.pid if child is not None and child.alive and not self._closed else None

    def close(self) -> None:
        """Stop the server and what it started (they also die with this process, by the lifeline)."""
        child = self._child
        if child is not None and not self._closed:
            self._closed = True
            child.stop()
            child.close_log()
