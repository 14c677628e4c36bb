"""`agentrl sandbox serve` in a real subprocess on loopback, driven by `RemoteSandbox` and raw HTTP."""

from __future__ import annotations

import asyncio
import base64
import socket
import subprocess
import sys
import time

import httpx
import pytest

from agentrl.errors import SandboxClosedError, SandboxError
from agentrl.sandboxes.bwrap import find_bwrap
from agentrl.sandboxes.remote import RemoteSandbox

pytestmark = pytest.mark.skipif(
    find_bwrap() is None, reason="bubblewrap is not installed (apt-get install bubblewrap)"
)
TOKEN = "test-token-123"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_url():
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c",
         f"from agentrl.sandboxes.server import serve; serve('127.0.0.1', {port}, {TOKEN!r}, 2, pool_size=2)"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.1)
    else:
        proc.kill()
        pytest.fail(f"sandbox server did not start: {proc.stderr.read().decode()[-2000:]}")
    yield url
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()


def run(coro):
    return asyncio.run(coro)


async def with_remote(url, fn, **kwargs):
    remote = RemoteSandbox(url, **{"token": TOKEN, **kwargs})
    try:
        return await fn(remote)
    finally:
        await remote.close()


def test_remote_exec_runs_in_the_server_sandbox(server_url):
    async def body(remote):
        code = await remote.exec(code="import sys; print(sys.stdin.read().upper())", stdin="hi", timeout_s=10)
        shell = await remote.exec("cat data/in.txt; id -u", files={"data/in.txt": b"payload\n"}, timeout_s=10)
        slow = await remote.exec("sleep 5", timeout_s=0.5)
        many = await asyncio.gather(*(remote.exec(code=f"print({i})", timeout_s=10) for i in range(8)))
        return code, shell, slow, many

    code, shell, slow, many = run(with_remote(server_url, body))
    assert code.stdout == "HI\n" and code.exit_code == 0
    assert shell.stdout.splitlines()[0] == "payload"
    assert slow.killed_reason == "timeout" and slow.timed_out and slow.exit_code is None
    assert [r.stdout for r in many] == [f"{i}\n" for i in range(8)]  # more than max_concurrency: they wait


def test_remote_session_keeps_files_and_closes(server_url):
    async def body(remote):
        sess = await remote.session()
        await sess.write_file("notes/a.txt", "remote file")
        ran = await sess.exec("cat notes/a.txt; echo more >> notes/a.txt", timeout_s=10)
        back = await sess.read_file("notes/a.txt")
        errors = []
        for path in ("missing.txt", "../etc/passwd"):
            try:
                await sess.read_file(path)
            except (FileNotFoundError, ValueError) as exc:
                errors.append(type(exc).__name__)
        alive = await sess.is_alive()
        await sess.close()
        try:
            await sess.exec("true", timeout_s=5)
            errors.append("ran after close")
        except SandboxClosedError:
            errors.append("closed")
        return ran, back, errors, alive, await sess.is_alive()

    ran, back, errors, alive, alive_after = run(with_remote(server_url, body))
    assert ran.stdout == "remote file"
    assert back == b"remote filemore\n"
    assert errors == ["FileNotFoundError", "ValueError", "closed"]
    assert alive is True and alive_after is False


def test_server_requires_the_token(server_url):
    assert httpx.post(f"{server_url}/v1/exec", json={"code": "print(1)"}).status_code == 401
    wrong = httpx.post(f"{server_url}/v1/exec", json={"code": "print(1)"}, headers={"Authorization": "Bearer no"})
    assert wrong.status_code == 401
    assert httpx.get(f"{server_url}/health").json()["status"] == "ok"

    async def body(remote):
        try:
            await remote.exec(code="print(1)", timeout_s=5)
        except SandboxError as exc:
            return str(exc)
        return "ran"

    assert "rejected the token" in run(with_remote(server_url, body, token="wrong"))


def test_run_code_speaks_sandboxfusion(server_url):
    headers = {"Authorization": f"Bearer {TOKEN}"}
    ok = httpx.post(f"{server_url}/run_code", headers=headers, timeout=30, json={
        "code": "print(open('x.txt').read()); open('out.txt', 'w').write('made')", "language": "python",
        "files": {"x.txt": base64.b64encode(b"from file").decode()}, "fetch_files": ["out.txt"],
    }).json()
    assert ok["status"] == "Success"
    assert ok["run_result"]["status"] == "Finished" and ok["run_result"]["return_code"] == 0
    assert ok["run_result"]["stdout"] == "from file\n"
    assert base64.b64decode(ok["files"]["out.txt"]) == b"made"
    tle = httpx.post(f"{server_url}/run_code", headers=headers, timeout=30,
                     json={"code": "import time; time.sleep(9)", "language": "python", "run_timeout": 0.5}).json()
    assert tle["status"] == "Failed" and tle["run_result"]["status"] == "TimeLimitExceeded"
    other = httpx.post(f"{server_url}/run_code", headers=headers, timeout=30,
                       json={"code": "int main(){}", "language": "cpp"}).json()
    assert other["status"] == "SandboxError"

    async def body(remote):
        return (await remote.exec(code="print(2+2)", timeout_s=10),
                await remote.exec("exit 3", timeout_s=10),
                await remote.exec(code="while True: pass", timeout_s=0.5))

    four, three, spin = run(with_remote(server_url, body, api="sandboxfusion"))
    assert four.stdout == "4\n" and four.ok
    assert three.exit_code == 3 and not three.ok
    assert spin.killed_reason == "timeout"


def test_metrics_count_jobs(server_url):
    httpx.post(f"{server_url}/v1/exec", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30,
               json={"code": "print(1)"})
    text = httpx.get(f"{server_url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text
    ok_line = next(line for line in text.splitlines() if line.startswith('agentrl_sandbox_jobs_total{outcome="ok"}'))
    assert int(ok_line.split()[-1]) >= 1
    assert "agentrl_sandbox_sessions_open" in text


def test_unreachable_server_is_an_infrastructure_error():
    async def body(remote):
        try:
            await remote.exec(code="print(1)", timeout_s=1)
        except SandboxError as exc:
            return type(exc).__name__, await remote.is_alive()
        return "ran", True

    name, alive = run(with_remote(f"http://127.0.0.1:{_free_port()}", body))
    assert name == "SandboxUnavailableError" and alive is False
