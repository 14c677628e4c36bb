"""The AgentLoop: one episode of a model acting in an environment, as an explicit state machine.

    PENDING ──► GENERATING ──► PROCESSING_TOOLS ──► GENERATING ──► ... ──► TERMINATED

PENDING resets the env and renders the first prompt; GENERATING sends the ledger's ids to the
inference client (token in, token out) and appends the sampled ids exactly as returned;
PROCESSING_TOOLS parses the turn into an `Action`, steps the env (which runs the turn's tool calls
concurrently) and appends the env's messages as a delta-tokenised suffix. One handler per state.

Each call the model attempted is a typed `CallOutcome` (`agentrl.types.ParseStatus`). The parser places it
on the decoded text; the loop places it on the turn's sampled ids (`ChatTemplate.token_spans`, by
incremental decoding; the failed ones, whose spans a reader needs, while a turn whose calls all parse pays
nothing for it) before the env sees the Action, and keeps every turn's outcomes, as the env typed
them (`info["call_outcomes"]`, which `ToolEnv` fills) or else as the parser did, in
`trajectory.info["call_outcomes"]`: turn, status, tool name, [start, end) ledger positions, and the message
a failed call got. A failed call is the env's to answer; the loop never ends an episode for one.

Budgets end an episode with a reason recorded in the trajectory: `done` (the env terminated it),
`max_turns` (the env truncated it, or the loop's turn budget ran out), `max_length` (a turn was
cut by its token budget, or the episode's is spent), `timeout` (the wall-clock budget is spent) or `error`. Every await has a deadline
bounded by what is left of the episode's time. Failures of the machinery (server down, env crash,
timeout) set `fault="infra"`, so the trainer masks the episode instead of scoring it 0; a request
the server refused (`InferenceRequestError`: too long for its context, bad parameters) sets
`fault="request"`, masked too, and not retried as an infrastructure failure would be (so does a
first prompt that leaves no room under `rollout.max_total_tokens`: nothing was sampled); nothing is
dropped, every episode returns a trajectory. The loop closes the env when the episode ends.

Which budget ended a truncated episode is in `trajectory.info["truncated_by"]`: the env's own
reason (its step's `info["truncated_by"]`, e.g. `max_wall_s`) or the loop's, named by its config
key (`rollout.max_turns`, `rollout.max_total_tokens`, `rollout.max_tokens_per_turn`,
`rollout.episode_timeout_s`). When a loop budget ends an episode the env had not ended, the loop
awaits `env.atruncate(that key)` under its own deadline (`truncate_timeout_s`, not the episode's),
so an env that judges work done (SWE) grades the state it was left in; its reward and metrics
count as a last step's, and its failure is an infrastructure fault (masked), never a reward of 0.
A reward that could not be measured (`RewardMissingError` from the env's step or truncation: a
judge down, slow or unreadable, a rule function that raised) is such a fault too; the trajectory's
`info["reward_missing"]` holds its cause and message, `info["reward"]` what the sources said, and its
reward is None, as is that of every episode that failed for infrastructure reasons or on a refused
request before the env graded it (whatever rewards its earlier steps had given: the episode was not
measured to its end).

Of the env's info the trajectory keeps the numbers of `info["metrics"]`, `truncated_by`, and the
keys the env class names in `recorded_info` (SWE's `info["swe"]`: per-test statuses and the
agent's diff), copied from the episode's last info into `trajectory.info`.

The chat-template and parsing work of a turn (a few hundred microseconds) runs on the event loop,
not on a thread, paced by a `CpuGate`: when thousands of episodes become ready together, it runs
in slices of `cpu_slice_s` with socket and timer polls in between, so the loop never stalls much
longer than a slice and no work hops between threads.

It knows nothing of training, batching or weight pushes; `RolloutWorker` runs many loops at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from agentrl.chat import ChatTemplate, ConversationTokenizer
from agentrl.config import RolloutConfig
from agentrl.errors import AgentRLError, InferenceRequestError, RewardMissingError
from agentrl.rollout.pacing import CpuGate
from agentrl.sampling import sampling_params
from agentrl.types import (
    Action,
    ActionParser,
    CallOutcome,
    Fault,
    FinishReason,
    GenerateClient,
    Generation,
    Message,
    TokenOrigin,
    Trajectory,
)

if TYPE_CHECKING:
    from agentrl.envs import Env

__all__ = ["AgentLoop", "AgentLoopConfig", "EpisodeState", "end_of_turn_ids", "prompt_too_long"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")

_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "</s>", "<|endoftext|>")


class EpisodeState(enum.Enum):
    PENDING = "pending"
    GENERATING = "generating"
    PROCESSING_TOOLS = "processing_tools"
    TERMINATED = "terminated"


AgentLoopConfig = RolloutConfig
"""Budgets and sampling of one episode: the run config's `rollout` section itself, so every knob
the loop reads can be set from YAML and there is no second copy to keep in step. The loop reads
`max_turns`, `max_tokens_per_turn`, `max_total_tokens`, the sampling fields (through
`agentrl.sampling.sampling_params`: `temperature`, `top_p`, `top_k`, `min_p`, `max_kept_set`), `episode_timeout_s`, `request_timeout_s`, `close_timeout_s`, `truncate_timeout_s`, `verify_template`,
`max_starting` and `cpu_slice_s`."""


def end_of_turn_ids(tokenizer: Any) -> tuple[int, ...]:
    """The ids that end an assistant turn for this tokenizer (EOS plus known end-of-turn tokens)."""
    ids: set[int] = set()
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    vocab = tokenizer.get_vocab()
    ids.update(vocab[t] for t in _END_OF_TURN_TOKENS if t in vocab)
    return tuple(sorted(ids))


@dataclass
class _Episode:
    """The mutable state of one episode, passed from handler to handler."""

    env: Env
    conv: ConversationTokenizer
    row: dict[str, Any] | None
    seed: int | None
    deadline: float
    action: Action | None = None
    turn_start: int = 0
    """Where the latest sampled turn starts in the ledger."""
    env_open: bool = False
    """The env has been reset and has not ended the episode itself."""
    turns: int = 0
    reward: float = 0.0
    graded: bool = False  # the env settled an episode a loop budget ended (`atruncate`): its reward was measured
    last_info: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=lambda: {"generate_s": 0.0, "env_s": 0.0})

    @property
    def trajectory(self) -> Trajectory:
        return self.conv.trajectory

    def time_left(self) -> float:
        return self.deadline - time.monotonic()


class _EpisodeOver(Exception):
    """Raised inside a handler to end the episode with a reason (and maybe a fault)."""

    def __init__(self, reason: FinishReason, fault: Fault | None = None, error: str | None = None,
                 budget: str | None = None) -> None:
        super().__init__(reason.value)
        self.reason, self.fault, self.error = reason, fault, error
        self.budget = budget
        """The loop budget (its config key) that ended the episode, if one did."""


class AgentLoop:
    """Runs episodes: `await loop.run_episode(env, row=row)` returns the episode's `Trajectory`."""

    def __init__(
        self,
        client: GenerateClient,
        template: ChatTemplate,
        parser: ActionParser,
        config: AgentLoopConfig | None = None,
        *,
        stop_token_ids: tuple[int, ...] | None = None,
    ) -> None:
        self.client = client
        self.template = template
        self.parser = parser
        self.config = config or AgentLoopConfig()
        self.truncate_timeout_s = self.config.truncate_timeout_s  # the deadline of env.atruncate
        tokenizer = template.tokenizer
        self.stop_token_ids = stop_token_ids if stop_token_ids is not None else end_of_turn_ids(tokenizer)
        self._starting: asyncio.Semaphore | None = None
        self.gate = CpuGate(self.config.cpu_slice_s)
        self._handlers = {
            EpisodeState.PENDING: self._on_pending,
            EpisodeState.GENERATING: self._on_generating,
            EpisodeState.PROCESSING_TOOLS: self._on_processing_tools,
        }

    # ── driver ──────────────────────────────────────────────────────────────────────────────
    async def run_episode(
        self,
        env: Env,
        *,
        row: dict[str, Any] | None = None,
        seed: int | None = None,
        episode_id: str | None = None,
        group_id: str = "",
    ) -> Trajectory:
        """Play one episode to the end; never raises for an episode failure (see the module doc)."""
        cfg = self.config
        trajectory = Trajectory(episode_id=episode_id or uuid.uuid4().hex, group_id=group_id)
        if row is not None:
            trajectory.data_source = str(row.get("data_source", ""))
        ep = _Episode(
            env=env,
            conv=ConversationTokenizer(self.template, trajectory, verify=cfg.verify_template),
            row=row,
            seed=seed,
            deadline=time.monotonic() + cfg.episode_timeout_s,
        )
        started = time.perf_counter()
        state = EpisodeState.PENDING
        if self._starting is None:
            self._starting = asyncio.Semaphore(max(1, cfg.max_starting))
        try:
            async with self._starting:
                state = await self._on_pending(ep)
            while state is not EpisodeState.TERMINATED:
                state = await self._handlers[state](ep)
        except _EpisodeOver as over:
            try:
                over = await self._settle(ep, over)
            except asyncio.CancelledError:
                self._finish(ep, FinishReason.ERROR, "infra", "the episode was cancelled")
                raise
            self._finish(ep, over.reason, over.fault, over.error)
        except asyncio.CancelledError:
            self._finish(ep, FinishReason.ERROR, "infra", "the episode was cancelled")
            raise
        except Exception as exc:  # a bug anywhere must not lose the episode: record it, mask it
            log.exception("episode %s failed in state %s", trajectory.episode_id, state.value)
            self._finish(ep, FinishReason.ERROR, "infra", f"{type(exc).__name__}: {exc}")
        finally:
            await self._close_env(ep)
            trajectory.metrics["episode_s"] = time.perf_counter() - started
        return trajectory

    # ── handlers, one per state ─────────────────────────────────────────────────────────────
    async def _on_pending(self, ep: _Episode) -> EpisodeState:
        options: dict[str, Any] = {"episode_id": ep.trajectory.episode_id}
        if ep.row is not None:
            options["row"] = ep.row
        messages, info = await self._await(ep, ep.env.areset(seed=ep.seed, options=options), "env reset")
        ep.env_open = True
        async with self.gate:
            ids = ep.conv.start(messages, info.get("tools") or None)
        if len(ids) >= self.config.max_total_tokens:
            # Nothing was sampled, so there is nothing the policy did to score: the episode is a
            # refused request (masked, its prompt filtered), not a 0 reward, and the env has no work
            # to grade.
            ep.env_open = False
            raise _EpisodeOver(FinishReason.MAX_LENGTH, "request", prompt_too_long(len(ids), self.config.max_total_tokens),
                               budget="rollout.max_total_tokens")
        return EpisodeState.GENERATING

    async def _on_generating(self, ep: _Episode) -> EpisodeState:
        cfg = self.config
        budget = min(cfg.max_tokens_per_turn, cfg.max_total_tokens - len(ep.trajectory))
        if budget <= 0:
            raise _EpisodeOver(FinishReason.MAX_LENGTH, budget="rollout.max_total_tokens")
        sampling = sampling_params(cfg, max_tokens=budget, stop_token_ids=self.stop_token_ids)
        timeout = min(cfg.request_timeout_s, ep.time_left())
        if timeout <= 0:
            raise _EpisodeOver(FinishReason.TIMEOUT, "infra", "no time left for the next generation",
                               budget="rollout.episode_timeout_s")
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(timeout):
                generation = await self.client.generate(
                    list(ep.trajectory.token_ids), sampling, session_id=ep.trajectory.episode_id, timeout_s=timeout
                )
        except TimeoutError:
            raise self._timeout_or_error(ep, "generation", timeout) from None
        except InferenceRequestError as exc:
            raise _EpisodeOver(FinishReason.ERROR, "request", f"the server refused the request: {exc}") from exc
        except AgentRLError as exc:
            raise _EpisodeOver(FinishReason.ERROR, "infra", f"generation failed: {exc}") from exc
        finally:
            ep.timings["generate_s"] += time.perf_counter() - t0
        if generation.finish_reason == "abort":
            raise _EpisodeOver(FinishReason.ERROR, "infra", "the server aborted the generation")
        if not generation.token_ids:
            generation = Generation([], [], generation.finish_reason, generation.weight_version)
        async with self.gate:
            text = self.template.decode_turn(generation.token_ids)
            ep.action = self._parse(text, generation.token_ids)
            ep.turn_start = len(ep.trajectory)
            ep.conv.add_generation(generation, ep.action.to_message())
        ep.turns += 1
        if generation.finish_reason == "length":
            # The turn was cut by a token budget: a half-written turn is not an action (verl and
            # DAPO treat it as a truncated response, which the overlong penalty can then shape).
            which = "rollout.max_tokens_per_turn" if budget >= cfg.max_tokens_per_turn else "rollout.max_total_tokens"
            raise _EpisodeOver(FinishReason.MAX_LENGTH, budget=which)
        return EpisodeState.PROCESSING_TOOLS

    async def _on_processing_tools(self, ep: _Episode) -> EpisodeState:
        assert ep.action is not None  # set by _on_generating, the only way into this state
        t0 = time.perf_counter()
        try:
            obs, reward, terminated, truncated, info = await self._await(ep, ep.env.astep(ep.action), "env step")
        finally:
            ep.timings["env_s"] += time.perf_counter() - t0
        ep.reward += float(reward)
        ep.last_info = info if isinstance(info, dict) else {}
        self._record_outcomes(ep)
        if terminated or truncated:
            ep.env_open = False
        if terminated:
            raise _EpisodeOver(FinishReason.DONE)
        if truncated:
            raise _EpisodeOver(FinishReason.MAX_TURNS)  # the env's own reason is its info["truncated_by"]
        if ep.turns >= self.config.max_turns:
            raise _EpisodeOver(FinishReason.MAX_TURNS, budget="rollout.max_turns")
        async with self.gate:
            ids = ep.conv.add_messages(_as_messages(obs))
        if len(ids) >= self.config.max_total_tokens:
            raise _EpisodeOver(FinishReason.MAX_LENGTH, budget="rollout.max_total_tokens")
        return EpisodeState.GENERATING

    # ── helpers ─────────────────────────────────────────────────────────────────────────────
    def _parse(self, text: str, token_ids: list[int]) -> Action:
        """The turn's Action, each failed outcome placed on the sampled ids it came from."""
        action = self.parser.parse(text)
        if all(o.ok for o in action.outcomes):  # nothing to place (or a parser that types nothing)
            return action
        # Placing a span costs a dozen prefix decodes: done for the failed calls, the ones a reader has
        # to find, so a turn whose calls all parse costs what it did before outcomes existed.
        spans = self.template.token_spans(token_ids, [None if o.ok else o.chars for o in action.outcomes],
                                          text=text)
        outcomes = tuple(dataclasses.replace(o, tokens=s) for o, s in zip(action.outcomes, spans, strict=True))
        return dataclasses.replace(action, outcomes=outcomes)

    def _record_outcomes(self, ep: _Episode) -> None:
        """Keep the turn's call outcomes in `trajectory.info["call_outcomes"]`, their token spans as ledger
        positions: the env's (`info["call_outcomes"]`, typed against its tools) or else the parser's."""
        assert ep.action is not None  # the step that produced this info was given it
        given = ep.last_info.get("call_outcomes")
        outcomes = given if isinstance(given, (tuple, list)) else ep.action.call_outcomes()
        if not outcomes:
            return
        recorded = ep.trajectory.info.setdefault("call_outcomes", [])
        for o in outcomes:
            if not isinstance(o, CallOutcome):
                continue
            tokens = None if o.tokens is None else [ep.turn_start + o.tokens[0], ep.turn_start + o.tokens[1]]
            entry: dict[str, Any] = {"turn": ep.turns, "status": o.status, "tokens": tokens}
            if o.call is not None:
                entry["name"] = o.call.name
            if not o.ok:
                entry["message"] = o.message
            recorded.append(entry)

    async def _await(self, ep: _Episode, coro: Coroutine[Any, Any, _T], what: str) -> _T:
        timeout = ep.time_left()
        if timeout <= 0:
            coro.close()
            raise _EpisodeOver(FinishReason.TIMEOUT, "infra", f"no time left for the {what}",
                               budget="rollout.episode_timeout_s")
        try:
            async with asyncio.timeout(timeout):
                return await coro
        except TimeoutError:
            raise self._timeout_or_error(ep, what, timeout) from None
        except AgentRLError as exc:
            _note_reward_missing(ep.trajectory, exc)
            raise _EpisodeOver(FinishReason.ERROR, "infra", f"{what} failed: {exc}") from exc

    def _timeout_or_error(self, ep: _Episode, what: str, timeout: float) -> _EpisodeOver:
        if ep.time_left() <= 0:
            return _EpisodeOver(FinishReason.TIMEOUT, "infra", f"the episode ran out of time during the {what}",
                                budget="rollout.episode_timeout_s")
        return _EpisodeOver(FinishReason.ERROR, "infra", f"the {what} did not finish within {timeout:.1f} s")

    async def _settle(self, ep: _Episode, over: _EpisodeOver) -> _EpisodeOver:
        """Record which budget ended the episode; let the env grade one a loop budget cut short."""
        env_reason = ep.last_info.get("truncated_by")
        if over.budget is None:
            if env_reason is not None:
                ep.trajectory.info["truncated_by"] = str(env_reason)
            return over
        ep.trajectory.info["truncated_by"] = over.budget
        if not ep.env_open:
            return over
        ep.env_open = False
        limit = self.truncate_timeout_s
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(limit):
                reward, info = await ep.env.atruncate(over.budget)
        except TimeoutError:
            return _EpisodeOver(over.reason, "infra", f"the env did not settle the episode ended by {over.budget} "
                                f"within {limit:g} s", over.budget)
        except Exception as exc:  # an env failure while grading is never the policy's: mask the episode
            _note_reward_missing(ep.trajectory, exc)
            if not isinstance(exc, AgentRLError):
                log.exception("env.atruncate failed for episode %s", ep.trajectory.episode_id)
            return _EpisodeOver(over.reason, "infra", f"the env could not settle the episode ended by {over.budget}: "
                                f"{type(exc).__name__}: {exc}", over.budget)
        finally:
            ep.timings["env_s"] += time.perf_counter() - t0
        ep.reward += float(reward)
        ep.graded = True
        if isinstance(info, dict):
            metrics = {**ep.last_info.get("metrics", {}), **info.get("metrics", {})}
            ep.last_info = {**ep.last_info, **info, "metrics": metrics}
        return over

    def _finish(self, ep: _Episode, reason: FinishReason, fault: Fault | None, error: str | None) -> None:
        t = ep.trajectory
        t.finish_reason = reason
        t.fault = fault
        t.error = error
        # Not measured (a reward source failed, or the episode broke for infrastructure reasons or on a
        # refused request before the env graded it, whatever it had collected): no number, never 0. An
        # episode the env graded after a budget ended it keeps that grade, masked or not.
        unmeasured = "reward_missing" in t.info or (fault in ("infra", "request") and not ep.graded)
        t.reward = None if unmeasured else ep.reward
        env_metrics = ep.last_info.get("metrics", {}) if isinstance(ep.last_info, dict) else {}
        t.metrics.update({k: float(v) for k, v in env_metrics.items() if isinstance(v, (int, float))})
        if isinstance(ep.last_info, dict):
            for key in getattr(ep.env, "recorded_info", ()):
                if key in ep.last_info:
                    t.info[key] = ep.last_info[key]
        t.metrics.update(ep.timings)
        t.metrics["turns"] = float(ep.turns)
        t.metrics["sampled_tokens"] = float(t.num_sampled)
        t.metrics["total_tokens"] = float(len(t))
        if ep.conv.verify and t.origins and t.origins[-1] == TokenOrigin.SAMPLED:
            # The last turn was sampled and never followed by a delta, so no re-render covered it yet.
            ep.conv.check(prefix=True)

    async def _close_env(self, ep: _Episode) -> None:
        try:
            async with asyncio.timeout(self.config.close_timeout_s):
                await ep.env.aclose()
        except Exception as exc:  # closing must never lose the trajectory
            log.warning("closing the env of episode %s failed: %s", ep.trajectory.episode_id, exc)
            ep.trajectory.metrics["env_close_failed"] = 1.0


def _note_reward_missing(trajectory: Trajectory, exc: BaseException) -> None:
    """Keep why an episode's reward could not be measured, and what its sources said, in its info."""
    if isinstance(exc, RewardMissingError):
        trajectory.info["reward_missing"] = {"cause": exc.cause, "message": exc.detail}
        if exc.record:
            trajectory.info["reward"] = exc.record


def prompt_too_long(tokens: int, max_total_tokens: int) -> str:
    """Why a prompt of `tokens` tokens is not rolled out: no room is left to sample a token."""
    return f"prompt of {tokens} tokens over rollout.max_total_tokens={max_total_tokens}"


def _as_messages(obs: object) -> list[Message]:
    if isinstance(obs, list):
        return obs
    raise AgentRLError(f"env.step must return a list of messages as its observation, got {type(obs).__name__}")
