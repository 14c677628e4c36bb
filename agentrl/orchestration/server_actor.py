"""LLM servers on a Ray cluster: each owned by a `ServerActor` on its node, driven by a `PlacedServer` proxy.

`ServerActor` is a Ray actor placed in a server's bundle of the run's placement group
(`cluster.Reservation`). On its node it resolves the model (a built-in name is converted there; a
directory must exist there at the same path), starts the server process (`launcher.ServerProcess`)
bound to the node's address on a free port there, taking the run's bearer token (`server_app`:
only the run's clients can generate, pause or push weights), and answers for it: its URL, whether it still
runs, its health, its log; it restarts or stops it when asked. The process runs under the actor's
lifeline, so it ends with the actor (and with the actor's node).

`PlacedServer` is the driver's side of one actor, with the same surface as `ServerProcess` (`url`,
`alive`, `returncode`, `restart`, `wait_healthy_async`, `log_tail`, `stop`, `kill`), so the router
reaches the server directly at its node address and `serve.ServerSupervisor` supervises it like a
local one: a server that died, or whose actor or node is gone, is `server_down` in the router, its
sessions move; it is restarted through its actor (a new actor in the same bundle when the old one
died, on the same port; if Ray moved the bundle off a lost node, the router's client follows it to
the new node's address) and re-synced to the current weights (`router.resync`) before it serves
again. The lost-node path has not been exercised by a test (the tests kill the server process).
`start_placed_servers` starts all of them and returns the `InferenceService` the driver uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from pathlib import Path
from typing import Any

from agentrl.config import AgentRLConfig
from agentrl.errors import AgentRLError, ConfigError, ServerUnavailableError
from agentrl.models import BUILTIN_MODELS

__all__ = ["PlacedServer", "ServerActor", "start_placed_servers"]

log = logging.getLogger(__name__)


class ServerActor:
    """One LLM server on this actor's node (see the module docstring); wrapped by `ray.remote`."""

    def __init__(
        self, engine: str, model: str, engine_kwargs: dict[str, Any], log_path: str, port: int | None = None,
        token: str | None = None,
    ) -> None:
        from agentrl.inference.launcher import ServerProcess
        from agentrl.models import resolve_model_path
        from agentrl.orchestration.ray_calls import node_ip
        from agentrl.registry import INFERENCE_ENGINES

        self.ip = node_ip()
        path = resolve_model_path(model)
        if not Path(path).is_dir():
            raise ConfigError(
                f"model.path '{model}' is not a directory on node {self.ip}: every node that runs "
                "a server or a trainer rank needs the model at the same path (or give a built-in "
                "model name, converted on each node)."
            )
        self.proc = ServerProcess(
            INFERENCE_ENGINES.resolve(engine),
            path,
            host=self.ip,
            port=port,
            log_path=log_path,
            token=token,
            **engine_kwargs,
        )
        self.proc.start()

    def url(self) -> str:
        return self.proc.url

    def status(self) -> tuple[bool, int | None]:
        """(whether the server process runs, its exit code if it ended)."""
        return self.proc.alive, self.proc.returncode

    def wait_healthy(self, timeout_s: float) -> float:
        """Block until the server answers /health (raise if it dies or time runs out); its start-up seconds."""
        self.proc.wait_healthy(timeout_s)
        return float(self.proc.startup_s or 0.0)

    def restart(self) -> None:
        self.proc.restart()

    def log_tail(self, n: int = 30) -> str:
        return self.proc.log_tail(n)

    def kill(self) -> None:
        """SIGKILL the server's process group (tests simulate a crash with it)."""
        self.proc.kill()

    def server_pid(self) -> int | None:
        return self.proc.server_pid

    def stop(self) -> None:
        self.proc.stop()


class PlacedServer:
    """The driver's proxy of one `ServerActor` (see the module docstring)."""

    def __init__(self, make_actor: Any, index: int, node_ip: str, log_path: str, token: str | None = None) -> None:
        self.make_actor = make_actor  # (port or None) -> a new actor handle in this server's bundle
        self.token = token  # the bearer token the server takes (`server_app`), for `client()`
        self.index = index
        self.node_ip = node_ip
        self.log_path = Path(log_path)  # on the server's node
        self.actor = make_actor(None)
        self.actor_gone = False
        self.url = ""
        self.port = 0
        self.alive = True
        self.returncode: int | None = None
        self.startup_s: float | None = None
        self._restart: Any = None
        self._client: Any = None  # the router's client of this server (`client()`)

    def __repr__(self) -> str:
        return f"PlacedServer({self.index}, {self.url or self.node_ip}, alive={self.alive})"

    async def _call(self, method: str, *args: Any) -> Any:
        import ray.exceptions

        try:
            return await getattr(self.actor, method).remote(*args)
        except ray.exceptions.RayActorError as exc:
            self.alive, self.actor_gone = False, True
            # driver.log keeps Ray's whole account (the console gets the line that names the cause)
            log.error("server %d on node %s: its actor is gone:\n%s", self.index, self.node_ip, exc)
            raise ServerUnavailableError(
                f"server {self.index} on node {self.node_ip}: its actor is gone ({actor_death_reason(exc)})"
            ) from exc
        except ray.exceptions.OutOfMemoryError as exc:
            # Ray's first line names the node and its memory; the rest is the same advice for every task.
            raise ServerUnavailableError(
                f"server {self.index} on node {self.node_ip}: its actor was killed for lack of memory during "
                f"{method} ({str(exc).strip().splitlines()[0] if str(exc).strip() else 'Ray said no more'}). Free "
                "memory on that node, or reserve it per process (cluster.server.memory_gb, "
                "cluster.trainer.memory_gb) so that Ray places no more there than it holds"
            ) from exc
        except ray.exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, ServerUnavailableError):
                # The server's own account (it exited, or never answered; its log's last lines) names
                # no node, and its log path is on the server's node, not the driver's: say which.
                raise ServerUnavailableError(f"server {self.index} on node {self.node_ip}: {cause}") from None
            if isinstance(cause, AgentRLError):
                raise cause from None
            raise ServerUnavailableError(
                f"server {self.index} on node {self.node_ip}: {method} failed: {exc}"
            ) from exc

    async def started(self, timeout_s: float) -> PlacedServer:
        """Wait until the server answers /health on its node; learn its URL."""
        url = await self._call("url")
        if self._client is not None and url != self._client.base_url:
            # Its node was lost and Ray moved the bundle: the router's client follows it there.
            log.warning("server %d moved from %s to %s", self.index, self._client.base_url, url)
            self._client.base_url = url
            self._client._http.base_url = url
            self.node_ip = url.split("//", 1)[1].rsplit(":", 1)[0]
        self.url = url
        self.port = int(self.url.rsplit(":", 1)[1])
        self.startup_s = await self._call("wait_healthy", timeout_s)
        return self

    async def refresh(self) -> None:
        if self._restart is not None:
            return  # being restarted: `wait_healthy_async` says how it went
        try:
            self.alive, self.returncode = await asyncio.wait_for(self._call("status"), 30.0)
        except (ServerUnavailableError, TimeoutError) as exc:
            self.alive, self.returncode = False, None
            log.warning("server %d on node %s does not answer: %s", self.index, self.node_ip, exc)

    def restart(self) -> PlacedServer:
        """Start the server again on the same port (the router knows it by its URL): through its actor,
        or a new actor in its bundle when that one is gone. Returns at once; `wait_healthy_async` waits."""
        import ray

        if self.actor_gone:
            with contextlib.suppress(Exception):
                ray.kill(self.actor)
            self.actor = self.make_actor(self.port or None)
            self.actor_gone = False
            self._restart = True
        else:
            self._restart = self.actor.restart.remote()
        return self

    async def wait_healthy_async(self, timeout_s: float = 600.0) -> PlacedServer:
        try:
            if self._restart is not None and self._restart is not True:
                await self._restart
            await self.started(timeout_s)
        except Exception as exc:
            if not isinstance(exc, ServerUnavailableError):
                raise ServerUnavailableError(
                    f"server {self.index} on node {self.node_ip} did not come back: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            raise
        finally:
            self._restart = None
        self.alive, self.returncode = True, None
        return self

    def log_tail(self, n: int = 30) -> str:
        import ray

        try:
            return str(ray.get(self.actor.log_tail.remote(n), timeout=10))
        except Exception as exc:  # the node may be gone with its log
            return f"(the log on node {self.node_ip} cannot be read: {type(exc).__name__})"

    def client(self, **kwargs: Any) -> Any:
        from agentrl.inference.client import HTTPServerClient

        self._client = HTTPServerClient(self.url, **{"token": self.token, **kwargs})
        return self._client

    def kill(self) -> None:
        import ray

        ray.get(self.actor.kill.remote(), timeout=30)

    def stop(self, timeout_s: float = 15.0) -> None:
        import ray

        with contextlib.suppress(Exception):
            ray.get(self.actor.stop.remote(), timeout=timeout_s + 5)
        with contextlib.suppress(Exception):
            ray.kill(self.actor)


async def start_placed_servers(
    config: AgentRLConfig, reservation: Any, model_path: str, *, log_dir: str | Path | None = None
) -> Any:
    """Start `inference.num_servers` servers of `model_path` (the model directory `build_job`
    resolved, which every server's node must hold at that path), each by a `ServerActor` in its
    bundle of `reservation`; return the `InferenceService` (router over their node addresses,
    supervised) once every server answers /health, or raise (stopping the ones that did start)."""
    import ray

    from agentrl.inference.router import Router
    from agentrl.inference.serve import InferenceService, ServerSupervisor, engine_kwargs_from_config

    inf = config.inference
    kwargs = engine_kwargs_from_config(config)
    actor_cls = ray.remote(max_concurrency=4)(ServerActor)  # type: ignore[call-overload]  # Ray's overloads take no options with a class
    servers: list[PlacedServer] = []
    # The servers listen on their nodes' addresses: only this run's clients hold the token they take.
    token = secrets.token_urlsafe(32)

    # A built-in model goes by its name: each node converts it into its own cache (the driver's
    # converted directory is not on the other nodes). Any other model is the path build_job resolved.
    model = config.model.path if config.model.path in BUILTIN_MODELS else model_path

    def maker(i: int, log_path: str) -> Any:
        opts = reservation.options("server", i)
        return lambda port: actor_cls.options(**opts).remote(
            inf.engine, model, kwargs, log_path, port, token
        )

    try:
        for i in range(inf.num_servers):
            # The log lives on the server's node: the driver's run directory is not there.
            log_path = str(Path(log_dir or "/tmp") / f"{inf.engine}-{i}.log")
            servers.append(PlacedServer(maker(i, log_path), i, reservation.node_ip("server", i), log_path, token))
        await asyncio.gather(*(s.started(inf.startup_timeout_s) for s in servers))
    except BaseException:
        for server in servers:
            server.stop()
        raise
    for s in servers:
        log.info(
            "%s server %d healthy at %s on node %s after %.1f s",
            inf.engine,
            s.index,
            s.url,
            s.node_ip,
            s.startup_s or 0.0,
        )
    router = Router(
        [s.client() for s in servers],
        overload_threshold=inf.overload_threshold,
        request_timeout_s=config.rollout.request_timeout_s,
    )
    supervisor = ServerSupervisor(
        router,
        servers,  # type: ignore[arg-type]  # the same surface as ServerProcess
        startup_timeout_s=inf.startup_timeout_s,
        max_restarts=inf.max_restarts,
    )
    return InferenceService(router, servers, supervisor)  # type: ignore[arg-type]  # the same surface as ServerProcess


def actor_death_reason(exc: BaseException) -> str:
    """The line of a Ray actor error that says why the actor died: the error its constructor raised
    (Ray puts it last, after the traceback), or the system's reason (a signal, the node lost)."""
    said = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    errors = [ln for ln in said if "Error:" in ln or "Exception:" in ln]
    if errors:
        return errors[-1][:500]
    system = [ln for ln in said[1:] if not ln.startswith(("class_name:", "actor_id:", "pid:", "name:", "namespace:"))]
    return "; ".join([said[0], *system] if said else [type(exc).__name__])[:500]

