"""`verifiers`: a taskset of the `verifiers` package (0.4, its `verifiers.v1` API) as an agentrl env.

    agentrl eval env=verifiers env.kwargs.id=examples/verifiers_arith.py    # a file exporting a Taskset
    agentrl eval env=verifiers env.kwargs.id=my_taskset                      # an installed taskset package

`id` is what verifiers itself takes (`--env.taskset.id`: an installed taskset package, or a built-in
one under `verifiers.v1.tasksets`), or the path of a `.py` file that exports one `Taskset` subclass in
`__all__`. `taskset_kwargs` are its config fields (`TasksetConfig`: `system_prompt`, `task`, ...).

What comes from verifiers: the rows (the taskset's tasks, in `load()` order: each task's `TaskData`
rides in the row's `extra_info.verifiers_task`, and a run given no `data.*_files` uses them for both
splits, as verifiers tasksets have none), the prompt (the task's `system_prompt`, after the taskset's
override, then its `prompt`), and the reward: the task's `@vf.reward` functions and plugged judges,
run by the task's own `score` over a `vf.Trace` of the episode's messages, summed with their
weights (`trace.reward`); its `@vf.metric`s and each named reward are the trajectory's metrics.
What agentrl does: it generates the turns itself (token in, token out) and ends the episode at the
model's first answer. A rubric that raises, times out (`score_timeout_s`) or leaves a reward unscored
is an infrastructure failure (`EnvServerError`: the episode is masked, never scored 0).

Not covered, and refused with this reason (`FeatureUnavailableError`): verifiers 0.4 has no
`MultiTurnEnv`/`ToolEnv`/`Parser` classes any more; its tools are MCP `Toolset` servers and its
multi-turn episodes are played by a harness program against an intercepted OpenAI endpoint (and a
user simulator). A taskset or task that declares toolsets is refused; serve its tools with
`env=mcp`, or run its harness through `env=agent` (the gateway records such episodes in the ledger).
Runtimes (`setup`/`finalize` in a container) and `@vf.stop` hooks are not run.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, ClassVar

import gymnasium

from agentrl.envs.core import Env
from agentrl.errors import ConfigError, EnvError, EnvServerError, FeatureUnavailableError
from agentrl.types import Action, Message

__all__ = ["VerifiersEnv", "load_verifiers_taskset"]

_TASK_KEY = "verifiers_task"


def _vf() -> Any:
    try:
        import verifiers.v1 as vf
    except ImportError as exc:
        raise FeatureUnavailableError(
            f"env=verifiers needs the 'verifiers' package (0.4, with its verifiers.v1 API): {exc}. Install it with "
            "pip install verifiers==0.4.0 (it pins openai<3; install it in an environment where that is allowed)."
        ) from exc
    return vf


def load_verifiers_taskset(id: str, taskset_kwargs: dict[str, Any] | None = None) -> Any:
    """The verifiers `Taskset` that `id` names (a package id or a `.py` file), built with its config."""
    vf = _vf()
    from verifiers.v1.utils.generic import concrete_type
    from verifiers.v1.utils.loaders import _plugin_class, file_module, taskset_class

    try:
        if id.endswith(".py"):
            if not Path(id).is_file():
                raise ConfigError(f"env.kwargs.id '{id}' is not a file (from {Path.cwd()}).")
            cls = _plugin_class(file_module(id), vf.Taskset, "taskset")
        else:
            cls = taskset_class(id)
    except ConfigError:
        raise
    except (ImportError, AttributeError, TypeError, ValueError) as exc:
        raise ConfigError(f"env.kwargs.id '{id}' names no verifiers taskset: {exc}") from exc
    config_cls = concrete_type(cls, vf.TasksetConfig, origin=vf.Taskset) or vf.TasksetConfig
    try:
        config = config_cls(**({"id": id} if not id.endswith(".py") else {}), **(taskset_kwargs or {}))
    except Exception as exc:  # pydantic's ValidationError: the user's taskset_kwargs
        raise ConfigError(f"env.kwargs.taskset_kwargs do not fit {config_cls.__name__}: {exc}") from exc
    taskset = cls(config)
    if cls.toolsets(config) or cls.task_type().toolsets(config.task):
        raise FeatureUnavailableError(
            f"the verifiers taskset '{id}' declares tool servers (Toolsets); env=verifiers does not run them yet "
            "(see agentrl.envs.verifiers_env). Serve them with env=mcp, or run its harness through env=agent."
        )
    return taskset


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) if isinstance(p, dict) else str(getattr(p, "text", "")) for p in content)
    return "" if content is None else str(content)


class VerifiersEnv(Env):
    """A verifiers taskset, scored by its tasks' rewards (see the module docstring)."""

    requires_ground_truth: ClassVar[bool] = False

    def __init__(self, *, id: str, taskset_kwargs: dict[str, Any] | None = None, max_rows: int = 1000,
                 score_timeout_s: float = 60.0) -> None:
        if not isinstance(id, str) or not id:
            raise ConfigError("env=verifiers needs env.kwargs.id: a verifiers taskset id or a .py file exporting one.")
        self.vf = _vf()
        self.id = id
        self.taskset = load_verifiers_taskset(id, taskset_kwargs)
        self.max_rows = max_rows
        self.score_timeout_s = score_timeout_s
        self._task: Any = None
        self._messages: list[Message] = []

    @classmethod
    def dataset_rows(cls, split: str, env_kwargs: dict[str, Any] | None = None) -> list[dict[str, Any]] | None:
        """The taskset's tasks (the same for both splits: verifiers tasksets have none), at most `max_rows`."""
        kwargs = dict(env_kwargs or {})
        if "id" not in kwargs:
            return None
        return cls(**{k: v for k, v in kwargs.items() if k in ("id", "taskset_kwargs", "max_rows")}).rows()

    def rows(self) -> list[dict[str, Any]]:
        """The taskset's first `max_rows` tasks as verl-format rows."""
        return [self._row(task) for task in self.taskset.take(self.max_rows)]

    def _row(self, task: Any) -> dict[str, Any]:
        data = task.data.model_dump(mode="json", exclude_none=True)
        return {"prompt": self._prompt(task), "data_source": f"verifiers/{Path(self.id).stem}",
                "extra_info": {_TASK_KEY: data, "task_id": task.data.id, "task_key": task.key}}

    def _prompt(self, task: Any) -> list[Message]:
        data = task.data
        messages: list[Message] = []
        if data.system_prompt:
            messages.append({"role": "system", "content": data.system_prompt})
        if isinstance(data.prompt, str):
            messages.append({"role": "user", "content": data.prompt})
        else:
            for m in data.prompt or []:
                dumped = m.model_dump(mode="json") if hasattr(m, "model_dump") else dict(m)
                messages.append({"role": dumped["role"], "content": _text(dumped.get("content"))})
        if not messages:
            raise EnvError(f"verifiers task {data.id or data.idx} has no prompt (the user opens the conversation: "
                           "a user simulator env, which env=verifiers does not run).")
        return messages

    def first_prompt(self, row: dict[str, Any]) -> tuple[list[Message], list[Any]]:
        return self._prompt(self._task_of(row)), []

    def _task_of(self, row: dict[str, Any]) -> Any:
        data = (row.get("extra_info") or {}).get(_TASK_KEY)
        if not isinstance(data, dict):
            raise EnvError(f"env=verifiers rows carry their task in extra_info.{_TASK_KEY}; this row has none. "
                           "Use the env's own rows (leave data.*_files unset).")
        task_cls = type(self.taskset).task_type()
        return task_cls(task_cls.data_type().model_validate(data), self.taskset.config.task)

    # ── the contract ────────────────────────────────────────────────────────────────────────
    async def areset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        gymnasium.Env.reset(self, seed=seed)  # seeds self.np_random the standard way
        row = (options or {}).get("row")
        if row is None:
            tasks = self.rows()
            row = tasks[(seed or 0) % len(tasks)]
        self._task = self._task_of(row)
        self._messages = self._prompt(self._task)
        return list(self._messages), {"tools": []}

    async def astep(self, action: Action) -> tuple[list[Message], float, bool, bool, dict[str, Any]]:
        if self._task is None:
            raise EnvError("VerifiersEnv.step was called without an open episode; call reset first.")
        if not isinstance(action, Action):
            raise EnvError(f"step expects an agentrl.types.Action, got {type(action).__name__}.")
        task, self._task = self._task, None
        trace = self._trace(task, [*self._messages, {"role": "assistant", "content": action.text}])
        try:
            await asyncio.wait_for(task.score(trace), self.score_timeout_s)
        except TimeoutError as exc:
            raise EnvServerError(f"the verifiers rubric of task {task.data.id or task.data.idx} did not finish "
                                 f"within {self.score_timeout_s:.0f} s (env.kwargs.score_timeout_s).") from exc
        except Exception as exc:  # the task's own reward code: whatever it raises, the episode was not scored
            raise EnvServerError(f"the verifiers rubric of task {task.data.id or task.data.idx} failed: "
                                 f"{type(exc).__name__}: {exc}") from exc
        unscored = sorted(name for name, r in trace.rewards.items() if r is None)
        if unscored:
            raise EnvServerError(f"the verifiers rewards {unscored} of task {task.data.id or task.data.idx} were not "
                                 "scored.")
        metrics = {f"reward/{name}": float(r.score) for name, r in trace.rewards.items() if r is not None}
        metrics.update({name: float(v) for name, v in trace.metrics.items() if isinstance(v, int | float)})
        return [], float(trace.reward), True, False, {"metrics": metrics}

    async def aclose(self) -> None:
        self._task = None

    def _trace(self, task: Any, messages: list[Message]) -> Any:
        vf = self.vf
        from verifiers.v1.graph import MessageNode

        kinds = {"system": vf.SystemMessage, "user": vf.UserMessage, "assistant": vf.AssistantMessage}
        kept = [m for m in messages if m["role"] in kinds]
        nodes = [MessageNode(message=kinds[m["role"]](content=m.get("content") or ""), parent=i - 1 if i else None,
                             sampled=i == len(kept) - 1)  # the one turn the model sampled: the last
                 for i, m in enumerate(kept)]
        return vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                        agent=vf.AgentInfo(config=vf.AgentConfig()), nodes=nodes)

