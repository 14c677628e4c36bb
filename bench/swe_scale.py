"""Benchmark of SWE episodes at scale on one machine: many Docker sandboxes at once, and nothing left behind.

    python bench/swe_scale.py                      # 64 concurrent episodes (a few minutes on 2 cores)
    python bench/swe_scale.py --episodes 16        # a quicker run
    python bench/swe_scale.py --no-kill-check      # skip the SIGKILL part

The instances are the three of tests/swe_images.py (their images are built on first use with
debootstrap: Python 3.13, Python 3.9, no Python), cycled over `--episodes` episodes that all run
at once through the real `SweEnv` on one `DockerSandbox` (warm pool of `--pool-size` containers
per image). Each episode is played by a scripted agent: it looks around with `bash`, applies the
reference fix with `str_replace_editor`, runs the repository's tests, submits, and is graded.

Reported: episodes per minute, the time an episode's reset takes (its session, pool hits
included, and the repository's start-up), container start latency p50/p99 (creation to running),
peak memory per container (cgroup `max_usage`), and the resolved count (every episode must resolve). Then it checks that nothing
is left behind: after the run, no container of this process, no process it started, no new file
in its temporary directory (a private TMPDIR, which its children inherit); and after a SIGKILL
of a process in the middle of its episodes, the same, once its watchdog has removed its
containers. It exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from swe_images import NAMESPACE, SPECS, published_row, tag_for_format  # noqa: E402

from agentrl.envs.swe import SweEnv, reference_fix_actions  # noqa: E402
from agentrl.envs.swe_tasks import SweTask, task_row  # noqa: E402
from agentrl.sandboxes.docker import DockerSandbox  # noqa: E402
from agentrl.types import Action, ToolCall  # noqa: E402


def _tasks() -> list[SweTask]:
    for spec in SPECS:
        tag_for_format(spec)
    return [SweTask.from_dict(published_row(spec), image_namespace=NAMESPACE) for spec in SPECS]


def _script(task: SweTask) -> list[Action]:
    look = Action("Let me look around.", (ToolCall("bash", {"command": "ls -R | head -50; git status --short"}, id="l"),))
    test = ToolCall("bash", {"command": "ls tests; (python3 -m pytest -q tests 2>/dev/null || sh tests/run.sh) | tail -3"},
                    id="t")
    fix = reference_fix_actions(task)
    return [look, *fix[:-1], Action("Checking.", (test,)), fix[-1]]


async def _episode(sandbox: DockerSandbox, task: SweTask, waits: list[float]) -> float:
    env = SweEnv(sandbox=sandbox, test_timeout_s=600, exec_timeout_s=120, tool_timeout_s=300)
    try:
        t0 = time.monotonic()
        await env.areset(options={"row": task_row(task)})
        waits.append(time.monotonic() - t0)
        for action in _script(task):
            _, reward, terminated, truncated, _ = await env.astep(action)
            if terminated or truncated:
                return float(reward)
        return 0.0
    finally:
        await env.aclose()


async def run_episodes(n: int, pool_size: int, memory_mb: int) -> dict[str, float]:
    tasks = _tasks()
    sandbox = DockerSandbox(pool_size=pool_size, memory_mb=memory_mb, max_starting=4)
    waits: list[float] = []
    try:
        for task in tasks:  # warm each image's pool first, as a run does while it loads its model
            await sandbox.start(image=task.image, workdir=task.image_repo_dir)
        warm_starts = len(sandbox.container_starts)
        t0 = time.monotonic()
        rewards = await asyncio.gather(*(_episode(sandbox, tasks[i % len(tasks)], waits) for i in range(n)))
        seconds = time.monotonic() - t0
    finally:
        await sandbox.close()
    starts = sorted(sandbox.container_starts)
    peaks = sorted(sandbox.peak_memory)
    return {
        "episodes": n, "seconds": seconds, "episodes_per_min": 60 * n / seconds, "resolved": sum(r == 1.0 for r in rewards),
        "containers": len(starts), "warm_containers": warm_starts,
        "start_p50_s": _pct(starts, 50), "start_p99_s": _pct(starts, 99),
        "session_wait_p50_s": _pct(sorted(waits), 50), "session_wait_p99_s": _pct(sorted(waits), 99),
        "memory_p50_mb": _pct(peaks, 50) / 2**20 if peaks else float("nan"),
        "memory_max_mb": peaks[-1] / 2**20 if peaks else float("nan"),
    }


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, max(0, round(q / 100 * len(values) + 0.5) - 1))]


# ── what is left behind ──────────────────────────────────────────────────────────────────────
def _containers_of(pid: int) -> list[str]:
    import docker

    return [c.id for c in docker.from_env().containers.list(all=True, filters={"label": f"agentrl.owner_pid={pid}"})]


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError), open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
                if fields[0] != "Z":
                    children.setdefault(int(fields[1]), []).append(int(name))
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def _private_tmp() -> str:
    """A temporary directory of this benchmark's own, which it and its children use as TMPDIR."""
    path = tempfile.mkdtemp(prefix="agentrl-swe-scale-")
    os.environ["TMPDIR"] = tempfile.tempdir = path
    return path


def _temp_entries() -> set[str]:
    return set(os.listdir(tempfile.gettempdir()))


def kill_check(episodes: int, pool_size: int) -> tuple[bool, str]:
    """SIGKILL a process in the middle of its episodes; its containers and processes must go."""
    before = _temp_entries()
    child = subprocess.Popen([sys.executable, __file__, "--child", "--episodes", str(episodes),
                              "--pool-size", str(pool_size)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while len(_containers_of(child.pid)) < min(episodes, 4) and time.monotonic() < deadline:
        time.sleep(0.5)
    running = len(_containers_of(child.pid))
    watchdogs = _descendants(child.pid)
    time.sleep(2.0)  # into the episodes
    child.send_signal(signal.SIGKILL)
    child.wait()
    deadline = time.monotonic() + 60
    while (_containers_of(child.pid) or any(os.path.exists(f"/proc/{p}") for p in watchdogs)) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = _containers_of(child.pid)
    alive = [p for p in watchdogs if os.path.exists(f"/proc/{p}")]
    new_tmp = _temp_entries() - before
    ok = running > 0 and not left and not alive and not new_tmp
    return ok, (f"killed a process with {running} containers: {len(left)} containers, {len(alive)} processes, "
                f"{len(new_tmp)} temporary entries left")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--pool-size", type=int, default=4, help="warm containers per image")
    parser.add_argument("--memory-mb", type=int, default=512, help="memory limit of one container")
    parser.add_argument("--no-kill-check", action="store_true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        asyncio.run(run_episodes(args.episodes, args.pool_size, args.memory_mb))
        return 0
    tmp = _private_tmp()
    tmp_before = _temp_entries()
    r = asyncio.run(run_episodes(args.episodes, args.pool_size, args.memory_mb))
    print(f"{r['episodes']} episodes at once on {os.cpu_count()} cores: {r['seconds']:.1f} s, "
          f"{r['episodes_per_min']:.1f} episodes/min, resolved {r['resolved']}/{r['episodes']}")
    print(f"containers: {r['containers']} started ({r['warm_containers']} warmed before the episodes); start latency "
          f"p50 {r['start_p50_s']:.2f} s, p99 {r['start_p99_s']:.2f} s; an episode's reset (session and start-up) took "
          f"p50 {r['session_wait_p50_s']:.2f} s, p99 {r['session_wait_p99_s']:.2f} s")
    print(f"peak memory per container: p50 {r['memory_p50_mb']:.1f} MiB, max {r['memory_max_mb']:.1f} MiB")
    time.sleep(1.0)
    left = _containers_of(os.getpid())
    procs = _descendants(os.getpid())
    new_tmp = _temp_entries() - tmp_before
    clean = not left and not procs and not new_tmp
    print(f"after the run: {len(left)} containers, {len(procs)} processes, {len(new_tmp)} temporary entries left"
          + ("" if clean else f" FAIL {left[:3]} {procs[:3]} {sorted(new_tmp)[:3]}"))
    ok = clean and r["resolved"] == args.episodes
    if not args.no_kill_check:
        killed_ok, line = kill_check(min(args.episodes, 16), args.pool_size)
        print(f"after a SIGKILL: {line}" + ("" if killed_ok else " FAIL"))
        ok = ok and killed_ok
    with contextlib.suppress(OSError):
        os.rmdir(tmp)  # empty, as checked
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
