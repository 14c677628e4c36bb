"""The environment contract: `agentrl.Env`, a `gymnasium.Env` whose observations are chat messages.

    obs, info = env.reset(seed=0, options={"row": dataset_row})
    # obs: list of chat messages (the prompt); info["tools"]: the tool schemas the agent may call
    obs, reward, terminated, truncated, info = env.step(action)
    # action: the assistant turn (`agentrl.types.Action`: text + parsed tool calls)
    # obs: the new messages to append (tool results, feedback)

`areset`/`astep`/`aclose` are the async twins the AgentLoop awaits. By default they run the sync
methods in a worker thread; environments that call tools implement the async side natively (see
`ToolEnv`) so thousands of episodes share one event loop, and then the sync methods drive it on a
private loop. Environments know nothing of the trainer or of tokens.

`atruncate(reason)` is the AgentLoop telling the env that one of the loop's own budgets (turns,
tokens, wall time) ended an episode the env had not ended; it returns the episode's last reward
and info. By default that is a reward of 0; envs that judge the work done (SWE) grade it there.

`arun_episode(loop, ...)` (`ExternalAgentEnv`) is the one hook an env may add to play its episodes
itself instead of being played by the AgentLoop: the rollout then hands it the loop (an
`EpisodeLoop`: its generate client, chat template, parser, stop ids and budgets) and takes the
trajectories it returns. `agentrl.gateway.AgentEnv` runs an external OpenAI-API agent this way.

`first_prompt(row)` says, without starting an episode, which messages and tool schemas `reset`
would start one on `row` with, so a run can measure a row's prompt before it rolls it out; an env
that cannot tell without a reset returns None (the default).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, SupportsFloat, TypeVar, runtime_checkable

import gymnasium
import numpy as np

from agentrl.types import Action, ActionParser, GenerateClient, Message, ToolSchema, Trajectory

if TYPE_CHECKING:
    from agentrl.chat import ChatTemplate
    from agentrl.config import RolloutConfig

__all__ = ["ActionSpace", "ChatSpace", "Env", "EpisodeLoop", "ExternalAgentEnv", "TurnBackend"]

_ROLES = ("system", "user", "assistant", "tool")
_T = TypeVar("_T")


class ChatSpace(gymnasium.Space[list[Message]]):
    """The space of chat-message lists: each a dict with a known `role` and string `content`."""

    def __init__(self, seed: int | np.random.Generator | None = None) -> None:
        super().__init__(shape=None, dtype=None, seed=seed)

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def contains(self, x: Any) -> bool:
        return isinstance(x, list) and all(_is_message(m) for m in x)

    def sample(self, mask: Any = None, probability: Any = None) -> list[Message]:
        words = ("add", "the", "numbers", "what", "is", "seven", "tool", "result")
        n = int(self.np_random.integers(1, 8))
        text = " ".join(words[int(i)] for i in self.np_random.integers(0, len(words), size=n))
        return [{"role": "user", "content": text}]

    def __repr__(self) -> str:
        return "ChatSpace()"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ChatSpace)


class ActionSpace(gymnasium.Space[Action]):
    """The space of assistant turns: `Action` objects (text plus parsed tool calls)."""

    def __init__(self, seed: int | np.random.Generator | None = None) -> None:
        super().__init__(shape=None, dtype=None, seed=seed)

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def contains(self, x: Any) -> bool:
        return isinstance(x, Action) and isinstance(x.text, str)

    def sample(self, mask: Any = None, probability: Any = None) -> Action:
        """A plain-text answer with no tool call (random digits), so any env can take it."""
        return Action(text=f"The answer is {int(self.np_random.integers(0, 1000))}.")

    def __repr__(self) -> str:
        return "ActionSpace()"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ActionSpace)


def _is_message(m: Any) -> bool:
    return (
        isinstance(m, dict)
        and m.get("role") in _ROLES
        and isinstance(m.get("content", ""), str)
    )


class Env(gymnasium.Env[list[Message], Action]):
    """Base class of agentrl environments (a `gymnasium.Env`; see the module docstring).

    Subclasses implement `reset` and `step` (sync), or `areset` and `astep` (async) and inherit
    sync versions that drive them. `reset(options={"row": row})` starts an episode on a dataset
    row in verl's format; without a row an environment may generate a task from `seed`.
    `info["tools"]` from `reset` lists the OpenAI tool schemas the agent may call. An env that plays
    its episodes itself (an external agent) also has `arun_episode`, the `ExternalAgentEnv` hook.
    """

    observation_space = ChatSpace()
    action_space = ActionSpace()
    reports_resolved: ClassVar[bool] = False
    """True when the env's episodes report `info["metrics"]["resolved"]` (SWE-style: the task's
    hidden tests pass); `agentrl eval` then reports a resolved rate."""
    recorded_info: ClassVar[tuple[str, ...]] = ()
    """Keys of the episode's last info (its final `step`'s, merged with `atruncate`'s) that the
    AgentLoop copies into `trajectory.info`, so they reach trajectory files (`agentrl eval`'s
    trajectories.jsonl, a run's rollouts) and the viewer. Their values must be JSON-serialisable.
    Of other keys only `info["metrics"]` numbers and `truncated_by` reach the trajectory."""

    @classmethod
    def dataset_rows(cls, split: str) -> list[dict[str, Any]] | None:
        """The env's own rows of `split` ("train" or "test") in verl's format, for runs given no
        `data.train_files`/`data.val_files`; None when the env ships no dataset."""
        return None
    requires_ground_truth: ClassVar[bool] = True
    """Every dataset row must carry `reward_model.ground_truth` (the answer it is scored against);
    a row without one is refused when the data is loaded. Envs that score otherwise (by running
    tests, by a judge) set it False."""

    def first_prompt(self, row: dict[str, Any]) -> tuple[list[Message], list[ToolSchema]] | None:
        """The messages and tool schemas `reset(options={"row": row})` would return, computed without
        starting an episode (no context, no sandbox); None when the env cannot tell without a reset."""
        return None

    async def apreflight(self) -> str | None:
        """Pre-flight (`agentrl run`, `eval`, `doctor`): check, in seconds and before anything starts,
        what this env needs from outside the process (a server it connects to); return what was
        checked, or None when there is nothing to check (the default). Raise `EnvServerError`
        naming the address and the fix when it cannot be reached."""
        return None

    # ── async twins: default to running the sync methods in a thread ────────────────────────
    async def areset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        """Async `reset`. Override it (and leave `reset` alone) for natively async environments."""
        if type(self).reset is Env.reset:
            raise NotImplementedError(f"{type(self).__name__} must implement reset or areset.")
        return await asyncio.to_thread(self.reset, seed=seed, options=options)

    async def astep(
        self, action: Action
    ) -> tuple[list[Message], SupportsFloat, bool, bool, dict[str, Any]]:
        """Async `step`. Override it (and leave `step` alone) for natively async environments."""
        if type(self).step is Env.step:
            raise NotImplementedError(f"{type(self).__name__} must implement step or astep.")
        return await asyncio.to_thread(self.step, action)

    async def atruncate(self, reason: str) -> tuple[float, dict[str, Any]]:
        """The AgentLoop's own budget ended the episode before the env did: settle it, return (reward, info).

        `reason` names the budget, as its config key (`rollout.max_turns`, `rollout.max_total_tokens`,
        `rollout.max_tokens_per_turn`, `rollout.episode_timeout_s`). The reward is added to the
        episode's; `info["metrics"]` reaches the trajectory like a step's. Called at most once per
        episode, after the last `astep`, under a deadline of its own; raise an `AgentRLError` for an
        infrastructure failure (the episode is then masked, not scored). Default: reward 0, no info.
        """
        return 0.0, {}

    async def aclose(self) -> None:
        """Async `close`; closing twice must be harmless."""
        if type(self).close is not Env.close:
            await asyncio.to_thread(self.close)

    # ── sync side: drives the async twins when only those are implemented ───────────────────
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        if type(self).areset is Env.areset:
            # A subclass implementing `reset` calls super().reset(seed=seed) to seed `np_random`,
            # the gymnasium idiom; that is all the base class does then.
            return super().reset(seed=seed, options=options)
        return self._drive(self.areset(seed=seed, options=options))

    def step(self, action: Action) -> tuple[list[Message], SupportsFloat, bool, bool, dict[str, Any]]:
        if type(self).astep is Env.astep:
            raise NotImplementedError(f"{type(self).__name__} must implement step or astep.")
        return self._drive(self.astep(action))

    def close(self) -> None:
        if type(self).aclose is not Env.aclose:
            self._drive(self.aclose())
        loop = self.__dict__.pop("_private_loop", None)
        if loop is not None and not loop.is_closed():
            loop.close()

    def _drive(self, coro: Coroutine[Any, Any, _T]) -> _T:
        """Run a coroutine of this env to completion on the env's own private event loop.

        One loop per env keeps loop-bound resources (subprocess pipes, HTTP clients) valid across
        calls. Calling the sync API from inside a running event loop would deadlock it, so that is
        refused with the async alternative named.
        """
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            coro.close()
            raise RuntimeError(
                f"{type(self).__name__}.reset/step were called from inside a running event loop; "
                "use `await env.areset(...)` / `await env.astep(...)` there instead."
            )
        loop = self.__dict__.get("_private_loop")
        if loop is None or loop.is_closed():
            loop = asyncio.new_event_loop()
            self.__dict__["_private_loop"] = loop
        return loop.run_until_complete(coro)


# ── the hook of envs that play their own episodes ───────────────────────────────────────────
class TurnBackend(Protocol):
    """What generates an agent's turns: a generate client, the chat template that renders the
    conversation, the action parser, the ids that end a turn, and the budgets and sampling of the
    run's `rollout` section. The rollout's `AgentLoop` is one; `agentrl.gateway` generates every call
    of an external agent with one."""

    client: GenerateClient
    template: ChatTemplate
    parser: ActionParser
    config: RolloutConfig
    stop_token_ids: tuple[int, ...]


class EpisodeLoop(TurnBackend, Protocol):
    """The rollout's `AgentLoop` as `ExternalAgentEnv.arun_episode` is given it: a `TurnBackend`
    that can also play an episode the usual way (`run_episode_segments`, for an env that hands one back:
    one trajectory per context, several when `rollout.compaction` compacted it)."""

    async def run_episode(
        self,
        env: Env,
        *,
        row: dict[str, Any] | None = None,
        seed: int | None = None,
        episode_id: str | None = None,
        group_id: str = "",
    ) -> Trajectory: ...

    async def run_episode_segments(
        self,
        env: Env,
        *,
        row: dict[str, Any] | None = None,
        seed: int | None = None,
        episode_id: str | None = None,
        group_id: str = "",
    ) -> list[Trajectory]: ...


@runtime_checkable
class ExternalAgentEnv(Protocol):
    """An env that plays its own episodes, generating through the rollout's loop.

    When the env the rollout builds for an episode has this method, the rollout (`RolloutWorker`) calls
    `await env.arun_episode(loop, row=..., seed=..., episode_id=..., group_id=...)` once, in place
    of `loop.run_episode(env, ...)`, and the env's `areset`/`astep`/`atruncate` are then its own
    business. It returns the episode's trajectories: one, or one per segment when the agent
    rewrote its history (they share the episode's reward, finish reason and `episode_id`). Like
    `AgentLoop.run_episode` it never raises for an episode failure (it records the failure in the
    trajectories, as a fault when the machinery failed) and it closes the env. An env may hand an
    episode back to the loop with `return await loop.run_episode_segments(self, ...)`.
    """

    async def arun_episode(
        self, loop: EpisodeLoop, *, row: dict[str, Any] | None, seed: int | None, episode_id: str, group_id: str
    ) -> list[Trajectory]: ...
