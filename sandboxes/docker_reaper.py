"""Containers outlive the process that started them; this module removes the ones whose owner died.

Every container `DockerSandbox` starts carries labels naming its owner: a random token per
sandbox object (`agentrl.owner`), the owner's pid, process start time and pid namespace, and this
machine's boot id (`agentrl.host`). Two mechanisms remove them when the owner cannot:

- A watchdog per sandbox (`start_watchdog`): a small detached process (`python -m
  agentrl.sandboxes.docker_reaper --owner TOKEN`) that blocks reading a pipe whose only writer is
  the owner. The kernel closes that pipe when the owner exits for any reason, SIGKILL included;
  the watchdog then removes every container labelled with the token and exits. After a normal
  `close()` it finds none and exits at once. It is the one process a sandbox leaves running, and
  only for as long as its owner lives.
- A reaper at start (`reap_orphans`): the first `DockerSandbox` of a process removes containers
  of this machine and pid namespace whose owner process is gone (its pid no longer runs, or runs
  a different process start time): what a killed watchdog could not clean.

Containers of other machines sharing a daemon, of other pid namespaces (a sandbox server in a
container drives the host's daemon too), and of owners still alive, are never touched.
Neither mechanism needs anything but the Docker SDK (`import_docker_sdk`, which the sandbox uses
too); neither kills a process.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
from typing import Any

from agentrl.child_process import ChildProcess
from agentrl.errors import SandboxUnavailableError

__all__ = ["LABEL_HOST", "LABEL_OWNER", "LABEL_OWNER_PID", "LABEL_OWNER_START", "LABEL_PIDNS", "LABEL_SANDBOX",
           "import_docker_sdk", "owner_labels", "reap_orphans", "start_watchdog"]

LABEL_SANDBOX = "agentrl.sandbox"
LABEL_OWNER = "agentrl.owner"
LABEL_OWNER_PID = "agentrl.owner_pid"
LABEL_OWNER_START = "agentrl.owner_start"
LABEL_HOST = "agentrl.host"
LABEL_PIDNS = "agentrl.pidns"

_INSTALL_SDK = "pip install 'agentrl[docker]' (or: bash scripts/install.sh docker)"


def import_docker_sdk() -> Any:
    """The Docker SDK (the `docker` package), or SandboxUnavailableError saying how to install it.

    Where the SDK is not installed, `import docker` still succeeds if a folder named `docker`
    lies on sys.path (the current directory, say): Python imports it as an empty namespace
    package, and the first `docker.from_env` fails with an AttributeError that names no cause.
    """
    try:
        docker = importlib.import_module("docker")
    except ImportError as exc:
        raise SandboxUnavailableError(f"The docker sandbox needs the Docker SDK: {_INSTALL_SDK}.") from exc
    if not hasattr(docker, "from_env"):
        found = [*getattr(docker, "__path__", []), getattr(docker, "__file__", None)]
        where = next((str(f) for f in found if f), "an unknown location")
        raise SandboxUnavailableError(
            f"'import docker' found {where}, which is not the Docker SDK (it has no docker.from_env): the "
            f"SDK is not installed and a folder named 'docker' on sys.path stands in for it. Install the SDK: "
            f"{_INSTALL_SDK}."
        )
    return docker


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        import socket

        return socket.gethostname()


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def process_start(pid: int) -> str | None:
    """The start time of process `pid` (clock ticks since boot), or None if it does not run."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22; the name in parentheses may hold spaces


def owner_labels(token: str) -> dict[str, str]:
    """The labels that tie a container to this process and to the sandbox object `token`."""
    pid = os.getpid()
    return {LABEL_SANDBOX: "1", LABEL_OWNER: token, LABEL_OWNER_PID: str(pid),
            LABEL_OWNER_START: process_start(pid) or "", LABEL_HOST: _boot_id(), LABEL_PIDNS: _pid_namespace()}


def _remove(client: Any, filters: dict[str, Any]) -> int:
    removed = 0
    for container in client.containers.list(all=True, filters=filters, ignore_removed=True):
        with contextlib.suppress(Exception):
            container.remove(force=True, v=True)
            removed += 1
    return removed


def reap_orphans(client: Any) -> int:
    """Remove this machine's sandbox containers whose owner process is gone; how many were removed."""
    wanted = [f"{LABEL_SANDBOX}=1", f"{LABEL_HOST}={_boot_id()}", f"{LABEL_PIDNS}={_pid_namespace()}"]
    removed = 0
    for container in client.containers.list(all=True, filters={"label": wanted}, ignore_removed=True):
        labels = container.labels or {}
        try:
            pid = int(labels.get(LABEL_OWNER_PID, ""))
        except ValueError:
            continue
        start = process_start(pid)
        if start is not None and start == labels.get(LABEL_OWNER_START, start):
            continue  # the owner still runs
        with contextlib.suppress(Exception):
            container.remove(force=True, v=True)
            removed += 1
    return removed


def start_watchdog(token: str, base_url: str | None) -> ChildProcess:
    """Start the watchdog of sandbox `token`; closing the returned process's stdin releases it.

    It is the one child agentrl starts without a lifeline (`lifeline=False`), on purpose: it must
    outlive its owner, to remove the owner's containers after it died."""
    argv = [sys.executable, "-m", "agentrl.sandboxes.docker_reaper", "--owner", token]
    if base_url:
        argv += ["--base-url", base_url]
    return ChildProcess(argv, name="the Docker sandbox's watchdog", stdin=True, lifeline=False).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Remove a dead DockerSandbox's containers (internal).")
    parser.add_argument("--owner", required=True)
    parser.add_argument("--base-url", default=None)
    args = parser.parse_args(argv)
    with contextlib.suppress(OSError):
        while os.read(0, 65536):  # returns b"" once the owner (the pipe's only writer) is gone
            pass
    docker = import_docker_sdk()
    client = docker.DockerClient(base_url=args.base_url) if args.base_url else docker.from_env()
    _remove(client, {"label": f"{LABEL_OWNER}={args.owner}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
