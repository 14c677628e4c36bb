"""One adversarial test per promise in `agentrl.sandboxes.local`'s docstring, against real bubblewrap.

Each test plays the hostile model: it runs code that tries to break a promise and asserts on the
values that show the promise held. "Egress" tests only *attempt* connections from inside the
sandbox's empty network namespace, where they fail at once; nothing leaves this machine.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from agentrl.sandboxes.bwrap import find_bwrap
from agentrl.sandboxes.local import LocalSandbox

pytestmark = pytest.mark.skipif(
    find_bwrap() is None, reason="bubblewrap is not installed (apt-get install bubblewrap)"
)

# Planted before any sandbox starts: a host secret that must never be visible inside one.
SECRET = f"agentrl-fake-secret-{uuid.uuid4().hex}"
os.environ["AGENTRL_FAKE_SECRET"] = SECRET


def run(coro):
    return asyncio.run(coro)


async def with_sandbox(fn, **kwargs):
    sandbox = LocalSandbox(**{"max_concurrency": 2, **kwargs})
    try:
        return await fn(sandbox)
    finally:
        await sandbox.close()


def host_processes_with(marker: str) -> list[int]:
    """Host PIDs whose command line contains `marker`."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmdline:
            found.append(int(name))
    return found


# ── network ──────────────────────────────────────────────────────────────────────────────────
EGRESS = """
import socket, time
for host, port in [("169.254.169.254", 80), ("1.1.1.1", 53), ("8.8.8.8", 443), ("10.0.0.1", 22)]:
    t = time.monotonic()
    try:
        socket.create_connection((host, port), timeout=3).close()
        print(host, "CONNECTED")
    except OSError as exc:
        print(host, type(exc).__name__, exc.errno, round(time.monotonic() - t, 2))
print("interfaces", sorted(l.split(":")[0].strip() for l in open("/proc/net/dev").readlines()[2:]))
"""


def test_network_egress_and_metadata_address_are_unreachable():
    res = run(with_sandbox(lambda sb: sb.exec(code=EGRESS, timeout_s=20)))
    lines = res.stdout.splitlines()
    assert res.exit_code == 0, res
    assert "CONNECTED" not in res.stdout
    for line in lines[:4]:
        _host, kind, errno, seconds = line.split()
        assert kind == "OSError" and errno == "101", line  # ENETUNREACH: no route at all
        assert float(seconds) < 0.5, line  # fails at once, never waits for a timeout
    assert lines[4] == "interfaces ['lo']"


def test_loopback_still_works_inside_the_sandbox():
    code = (
        "import socket\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
        "c = socket.create_connection(s.getsockname()); a, _ = s.accept()\n"
        "c.sendall(b'ping'); print(a.recv(4).decode())\n"
    )
    res = run(with_sandbox(lambda sb: sb.exec(code=code, timeout_s=10)))
    assert res.stdout == "ping\n", res


# ── the host's files ────────────────────────────────────────────────────────────────────────
def test_writing_outside_the_work_dir_is_denied():
    marker = uuid.uuid4().hex
    targets = [f"/etc/{marker}", f"/usr/{marker}", f"/usr/local/bin/{marker}", f"/{marker}",
               f"/root/{marker}", f"/proc/{marker}", f"{tempfile.gettempdir()}/../{marker}"]
    code = f"""
for path in {targets!r}:
    try:
        open(path, "w").write("pwned")
        print(path, "WRITTEN")
    except OSError as exc:
        print(path, type(exc).__name__)
open("inside.txt", "w").write("ok"); print("inside ok")
"""
    res = run(with_sandbox(lambda sb: sb.exec(code=code, timeout_s=10)))
    assert "WRITTEN" not in res.stdout, res.stdout
    assert res.stdout.count("Error") == len(targets), res.stdout
    assert res.stdout.endswith("inside ok\n")
    for path in targets:
        assert not os.path.exists(path)


def test_host_private_files_and_work_dirs_are_invisible():
    host_dir = tempfile.mkdtemp(prefix="agentrl-host-secret-")
    secret_file = Path(host_dir, "secret.txt")
    secret_file.write_text(SECRET)
    root_file = Path("/root", f".agentrl-secret-{uuid.uuid4().hex}")
    paths = [str(secret_file), str(Path(__file__).resolve()), "/etc/shadow", "/proc/1/environ"]
    try:
        if os.access("/root", os.W_OK):
            root_file.write_text(SECRET)
            paths.append(str(root_file))
        code = f"""
import os
for path in {paths!r}:
    try:
        data = open(path, "rb").read()
        print(path, "READ", {SECRET!r}.encode() in data)
    except OSError as exc:
        print(path, type(exc).__name__)
print("root lists", sorted(os.listdir("/root")) if os.path.isdir("/root") else None)
"""
        res = run(with_sandbox(lambda sb: sb.exec(code=code, timeout_s=10)))
    finally:
        secret_file.unlink()
        os.rmdir(host_dir)
        root_file.unlink(missing_ok=True)
    assert SECRET not in res.stdout
    for line in res.stdout.splitlines()[: len(paths)]:
        if not line.startswith("/proc/1/"):  # the sandbox's own init: exists, not readable
            assert line.endswith("FileNotFoundError"), line  # not even there, let alone readable
    assert "READ True" not in res.stdout
    assert res.stdout.splitlines()[-1] == "root lists ['.pyenv']" or root_file.name not in res.stdout.splitlines()[-1]


def test_host_environment_secrets_are_absent():
    code = (
        "import os\n"
        "print(sorted(os.environ))\n"
        "print(open('/proc/self/environ','rb').read().count(b'SECRET'))\n"
        "print(open('/proc/1/environ','rb').read().count(b'SECRET') if os.access('/proc/1/environ', os.R_OK) else 0)\n"
    )
    res = run(with_sandbox(lambda sb: sb.exec(code=code, timeout_s=10)))
    shell = run(with_sandbox(lambda sb: sb.exec("env; echo $AGENTRL_FAKE_SECRET", timeout_s=10)))
    assert SECRET not in res.stdout + shell.stdout
    assert "AGENTRL_FAKE_SECRET" not in res.stdout + shell.stdout
    assert res.stdout.splitlines()[1:] == ["0", "0"]
    assert set(eval(res.stdout.splitlines()[0])) <= {
        "HOME", "LANG", "LC_ALL", "LC_CTYPE", "LOGNAME", "PATH", "PWD", "PYTHONDONTWRITEBYTECODE",
        "TMPDIR", "USER",
    }


def test_jobs_run_unprivileged_and_cannot_touch_the_fork_server():
    code = (
        "import os, signal\n"
        "status = dict(l.split(':', 1) for l in open('/proc/self/status'))\n"
        "print(os.getuid(), status['CapEff'].strip(), status['NoNewPrivs'].strip())\n"
        "try:\n    os.kill(os.getppid(), signal.SIGKILL); print('KILLED SERVER')\n"
        "except PermissionError: print('kill denied')\n"
    )

    async def body(sb):
        first = await sb.exec(code=code, timeout_s=10)
        second = await sb.exec(code="print('still serving')", timeout_s=10)
        return first, second

    first, second = run(with_sandbox(body, max_concurrency=1, pool_size=1))
    uid, cap_eff, no_new_privs = first.stdout.splitlines()[0].split()
    if os.geteuid() == 0:
        assert int(uid) >= 100_000
        assert first.stdout.splitlines()[1] == "kill denied"
    assert cap_eff == "0000000000000000"
    assert no_new_privs == "1"
    assert second.stdout == "still serving\n"


# ── resource limits ─────────────────────────────────────────────────────────────────────────
FORK_BOMB = """
import os, time
made = 0
for _ in range(2000):
    try:
        if os.fork() == 0:
            time.sleep(60); os._exit(0)
        made += 1
    except OSError:
        break
print(made, flush=True)
while True:
    try: os.fork()
    except OSError: pass
"""


def test_fork_bomb_is_contained_and_the_host_stays_responsive():
    async def body(sb):
        bomb = asyncio.ensure_future(sb.exec(code=FORK_BOMB, timeout_s=4))
        await asyncio.sleep(1.0)
        t = time.monotonic()
        other = await sb.exec(code="print('alive')", timeout_s=10)
        other_s = time.monotonic() - t
        t = time.monotonic()
        subprocess.run(["true"], check=True)
        host_s = time.monotonic() - t
        return await bomb, other, other_s, host_s

    bomb, other, other_s, host_s = run(with_sandbox(body, max_processes=32))
    assert bomb.killed_reason == "timeout"
    assert 0 < int(bomb.stdout.split()[0]) < 32  # the process ceiling stopped it
    assert other.stdout == "alive\n" and other_s < 2.0
    assert host_s < 1.0
    bash_bomb = run(with_sandbox(lambda sb: sb.exec(":(){ :|:& };:; sleep 10", timeout_s=2)))
    assert bash_bomb.killed_reason == "timeout"


def test_memory_bomb_is_killed_with_reason_memory():
    grow = "x = []\nwhile True:\n    x.append(bytearray(16 << 20))\n"
    res = run(with_sandbox(lambda sb: sb.exec(code=grow, timeout_s=20), memory_mb=256))
    assert res.killed_reason == "memory", res
    assert res.duration_s < 10
    huge = run(with_sandbox(lambda sb: sb.exec(code="b = bytearray(64 << 30)", timeout_s=20), memory_mb=256))
    assert huge.killed_reason == "memory", huge
    assert "MemoryError" in huge.stderr


@pytest.mark.parametrize(
    ("command", "code"),
    [(None, "while True:\n    pass\n"), ("sleep 100", None), ("setsid sleep 100 & sleep 100", None)],
    ids=["cpu-spin", "sleep", "setsid-child"],
)
def test_runaway_jobs_are_killed_at_the_deadline(command, code):
    timeout = 1.5
    res = run(with_sandbox(lambda sb: sb.exec(command, code=code, timeout_s=timeout)))
    assert res.timed_out and res.killed_reason == "timeout"
    assert res.exit_code is None
    assert timeout <= res.duration_s <= timeout * 1.10, res.duration_s


def test_cpu_time_limit_is_reported_as_cpu():
    res = run(with_sandbox(lambda sb: sb.exec(code="while True: pass", timeout_s=10), cpu_time_s=1))
    assert res.killed_reason == "cpu", res
    assert res.duration_s < 3


def test_output_flood_is_capped_and_killed():
    cap = 100_000
    res = run(with_sandbox(lambda sb: sb.exec("yes flood", timeout_s=20), max_output_bytes=cap))
    assert res.killed_reason == "output"
    assert len(res.stdout.encode()) + len(res.stderr.encode()) <= cap
    assert res.stdout.startswith("flood\nflood\n")
    assert res.duration_s < 5


# ── sandboxes and jobs do not see each other ────────────────────────────────────────────────
def test_two_sandboxes_cannot_see_each_others_files_or_processes():
    marker = f"agentrl-marker-{uuid.uuid4().hex[:12]}"

    async def body(sb):
        a, b = await sb.session(), await sb.session()
        try:
            await a.write_file("secret.txt", SECRET)
            a_job = asyncio.ensure_future(a.exec(f"exec -a {marker} sleep 3", timeout_s=10))
            await asyncio.sleep(0.5)
            assert host_processes_with(marker), "the first sandbox's process should be running"
            seen = await b.exec(
                # (counting by name: a pattern in our own command line would match ourselves)
                "ls -a /workspace; cat /proc/[0-9]*/comm 2>/dev/null | grep -c '^sleep$'; "
                f"grep -rl {SECRET} /workspace /tmp /dev/shm 2>/dev/null | wc -l; "
                "ls /proc | grep -c '^[0-9]'",
                timeout_s=20,
            )
            a_res = await a_job
            return seen, a_res, await a.read_file("secret.txt")
        finally:
            await a.close()
            await b.close()

    seen, a_res, a_file = run(with_sandbox(body))
    lines = seen.stdout.split()
    assert lines[:2] == [".", ".."]  # b's work dir is empty
    assert lines[2:4] == ["0", "0"]  # neither a's process nor a's file is visible
    assert int(lines[4]) <= 8  # only b's own handful of processes exist in its PID namespace
    assert a_res.exit_code == 0 and a_file == SECRET.encode()


def test_pooled_sandbox_is_wiped_between_jobs():
    marker = f"agentrl-daemon-{uuid.uuid4().hex[:12]}"
    plant = (
        "echo x > /workspace/left.txt; echo x > /tmp/left.txt; echo x > /dev/shm/left.txt; "
        f"(setsid nohup bash -c 'exec -a {marker} sleep 1000' >/dev/null 2>&1 &); echo planted"
    )
    look = "ls -A /workspace /tmp /dev/shm; cat /proc/[0-9]*/comm 2>/dev/null | grep -c '^sleep$'"

    async def body(sb):
        first = await sb.exec(plant, timeout_s=10)
        second = await sb.exec(look, timeout_s=10)
        return first, second, host_processes_with(marker)

    first, second, leftovers = run(with_sandbox(body, max_concurrency=1, pool_size=1))
    assert first.stdout == "planted\n"
    assert "left.txt" not in second.stdout
    assert second.stdout.split()[-1] == "0"
    assert leftovers == []


def test_close_leaves_no_process_and_no_files():
    marker = f"agentrl-close-{uuid.uuid4().hex[:12]}"
    before_tmp = set(os.listdir(tempfile.gettempdir()))

    async def body(sb):
        sess = await sb.session()
        await sess.write_file("data/file.txt", "x" * 1000)
        worker = sess._worker
        host_pid = worker.proc.pid  # the outer bwrap; its child is the sandbox's init
        init_pid = Path(f"/proc/{host_pid}/task/{host_pid}/children").read_text().split()[0]
        cgroup_dirs = [d for d, _ in worker.cgroup.dirs.values()] if worker.cgroup else []
        job = asyncio.ensure_future(sess.exec(f"(exec -a {marker} sleep 1000) & exec -a {marker} sleep 1000",
                                              timeout_s=60))
        await asyncio.sleep(0.5)
        running = host_processes_with(marker)
        assert Path(f"/proc/{init_pid}/root/workspace/data/file.txt").exists()
        await sess.close()
        res = await job
        return host_pid, cgroup_dirs, running, res, await sess.is_alive()

    host_pid, cgroup_dirs, running, res, alive = run(with_sandbox(body))
    assert len(running) == 2
    assert res.exit_code is None and res.killed_reason is not None
    assert alive is False
    time.sleep(0.1)
    assert host_processes_with(marker) == []
    assert not os.path.exists(f"/proc/{host_pid}")
    assert all(not os.path.exists(d) for d in cgroup_dirs)
    new_tmp = set(os.listdir(tempfile.gettempdir())) - before_tmp
    assert not [p for p in new_tmp if p.startswith("agentrl-")]  # no host-side work dirs either


def test_session_file_access_is_confined_to_the_work_dir():
    async def body(sb):
        sess = await sb.session()
        try:
            await sess.exec("ln -s /etc/passwd link; ln -s / rootlink", timeout_s=10)
            outcomes = []
            for path in ("../etc/passwd", "/etc/passwd", "link", "rootlink/etc/hosts", "a/../../x"):
                try:
                    await sess.read_file(path)
                    outcomes.append("read")
                except (ValueError, PermissionError) as exc:
                    outcomes.append(type(exc).__name__)
            try:
                await sess.write_file("rootlink/tmp/escape.txt", "x")
                outcomes.append("written")
            except PermissionError:
                outcomes.append("PermissionError")
            return outcomes
        finally:
            await sess.close()

    assert run(with_sandbox(body)) == ["ValueError", "ValueError", "PermissionError", "PermissionError",
                                       "ValueError", "PermissionError"]


MEMORY_SCAN = """
h1, h2 = {h1!r}.encode(), {h2!r}.encode()
hits = 0
for line in open("/proc/self/maps"):
    parts = line.split()
    lo, hi = (int(x, 16) for x in parts[0].split("-"))
    if "r" not in parts[1] or (len(parts) > 5 and parts[5] in ("[vvar]", "[vsyscall]")):
        continue
    try:
        with open("/proc/self/mem", "rb") as mem:
            mem.seek(lo)
            data = mem.read(hi - lo)
    except OSError:
        continue
    i = data.find(h1)
    while i != -1:  # the two halves are only ever adjacent in the earlier job's data
        hits += data[i + len(h1): i + len(h1) + len(h2)] == h2
        i = data.find(h1, i + 1)
print("scanned", hits)
"""


@pytest.mark.parametrize("output_bytes", [100, 300_000])
def test_a_pooled_job_cannot_read_an_earlier_jobs_data_from_memory(output_bytes):
    h1, h2 = f"LEAK{uuid.uuid4().hex[:10]}", f"{uuid.uuid4().hex[:10]}END"
    secret = h1 + h2
    earlier = f"s = {secret!r}\nprint((s + ' ') * ({output_bytes} // {len(secret) + 1} + 1))"

    async def body(sb):
        first = await sb.exec(code=earlier, stdin=secret, files={"f.txt": secret}, timeout_s=10)
        later = await sb.exec(code=MEMORY_SCAN.format(h1=h1, h2=h2), timeout_s=30)
        return first, later

    first, later = run(with_sandbox(body, max_concurrency=1, pool_size=1))
    assert secret in first.stdout
    assert later.stdout.strip() == "scanned 0", later

