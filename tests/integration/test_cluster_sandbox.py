"""Sandboxes on another host: `cluster.sandbox_hosts` places `agentrl sandbox serve` on a
node of the namespace cluster (`tests/cluster_hosts.py`), with a token; code sent from the driver's
host runs there, a client without the token is refused (an infrastructure fault, `SandboxError`),
and the host leaves no file behind in the node's /tmp."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = """
import asyncio, json
import ray
from agentrl.config import load_config
from agentrl.errors import SandboxError
from agentrl.orchestration.cluster import build_cluster_plan, reserve
from agentrl.orchestration.sandbox_hosts import plan_sandbox_hosts
from agentrl.sandboxes.remote import RemoteSandbox

config = load_config(None, ["env=arithmetic", "inference.engine=hf", "trainer.device=cpu",
    "cluster.address={address}", "cluster.strategy=PACK", "cluster.trainer.cpus=2", "cluster.server.cpus=1",
    "cluster.sandbox_hosts=1", "cluster.sandbox_cpus=1"])
ray.init(address=config.cluster.address, logging_level="ERROR")
reservation = reserve(build_cluster_plan(config))
hosts = asyncio.run(plan_sandbox_hosts(config).start(reservation))
out = {{"nodes": reservation.nodes, "urls": hosts.urls}}

async def main():
    sandbox = hosts.sandbox()
    res = await sandbox.exec(code="import socket; print(socket.gethostname())", timeout_s=60)
    out["host"] = res.stdout.strip()
    session = await sandbox.session()
    await session.write_file("note.txt", "kept in the session")
    out["read"] = (await session.read_file("note.txt")).decode()
    await session.close()
    await sandbox.close()
    stranger = RemoteSandbox(hosts.urls[0], token="wrong")
    try:
        await stranger.exec("echo hi", timeout_s=10)
        out["stranger"] = "ran"
    except SandboxError as exc:
        out["stranger"] = str(exc)
    await stranger.close()

try:
    asyncio.run(main())
finally:
    hosts.stop()
    reservation.release()
print("RESULT", json.dumps(out))
"""


def test_a_sandbox_host_on_the_worker_runs_code_for_the_driver_with_a_token(
    ns_cluster, tmp_path: Path
) -> None:
    done = ns_cluster.head.python(SCRIPT.format(address=ns_cluster.address), timeout=300)
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    out = json.loads(line[len("RESULT ") :])
    worker = ns_cluster.worker.ip
    # trainer rank 0 fills the driver's node, so the server and the sandbox host land on the worker
    assert out["nodes"] == [ns_cluster.head.ip, worker, worker]
    assert out["urls"][0].startswith(f"http://{worker}:")
    # The server listens on the worker's address, which exists only in the worker host's namespace;
    # the code ran under the local backend's isolation there (its own host name).
    assert out["host"] == "sandbox"
    assert out["read"] == "kept in the session"
    assert "rejected the token" in out["stranger"]
    # the host's server log lived in an unlinked file: nothing is left in the worker's /tmp
    left = ns_cluster.worker.run(["sh", "-c", "ls -a /tmp"]).stdout.split()
    assert not [name for name in left if name.startswith("agentrl-sandbox-host-")], left
