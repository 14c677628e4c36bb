"""`JudgeServer`: the judge model a run serves itself (`reward.judge.model_path`), in a process of its own.

When `reward.judge.url` is not given, the judge is a separate model that agentrl serves: on the first
judge request of a process, this starts `agentrl gateway model.path=MODEL_PATH inference.engine=ENGINE
SERVER_ARGS... --port 0` under a lifeline (it dies with the process that started it, SIGKILL
included, and takes its inference servers with it), waits up to `startup_timeout_s` for it to say
where it listens, and sends the judge's chat completions there: the gateway's own router over its
own servers, which generate token in, token out, as the policy's do. Each judge request is a gateway
session of its own (`/s/judge-N/v1`), ended once its verdict is read, so the gateway holds nothing
between requests and appends every exchange, tokens and all, to `OUT/trajectories.jsonl`; OUT is a
fresh directory under the system's temp directory, named in the log, and never deleted.

A judge server that fails to start, or dies, is not restarted: every later judge reward is missing
(`infra`, naming its exit code and its log), so a run stops past `run.max_infra_failure_rate` with
that cause instead of training on a judge that comes and goes (as `RewardModelScorer` does). Each
process that scores starts its own server; `close` (or the process's exit) stops it.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import itertools
import logging
import re
import subprocess
import sys
import tempfile
import threading
from collections import deque
from pathlib import Path

from agentrl.lifeline import lifeline_argv

__all__ = ["JudgeServer", "JudgeServerError"]

log = logging.getLogger(__name__)

_LISTENING = re.compile(r"gateway at (http://\S+)/v1\b")
_CLI = "import sys; from agentrl.cli import main; sys.exit(main())"


class JudgeServerError(RuntimeError):
    """The judge server could not be had: it failed to start, or died (the message says which and why)."""


class JudgeServer:
    """One `agentrl gateway` of the judge model, started on first use (see the module docstring)."""

    def __init__(self, model_path: str, engine: str, server_args: list[str], startup_timeout_s: float) -> None:
        self.model_path = model_path
        self.engine = engine
        self.server_args = list(server_args)
        self.startup_timeout_s = startup_timeout_s
        self.out_dir: Path | None = None
        self._proc: subprocess.Popen[str] | None = None
        self._ready: concurrent.futures.Future[str] | None = None
        self._lock = threading.Lock()
        self._tail: deque[str] = deque(maxlen=30)
        self._dead: str | None = None
        self._keys = itertools.count()

    def __repr__(self) -> str:
        return f"JudgeServer({self.model_path!r}, engine={self.engine!r})"

    @property
    def command(self) -> list[str]:
        """The command line of the judge's gateway (with `--port 0` and `--out` added at start)."""
        return [sys.executable, "-c", _CLI, "gateway", f"model.path={self.model_path}",
                f"inference.engine={self.engine}", *self.server_args, "--host", "127.0.0.1"]

    def _start(self) -> concurrent.futures.Future[str]:
        with self._lock:
            if self._ready is not None:  # started once: one that died stays dead (see the module docstring)
                return self._ready
            self.out_dir = Path(tempfile.mkdtemp(prefix="agentrl-judge-"))
            command = [*self.command, "--port", "0", "--out", str(self.out_dir)]
            log.info("starting the judge server: %s", " ".join(command[3:]))
            self._ready = concurrent.futures.Future()
            self._proc = subprocess.Popen(lifeline_argv(command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, text=True, bufsize=1, start_new_session=True)
            threading.Thread(target=self._read, args=(self._proc, self._ready), daemon=True,
                             name="judge-server-reader").start()
            atexit.register(self.close)
            return self._ready

    def _read(self, proc: subprocess.Popen[str], ready: concurrent.futures.Future[str]) -> None:
        """The server's output: its address once it listens, then a tail kept for the error that says
        why it died; at its exit, `_dead` and a failed `ready` if it never listened."""
        assert proc.stdout is not None  # opened as a pipe above
        log_path = self.log_path or Path(tempfile.gettempdir()) / "agentrl-judge-server.log"  # set by _start
        with open(log_path, "a") as keep:
            for line in proc.stdout:
                keep.write(line)
                keep.flush()
                self._tail.append(line.rstrip())
                found = _LISTENING.search(line)
                if found and not ready.done():
                    ready.set_result(found.group(1))
        code = proc.wait()
        tail = "\n".join(self._tail)
        with self._lock:
            self._dead = (f"the judge server the run started ({self.model_path}, engine {self.engine}) exited with "
                          f"code {code}; its log is {log_path}, ending:\n{tail}")
        if not ready.done():
            ready.set_exception(JudgeServerError(self._dead))
        elif self._proc is not None:  # not closed on purpose
            log.error("%s", self._dead)

    async def session_url(self) -> tuple[str, str]:
        """(base URL of a fresh session's `/v1`, the gateway's base URL), starting the server first if
        needed; raises `JudgeServerError` (it failed or died) or TimeoutError (past `startup_timeout_s`)."""
        async with asyncio.timeout(self.startup_timeout_s):
            base = await asyncio.wrap_future(self._start())
        if self._dead is not None:
            raise JudgeServerError(self._dead)
        return f"{base}/s/judge-{next(self._keys)}/v1", base

    @property
    def log_path(self) -> Path | None:
        """Where the server's output goes (`OUT/judge-server.log`), once it was started."""
        return self.out_dir / "judge-server.log" if self.out_dir is not None else None

    @property
    def failure(self) -> str | None:
        """Why the server is gone (exit code and log), or None while it runs or before it starts."""
        return self._dead

    @property
    def pid(self) -> int | None:
        """The lifeline's pid (it leads the server's process group), or None when none runs."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def close(self) -> None:
        """Stop the server and what it started (they also die with this process, by the lifeline)."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
