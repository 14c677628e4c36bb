"""`agentrl swe check FILE`: replay each instance's reference fix and find the broken ones.

Every instance is played twice through the real `SweEnv` on the chosen sandbox: once with its
reference fix applied to the repository (host-side, so any diff applies, not only those a
`str_replace` can express) and then submitted, once submitted unchanged. An instance is **ok**
when the fix resolves it and the unchanged repository does not. Otherwise the report says why:

- `image missing`: its Docker image is not on the daemon (agentrl pulls nothing);
- `no reference fix`: the row has no `patch`;
- `fix does not apply`: the reference fix does not apply to the repository in the image;
- `fix does not resolve`: some FAIL_TO_PASS or PASS_TO_PASS test fails with the fix (listed);
- `resolved without a fix`: the FAIL_TO_PASS tests already pass (the instance tests nothing);
- `the test command could not start`: the instance's test command (or its env_setup) does not run
  in its image (`pytest: not found`, a missing conda env): the instance, not the fix, is broken;
- `the sandbox was killed during grading` / `the test run was killed during grading`: the container
  died, or the tests were SIGKILLed or hit the memory limit, before they reported;
- `infrastructure error`: the sandbox failed otherwise (the message says how).

Instances are checked `concurrency` at a time. `check_tasks` builds the sandbox backend by name and
returns one `CheckResult` per instance; the command prints them, optionally writes them as JSON,
and exits 1 when any instance is broken. The env (`agentrl.envs.swe`) is imported here and never
imports this module back.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from agentrl.envs.patches import PatchError
from agentrl.envs.swe import SweEnv
from agentrl.envs.swe_tasks import SweTask, task_row
from agentrl.errors import AgentRLError, GradingError, SandboxUnavailableError
from agentrl.types import Action, ToolCall

__all__ = ["CheckResult", "check_instances", "check_tasks"]

_SUBMIT = Action("Submitting.", (ToolCall("submit", {"summary": "check"}, id="check"),))


@dataclass
class CheckResult:
    """What the check found for one instance."""

    instance_id: str
    ok: bool
    problem: str = ""
    detail: str = ""
    fix_statuses: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0


async def _play(sandbox: Any, task: SweTask, patch: str | None, test_timeout_s: float) -> dict[str, Any]:
    env = SweEnv(sandbox=sandbox, test_timeout_s=test_timeout_s)
    try:
        await env.areset(options={"row": task_row(task)})
        if patch:
            await env.apply_patch(patch)
        _, _, _, _, info = await env.astep(_SUBMIT)
        return dict(info["swe"])
    finally:
        await env.aclose()


async def _check_one(sandbox: Any, task: SweTask, test_timeout_s: float) -> CheckResult:
    start = time.monotonic()
    result = CheckResult(task.instance_id, ok=False)
    try:
        has_image = getattr(sandbox, "has_image", None)
        if task.image and has_image is not None and not await asyncio.to_thread(has_image, task.image):
            result.problem, result.detail = "image missing", f"{task.image} is not on the Docker daemon"
        elif not task.patch:
            result.problem = "no reference fix"
        else:
            fixed = await _play(sandbox, task, task.patch, test_timeout_s)
            result.fix_statuses = fixed["statuses"]
            if not fixed["resolved"]:
                failing = sorted(t for t, s in fixed["statuses"].items() if s != "PASSED")
                result.problem = "fix does not resolve"
                result.detail = f"failing with the fix: {failing[:10]}" + (f"; {fixed['note']}" if fixed["note"] else "")
            else:
                unchanged = await _play(sandbox, task, None, test_timeout_s)
                if unchanged["fail_to_pass_passed"] == unchanged["fail_to_pass_total"] > 0:
                    result.problem = "resolved without a fix"
                    result.detail = "every FAIL_TO_PASS test passes on the unchanged repository"
                else:
                    result.ok = True
    except SandboxUnavailableError as exc:
        result.problem, result.detail = "image missing", str(exc)
    except PatchError as exc:
        result.problem, result.detail = "fix does not apply", str(exc)
    except GradingError as exc:
        result.problem, result.detail = exc.cause, str(exc)
    except (AgentRLError, OSError) as exc:
        result.problem, result.detail = "infrastructure error", f"{type(exc).__name__}: {exc}"
    result.seconds = time.monotonic() - start
    return result


async def check_instances(tasks: Sequence[SweTask], sandbox: Any, *, concurrency: int = 2,
                          test_timeout_s: float = 600.0) -> list[CheckResult]:
    """Check every instance on `sandbox` (see the module docstring), `concurrency` at a time."""
    gate = asyncio.Semaphore(max(1, concurrency))

    async def one(task: SweTask) -> CheckResult:
        async with gate:
            return await _check_one(sandbox, task, test_timeout_s)

    return list(await asyncio.gather(*(one(t) for t in tasks)))


def check_tasks(tasks: Sequence[SweTask], *, sandbox: str = "docker", concurrency: int = 2) -> list[CheckResult]:
    """Check every instance on a fresh `sandbox` backend (by registry name), closed at the end."""
    from agentrl.registry import SANDBOXES

    kwargs: dict[str, Any] = {"pool_size": 0} if sandbox == "docker" else {}
    backend = SANDBOXES.resolve(sandbox)(**kwargs)

    async def go() -> list[CheckResult]:
        try:
            return await check_instances(tasks, backend, concurrency=concurrency)
        finally:
            await backend.close()

    return asyncio.run(go())
