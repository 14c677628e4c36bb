"""The SWE env on the `docker` backend's host userland, against a real daemon: shipped tasks, faults.

Marked `docker`: skipped where no daemon answers. Instances in images of their own (another
Python, no Python) are in test_swe_images.py.
"""

from __future__ import annotations

import asyncio
import os

import pytest
from docker_images import docker_sdk

from agentrl.envs.swe import SweEnv, reference_fix_actions
from agentrl.envs.swe_tasks import SweTask, shipped_tasks, task_row
from agentrl.errors import SandboxError
from agentrl.sandboxes.docker import DockerSandbox
from agentrl.types import Action, ToolCall

pytestmark = pytest.mark.docker

SUBMIT = Action("done", (ToolCall("submit", {"summary": "done"}, id="c1"),))
TASKS = {t.instance_id: t for t in shipped_tasks()}
SAMPLE = ["casing__acronyms", "envconf__bool-case", "notes__shared-default-tags", "respath__parent-above-root"]


def _daemon() -> object:
    docker = docker_sdk()
    try:
        client = docker.from_env(timeout=10)
        client.ping()
        return client
    except Exception:
        pytest.skip("no Docker daemon answers here (start dockerd)")


def _our_containers(client) -> list:  # type: ignore[no-untyped-def]
    return client.containers.list(all=True, filters={"label": f"agentrl.owner_pid={os.getpid()}"})


async def _play(env: SweEnv, task: SweTask, actions: list[Action]) -> tuple[float, dict]:
    await env.areset(options={"row": task_row(task)})
    for action in actions:
        _, reward, terminated, truncated, info = await env.astep(action)
        if terminated or truncated:
            return float(reward), info
    raise AssertionError("the episode did not end")


def test_docker_sessions_grade_tasks_and_leave_no_container() -> None:
    client = _daemon()

    async def body():  # type: ignore[no-untyped-def]
        sandbox = DockerSandbox(pool_size=1)
        env = SweEnv(sandbox=sandbox)
        try:
            fixed = [await _play(env, TASKS[i], reference_fix_actions(TASKS[i])) for i in SAMPLE]
            idle = await _play(env, TASKS[SAMPLE[0]], [SUBMIT])
        finally:
            await env.aclose()
            await sandbox.close()
        return fixed, idle

    fixed, (idle, idle_info) = asyncio.run(body())
    assert [(r, info["swe"]["instance_id"]) for r, info in fixed] == [(1.0, i) for i in SAMPLE]
    assert idle == 0.0 and idle_info["swe"]["fail_to_pass_passed"] == 0
    assert _our_containers(client) == []


def test_a_removed_container_is_an_infrastructure_failure() -> None:
    client = _daemon()
    task = TASKS[SAMPLE[0]]

    async def body():  # type: ignore[no-untyped-def]
        sandbox = DockerSandbox(pool_size=0)
        env = SweEnv(sandbox=sandbox)
        try:
            await env.areset(options={"row": task_row(task)})
            client.containers.get(env._ctx.sandbox.container_id).remove(force=True)
            with pytest.raises(SandboxError, match="died before grading"):
                await env.astep(SUBMIT)
            return env._ctx
        finally:
            await env.aclose()
            await sandbox.close()

    assert asyncio.run(body()) is None
    assert _our_containers(client) == []



def test_a_container_killed_while_the_hidden_tests_run_is_an_infrastructure_failure() -> None:
    import dataclasses

    from agentrl.envs.swe_grading import SANDBOX_KILLED
    from agentrl.errors import GradingError

    client = _daemon()
    task = dataclasses.replace(TASKS[SAMPLE[0]], test_cmd="sleep 30; python -m pytest -rA -p no:cacheprovider {tests}")

    async def body():  # type: ignore[no-untyped-def]
        sandbox = DockerSandbox(pool_size=0)
        env = SweEnv(sandbox=sandbox)
        try:
            await env.areset(options={"row": task_row(task)})
            container = client.containers.get(env._ctx.sandbox.container_id)
            grading = asyncio.ensure_future(env.astep(SUBMIT))
            for _ in range(200):  # until the hidden tests are running
                await asyncio.sleep(0.1)
                if "sleep 30" in str(await asyncio.to_thread(container.top, ps_args="-ef")):
                    break
            await asyncio.to_thread(container.kill)  # as `docker kill` (or the OOM killer of the whole container)
            with pytest.raises(GradingError) as info:
                await grading
            return info.value, env._ctx
        finally:
            await env.aclose()
            await sandbox.close()

    err, ctx = asyncio.run(body())
    assert err.cause == SANDBOX_KILLED and task.instance_id in str(err)
    assert ctx is None and _our_containers(client) == []
