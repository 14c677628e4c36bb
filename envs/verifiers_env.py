"""`verifiers`: a taskset of the `verifiers` package (0.4, its `verifiers.v1` API) as an agentrl env.

    agentrl eval env=verifiers env.kwargs.id=examples/verifiers_arith.py    # a file exporting a Taskset
    agentrl eval env=verifiers env.kwargs.id=my_taskset                      # an installed taskset package
    agentrl eval env=verifiers env.kwargs.id=examples/verifiers_guess.py    # multi-turn: it exports a vf.Env too

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

Multi-turn tasksets (a package or file that exports a `vf.Env` besides its `Taskset`, whose
`run(task, agents)` plays the player's `interaction` turn by turn, as verifiers' TextArena and
OpenEnv tasksets do) cannot be played by reset/step: their episodes are verifiers' own program. This
env gives their rows (`extra_info.verifiers_multi_turn`; `first_prompt` is None, as verifiers'
program renders the first call) and refuses `reset` with `FeatureUnavailableError`;
`agentrl.gateway.verifiers_agent.VerifiersAgentEnv`, the class `env=verifiers` names, plays them
through the gateway (the worker's `play`), and hands plain tasksets to the AgentLoop as described
above. It is a separate class because the gateway sits a layer above the envs.

Where verifiers runs: never in agentrl's process. verifiers 0.4 pins `openai<3` and `mcp==2.0.0`,
which agentrl's own environment does not allow, so `bash scripts/install.sh verifiers` (and `dev`)
installs it with its pinned dependencies into a folder of its own beside the environment
(`<sys.prefix>/agentrl-extras/verifiers`), and the taskset is loaded and scored in a worker process
whose `sys.path` starts with that folder (`agentrl.envs.verifiers_process`). A run's envs share the
job's one worker (`verifiers_worker`, which the job gives them and closes); an env built alone
starts its own and stops it in `aclose`. The worker dies with agentrl (a lifeline); a worker that
dies mid-episode fails the episodes it was scoring or playing as infrastructure, and the next
episode gets a fresh one. Without the folder, building the env raises `FeatureUnavailableError`
naming the command.

Tools: a taskset or task that declares toolsets (verifiers 0.4's tools are MCP `Toolset` servers,
`examples/verifiers_calculator.py`) is played by verifiers as a multi-turn episode (its
`SingleAgentEnv` when the package exports no `vf.Env`). verifiers starts each toolset for the episode
(a task's) or for the episode's env (a taskset's) in its subprocess runtime: a process of the worker's
user on this machine, `python -m` the toolset's module with the verifiers folder on its path, serving
MCP over streamable HTTP on a loopback port with no authentication, in its own session and working
folder (under `~/.cache/verifiers/runtimes/subprocess/`), killed when the episode ends and, by
verifiers' `PR_SET_PDEATHSIG`, when the worker dies (a killed worker leaves that folder, the server's
log in it; and verifiers leaves a 5-byte `/tmp/vf-port-*` file for every server it starts). It is NOT sandboxed: the tool runs with the
user's rights, files and network, as the taskset's own rubric code does in the worker; `env=mcp` runs
stdio MCP servers under agentrl's sandbox (bubblewrap) instead, which is the choice for tools that
run untrusted model input. The chat program lists the tools in each chat request, the gateway renders
them with the model's chat template and parses its calls with the run's tool parser
(`model.tool_parser`), and the chat program calls the server; each result is the next (masked) tool
turn. A toolset's module must end with `if __name__ == "__main__": TheToolset.run()`, as verifiers'
own do (it is run as `python -m`): one without is refused when the taskset loads (`ConfigError`).
Refused with the reason (`FeatureUnavailableError`): a toolset whose runtime is not
`subprocess` (docker, podman, apptainer, modal, e2b, prime: verifiers builds and installs the toolset with
`uv` there, which needs that runtime and the network), and an env with more than one agent seat (a
user simulator or a judge played by a second model, which an offline run does not have). The
player's program is always verifiers' chat program (the `null` harness's: no tools but the toolsets'),
whatever harness the taskset bundles, and it runs on the host (verifiers' subprocess runtime), never
in a container or a remote sandbox.
Runtimes (`setup`/`finalize` in a container) and `@vf.stop` hooks of plain tasksets are not run (a
multi-turn episode runs whatever verifiers' `Env.run_episode` runs). A taskset whose module does not
import (a package of its own missing from the verifiers folder) is refused with the folder to install
it in. Of verifiers' built-in multi-turn tasksets, `openenv` runs offline against an OpenEnv server
given as `taskset_kwargs.base_url` once the folder holds verifiers' `openenv` extra (PyPI `openenv`,
not agentrl's `openenv-core`, which shares its module name but lacks what verifiers 0.4 reads);
`textarena` cannot run offline: its `load()` downloads NLTK corpora (`words`,
`averaged_perceptron_tagger_eng`) from raw.githubusercontent.com.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, cast

import gymnasium

from agentrl.envs.core import Env
from agentrl.envs.verifiers_process import VerifiersWorker, checked_answer
from agentrl.errors import ConfigError, EnvError, EnvServerError, FeatureUnavailableError
from agentrl.types import Action, Message, Role

__all__ = ["VerifiersEnv", "scored_answer", "task_label", "task_of"]

_TASK_KEY = "verifiers_task"
_TURNS_KEY = "verifiers_multi_turn"
_ROLES = ("system", "user", "assistant", "tool")
_WEDGED_GRACE_S = 10.0
"""How long past `score_timeout_s` the worker may take to answer before it is taken to be wedged."""


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) if isinstance(p, dict) else "" for p in content)
    return "" if content is None else str(content)


def _prompt(data: dict[str, Any]) -> list[Message]:
    """The messages a task opens with: its `system_prompt` (the taskset's override already applied
    when the task was loaded), then its `prompt` (a string, or messages)."""
    messages: list[Message] = []
    if data.get("system_prompt"):
        messages.append({"role": "system", "content": str(data["system_prompt"])})
    prompt = data.get("prompt")
    if isinstance(prompt, str):
        messages.append({"role": "user", "content": prompt})
    else:
        for m in prompt or []:
            role = m.get("role") if isinstance(m, dict) else None
            if role not in _ROLES:
                raise EnvError(f"verifiers task {task_label(data)} has a prompt message of role {role!r}; env=verifiers "
                               f"takes {', '.join(_ROLES)}.")
            messages.append({"role": cast(Role, role), "content": _text(m.get("content"))})
    if not messages:
        raise EnvError(f"verifiers task {task_label(data)} has no prompt (the user opens the conversation: a user "
                       "simulator env, which env=verifiers does not run).")
    return messages


def _opening(data: dict[str, Any]) -> list[Message]:
    """A multi-turn task's row prompt: its own (system prompt, prompt) where it has one, else a line
    saying its env opens the conversation. The episode's real messages are those its env sends."""
    try:
        return _prompt(data)
    except EnvError:
        return [{"role": "user", "content": f"(verifiers task {task_label(data)}: its env opens the conversation)"}]


def task_label(data: dict[str, Any]) -> str:
    """How errors name a verifiers task: its id, else its position in the taskset."""
    return str(data.get("id") or data.get("idx"))


def task_of(row: dict[str, Any]) -> dict[str, Any]:
    """The verifiers `TaskData` (as JSON) a row of env=verifiers carries."""
    data = (row.get("extra_info") or {}).get(_TASK_KEY)
    if not isinstance(data, dict):
        raise EnvError(f"env=verifiers rows carry their task in extra_info.{_TASK_KEY}; this row has none. "
                       "Use the env's own rows (leave data.*_files unset).")
    return data


def scored_answer(answer: dict[str, Any], what: str, deadline: str) -> tuple[float, dict[str, float]]:
    """The reward and metrics of the worker's answer to a `score` or `play` request about `what` (the
    task's rewards by name as `reward/<name>`, and its metrics); `EnvServerError` when it timed out
    (past `deadline`), failed, or left a reward unscored: an infrastructure failure, never a score."""
    if not answer.get("ok"):
        if answer.get("kind") == "timeout":
            raise EnvServerError(f"{what} did not finish within {deadline}.")
        if answer.get("kind") == "failed":
            raise EnvServerError(f"{what} failed: {answer.get('message')}")
        checked_answer(answer)  # raises what its kind stands for (a wrong taskset, a row that does not fit it)
    rewards: dict[str, float | None] = answer["rewards"]
    unscored = sorted(name for name, r in rewards.items() if r is None)
    if unscored or answer.get("reward") is None:
        task = what.removeprefix("the verifiers rubric of ").removeprefix("the verifiers episode of ")
        raise EnvServerError(f"the verifiers rewards {unscored} of {task} were not scored.")
    metrics = {f"reward/{name}": float(r) for name, r in rewards.items() if r is not None}
    metrics.update({name: float(v) for name, v in answer["metrics"].items()})
    return float(answer["reward"]), metrics


class VerifiersEnv(Env):
    """A verifiers taskset, scored by its tasks' rewards (see the module docstring)."""

    requires_ground_truth: ClassVar[bool] = False

    def __init__(self, *, id: str, taskset_kwargs: dict[str, Any] | None = None, max_rows: int = 1000,
                 score_timeout_s: float = 60.0, verifiers_worker: VerifiersWorker | None = None) -> None:
        if not isinstance(id, str) or not id:
            raise ConfigError("env=verifiers needs env.kwargs.id: a verifiers taskset id or a .py file exporting one.")
        if id.endswith(".py"):
            if not Path(id).is_file():
                raise ConfigError(f"env.kwargs.id '{id}' is not a file (from {Path.cwd()}).")
            self.taskset_id = str(Path(id).resolve())  # the worker may run elsewhere than the cwd one day
        else:
            self.taskset_id = id
        if taskset_kwargs is not None and not isinstance(taskset_kwargs, dict):
            raise ConfigError(f"env.kwargs.taskset_kwargs must be a mapping of the taskset's config fields, "
                              f"got {taskset_kwargs!r}.")
        self.id = id
        self.taskset_kwargs = dict(taskset_kwargs or {})
        self.max_rows = max_rows
        self.score_timeout_s = score_timeout_s
        self._own_worker = verifiers_worker is None
        self.worker = verifiers_worker if verifiers_worker is not None else VerifiersWorker()
        self._data: dict[str, Any] | None = None
        self._messages: list[Message] = []

    @classmethod
    def dataset_rows(cls, split: str, env_kwargs: dict[str, Any] | None = None) -> list[dict[str, Any]] | None:
        """The taskset's tasks (the same for both splits: verifiers tasksets have none), at most `max_rows`."""
        kwargs = dict(env_kwargs or {})
        if "id" not in kwargs:
            return None
        env = cls(**{k: v for k, v in kwargs.items() if k in ("id", "taskset_kwargs", "max_rows", "verifiers_worker")})
        try:
            return env.rows()
        finally:
            if env._own_worker:  # not env.close(): this may run inside an event loop
                env.worker.close()

    def rows(self) -> list[dict[str, Any]]:
        """The taskset's first `max_rows` tasks as verl-format rows (loaded by the worker)."""
        loaded = self.worker.taskset(self.taskset_id, self.taskset_kwargs, self.max_rows)
        return self._rows(loaded["tasks"], bool(loaded.get("multi_turn")))

    def _rows(self, tasks: list[dict[str, Any]], multi_turn: bool = False) -> list[dict[str, Any]]:
        return [{"prompt": _opening(t["data"]) if multi_turn else _prompt(t["data"]),
                 "data_source": f"verifiers/{Path(self.id).stem}",
                 "extra_info": {_TASK_KEY: t["data"], "task_id": t["data"].get("id"), "task_key": t["key"],
                                **({_TURNS_KEY: True} if multi_turn else {})}}
                for t in tasks]

    def first_prompt(self, row: dict[str, Any]) -> tuple[list[Message], list[Any]] | None:
        if (row.get("extra_info") or {}).get(_TURNS_KEY):
            return None  # verifiers' own program renders the first call of an episode played in turns
        return _prompt(task_of(row)), []

    async def apreflight(self) -> str | None:
        """The worker starts and loads the taskset (its first `max_rows` tasks)."""
        loaded = await self.worker.ataskset(self.taskset_id, self.taskset_kwargs, self.max_rows)
        played = f", played in turns by its {loaded['env']}" if loaded.get("multi_turn") else ""
        return (f"verifiers {self.worker.version} ({self.worker.folder}) loaded the taskset '{self.id}': "
                f"{len(loaded['tasks'])} tasks{played}")

    async def aplays_turns(self) -> str | None:
        """The name of the `vf.Env` that plays the taskset's episodes in turns (verifiers' `SingleAgentEnv`
        for a taskset with toolsets), or None when it is answered in one reply (a plain taskset)."""
        loaded = await self.worker.ataskset(self.taskset_id, self.taskset_kwargs, self.max_rows)
        return str(loaded["env"]) if loaded.get("multi_turn") else None

    # ── the contract ────────────────────────────────────────────────────────────────────────
    async def areset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        gymnasium.Env.reset(self, seed=seed)  # seeds self.np_random the standard way
        player = await self.aplays_turns()
        if player is not None:
            raise FeatureUnavailableError(
                f"the verifiers taskset '{self.id}' is played in turns by its {player}, which reset/step cannot "
                "do: its episodes run through agentrl's gateway. Run it with `agentrl run|eval env=verifiers` "
                "(agentrl.gateway.VerifiersAgentEnv), not by stepping VerifiersEnv.")
        row = (options or {}).get("row")
        if row is None:
            tasks = self._rows(await self.worker.atasks(self.taskset_id, self.taskset_kwargs, self.max_rows))
            if not tasks:
                raise EnvError(f"the verifiers taskset '{self.id}' has no tasks.")
            row = tasks[(seed or 0) % len(tasks)]
        self._data = task_of(row)
        self._messages = _prompt(self._data)
        return list(self._messages), {"tools": []}

    async def astep(self, action: Action) -> tuple[list[Message], float, bool, bool, dict[str, Any]]:
        if self._data is None:
            raise EnvError("VerifiersEnv.step was called without an open episode; call reset first.")
        if not isinstance(action, Action):
            raise EnvError(f"step expects an agentrl.types.Action, got {type(action).__name__}.")
        data, self._data = self._data, None
        request = {"op": "score", "taskset": self.taskset_id, "kwargs": self.taskset_kwargs, "data": data,
                   "messages": [*self._messages, {"role": "assistant", "content": action.text}],
                   "timeout_s": self.score_timeout_s}
        try:
            answer = await self.worker.arequest(request, self.score_timeout_s + _WEDGED_GRACE_S)
        except EnvServerError as exc:
            raise EnvServerError(f"the verifiers rubric of task {task_label(data)} was not scored: {exc}") from exc
        reward, metrics = scored_answer(answer, f"the verifiers rubric of task {task_label(data)}",
                                        f"{self.score_timeout_s:.0f} s (env.kwargs.score_timeout_s)")
        return [], reward, True, False, {"metrics": metrics}

    async def aclose(self) -> None:
        self._data = None
        if self._own_worker:
            await self.worker.aclose()
