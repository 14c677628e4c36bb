"""The Docker sandbox's control execs (the wipe of a one-shot container, the kill of its jobs) have a
deadline: an exec the daemon never finishes (its container gone under it) must not hang the thread
that runs it, or the event loop's shutdown that waits for that thread. A fake daemon API stands in
for Docker: its exec sockets never answer, and the non-socket `exec_start` (docker-py's, which waits
in `poll()` without a timeout) fails the test if it is ever called."""

from __future__ import annotations

import socket
import time
from typing import Any

import pytest

from agentrl.sandboxes import docker as docker_sandbox


class SilentDaemon:
    """Creates execs whose output never comes; records what was asked."""

    def __init__(self) -> None:
        self.started: list[list[str]] = []
        self.peers: list[socket.socket] = []
        self._argv: dict[str, list[str]] = {}

    def exec_create(self, cid: str, argv: list[str], **_: Any) -> dict[str, str]:
        eid = f"exec-{len(self._argv)}"
        self._argv[eid] = argv
        return {"Id": eid}

    def exec_start(self, eid: str, **kwargs: Any) -> Any:
        if not kwargs.get("socket"):
            raise AssertionError("a blocking exec_start (no deadline) was called")
        self.started.append(self._argv[eid])
        ours, theirs = socket.socketpair()
        self.peers.append(theirs)  # kept open: the exec neither answers nor ends
        return ours

    def exec_inspect(self, eid: str) -> dict[str, Any]:
        return {"Running": True, "ExitCode": None}


@pytest.fixture
def container(monkeypatch: pytest.MonkeyPatch) -> docker_sandbox._Container:
    monkeypatch.setattr(docker_sandbox, "_CONTROL_TIMEOUT_S", 0.2)
    spec = docker_sandbox._Spec(image="img", workdir="/work", tmpfs_workdir=True, read_only=True, user="65533:65533")
    c = docker_sandbox._Container(SilentDaemon(), "cid", spec, 0)
    monkeypatch.setattr(c, "_cgroup_file", lambda *_: None)  # no cgroup access: the kill goes through an exec
    monkeypatch.setattr(time, "sleep", lambda _s: None)  # the wait for the exec's exit code
    return c


def test_a_wipe_the_daemon_never_finishes_fails_within_its_deadline(container: docker_sandbox._Container) -> None:
    start = time.monotonic()
    assert container.wipe() is False  # not kept: the pool removes the container
    assert time.monotonic() - start < 5
    assert [argv[:3] for argv in container.api.started] == [["/bin/sh", "-c", docker_sandbox._WIPE]]


def test_a_kill_the_daemon_never_finishes_returns_without_killing_again(container: docker_sandbox._Container) -> None:
    start = time.monotonic()
    container.kill_jobs()
    assert time.monotonic() - start < 5
    assert container.api.started == [["/bin/sh", "-c", "kill -9 -1 2>/dev/null; exit 0"]]  # once: no kill loop


def test_a_job_past_its_deadline_is_killed_once(container: docker_sandbox._Container) -> None:
    out, err, code, killed = container.run(["sleep", "9"], b"", 0.2, 1024, env=None)
    assert (out, err, code, killed) == (b"", b"", None, "timeout")
    assert [argv[0] for argv in container.api.started] == ["sleep", "/bin/sh"]
