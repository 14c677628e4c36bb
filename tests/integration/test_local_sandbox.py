"""LocalSandbox doing its ordinary job: programs, input, files, exit codes, sessions, back-pressure."""

from __future__ import annotations

import asyncio
import logging

import pytest

from agentrl.errors import SandboxClosedError
from agentrl.sandboxes.bwrap import find_bwrap
from agentrl.sandboxes.local import LocalSandbox

needs_bwrap = pytest.mark.skipif(
    find_bwrap() is None, reason="bubblewrap is not installed (apt-get install bubblewrap)"
)


def run(coro):
    return asyncio.run(coro)


async def with_sandbox(fn, **kwargs):
    sandbox = LocalSandbox(**{"max_concurrency": 2, **kwargs})
    try:
        return await fn(sandbox)
    finally:
        await sandbox.close()


@needs_bwrap
def test_programs_see_stdin_files_and_report_exit_codes():
    async def body(sb):
        return await asyncio.gather(
            sb.exec(code="import sys; print(sys.stdin.read()[::-1])", stdin="abc", timeout_s=10),
            sb.exec("cat data/x.txt && exit 7", files={"data/x.txt": b"\x00bin\xff"}, timeout_s=10),
            sb.exec(code="import sys; sys.exit('bad input')", timeout_s=10),
            sb.exec(code="raise ValueError('nope')", timeout_s=10),
            sb.exec(code="import helper; print(helper.X)", files={"helper.py": "X = 41 + 1"}, timeout_s=10),
            sb.exec("python -c 'import os; print(os.getcwd())'", timeout_s=10),
        )

    rev, shell, sysexit, error, module, cwd = run(with_sandbox(body))
    assert rev.stdout == "cba\n" and rev.exit_code == 0 and rev.ok
    assert shell.exit_code == 7 and shell.stdout.startswith("\x00bin") and shell.killed_reason is None
    assert sysexit.exit_code == 1 and sysexit.stderr == "bad input\n"
    assert error.exit_code == 1 and error.stderr.splitlines()[-1] == "ValueError: nope"
    assert 'File "<string>", line 1' in error.stderr and "forkserver" not in error.stderr
    assert module.stdout == "42\n"
    assert cwd.stdout == "/workspace\n"


@needs_bwrap
def test_many_callers_wait_for_a_slot_and_all_succeed():
    async def body(sb):
        return await asyncio.gather(*(sb.exec(code=f"import time; time.sleep(0.05); print({i})", timeout_s=30)
                                      for i in range(12)))

    results = run(with_sandbox(body, max_concurrency=2))
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(12)]


@needs_bwrap
def test_jobs_draw_different_random_numbers():
    async def body(sb):
        return [await sb.exec(code="import random; print(random.random())", timeout_s=10) for _ in range(3)]

    outs = {r.stdout for r in run(with_sandbox(body, max_concurrency=1, pool_size=1, preload=("random",)))}
    assert len(outs) == 3


@needs_bwrap
def test_closed_sessions_and_sandboxes_refuse_work():
    async def body(sb):
        sess = await sb.session()
        await sess.close()
        await sess.close()  # twice is a no-op
        with pytest.raises(SandboxClosedError):
            await sess.exec("true", timeout_s=5)
        await sb.close()
        with pytest.raises(SandboxClosedError):
            await sb.exec("true", timeout_s=5)
        return await sess.is_alive(), await sb.is_alive()

    assert run(with_sandbox(body)) == (False, False)


def test_unisolated_mode_runs_code_and_says_so(caplog):
    with caplog.at_level(logging.WARNING):
        res = run(with_sandbox(lambda sb: sb.exec(code="print(6 * 7)", timeout_s=10), isolation="none"))
    assert res.stdout == "42\n"
    assert "UNISOLATED" in caplog.text


@needs_bwrap
def test_a_cancelled_session_call_does_not_desynchronise_the_session():
    async def body(sb):
        sess = await sb.session()
        try:
            await sess.write_file("kept.txt", "still here")
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(sess.exec("sleep 1; echo late", timeout_s=5), 0.2)
            after = await sess.exec("cat kept.txt", timeout_s=5)
            return after, await sess.read_file("kept.txt")
        finally:
            await sess.close()

    after, data = run(with_sandbox(body))
    assert after.stdout == "still here" and data == b"still here"
