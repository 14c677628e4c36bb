"""Core data types shared by every layer: messages, tool calls, sampling, generations, trajectories.

These are plain dataclasses and TypedDicts, cheap to build in hot loops and easy to serialise to
JSON. The centre is `Trajectory`, the token ledger of one episode (DESIGN.md §4): for every token
its origin, its turn, its rollout logprob and the policy version that sampled it. An episode that
an external agent recorded as several trajectories gives each its `Segment`, and `final_segments`
counts such an episode once.

The two protocols every layer that plays episodes meets at are here too, once: `GenerateClient`
(token in, token out; the inference clients and the router implement it, the AgentLoop and the
gateway call it) and `ActionParser` (assistant text to an `Action`; the tool-call parsers
implement it). So is what a training step reports back to the run (`StepReport`: its metrics and
the on-policy gate's per-row decisions, `GatedRow`), which the trainer writes and the orchestration
reads without importing torch. Nothing here talks to a model, an environment or a sandbox; that is
what the layers above do.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from enum import IntEnum, StrEnum
from typing import Any, Literal, Protocol, TypedDict, get_args, runtime_checkable

__all__ = [
    "GATE_REASONS",
    "MASK_CAUSES",
    "PARSE_STATUSES",
    "Action",
    "ActionParser",
    "CallOutcome",
    "ExecResult",
    "Fault",
    "FinishReason",
    "GateReason",
    "GatedRow",
    "GenerateClient",
    "Generation",
    "MaskCause",
    "Message",
    "ParseStatus",
    "Role",
    "SamplingParams",
    "Segment",
    "StepReport",
    "TokenOrigin",
    "ToolCall",
    "ToolResult",
    "ToolSchema",
    "Trajectory",
    "final_segments",
    "is_final_segment",
    "is_first_segment",
    "label_segments",
    "truncates_vocabulary",
]

Role = Literal["system", "user", "assistant", "tool"]
Fault = Literal["model", "infra", "request"]


class Message(TypedDict, total=False):
    """One chat message, in the shape Hugging Face chat templates and OpenAI APIs accept."""

    role: Role
    content: str
    tool_calls: list[dict[str, Any]]
    tool_call_id: str
    name: str
    reasoning_content: str


class ToolSchema(TypedDict):
    """An OpenAI function-tool schema: `{"type": "function", "function": {...}}`."""

    type: Literal["function"]
    function: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A tool call parsed from model text.

    `arguments` is the decoded JSON object; `raw` is the exact text it was parsed from, kept so that
    the sampled tokens never need to be re-rendered from the parsed form.
    """

    name: str
    arguments: dict[str, Any]
    id: str = ""
    raw: str = ""

    def to_message_dict(self) -> dict[str, Any]:
        """The OpenAI/HF `tool_calls` entry for this call."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


ParseStatus = Literal["ok", "invalid_json", "unclosed_block", "missing_name", "unknown_tool", "bad_arguments",
                     "malformed"]
"""What became of one tool call the model attempted.

- `ok`: it parsed, names a tool the episode has, and its arguments fit that tool's schema.
- `invalid_json`: its body is not well formed in the family's syntax (JSON for the JSON families; the
  `<parameter=...>` / `<arg_key>` markup for qwen3_coder and glm45), or there is text where none may be.
- `unclosed_block`: it is cut off: its block, message or JSON never ends (a turn cut mid-argument).
- `missing_name`: no function name can be read from it.
- `unknown_tool`: it names a function the episode does not offer (the tool env decides, or gpt_oss for a
  harmony built-in such as `browser.search`).
- `bad_arguments`: its arguments are not a JSON object, or do not fit the tool's JSON schema (the tool env
  decides the latter with the tool's own validation).
- `malformed`: a parse error from a parser that reports no status (one written against `parse_errors` only).
"""

PARSE_STATUSES: tuple[ParseStatus, ...] = get_args(ParseStatus)


@dataclass(frozen=True, slots=True)
class CallOutcome:
    """One tool call the model attempted, typed: its status, the call when one was read, what the model is
    told when it failed, and where it came from.

    `chars` is its [start, end) in the turn's decoded text (what the parser read); `tokens` the same span in
    the turn's sampled token ids (index 0 is the turn's first sampled token), set by the AgentLoop from
    `chars` for the outcomes that failed in the parser (None until then, for `ok` ones, whose text is
    `call.raw`, and for outcomes a parser could not place).
    """

    status: ParseStatus
    call: ToolCall | None = None
    message: str = ""
    chars: tuple[int, int] | None = None
    tokens: tuple[int, int] | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass(frozen=True, slots=True)
class Action:
    """One assistant turn as the environment receives it in `Env.step`.

    `text` is the decoded assistant message; `tool_calls` are the calls parsed from it;
    `parse_errors` describes text that looked like a tool call but was malformed (the environment
    answers each with an error message, so the model can learn from it). `outcomes`, when the parser
    gives them (agentrl's do), type every call attempted, in order: the `ok` ones are `tool_calls`, the
    others' messages are among `parse_errors`. A parser that fills only the first three fields still
    works: `call_outcomes()` derives outcomes from them.
    """

    text: str
    tool_calls: tuple[ToolCall, ...] = ()
    parse_errors: tuple[str, ...] = ()
    outcomes: tuple[CallOutcome, ...] = field(default=(), compare=False)
    """Left out of `==`, so that Actions compare as they did before outcomes existed."""

    def to_message(self) -> Message:
        msg: Message = {"role": "assistant", "content": self.text}
        if self.tool_calls:
            msg["tool_calls"] = [c.to_message_dict() for c in self.tool_calls]
        return msg

    def call_outcomes(self) -> tuple[CallOutcome, ...]:
        """`outcomes`, or for a parser that gives none, one `ok` per call and one `malformed` per parse error
        (without spans)."""
        if self.outcomes:
            return self.outcomes
        return (*(CallOutcome("ok", call) for call in self.tool_calls),
                *(CallOutcome("malformed", message=err) for err in self.parse_errors))


@dataclass(frozen=True, slots=True)
class ToolResult:
    """What a tool call produced: the text the model sees, and whose fault a failure was."""

    content: str
    fault: Fault | None = None
    tool_name: str = ""
    tool_call_id: str = ""
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.fault is None

    def to_message(self) -> Message:
        msg: Message = {"role": "tool", "content": self.content}
        if self.tool_call_id:
            msg["tool_call_id"] = self.tool_call_id
        if self.tool_name:
            msg["name"] = self.tool_name
        return msg


@dataclass(frozen=True, slots=True)
class ExecResult:
    """The outcome of running a command or program in a sandbox.

    `killed_reason` is None for a normal exit, else one of "timeout", "memory", "output",
    "signal", "cpu" (why the sandbox ended the process) or "closed" (its session was closed mid-job).
    """

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool = False
    killed_reason: str | None = None
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.killed_reason is None


def truncates_vocabulary(temperature: float, top_p: float, top_k: int, min_p: float) -> bool:
    """Whether these settings sample from fewer tokens than the whole vocabulary (so the tokens
    kept, the *kept set*, must be recorded for the trainer to score under the same distribution).
    Greedy decoding (temperature 0) keeps one token and is never replayed: the trainer cannot
    score at temperature 0."""
    return temperature > 0 and (top_p < 1.0 or top_k > 0 or min_p > 0.0)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How a server samples one generation.

    The kept set of a sampled token is the set of tokens it was drawn from: temperature first, then
    `min_p`, `top_k` and `top_p` (vLLM's order; `agentrl.kept_set`). When the settings
    truncate the vocabulary, a server answers each token's kept set (up to `max_kept_set` members;
    a larger one is reported as overflowed) so the trainer can replay it.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 512
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: bool = True
    min_p: float = 0.0
    max_kept_set: int = 128

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")
        if self.max_kept_set < 1:
            raise ValueError(f"max_kept_set must be >= 1, got {self.max_kept_set}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")

    @property
    def truncates(self) -> bool:
        """Whether tokens are drawn from a kept set smaller than the vocabulary."""
        return truncates_vocabulary(self.temperature, self.top_p, self.top_k, self.min_p)


@dataclass(frozen=True, slots=True)
class Generation:
    """A server's answer to one token-in request: the sampled ids and their logprobs.

    `finish_reason` is "stop" (EOS or stop sequence), "length" (max_tokens) or "abort" (the server
    cancelled the request, e.g. for a weight update). `weight_version` is the policy version of
    the weights that sampled these tokens. `kept_sets` is None when the sampling kept the whole
    vocabulary, else one sorted list of token ids per sampled token: the set it was drawn from, or
    `[]` when that set was larger than the request's `max_kept_set` (overflowed, not recorded).
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length", "abort"]
    weight_version: int = 0
    server_id: str = ""
    kept_sets: list[list[int]] | None = None

    def __post_init__(self) -> None:
        if self.logprobs and len(self.logprobs) != len(self.token_ids):
            raise ValueError(
                f"Generation has {len(self.token_ids)} tokens but {len(self.logprobs)} logprobs"
            )
        if self.kept_sets is not None and len(self.kept_sets) != len(self.token_ids):
            raise ValueError(
                f"Generation has {len(self.token_ids)} tokens but {len(self.kept_sets)} kept sets"
            )


@runtime_checkable
class GenerateClient(Protocol):
    """Token in, token out: the one call the AgentLoop and the gateway make to inference.

    `generate` samples a continuation of `prompt_ids` (never re-tokenised text) and returns the
    sampled ids with their logprobs and the weight version that sampled them. `session_id` keeps
    the turns of one episode on one server (prefix cache); `timeout_s` is the call's deadline (None:
    the client's default). A server that cannot answer raises `ServerUnavailableError`, a request
    it refuses `InferenceRequestError`. `agentrl.inference` implements it (`HTTPServerClient`,
    `Router`, the engine adapters) and adds what owners of a client need (`InferenceClient`).
    """

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        *,
        session_id: str,
        timeout_s: float | None = None,
    ) -> Generation: ...


@runtime_checkable
class ActionParser(Protocol):
    """Reads an assistant turn's text into an `Action`: the tool calls in it, and the malformed ones
    as `parse_errors` (never raises for model text). The tool-call parsers of `agentrl.tools`
    (`ToolCallParser`: hermes, llama3, mistral, retool and the families of `parsers_more`) implement it,
    and also type every call attempted (`Action.outcomes`, each with its span in `text`); a parser may
    leave `outcomes` empty."""

    def parse(self, text: str) -> Action: ...


class TokenOrigin(IntEnum):
    """Where a token in the ledger came from. Only SAMPLED tokens are trained on."""

    PROMPT = 0
    SAMPLED = 1
    TEMPLATE = 2
    TOOL = 3


class FinishReason(StrEnum):
    """Why an episode ended."""

    DONE = "done"
    MAX_TURNS = "max_turns"
    MAX_LENGTH = "max_length"
    TIMEOUT = "timeout"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class Segment:
    """Where a trajectory sits in an episode recorded as several: segment `index` (0-based) of `of`.

    An external agent that rewrites its history mid-episode (the gateway, `agentrl.gateway.session`)
    produces one trajectory per conversation it held; they share the episode's `episode_id`,
    `group_id` and reward, and each carries its `Segment`. An episode played in one piece has none.
    """

    index: int
    of: int

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.of:
            raise ValueError(f"segment index must be in [0, {self.of}), got {self.index}")

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> Segment | None:
        """The segment a `{"index": k, "of": n}` mapping describes (None stays None)."""
        return None if d is None else cls(index=int(d["index"]), of=int(d["of"]))


def label_segments(
    trajectories: Sequence[Trajectory], *, reward: float | None, finish_reason: FinishReason, fault: Fault | None = None,
    error: str | None = None, number_one: bool = True,
) -> list[Trajectory]:
    """Close an episode recorded as `trajectories` (one per context, in order): each gets the episode's
    reward, finish reason, fault and error, and its `Segment(index=k, of=n)`; an episode in one piece
    is numbered `Segment(0, 1)` only with `number_one` (the gateway's: its agent may rewrite; the
    AgentLoop leaves an episode it played in one context unnumbered, as it always has).

    The one place segments are numbered: the gateway's sessions (an agent that rewrote its history) and
    the AgentLoop's compaction (a context closed when it was full) both end their episodes here.
    """
    out = list(trajectories)
    n = len(out)
    for k, t in enumerate(out):
        t.reward, t.finish_reason, t.fault, t.error = reward, finish_reason, fault, error
        if n > 1 or number_one:
            t.segment = Segment(index=k, of=n)
    return out


def is_final_segment(t: Trajectory) -> bool:
    """True for the last segment of an episode (and for every trajectory that has no segments)."""
    return t.segment is None or t.segment.index == t.segment.of - 1


def is_first_segment(t: Trajectory) -> bool:
    """True for the first segment of an episode (the one whose prompt is the dataset row's)."""
    return t.segment is None or t.segment.index == 0


def final_segments(trajectories: Sequence[Trajectory]) -> list[Trajectory]:
    """One trajectory per episode: the last segment of each (for per-episode counts and pass rates)."""
    return [t for t in trajectories if is_final_segment(t)]


@dataclass
class Trajectory:
    """The token ledger of one episode.

    Parallel lists hold one entry per token: `token_ids`, `origins` (a `TokenOrigin`), `turns`
    (0 for the first prompt, k for tokens produced or appended at turn k), `logprobs` (the rollout
    logprob for sampled tokens, 0.0 elsewhere) and `versions` (the policy version that sampled the
    token, -1 for tokens that were not sampled). `response_mask` is 1 exactly on sampled tokens.

    `fault` marks why an episode that ended in `error` failed: "infra" episodes are masked out of
    the loss by the trainer instead of being scored 0 (`trainable` is False); "request" episodes
    were refused by the server (a prompt longer than its context, bad parameters): they are not
    trained on either, and their prompt is filtered with the reason instead of being retried;
    "model" errors are the policy's own and are trained on.

    `segment` is set when the episode was recorded as several trajectories (`Segment`), else None.

    `kept_sets` holds, for each sampled token in ledger order, the sorted ids of the kept set it was
    drawn from (`Generation.kept_sets`; `[]`: the set overflowed the cap and was not recorded, and
    the trainer masks that token out of the loss). It is empty when the rollout kept the whole
    vocabulary: then nothing is stored and the trainer scores over the whole vocabulary.

    Three typed extensions carry what objectives other than one end-of-episode reward read (empty
    or None when unused; files written before them read as unused):
    - `seat`: the seat (a player or role an environment declares) whose policy sampled this
      trajectory's tokens. An episode played by several seats is recorded as one trajectory per
      seat, sharing `episode_id` and `group_id`; advantages are computed per seat (each seat's
      trajectories form their own groups). None: the environment has one policy.
    - `teacher_logprobs`: parallel to `logprobs`, the logprob a teacher model gave each sampled
      token in the same context (0.0 on every other token); the per-token distillation signal is
      `teacher_logprobs - logprobs` on sampled tokens only. Empty: no teacher scored the episode
      (an episode whose teacher failed is an infrastructure failure, never scored as 0).
    - `turn_rewards`: the reward given for the action of each turn, `turn_rewards[k - 1]` for turn
      k (the `turns` number of its sampled tokens), None where none was given or its source failed
      (masked, never read as 0). Empty: the episode has only its final `reward`.
    """

    token_ids: list[int] = field(default_factory=list)
    origins: list[int] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    reward: float | None = None
    finish_reason: FinishReason | None = None
    fault: Fault | None = None
    error: str | None = None
    episode_id: str = ""
    group_id: str = ""
    data_source: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    segment: Segment | None = None
    kept_sets: list[list[int]] = field(default_factory=list)
    seat: str | None = None
    teacher_logprobs: list[float] = field(default_factory=list)
    turn_rewards: list[float | None] = field(default_factory=list)

    # ── building ────────────────────────────────────────────────────────────────────────────
    def extend(
        self,
        token_ids: Sequence[int],
        origin: TokenOrigin,
        turn: int,
        logprobs: Sequence[float] | None = None,
        version: int = -1,
        *,
        ints: bool = False,
        kept_sets: Sequence[Sequence[int]] | None = None,
    ) -> None:
        """Append tokens of one origin. Sampled tokens need their logprobs and policy version, and
        their kept sets when the rollout truncated the vocabulary (all sampled tokens of a ledger
        have one, or none does).

        Ids are converted to Python ints (servers and tensors hand out numpy integers); `ints=True`
        says they are ints already (agentrl's own tokenisation), which skips the conversion.
        """
        n = len(token_ids)
        if origin == TokenOrigin.SAMPLED:
            if logprobs is None or len(logprobs) != n:
                got = "none" if logprobs is None else len(logprobs)
                raise ValueError(f"{n} sampled tokens need {n} rollout logprobs, got {got}")
            if version < 0:
                raise ValueError(f"sampled tokens need a policy version >= 0, got {version}")
            if n:
                self._extend_kept_sets(n, kept_sets)
            self.logprobs.extend(map(float, logprobs))
            self.versions.extend([version] * n)
        else:
            if logprobs is not None or kept_sets is not None:
                raise ValueError(f"only sampled tokens carry logprobs and kept sets, not {origin.name} tokens")
            self.logprobs.extend([0.0] * n)
            self.versions.extend([-1] * n)
        self.token_ids.extend(token_ids if ints else map(int, token_ids))
        self.origins.extend([int(origin)] * n)
        self.turns.extend([turn] * n)

    def _extend_kept_sets(self, n: int, kept_sets: Sequence[Sequence[int]] | None) -> None:
        if kept_sets is None:
            if self.kept_sets:
                raise ValueError(f"{n} sampled tokens come without kept sets, but this ledger records them; "
                                 "every generation of an episode must be sampled with the same settings")
            return
        if len(kept_sets) != n:
            raise ValueError(f"{n} sampled tokens need {n} kept sets, got {len(kept_sets)}")
        # Counting the sampled tokens walks the ledger: only where it can matter (no kept set recorded yet),
        # so that a turn's append costs the same at turn 100 as at turn 2.
        if not self.kept_sets and self.num_sampled > 0:
            raise ValueError("sampled tokens with kept sets follow tokens sampled without; every "
                             "generation of an episode must be sampled with the same settings")
        self.kept_sets.extend([int(t) for t in kept] for kept in kept_sets)

    @property
    def kept_set_overflows(self) -> int:
        """Sampled tokens whose kept set overflowed the cap (stored as `[]`, masked out of the loss)."""
        return sum(1 for kept in self.kept_sets if not kept)

    # ── views ───────────────────────────────────────────────────────────────────────────────
    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def response_mask(self) -> list[int]:
        """1 on sampled tokens, 0 elsewhere."""
        sampled = int(TokenOrigin.SAMPLED)
        return [1 if o == sampled else 0 for o in self.origins]

    @property
    def prompt_length(self) -> int:
        """Number of tokens before the first sampled token (the whole ledger if none)."""
        sampled = int(TokenOrigin.SAMPLED)
        for i, o in enumerate(self.origins):
            if o == sampled:
                return i
        return len(self.origins)

    @property
    def num_sampled(self) -> int:
        return sum(self.response_mask)

    @property
    def num_turns(self) -> int:
        return max(self.turns, default=0)

    @property
    def trainable(self) -> bool:
        """False when the episode failed for infrastructure reasons, or the server refused its
        request, and it must be masked out."""
        return self.fault not in ("infra", "request")

    def tokens_of(self, origin: TokenOrigin) -> list[int]:
        return [t for t, o in zip(self.token_ids, self.origins, strict=True) if o == int(origin)]

    # ── checking and serialising ────────────────────────────────────────────────────────────
    def validate(self) -> None:
        """Raise ValueError if the ledger's invariants do not hold."""
        n = len(self.token_ids)
        lengths = {
            "origins": len(self.origins),
            "turns": len(self.turns),
            "logprobs": len(self.logprobs),
            "versions": len(self.versions),
        }
        bad = {k: v for k, v in lengths.items() if v != n}
        if bad:
            raise ValueError(f"ledger has {n} tokens but per-token lists of lengths {bad}")
        sampled = int(TokenOrigin.SAMPLED)
        for i, (o, lp, v) in enumerate(zip(self.origins, self.logprobs, self.versions, strict=True)):
            if o not in (0, 1, 2, 3):
                raise ValueError(f"token {i} has unknown origin {o}")
            if o == sampled and (v < 0 or math.isnan(lp) or lp > 1e-6):
                raise ValueError(f"sampled token {i} has version {v} and logprob {lp}")
            if o != sampled and (v != -1 or lp != 0.0):
                raise ValueError(f"non-sampled token {i} carries version {v} or logprob {lp}")
        if any(b < a for a, b in zip(self.turns, self.turns[1:], strict=False)):
            raise ValueError("turn numbers must never decrease along the ledger")
        if self.kept_sets:
            self._validate_kept_sets()
        if self.teacher_logprobs:
            self._validate_teacher_logprobs()
        self._validate_turn_rewards()

    def _validate_teacher_logprobs(self) -> None:
        n = len(self.token_ids)
        if len(self.teacher_logprobs) != n:
            raise ValueError(f"ledger has {n} tokens but {len(self.teacher_logprobs)} teacher logprobs; "
                             "give one per token (0.0 on tokens that were not sampled)")
        sampled = int(TokenOrigin.SAMPLED)
        for i, (o, lp) in enumerate(zip(self.origins, self.teacher_logprobs, strict=True)):
            if o == sampled and (not math.isfinite(lp) or lp > 1e-6):
                raise ValueError(f"sampled token {i} has teacher logprob {lp}; a logprob is finite and <= 0")
            if o != sampled and lp != 0.0:
                raise ValueError(f"non-sampled token {i} carries teacher logprob {lp}; only sampled tokens are scored")

    def _validate_turn_rewards(self) -> None:
        if len(self.turn_rewards) > self.num_turns:
            raise ValueError(f"{len(self.turn_rewards)} turn rewards for an episode of {self.num_turns} turn(s); "
                             "turn_rewards[k - 1] is the reward of turn k")
        for k, r in enumerate(self.turn_rewards, start=1):
            if r is not None and (isinstance(r, bool) or not isinstance(r, int | float) or not math.isfinite(r)):
                raise ValueError(f"turn {k}'s reward is {r!r}; give a finite number, or None where none was given")

    def _validate_kept_sets(self) -> None:
        sampled = [t for t, o in zip(self.token_ids, self.origins, strict=True) if o == int(TokenOrigin.SAMPLED)]
        if len(self.kept_sets) != len(sampled):
            raise ValueError(f"ledger has {len(sampled)} sampled tokens but {len(self.kept_sets)} kept sets")
        for k, (token, kept) in enumerate(zip(sampled, self.kept_sets, strict=True)):
            if kept and token not in kept:
                raise ValueError(f"sampled token {k} (id {token}) is not in its own kept set")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["finish_reason"] = self.finish_reason.value if self.finish_reason else None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trajectory:
        """The trajectory `to_dict` wrote; also reads dicts written before `segment` was a field
        (they kept it as a `segment` entry of `info`)."""
        d = dict(d)
        if d.get("finish_reason") is not None:
            d["finish_reason"] = FinishReason(d["finish_reason"])
        info = dict(d.get("info") or {})
        legacy = info.pop("segment") if isinstance(info.get("segment"), dict) else None
        d["info"], d["segment"] = info, Segment.from_dict(d.get("segment") or legacy)
        return cls(**d)


# ── what one training step reports to the run ───────────────────────────────────────────────────
GateReason = Literal["template", "version", "logprob_gap", "mean_logprob_gap", "log_ratio_spread", "ess"]
GATE_REASONS: tuple[GateReason, ...] = get_args(GateReason)
"""Why the trainer's on-policy gate masks a sequence, in the order it tests them (the first figure
that trips is the one recorded); `agentrl.trainer.mismatch_gate` decides, the run reads."""


@dataclass(frozen=True, slots=True)
class GatedRow:
    """One sequence of a training batch that the on-policy gate masked out of the loss: which, why,
    and the figures the gate computed for it over its sampled tokens (those sampled by the trained
    version, when the step names it). A row gated by the batch's ESS (`reason` "ess" with its own
    `ess` above the threshold) was kept by its own figures and gated with every other kept row."""

    row: int
    """Its index among the trainable trajectories of the batch, in the order the trainer got them."""
    reason: GateReason
    logprob_gap: float
    """Largest |rollout - trainer| logprob gap over its tokens."""
    mean_logprob_gap: float
    """Mean |rollout - trainer| logprob gap over its tokens."""
    log_ratio_spread: float
    """Largest minus smallest log importance ratio over its tokens."""
    ess: float
    """Normalised effective sample size of its tokens' importance weights (1: all equal)."""
    out_of_window_tokens: int = 0
    """Sampled tokens whose policy version lies outside what the run's staleness allows."""
    template_mismatches: float = 0.0
    """Chat-template re-render mismatches `rollout.verify_template` counted in the episode."""


MaskCause = Literal["unpredicted", "kept_set_overflow", "rollout_is", "gate"]
MASK_CAUSES: tuple[MaskCause, ...] = get_args(MaskCause)
"""Why a sampled token of a trained trajectory is not in the loss, in the order the trainer applies
them (a token is counted under the first that takes it out): `unpredicted` (the ledger's first
token, which no logit predicts), `kept_set_overflow` (its kept set overflowed `rollout.max_kept_set`,
so it cannot be scored over the set it was drawn from), `rollout_is` (a masking rollout correction:
`icepop` tokens, `seq_mask_tis` sequences), `gate` (the on-policy gate masked its sequence)."""


@dataclass
class StepReport:
    """What one training step reports to the run: its metrics (numbers only, named `group/metric`),
    the on-policy gate's per-row decisions (`gated`, empty when the gate is off or kept every row)
    and, per row, the sampled tokens taken out of the loss by cause (`masked_tokens`). The
    orchestration writes the decisions into each prompt's ledger line, stops a run whose share of
    gated rows is over its threshold, and writes each trained episode's masked tokens into the
    step's rollout file."""

    metrics: dict[str, float]
    gated: list[GatedRow] = field(default_factory=list)
    masked_tokens: list[dict[MaskCause, int]] = field(default_factory=list)
    """Per trainable trajectory of the batch, in order: its sampled tokens out of the loss by cause
    (`MASK_CAUSES`, causes with none left out). Its sampled tokens less these are its loss tokens,
    and their sum over the batch is the metric `batch/loss_tokens`."""
