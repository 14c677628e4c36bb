"""Sandboxes on other hosts of a Ray cluster: `agentrl sandbox serve` placed like the servers.

With `cluster.sandbox_hosts=N`, `build_job` plans the hosts (`SandboxHostsPlan`) and the run starts
them (`SandboxHostsPlan.start`): one `SandboxHostActor` in each sandbox bundle of the run's placement
group, each checked to run a shell command before the run goes on. On its node the actor runs the sandbox server (the process
`agentrl sandbox serve` runs: `agentrl.sandboxes.server.serve`, with the backend `sandbox.name`
and its `sandbox.kwargs`) bound to the node's address on a free port there, under a lifeline, and
with a bearer token the driver drew for this run (handed over in the process's environment, never
on its command line). The run's tools then reach those servers through `RemoteSandbox` clients
(several hosts: `SpreadSandbox`, each job or session on the next host), so a tool failure is
classified as it is with a local sandbox: a program's failure is the model's, a host that cannot be
reached or answers 5xx is an infrastructure fault.

What this does not do: restart a sandbox host that died (its sessions are gone; the episodes using
it fail as infrastructure faults and their prompts are requeued, and with every host gone the run
stops on `run.max_infra_failure_rate`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import sys
from dataclasses import dataclass, field
from typing import Any

from agentrl.config import AgentRLConfig
from agentrl.errors import PreflightError, SandboxError

__all__ = ["SandboxHostActor", "SandboxHosts", "SandboxHostsPlan", "plan_sandbox_hosts"]

log = logging.getLogger(__name__)

_SERVE = (
    "import json, os, sys\n"
    "from agentrl.sandboxes.server import serve\n"
    "serve(host=sys.argv[1], port=int(sys.argv[2]), token=os.environ['AGENTRL_SANDBOX_TOKEN'], "
    "backend=sys.argv[3], **json.loads(sys.argv[4]))\n"
)


class SandboxHostActor:
    """One sandbox server on this actor's node (see the module docstring); wrapped by `ray.remote`."""

    def __init__(self, backend: str, kwargs: dict[str, Any], token: str) -> None:
        from agentrl.child_process import ChildProcess
        from agentrl.inference.launcher import free_port
        from agentrl.orchestration.ray_calls import node_ip

        self.ip = node_ip()
        self.port = free_port(self.ip)
        # The server's output goes to a file that is unlinked at once (ChildProcess's default log): the
        # actor quotes its tail when the server fails, and nothing is left in the node's /tmp afterwards,
        # however the run ends.
        argv = [sys.executable, "-c", _SERVE, self.ip, str(self.port), backend, json.dumps(kwargs)]
        self.proc = ChildProcess(argv, name=f"the sandbox server on node {self.ip}",
                                 env={**os.environ, "AGENTRL_SANDBOX_TOKEN": token}).start()

    def log_tail(self, lines: int = 20) -> str:
        """The last `lines` lines the server wrote."""
        return self.proc.log_tail(lines=lines)

    def url(self) -> str:
        return f"http://{self.ip}:{self.port}"

    def wait_healthy(self, timeout_s: float) -> str:
        """Block until the server answers /health; its URL. Raise with its log if it exits or times out."""
        from agentrl.child_process import HealthURL
        from agentrl.errors import ChildNotReadyError

        try:
            self.proc.wait_ready(HealthURL(self.url() + "/health"), timeout_s)
        except ChildNotReadyError as exc:
            raise SandboxError(f"{exc.name} {exc.cause}; its log ends:\n{exc.tail}") from None
        return self.url()

    def stop(self) -> None:
        self.proc.stop()
        self.proc.close_log()


@dataclass(frozen=True)
class SandboxHostsPlan:
    """The sandbox hosts a cluster run starts (`cluster.sandbox_hosts`): planned by `build_job`,
    started by the run once its placement group is reserved (their addresses are known only then)."""

    count: int
    backend: str
    """`sandbox.name`: the backend each host serves (local or docker)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """`sandbox.kwargs`, given to the backend on each host."""
    timeout_s: float = 120.0
    """How long a host may take to answer /health."""

    async def start(self, reservation: Any) -> SandboxHosts:
        """Start one host in each sandbox bundle of `reservation`; wait until each answers, and
        check each runs a shell command. On any failure the hosts started are stopped."""
        import ray

        token = secrets.token_urlsafe(32)
        actor_cls = ray.remote(SandboxHostActor)
        actors: list[Any] = [
            actor_cls.options(**reservation.options("sandbox", i)).remote(
                self.backend, dict(self.kwargs), token
            )
            for i in range(self.count)
        ]
        try:
            urls = list(await asyncio.gather(*(a.wait_healthy.remote(self.timeout_s) for a in actors)))
        except Exception as exc:
            for actor in actors:
                ray.kill(actor)
            cause = getattr(exc, "cause", None)
            raise (
                cause
                if isinstance(cause, SandboxError)
                else SandboxError(f"cluster.sandbox_hosts: a sandbox host did not start: {exc}")
            ) from None
        hosts = SandboxHosts(actors, urls, token)
        try:
            await hosts.check()
        except BaseException:
            hosts.stop()
            raise
        for i, url in enumerate(urls):
            log.info("sandbox host %d serving at %s (%s backend, token auth)", i, url, self.backend)
        return hosts


class SandboxHosts:
    """The sandbox host actors of a run, their URLs and token; `sandbox()` is the run's client."""

    def __init__(self, actors: list[Any], urls: list[str], token: str) -> None:
        self.actors = actors
        self.urls = urls
        self.token = token

    def sandbox(self) -> Any:
        from agentrl.sandboxes.remote import RemoteSandbox, SpreadSandbox

        clients = [RemoteSandbox(u, token=self.token) for u in self.urls]
        return clients[0] if len(clients) == 1 else SpreadSandbox(clients)

    async def check(self) -> None:
        """Raise PreflightError naming the host that cannot run a shell command."""
        from agentrl.sandboxes.remote import RemoteSandbox

        for url in self.urls:
            client = RemoteSandbox(url, token=self.token)
            try:
                res = await client.exec("echo $((6 * 7))", timeout_s=60)
            finally:
                await client.close()
            if res.exit_code != 0 or res.stdout.strip() != "42":
                raise PreflightError(f"cluster.sandbox_hosts: the sandbox host at {url} cannot run a shell command "
                                     f"(exit {res.exit_code}, {res.stderr[-300:]!r}); run 'agentrl doctor' on "
                                     "that node with the same sandbox settings.")

    def stop(self) -> None:
        import ray

        for actor in self.actors:
            try:
                ray.get(actor.stop.remote(), timeout=20)
            except Exception as exc:  # a host that is already gone
                log.debug("stopping a sandbox host: %s", exc)
            ray.kill(actor)


def plan_sandbox_hosts(config: AgentRLConfig) -> SandboxHostsPlan:
    """The plan of `cluster.sandbox_hosts` hosts serving `sandbox.name` with `sandbox.kwargs`."""
    return SandboxHostsPlan(config.cluster.sandbox_hosts, config.sandbox.name, dict(config.sandbox.kwargs))
