"""`swe`: fix a bug in a real repository inside a sandbox, rewarded by hidden tests (SWE-bench style).

Reset opens a session on the run's sandbox (`sandbox=`, the one object built from the config's
`sandbox` section; built alone, the env makes and owns a `LocalSandbox`). An instance that names a
Docker `image` gets a session in that image, run as it is, with the repository where the image
keeps it (`image_repo_dir`, /testbed for SWE-bench, SWE-Gym, SWE-smith and R2E-Gym images) as the
work dir: `sandbox.session(image=..., workdir=...)`, which the `docker` backend (and a remote one
backed by it) takes. Otherwise the repository is copied into the session's work dir. Then the
instance's start-up runs: its `setup_cmd`, its `start_patch` (SWE-smith's bug), its hidden test
files are removed, and the state is committed with git when git is there (so the final diff is
the agent's alone). Every shell command of the episode runs after the instance's `env_setup` (e.g.
activating SWE-bench's conda env). The agent explores and edits with `bash`,
`str_replace_editor` and `submit`; a turn without a tool call is answered with a reminder.

On `submit`, when one of this env's budgets is spent (turns, approximate tokens of the
conversation, wall-clock seconds since reset), or when the AgentLoop's own budget ends the episode
first (`atruncate`), the hidden tests run in the same session on the repository as the agent left
it (`agentrl.envs.swe_grading`), under a deadline of their own (`test_timeout_s`, plus two minutes
for copying files in and reading the diff): the reward is 1.0 when every FAIL_TO_PASS and
PASS_TO_PASS test passes, else 0.0; with `partial_credit` the fraction of FAIL_TO_PASS tests that
pass, as long as no PASS_TO_PASS test broke. The final step's `info["swe"]` holds every test's
status and the agent's diff (`model_patch`); the class names it in `recorded_info`, so it reaches
`trajectory.info["swe"]` and trajectory files, and `agentrl eval` turns the diffs into a SWE-bench
`predictions.jsonl` (`swe_predictions`). `info["metrics"]["resolved"]` feeds the resolved rate.

Infrastructure failures (the session died, the sandbox stopped answering or was killed while the
tests ran, the image is missing, grading ran past its deadline, the test command could not start)
raise `SandboxError` (`GradingError`, with its cause, from grading) instead of scoring 0: the
AgentLoop records the episode as fault "infra" and the trainer masks it. The session is closed when the episode ends, whatever happened. Instances come
from the shipped task set (`agentrl.envs.swe_tasks.shipped_tasks`), from `tasks=` (a file in any
supported format), or from dataset rows.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import shlex
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from agentrl.envs.patches import apply_patch, parse_patch
from agentrl.envs.swe_grading import grade, pristine_test_files
from agentrl.envs.swe_tasks import SweTask, load_tasks, row_task, shipped_tasks, tasks_rows
from agentrl.envs.tool_env import ToolEnv
from agentrl.errors import ConfigError, SandboxError
from agentrl.sandboxes.protocol import SandboxSession
from agentrl.tools.bash import BashTool
from agentrl.tools.core import ToolContext, tool
from agentrl.tools.editor import EditorTool
from agentrl.types import Action, ExecResult, Message, ToolCall, Trajectory

__all__ = ["SYSTEM_PROMPT", "SweEnv", "approx_tokens", "reference_fix_actions", "submit_changes", "swe_predictions"]

SYSTEM_PROMPT = (
    "You are a software engineer fixing an issue in a Python repository. The repository is your "
    "working directory. Use the `bash` tool to explore and run code, and `str_replace_editor` to view "
    "and edit files. Make the smallest change to the source that resolves the issue; do not edit the "
    "tests, hidden tests will check your fix. When you are done, call `submit`."
)

# The repository snapshot arrives as a tar on stdin: tar if the sandbox has it, else Python.
_EXTRACT = (
    "if command -v tar >/dev/null 2>&1; then exec tar -xf - --no-same-owner; fi\n"
    "py=$(command -v python3 || command -v python) || { echo 'neither tar nor python here' >&2; exit 127; }\n"
    "exec \"$py\" -c 'import io, sys, tarfile\n"
    "t = tarfile.open(fileobj=io.BytesIO(sys.stdin.buffer.read()))\n"
    "t.extractall(\".\")'"
)
# Commit the starting state (a repository of its own when the work dir is not one) and print its tree.
_SNAPSHOT = (
    "command -v git >/dev/null 2>&1 || exit 0\n"
    "g='git -c user.name=agentrl -c user.email=agentrl@localhost -c core.fileMode=false'\n"
    "if [ \"$(git rev-parse --show-toplevel 2>/dev/null)\" != \"$(pwd -P)\" ]; then git init -q . || exit 1; fi\n"
    "$g add -A >/dev/null 2>&1 || exit 1\n"
    "if ! git rev-parse -q --verify HEAD >/dev/null 2>&1 || ! git diff --cached --quiet HEAD; then\n"
    "  $g commit -q --no-verify -m \"agentrl: the task's starting state\" || exit 1\n"
    "fi\n"
    "git rev-parse HEAD^{tree}"
)
_MAX_DIFF_CHARS = 20_000
_GRADING_MARGIN_S = 120.0


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


def swe_predictions(groups: Iterable[Sequence[Trajectory]], model: str) -> list[dict[str, str]]:
    """Predictions in the SWE-bench harness format (`instance_id`, `model_name_or_path`, `model_patch`).

    One per instance, from its first graded episode that did not fail for infrastructure reasons
    (the diff in `trajectory.info["swe"]`); an instance with no such episode is left out, which the
    harness counts as unresolved. `agentrl eval` writes them to `predictions.jsonl`.
    """
    out: dict[str, dict[str, str]] = {}
    for group in groups:
        for t in group:
            verdict = t.info.get("swe")
            if not t.trainable or not isinstance(verdict, dict) or not verdict.get("instance_id"):
                continue
            iid = str(verdict["instance_id"])
            if iid not in out:
                out[iid] = {"instance_id": iid, "model_name_or_path": model,
                            "model_patch": str(verdict.get("model_patch") or "")}
            break
    return list(out.values())


class _SetupShell:
    """A session whose shell commands first run the instance's `env_setup` (e.g. activating its conda env)."""

    def __init__(self, session: SandboxSession, setup: str) -> None:
        self.session = session
        self.setup = setup

    async def exec(self, command: str | None = None, *, code: str | None = None, timeout_s: float,
                   stdin: str | bytes | None = None, files: Mapping[str, str | bytes] | None = None) -> ExecResult:
        if command is not None:
            command = f"{self.setup}\n{command}"
        return await self.session.exec(command, code=code, timeout_s=timeout_s, stdin=stdin, files=files)

    async def read_file(self, path: str) -> bytes:
        return await self.session.read_file(path)

    async def write_file(self, path: str, data: str | bytes) -> None:
        await self.session.write_file(path, data)

    async def close(self) -> None:
        await self.session.close()

    async def is_alive(self) -> bool:
        return await self.session.is_alive()

    def __getattr__(self, name: str) -> Any:  # container_id, workdir... of the backend's session
        return getattr(self.session, name)


async def apply_patch_in_session(session: Any, patch: str) -> None:
    """Apply a unified diff to the files of `session`'s work dir (host-side: no `patch` or git needed)."""
    for fp in parse_patch(patch):
        old = None
        if fp.old_path is not None:
            old = (await session.read_file(fp.old_path)).decode("utf-8", errors="surrogateescape")
        new = apply_patch(old, fp)
        if fp.old_path is not None and (new is None or fp.old_path != fp.path):
            await session.exec(f"rm -f -- {shlex.quote(fp.old_path)}", timeout_s=30)
        if new is not None:
            await session.write_file(fp.path, new.encode("utf-8", errors="surrogateescape"))


class SweEnv(ToolEnv):
    """A repository, an issue and hidden tests in a sandbox (see the module docstring).

    Args:
        tasks: Instances for `reset` without a row (any supported file format); default the shipped set.
        sandbox: The sandbox to open sessions on: the run's, built from the config's `sandbox` section
            and closed by the run. None: the env makes a `LocalSandbox` of its own and closes it.
        max_turns: Assistant turns before the episode is graded as it stands.
        max_tokens: Approximate tokens (`count_tokens`) of assistant turns and tool output before grading.
        max_wall_s: Seconds since reset before grading.
        partial_credit: Reward the fraction of FAIL_TO_PASS tests that pass (0 if a PASS_TO_PASS broke).
        test_timeout_s: Deadline of the hidden-test run; grading as a whole gets two minutes more.
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
    recorded_info = ("swe",)
    """The verdict (`info["swe"]`: per-test statuses, counts, note, instance id, the agent's diff as
    `model_patch`) reaches `trajectory.info["swe"]`, so trajectory files keep it."""
    no_tool_call_message = (
        "You did not call a tool. Keep working with `bash` and `str_replace_editor`, "
        "and call `submit` when the issue is fixed."
    )

    def __init__(
        self,
        *,
        tasks: str | None = None,
        sandbox: Any = None,
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
        if isinstance(sandbox, str):
            raise ConfigError(
                f"SweEnv takes the run's sandbox object, not a backend name ({sandbox!r}): set the config's "
                f"`sandbox.name={sandbox}` (and `sandbox.kwargs`), not `env.kwargs.sandbox`."
            )
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
        self._own_sandbox: Any = None
        self.max_tokens = max_tokens
        self.max_wall_s = max_wall_s
        self.partial_credit = partial_credit
        self.test_timeout_s = test_timeout_s
        self.per_test_timeout_s = per_test_timeout_s
        self.count_tokens = count_tokens or approx_tokens
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
    def _backend(self) -> Any:
        if self.sandbox is not None:
            return self.sandbox
        if self._own_sandbox is None:
            from agentrl.sandboxes.local import LocalSandbox

            self._own_sandbox = LocalSandbox()
        return self._own_sandbox

    async def _open_session(self, task: SweTask) -> Any:
        backend = self._backend()
        if not task.image:
            return await backend.session()
        if "image" not in inspect.signature(backend.session).parameters:
            raise ConfigError(
                f"Instance {task.instance_id} runs in the Docker image {task.image!r}, but the "
                f"{type(backend).__name__} sandbox cannot run images: run with sandbox=docker (sandbox.name)."
            )
        return await backend.session(image=task.image, workdir=task.image_repo_dir)

    async def create_context(self, episode_id: str, row: dict[str, Any]) -> ToolContext:
        task = row_task(row)
        raw = await self._open_session(task)
        session = _SetupShell(raw, task.env_setup) if task.env_setup else raw
        try:
            await self._populate(session, task)
            await self._start_state(session, task)
            pristine = await pristine_test_files(session, task)
            for path in task.hidden_files:
                await session.exec(f"rm -f -- {shlex.quote(path)}", timeout_s=30)
            base = await self._run(session, _SNAPSHOT, task, "git could not snapshot the repository", 300)
        except BaseException:
            await session.close()
            raise
        self._started, self._tokens = time.monotonic(), 0
        return ToolContext(episode_id=episode_id, sandbox=session,
                           state={"swe_task": task, "swe_pristine": pristine, "swe_base": base.strip()})

    async def _run(self, session: SandboxSession, command: str, task: SweTask, what: str, timeout_s: float,
                   stdin: bytes | None = None) -> str:
        res = await session.exec(command, stdin=stdin, timeout_s=timeout_s)
        if not res.ok:
            detail = (res.stderr or res.stdout or res.killed_reason or f"exit code {res.exit_code}").strip()[-500:]
            raise SandboxError(f"{what} for {task.instance_id}: {detail}")
        return res.stdout

    async def _populate(self, session: Any, task: SweTask) -> None:
        archive = await asyncio.to_thread(task.repo_archive)
        if archive is not None:
            await self._run(session, _EXTRACT, task, "Could not copy the repository into the sandbox", 120, archive)
        elif task.image_repo_dir:  # the image's repository: in place when it is the work dir, else copied
            repo = shlex.quote(task.image_repo_dir)
            await self._run(session, f'[ "$(pwd -P)" = "$(cd {repo} && pwd -P)" ] || cp -a {repo}/. .', task,
                            "Could not copy the repository into the work dir", 300)

    async def _start_state(self, session: Any, task: SweTask) -> None:
        if task.setup_cmd:
            await self._run(session, task.setup_cmd, task, "The instance's setup_cmd failed", 300)
        if task.start_patch:
            try:
                await apply_patch_in_session(session, task.start_patch)
            except (OSError, ValueError) as exc:  # PatchError is a ValueError too: the image is not the one expected
                raise SandboxError(f"The start_patch of {task.instance_id} does not apply to its image: {exc}") from exc

    async def apply_patch(self, patch: str) -> None:
        """Apply a unified diff to the open episode's repository, as an agent's edits would (`--check` does)."""
        if self._ctx is None:
            raise ConfigError("SweEnv.apply_patch needs an open episode: call reset first.")
        await apply_patch_in_session(self._ctx.sandbox, patch)

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

    @property
    def grading_timeout_s(self) -> float:
        """The deadline of grading as a whole: the test run's plus a margin for copying files and the diff."""
        return self.test_timeout_s + _GRADING_MARGIN_S

    async def ascore(self, final_text: str, row: dict[str, Any], ctx: ToolContext) -> float:
        task: SweTask = ctx.state["swe_task"]
        try:
            async with asyncio.timeout(self.grading_timeout_s):
                return await self._grade(task, ctx)
        except TimeoutError:
            raise SandboxError(
                f"Grading {task.instance_id} did not finish within {self.grading_timeout_s:g} s; the episode is not "
                "scored. Raise test_timeout_s if its tests are slow."
            ) from None

    async def _grade(self, task: SweTask, ctx: ToolContext) -> float:
        session = ctx.sandbox
        if session is None:
            raise SandboxError(f"{task.instance_id}: the episode has no sandbox session to grade in (it was released).")
        diff = ""
        base = ctx.state.get("swe_base") or "HEAD"
        try:
            res = await session.exec(
                "command -v git >/dev/null 2>&1 || exit 0; git -c core.fileMode=false add -A >/dev/null 2>&1; "
                f"git diff --cached --no-color {shlex.quote(base)} 2>/dev/null", timeout_s=60)
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
        own, self._own_sandbox = self._own_sandbox, None
        if own is not None:
            await own.close()
