"""DockerSandbox against a real Docker daemon: the same promises as the local backend, and sessions.

Marked `docker`: skipped where no daemon answers. Images are built locally from a tarball of empty
directories (nothing is pulled); the host's /usr and interpreter are bind-mounted read-only.
"""

from __future__ import annotations

import asyncio
import os
import uuid

import pytest

pytestmark = pytest.mark.docker

SECRET = f"agentrl-docker-secret-{uuid.uuid4().hex}"
os.environ["AGENTRL_FAKE_DOCKER_SECRET"] = SECRET


def _daemon_answers() -> bool:
    try:
        import docker

        docker.from_env(timeout=5).ping()
        return True
    except Exception:
        return False


if not _daemon_answers():
    pytest.skip("no Docker daemon answers here (start dockerd)", allow_module_level=True)

from agentrl.sandboxes.docker import DockerSandbox  # noqa: E402


def run(coro):
    return asyncio.run(coro)


async def with_docker(fn, **kwargs):
    sandbox = DockerSandbox(**{"pool_size": 1, "memory_mb": 256, **kwargs})
    try:
        return await fn(sandbox)
    finally:
        await sandbox.close()


def _labelled_containers() -> list:
    import docker

    return docker.from_env().containers.list(all=True, filters={"label": f"agentrl.owner_pid={os.getpid()}"})


def test_docker_runs_code_with_stdin_files_and_exit_codes():
    async def body(sb):
        return await asyncio.gather(
            sb.exec(code="import sys; print(sys.stdin.read().upper())", stdin="hi", timeout_s=20),
            sb.exec("cat in/x.txt; id -u; exit 4", files={"in/x.txt": "payload\n"}, timeout_s=20),
        )

    py, sh = run(with_docker(body))
    assert py.stdout == "HI\n" and py.exit_code == 0
    assert sh.stdout.splitlines() == ["payload", "1000"] and sh.exit_code == 4


def test_docker_blocks_network_hides_host_files_and_environment():
    code = (
        "import os, socket\n"
        "try:\n    socket.create_connection(('169.254.169.254', 80), timeout=3); print('CONNECTED')\n"
        "except OSError as e: print('net', e.errno)\n"
        f"print('secret' if {SECRET!r} in str(os.environ) else 'no secret')\n"
        "for p in ('/root/.bashrc', '/etc/shadow', '/home', '/work'):\n"
        "    print(p, os.path.exists(p))\n"
        "try:\n    open('/usr/x', 'w')\nexcept OSError as e: print('usr', e.errno)\n"
    )
    res = run(with_docker(lambda sb: sb.exec(code=code, timeout_s=20)))
    assert res.stdout.splitlines() == ["net 101", "no secret", "/root/.bashrc False", "/etc/shadow False",
                                       "/home False", "/work False", "usr 30"]


def test_docker_kills_runaway_memory_and_output():
    async def body(sb):
        spin = await sb.exec(code="while True: pass", timeout_s=1.5)
        flood = await sb.exec("yes", timeout_s=20)
        bomb = await sb.exec(code="x = []\nwhile True: x.append(bytearray(16 << 20))", timeout_s=30)
        after = await sb.exec("ls -A /workspace /tmp; ps -eo user= | sort | uniq -c", timeout_s=20)
        return spin, flood, bomb, after

    spin, flood, bomb, after = run(with_docker(body, max_output_bytes=50_000))
    assert spin.killed_reason == "timeout" and 1.5 <= spin.duration_s <= 1.5 * 1.5
    assert flood.killed_reason == "output" and len(flood.stdout) <= 50_000
    assert bomb.killed_reason == "memory"
    assert "sandbox" in after.stdout  # only the listing's own processes run as the job's user
    assert "yes" not in after.stdout


def test_docker_session_keeps_files_and_close_removes_the_container():
    async def body(sb):
        sess = await sb.session()
        await sess.write_file("notes/a.txt", "kept")
        ran = await sess.exec("cat notes/a.txt && echo more >> notes/a.txt", timeout_s=20)
        back = await sess.read_file("notes/a.txt")
        with pytest.raises(FileNotFoundError):
            await sess.read_file("missing.txt")
        with pytest.raises(ValueError):
            await sess.read_file("../etc/passwd")
        cid = sess.container_id
        await sess.close()
        return ran, back, cid

    ran, back, cid = run(with_docker(body))
    assert ran.stdout == "kept" and back == b"keptmore\n"
    assert all(c.id != cid for c in _labelled_containers())
    assert _labelled_containers() == []  # the pool was removed by close() too
