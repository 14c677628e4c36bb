"""Gateway sessions: one episode's chat completion calls, recorded as exact trajectory segments.

A `GatewaySession` is what one episode (one agent run) talks to. Each call's messages are compared
with the conversations the session has recorded so far, message by message (`wire.message_key`):

- When they extend a recorded conversation (its messages, then the assistant message the gateway
  returned, then anything new), the call continues that conversation's trajectory exactly as the
  AgentLoop does: the new messages are delta-tokenised with the chat template after the sampled
  tokens (`ChatTemplate.encode_delta`), so the ids sent extend the ids of the previous call and
  no sampled token is ever re-tokenised. Tool results, user turns and template tokens are masked.
- When they do not (the agent edited, truncated or summarised its history, stripped a thinking
  block, changed its tools, or started a side conversation), the call starts a new *segment*: a
  new trajectory whose prompt is the agent's messages rendered whole. Every earlier segment stays
  as it was, exact up to its last sampled token; the episode's ledger is never silently patched.
  A segment is counted as a rewrite when it shares its first message with an earlier one, and as a
  new conversation otherwise.

Nothing is written into a trajectory until its generation has succeeded, so a failed or refused
call leaves no trace and a retry of it extends the same conversation. A conversation waiting on a
generation cannot be extended by a concurrent call (that call starts its own segment).

Budgets come from the backend's config (the run's `rollout` section), as for the AgentLoop: at most `max_turns`
calls per episode, `max_tokens_per_turn` per call, `max_total_tokens` per trajectory, and
`request_timeout_s` per generation. A call over budget is refused with an OpenAI-style 400
(`context_length_exceeded`, `max_turns_exceeded`) and the refusal is remembered, so an agent that
then gives up ends as `max_length` / `max_turns`, not as an infrastructure failure. Sampling is the
backend's (`agentrl.sampling.sampling_params` of its config, its stop ids): the trainer scores tokens at the rollout temperature, so
an agent's own `temperature` is not applied (`metrics["ignored_sampling"]` counts such calls).

A call's template and parsing work (well under a millisecond) runs inline, not through the
AgentLoop's `CpuGate`: the HTTP handling around it is not paced either, and a gate whose slices are
spent by that unpaced work keeps re-queuing its waiters (measured: seconds of waiting per call with
200 agents on a loaded machine). Big calls are the exception: a call whose text cannot fit
`max_total_tokens` (fewer characters per token than the vocabulary's longest piece is impossible)
is refused before any rendering, and new messages over 32k characters are rendered and tokenised
in a worker thread, so one agent's megabyte prompt does not stall every other session.

A generation that finishes after the episode's deadline, or after the session ended, is not
recorded: the trajectories handed over are final. The call is refused (408 / 410) and counted
(`late_calls`, `late_tokens`; a call still in flight at the hand-over counts in `late_calls`).

Text stop sequences (`stop`) are applied after generation: the answer is cut before the earliest
stop string and the sampled tokens are kept up to the one that completed it (the token API has no
text stops), so the ledger holds exactly what the model sampled and saw.

`trajectories()` ends the session: one `Trajectory` per segment, all sharing the episode's reward,
finish reason and fault, each with its `segment` (`agentrl.types.Segment(index=k, of=n)`, numbered by
`agentrl.types.label_segments`, as the AgentLoop's compacted contexts are) and
`info["tools"]`, the tool schemas its prompt rendered; the episode's
metrics (calls, segments, rewrites, tool calls, parse errors, refusals) are on the last segment,
but for `template_mismatch`, which each segment carries for itself (the trainer's on-policy gate
masks the segment whose re-render differed, and only it).
This module knows nothing of HTTP (`server.py`) or of how the agent is run (`agent_env.py`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agentrl.chat import ChatTemplate, TokenDelta
from agentrl.errors import ChatTemplateError, InferenceError, ServerUnavailableError
from agentrl.gateway.wire import ChatRequest, Completion, WireError, assistant_message, message_key
from agentrl.sampling import sampling_params
from agentrl.types import (
    Action,
    Fault,
    FinishReason,
    Generation,
    Message,
    TokenOrigin,
    Trajectory,
    label_segments,
)

if TYPE_CHECKING:
    from agentrl.envs import TurnBackend

__all__ = ["GatewaySession"]

log = logging.getLogger(__name__)

_STORED_RESPONSES = 64
# New messages longer than this (in their JSON form) are rendered and tokenised in a worker thread,
# where the tokenizer releases the GIL, so the event loop the other sessions share stays free.
_OFF_LOOP_CHARS = 32_768
# Normalisers may merge a few characters into one (NFC composes Hangul jamo 3 -> 1) before tokenising.
_NORMALISER_MERGE = 3




@dataclass
class _Segment:
    trajectory: Trajectory
    tools: list[Any] | None
    tools_key: str
    system: Message | None
    keys: list[str] = field(default_factory=list)
    turn: int = 0
    busy: bool = False
    template_mismatches: int = 0  # this segment's, for the trainer's gate (the session counts them all)


class GatewaySession:
    """One episode's calls (see the module docstring). `complete` serves one chat request."""

    def __init__(
        self, backend: TurnBackend, *, key: str, episode_id: str, group_id: str = "", data_source: str = "",
        deadline: float | None = None,
    ) -> None:
        self.backend = backend
        self.key = key
        self.episode_id = episode_id
        self.group_id = group_id
        self.data_source = data_source
        self.deadline = deadline
        self.segments: list[_Segment] = []
        self.closed = False
        self.handed_over = False  # trajectories() was called: the segments belong to the caller
        self.in_flight = 0  # calls between their match and their generation's end
        self.budget_hit: FinishReason | None = None
        self.reward: float | None = None
        # a reward given from outside (the standalone gateway's end call), if any
        self.last_finish: str | None = None
        self.started = time.monotonic()
        self.last_used = self.started
        self.stored_responses: dict[str, list[Message]] = {}
        # `handling_s` is the server's time on this session's requests, from a request's arrival to its
        # answer (generation included); minus `generate_s`, it is what the gateway itself added.
        self.counters: dict[str, float] = {
            "llm_calls": 0, "segments": 0, "rewrites": 0, "new_conversations": 0, "tool_calls": 0,
            "parse_errors": 0, "length_cut": 0, "refused_context": 0, "refused_turns": 0, "server_errors": 0,
            "ignored_sampling": 0, "template_mismatch": 0, "generate_s": 0.0, "handling_s": 0.0,
            "late_calls": 0, "late_tokens": 0, "late_tokens_after_end": 0,
        }

    # ── serving one call ────────────────────────────────────────────────────────────────────
    def time_left(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.monotonic()

    async def complete(self, request: ChatRequest) -> Completion:
        """Generate the answer to one chat request and record it; raise `WireError` if refused."""
        if self.closed:
            raise WireError("This agentrl session has ended (its episode is over); no more calls are served.",
                            status=410, code="session_closed")
        self.last_used = time.monotonic()
        backend, cfg = self.backend, self.backend.config
        if self.counters["llm_calls"] >= cfg.max_turns:
            self.counters["refused_turns"] += 1
            self.budget_hit = FinishReason.MAX_TURNS
            raise WireError(f"This episode has used its {cfg.max_turns} model calls (rollout.max_turns).",
                            code="max_turns_exceeded")
        template = backend.template
        tools = template.intern_tools(request.tools)
        tools_key = template.tools_key(tools)
        seg = self._match(request.keys, tools_key)
        start = 0 if seg is None else len(seg.keys)
        new = request.messages[start:]
        # A prompt that cannot fit is refused before any template work: rendering and tokenising
        # megabytes takes seconds of CPU (module docstring).
        least = (0 if seg is None else len(seg.trajectory.token_ids)) + _fewest_tokens(template, new)
        if least >= cfg.max_total_tokens:
            raise self._too_long(f"at least {least}")
        self.in_flight += 1
        if seg is not None:
            seg.busy = True  # no concurrent call extends it while this one renders or generates
        try:
            if sum(map(len, request.keys[start:])) > _OFF_LOOP_CHARS:
                prompt, delta = await asyncio.to_thread(self._prompt, template, seg, new, tools)
            else:
                prompt, delta = self._prompt(template, seg, new, tools)
            if self.closed:  # ended while the prompt was rendered in a worker thread
                raise WireError("This agentrl session has ended (its episode is over); no more calls are served.",
                                status=410, code="session_closed")
            room = cfg.max_total_tokens - len(prompt)
            if room < 1:
                raise self._too_long(str(len(prompt)))
            generation = await self._generate(prompt, request, min(cfg.max_tokens_per_turn, room))
        finally:
            self.in_flight -= 1
            if seg is not None:
                seg.busy = False
        if self.closed or self.time_left() <= 0:
            self._drop_late(generation)
        return self._commit(request, seg, delta, prompt, generation, tools, tools_key)

    def _prompt(self, template: ChatTemplate, seg: _Segment | None, new: list[Message], tools: list[Any] | None,
                ) -> tuple[list[int], TokenDelta | None]:
        """The ids to send: the new conversation rendered whole, or `seg`'s ledger plus the delta of `new`."""
        try:
            if seg is None:
                return list(template.first_prompt_ids(new, tools)), None
            delta = template.encode_delta(new, sampled_ids=seg.trajectory.token_ids, tools=seg.tools,
                                          system=seg.system)
        except ChatTemplateError as exc:
            raise WireError(f"The model's chat template cannot render these messages: {exc}",
                            param="messages") from exc
        return seg.trajectory.token_ids + delta.token_ids, delta

    def _too_long(self, tokens: str) -> WireError:
        limit = self.backend.config.max_total_tokens
        self.counters["refused_context"] += 1
        self.budget_hit = FinishReason.MAX_LENGTH
        return WireError(
            f"This model's maximum context length is {limit} tokens (rollout.max_total_tokens). However, your "
            f"messages resulted in {tokens} tokens. Please reduce the length of the messages.", param="messages",
            code="context_length_exceeded")

    def _drop_late(self, generation: Generation) -> None:
        """A generation that finished after the episode's deadline or end: its tokens are not recorded
        (the trajectories handed over are final) but counted, and the call is refused."""
        if self.handed_over:  # counted in the trajectories already, as a call in flight at the end
            self.counters["late_tokens_after_end"] += len(generation.token_ids)
        else:
            self.counters["late_calls"] += 1
            self.counters["late_tokens"] += len(generation.token_ids)
        log.warning("session %s: a generation of %d tokens finished after its episode %s; dropped",
                    self.episode_id, len(generation.token_ids), "ended" if self.closed else "ran out of time")
        if self.closed:
            raise WireError("This agentrl session ended while the call was generating; its answer is dropped.",
                            status=410, code="session_closed")
        raise WireError("This episode ran out of time while the call was generating; its answer is dropped.",
                        status=408, code="episode_timeout", kind="timeout_error")

    def _match(self, keys: list[str], tools_key: str) -> _Segment | None:
        """The longest recorded conversation that `keys` extend (ties: the latest), if any."""
        best: _Segment | None = None
        for seg in self.segments:
            n = len(seg.keys)
            if seg.busy or seg.tools_key != tools_key or n > len(keys) or (best is not None and n < len(best.keys)):
                continue
            if keys[:n] == seg.keys:
                best = seg
        return best

    async def _generate(self, prompt: list[int], request: ChatRequest, cap: int) -> Generation:
        backend, cfg = self.backend, self.backend.config
        budget = min(cap, request.max_tokens or cap)
        sampling = sampling_params(cfg, max_tokens=budget, stop_token_ids=backend.stop_token_ids, seed=request.seed)
        timeout = min(cfg.request_timeout_s, self.time_left())
        if timeout <= 0:
            raise WireError("This episode has run out of time.", status=408, code="episode_timeout",
                            kind="timeout_error")
        if request.ignored:
            self.counters["ignored_sampling"] += 1
        t0 = time.perf_counter()
        try:
            generation = await backend.client.generate(prompt, sampling, session_id=self.episode_id, timeout_s=timeout)
        except (ServerUnavailableError, TimeoutError) as exc:
            self.counters["server_errors"] += 1
            raise WireError(f"No inference server answered in time: {exc}", status=503, code="server_unavailable",
                            kind="server_error") from exc
        except InferenceError as exc:
            self.counters["server_errors"] += 1
            raise WireError(f"The inference server refused the request: {exc}", code="invalid_prompt") from exc
        finally:
            self.counters["generate_s"] += time.perf_counter() - t0
        if generation.finish_reason == "abort":
            self.counters["server_errors"] += 1
            raise WireError("The inference server aborted this generation (a weight update); retry the call.",
                            status=503, code="generation_aborted", kind="server_error")
        return generation

    def _commit(
        self, request: ChatRequest, seg: _Segment | None, delta: TokenDelta | None, prompt: list[int],
        generation: Generation, tools: list[Any] | None, tools_key: str,
    ) -> Completion:
        backend = self.backend
        ids, logprobs, finish = list(generation.token_ids), list(generation.logprobs), generation.finish_reason
        kept = generation.kept_sets
        text: str | None = None
        if request.stop:
            cut = _cut_at_stop(backend.template, ids, request.stop)
            if cut is not None:
                k, text = cut
                ids, logprobs, finish = ids[:k], logprobs[:k], "stop"
                kept = kept[:k] if kept is not None else None
        if text is None:
            text = backend.template.decode_turn(ids)
        action = backend.parser.parse(text) if request.parse_tools else Action(text.strip())
        # ── record: nothing was written before the generation succeeded ──
        if seg is None:
            seg = self._new_segment(request, prompt, tools, tools_key)
        else:
            t = seg.trajectory
            assert delta is not None
            for origin, run in delta.runs():
                t.extend(run, origin, seg.turn, ints=True)
            t.messages.extend(request.messages[len(seg.keys):])
            seg.keys.extend(request.keys[len(seg.keys):])
            if backend.config.verify_template:
                self._check(seg)
        seg.turn += 1
        seg.trajectory.extend(ids, TokenOrigin.SAMPLED, seg.turn, logprobs=logprobs,
                              version=generation.weight_version, kept_sets=kept)
        message = assistant_message(action.text, action.tool_calls)
        seg.trajectory.messages.append(message)
        seg.keys.append(message_key(message))
        c = self.counters
        c["llm_calls"] += 1
        c["tool_calls"] += len(action.tool_calls)
        c["parse_errors"] += len(action.parse_errors)
        c["length_cut"] += finish == "length"
        self.last_finish = finish
        # A turn cut by its budget is "length" even when calls were parsed before the cut (as the API).
        wire_finish = "length" if finish == "length" else ("tool_calls" if action.tool_calls else "stop")
        return Completion(
            model=request.model, content=action.text if (action.text or not action.tool_calls) else None,
            tool_calls=list(action.tool_calls), finish_reason=wire_finish, prompt_tokens=len(prompt),
            completion_tokens=len(ids),
            logprobs=_token_logprobs(backend, ids, logprobs) if request.logprobs else None,
        )

    def _new_segment(self, request: ChatRequest, prompt: list[int], tools: list[Any] | None,
                     tools_key: str) -> _Segment:
        t = Trajectory(episode_id=self.episode_id, group_id=self.group_id, data_source=self.data_source)
        t.extend(prompt, TokenOrigin.PROMPT, 0, ints=True)
        t.messages.extend(request.messages)
        first = request.messages[0]
        if self.segments:
            same_start = any(s.keys and s.keys[0] == request.keys[0] for s in self.segments)
            self.counters["rewrites" if same_start else "new_conversations"] += 1
            log.debug("session %s: call %d starts segment %d (%s)", self.episode_id, int(self.counters["llm_calls"]),
                      len(self.segments), "rewrite" if same_start else "new conversation")
        seg = _Segment(t, tools, tools_key, first if first.get("role") == "system" else None, list(request.keys))
        self.segments.append(seg)
        self.counters["segments"] = float(len(self.segments))
        return seg

    def _check(self, seg: _Segment) -> None:
        """Compare the ledger with a full re-render (`rollout.verify_template`), as the AgentLoop does."""
        t = seg.trajectory
        try:
            same = self.backend.template.encode_prompt(t.messages, seg.tools) == t.token_ids
        except ChatTemplateError:
            same = False
        if not same:
            self.counters["template_mismatch"] += 1
            seg.template_mismatches += 1

    def store_response(self, response_id: str, conversation: list[Message]) -> None:
        """Keep a Responses API conversation for `previous_response_id` (the latest 64 per session)."""
        if len(self.stored_responses) >= _STORED_RESPONSES:
            del self.stored_responses[next(iter(self.stored_responses))]
        self.stored_responses[response_id] = conversation

    # ── ending ──────────────────────────────────────────────────────────────────────────────
    def close(self) -> None:
        """Refuse every later call (the episode is over)."""
        self.closed = True

    def trajectories(
        self, *, reward: float | None, finish_reason: FinishReason, fault: Fault | None = None,
        error: str | None = None, metrics: dict[str, float] | None = None, info: dict[str, Any] | None = None,
    ) -> list[Trajectory]:
        """The episode's segments, closed and labelled (module docstring); empty if no call succeeded."""
        self.close()
        self.handed_over = True
        self.counters["late_calls"] += self.in_flight  # they can only finish late now: dropped then
        out = label_segments([seg.trajectory for seg in self.segments], reward=reward, finish_reason=finish_reason,
                             fault=fault, error=error)
        for seg in self.segments:
            t = seg.trajectory
            if seg.tools:
                t.info["tools"] = seg.tools  # what the prompt rendered: a re-render needs them
            t.metrics.update({"turns": float(seg.turn), "sampled_tokens": float(t.num_sampled),
                              "total_tokens": float(len(t))})
        if out:
            last = out[-1]
            last.metrics.update({k: float(v) for k, v in self.counters.items()})
            last.metrics.update(metrics or {})
            if info:
                last.info.update(info)
        for seg, t in zip(self.segments, out, strict=True):
            # Per segment, not the episode's total on its last one: the on-policy gate masks the
            # segment whose ledger a re-render does not give, and only that one.
            t.metrics["template_mismatch"] = float(seg.template_mismatches)
        return out


def _cut_at_stop(template: ChatTemplate, ids: list[int], stops: tuple[str, ...]) -> tuple[int, str] | None:
    """(tokens to keep, text before the earliest stop string) if the turn contains one, else None.

    The kept tokens end with the one that completed a stop string: the fewest whose text holds one.
    """
    if not any(s in template.decode_turn(ids) for s in stops):
        return None
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in template.decode_turn(ids[:mid]) for s in stops):
            hi = mid
        else:
            lo = mid + 1
    text = template.decode_turn(ids[:lo])
    at = min(text.find(s) for s in stops if s in text)
    return lo, text[:at]


def _fewest_tokens(template: ChatTemplate, messages: list[Message]) -> int:
    """A lower bound on the tokens `messages` render to, from their text alone (no rendering).

    Templates render system, user and tool content whole (some trim it); assistant content is not
    counted (templates may drop old thinking). No token covers more characters than the longest
    piece of the vocabulary, after the normaliser merged at most `_NORMALISER_MERGE` into one.
    """
    try:
        longest = _longest_piece(template.tokenizer)
    except TypeError:  # an unhashable tokenizer: read its vocabulary every time (milliseconds)
        longest = _longest_piece.__wrapped__(template.tokenizer)
    if longest is None:
        return 0
    chars = sum(len(m["content"].strip()) for m in messages
                if m.get("role") != "assistant" and isinstance(m.get("content"), str))
    return chars // (longest * _NORMALISER_MERGE)


@functools.lru_cache(maxsize=8)
def _longest_piece(tokenizer: Any) -> int | None:
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # a tokenizer without a vocabulary to read: no pre-check
        return None
    return max((len(piece) for piece in vocab), default=0) or None


def _token_logprobs(backend: TurnBackend, ids: list[int], logprobs: list[float]) -> list[tuple[str, float]]:
    tok = backend.template.tokenizer
    stop = set(backend.stop_token_ids)
    n = len(ids)
    while n and ids[n - 1] in stop:
        n -= 1
    return [(tok.decode([i]), lp) for i, lp in zip(ids[:n], logprobs[:n], strict=True)]
