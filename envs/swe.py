"""`swe`: fix a bug in a real repository inside a sandbox, rewarded by hidden tests (SWE-bench style).

Reset opens a sandbox session (the `local` bubblewrap backend by default, or `docker`, with the
instance's own image when it names one), copies the instance's repository into its work dir (and
makes it a git repository when git is there, so `git diff` works) and shows the agent the issue.
The agent explores and edits with `bash`, `str_replace_editor` and `submit`. A turn without a tool
call is answered with a reminder, not taken as the end. On `submit`, or when a budget is spent
(turns, approximate tokens of the conversation, wall-clock seconds since reset), the hidden tests
run in the same session (`agentrl.envs.swe_grading`): the reward is 1.0 when every FAIL_TO_PASS and
PASS_TO_PASS test passes, else 0.0; with `partial_credit` the fraction of FAIL_TO_PASS tests that
pass, as long as no PASS_TO_PASS test broke. The final step's `info["swe"]` holds every test's
status and the agent's diff; `info["metrics"]["resolved"]` feeds `agentrl eval`'s resolved rate.

Infrastructure failures (the session died, the sandbox stopped answering, the tests could not
run through no fault of the agent) raise `SandboxError` from `step` instead of scoring 0: the
AgentLoop records the episode as fault "infra" and the trainer masks it. The session is closed
when the episode ends, whatever happened. Instances come from the shipped task set
(`agentrl.envs.swe_tasks.shipped_tasks`), from `tasks=path.jsonl`, or from dataset rows.

The AgentLoop's own budgets (`rollout.max_turns`, `max_total_tokens`, `episode_timeout_s`, and a
turn cut by `max_tokens_per_turn`) end an episode without grading it; keep them above this env's
budgets so the env's budgets end episodes.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import Any

from agentrl.envs.patches import apply_patch, parse_patch
from agentrl.envs.swe_grading import grade, pristine_test_files
from agentrl.envs.swe_tasks import SweTask, load_tasks, row_task, shipped_tasks, tasks_rows
from agentrl.envs.tool_env import ToolEnv
from agentrl.errors import ConfigError, SandboxError
from agentrl.registry import SANDBOXES
from agentrl.tools.bash import BashTool
from agentrl.tools.core import ToolContext, tool
from agentrl.tools.editor import EditorTool
from agentrl.types import Action, Message, ToolCall

__all__ = ["SYSTEM_PROMPT", "SweEnv", "approx_tokens", "reference_fix_actions", "submit_changes"]

SYSTEM_PROMPT = (
    "You are a software engineer fixing an issue in a Python repository. The repository is your "
    "working directory. Use the `bash` tool to explore and run code, and `str_replace_editor` to view "
    "and edit files. Make the smallest change to the source that resolves the issue; do not edit the "
    "tests, hidden tests will check your fix. When you are done, call `submit`."
)

_EXTRACT = (
    "import io, sys, tarfile\n"
    "with tarfile.open(fileobj=io.BytesIO(sys.stdin.buffer.read())) as t:\n"
    "    t.extractall('.', filter='data')\n"
)
_GIT_INIT = (
    "command -v git >/dev/null || exit 0; git init -q . && git add -A && "
    "git -c user.name=agentrl -c user.email=agentrl@localhost commit -qm 'the repository as given' "
    "&& git config core.fileMode false"
)
_MAX_DIFF_CHARS = 20_000


def approx_tokens(text: str) -> int:
    """A tokenizer-free token estimate: one token per four characters (English and code average)."""
    return math.ceil(len(text) / 4)


@tool(name="submit")
def submit_changes(ctx: ToolContext, summary: str = "") -> str:
    """Submit your changes to the repository for grading and end the task. Call it once, when done.

    Args:
        summary: One or two sentences on what you changed and why.
    """
    ctx.state["answer"] = summary
    ctx.state["done"] = True
    return "Changes submitted; the hidden tests will now run."


def reference_fix_actions(task: SweTask) -> list[Action]:
    """The assistant turns of a scripted agent that applies `task.patch` with the tools, then submits.

    Each hunk becomes one `str_replace_editor` call (its old lines replaced by its new lines), a new
    file a `create`, a deleted file an `rm`. It checks an instance's reference fix end to end, through
    the same tools and sandbox an agent uses.
    """
    if not task.patch:
        raise ConfigError(f"Instance {task.instance_id} has no reference 'patch' to apply.")
    calls: list[ToolCall] = []
    for fp in parse_patch(task.patch):
        if fp.old_path is None:
            calls.append(ToolCall("str_replace_editor", {"command": "create", "path": fp.path,
                                                         "file_text": apply_patch(None, fp)}))
        elif fp.new_path is None:
            calls.append(ToolCall("bash", {"command": f"rm -f -- '{fp.old_path}'"}))
        else:
            calls += [ToolCall("str_replace_editor", {"command": "str_replace", "path": fp.path,
                                                      "old_str": "\n".join(h.old_lines),
                                                      "new_str": "\n".join(h.new_lines)}) for h in fp.hunks]
    turns = [Action(f"Applying edit {i + 1} of {len(calls)}.", (ToolCall(c.name, c.arguments, id=f"call_{i}"),))
             for i, c in enumerate(calls)]
    submit = ToolCall("submit", {"summary": "Applied the reference fix."}, id=f"call_{len(calls)}")
    return [*turns, Action("The fix is in place.", (submit,))]


class SweEnv(ToolEnv):
    """A repository, an issue and hidden tests in a sandbox (see the module docstring).

    Args:
        tasks: A JSONL file of instances for `reset` without a row; default the shipped set.
        sandbox: Backend name (`local`, `docker`) or `package.module:Class`.
        sandbox_kwargs: Arguments of the backend; an instance's `image` is passed to `docker` as `image`.
        max_turns: Assistant turns before the episode is graded as it stands.
        max_tokens: Approximate tokens (`count_tokens`) of assistant turns and tool output before grading.
        max_wall_s: Seconds since reset before grading.
        partial_credit: Reward the fraction of FAIL_TO_PASS tests that pass (0 if a PASS_TO_PASS broke).
        test_timeout_s: Deadline of the whole hidden-test run.
        per_test_timeout_s: Deadline of one test (agentrl's runner); past it the test fails.
        exec_timeout_s: Deadline of one `bash` command of the agent.
        tool_timeout_s: Deadline of one tool call, sandbox overhead included (an infra error past it).
        max_output_chars: Longest tool output shown to the agent.
        count_tokens: Token counter for `max_tokens`; default `approx_tokens`.
    """

    end_without_tool_call = False
    score_truncated = True
    reports_resolved = True
    """`agentrl eval` reports a resolved rate for this env (episodes it never graded count as unresolved)."""
    no_tool_call_message = (
        "You did not call a tool. Keep working with `bash` and `str_replace_editor`, "
        "and call `submit` when the issue is fixed."
    )

    def __init__(
        self,
        *,
        tasks: str | None = None,
        sandbox: Any | None = None,
        sandbox_kwargs: dict[str, Any] | None = None,
        max_turns: int = 30,
        max_tokens: int | None = None,
        max_wall_s: float | None = None,
        partial_credit: bool = False,
        test_timeout_s: float = 300.0,
        per_test_timeout_s: float = 20.0,
        exec_timeout_s: float = 30.0,
        tool_timeout_s: float = 60.0,
        max_output_chars: int = 8000,
        count_tokens: Callable[[str], int] | None = None,
    ) -> None:
        if exec_timeout_s >= tool_timeout_s:
            raise ValueError(
                f"exec_timeout_s ({exec_timeout_s:g}) must be below tool_timeout_s ({tool_timeout_s:g}), so a slow "
                "command is the agent's timeout, not an infrastructure one."
            )
        for name, value in (("max_tokens", max_tokens), ("max_wall_s", max_wall_s)):
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive (or None for no limit), got {value!r}.")
        tools = [BashTool(exec_timeout_s=exec_timeout_s, max_output_chars=max_output_chars),
                 EditorTool(max_output_chars=max_output_chars), submit_changes]
        super().__init__(tools, max_turns=max_turns, tool_timeout_s=tool_timeout_s, sandbox=sandbox)
        self.tasks_path = tasks
        self._tasks: tuple[SweTask, ...] | None = None
        self.sandbox_kwargs = dict(sandbox_kwargs or {})
        self.max_tokens = max_tokens
        self.max_wall_s = max_wall_s
        self.partial_credit = partial_credit
        self.test_timeout_s = test_timeout_s
        self.per_test_timeout_s = per_test_timeout_s
        self.count_tokens = count_tokens or approx_tokens
        self._owned: dict[str | None, Any] = {}
        self._started = 0.0
        self._tokens = 0

    # ── tasks ───────────────────────────────────────────────────────────────────────────────
    @classmethod
    def dataset_rows(cls, split: str) -> list[dict[str, Any]]:
        """The shipped tasks as verl rows. Both splits are the whole set: it is a verification set,
        not a held-out benchmark; give data.train_files / data.val_files for your own split."""
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        return tasks_rows(shipped_tasks())

    @property
    def tasks(self) -> tuple[SweTask, ...]:
        if self._tasks is None:
            self._tasks = tuple(load_tasks(self.tasks_path)) if self.tasks_path else shipped_tasks()
            if not self._tasks:
                raise ConfigError(f"The task file {self.tasks_path} holds no instance.")
        return self._tasks

    def generate_row(self, seed: int | None) -> dict[str, Any]:
        task = self.tasks[(seed or 0) % len(self.tasks)]
        return tasks_rows([task])[0]

    def initial_messages(self, row: dict[str, Any]) -> list[Message]:
        task = row_task(row)
        return [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": (
                f"Here is an issue filed against the repository in your working directory:\n\n<issue>\n"
                f"{task.problem_statement.strip()}\n</issue>\n\nFind the cause, fix it in the source, "
                "check your fix, then call `submit`.")},
        ]

    # ── sandbox session per episode ─────────────────────────────────────────────────────────
    def _backend(self, task: SweTask) -> Any:
        if self.sandbox is not None and not task.image:
            return self.sandbox  # the run's, closed by the run
        if task.image not in self._owned:
            kwargs = dict(self.sandbox_kwargs)
            if task.image:
                kwargs["image"] = task.image
            self._owned[task.image] = SANDBOXES.resolve("docker" if task.image else "local")(**kwargs)
        return self._owned[task.image]

    async def create_context(self, episode_id: str, row: dict[str, Any]) -> ToolContext:
        task = row_task(row)
        session = await self._backend(task).session()
        try:
            await self._populate(session, task)
            pristine = await pristine_test_files(session, task)
        except BaseException:
            await session.close()
            raise
        self._started, self._tokens = time.monotonic(), 0
        return ToolContext(episode_id=episode_id, sandbox=session,
                           state={"swe_task": task, "swe_pristine": pristine})

    async def _populate(self, session: Any, task: SweTask) -> None:
        archive = await asyncio.to_thread(task.repo_archive)
        if archive is not None:
            res = await session.exec(code=_EXTRACT, stdin=archive, timeout_s=120)
        else:
            res = await session.exec(f"cp -a {task.image_repo_dir}/. .", timeout_s=300)
        if not res.ok:
            raise SandboxError(f"Could not copy the repository of {task.instance_id} into the sandbox: "
                               f"{(res.stderr or res.killed_reason or '').strip()[-500:]}")
        res = await session.exec(_GIT_INIT, timeout_s=120)
        if not res.ok:
            raise SandboxError(f"git could not snapshot the repository of {task.instance_id}: {res.stderr.strip()[-500:]}")

    async def release_context(self, ctx: ToolContext) -> None:
        if ctx.sandbox is not None:
            await ctx.sandbox.close()

    # ── budgets and grading ─────────────────────────────────────────────────────────────────
    def budget_exceeded(self, action: Action, messages: list[Message]) -> str | None:
        self._tokens += self.count_tokens(action.text) + sum(self.count_tokens(m.get("content", "")) for m in messages)
        if self.max_tokens is not None and self._tokens >= self.max_tokens:
            return "max_tokens"
        if self.max_wall_s is not None and time.monotonic() - self._started >= self.max_wall_s:
            return "max_wall_s"
        return None

    async def ascore(self, final_text: str, row: dict[str, Any], ctx: ToolContext) -> float:
        task: SweTask = ctx.state["swe_task"]
        session = ctx.sandbox
        diff = ""
        try:
            res = await session.exec("git diff 2>/dev/null", timeout_s=60)
            diff = res.stdout[:_MAX_DIFF_CHARS] if res.ok else ""
        except SandboxError:
            pass  # grade() below finds the dead session and reports it as an infra failure
        verdict = await grade(session, task, ctx.state["swe_pristine"], partial_credit=self.partial_credit,
                              timeout_s=self.test_timeout_s, per_test_timeout_s=self.per_test_timeout_s)
        ctx.state["score_info"] = {
            "swe": {**verdict.info(), "instance_id": task.instance_id, "model_patch": diff},
            "metrics": {"resolved": float(verdict.resolved)},
        }
        return verdict.reward

    async def aclose(self) -> None:
        await super().aclose()
        owned, self._owned = self._owned, {}
        for backend in owned.values():
            await backend.close()
