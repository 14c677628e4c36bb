"""`ToolEnv`: the base of environments whose agent calls tools until it gives a final answer.

A subclass says three things: how a dataset row becomes the first messages (`initial_messages`),
which tools the agent may call (`tools`), and how the final answer is scored (`score`). ToolEnv
does the rest natively in async: per-episode tool lifecycle (create on reset, release when the
episode ends or the env closes, always), running the calls of one turn concurrently with a deadline
each, turning unknown tools, bad arguments and malformed calls into tool messages the model can
learn from, and counting them by fault class in `info["metrics"]`. Each call the model attempted is
typed (`agentrl.types.CallOutcome`): the parser's outcome, where the env decides `unknown_tool` and
`bad_arguments` (the tool's schema refusing the arguments, checked before anything runs); the turn's
outcomes are `info["call_outcomes"]` and their counts `info["metrics"]["tools/parse/<status>"]`. A failed
call never ends the episode and never sets its reward. A call that fails for
infrastructure reasons (no sandbox, a sandbox process that died, the tool deadline) ends the
episode with `ToolInfrastructureError`, which the AgentLoop records as `fault="infra"`: such an
episode is masked and requeued, never scored. Tools run in `sandbox`, the run's sandbox (built
once from `config.sandbox` and passed to the constructor; the env never closes it); an env built
without one lets each episode make its own (`agentrl.tools.session`).

An episode terminates when the assistant answers without calling a tool (or a tool sets
`ctx.state["done"]`), and is truncated after `max_turns` assistant turns (reward 0). Subclasses
whose episodes are judged by work done rather than by a final answer (SWE) may instead answer a
turn without tool calls with a reminder (`end_without_tool_call = False`), add budgets of their own
(`budget_exceeded`), score truncated episodes too (`score_truncated = True`) and score
asynchronously while the episode's tools and sandbox are still alive (`ascore`). When a budget of
the AgentLoop ends an episode first, `atruncate` ends it the same way (scored when
`score_truncated`, with `info["truncated_by"]` naming the budget). It does not tokenise anything
or sample from a model; the AgentLoop does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import Sequence
from typing import Any, ClassVar

import gymnasium

from agentrl.envs.core import Env
from agentrl.errors import EnvError, ToolArgumentError, ToolInfrastructureError
from agentrl.tools.core import Tool, ToolContext
from agentrl.tools.session import release_episode_resources
from agentrl.types import (
    PARSE_STATUSES,
    Action,
    CallOutcome,
    Message,
    ParseStatus,
    ToolCall,
    ToolResult,
    ToolSchema,
)

__all__ = ["ToolEnv"]

_log = logging.getLogger(__name__)


class ToolEnv(Env):
    """Base class for tool-using environments (see the module docstring)."""

    end_without_tool_call: ClassVar[bool] = True
    """A turn that calls no tool ends the episode as the final answer; False answers it with
    `no_tool_call_message` instead, and the episode goes on."""
    no_tool_call_message: ClassVar[str] = (
        "You did not call a tool. Use the tools to work on the task, and call `submit` when you are done."
    )
    score_truncated: ClassVar[bool] = False
    """Score episodes cut by a budget too (reward 0 when False)."""

    def __init__(
        self,
        tools: Sequence[Tool] = (),
        *,
        max_turns: int = 8,
        tool_timeout_s: float = 30.0,
        sandbox: Any | None = None,
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        names = [t.tool_name for t in tools]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"Two tools share the name(s) {dupes}; tool names must be unique.")
        self.tools: dict[str, Tool] = {t.tool_name: t for t in tools}
        self.max_turns = max_turns
        self.tool_timeout_s = tool_timeout_s
        self.sandbox = sandbox
        self._ctx: ToolContext | None = None
        self._row: dict[str, Any] | None = None
        self._turn = 0
        self._done = False
        self._metrics: dict[str, float] = {}

    # ── what subclasses provide ─────────────────────────────────────────────────────────────
    def generate_row(self, seed: int | None) -> dict[str, Any]:
        """A task row for `reset` without `options["row"]`; by default a row is required."""
        raise EnvError(
            f"{type(self).__name__}.reset needs a dataset row: call reset(options={{'row': row}})."
        )

    def initial_messages(self, row: dict[str, Any]) -> list[Message]:
        """The first messages of the episode; by default the row's verl-style `prompt`."""
        prompt = row.get("prompt")
        if isinstance(prompt, str):
            return [{"role": "user", "content": prompt}]
        if isinstance(prompt, list) and prompt:
            return [dict(m) for m in prompt]  # type: ignore[misc]  # a plain copy of each TypedDict message
        raise EnvError(
            f"Dataset row has no usable 'prompt' (got {type(prompt).__name__}); "
            "a row needs 'prompt' as a list of chat messages or a string."
        )

    def prompt_tools(self) -> list[ToolSchema]:
        """The tool schemas rendered into the prompt (`info["tools"]` of `reset`); by default every tool's."""
        return [t.schema for t in self.tools.values()]

    def first_prompt(self, row: dict[str, Any]) -> tuple[list[Message], list[ToolSchema]]:
        return self.initial_messages(row), self.prompt_tools()

    def score(self, final_text: str, row: dict[str, Any], ctx: ToolContext) -> float:
        """The reward of an episode that ended with `final_text` as the answer."""
        raise NotImplementedError(f"{type(self).__name__} must implement score().")

    async def ascore(self, final_text: str, row: dict[str, Any], ctx: ToolContext) -> float:
        """Async scoring, awaited while the episode's tools and context are alive; default `score`.

        Details for the step's info go in `ctx.state["score_info"]` (its "metrics" are merged
        into `info["metrics"]`, which the AgentLoop copies into the trajectory). Raising ends the episode
        (cleaned up as always) and the error reaches the caller: raise an `AgentRLError` for an
        infrastructure failure, which the AgentLoop records as fault "infra" (masked, not scored 0).
        """
        return float(self.score(final_text, row, ctx))

    def budget_exceeded(self, action: Action, messages: list[Message]) -> str | None:
        """After a turn's tool calls: why the episode's budget is spent (it is truncated), or None."""
        return None

    async def create_context(self, episode_id: str, row: dict[str, Any]) -> ToolContext:
        """The per-episode tool context: the env's sandbox (the run's); override to attach a session."""
        return ToolContext(episode_id=episode_id, sandbox=self.sandbox)

    async def release_context(self, ctx: ToolContext) -> None:
        """Free what `create_context` made (after every tool's `release`)."""

    # ── the contract ────────────────────────────────────────────────────────────────────────
    async def areset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        gymnasium.Env.reset(self, seed=seed)  # seeds self.np_random the standard way
        gen_seed = seed
        await self._end_episode()
        options = options or {}
        row = options.get("row")
        if row is None:
            if gen_seed is None:
                gen_seed = int(self.np_random.integers(0, 2**31 - 1))
            row = self.generate_row(gen_seed)
        if not isinstance(row, dict):
            raise EnvError(f"options['row'] must be a dict (a dataset row), got {type(row).__name__}.")
        messages = self.initial_messages(row)
        episode_id = str(options.get("episode_id") or uuid.uuid4().hex)
        ctx = await self.create_context(episode_id, row)
        created: list[Tool] = []
        try:
            for t in self.tools.values():
                await t.create(ctx)
                created.append(t)
        except BaseException:
            for t in created:
                await _quietly(t.release(ctx))
            await _quietly(self.release_context(ctx))
            raise
        self._ctx, self._row, self._turn, self._done = ctx, row, 0, False
        self._metrics = {"tool_calls": 0, "tool_errors_model": 0, "tool_errors_infra": 0, "parse_errors": 0,
                         **{f"tools/parse/{status}": 0 for status in PARSE_STATUSES}}
        info = {"tools": self.prompt_tools(), "episode_id": episode_id}
        return messages, info

    async def astep(self, action: Action) -> tuple[list[Message], float, bool, bool, dict[str, Any]]:
        if self._done:
            raise EnvError(f"{type(self).__name__}.step was called after the episode ended; call reset.")
        if self._ctx is None or self._row is None:
            raise EnvError(f"{type(self).__name__}.step was called before reset; call reset first.")
        if not isinstance(action, Action):
            raise EnvError(
                f"step expects an agentrl.types.Action, got {type(action).__name__}; "
                "wrap model text as Action(text=...)."
            )
        self._turn += 1
        ctx, row = self._ctx, self._row
        messages: list[Message] = []
        for err in action.parse_errors:
            self._metrics["parse_errors"] += 1
            messages.append({"role": "tool", "content": f"Error: {err}"})
        calls = action.tool_calls
        # One call (the common case) is awaited in place: a task per call is only worth its cost
        # when there are several to overlap.
        ran = [await self._call(calls[0], ctx)] if len(calls) == 1 else (
            await asyncio.gather(*(self._call(c, ctx) for c in calls))
        )
        results = [r for r, _ in ran]
        for r in results:
            self._metrics["tool_calls"] += 1
            if r.fault:
                self._metrics[f"tool_errors_{r.fault}"] += 1
            messages.append(r.to_message())
        outcomes = _typed_outcomes(action, [status for _, status in ran])
        for outcome in outcomes:
            self._metrics[f"tools/parse/{outcome.status}"] += 1
        infra = [r for r in results if r.fault == "infra"]
        if infra:
            # The tool could not run (no sandbox, a dead sandbox process, a deadline passed): what
            # the model would see next is not its doing, so the episode ends here and the AgentLoop
            # records it as an infrastructure failure (masked, never scored).
            await self._end_episode()
            self._done = True
            raise ToolInfrastructureError(
                f"tool '{infra[0].tool_name or '?'}' failed for infrastructure reasons: {infra[0].content}"
            )

        reward = 0.0
        called = bool(action.tool_calls or action.parse_errors)
        if not called and not self.end_without_tool_call:
            messages.append({"role": "user", "content": self.no_tool_call_message})
        terminated = bool(ctx.state.get("done")) or (not called and self.end_without_tool_call)
        why: str | None = None
        if not terminated:
            why = "max_turns" if self._turn >= self.max_turns else self.budget_exceeded(action, messages)
        truncated = why is not None
        info: dict[str, Any] = {"metrics": dict(self._metrics), "turn": self._turn, "call_outcomes": outcomes}
        if truncated:
            info["truncated_by"] = why
        if terminated or truncated:
            try:
                if terminated or self.score_truncated:
                    reward = float(await self.ascore(action.text, row, ctx))
                    extra = dict(ctx.state.get("score_info") or {})
                    info["metrics"].update(extra.pop("metrics", {}))
                    info.update(extra)
            finally:
                await self._end_episode()
                self._done = True
        return messages, reward, terminated, truncated, info

    async def atruncate(self, reason: str) -> tuple[float, dict[str, Any]]:
        """End an episode the AgentLoop's budget cut short: scored like an env truncation (see `Env`)."""
        ctx, row = self._ctx, self._row
        if ctx is None or row is None or self._done:
            return 0.0, {}
        info: dict[str, Any] = {"metrics": dict(self._metrics), "turn": self._turn, "truncated_by": reason}
        reward = 0.0
        try:
            if self.score_truncated:
                reward = float(await self.ascore("", row, ctx))
                extra = dict(ctx.state.get("score_info") or {})
                info["metrics"].update(extra.pop("metrics", {}))
                info.update(extra)
        finally:
            await self._end_episode()
            self._done = True
        return reward, info

    async def aclose(self) -> None:
        await self._end_episode()

    # ── internals ───────────────────────────────────────────────────────────────────────────
    async def _call(self, call: ToolCall, ctx: ToolContext) -> tuple[ToolResult, ParseStatus]:
        """Run one parsed call; its result and its outcome's status (`unknown_tool` and `bad_arguments`, the
        tool's schema refusing the arguments, are decided here, before anything runs)."""
        t = self.tools.get(call.name)
        if t is None:
            available = ", ".join(sorted(self.tools)) or "none"
            return ToolResult(
                f"Error: there is no tool named '{call.name}'. Available tools: {available}.",
                fault="model", tool_name=call.name, tool_call_id=call.id,
            ), "unknown_tool"
        try:
            t.validate_arguments(call.arguments)
        except (ToolArgumentError, ValueError, TypeError) as exc:  # what `invoke` would answer as the model's fault
            return ToolResult(f"Error: {exc}", fault="model", tool_name=call.name, tool_call_id=call.id), "bad_arguments"
        except Exception:  # not a verdict on the arguments: `invoke` meets it again and answers it as always
            _log.debug("validating the arguments of %s failed; invoke reports it", call.name, exc_info=True)
        return await t.invoke(call.arguments, ctx, tool_call_id=call.id, timeout_s=self.tool_timeout_s), "ok"

    async def _end_episode(self) -> None:
        ctx, self._ctx = self._ctx, None
        if ctx is None:
            return
        for t in self.tools.values():
            await _quietly(t.release(ctx))
        await _quietly(self.release_context(ctx))
        await _quietly(release_episode_resources(ctx))


def _typed_outcomes(action: Action, statuses: list[ParseStatus]) -> tuple[CallOutcome, ...]:
    """The turn's outcomes with the statuses the tools gave its parsed calls (`statuses`, in the order of
    `action.tool_calls`, which is the order of the `ok` outcomes)."""
    given = iter(statuses)
    return tuple(dataclasses.replace(o, status=next(given, "ok")) if o.ok else o for o in action.call_outcomes())


async def _quietly(coro: Any) -> None:
    """Await a cleanup step; its failure is logged, never allowed to stop the other cleanups."""
    try:
        await coro
    except Exception:  # cleanup must go on for the remaining resources
        _log.exception("cleanup step failed")
