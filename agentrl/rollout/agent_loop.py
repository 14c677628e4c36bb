"""The AgentLoop: one episode of a model acting in an environment, as an explicit state machine.

    PENDING ──► GENERATING ──► PROCESSING_TOOLS ──► GENERATING ──► ... ──► TERMINATED
                                      │    ▲
                                      ▼    │  (rollout.compaction on, the context is full)
                                    COMPACTING

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

Long episodes (`rollout.compaction`, `agentrl.rollout.compaction`): when a tool result would take the
context past the policy's high watermark, PROCESSING_TOOLS hands it to COMPACTING, which closes the
context as a trajectory segment and opens the next (a rule that truncates old tool outputs, or a
sampled summary turn first). `run_episode_segments` returns every segment, numbered by
`agentrl.types.label_segments` as the gateway's are, all with the episode's reward, finish reason and
fault. `rollout.max_total_tokens` is then one context's budget; the episode's are `rollout.max_turns`
(summary turns count), `rollout.episode_timeout_s` and `rollout.compaction.max_sampled_tokens`. The
last segment carries the episode's metrics (`turns` and `sampled_tokens` of the whole episode,
`segments`, `compactions`); an earlier one its own `turns`, `sampled_tokens` and `total_tokens`.

Per-turn rewards: a step whose info has `turn_reward` (a number, or None where its source failed)
gives the reward of the turn it answered; it lands in `trajectory.turn_rewards[k - 1]` for turn k of
the segment's ledger (None for turns without one, never 0). The step's `reward` is the episode's
outcome as always (summed over steps).

It knows nothing of training, batching or weight pushes; `RolloutWorker` runs many loops at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import math
import time
import uuid
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from agentrl.chat import ChatTemplate, ConversationTokenizer
from agentrl.config import RolloutConfig
from agentrl.errors import AgentRLError, InferenceRequestError, RewardMissingError
from agentrl.rollout.compaction import Compaction, dropped_tool_outputs, summary_context, task_messages
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
    ToolSchema,
    Trajectory,
    label_segments,
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
    COMPACTING = "compacting"
    TERMINATED = "terminated"


AgentLoopConfig = RolloutConfig
"""Budgets and sampling of one episode: the run config's `rollout` section itself, so every knob
the loop reads can be set from YAML and there is no second copy to keep in step. The loop reads
`max_turns`, `max_tokens_per_turn`, `max_total_tokens`, the sampling fields (through
`agentrl.sampling.sampling_params`: `temperature`, `top_p`, `top_k`, `min_p`, `max_kept_set`), `episode_timeout_s`, `request_timeout_s`, `close_timeout_s`, `truncate_timeout_s`, `verify_template`,
`max_starting`, `cpu_slice_s` and `compaction` (through `Compaction.from_config`)."""


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
    sampled: int = 0
    """Tokens sampled in the episode, over all its contexts."""
    closed: list[Trajectory] = field(default_factory=list)
    """The contexts compaction closed, in order (the current one is `conv`'s)."""
    tools: list[ToolSchema] | None = None
    task: list[Message] = field(default_factory=list)
    """The episode's first messages (system prompt, task): what a summary's new context starts from."""
    pending: list[Message] = field(default_factory=list)
    """A tool result that takes the context past the high watermark, for COMPACTING to place."""
    counts: dict[str, float] = field(default_factory=lambda: {"summary_turns": 0.0, "tool_outputs_cut": 0.0})
    """What compaction did, for the last segment's metrics."""

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
        self.compaction = Compaction.from_config(self.config)
        self._handlers = {
            EpisodeState.PENDING: self._on_pending,
            EpisodeState.GENERATING: self._on_generating,
            EpisodeState.PROCESSING_TOOLS: self._on_processing_tools,
            EpisodeState.COMPACTING: self._on_compacting,
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
        """Play one episode to the end and return its trajectory; never raises for an episode failure (see
        the module doc). An episode compaction played in several contexts raises ValueError (after it
        ended): call `run_episode_segments` when `rollout.compaction` is on."""
        segments = await self.run_episode_segments(env, row=row, seed=seed, episode_id=episode_id, group_id=group_id)
        if len(segments) != 1:
            raise ValueError(f"episode {segments[0].episode_id} was played in {len(segments)} contexts "
                             "(rollout.compaction); call run_episode_segments to get every segment")
        return segments[0]

    async def run_episode_segments(
        self,
        env: Env,
        *,
        row: dict[str, Any] | None = None,
        seed: int | None = None,
        episode_id: str | None = None,
        group_id: str = "",
    ) -> list[Trajectory]:
        """Play one episode to the end: its trajectory, or one per context when compaction closed some."""
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
            ep.trajectory.metrics["episode_s"] = time.perf_counter() - started
        return [*ep.closed, ep.trajectory]

    # ── handlers, one per state ─────────────────────────────────────────────────────────────
    async def _on_pending(self, ep: _Episode) -> EpisodeState:
        options: dict[str, Any] = {"episode_id": ep.trajectory.episode_id}
        if ep.row is not None:
            options["row"] = ep.row
        messages, info = await self._await(ep, ep.env.areset(seed=ep.seed, options=options), "env reset")
        ep.env_open = True
        ep.tools = info.get("tools") or None
        ep.task = task_messages(messages)
        async with self.gate:
            ids = ep.conv.start(messages, ep.tools)
        if len(ids) >= self.config.max_total_tokens:
            # Nothing was sampled, so there is nothing the policy did to score: the episode is a
            # refused request (masked, its prompt filtered), not a 0 reward, and the env has no work
            # to grade.
            ep.env_open = False
            raise _EpisodeOver(FinishReason.MAX_LENGTH, "request", prompt_too_long(len(ids), self.config.max_total_tokens),
                               budget="rollout.max_total_tokens")
        return EpisodeState.GENERATING

    async def _on_generating(self, ep: _Episode) -> EpisodeState:
        budget, which = self._turn_budget(ep, self.config.max_tokens_per_turn, "rollout.max_tokens_per_turn")
        generation = await self._generate(ep, budget)
        async with self.gate:
            text = self.template.decode_turn(generation.token_ids)
            ep.action = self._parse(text, generation.token_ids)
            ep.turn_start = len(ep.trajectory)
            ep.conv.add_generation(generation, ep.action.to_message())
        ep.turns += 1
        ep.sampled += len(generation.token_ids)
        if generation.finish_reason == "length":
            # The turn was cut by a token budget: a half-written turn is not an action (verl and
            # DAPO treat it as a truncated response, which the overlong penalty can then shape).
            raise _EpisodeOver(FinishReason.MAX_LENGTH, budget=which)
        return EpisodeState.PROCESSING_TOOLS

    def _turn_budget(self, ep: _Episode, cap: int, cap_key: str) -> tuple[int, str]:
        """(most tokens the next turn may sample, the budget's config key that sets it); ends the episode
        when a budget is spent."""
        limits = [(cap, cap_key), (self.config.max_total_tokens - len(ep.trajectory), "rollout.max_total_tokens")]
        if self.compaction is not None and self.compaction.max_sampled_tokens is not None:
            limits.append((self.compaction.max_sampled_tokens - ep.sampled, "rollout.compaction.max_sampled_tokens"))
        budget, which = min(limits, key=lambda limit: limit[0])
        if budget <= 0:
            raise _EpisodeOver(FinishReason.MAX_LENGTH, budget=which)
        return budget, which

    async def _generate(self, ep: _Episode, budget: int) -> Generation:
        """One generation on the current context's ids, under the episode's deadline."""
        cfg = self.config
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
        return generation

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
        if "turn_reward" in ep.last_info:
            _record_turn_reward(ep.trajectory, ep.conv.turn, ep.last_info["turn_reward"])
        if terminated or truncated:
            ep.env_open = False
        if terminated:
            raise _EpisodeOver(FinishReason.DONE)
        if truncated:
            raise _EpisodeOver(FinishReason.MAX_TURNS)  # the env's own reason is its info["truncated_by"]
        if ep.turns >= self.config.max_turns:
            raise _EpisodeOver(FinishReason.MAX_TURNS, budget="rollout.max_turns")
        messages = _as_messages(obs)
        if self.compaction is None:
            async with self.gate:
                ids = ep.conv.add_messages(messages)
            if len(ids) >= self.config.max_total_tokens:
                raise _EpisodeOver(FinishReason.MAX_LENGTH, budget="rollout.max_total_tokens")
            return EpisodeState.GENERATING
        async with self.gate:
            delta = ep.conv.preview(messages)
            if len(ep.trajectory) + len(delta.token_ids) < self.compaction.high_tokens:
                ep.conv.add_delta(delta, messages)
                return EpisodeState.GENERATING
        ep.pending = messages
        return EpisodeState.COMPACTING

    async def _on_compacting(self, ep: _Episode) -> EpisodeState:
        """Close the full context as a segment and open the next (`agentrl.rollout.compaction`)."""
        assert self.compaction is not None  # the only way into this state
        pending, ep.pending = ep.pending, []
        if self.compaction.kind == "summary":
            messages = summary_context(ep.task, await self._summarise(ep, pending))
            if ep.turns >= self.config.max_turns:  # the summary was the last turn the episode had
                raise _EpisodeOver(FinishReason.MAX_TURNS, budget="rollout.max_turns")
        else:
            async with self.gate:
                messages, dropped = dropped_tool_outputs(
                    [*ep.trajectory.messages, *pending], count=self._context_tokens(ep), count_text=self._text_tokens,
                    low_tokens=self.compaction.low_tokens, keep_chars=self.compaction.tool_output_chars)
            ep.counts["tool_outputs_cut"] += dropped
        async with self.gate:
            self._open_context(ep, messages)
        if len(ep.trajectory) >= self.compaction.high_tokens:
            # What the policy keeps (the task, the latest tool result, a summary) fills a context by itself.
            raise _EpisodeOver(FinishReason.MAX_LENGTH, budget="rollout.max_total_tokens")
        return EpisodeState.GENERATING

    async def _summarise(self, ep: _Episode, pending: list[Message]) -> str:
        """Ask for a summary after the tool result in the full context; its turn is sampled (and trained)."""
        assert self.compaction is not None
        messages = [*pending, self.compaction.summary_request()]
        async with self.gate:
            delta = ep.conv.preview(messages)
            if len(ep.trajectory) + len(delta.token_ids) >= self.config.max_total_tokens:
                raise _EpisodeOver(FinishReason.MAX_LENGTH, budget="rollout.max_total_tokens")
            ep.conv.add_delta(delta, messages)
        budget, which = self._turn_budget(ep, self.compaction.summary_max_tokens,
                                          "rollout.compaction.summary_max_tokens")
        generation = await self._generate(ep, budget)
        async with self.gate:
            text = self.template.decode_turn(generation.token_ids)
            ep.turn_start = len(ep.trajectory)
            ep.conv.add_generation(generation, {"role": "assistant", "content": text})
        ep.turns += 1
        ep.sampled += len(generation.token_ids)
        ep.counts["summary_turns"] += 1
        if generation.finish_reason == "length" and which != "rollout.compaction.summary_max_tokens":
            raise _EpisodeOver(FinishReason.MAX_LENGTH, budget=which)
        return text.strip()  # a summary cut by its own budget is still the summary the policy wrote

    def _open_context(self, ep: _Episode, messages: list[Message]) -> None:
        """Close the current context (a segment of the episode) and start the next one on `messages`."""
        old = ep.trajectory
        if ep.conv.verify and old.origins and old.origins[-1] == TokenOrigin.SAMPLED:
            ep.conv.check(prefix=True)
        old.metrics.update({"turns": float(ep.conv.turn), "sampled_tokens": float(old.num_sampled),
                            "total_tokens": float(len(old))})
        ep.closed.append(old)
        new = Trajectory(episode_id=old.episode_id, group_id=old.group_id, data_source=old.data_source)
        ep.conv = ConversationTokenizer(self.template, new, verify=self.config.verify_template)
        ep.conv.start(messages, ep.tools)

    def _context_tokens(self, ep: _Episode) -> Callable[[Sequence[Message]], int]:
        """Counts the tokens of a context of the episode's tools and `messages`, rendered whole."""
        tools = ep.conv.tools
        return lambda messages: len(self.template.encode_prompt(messages, tools))

    def _text_tokens(self, text: str) -> int:
        """Counts the tokens of one message's text."""
        return len(self.template.tokenizer.encode(text, add_special_tokens=False))

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
        # Not measured (a reward source failed, or the episode broke for infrastructure reasons or on a
        # refused request before the env graded it, whatever it had collected): no number, never 0. An
        # episode the env graded after a budget ended it keeps that grade, masked or not.
        unmeasured = "reward_missing" in t.info or (fault in ("infra", "request") and not ep.graded)
        label_segments([*ep.closed, t], reward=None if unmeasured else ep.reward, finish_reason=reason, fault=fault,
                       error=error, number_one=False)
        env_metrics = ep.last_info.get("metrics", {}) if isinstance(ep.last_info, dict) else {}
        t.metrics.update({k: float(v) for k, v in env_metrics.items() if isinstance(v, (int, float))})
        if isinstance(ep.last_info, dict):
            for key in getattr(ep.env, "recorded_info", ()):
                if key in ep.last_info:
                    t.info[key] = ep.last_info[key]
        t.metrics.update(ep.timings)
        t.metrics["turns"] = float(ep.turns)
        t.metrics["sampled_tokens"] = float(ep.sampled)
        t.metrics["total_tokens"] = float(len(t))
        if self.compaction is not None:
            t.metrics["segments"] = float(len(ep.closed) + 1)
            t.metrics["compactions"] = float(len(ep.closed))
            t.metrics.update(ep.counts)
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


def _record_turn_reward(trajectory: Trajectory, turn: int, value: object) -> None:
    """Put a step's `info["turn_reward"]` at `turn_rewards[turn - 1]` (None: given as missing, kept so)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                              or not math.isfinite(value)):
        raise AgentRLError(f"an env step's info['turn_reward'] must be a finite number, or None where its source "
                           f"failed; got {value!r}")
    rewards = trajectory.turn_rewards
    rewards.extend([None] * (turn - len(rewards)))
    rewards[turn - 1] = None if value is None else float(value)


def _as_messages(obs: object) -> list[Message]:
    if isinstance(obs, list):
        return obs
    raise AgentRLError(f"env.step must return a list of messages as its observation, got {type(obs).__name__}")
