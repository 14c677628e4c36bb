"""Processes die with the process that started them, without vLLM: the lifeline
and the reaper with small real process trees. A parent here is a real Python process that starts
the children and is then SIGKILLed, as a driver would be."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
from fault_common import wait_until_gone

# A "server" that starts a child of its own in the same process group (like vLLM's engine core).
SERVER = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
          "time.sleep(600)")


def tree_of(parent: subprocess.Popen[str], expect: int) -> list[psutil.Process]:
    """The parent's descendants, once `expect` of them run (a busy machine starts them slowly)."""
    line = parent.stdout.readline()  # type: ignore[union-attr]
    assert line.startswith("ready"), line
    deadline = time.monotonic() + 60
    while True:
        procs = psutil.Process(parent.pid).children(recursive=True)
        if len(procs) >= expect or time.monotonic() > deadline:
            return procs
        time.sleep(0.2)


def spawn_parent(body: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(body)], stdout=subprocess.PIPE, text=True)


def test_a_server_and_its_children_die_when_the_driver_is_killed() -> None:
    parent = spawn_parent(f"""
        import subprocess, sys, time
        from agentrl.lifeline import lifeline_argv
        subprocess.Popen(lifeline_argv([sys.executable, "-c", {SERVER!r}], grace_s=2), start_new_session=True)
        print("ready", flush=True)
        time.sleep(600)
    """)
    procs = tree_of(parent, 3)
    assert len(procs) == 3  # the lifeline, the server, the server's child
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    assert wait_until_gone(procs, timeout_s=30) == []


def test_when_the_server_dies_its_children_go_too_and_its_exit_is_reported() -> None:
    from agentrl.lifeline import lifeline_argv

    lifeline = subprocess.Popen(lifeline_argv([sys.executable, "-c", SERVER], grace_s=2), start_new_session=True)
    deadline = time.monotonic() + 60
    while len(psutil.Process(lifeline.pid).children(recursive=True)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    server, child = sorted(psutil.Process(lifeline.pid).children(recursive=True), key=lambda p: p.pid)
    server.kill()  # the OOM killer takes the server, not its child
    assert lifeline.wait(timeout=30) == -signal.SIGKILL, "the lifeline ends as its server did"
    assert wait_until_gone([child], timeout_s=10) == []


def test_the_reaper_ends_every_descendant_even_those_that_left_the_group() -> None:
    parent = spawn_parent("""
        import subprocess, sys, time
        from agentrl.lifeline import start_reaper
        start_reaper(grace_s=2)
        # one child in a session of its own, with a grandchild: as Ray's processes are
        subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                          "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"],
                         start_new_session=True)
        time.sleep(2.5)  # the reaper looks once a second
        print("ready", flush=True)
        time.sleep(600)
    """)
    procs = [p for p in tree_of(parent, 3) if "--reap-tree" not in " ".join(p.cmdline())]
    assert len(procs) == 2
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    assert wait_until_gone(procs, timeout_s=30) == []
