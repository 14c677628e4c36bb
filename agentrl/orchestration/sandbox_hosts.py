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
import subprocess
import sys
import tempfile
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
        import ray.util

        from agentrl.inference.launcher import free_port
        from agentrl.lifeline import lifeline_argv

        self.ip = ray.util.get_node_ip_address()
        self.port = free_port(self.ip)
        # The server's output goes to a file that is unlinked at once: the actor keeps it open to
        # quote its tail when the server fails, and nothing is left in the node's /tmp afterwards,
        # however the run ends.
        self._log = tempfile.TemporaryFile(prefix="agentrl-sandbox-host-", suffix=".log")
        argv = [sys.executable, "-c", _SERVE, self.ip, str(self.port), backend, json.dumps(kwargs)]
        self.proc = subprocess.Popen(
            lifeline_argv(argv), stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            env={**os.environ, "AGENTRL_SANDBOX_TOKEN": token}, start_new_session=True,
        )  # fmt: skip

    def log_tail(self, lines: int = 20) -> str:
        """The last `lines` lines the server wrote."""
        self._log.seek(0)
        return "".join(self._log.read().decode(errors="replace").splitlines(keepends=True)[-lines:])

    def url(self) -> str:
        return f"http://{self.ip}:{self.port}"

    def wait_healthy(self, timeout_s: float) -> str:
        """Block until the server answers /health; its URL. Raise with its log if it exits or times out."""
        import time

        import httpx

        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log_tail()
                why = (
                    f"exited with code {self.proc.returncode}"
                    if self.proc.poll() is not None
                    else f"did not answer within {timeout_s:.0f} s"
                )
                raise SandboxError(f"the sandbox server on node {self.ip} {why}; its log ends:\n{tail}")
            try:
                if httpx.get(self.url() + "/health", timeout=2.0).status_code == 200:
                    return self.url()
            except httpx.HTTPError:
                pass
            time.sleep(0.25)

    def stop(self) -> None:
        import signal

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self._log.close()


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
