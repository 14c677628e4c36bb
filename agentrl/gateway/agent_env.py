"""`AgentEnv` (`env=agent`): a user's OpenAI-API agent, run on a dataset row through the gateway.

The agent is a Python callable or a command, given as `agent=` (`"my_pkg.agent:run"`,
`"path/to/agent.py:run"` or the function itself) or `command=` (`"python my_agent.py"`). For each
episode the env opens a gateway session and runs the agent once on the row:

- a callable gets an `AgentTask` (`base_url`, `api_key`, `model`, the row's `messages` and
  `prompt`, the `row`) and returns its final answer; `async def` agents run on the rollout's event
  loop, plain functions each in a thread of their own;
- a command starts with `OPENAI_BASE_URL` and `OPENAI_API_KEY` in its environment (plus
  `AGENTRL_MODEL`, and `AGENTRL_TASK_FILE`, a JSON file with the messages and the row), reads the
  prompt on stdin, and prints its final answer on stdout.

The sessions live on the gateway the env is given (`gateway`): in `agentrl run` and `agentrl eval`
the job's `SharedGateway`, one for all episodes, which the job closes; an env made without one
starts a gateway for each episode. Its calls become the episode's trajectory (or several segments, `session.py`), and its answer is
scored with the run's reward function (`reward_fn`: `reward.function`, verl's `compute_score(
data_source, solution_str, ground_truth, extra_info)`; by default `agentrl.envs.rewards.compute_score`,
which reads the answer in the format of the row's `data_source`). The episode has the loop's deadline (`rollout.episode_timeout_s`, or `timeout_s`
if shorter), and the loop's budgets apply to every call (`rollout.max_turns` calls, ...).

How an episode ends:

    agent returned an answer                 done (max_length if its last call was cut), scored
    agent failed after a refused call        max_turns / max_length, reward 0, trained on
    agent failed on a reply cut by length    max_length, reward 0, trained on
    agent crashed (exception, exit code)     error, fault "infra": masked, never scored 0
    deadline passed (the agent is killed)    timeout, fault "infra"
    agent never called the model             error, fault "infra" (usually a wrong base URL)
    the reward function raised               error, fault "infra"

All segments of an episode carry its reward, finish reason and fault; GRPO treats them as one
sample of their group (`agentrl.trainer.step`): the group's statistics use one reward per
episode, and each segment's sampled tokens get that episode's advantage (rLLM's and SkyRL's
step-wise "broadcast"). Without an agent, the env is a single-turn task: the model answers the
row's prompt directly (`reset`/`step`, played by the AgentLoop), which makes it pass `check_env`
and gives the no-scaffold baseline. Without data files, rows are the `arithmetic` env's tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import inspect
import json
import math
import os
import shlex
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import gymnasium

from agentrl.child_process import arun_probe, exit_cause
from agentrl.envs.arithmetic import ArithmeticEnv, make_arithmetic_row
from agentrl.envs.core import Env, EpisodeLoop, ExternalAgentEnv
from agentrl.envs.reward_sources import ascore_row
from agentrl.envs.rewards import RewardFn, compute_score
from agentrl.errors import ConfigError, EnvError, RewardMissingError
from agentrl.gateway.server import Gateway, SharedGateway
from agentrl.gateway.session import GatewaySession
from agentrl.registry import import_object
from agentrl.types import Action, Fault, FinishReason, Message, Trajectory

__all__ = ["AgentEnv", "AgentTask", "load_callable"]

_STDERR_TAIL = 4000
_KILL_GRACE_S = 3.0


class _AgentCrashedError(Exception):
    """The agent process could not start, or exited with a non-zero status."""


@dataclass(frozen=True)
class AgentTask:
    """What an agent callable is given for one episode."""

    base_url: str
    """The OpenAI base URL of this episode's session (ends in /v1)."""
    api_key: str
    """The session's key; send it as the API key (the base URL alone also selects the session)."""
    model: str
    """A model name to send; the gateway serves the policy under any name."""
    messages: list[Message]
    """The row's prompt as chat messages."""
    row: dict[str, Any]
    episode_id: str = ""
    seed: int | None = None
    timeout_s: float = math.inf
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def prompt(self) -> str:
        """The last user message of the row's prompt."""
        users = [m.get("content", "") for m in self.messages if m.get("role") == "user"]
        return str(users[-1]) if users else ""

    @property
    def system(self) -> str | None:
        """The row's system message, if it has one."""
        first = self.messages[0] if self.messages else {}
        return str(first.get("content", "")) if first.get("role") == "system" else None

    def environ(self) -> dict[str, str]:
        """The environment variables an agent process gets (besides the parent's)."""
        return {**self.extra_env, "OPENAI_BASE_URL": self.base_url, "OPENAI_API_KEY": self.api_key,
                "AGENTRL_MODEL": self.model, "AGENTRL_EPISODE_ID": self.episode_id}


def load_callable(spec: str | Callable[..., Any], what: str) -> Callable[..., Any]:
    """A callable from `"package.module:name"`, `"path/to/file.py:name"`, or itself."""
    if callable(spec):
        return spec
    if not isinstance(spec, str) or ":" not in spec:
        raise ConfigError(f"{what} must be 'package.module:function' or 'path/to/file.py:function', got {spec!r}.")
    target, _, name = spec.rpartition(":")
    if target.endswith(".py"):
        path = Path(target).expanduser().resolve()
        if not path.is_file():
            raise ConfigError(f"{what}: no file {target!r} (from {spec!r}).")
        module_name = f"agentrl_user_{path.stem}_{abs(hash(str(path))):x}"
        module = sys.modules.get(module_name)
        if module is None:
            loader_spec = importlib.util.spec_from_file_location(module_name, path)
            if loader_spec is None or loader_spec.loader is None:
                raise ConfigError(f"{what}: cannot import {target!r}.")
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[module_name] = module
            loader_spec.loader.exec_module(module)
        obj = getattr(module, name, None)
        if obj is None:
            raise ConfigError(f"{what}: {target!r} has no {name!r}.")
    else:
        obj = import_object(spec)
    if not callable(obj):
        raise ConfigError(f"{what}: {spec!r} is a {type(obj).__name__}, not a function.")
    fn: Callable[..., Any] = obj
    return fn


class AgentEnv(Env, ExternalAgentEnv):
    """Runs a user's OpenAI-API agent as an environment (see the module docstring)."""

    recorded_info = ("reward",)  # what the reward's sources said (judge verdicts), for the viewer

    def __init__(
        self,
        agent: str | Callable[[AgentTask], Any] | None = None,
        *,
        command: str | Sequence[str] | None = None,
        reward_fn: RewardFn | str | None = None,
        timeout_s: float | None = None,
        model: str = "agentrl-policy",
        environment: dict[str, str] | None = None,
        cwd: str | None = None,
        gateway: Gateway | SharedGateway | None = None,
    ) -> None:
        if agent is not None and command is not None:
            raise ConfigError("Give the agent as `agent` (a Python function) or `command` (a program), not both.")
        self.agent = load_callable(agent, "env.kwargs.agent") if agent is not None else None
        if isinstance(command, str):
            command = shlex.split(command)
        if command is not None and not command:
            raise ConfigError("env.kwargs.command is empty; give the program to run, e.g. 'python my_agent.py'.")
        self.command = list(command) if command is not None else None
        self.reward_fn: RewardFn = load_callable(reward_fn, "reward_fn") if reward_fn is not None else compute_score
        if timeout_s is not None and timeout_s <= 0:
            raise ConfigError(f"env.kwargs.timeout_s must be positive, got {timeout_s}.")
        self.timeout_s = timeout_s
        self.model = model
        self.environment = {str(k): str(v) for k, v in (environment or {}).items()}
        self.cwd = cwd
        self.gateway = gateway
        self._row: dict[str, Any] | None = None

    @property
    def runs_agent(self) -> bool:
        return self.agent is not None or self.command is not None

    # ── rows and scoring ────────────────────────────────────────────────────────────────────
    @classmethod
    def dataset_rows(cls, split: str) -> list[dict[str, Any]]:
        """Without data files: the `arithmetic` env's problems."""
        return ArithmeticEnv.dataset_rows(split)

    def generate_row(self, seed: int | None) -> dict[str, Any]:
        return make_arithmetic_row(seed or 0)

    def initial_messages(self, row: dict[str, Any]) -> list[Message]:
        prompt = row.get("prompt")
        if isinstance(prompt, str):
            return [{"role": "user", "content": prompt}]
        if isinstance(prompt, list) and prompt:
            # copies of the row's messages, each checked to be one when the rows were loaded (agentrl.datasets)
            return [cast(Message, dict(m)) for m in prompt]
        raise EnvError(f"Dataset row has no usable 'prompt' (got {type(prompt).__name__}); a row needs 'prompt' "
                       "as a list of chat messages or a string.")

    async def ascore(self, answer: str, row: dict[str, Any]) -> tuple[float, dict[str, float], dict[str, Any]]:
        """The reward of `answer` on `row` (the run's `reward_fn`, verl's contract), the extra numbers
        it returned as `reward/<name>` metrics, and what the reward's sources said (judge verdicts,
        reward-model scores) for the trajectory's `info["reward"]`. Raises when the row has no ground
        truth, and `RewardMissingError` when a source of a combined reward cannot score."""
        result = await ascore_row(self.reward_fn, row, answer)
        return result.score, result.metrics(), result.record

    # ── without an agent: one turn, the model answers directly ─────────────────────────────
    async def areset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
                     ) -> tuple[list[Message], dict[str, Any]]:
        gymnasium.Env.reset(self, seed=seed)
        row = (options or {}).get("row")
        if row is None:
            row = self.generate_row(seed)
        if not isinstance(row, dict):
            raise EnvError(f"options['row'] must be a dict (a dataset row), got {type(row).__name__}.")
        self._row = row
        return self.initial_messages(row), {"tools": []}

    async def astep(self, action: Action) -> tuple[list[Message], float, bool, bool, dict[str, Any]]:
        if self._row is None:
            raise EnvError("AgentEnv.step was called before reset (or after the episode ended); call reset first.")
        if not isinstance(action, Action):
            raise EnvError(f"step expects an agentrl.types.Action, got {type(action).__name__}.")
        row, self._row = self._row, None
        reward, extra, record = await self.ascore(action.text, row)
        return [], reward, True, False, {"metrics": extra, **({"reward": record} if record else {})}

    # ── with an agent: the agent drives the episode through the gateway ────────────────────
    async def arun_episode(self, loop: EpisodeLoop, *, row: dict[str, Any] | None, seed: int | None,
                           episode_id: str, group_id: str) -> list[Trajectory]:
        """Play one episode (module docstring; the `ExternalAgentEnv` hook of the Env contract, which the
        rollout calls in place of `loop.run_episode`); never raises for an episode failure. Without an
        agent the episode is handed back to the loop."""
        if not self.runs_agent:
            return await loop.run_episode_segments(self, row=row, seed=seed, episode_id=episode_id,
                                                     group_id=group_id)
        started = time.perf_counter()
        row = row if row is not None else self.generate_row(seed)
        timeout = min(loop.config.episode_timeout_s, self.timeout_s or math.inf)
        async with contextlib.AsyncExitStack() as stack:
            if isinstance(self.gateway, SharedGateway):
                gateway = await self.gateway.get()
            elif self.gateway is not None:
                gateway = self.gateway
            else:  # an env made outside a job: a gateway of this episode's own
                gateway = await stack.enter_async_context(Gateway())
            session = gateway.open_session(loop, episode_id=episode_id, group_id=group_id,
                                           data_source=str(row.get("data_source", "")),
                                           deadline=time.monotonic() + timeout)
            stack.callback(gateway.end_session, session.key)
            segments = await self._play(gateway, session, row, seed, timeout, started)
        return segments

    async def _play(self, gateway: Gateway, session: GatewaySession, row: dict[str, Any], seed: int | None,
                    timeout: float, started: float) -> list[Trajectory]:
        answer: str | None = None
        reason: FinishReason = FinishReason.DONE
        fault: Fault | None = None
        error: str | None = None
        info: dict[str, Any] = {}
        reward: float | None = None
        extra: dict[str, float] = {}
        try:
            task = AgentTask(base_url=gateway.base_url(session), api_key=session.key, model=self.model,
                             messages=self.initial_messages(row), row=row, episode_id=session.episode_id,
                             seed=seed, timeout_s=timeout, extra_env=self.environment)
            agent_t0 = time.perf_counter()
            try:
                async with asyncio.timeout(timeout):
                    answer = await self.arun_agent(task, info)
            finally:
                extra["agent_s"] = time.perf_counter() - agent_t0
                session.close()  # a sync agent left running past its deadline gets no more answers
        except TimeoutError:
            reason, fault, error = FinishReason.TIMEOUT, "infra", f"the agent did not finish within {timeout:.1f} s"
        except Exception as exc:  # the agent's own failure, whatever it raised
            if session.budget_hit is not None or session.last_finish == "length":
                # It gave up after a refused call, or on a reply cut by the token budget: the
                # policy's doing (as the AgentLoop's max_turns / max_length), not the machinery's.
                reason, reward = session.budget_hit or FinishReason.MAX_LENGTH, 0.0
                info["agent_error"] = f"{type(exc).__name__}: {exc}"[:_STDERR_TAIL]
            else:
                reason, fault = FinishReason.ERROR, "infra"
                error = f"the agent failed: {type(exc).__name__}: {exc}"[:_STDERR_TAIL]
        if fault is None and not session.segments:
            reason, fault, reward = FinishReason.ERROR, "infra", None
            error = (f"the agent made no successful model call at {gateway.base_url(session)}; point its OpenAI "
                     "client at OPENAI_BASE_URL / AgentTask.base_url")
        if fault is None and reward is None:
            try:
                reward, scored, record = await self.ascore_episode(answer or "", row, info)
                extra.update(scored)
                if record:
                    info["reward"] = record
            except RewardMissingError as exc:  # a judge or reward model could not score: masked, with its cause
                reason, fault, reward = FinishReason.ERROR, "infra", None
                error = f"the reward could not be measured ({exc.cause}): {exc.detail}"
                info["reward_missing"] = {"cause": exc.cause, "message": exc.detail}
                if exc.record:
                    info["reward"] = exc.record
            except Exception as exc:  # a broken reward function must not score the episode 0
                reason, fault, reward = FinishReason.ERROR, "infra", None
                error = f"the reward function failed: {type(exc).__name__}: {exc}"
            if fault is None and session.last_finish == "length":
                reason = FinishReason.MAX_LENGTH
            if fault is None:
                reason = self.finish_reason(reason, info)
        info["answer"] = answer
        extra["episode_s"] = time.perf_counter() - started
        segments = session.trajectories(reward=reward, finish_reason=reason, fault=fault, error=error,
                                        metrics=extra, info=info)
        if not segments:  # nothing the model sampled: one empty, masked trajectory keeps the episode counted
            t = Trajectory(episode_id=session.episode_id, group_id=session.group_id,
                           data_source=session.data_source, reward=reward, finish_reason=reason, fault=fault,
                           error=error, info=info)
            t.metrics.update({k: float(v) for k, v in session.counters.items()})
            t.metrics.update(extra)
            segments = [t]
        return segments

    # ── the steps of an agent's episode that a subclass may replace ─────────────────────────
    async def arun_agent(self, task: AgentTask, info: dict[str, Any]) -> str:
        """Run the agent once on `task` (its session's base URL) and return its final answer. What it
        raises fails the episode (classified in `_play`); `info` is the episode's trajectory info."""
        return await (self._run_command(task, info) if self.command else self._run_callable(task))

    async def ascore_episode(self, answer: str, row: dict[str, Any], info: dict[str, Any]
                             ) -> tuple[float, dict[str, float], dict[str, Any]]:
        """The reward of an episode whose agent answered `answer` (`ascore`'s contract; `info` holds
        what `arun_agent` recorded). What it raises masks the episode, never scores it 0."""
        return await self.ascore(answer, row)

    def finish_reason(self, reason: FinishReason, info: dict[str, Any]) -> FinishReason:
        """How a scored episode ended: `reason` (done, or max_length when its last call was cut), unless
        what `arun_agent` recorded says the agent's own budget ended it."""
        return reason

    async def _run_callable(self, task: AgentTask) -> str:
        assert self.agent is not None
        fn = self.agent
        if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None)):  # noqa: B004
            result = await fn(task)
        else:
            result = await _in_own_thread(fn, task)
            if inspect.isawaitable(result):
                result = await result
        return "" if result is None else str(result)

    async def _run_command(self, task: AgentTask, info: dict[str, Any]) -> str:
        assert self.command is not None
        with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="agentrl-task-", delete=False) as f:
            json.dump({"messages": task.messages, "row": task.row, "episode_id": task.episode_id}, f, default=str)
            task_file = f.name
        env = {**os.environ, **task.environ(), "AGENTRL_TASK_FILE": task_file}
        try:  # under a lifeline, in a group of its own; a cancelled episode kills the group
            returncode, out, err = await arun_probe(self.command, input=task.prompt.encode(), env=env, cwd=self.cwd,
                                                    grace_s=_KILL_GRACE_S)
        except OSError as exc:
            raise _AgentCrashedError(f"cannot start {self.command[0]!r}: {exc}") from exc
        finally:
            os.unlink(task_file)
        stderr = err.decode(errors="replace")[-_STDERR_TAIL:]
        if stderr:
            info["agent_stderr"] = stderr
        if returncode != 0:
            cause = exit_cause(returncode) if returncode is not None else "did not finish"  # (no timeout given)
            raise _AgentCrashedError(f"{' '.join(self.command)} {cause}: {stderr[-800:]}")
        return out.decode(errors="replace").strip()


async def _in_own_thread(fn: Callable[[AgentTask], Any], task: AgentTask) -> Any:
    """Run a blocking agent in a daemon thread of its own (the shared pool has only a few threads)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not done.done():
            (done.set_result if ok else done.set_exception)(value)

    def target() -> None:
        try:
            result = fn(task)
        except BaseException as exc:  # handed to the episode, which classifies it
            loop.call_soon_threadsafe(settle, False, exc)
        else:
            loop.call_soon_threadsafe(settle, True, result)

    threading.Thread(target=target, name=f"agentrl-agent-{task.episode_id}", daemon=True).start()
    return await done
