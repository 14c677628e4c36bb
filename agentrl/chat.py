"""The chat-template side of the token ledger: first prompts and delta-tokenised follow-ups.

`ChatTemplate` wraps a Hugging Face tokenizer (and optionally a replacement Jinja template) and
turns messages into token ids with the model's own template. `ConversationTokenizer` keeps one
episode's ledger (`agentrl.types.Trajectory`) append-only: the first prompt is rendered whole,
sampled tokens go in exactly as the server returned them, and every later batch of messages (tool
results, user feedback) is rendered on its own as a *delta*, so that the ids sent at turn k+1
extend the ids of turn k exactly (DESIGN.md §4). Nothing sampled is ever re-tokenised.

How a delta is found. A fixed dummy conversation `[system?, user, assistant(MARK)]` is rendered
with and without the new messages; the text after `MARK` is "the closing of an assistant turn,
then the new messages, then the generation prompt". Looking only after the marker makes the
delta immune to templates that rewrite earlier turns (Qwen3 drops past `<think>` blocks). The
closing tokens the model already sampled (it usually stops *on* `<|im_end|>` or `</s>`) are
dropped from the front; the rest (`"\n"` after `<|im_end|>`, or the whole closing marker after a
generation cut by length) is appended as TEMPLATE.

Origins. The first prompt is PROMPT. In a delta, a token whose characters overlap a new message's
`content` is TOOL (whatever the role: everything the environment said is TOOL), every other
token (role markers, `<tool_response>` wrappers, closings, the generation prompt) is TEMPLATE. The
content spans are located by rendering the delta a second time with sentinels in place of the
contents (and of call ids and names, where the template accepts that) and checking that putting
the real values back gives the delta text exactly; that sentinel render depends only on the shape
of the new messages, the tools and the system message, so it is cached per shape. When a
template transforms content so that this fails, a plain left-to-right search is the fallback.

Cost. Rendering is Jinja; tokenising is mostly a fast tokenizer's pre-tokenizer regex, whose cost
grows with the characters. Pieces of text between the template's special tokens are tokenised
once and cached (`agentrl.segments.SegmentEncoder`), so the system prompt and tool schemas that
every episode repeats, and the role markers every delta repeats, cost a dict lookup.
Tokenisers without offset mapping mark every appended token TEMPLATE. Either way, only sampled
tokens are ever SAMPLED.

Prefix stability. Re-rendering the whole conversation does not always reproduce the ledger, and
the ledger is right: it holds what the model saw. `ConversationTokenizer` compares the two after
each delta (when `verify=True`) and counts disagreements in `trajectory.metrics
["template_mismatch"]` (details in `trajectory.info["template_mismatches"]`); it never raises for
them. Known cases, found by tests/unit/test_chat.py with the real tokenizers:

- Qwen2.5: prefix-stable for tool results and user feedback.
- Qwen3: drops the `<think>` block of every assistant turn before the latest real user message,
  and renders a past turn with empty reasoning without its `<think></think>` wrapper, so a user
  follow-up, or thinking disabled (`enable_thinking=False` puts an empty think block into the
  generation prompt), makes the re-render differ. Tool-only episodes with non-empty reasoning
  are stable.
- Mistral-Nemo: the system message is rendered only inside the *last* user message, and only
  when that message ends the conversation, so it vanishes from a re-render once the assistant
  has answered; `[AVAILABLE_TOOLS]` is rendered before the last user message, so it moves when
  user feedback arrives. Tool call ids must be 9 characters (the template raises otherwise), tool
  results are pasted unescaped into `[TOOL_RESULTS]{"content": ..., "call_id": ...}`, an empty
  tools list renders a broken `[AVAILABLE_TOOLS][[/AVAILABLE_TOOLS]` (we pass `None` instead), and
  a user message straight after tool results is refused. There is no generation prompt.

This module does not parse tool calls (agentrl.tools.parsers does) and does not talk to servers.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl.errors import ChatTemplateError
from agentrl.segments import SegmentEncoder
from agentrl.types import Generation, Message, TokenOrigin, ToolSchema, Trajectory

__all__ = ["ChatTemplate", "ConversationTokenizer", "TokenDelta", "render_difference", "token_spans"]

log = logging.getLogger(__name__)

# Unlikely to occur in real text, free of characters any template treats specially.
_MARK = "AGENTRL-DELTA-MARK-5f0c2a"
_DUMMY_USER = "AGENTRL-DELTA-USER-5f0c2a"
_SENTINEL = "AGENTRL-CONTENT-{}-5f0c2a"
_SENTINEL_RE = re.compile(r"AGENTRL-CONTENT-\d+-[a-z_]+-5f0c2a")
_MASKED_FIELDS = ("content", "tool_call_id", "name")
_PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "probe",
            "description": "A probe.",
            "parameters": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]},
        },
    }
]
_MASKED_CACHE_SIZE = 1024
_PROMPT_CACHE_SIZE = 4096
_TOOLS_CACHE_SIZE = 64


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """Tokens to append to a ledger after a sampled turn, each with its origin.

    `text` is the rendered text the ids were tokenised from, including any closing tokens the
    model had already sampled (`skipped` of them, which are not in `token_ids`).
    """

    token_ids: list[int]
    origins: list[TokenOrigin]
    text: str
    skipped: int = 0

    def runs(self) -> list[tuple[TokenOrigin, list[int]]]:
        """Consecutive runs of one origin, in order: what `Trajectory.extend` takes."""
        out: list[tuple[TokenOrigin, list[int]]] = []
        for tok, origin in zip(self.token_ids, self.origins, strict=True):
            if out and out[-1][0] == origin:
                out[-1][1].append(tok)
            else:
                out.append((origin, [tok]))
        return out


class ChatTemplate:
    """A model's chat template, rendering messages to ids the way the model was trained on.

    `template` replaces the tokenizer's own Jinja template (for models that ship none, or one
    without tool support); `template_kwargs` are passed to every render (for example
    `enable_thinking=False` for Qwen3).
    """

    def __init__(self, tokenizer: Any, template: str | None = None, **template_kwargs: Any) -> None:
        if template is None and not getattr(tokenizer, "chat_template", None):
            name = getattr(tokenizer, "name_or_path", type(tokenizer).__name__)
            raise ChatTemplateError(
                f"Tokenizer '{name}' has no chat template; pass one with ChatTemplate(tokenizer, "
                "template=...)."
            )
        self.tokenizer = tokenizer
        self.template = template
        self.template_kwargs = template_kwargs
        # Probe once: the closing of an assistant turn, and proof that the template can render
        # the dummy conversation the deltas are built on.
        text = self.render(
            [*self._dummy(None), {"role": "assistant", "content": _MARK}], add_generation_prompt=False
        )
        self.closing_text = _after_mark(text)
        self.segments = SegmentEncoder(tokenizer, [text, *self._probe_renders()])
        self.closing_ids = self.encode(self.closing_text)
        # Sentinel renders of deltas depend only on the shape of the new messages (roles, call
        # ids, names), the tools and the system message, so they are rendered once per shape.
        self._masked: dict[str, str] = {}
        self._cache_lock = threading.Lock()
        self._mask_ids: bool | None = None  # whether the template accepts sentinel call ids
        # First prompts repeat: every sample of a GRPO group starts from the same row, and every
        # episode of an env from the same tools. Their ids are cached by the render's whole input,
        # unless the template reads the clock (Llama 3 renders today's date).
        self._prompts: dict[str, tuple[int, ...]] = {}
        source = template if template is not None else getattr(tokenizer, "chat_template", "")
        self._cache_prompts = "strftime_now" not in str(source)
        # Tool lists are interned by content: episodes of one env share one list and its JSON key,
        # so cache keys do not serialise the tool schemas again for every episode and delta.
        self._tools: dict[str, list[ToolSchema]] = {}
        self._tools_key: dict[int, str] = {}

    @classmethod
    def from_pretrained(
        cls, path: str | Path, template: str | None = None, *, trust_remote_code: bool = False,
        **template_kwargs: Any,
    ) -> ChatTemplate:
        """Load the tokenizer at `path` (a local directory or hub id) and wrap it; `trust_remote_code`
        lets the tokenizer run code from the model repository (`model.trust_remote_code`)."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        return cls(tokenizer, template, **template_kwargs)

    # ── rendering ───────────────────────────────────────────────────────────────────────────
    def render(
        self,
        messages: Sequence[Message] | Sequence[Mapping[str, Any]],
        tools: Sequence[ToolSchema] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> str:
        """The template's text for `messages` (and tool schemas in OpenAI format)."""
        try:
            return str(self.tokenizer.apply_chat_template(
                [dict(m) for m in messages],
                tools=list(tools) if tools else None,  # Mistral renders [] as a broken tool list
                chat_template=self.template,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **self.template_kwargs,
            ))
        except Exception as exc:  # jinja's TemplateError, raise_exception(), missing keys
            raise ChatTemplateError(
                f"The chat template could not render {len(messages)} messages "
                f"(roles {[m.get('role') for m in messages]}): {exc}"
            ) from exc

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered text; special tokens come from the text, none are added.

        Equal to `tokenizer(text, add_special_tokens=False)["input_ids"]`; pieces between the
        template's special tokens are cached (`agentrl.segments`), so the system prompt and tool
        schemas every episode repeats are tokenised once.
        """
        return self.segments.encode(text)

    def encode_prompt(
        self,
        messages: Sequence[Message] | Sequence[Mapping[str, Any]],
        tools: Sequence[ToolSchema] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Ids of a whole conversation, as `apply_chat_template(..., tokenize=True)` gives them."""
        return self.encode(self.render(messages, tools, add_generation_prompt=add_generation_prompt))

    def first_prompt_ids(
        self, messages: Sequence[Message] | Sequence[Mapping[str, Any]], tools: Sequence[ToolSchema] | None = None
    ) -> tuple[int, ...]:
        """`encode_prompt(messages, tools)` with a generation prompt, cached by its input.

        Samples of a group, and retries, start from the same messages: they are rendered and
        tokenised once. Messages that are not JSON-serialisable are rendered every time.
        """
        key = self._cache_key(tools, messages) if self._cache_prompts else None
        if key is not None and (hit := self._prompts.get(key)) is not None:
            return hit
        ids = tuple(self.encode_prompt(messages, tools))
        if key is not None:
            self._remember(self._prompts, key, ids, _PROMPT_CACHE_SIZE)
        return ids

    def _cache_key(self, tools: Sequence[ToolSchema] | None, payload: object) -> str | None:
        """A cache key for a render of `payload` with `tools` (None if it is not JSON-serialisable)."""
        try:
            return f"{self.tools_key(tools)}\n{json.dumps(payload, sort_keys=True)}"
        except (TypeError, ValueError):
            return None

    def _remember(self, cache: dict[str, Any], key: str, value: Any, limit: int) -> None:
        """Store `value` under `key`, dropping the oldest entry when `cache` holds `limit`."""
        with self._cache_lock:
            if len(cache) >= limit:
                del cache[next(iter(cache))]
            cache[key] = value

    def intern_tools(self, tools: Sequence[ToolSchema] | None) -> list[ToolSchema] | None:
        """One shared list per distinct set of tool schemas (None for no tools); treat it as read-only."""
        if not tools:
            return None
        key = json.dumps(list(tools), sort_keys=True)
        shared = self._tools.get(key)
        if shared is None:
            with self._cache_lock:
                if len(self._tools) >= _TOOLS_CACHE_SIZE:
                    self._tools_key.pop(id(self._tools.pop(next(iter(self._tools)))), None)
                shared = self._tools.setdefault(key, list(tools))
                self._tools_key[id(shared)] = key
        return shared

    def tools_key(self, tools: Sequence[ToolSchema] | None) -> str:
        """The JSON of `tools` for cache keys: a lookup for interned lists (`intern_tools`)."""
        if not tools:
            return "null"
        key = self._tools_key.get(id(tools))
        return key if key is not None else json.dumps(list(tools), sort_keys=True)

    def decode_turn(self, token_ids: Sequence[int]) -> str:
        """The text of a sampled turn, as tool-call parsers expect it.

        Special tokens stay (Mistral's `[TOOL_CALLS]` and Llama's `<|python_tag|>` are special);
        the end-of-turn tokens the model sampled (a prefix of the template's closing, such as
        `<|im_end|>` or `</s>`) are dropped, so they do not end up in the message content.
        """
        ids = list(token_ids)
        for k in range(min(len(self.closing_ids), len(ids)), 0, -1):
            if ids[-k:] == self.closing_ids[:k]:
                ids = ids[:-k]
                break
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))

    def token_spans(
        self, token_ids: Sequence[int], char_spans: Sequence[tuple[int, int] | None], *, text: str | None = None
    ) -> list[tuple[int, int] | None]:
        """Where character spans of `decode_turn(token_ids)` (given as `text` when at hand) lie in `token_ids`
        (`token_spans`)."""
        return token_spans(self.tokenizer, token_ids, char_spans, text=text)

    # ── deltas ──────────────────────────────────────────────────────────────────────────────
    def encode_delta(
        self,
        new_messages: Sequence[Message] | Sequence[Mapping[str, Any]],
        *,
        sampled_ids: Sequence[int] = (),
        tools: Sequence[ToolSchema] | None = None,
        system: Message | Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> TokenDelta:
        """The tokens that follow a sampled assistant turn: its closing, `new_messages`, and
        the generation prompt.

        `sampled_ids` are the ids already in the ledger (only the tail matters): closing tokens
        the model sampled itself are not repeated. `tools` and `system` are the conversation's,
        so that templates which render them next to the latest user message (Mistral) do so in
        the delta too.
        """
        base = [*self._dummy(system), {"role": "assistant", "content": _MARK}]
        new = [dict(m) for m in new_messages]
        try:
            text = _after_mark(self.render(base + new, tools, add_generation_prompt=add_generation_prompt))
        except ChatTemplateError as exc:
            roles = [m.get("role") for m in new]
            raise ChatTemplateError(
                f"Cannot append messages with roles {roles} after an assistant turn: {exc.__cause__ or exc}"
            ) from exc
        spans = self._content_spans(base, new, text, tools, add_generation_prompt)

        closing_len = _common_prefix_len(text, self.closing_text)
        enc = self._encode_with_offsets(text)
        ids: list[int] = enc[0]
        offsets: list[tuple[int, int]] | None = enc[1]
        n_closing = 0
        if offsets is None:
            n_closing = len(self.closing_ids) if text.startswith(self.closing_text) else 0
        else:
            while n_closing < len(ids) and offsets[n_closing][1] <= closing_len:
                n_closing += 1
        skip = 0
        tail = list(sampled_ids[-n_closing:]) if n_closing else []
        for k in range(min(n_closing, len(tail)), 0, -1):
            if tail[-k:] == ids[:k]:
                skip = k
                break

        origins = [TokenOrigin.TEMPLATE] * len(ids) if offsets is None else _origins(offsets, spans)
        return TokenDelta(ids[skip:], origins[skip:], text, skip)

    def _dummy(self, system: Message | Mapping[str, Any] | None) -> list[dict[str, Any]]:
        head = [dict(system)] if system else []
        return [*head, {"role": "user", "content": _DUMMY_USER}]

    def _probe_renders(self) -> list[str]:
        """Renders of typical conversations, to choose where `SegmentEncoder` may cut text."""
        call = {"id": "probe0001", "type": "function", "function": {"name": "probe", "arguments": {"x": "1"}}}
        system = {"role": "system", "content": "S."}
        user = {"role": "user", "content": "U."}
        tries: list[tuple[list[dict[str, Any]], Any]] = [
            ([system, user], _PROBE_TOOLS),
            ([system, user, {"role": "assistant", "content": "A."}, {"role": "user", "content": "V."}], None),
            (
                [user, {"role": "assistant", "content": "", "tool_calls": [call]},
                 {"role": "tool", "content": "1", "tool_call_id": "probe0001", "name": "probe"}],
                _PROBE_TOOLS,
            ),
        ]
        out = []
        for messages, tools in tries:
            try:
                out.append(self.render(messages, tools))
            except ChatTemplateError:
                continue
        return out

    def _content_spans(
        self,
        base: list[dict[str, Any]],
        new: list[dict[str, Any]],
        text: str,
        tools: Sequence[ToolSchema] | None,
        add_generation_prompt: bool,
    ) -> list[tuple[int, int]]:
        """Character spans of the new messages' contents inside the delta text."""
        contents = [m.get("content") for m in new]
        slots = [i for i, c in enumerate(contents) if isinstance(c, str) and c]
        if not slots:
            return []
        # Masking the call ids and names too makes the sentinel render the same for every
        # episode (ids are random), so it is cached; templates that check ids (Mistral wants 9
        # alphanumerics) refuse the masked ids, and then only contents are masked.
        spans = None
        if self._mask_ids is not False:
            spans = self._sentinel_spans(base, new, text, tools, add_generation_prompt, _MASKED_FIELDS)
            if self._mask_ids is None:
                self._mask_ids = spans is not None
        if spans is None:
            spans = self._sentinel_spans(base, new, text, tools, add_generation_prompt, ("content",))
        if spans is not None:
            return spans
        # The template transformed content; fall back to finding each content (or its stripped
        # form, for templates that trim) in order. Content not found is left TEMPLATE.
        spans, pos = [], 0
        for i in slots:
            for content in dict.fromkeys((str(contents[i]), str(contents[i]).strip())):
                at = text.find(content, pos) if content else -1
                if at >= 0:
                    spans.append((at, at + len(content)))
                    pos = at + len(content)
                    break
        return spans

    def _sentinel_spans(
        self,
        base: list[dict[str, Any]],
        new: list[dict[str, Any]],
        text: str,
        tools: Sequence[ToolSchema] | None,
        add_generation_prompt: bool,
        fields: tuple[str, ...],
    ) -> list[tuple[int, int]] | None:
        """Content spans found by rendering `fields` as sentinels and putting the values back.

        None when that does not reproduce `text` exactly (the template transformed a value, or
        refused the sentinels): the spans are only trusted when the splice is the real text.
        """
        values: dict[str, tuple[str, bool]] = {}
        masked = []
        for i, message in enumerate(new):
            m = dict(message)
            for f in fields:
                value = m.get(f)
                if isinstance(value, str) and value:
                    sentinel = _SENTINEL.format(f"{i}-{f}")
                    m[f] = sentinel
                    values[sentinel] = (value, f == "content")
            masked.append(m)
        masked_text = self._masked_render(base, masked, tools, add_generation_prompt)
        if not masked_text:
            return None
        parts: list[str] = []
        spans: list[tuple[int, int]] = []
        pos = length = 0
        for match in _SENTINEL_RE.finditer(masked_text):
            found = values.get(match.group(0))
            if found is None:
                return None
            parts.append(masked_text[pos : match.start()])
            length += match.start() - pos
            value, is_content = found
            if is_content:
                spans.append((length, length + len(value)))
            parts.append(value)
            length += len(value)
            pos = match.end()
        parts.append(masked_text[pos:])
        return spans if "".join(parts) == text else None

    def _masked_render(
        self,
        base: list[dict[str, Any]],
        masked: list[dict[str, Any]],
        tools: Sequence[ToolSchema] | None,
        add_generation_prompt: bool,
    ) -> str:
        """The delta text of the sentinel conversation ("" if the template refuses it), cached.

        The key is the whole input of the render (JSON), so a different tool set, system message
        or message shape renders anew; inputs that are not JSON-serialisable are not cached.
        """
        key = self._cache_key(tools, [base, masked, add_generation_prompt])
        if key is not None and (hit := self._masked.get(key)) is not None:
            return hit
        try:
            text = _after_mark(self.render(base + masked, tools, add_generation_prompt=add_generation_prompt))
        except ChatTemplateError:
            text = ""
        if key is not None:
            self._remember(self._masked, key, text, _MASKED_CACHE_SIZE)
        return text

    def _encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]] | None]:
        return self.segments.encode_with_offsets(text)


def _after_mark(text: str) -> str:
    at = text.find(_MARK)
    if at < 0:
        raise ChatTemplateError(
            "The chat template dropped the content of an assistant message, so deltas cannot be "
            "located; use a template that renders assistant content verbatim."
        )
    return text[at + len(_MARK) :]


def _origins(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[TokenOrigin]:
    """TOOL for each token whose characters overlap a span, TEMPLATE for the others.

    `spans` are disjoint and in order, so one pass over both suffices while token starts grow; a
    token starting before the previous one starts the span search over.
    """
    tool, template = TokenOrigin.TOOL, TokenOrigin.TEMPLATE
    if not spans:
        return [template] * len(offsets)
    out: list[TokenOrigin] = []
    j, last = 0, -1
    for s, e in offsets:
        if s < last:
            j = 0
        last = s
        while j < len(spans) and spans[j][1] <= s:
            j += 1
        out.append(tool if j < len(spans) and spans[j][0] < e else template)
    return out


def _common_prefix_len(a: Sequence[object], b: Sequence[object]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def render_difference(
    template: ChatTemplate, trajectory: Trajectory, tools: Sequence[ToolSchema] | None = None, *, prefix: bool = False
) -> str:
    """Why the ledger differs from a full re-render of its conversation ("" when it does not).

    Token for token first. Where the ids differ, the ledger still agrees when both decode to the
    same text (after the tokenizer's normaliser) and the first differing id is a sampled one: sampled
    text need not re-tokenise to the ids the model sampled (a model may sample " a", "b" where the
    tokenizer would write " ab"), and the ledger rightly keeps what was sampled; the same holds where
    the template's last id before a sampled turn merges with its first sampled character. An assistant message is rendered with the text its
    turn sampled (`decode_turn`) when that differs from its content only in surrounding whitespace
    (parsers strip whitespace the model did sample). `prefix`: the ledger may stop before the
    re-render does (an episode that ends on a sampled turn, whose closing the template adds).
    """
    ledger = trajectory.token_ids
    try:
        full = template.encode_prompt(_as_sampled(template, trajectory), tools, add_generation_prompt=not prefix)
    except ChatTemplateError as exc:
        return f"re-render failed: {exc}"
    if full == ledger or (prefix and full[: len(ledger)] == ledger):
        return ""
    pos = _common_prefix_len(ledger, full)
    decode = template.tokenizer.decode
    text_ledger = decode(ledger, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    text_full = decode(full, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    norm_ledger, norm_full = _normalised(template, text_ledger), _normalised(template, text_full)
    same_text = norm_full == norm_ledger or (prefix and norm_full.startswith(norm_ledger))
    # The first differing id is sampled, or is the template's last id before a sampled one that
    # re-tokenising merges with it ("assistant\n" then a sampled "\n" is one "\n\n" id).
    near = trajectory.origins[pos:pos + 2]
    if same_text and TokenOrigin.SAMPLED in near:
        return ""
    at = _common_prefix_len(text_ledger, text_full)
    return (f"ledger has {len(ledger)} ids, re-render {len(full)}; first difference at id {pos}, character {at}: "
            f"ledger {text_ledger[at:at + 24]!r} vs re-render {text_full[at:at + 24]!r}")


def _normalised(template: ChatTemplate, text: str) -> str:
    """`text` as the tokenizer's normaliser sees it (NFC for Qwen): a model may sample a character the
    tokenizer would write in another form (U+FB44 for U+05E4 U+05BC); both are the same text to it."""
    backend = getattr(template.tokenizer, "backend_tokenizer", None)
    normalizer = getattr(backend, "normalizer", None)
    if normalizer is None:
        return text
    return str(normalizer.normalize_str(text))


def _as_sampled(template: ChatTemplate, trajectory: Trajectory) -> list[Message]:
    """The conversation with each assistant message's content as its turn sampled it, where the two
    differ only in surrounding whitespace (a template that drops reasoning still differs)."""
    by_turn: dict[int, list[int]] = {}
    for tok, origin, turn in zip(trajectory.token_ids, trajectory.origins, trajectory.turns, strict=True):
        if origin == TokenOrigin.SAMPLED:
            by_turn.setdefault(turn, []).append(tok)
    sampled = [template.decode_turn(ids) for _turn, ids in sorted(by_turn.items())]
    out: list[Message] = []
    k = 0
    for m in trajectory.messages:
        if m.get("role") == "assistant":
            content = m.get("content")
            if k < len(sampled) and isinstance(content, str) and sampled[k].strip() == content.strip():
                m = {**m, "content": sampled[k]}
            k += 1
        out.append(m)
    return out


class ConversationTokenizer:
    """One episode's conversation and its token ledger, kept in step.

    >>> conv = ConversationTokenizer(template, trajectory)
    >>> ids = conv.start(messages, tools)            # PROMPT tokens, turn 0
    >>> conv.add_generation(generation, message)     # SAMPLED tokens, turn 1
    >>> ids = conv.add_messages(tool_messages)       # TEMPLATE/TOOL tokens, turn 1; send `ids`

    `ids` returned at each step is the whole ledger, and always extends the previous one.
    `message` is the assistant message for the conversation (content without tool-call markup,
    plus `tool_calls`, as `Action.to_message()` gives it); it is used only to re-render the
    conversation for `verify`, never to produce tokens.
    """

    def __init__(
        self, template: ChatTemplate, trajectory: Trajectory | None = None, *, verify: bool = True
    ) -> None:
        self.template = template
        self.trajectory = trajectory if trajectory is not None else Trajectory()
        self.verify = verify
        self.tools: list[ToolSchema] | None = None
        self.turn = 0
        self._started = False
        self._after_generation = False

    @property
    def token_ids(self) -> list[int]:
        return self.trajectory.token_ids

    @property
    def messages(self) -> list[Message]:
        return self.trajectory.messages

    def start(self, messages: Sequence[Message], tools: Sequence[ToolSchema] | None = None) -> list[int]:
        """Render the first prompt into an empty ledger and return its ids."""
        if self._started or len(self.trajectory):
            raise ValueError("ConversationTokenizer.start() needs an empty trajectory; it was called twice")
        self.tools = self.template.intern_tools(tools)
        ids = self.template.first_prompt_ids(messages, self.tools)
        self.trajectory.extend(ids, TokenOrigin.PROMPT, 0, ints=True)
        self.trajectory.messages.extend(Message(**m) for m in messages)
        if self.verify:
            self.trajectory.metrics.setdefault("template_mismatch", 0.0)
        self._started = True
        return list(self.trajectory.token_ids)

    def add_generation(self, generation: Generation, message: Message | None = None) -> None:
        """Append a sampled turn exactly as the server returned it; starts a new turn."""
        if not self._started:
            raise ValueError("call ConversationTokenizer.start() before add_generation()")
        self.turn += 1
        self.trajectory.extend(
            generation.token_ids,
            TokenOrigin.SAMPLED,
            self.turn,
            logprobs=generation.logprobs,
            version=generation.weight_version,
            kept_sets=generation.kept_sets,
        )
        if message is None:
            text = self.template.tokenizer.decode(generation.token_ids, skip_special_tokens=True)
            message = {"role": "assistant", "content": text}
        self.trajectory.messages.append(message)
        self._after_generation = True

    def add_messages(self, messages: Sequence[Message]) -> list[int]:
        """Append new messages after the last sampled turn; return the ids to send next."""
        return self.add_delta(self.preview(messages), messages)

    def preview(self, messages: Sequence[Message]) -> TokenDelta:
        """The delta `add_messages(messages)` would append, without appending it (a caller that decides
        by its length, such as the AgentLoop's compaction, then appends it with `add_delta`)."""
        if not self._started:
            raise ValueError("call ConversationTokenizer.start() before add_messages()")
        if not self._after_generation:
            # A delta closes an assistant turn; without one it would invent an empty reply.
            raise ValueError(
                "add_messages() must follow add_generation(): new messages close the assistant "
                "turn before them. Append the generation (even an empty one) first."
            )
        first = self.trajectory.messages[0] if self.trajectory.messages else None
        system = first if first is not None and first.get("role") == "system" else None
        return self.template.encode_delta(
            messages, sampled_ids=self.trajectory.token_ids, tools=self.tools, system=system
        )

    def add_delta(self, delta: TokenDelta, messages: Sequence[Message]) -> list[int]:
        """Append `delta`, which `preview(messages)` gave for the ledger as it is; return the ids to send next."""
        if not self._after_generation:
            raise ValueError("add_delta() appends one delta after each generation; preview the messages again")
        for origin, ids in delta.runs():
            self.trajectory.extend(ids, origin, self.turn, ints=True)
        self._after_generation = False
        self.trajectory.messages.extend(Message(**m) for m in messages)
        if self.verify:
            self.check()
        return list(self.trajectory.token_ids)

    def check(self, *, prefix: bool = False) -> bool:
        """Compare the ledger with a full re-render of the conversation; count a disagreement.

        Returns True when they agree. A template that cannot render the whole conversation
        (Mistral refuses some role orders) counts as a disagreement too. `prefix`: the episode
        ended on a sampled turn, so the ledger may stop before the re-render's closing.
        """
        reason = render_difference(self.template, self.trajectory, self.tools, prefix=prefix)
        if not reason:
            return True
        m = self.trajectory.metrics
        m["template_mismatch"] = m.get("template_mismatch", 0.0) + 1.0
        self.trajectory.info.setdefault("template_mismatches", []).append(
            {"turn": self.turn, "reason": reason}
        )
        log.debug("chat template is not prefix-stable at turn %d: %s", self.turn, reason)
        return False


def token_spans(
    tokenizer: Any, token_ids: Sequence[int], char_spans: Sequence[tuple[int, int] | None], *, text: str | None = None
) -> list[tuple[int, int] | None]:
    """Where each [start, end) character span of the text `token_ids` decode to (`ChatTemplate.decode_turn`,
    special tokens kept; pass it as `text` when it is at hand) lies in `token_ids`: the [first, end) token
    span whose text holds it (None stays None).

    By incremental decoding: the decoded length of a prefix of the ids, found by bisection (a few
    decodes per span boundary, cached within the call), so it holds for any tokenizer, byte-level or
    SentencePiece, without offsets of a re-encoding (the sampled ids are never re-tokenised). A token
    that holds part of a character (a byte of an emoji) counts with the token that completes it. The
    decodes go straight to a fast tokenizer's backend when that gives the same text (`text` is checked
    against it), which is several times cheaper than the Python `decode`.
    """
    ids = list(token_ids)
    if not ids or all(span is None for span in char_spans):
        return [None] * len(char_spans)
    decode = _prefix_decoder(tokenizer, ids, text)
    lengths: dict[int, int] = {0: 0}

    def length(k: int) -> int:
        if k not in lengths:
            lengths[k] = len(decode(ids[:k]))
        return lengths[k]

    def first_token(char: int) -> int:  # the last prefix that ends at or before `char`
        lo, hi = 0, len(ids)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if length(mid) <= char:
                lo = mid
            else:
                hi = mid - 1
        return min(lo, len(ids) - 1)

    def end_token(char: int, lo: int) -> int:  # the shortest prefix that covers `char` characters
        hi = len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if length(mid) >= char:
                hi = mid
            else:
                lo = mid + 1
        return lo

    spans: list[tuple[int, int] | None] = []
    for span in char_spans:
        if span is None:
            spans.append(None)
            continue
        start = first_token(span[0])
        spans.append((start, max(end_token(span[1], start), start + 1)))
    return spans


def _prefix_decoder(tokenizer: Any, ids: list[int], text: str | None) -> Any:
    """How to decode prefixes of `ids`: a fast tokenizer's backend when it decodes them as the tokenizer does."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        def fast(prefix: list[int]) -> str:
            return str(backend.decode(prefix, skip_special_tokens=False))

        whole = fast(ids)
        expected = text if text is not None else str(tokenizer.decode(ids, skip_special_tokens=False))
        if whole.startswith(expected):
            return fast

    def slow(prefix: list[int]) -> str:
        return str(tokenizer.decode(prefix, skip_special_tokens=False))

    return slow
