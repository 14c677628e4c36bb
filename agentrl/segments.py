"""Tokenising rendered chat text in cached pieces, cut after the template's special tokens.

Rendered conversations repeat themselves: every episode of a run starts with the same system
prompt and tool schemas (a thousand characters for one small tool), and every delta carries the
same role markers. A fast tokenizer spends most of its time in its pre-tokenizer regex, roughly
in proportion to the characters, so tokenising the same system block again for every episode is
most of the CPU an AgentLoop turn costs. `SegmentEncoder` cuts the text right after each
occurrence of a *boundary*, a special token the template renders (`<|im_end|>`, `[/INST]`, ...),
tokenises every piece on its own and remembers the ids (and character offsets) of each piece.

Why that is exact. A fast tokenizer first splits its input around added tokens, then normalises
and pre-tokenises each stretch of text between them on its own, so the ids of `A + B` are the ids
of `A` followed by those of `B` when `A` ends with a special token that

- is matched before normalisation (`normalized=False`) and strips no whitespace after itself
  (`rstrip=False`) nor depends on its neighbours (`single_word=False`), and
- cannot be part of a longer or overlapping added-token match (no other added token contains
  it, starts with one of its suffixes or ends with one of its prefixes).

Boundaries are chosen by those rules among the special tokens that occur in the probe texts the
caller passes (renders of typical conversations), and the choice is then checked on the probe
texts themselves: a boundary whose pieces do not reproduce the whole-text ids there is dropped.
Tokenizers without a Rust backend (slow tokenizers) get no boundaries and no cache: they encode
the whole text each time, as before.

The cache is bounded by the characters it holds (`max_chars`); the oldest pieces go first. It is
safe to share between threads (CPython dict operations are atomic; eviction holds a lock).

This module knows nothing of chat templates or messages: `agentrl.chat` renders, this tokenises.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["SegmentEncoder"]

_Entry = tuple[tuple[int, ...], tuple[tuple[int, int], ...]]


class SegmentEncoder:
    """Ids (and offsets) of text, tokenised piece by piece with a cache (see the module doc)."""

    def __init__(self, tokenizer: Any, probe_texts: Iterable[str] = (), *, max_chars: int = 4_000_000) -> None:
        self.tokenizer = tokenizer
        self.max_chars = max_chars
        self._backend = tokenizer.backend_tokenizer if getattr(tokenizer, "is_fast", False) else None
        self._cache: dict[str, _Entry] = {}
        self._chars = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        probes = [t for t in probe_texts if t]
        self.boundaries: tuple[str, ...] = self._choose_boundaries(probes) if self._backend is not None else ()
        self._split = (
            re.compile("|".join(re.escape(b) for b in sorted(self.boundaries, key=len, reverse=True)))
            if self.boundaries
            else None
        )

    @property
    def cached_pieces(self) -> int:
        return len(self._cache)

    # ── encoding ────────────────────────────────────────────────────────────────────────────
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, exactly as the tokenizer gives them without added special tokens."""
        if self._backend is None:
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        out: list[int] = []
        for _, piece in self._pieces(text):
            out.extend(self._lookup(piece)[0])
        return out

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]] | None]:
        """Ids of `text` and each token's character span in it (None for slow tokenizers)."""
        if self._backend is None:
            return self.encode(text), None
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        for start, piece in self._pieces(text):
            piece_ids, piece_offsets = self._lookup(piece)
            ids.extend(piece_ids)
            if start:
                offsets.extend([(s + start, e + start) for s, e in piece_offsets])
            else:
                offsets.extend(piece_offsets)
        return ids, offsets

    def clear(self) -> None:
        """Forget every cached piece."""
        with self._lock:
            self._cache.clear()
            self._chars = 0

    # ── internals ───────────────────────────────────────────────────────────────────────────
    def _pieces(self, text: str) -> list[tuple[int, str]]:
        if self._split is None:
            return [(0, text)]
        out: list[tuple[int, str]] = []
        pos = 0
        for match in self._split.finditer(text):
            out.append((pos, text[pos : match.end()]))
            pos = match.end()
        if pos < len(text):
            out.append((pos, text[pos:]))
        return out

    def _lookup(self, piece: str) -> _Entry:
        entry = self._cache.get(piece)
        if entry is not None:
            self.hits += 1
            return entry
        self.misses += 1
        if self._backend is None:  # callers take the slow tokenizer's own path before coming here
            raise RuntimeError("SegmentEncoder._lookup needs a fast tokenizer.")
        enc = self._backend.encode(piece, add_special_tokens=False)
        entry = (tuple(enc.ids), tuple(enc.offsets))
        if len(piece) <= self.max_chars // 8:  # one huge tool output must not flush the cache
            with self._lock:
                if piece not in self._cache:
                    self._cache[piece] = entry
                    self._chars += len(piece)
                    while self._chars > self.max_chars and self._cache:
                        oldest = next(iter(self._cache))
                        self._chars -= len(oldest)
                        del self._cache[oldest]
        return entry

    def _whole(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _choose_boundaries(self, probes: Sequence[str]) -> tuple[str, ...]:
        added = list(getattr(self.tokenizer, "added_tokens_decoder", {}).values())
        contents = [str(getattr(t, "content", t)) for t in added]
        candidates = [
            tok.content
            for tok in added
            if getattr(tok, "special", False)
            and not getattr(tok, "rstrip", True)
            and not getattr(tok, "single_word", True)
            and not getattr(tok, "normalized", True)
            and tok.content
            and any(tok.content in p for p in probes)
            and not _overlaps_another(tok.content, contents)
        ]
        kept = []
        for boundary in dict.fromkeys(candidates):
            if all(self._splits_exactly(p, boundary) for p in probes if boundary in p):
                kept.append(boundary)
        return tuple(kept)

    def _splits_exactly(self, text: str, boundary: str) -> bool:
        pieces, pos = [], 0
        while (at := text.find(boundary, pos)) >= 0:
            pieces.append(text[pos : at + len(boundary)])
            pos = at + len(boundary)
        pieces.append(text[pos:])
        ids = [i for piece in pieces if piece for i in self._whole(piece)]
        return ids == self._whole(text)


def _overlaps_another(token: str, others: Sequence[str]) -> bool:
    """True if a match of another added token could cover part of `token` and text beyond it."""
    for other in others:
        if other == token or not other:
            continue
        if token in other:
            return True
        for k in range(1, len(token)):
            if other.startswith(token[k:]) or other.endswith(token[:k]):
                return True
    return False
