"""The sandbox-server image recipe (images/sandbox-server/) builds and serves, with nothing pulled.

The image is built by the shipped `build.sh` FROM a Debian bookworm made with debootstrap
(tests/docker_images.py), offline: the server's wheels are downloaded on the host first (from
PyPI, which this machine reaches) and installed from the build context. Then it runs the way a
fleet machine runs it, with the docker backend on the host's daemon, and serves a SWE episode in
an instance image whose Python is 3.13 through `RemoteSandbox`, as a rollout worker elsewhere would.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
from docker_images import debian_image, docker_sdk, image_exists
from swe_images import BATCHKIT, NAMESPACE, published_row, tag_for_format

from agentrl.envs.swe import SweEnv, reference_fix_actions
from agentrl.envs.swe_tasks import SweTask, task_row
from agentrl.sandboxes.remote import RemoteSandbox

pytestmark = [pytest.mark.docker, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
BASE = "agentrl-swe-test/debian:bookworm-server"
TOKEN = f"token-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="module")
def server_image(tmp_path_factory: pytest.TempPathFactory) -> str:
    if not image_exists(BASE) and shutil.which("debootstrap") is None:
        pytest.skip("building the base image needs debootstrap")
    debian_image(BASE, suite="bookworm", packages=["python3", "python3-venv", "bubblewrap"])
    wheels = tmp_path_factory.mktemp("wheels")
    got = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "-d", str(wheels), "-r",
                          str(REPO / "images/sandbox-server/requirements.txt")], capture_output=True, text=True)
    if got.returncode != 0:
        pytest.skip(f"PyPI is not reachable for the server's wheels: {got.stderr[-300:]}")
    tag = f"{NAMESPACE}/sandbox-server:{uuid.uuid4().hex[:8]}"
    built = subprocess.run(
        ["sh", str(REPO / "images/sandbox-server/build.sh"), tag, "--network", "none", "--build-arg", f"BASE={BASE}",
         "--build-arg", "PIP_ARGS=--no-index --find-links /src/wheels"],
        capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", "AGENTRL_WHEELS": str(wheels)}, timeout=900)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    yield tag
    subprocess.run(["docker", "rmi", "-f", tag], capture_output=True)


def _serve(image: str, *args: str) -> tuple[str, str]:
    """Run the server container; return its id and URL once /health answers.

    This machine's daemon has no bridge network (dockerd --bridge=none), so the container shares
    the host's network and the server binds a free loopback port (later flags win over the image's).
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cid = subprocess.run(["docker", "run", "-d", "--label", "agentrl.test=sandbox-server", "--network", "host",
                          "-e", f"AGENTRL_SANDBOX_TOKEN={TOKEN}", *args, image, "--backend", "docker",
                          "--host", "127.0.0.1", "--port", str(port)],
                         capture_output=True, text=True, check=True).stdout.strip()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).json().get("status") == "ok":
                return cid, url
        except (httpx.TransportError, ValueError):
            time.sleep(0.3)
    logs = subprocess.run(["docker", "logs", cid], capture_output=True, text=True)
    subprocess.run(["docker", "rm", "-f", cid], capture_output=True)
    pytest.fail(f"the server container did not answer: {logs.stdout[-2000:]}{logs.stderr[-2000:]}")


def test_the_server_image_serves_swe_sessions_in_instance_images(server_image: str) -> None:
    image = tag_for_format(BATCHKIT)
    task = SweTask.from_dict(published_row(BATCHKIT), image_namespace=NAMESPACE)
    cid, url = _serve(server_image, "-v", "/var/run/docker.sock:/var/run/docker.sock")
    try:
        async def body():  # type: ignore[no-untyped-def]
            remote = RemoteSandbox(url, token=TOKEN)
            env = SweEnv(sandbox=remote)
            try:
                session = await remote.session(image=image, workdir="/testbed")
                probe = await session.exec("python3 --version; pwd", timeout_s=30)
                await session.close()
                await env.areset(options={"row": task_row(task)})
                for action in reference_fix_actions(task):
                    _, reward, terminated, _, info = await env.astep(action)
                return probe, reward, terminated, info
            finally:
                await env.aclose()
                await remote.close()

        probe, reward, terminated, info = asyncio.run(body())
        assert probe.stdout.split()[:2] == ["Python", probe.stdout.split()[1]] and probe.stdout.split()[1].startswith("3.13")
        assert probe.stdout.split()[2] == "/testbed"
        assert (reward, terminated, info["metrics"]["resolved"]) == (1.0, True, 1.0), info["swe"]
        unauthorized = httpx.post(f"{url}/v1/sessions", json={}, timeout=10)
        assert unauthorized.status_code == 401
    finally:
        subprocess.run(["docker", "stop", "-t", "20", cid], capture_output=True)  # SIGTERM: the server closes its sandbox
        logs = subprocess.run(["docker", "logs", cid], capture_output=True, text=True)
        subprocess.run(["docker", "rm", "-f", cid], capture_output=True)
    docker = docker_sdk()
    left = docker.from_env().containers.list(all=True, filters={"ancestor": image, "label": "agentrl.sandbox=1"})
    assert left == [], logs.stderr[-2000:]
