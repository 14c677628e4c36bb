"""Sandboxes on other hosts of a Ray cluster: `agentrl sandbox serve` placed like the servers.

With `cluster.sandbox_hosts=N`, `start_sandbox_hosts` starts one `SandboxHostActor` in each sandbox
bundle of the run's placement group. On its node the actor runs the sandbox server (the process
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
from typing import Any

from agentrl.config import AgentRLConfig
from agentrl.errors import SandboxError

__all__ = ["SandboxHostActor", "SandboxHosts", "start_sandbox_hosts"]

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
        fd, self.log_path = tempfile.mkstemp(prefix="agentrl-sandbox-host-", suffix=".log")
        os.close(fd)
        argv = [sys.executable, "-c", _SERVE, self.ip, str(self.port), backend, json.dumps(kwargs)]
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(
                lifeline_argv(argv), stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                env={**os.environ, "AGENTRL_SANDBOX_TOKEN": token}, start_new_session=True,
            )  # fmt: skip

    def url(self) -> str:
        return f"http://{self.ip}:{self.port}"

    def wait_healthy(self, timeout_s: float) -> str:
        """Block until the server answers /health; its URL. Raise with its log if it exits or times out."""
        import time

        import httpx

        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                with open(self.log_path, errors="replace") as f:
                    tail = "".join(f.readlines()[-20:])
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

    def stop(self) -> None:
        import ray

        for actor in self.actors:
            try:
                ray.get(actor.stop.remote(), timeout=20)
            except Exception as exc:  # a host that is already gone
                log.debug("stopping a sandbox host: %s", exc)
            ray.kill(actor)


def start_sandbox_hosts(config: AgentRLConfig, reservation: Any, *, timeout_s: float = 120.0) -> SandboxHosts:
    """Start `cluster.sandbox_hosts` sandbox servers in their bundles; wait until each answers."""
    import ray

    token = secrets.token_urlsafe(32)
    actor_cls = ray.remote(SandboxHostActor)
    n = config.cluster.sandbox_hosts
    actors: list[Any] = [
        actor_cls.options(**reservation.options("sandbox", i)).remote(
            config.sandbox.name, dict(config.sandbox.kwargs), token
        )
        for i in range(n)
    ]

    async def wait() -> list[str]:
        return list(await asyncio.gather(*(a.wait_healthy.remote(timeout_s) for a in actors)))

    try:
        urls = asyncio.run(wait())
    except Exception as exc:
        for actor in actors:
            ray.kill(actor)
        cause = getattr(exc, "cause", None)
        raise (
            cause
            if isinstance(cause, SandboxError)
            else SandboxError(f"cluster.sandbox_hosts: a sandbox host did not start: {exc}")
        ) from None
    for i, url in enumerate(urls):
        log.info("sandbox host %d serving at %s (%s backend, token auth)", i, url, config.sandbox.name)
    return SandboxHosts(actors, urls, token)
