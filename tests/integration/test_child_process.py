"""`agentrl.child_process` with tiny `python -c` children: ready within the deadline, not ready (the
log tail and the cause in the error), an exit before ready, a stop that ends the whole group, a
one-shot probe whose timeout kills its group. Real processes, so here and not in tests/unit; each
test takes a second or two."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import pytest

from agentrl.child_process import ChildProcess, Condition, LogLine, arun_probe, exit_cause, run_probe
from agentrl.errors import ChildNotReadyError
from agentrl.lifeline import LIFELINE_PATH, group_members

PY = sys.executable


def _gone(pid: int, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def test_ready_within_the_deadline_from_a_log_line(tmp_path):
    child = ChildProcess([PY, "-c", "import time; print('listening on 4242', flush=True); time.sleep(60)"],
                         name="the test server", log_path=tmp_path / "server.log").start()
    try:
        assert child.wait_ready(LogLine(r"listening on (\d+)"), timeout_s=20) == "4242"
        assert child.alive and child.returncode is None
        cmdline = Path(f"/proc/{child.pid}/cmdline").read_bytes().split(b"\0")
        assert cmdline[2].decode() == LIFELINE_PATH  # python -I lifeline.py ...
        assert os.getpgid(child.pid) == child.pid  # it leads a process group of its own
    finally:
        child.stop()
    assert "listening on 4242" in (tmp_path / "server.log").read_text()


def test_not_ready_in_time_raises_with_the_tail_and_the_cause_and_stops_it():
    child = ChildProcess([PY, "-c", "import time; print('loading weights', flush=True); time.sleep(60)"],
                         name="the slow server", grace_s=1.0).start()
    pid = child.pid
    with pytest.raises(ChildNotReadyError) as err:
        child.wait_ready(Condition(lambda: None), timeout_s=1.5)
    assert err.value.cause == "did not become ready within 1.5 s"
    assert err.value.timed_out and err.value.returncode is None
    assert err.value.tail == "loading weights"
    assert str(err.value).startswith("the slow server did not become ready within 1.5 s; its log ends:\nloading weights")
    assert pid is not None and _gone(pid)


def test_exit_before_ready_names_the_exit_code_and_the_tail():
    child = ChildProcess([PY, "-c", "import sys; print('no such model', file=sys.stderr); sys.exit(3)"],
                         name="the judge").start()

    async def wait() -> str:
        return await child.await_ready(Condition(lambda: None), timeout_s=30, interval_s=0.05)

    with pytest.raises(ChildNotReadyError) as err:
        asyncio.run(wait())
    assert err.value.cause == "exited with code 3" and err.value.returncode == 3
    assert err.value.tail == "no such model" and not err.value.timed_out


def test_killed_by_a_signal_is_said_so():
    assert exit_cause(-9) == "was killed by signal 9 (SIGKILL)"
    assert exit_cause(-15) == "was killed by signal 15 (SIGTERM)"
    assert exit_cause(0) == "exited with code 0"
    child = ChildProcess([PY, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], name="x").start()
    child.wait(timeout=20)
    assert child.exit_cause() == "was killed by signal 9 (SIGKILL)"  # the lifeline ends as its command did


def test_stop_ends_the_whole_group_even_a_child_that_ignores_sigterm():
    code = ("import signal, subprocess, sys, time\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "subprocess.Popen([sys.executable, '-c', 'import signal, time; "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)'])\n"
            "print('up', flush=True); time.sleep(60)\n")
    child = ChildProcess([PY, "-c", code], name="stubborn", grace_s=1.0).start()
    child.wait_ready(LogLine("^up$"), timeout_s=20, interval_s=0.05)
    time.sleep(0.3)
    members = [p for p in group_members(child.pid) if p != child.pid]
    assert len(members) == 2  # the command and the grandchild it started
    started = time.monotonic()
    assert child.stop() == -9  # SIGTERM was ignored: the lifeline SIGKILLed the group after its grace
    assert time.monotonic() - started < 8
    assert all(_gone(p) for p in members)
    assert group_members(child.pid) == []


def test_pipes_carry_a_protocol_and_stderr_goes_to_the_log():
    code = ("import sys\nprint('starting', file=sys.stderr, flush=True)\n"
            "for line in sys.stdin: print(line.strip().upper(), flush=True)\n")
    child = ChildProcess([PY, "-c", code], name="echo", stdin=True, stdout=True, text=True).start()
    child.stdin.write("hello\n")
    child.stdin.flush()
    assert child.stdout.readline() == "HELLO\n"
    child.stdin.close()
    assert child.wait(timeout=20) == 0
    assert child.log_tail() == "starting"


def test_one_shot_probe_captures_output_and_its_timeout_kills_the_group(tmp_path):
    done = run_probe([PY, "-c", "import sys; print('42'); print('warn', file=sys.stderr)"], timeout_s=30)
    assert (done.returncode, done.stdout, done.stderr, done.timed_out) == (0, "42\n", "warn\n", False)
    assert done.cause == "exited with code 0"

    pidfile = tmp_path / "grandchild.pid"
    code = (f"import subprocess, sys, time\np = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            f"open({str(pidfile)!r}, 'w').write(str(p.pid))\nprint('started', flush=True)\ntime.sleep(60)\n")
    started = time.monotonic()
    slow = run_probe([PY, "-c", code], timeout_s=2.0)
    assert slow.timed_out and slow.returncode is None and slow.cause == "did not finish within 2 s"
    assert slow.stdout == "started\n"
    assert time.monotonic() - started < 10
    assert _gone(int(pidfile.read_text()))


def test_async_probe_feeds_stdin_and_a_cancel_kills_the_group(tmp_path):
    async def both() -> tuple[int | None, bytes, bytes]:
        answer = await arun_probe([PY, "-c", "import sys; print(sys.stdin.read()[::-1])"], input=b"abc")
        pidfile = tmp_path / "agent.pid"
        code = f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
        task = asyncio.ensure_future(arun_probe([PY, "-c", code], input=b""))
        while not pidfile.exists() or not pidfile.read_text():
            await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert _gone(int(pidfile.read_text()))
        return answer

    assert asyncio.run(both()) == (0, b"cba\n", b"")


def test_a_program_that_cannot_start_raises_as_popen_would(tmp_path):
    with pytest.raises(FileNotFoundError):
        run_probe([str(tmp_path / "no-such-program")], timeout_s=5)
    with pytest.raises(FileNotFoundError):
        ChildProcess(["no-such-program-on-path"], name="x").start()
    script = tmp_path / "not-executable"
    script.write_text("#!/bin/sh\n")
    with pytest.raises(PermissionError):
        run_probe([str(script)], timeout_s=5)


def test_on_exit_is_called_once_the_child_has_ended_and_it_is_reaped():
    import threading

    ended = threading.Event()
    causes: list[str | None] = []
    child = ChildProcess([PY, "-c", "import sys; sys.exit(5)"], name="short",
                         on_exit=lambda c: (causes.append(c.exit_cause()), ended.set()))
    child.start()
    assert ended.wait(20)
    assert causes == ["exited with code 5"]
    assert not Path(f"/proc/{child.pid}").exists()  # reaped: no zombie left for the next look
