"""From a list of `Trajectory` to model-ready tensors: packed without padding, or padded.

Packing concatenates the token ledgers into one row: `position_ids` restart at 0 for every
sequence and `cu_seqlens` marks the boundaries, so attention kernels that understand packed
input (flash-attention's varlen kernels; in Hugging Face transformers ≥ 5, the `sdpa` and `eager`
paths too, which detect restarting `position_ids` when no `attention_mask` and no cache are
given) never attend across sequences. For kernels that do not, `block_causal_mask` builds the
equivalent explicit 4D mask. `split_micro_batches` cuts a batch into token-budget micro-batches of
balanced length.

Every per-token tensor is aligned with next-token prediction: position t holds what the logits at
t are scored against, i.e. token t+1 of the same sequence (`labels`), whether that token is
trained on (`loss_mask`, the response mask shifted left and zeroed for untrainable trajectories)
and its rollout logprob. The last position of each sequence predicts nothing and is masked.
`compute_token_logprobs` and `compute_entropy` turn logits into those per-token values at the
sampling temperature, a chunk of tokens at a time.

This module does not run models or compute advantages; see `algos` for that.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from agentrl.types import TokenOrigin, Trajectory

__all__ = [
    "PackedBatch",
    "PaddedBatch",
    "block_causal_mask",
    "compute_entropy",
    "compute_token_logprobs",
    "pack_micro_batches",
    "pack_trajectories",
    "packed_to_padded",
    "pad_trajectories",
    "padded_to_packed",
    "prefix_key",
    "prefix_units",
    "shared_cost",
    "split_micro_batches",
    "zero_loss_micro_batch",
]


@dataclass
class PackedBatch:
    """Sequences concatenated into one row; every per-token tensor has shape (1, total_tokens).

    `cu_seqlens` (int32) holds the boundaries of the row's segments: one per sequence, unless
    prefixes are shared (then a shared prefix is a segment of its own and each sequence's segment
    holds the rest of it). `segment_ids` gives the sequence number of each token (for
    `algos.aggregate_loss(..., segment_ids=...)`; a shared prefix counts as its first sequence's,
    it holds no loss token), `seq_lengths` each sequence's full length, `indices` the position of
    each sequence in the caller's list. `token_rows` / `token_cols` name the sequence (0..S-1) and
    the column of every token of the row; `shared` lists (source, dest, n): sequence `dest`'s first
    `n` tokens are sequence `source`'s, packed once. `attention_mask` is set only when prefixes are
    shared.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    segment_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    seq_lengths: list[int]
    indices: list[int]
    token_rows: torch.Tensor
    token_cols: torch.Tensor
    attention_mask: torch.Tensor | None = None
    shared: list[tuple[int, int, int]] = field(default_factory=list)
    kept_ids: torch.Tensor | None = None
    """(1, N, K) the kept set (token ids, padded with -1) of the token each position predicts, for
    the trainer to score over that set (`Trajectory.kept_sets`); all -1 where there is none (not a
    sampled token, or an overflowed set). None when no trajectory of the batch records kept sets."""

    @property
    def max_seqlen(self) -> int:
        return max(self.seq_lengths, default=0)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[-1])

    @property
    def shares_prefixes(self) -> bool:
        return self.attention_mask is not None

    def model_inputs(self) -> dict[str, Any]:
        """Keyword arguments for a Hugging Face causal LM forward on this packed row.

        Without shared prefixes: no attention mask and no cache, which is what makes transformers
        detect the packed sequences from the restarting `position_ids`; a cache (`use_cache=True`,
        the config default) would silently turn the detection off and let sequences attend to each
        other. With shared prefixes: the explicit boolean (1, 1, N, N) mask (for `sdpa`; see
        `pack_trajectories`), which transformers uses as given.
        """
        inputs = {"input_ids": self.input_ids, "position_ids": self.position_ids, "use_cache": False}
        if self.attention_mask is not None:
            inputs["attention_mask"] = self.attention_mask
        return inputs

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """`(batch, max_len)` per-trajectory values (rows named by `indices`) laid out like this
        micro-batch: `(1, N)`. A shared prefix token takes the value of its first trajectory."""
        index = torch.tensor(self.indices, dtype=torch.long)[self.token_rows]
        return rows[index, self.token_cols].unsqueeze(0)

    def scatter(self, values: torch.Tensor, out: torch.Tensor) -> None:
        """Write this micro-batch's `(1, N)` values into the `(batch, max_len)` rows `indices`
        names: every trajectory gets the values of its shared prefix too, and each sequence's
        last position (it predicts nothing) is set to 0."""
        flat = values.detach().reshape(-1).to(out.device, out.dtype)
        index = torch.tensor(self.indices, dtype=torch.long)
        out[index[self.token_rows], self.token_cols] = flat
        for source, dest, n in self.shared:
            out[index[dest], :n] = out[index[source], :n]
        out[index, torch.tensor(self.seq_lengths, dtype=torch.long) - 1] = 0.0


@dataclass
class PaddedBatch:
    """Sequences right-padded to the longest one; per-token tensors have shape (batch, max_len)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    seq_lengths: list[int]
    indices: list[int]

    def model_inputs(self) -> dict[str, Any]:
        """Keyword arguments for a Hugging Face causal LM forward on this padded batch."""
        return {
            "input_ids": self.input_ids,
            "attention_mask": self.attention_mask,
            "position_ids": self.position_ids,
            "use_cache": False,
        }


# ── building batches ────────────────────────────────────────────────────────────────────────────
def _shifted_kept(traj: Trajectory) -> list[list[int] | None] | None:
    """Each position's kept set of the token it predicts (None: not a sampled token), aligned like
    the labels; None when the trajectory records no kept sets (the whole vocabulary was kept)."""
    if not traj.kept_sets:
        return None
    sampled = int(TokenOrigin.SAMPLED)
    sets = iter(traj.kept_sets)
    per_token = [next(sets) if o == sampled else None for o in traj.origins]
    return [*per_token[1:], None]


def _shifted_rows(traj: Trajectory, pos: int) -> tuple[list[int], list[float], list[float]]:
    """(labels, loss_mask, rollout_logprobs) of one trajectory, aligned with next-token logits.
    A sampled token whose kept set overflowed the cap (`[]`) is left out of the loss: its rollout
    logprob is over a set the trainer does not know, and scoring it over the whole vocabulary
    instead would bias its ratio."""
    n = len(traj.token_ids)
    if n == 0:
        raise ValueError(
            f"trajectory {pos} (episode '{traj.episode_id}') has no tokens; drop it before packing."
        )
    if not (len(traj.origins) == len(traj.logprobs) == n):
        raise ValueError(
            f"trajectory {pos} (episode '{traj.episode_id}') has {n} tokens but {len(traj.origins)} "
            f"origins and {len(traj.logprobs)} logprobs; build it with Trajectory.extend."
        )
    keep = 1.0 if traj.trainable else 0.0
    mask = traj.response_mask
    labels = [*traj.token_ids[1:], 0]
    loss_mask = [float(m) * keep for m in mask[1:]] + [0.0]
    kept = _shifted_kept(traj)
    if kept is not None:
        loss_mask = [0.0 if k is not None and not k else m for m, k in zip(loss_mask, kept, strict=True)]
    logprobs = [*(float(x) for x in traj.logprobs[1:]), 0.0]
    return labels, loss_mask, logprobs


def _prompt_length(traj: Trajectory) -> int:
    """Tokens before the first trainable (sampled) token: the part samples of a group share."""
    mask = traj.response_mask
    for k, m in enumerate(mask):
        if m:
            return k
    return len(mask)


def prefix_key(traj: Trajectory) -> tuple[int, ...] | None:
    """The token ids a trajectory can share with others in a packed row (None: nothing to share).

    That is its prompt minus the last token: every position of it predicts a prompt token (no
    loss), while the last prompt token's logits score the first sampled token, which differs
    between samples, so each trajectory keeps that position for itself.
    """
    n = _prompt_length(traj) - 1
    return tuple(traj.token_ids[:n]) if n >= 1 else None


def shared_cost(lengths: Sequence[int], prefix: int) -> int:
    """Packed tokens of trajectories of `lengths` that share a `prefix`-token prefix."""
    return sum(lengths) - (len(lengths) - 1) * prefix if len(lengths) > 1 else sum(lengths)


def pack_trajectories(
    trajectories: Sequence[Trajectory], *, device: torch.device | str = "cpu", share_prefixes: bool = False
) -> PackedBatch:
    """Concatenate trajectories into one padding-free row (see the module docstring).

    With `share_prefixes`, trajectories with the same prompt (`prefix_key`: the samples of a
    GRPO group) put it in the row once: the prefix, then each trajectory's remaining tokens, with
    `position_ids` continuing from the prefix, and an explicit boolean attention mask (each token
    sees its own segment causally and, in a trajectory's segment, the shared prefix). The forward
    and backward are the same as with every prompt repeated (the prefix's activations get the
    gradients of all its trajectories), on fewer tokens. `token_rows`/`token_cols` say which
    trajectory token each position is, `gather`/`scatter` move per-token values in and out.
    """
    if not trajectories:
        raise ValueError("cannot pack an empty list of trajectories.")
    ids: list[int] = []
    positions: list[int] = []
    labels: list[int] = []
    loss_mask: list[float] = []
    logprobs: list[float] = []
    segments: list[int] = []
    rows: list[int] = []
    cols: list[int] = []
    lengths = [len(t.token_ids) for t in trajectories]
    starts: list[int] = []  # start of each physical segment in the row
    parent: list[int] = []  # for each physical segment, the shared-prefix segment it sees (-1: none)
    shared: list[tuple[int, int, int]] = []
    shifted = [_shifted_rows(t, i) for i, t in enumerate(trajectories)]
    kept_of = [_shifted_kept(t) for t in trajectories]
    kept: list[list[int] | None] | None = [] if any(k is not None for k in kept_of) else None

    def emit(i: int, lo: int, hi: int, seen: int) -> None:
        starts.append(len(ids))
        parent.append(seen)
        lab, msk, lps = shifted[i]
        ids.extend(trajectories[i].token_ids[lo:hi])
        positions.extend(range(lo, hi))
        labels.extend(lab[lo:hi])
        loss_mask.extend(msk[lo:hi])
        logprobs.extend(lps[lo:hi])
        if kept is not None:
            own = kept_of[i]
            kept.extend(own[lo:hi] if own is not None else [None] * (hi - lo))
        segments.extend([i] * (hi - lo))
        rows.extend([i] * (hi - lo))
        cols.extend(range(lo, hi))

    groups: dict[tuple[int, ...] | int, list[int]] = {}
    for i, traj in enumerate(trajectories):
        prompt = prefix_key(traj) if share_prefixes else None
        groups.setdefault(prompt if prompt is not None else -1 - i, []).append(i)
    for key, members in groups.items():
        if isinstance(key, int) or len(members) == 1:
            for i in members:
                emit(i, 0, lengths[i], -1)
            continue
        n = len(key)
        emit(members[0], 0, n, -1)
        prefix_segment = len(starts) - 1
        for i in members:
            emit(i, n, lengths[i], prefix_segment)
            if i != members[0]:
                shared.append((members[0], i, n))
    cu = [*starts, len(ids)]

    def row(values: Sequence[float], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device).unsqueeze(0)

    attention_mask = None
    if shared:
        seg_of = torch.repeat_interleave(
            torch.arange(len(starts)), torch.tensor([b - a for a, b in itertools.pairwise(cu)])
        )
        sees = torch.tensor(parent)[seg_of]
        idx = torch.arange(len(ids))
        same = (seg_of[:, None] == seg_of[None, :]) | (sees[:, None] == seg_of[None, :])
        attention_mask = (same & (idx[None, :] <= idx[:, None]))[None, None].to(device)
    return PackedBatch(
        input_ids=row(ids, torch.long),
        position_ids=row(positions, torch.long),
        labels=row(labels, torch.long),
        loss_mask=row(loss_mask, torch.float32),
        rollout_logprobs=row(logprobs, torch.float32),
        segment_ids=row(segments, torch.long),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device),
        seq_lengths=lengths,
        indices=list(range(len(trajectories))),
        token_rows=torch.tensor(rows, dtype=torch.long),
        token_cols=torch.tensor(cols, dtype=torch.long),
        attention_mask=attention_mask,
        shared=shared,
        kept_ids=None if kept is None else _kept_tensor(kept, device),
    )


def _kept_tensor(kept: Sequence[list[int] | None], device: torch.device | str) -> torch.Tensor:
    """(1, N, K) ids of each position's kept set, left-aligned and padded with -1."""
    width = max((len(k) for k in kept if k), default=1)
    out = torch.full((len(kept), width), -1, dtype=torch.long)
    for row, ids in enumerate(kept):
        if ids:
            out[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out.unsqueeze(0).to(device)


def zero_loss_micro_batch(device: torch.device | str = "cpu") -> PackedBatch:
    """A two-token prompt with no sampled token: an all-zero loss mask. A backend runs it to keep a
    rank in step with the others' collectives, or so that an update whose every row was left out
    still gives each parameter its (zero) gradient."""
    empty = Trajectory()
    empty.extend([0, 0], TokenOrigin.PROMPT, 0)
    return pack_trajectories([empty], device=device)


def pad_trajectories(
    trajectories: Sequence[Trajectory], *, pad_token_id: int = 0, device: torch.device | str = "cpu"
) -> PaddedBatch:
    """Right-pad trajectories to the longest one: the layout to compare packing against."""
    if not trajectories:
        raise ValueError("cannot pad an empty list of trajectories.")
    rows = [_shifted_rows(t, i) for i, t in enumerate(trajectories)]
    lengths = [len(t.token_ids) for t in trajectories]
    batch, width = len(trajectories), max(lengths)
    input_ids = torch.full((batch, width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, width), dtype=torch.long)
    labels = torch.zeros((batch, width), dtype=torch.long)
    loss_mask = torch.zeros((batch, width), dtype=torch.float32)
    logprobs = torch.zeros((batch, width), dtype=torch.float32)
    for i, (traj, (lab, msk, lps), n) in enumerate(zip(trajectories, rows, lengths, strict=True)):
        input_ids[i, :n] = torch.tensor(traj.token_ids)
        attention_mask[i, :n] = 1
        labels[i, :n] = torch.tensor(lab)
        loss_mask[i, :n] = torch.tensor(msk)
        logprobs[i, :n] = torch.tensor(lps)
    position_ids = torch.arange(width).expand(batch, width).clone()
    return PaddedBatch(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        position_ids=position_ids.to(device),
        labels=labels.to(device),
        loss_mask=loss_mask.to(device),
        rollout_logprobs=logprobs.to(device),
        seq_lengths=lengths,
        indices=list(range(batch)),
    )


# ── moving values between the two layouts ───────────────────────────────────────────────────────
def packed_to_padded(values: torch.Tensor, cu_seqlens: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """(1, N, ...) packed values -> (S, max_len, ...) right-padded with `fill`."""
    if values.dim() < 2 or values.shape[0] != 1:
        raise ValueError(f"packed values have shape (1, N, ...); got {tuple(values.shape)}.")
    flat = values[0]
    bounds = cu_seqlens.tolist()
    lengths = [b - a for a, b in itertools.pairwise(bounds)]
    out = flat.new_full((len(lengths), max(lengths, default=0), *flat.shape[1:]), fill)
    for i, (start, n) in enumerate(zip(bounds, lengths, strict=False)):
        out[i, :n] = flat[start : start + n]
    return out


def padded_to_packed(values: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """(S, max_len, ...) right-padded values -> (1, N, ...) packed (padding dropped)."""
    bounds = cu_seqlens.tolist()
    pieces = [values[i, : b - a] for i, (a, b) in enumerate(itertools.pairwise(bounds))]
    return torch.cat(pieces, dim=0).unsqueeze(0)


def block_causal_mask(cu_seqlens: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An explicit (1, 1, N, N) additive mask: causal within each sequence, -inf across them.

    For attention paths that do not detect packed `position_ids`. It costs N² memory, so prefer
    the detection (or a varlen kernel) for long rows. Works with HF `eager` and `sdpa`.
    """
    bounds = cu_seqlens.tolist()
    n = bounds[-1]
    seg = torch.zeros(n, dtype=torch.long, device=cu_seqlens.device)
    for i, (a, b) in enumerate(itertools.pairwise(bounds)):
        seg[a:b] = i
    idx = torch.arange(n, device=cu_seqlens.device)
    allowed = (seg[:, None] == seg[None, :]) & (idx[None, :] <= idx[:, None])
    mask = torch.zeros((n, n), dtype=dtype, device=cu_seqlens.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


# ── micro-batches ───────────────────────────────────────────────────────────────────────────────
def split_micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Split sequences into as few micro-batches of at most `max_tokens` tokens as greedy finds.

    Longest-processing-time-first: start from k = ⌈Σ lengths / max_tokens⌉ bins, give each
    sequence, longest first, to the least-loaded bin, and retry with k + 1 bins if one overflows.
    Bins end up close to equal in tokens, so data-parallel ranks and micro-steps take similar time.
    Returns lists of indices into `lengths`, each sorted, ordered by their first index. A sequence
    longer than `max_tokens` is a micro-batch on its own.
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}.")
    # A sequence longer than the budget (an episode whose last tool output ran past the token
    # budget, say) gets a micro-batch of its own rather than failing the step.
    alone = [[i] for i, n in enumerate(lengths) if n > max_tokens]
    if alone:
        rest = [i for i, n in enumerate(lengths) if n <= max_tokens]
        fitting = [[rest[j] for j in b] for b in split_micro_batches([lengths[i] for i in rest], max_tokens)]
        return sorted(alone + fitting, key=lambda b: b[0])
    if not lengths:
        return []
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    k = max(1, math.ceil(sum(lengths) / max_tokens))
    while True:
        heap = [(0, b) for b in range(k)]
        bins: list[list[int]] = [[] for _ in range(k)]
        overflow = False
        for i in order:
            load, b = heapq.heappop(heap)
            load += lengths[i]
            overflow |= load > max_tokens
            bins[b].append(i)
            heapq.heappush(heap, (load, b))
        if not overflow:
            return sorted((sorted(b) for b in bins if b), key=lambda b: b[0])
        k += 1


def prefix_units(
    trajectories: Sequence[Trajectory], max_tokens: int, *, min_units: int = 1
) -> list[tuple[list[int], int]]:
    """Trajectories that share a prompt (`prefix_key`), as units of (indices, packed tokens).

    A unit is packed with its prefix once, so micro-batches and ranks should be planned over units
    with these costs (`split_micro_batches`, `balanced_shares`). A unit over `max_tokens` is cut
    into several (each repeats the prefix), and the largest units are halved until there are at
    least `min_units` of them (so every data-parallel rank gets work). Units are in order of their
    first trajectory.
    """
    lengths = [len(t.token_ids) for t in trajectories]
    by_key: dict[tuple[int, ...] | int, list[int]] = {}
    prefix: dict[tuple[int, ...] | int, int] = {}
    for i, traj in enumerate(trajectories):
        prompt = prefix_key(traj)
        key: tuple[int, ...] | int = prompt if prompt is not None else -1 - i
        by_key.setdefault(key, []).append(i)
        prefix[key] = len(key) if isinstance(key, tuple) else 0
    units: list[tuple[list[int], int]] = []
    for key, members in by_key.items():
        n = prefix[key]
        chunk: list[int] = []
        for i in members:
            if chunk and shared_cost([lengths[j] for j in [*chunk, i]], n) > max_tokens:
                units.append((chunk, n))
                chunk = []
            chunk.append(i)
        units.append((chunk, n))
    while units and len(units) < min_units:
        k = max(range(len(units)), key=lambda u: (len(units[u][0]), -u))
        members, n = units[k]
        if len(members) < 2:
            break
        half = len(members) // 2
        units[k : k + 1] = [(members[:half], n), (members[half:], n)]
    out = [(m, shared_cost([lengths[j] for j in m], n)) for m, n in units]
    return sorted(out, key=lambda u: u[0][0])


def pack_micro_batches(
    trajectories: Sequence[Trajectory], max_tokens: int, *, device: torch.device | str = "cpu"
) -> list[PackedBatch]:
    """Split trajectories into balanced micro-batches of at most `max_tokens` tokens and pack each.

    Each batch's `indices` point into `trajectories`, so per-sequence values (scores, advantages)
    can be gathered for it and results scattered back.
    """
    bins = split_micro_batches([len(t.token_ids) for t in trajectories], max_tokens)
    batches = []
    for members in bins:
        batch = pack_trajectories([trajectories[i] for i in members], device=device)
        batch.indices = list(members)
        batches.append(batch)
    return batches


# ── logits to per-token values ──────────────────────────────────────────────────────────────────
def _chunked(
    fn: Callable[..., torch.Tensor], logits: torch.Tensor, *extra: torch.Tensor, chunk_size: int
) -> torch.Tensor:
    """Apply `fn` to chunks of tokens; under autograd each chunk is recomputed in backward, so the
    fp32 softmax of only one chunk is alive at a time instead of one for the whole batch."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}.")
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    flat_extra = [e.reshape(-1) for e in extra]
    outs = []
    for start in range(0, flat.shape[0], chunk_size):
        args = (flat[start : start + chunk_size], *(e[start : start + chunk_size] for e in flat_extra))
        if torch.is_grad_enabled() and flat.requires_grad:
            outs.append(checkpoint(fn, *args, use_reentrant=False))
        else:
            outs.append(fn(*args))
    if not outs:
        return flat.new_zeros(lead, dtype=torch.float32)
    return torch.cat(outs).reshape(lead)


def _check_temperature(temperature: float) -> None:
    if temperature <= 0:
        raise ValueError(
            f"temperature must be > 0 to score tokens, got {temperature}; for greedy rollouts use 1.0."
        )


def compute_token_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, *, chunk_size: int = 2048
) -> torch.Tensor:
    """log softmax(logits / T)[label] per position, in fp32: logit_y/T - logsumexp(logits/T).

    `logits` is (..., vocab) and `labels` (...); the result has the shape of `labels`. Scoring at
    the sampling temperature T is what makes these comparable to the inference engine's logprobs.
    """
    _check_temperature(temperature)
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)}.")

    def score(chunk: torch.Tensor, chunk_labels: torch.Tensor) -> torch.Tensor:
        z = chunk.float() / temperature
        picked = z.gather(-1, chunk_labels.long().unsqueeze(-1)).squeeze(-1)
        return picked - torch.logsumexp(z, dim=-1)

    return _chunked(score, logits, labels, chunk_size=chunk_size)


def compute_entropy(
    logits: torch.Tensor, temperature: float = 1.0, *, chunk_size: int = 2048
) -> torch.Tensor:
    """Entropy of softmax(logits / T) per position, in fp32: H = logsumexp(z) - Σ softmax(z)·z."""
    _check_temperature(temperature)

    def entropy(chunk: torch.Tensor) -> torch.Tensor:
        z = chunk.float() / temperature
        return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1)

    return _chunked(entropy, logits, chunk_size=chunk_size)
