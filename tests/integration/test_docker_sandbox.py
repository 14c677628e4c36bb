"""DockerSandbox against a real Docker daemon: each promise of its module docstring, on both kinds of image.

Marked `docker`: skipped where no daemon answers. Nothing is pulled: the host-userland image is
imported from a tarball of empty directories (the host's /usr and interpreter bind-mounted
read-only), and the image run as it is is a Debian trixie built with debootstrap
(tests/docker_images.py), with its own Python 3.13 and nothing of the host.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import uuid

import pytest
from docker_images import docker_sdk

pytestmark = pytest.mark.docker

SECRET = f"agentrl-docker-secret-{uuid.uuid4().hex}"
os.environ["AGENTRL_FAKE_DOCKER_SECRET"] = SECRET


def _daemon_answers() -> bool:
    docker = docker_sdk()  # skips the module where the SDK is not installed
    try:
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
    return docker_sdk().from_env().containers.list(all=True, filters={"label": f"agentrl.owner_pid={os.getpid()}"})


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


def test_a_session_closed_mid_job_ends_the_job_as_closed_not_as_a_fault():
    async def body(sb):
        sess = await sb.session()
        job = asyncio.ensure_future(sess.exec("echo started; sleep 60", timeout_s=90))
        await asyncio.sleep(2.0)
        await sess.close()
        return await asyncio.wait_for(job, 30)

    res = run(with_docker(body))
    # the caller's doing: a tool reports it as an infrastructure failure, never as the program's
    assert res.killed_reason == "closed" and res.exit_code is None and not res.timed_out
    assert res.duration_s < 30
    assert _labelled_containers() == []


# ── images run as they are ──────────────────────────────────────────────────────────────────
DEBIAN = "agentrl-swe-test/debian:trixie-py"


@pytest.fixture(scope="module")
def debian() -> str:
    import shutil

    from docker_images import debian_image, image_exists

    if not image_exists(DEBIAN) and shutil.which("debootstrap") is None:
        pytest.skip("building the Debian test image needs debootstrap")
    return debian_image(DEBIAN, suite="trixie", packages=["python3", "python3-pytest", "git"])


@pytest.mark.slow  # builds its images with debootstrap where none exist: minutes on a fresh machine
def test_an_image_runs_with_its_own_userland_and_none_of_the_hosts(debian):
    host_dir = os.path.dirname(os.path.realpath(__file__))
    code = (
        "import os, socket, sys\n"
        "print(sys.version_info[:2] >= (3, 13), sys.executable)\n"
        "try:\n    socket.create_connection(('169.254.169.254', 80), timeout=3); print('CONNECTED')\n"
        "except OSError as e: print('net', e.errno)\n"
        f"print('secret' if {SECRET!r} in str(os.environ) else 'no secret')\n"
        f"print([p for p in ({host_dir!r}, {sys.base_prefix!r}, '/work', '/root/.pyenv') if os.path.exists(p)])\n"
        "status = dict(l.split(':', 1) for l in open('/proc/self/status'))\n"
        "print(os.getuid(), status['CapEff'].strip(), status['NoNewPrivs'].strip())\n"
    )

    async def body(sb):
        one_shot = await sb.exec(code=code, timeout_s=30)
        sess = await sb.session()
        try:
            in_session = await sess.exec("python3 --version; pwd; touch /usr/local/made-here && echo writable", timeout_s=30)
        finally:
            await sess.close()
        return one_shot, in_session

    one_shot, in_session = run(with_docker(body, image=debian))
    assert one_shot.stdout.splitlines() == ["True /usr/bin/python3", "net 101", "no secret", "[]",
                                            "0 0000000000000000 1"], one_shot
    assert in_session.stdout.split() == ["Python", in_session.stdout.split()[1], "/workspace", "writable"]
    assert in_session.stdout.split()[1].startswith("3.13")
    assert _labelled_containers() == []


@pytest.mark.slow  # builds its images with debootstrap where none exist: minutes on a fresh machine
def test_a_job_cannot_stop_its_own_container(debian):
    async def body(sb):
        sess = await sb.session()
        try:
            attack = await sess.exec("kill -9 -1; kill -TERM 1; kill -9 1; pkill sleep; "
                                     "for p in /proc/[0-9]*; do kill -9 ${p#/proc/} 2>/dev/null; done; echo tried",
                                     timeout_s=20)
            after = await sess.exec("echo still here; ps -eo user=,comm= 2>/dev/null | sort | uniq -c | wc -l",
                                    timeout_s=20)
            return attack, after, await sess.is_alive()
        finally:
            await sess.close()

    attack, after, alive = run(with_docker(body, image=debian))
    assert alive and after.stdout.startswith("still here"), (attack, after)


@pytest.mark.slow  # builds its images with debootstrap where none exist: minutes on a fresh machine
def test_runaway_jobs_in_an_image_are_killed_with_their_reason(debian):
    async def body(sb):
        spin = await sb.exec("echo x > left.txt; echo y > /tmp/left; while :; do :; done", timeout_s=1.5)
        flood = await sb.exec("yes", timeout_s=20)
        bomb = await sb.exec(code="x = []\nwhile True: x.append(bytearray(16 << 20))", timeout_s=30)
        forks = await sb.exec(":(){ :|:& };:; sleep 5", timeout_s=3)
        clean = await sb.exec("ls -A /workspace /tmp; echo done", timeout_s=20)
        return spin, flood, bomb, forks, clean

    spin, flood, bomb, forks, clean = run(with_docker(body, image=debian, max_output_bytes=50_000, max_processes=64))
    assert spin.killed_reason == "timeout" and 1.5 <= spin.duration_s <= 1.5 * 1.5
    assert flood.killed_reason == "output" and len(flood.stdout) <= 50_000
    assert bomb.killed_reason == "memory"
    assert forks.killed_reason == "timeout"
    assert clean.stdout.split() == ["/tmp:", "/workspace:", "done"]  # the pooled container was wiped


@pytest.mark.slow  # builds its images with debootstrap where none exist: minutes on a fresh machine
def test_a_killed_owner_leaves_no_container_behind(debian, tmp_path):
    import signal
    import subprocess
    import sys
    import time

    docker = docker_sdk()
    script = tmp_path / "owner.py"
    script.write_text(
        "import asyncio, sys\n"
        "from agentrl.sandboxes.docker import DockerSandbox\n"
        "async def main():\n"
        f"    sb = DockerSandbox(image={debian!r}, pool_size=1)\n"
        "    sess = await sb.session()\n"
        "    print(sess.container_id, flush=True)\n"
        "    await asyncio.sleep(600)\n"
        "asyncio.run(main())\n"
    )
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    cid = owner.stdout.readline().strip()
    client = docker.from_env()
    label = f"agentrl.owner_pid={owner.pid}"
    time.sleep(1.0)  # let the pool's warm container start too
    assert len(client.containers.list(all=True, filters={"label": label})) >= 1
    watchdogs = [int(p) for p in os.listdir("/proc") if p.isdigit() and _is_child_of(int(p), owner.pid)]
    assert len(watchdogs) == 1  # the one process a sandbox starts
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    deadline = time.monotonic() + 30
    while client.containers.list(all=True, filters={"label": label}) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert client.containers.list(all=True, filters={"label": label}) == []
    with pytest.raises(docker.errors.NotFound):
        client.containers.get(cid)
    time.sleep(1.0)
    watchdogs = subprocess.run(["pgrep", "-f", "docker_reaper --owner"], capture_output=True, text=True).stdout.split()
    assert all(not _is_child_of(int(p), owner.pid) for p in watchdogs)


def _is_child_of(pid: int, parent: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1]) == parent
    except OSError:
        return False


@pytest.mark.slow  # builds its images with debootstrap where none exist: minutes on a fresh machine
def test_the_reaper_removes_containers_of_dead_owners_only(debian):
    import subprocess
    import sys

    from agentrl.sandboxes.docker_reaper import owner_labels, reap_orphans

    docker = docker_sdk()
    client = docker.from_env()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = {**owner_labels("dead-owner"), "agentrl.owner_pid": gone.stdout.strip()}
    alive = owner_labels("live-owner")
    made = [client.containers.create(debian, ["sleep", "1"], labels=labels) for labels in (dead, alive)]
    try:
        reap_orphans(client)
        left = {c.id for c in client.containers.list(all=True, filters={"label": "agentrl.sandbox=1"})}
        assert made[0].id not in left and made[1].id in left
    finally:
        for c in made:
            with contextlib.suppress(docker.errors.NotFound):
                c.remove(force=True)


@pytest.mark.slow  # builds its images with debootstrap where none exist: minutes on a fresh machine
def test_the_pool_follows_the_data_one_container_per_one_image_instance_and_a_cap_across_images(debian):
    """SWE data runs each instance in an image of its own: a warm pool refilled per image after its
    first session started about three containers per instance and kept two idle each until the end."""
    client = docker_sdk().from_env()
    images = [f"agentrl-pool-test/instance-{i}:latest" for i in range(4)]
    for name in images:
        client.images.get(debian).tag(name)

    async def one_session_per_image(sb):
        for image in images:
            sess = await sb.session(image=image)
            await sess.exec("true", timeout_s=30)
            await sess.close()
        await asyncio.sleep(1.0)  # a refill would have started by now
        return len(sb.container_starts), sb.idle_count()

    async def announced(sb):
        sb.expect(images[0], 3)
        sb.expect(images[1], 3)
        for _ in range(3):
            sess = await sb.session(image=images[0])
            await sess.close()
            await asyncio.sleep(0.5)
            assert sb.idle_count() <= sb.max_idle
        left_warm = sb.idle_count()
        await sb.session(image=images[1])
        await asyncio.sleep(1.0)
        return len(sb.container_starts), left_warm, sb.idle_count()

    try:
        starts, idle = run(with_docker(one_session_per_image, pool_size=2))
        assert (starts, idle) == (len(images), 0)  # nothing warmed for an image no session will use again
        starts, left_warm, idle = run(with_docker(announced, pool_size=2, max_idle=1))
        assert left_warm == 0  # the three announced sessions of image 0 were taken: none kept for it
        # image 0: 3 sessions from 3 starts; image 1: its session and one warm for the 2 still announced,
        # the second one left out by the cap across images (max_idle=1)
        assert (starts, idle) == (5, 1)
        assert _labelled_containers() == []
    finally:
        for name in images:
            client.images.remove(name, noprune=True)
