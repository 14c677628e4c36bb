"""The SWE env on the `docker` backend, against a real daemon: tasks, per-instance images, faults.

Marked `docker`: skipped where no daemon answers. Nothing is pulled: the per-instance image is
built here, FROM the sandbox's base image (itself imported from a tarball), with the repository
at /testbed as SWE-bench images have it.
"""

from __future__ import annotations

import asyncio
import io
import os
import tarfile
import uuid

import pytest

from agentrl.envs.swe import SweEnv, reference_fix_actions
from agentrl.envs.swe_tasks import SweTask, shipped_tasks, task_row
from agentrl.errors import SandboxError
from agentrl.types import Action, ToolCall

pytestmark = pytest.mark.docker

SUBMIT = Action("done", (ToolCall("submit", {"summary": "done"}, id="c1"),))
TASKS = {t.instance_id: t for t in shipped_tasks()}
SAMPLE = ["casing__acronyms", "envconf__bool-case", "notes__shared-default-tags", "respath__parent-above-root"]


def _daemon() -> object:
    try:
        import docker

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
    env = SweEnv(sandbox="docker", sandbox_kwargs={"pool_size": 0})

    async def body():  # type: ignore[no-untyped-def]
        try:
            fixed = [await _play(env, TASKS[i], reference_fix_actions(TASKS[i])) for i in SAMPLE]
            idle = await _play(env, TASKS[SAMPLE[0]], [SUBMIT])
        finally:
            await env.aclose()
        return fixed, idle

    fixed, (idle, idle_info) = asyncio.run(body())
    assert [(r, info["swe"]["instance_id"]) for r, info in fixed] == [(1.0, i) for i in SAMPLE]
    assert idle == 0.0 and idle_info["swe"]["fail_to_pass_passed"] == 0
    assert _our_containers(client) == []


def _build_instance_image(client, tag: str, files: dict[str, str]) -> None:  # type: ignore[no-untyped-def]
    from agentrl.sandboxes.docker import IMAGE, DockerSandbox

    DockerSandbox().ensure_base_image()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, text in {"Dockerfile": f"FROM {IMAGE}\nCOPY testbed /testbed\n",
                           **{f"testbed/{k}": v for k, v in files.items()}}.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    buf.seek(0)
    client.images.build(fileobj=buf, custom_context=True, tag=tag, rm=True, network_mode="none")


def test_an_instance_runs_in_its_own_image_with_the_repository_inside() -> None:
    client = _daemon()
    base = TASKS["pager__page-count-remainder"]
    tag = f"agentrl-swe-test:{uuid.uuid4().hex[:8]}"
    _build_instance_image(client, tag, base.repo_files or {})
    try:
        instance = {**base.to_dict(), "instance_id": "pager__in-image", "image": tag, "image_repo_dir": "/testbed"}
        del instance["repo_files"]
        task = SweTask.from_dict(instance)
        env = SweEnv(sandbox="docker", sandbox_kwargs={"pool_size": 0})

        async def body():  # type: ignore[no-untyped-def]
            try:
                return await _play(env, task, reference_fix_actions(task)), await _play(env, task, [SUBMIT])
            finally:
                await env.aclose()

        (fixed, info), (idle, _) = asyncio.run(body())
        assert (fixed, idle) == (1.0, 0.0), info["swe"]
        assert "return -(-total // per_page)" in info["swe"]["model_patch"]
        assert _our_containers(client) == []
    finally:
        client.images.remove(tag, force=True)

    missing = SweTask.from_dict({**instance, "image": "agentrl-swe-test:absent"})
    env = SweEnv(sandbox="docker", sandbox_kwargs={"pool_size": 0})
    with pytest.raises(SandboxError, match="pulls nothing: build it locally"):
        env.reset(options={"row": task_row(missing)})
    env.close()


def test_a_removed_container_is_an_infrastructure_failure() -> None:
    client = _daemon()
    env = SweEnv(sandbox="docker", sandbox_kwargs={"pool_size": 0})
    task = TASKS[SAMPLE[0]]

    async def body():  # type: ignore[no-untyped-def]
        try:
            await env.areset(options={"row": task_row(task)})
            client.containers.get(env._ctx.sandbox.container_id).remove(force=True)
            with pytest.raises(SandboxError, match="died before grading"):
                await env.astep(SUBMIT)
            return env._ctx
        finally:
            await env.aclose()

    assert asyncio.run(body()) is None
    assert _our_containers(client) == []

