"""Trajectory files: the one on-disk format of episodes, written by `agentrl eval` and each step of `agentrl run`.

A trajectory file is JSON Lines, one episode per line, readable without agentrl or a tokenizer.
`agentrl eval` writes every episode to `trajectories.jsonl` in its output directory (and the run's
held-out evaluations to `eval/step-N/trajectories.jsonl`); `agentrl run` writes a sample of each
step's rollouts to `rollouts/step-N.jsonl` (`RolloutLog`, chosen by `run.keep_rollouts`: all
groups, or N groups that always include the best and the worst by mean reward, plus every group
with an infrastructure-failed episode). Step N is the N-th training step, the one that produced
policy version N from N-1: the same numbering as the x axis of `agentrl plot` and `eval/step-N`.

One line (`format: "agentrl.trajectory/1"`):

| key | what |
|---|---|
| `source` | `train` (a step's rollouts) or `eval` |
| `step` | train: the step that used the episode; eval: null (the directory says when) |
| `status` | what became of the episode's group: `trained`, `filtered` (not trained: e.g. equal rewards), `infra` (every episode failed for infrastructure reasons), `eval` |
| `kept_as` | why the step's sample holds this group: `best`, `worst`, `infra`, `sample`, `all`; `stopped` in `step-N-stopped.jsonl` (the infrastructure-failed episodes the run stopped on) |
| `trained` | true when its sampled tokens were in the loss (status `trained` and not an infra fault) |
| `loss_tokens`, `masked_tokens` | trained episodes of a run's step: how many of its sampled tokens were in the loss, and the others by cause (`agentrl.types.MASK_CAUSES`: `unpredicted`, `kept_set_overflow`, `rollout_is`, `gate`; causes with none left out), so that `num_sampled` = `loss_tokens` + the masked ones; absent where not trained, in eval files and in files written before they existed |
| `episode_id`, `group_id`, `data_source`, `ground_truth` | where it came from (`ground_truth`: the row's `reward_model.ground_truth`) |
| `reward`, `finish_reason`, `fault`, `error` | how it ended (`fault`: `model`, `infra` or null) |
| `num_tokens`, `num_sampled`, `num_turns` | sizes |
| `segment` | `{"index": k, "of": n}` when the episode was recorded as n trajectories (an external agent that rewrote its history, `Trajectory.segment`), else null |
| `seat` | the seat whose policy sampled the tokens (`Trajectory.seat`), else null |
| `turn_rewards` | the reward of each turn's action, entry k-1 for turn k, null where none was given (`Trajectory.turn_rewards`); `[]` when the episode has only its final reward |
| `metrics`, `info` | the episode's numbers (tool calls, tool errors by class, timings, env metrics) and env details |
| `messages` | the conversation as chat messages, tool calls parsed |
| `segments` | the token ledger, below |

`segments` cut the ledger into runs of tokens with the same origin, turn and policy version, in
order; their concatenation is the whole episode exactly as the model saw it:
`{"origin": "prompt"|"sampled"|"template"|"tool", "turn": k, "start": index of the first token,
"text": decoded text, "ids": [token ids], "pieces": [the text of each token], "version": policy
version (sampled only), "logprobs": [rollout logprob of each token] (sampled only), "kept": [the
sorted kept-set ids of each token; [] when it overflowed] (sampled only, and only when the rollout
truncated the vocabulary: `Trajectory.kept_sets`), "teacher_logprobs": [a teacher's logprob of each
token] (sampled only, and only when a teacher scored the episode: `Trajectory.teacher_logprobs`)}`, and in a
step's kept rollouts the trainer's view of the same tokens where the trainer scored them
(`TrainerTokens`): `"trainer_logprobs"` (the old logprob the loss used, at the step that trained
the episode) and `"trainer_entropy"` (the policy's entropy at that token), sampled segments only,
one value or null per token; absent in eval files, in episodes that were not trained, and in files
written before they existed (those still read). Only
`sampled` tokens are trained on (`response_mask`); `prompt` is the first prompt, `template` the
chat template's markers, `tool` everything the environment said. `"".join(pieces) == text`, and the
texts joined are the tokenizer's decoding of the whole ledger. `trajectory_from_record` turns a
line back into the exact `Trajectory`.

Files written before this format (`Trajectory.to_dict()` plus `text`, origins as integers) are
read too (`read_trajectory_file`); without a tokenizer their tokens carry no text. Files that kept
the segment as an entry of `info` (before it had its own key) are read with it moved to `segment`.
This module only writes and reads files; it does not run episodes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from agentrl.records.run_files import writing
from agentrl.types import FinishReason, Segment, TokenOrigin, Trajectory

__all__ = [
    "FORMAT",
    "ORIGIN_NAMES",
    "RolloutLog",
    "RowIndex",
    "StepGroup",
    "TokenPieces",
    "TrainerTokens",
    "read_trajectory_file",
    "scan_trajectory_file",
    "select_groups",
    "trajectory_from_record",
    "trajectory_record",
    "write_eval_trajectories",
    "write_trajectories",
]

log = logging.getLogger("agentrl.run")

FORMAT = "agentrl.trajectory/1"
ORIGIN_NAMES: dict[int, str] = {int(o): o.name.lower() for o in TokenOrigin}
_ORIGIN_OF: dict[str, int] = {v: k for k, v in ORIGIN_NAMES.items()}

Keep = int | Literal["all"]


class RowIndex(Protocol):
    """Where a group's dataset row is: `index` into the rows of its step."""

    @property
    def index(self) -> int: ...


class StepGroup(Protocol):
    """One prompt's episodes of a training step, as the scheduler hands them over (its `GroupResult`)."""

    @property
    def prompt(self) -> RowIndex: ...

    @property
    def trajectories(self) -> Sequence[Trajectory]: ...


class TokenPieces:
    """The text of each token, without re-tokenising anything, for one tokenizer.

    A token's text is what it adds after a fixed anchor token (so tokenizers that drop a leading
    space at the start of a sequence still show it), cached per id: the vocabulary does not change,
    so after the first steps this costs a dict lookup per token. Tokens that hold only part of a
    UTF-8 character (byte-level BPE splits some characters) are decoded together and the character
    goes to the last of them, so the pieces always join to the tokenizer's own decoding.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self._anchor = list(tokenizer.encode("a", add_special_tokens=False))[:1]
        self._anchor_text = self._decode(self._anchor)

    def _decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False))

    def _after_anchor(self, text: str) -> str:
        return text[len(self._anchor_text):] if text.startswith(self._anchor_text) else text

    def __call__(self, ids: Sequence[int]) -> list[str]:
        cache = self._cache
        new = [i for i in set(ids) if i not in cache]
        if new:
            decoded = self.tokenizer.batch_decode([[*self._anchor, i] for i in new], skip_special_tokens=False,
                                                  clean_up_tokenization_spaces=False)
            for i, text in zip(new, decoded, strict=True):
                cache[i] = self._after_anchor(text)
        pieces = [cache[i] for i in ids]
        k, n = 0, len(pieces)
        while k < n:  # runs of partial characters: decode them together
            if "\ufffd" not in pieces[k]:
                k += 1
                continue
            j = k
            while j < n and "\ufffd" in pieces[j]:
                j += 1
            whole = self._after_anchor(self._decode([*self._anchor, *ids[k:j]]))
            pieces[k:j] = [""] * (j - k - 1) + [whole]
            k = j
        return pieces


@dataclass(frozen=True)
class TrainerTokens:
    """What the trainer computed for each token of one trained trajectory, beside the rollout's logprobs.

    `logprobs[i]` is the trainer's logprob of ledger token i (the old logprob of the loss) and
    `entropy[i]` the policy's entropy at it, None where the trainer scored nothing (every token that
    is not sampled, and sampled tokens outside the loss). Both are as long as the ledger; `entropy`
    is None when the trainer did not measure it. Where the two logprobs differ, the rollout was
    off-policy on that token (a different engine, numerics, or a stale policy version).
    """

    logprobs: Sequence[float | None]
    entropy: Sequence[float | None] | None = None


# ── one episode <-> one line ───────────────────────────────────────────────────────────────


def _segments(t: Trajectory, pieces: list[str] | None, trainer: TrainerTokens | None = None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    n = len(t.token_ids)
    start = 0
    sampled = int(TokenOrigin.SAMPLED)
    kept_at = 0  # index into t.kept_sets (one per sampled token, in ledger order)
    while start < n:
        origin, turn, version = t.origins[start], t.turns[start], t.versions[start]
        end = start + 1
        while end < n and t.origins[end] == origin and t.turns[end] == turn and t.versions[end] == version:
            end += 1
        seg: dict[str, Any] = {"origin": ORIGIN_NAMES.get(origin, str(origin)), "turn": turn, "start": start}
        if pieces is not None:
            seg["text"] = "".join(pieces[start:end])
        seg["ids"] = t.token_ids[start:end]
        if pieces is not None:
            seg["pieces"] = pieces[start:end]
        if origin == sampled:
            seg["version"] = version
            seg["logprobs"] = t.logprobs[start:end]
            if t.kept_sets:  # each sampled token's kept set ([]: overflowed); absent: whole vocabulary
                seg["kept"] = t.kept_sets[kept_at : kept_at + end - start]
                kept_at += end - start
            if t.teacher_logprobs:
                seg["teacher_logprobs"] = t.teacher_logprobs[start:end]
            if trainer is not None:
                seg["trainer_logprobs"] = list(trainer.logprobs[start:end])
                if trainer.entropy is not None:
                    seg["trainer_entropy"] = list(trainer.entropy[start:end])
        out.append(seg)
        start = end
    return out


def trajectory_record(
    t: Trajectory,
    pieces: TokenPieces | None,
    *,
    source: Literal["train", "eval"],
    step: int | None = None,
    status: str = "eval",
    kept_as: Sequence[str] = (),
    ground_truth: Any = None,
    trainer: TrainerTokens | None = None,
    masked_tokens: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """One line of a trajectory file (see the module docstring).

    `kept_as` is a sequence of reasons; a bare string is refused (it would be written letter by letter).
    `trainer`: the trainer's logprob and entropy of each token, for a trained episode;
    `masked_tokens`: its sampled tokens the step left out of the loss, by cause."""
    if isinstance(kept_as, str):
        raise TypeError(f"kept_as takes a sequence of reasons, such as ({kept_as!r},), not a bare string")
    if trainer is not None and (len(trainer.logprobs) != len(t.token_ids) or (
            trainer.entropy is not None and len(trainer.entropy) != len(t.token_ids))):
        raise ValueError(f"the trainer's values cover {len(trainer.logprobs)} tokens, the ledger of episode "
                         f"{t.episode_id!r} has {len(t.token_ids)}; pass one value (or None) per ledger token")
    trained = status == "trained" and t.trainable
    books: dict[str, Any] = {}
    if trained and masked_tokens is not None:
        books = {"loss_tokens": t.num_sampled - sum(masked_tokens.values()), "masked_tokens": dict(masked_tokens)}
    return {
        "format": FORMAT,
        "source": source,
        "step": step,
        "status": status,
        "kept_as": list(kept_as),
        "trained": trained,
        **books,
        "episode_id": t.episode_id,
        "group_id": t.group_id,
        "data_source": t.data_source,
        "ground_truth": ground_truth,
        "reward": t.reward,
        "finish_reason": t.finish_reason.value if t.finish_reason else None,
        "fault": t.fault,
        "error": t.error,
        "num_tokens": len(t.token_ids),
        "num_sampled": t.num_sampled,
        "num_turns": t.num_turns,
        "segment": {"index": t.segment.index, "of": t.segment.of} if t.segment is not None else None,
        "seat": t.seat,
        "turn_rewards": t.turn_rewards,
        "metrics": t.metrics,
        "info": t.info,
        "messages": t.messages,
        "segments": _segments(t, pieces(t.token_ids) if pieces is not None else None, trainer),
    }


def trajectory_from_record(record: dict[str, Any]) -> Trajectory:
    """The `Trajectory` a line was written from (either format)."""
    if "segments" not in record:  # the format before this one: Trajectory.to_dict() plus text
        known = set(Trajectory.__dataclass_fields__)
        return Trajectory.from_dict({k: v for k, v in record.items() if k in known})
    record = _segment_lifted(record)
    t = Trajectory(
        messages=list(record.get("messages") or []), reward=record.get("reward"),
        finish_reason=FinishReason(record["finish_reason"]) if record.get("finish_reason") else None,
        fault=record.get("fault"), error=record.get("error"), episode_id=record.get("episode_id", ""),
        group_id=record.get("group_id", ""), data_source=record.get("data_source", ""),
        metrics=dict(record.get("metrics") or {}), info=dict(record.get("info") or {}),
        segment=Segment.from_dict(record.get("segment")), seat=record.get("seat"),
        turn_rewards=list(record.get("turn_rewards") or []),
    )  # fmt: skip
    scored_by_teacher = any("teacher_logprobs" in seg for seg in record["segments"])
    for seg in record["segments"]:
        ids = seg["ids"]
        origin = _ORIGIN_OF[seg["origin"]]
        t.token_ids.extend(ids)
        t.origins.extend([origin] * len(ids))
        t.turns.extend([seg["turn"]] * len(ids))
        if "logprobs" in seg:
            t.logprobs.extend(seg["logprobs"])
            t.versions.extend([seg["version"]] * len(ids))
            t.kept_sets.extend(seg.get("kept") or [])
            if scored_by_teacher:
                t.teacher_logprobs.extend(seg["teacher_logprobs"])
        else:
            t.logprobs.extend([0.0] * len(ids))
            t.versions.extend([-1] * len(ids))
            if scored_by_teacher:
                t.teacher_logprobs.extend([0.0] * len(ids))
    return t


def _finite(value: Any) -> Any:
    """`value` with every non-finite float replaced by None (JSON has no NaN; browsers refuse it)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _dumps(record: dict[str, Any]) -> str:
    try:
        return json.dumps(record, allow_nan=False, default=str)
    except ValueError:
        return json.dumps(_finite(record), allow_nan=False, default=str)


def write_trajectories(path: str | Path, records: Iterable[dict[str, Any]], run_dir: str | Path | None = None) -> int:
    """Write `records` (from `trajectory_record`) to `path` as JSON Lines; return how many.

    A write that fails where it writes (a full disk, a read-only filesystem) raises `RunWriteError`
    (`run_files`) and leaves no temporary file behind. With `run_dir` (a run's directory), only the
    last folder of `path` is made: a run directory that vanished is reported, not silently recreated.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    n = 0
    with writing(path, run_dir):
        if run_dir is None or Path(run_dir).is_dir():
            path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with tmp.open("w") as f:
                for record in records:
                    f.write(_dumps(record) + "\n")
                    n += 1
            tmp.replace(path)  # a reader (the viewer) never sees half a file
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
    return n


def write_eval_trajectories(
    path: str | Path, groups: Sequence[Sequence[Trajectory]], rows: Sequence[dict[str, Any]], tokenizer: Any,
) -> int:
    """`agentrl eval`'s file: every episode of every group, with its row's ground truth."""
    pieces = TokenPieces(tokenizer)
    return write_trajectories(path, (
        trajectory_record(t, pieces, source="eval", ground_truth=_ground_truth(row))
        for group, row in zip(groups, rows, strict=True) for t in group
    ))  # fmt: skip


def _ground_truth(row: dict[str, Any] | None) -> Any:
    return ((row or {}).get("reward_model") or {}).get("ground_truth")


def read_trajectory_file(path: str | Path) -> list[dict[str, Any]]:
    """The lines of a trajectory file, in this module's format (older files are converted, their
    tokens without text). A line that is not an episode (cut by a crash, or foreign) is skipped."""
    return scan_trajectory_file(path)[0]


def scan_trajectory_file(path: str | Path) -> tuple[list[dict[str, Any]], int]:
    """The episodes of a trajectory file (as `read_trajectory_file`) and how many of its non-blank
    lines are not episodes: not JSON, JSON but not an object, or an object without a usable ledger."""
    out, skipped = [], 0
    with Path(path).open() as f:
        for line in f:
            if not line.strip():
                continue
            try:
                record = json.loads(line, parse_constant=lambda _: None)  # NaN, Infinity: null, as written
                if isinstance(record, dict) and "segments" not in record:  # the older format, or not an episode
                    record = _upgrade(record) if isinstance(record.get("token_ids"), list) else None
                elif isinstance(record, dict):
                    record = _segment_lifted(record)
            except (ValueError, TypeError, KeyError, IndexError, AttributeError):  # JSONDecodeError: a ValueError
                record = None
            if _is_episode(record):
                out.append(record)
            else:
                skipped += 1
    return out, skipped


def _is_episode(record: object) -> bool:
    """Whether a parsed line has the shape a reader relies on: segments with ids, messages as objects."""
    if not isinstance(record, dict) or not isinstance(record.get("segments"), list):
        return False
    for seg in record["segments"]:
        if not (isinstance(seg, dict) and seg.get("origin") in _ORIGIN_OF and isinstance(seg.get("ids"), list)
                and type(seg.get("turn")) is int and type(seg.get("start")) is int):
            return False
        for key in ("pieces", "logprobs", "trainer_logprobs", "trainer_entropy"):
            if key in seg and not (isinstance(seg[key], list) and len(seg[key]) == len(seg["ids"])):
                return False
    messages = record.get("messages")
    if messages is not None and not (isinstance(messages, list) and all(isinstance(m, dict) for m in messages)):
        return False
    return all(record.get(key) is None or isinstance(record[key], dict) for key in ("metrics", "info"))


def _segment_lifted(record: dict[str, Any]) -> dict[str, Any]:
    """`record` with a segment that an older file kept in `info` moved to its own key."""
    info = dict(record.get("info") or {})
    if record.get("segment") is not None or not isinstance(info.get("segment"), dict):
        return record
    return record | {"segment": info.pop("segment"), "info": info}


def _upgrade(old: dict[str, Any]) -> dict[str, Any]:
    t = trajectory_from_record(old)
    record = trajectory_record(t, None, source="eval", ground_truth=old.get("ground_truth"))
    record["text"] = old.get("text")
    return record


# ── a step's sample ────────────────────────────────────────────────────────────────────────


@dataclass
class _Group:
    trajectories: list[Trajectory]
    status: str
    row: dict[str, Any] | None
    kept_as: list[str] = field(default_factory=list)

    @property
    def has_infra(self) -> bool:
        return any(not t.trainable for t in self.trajectories)

    @property
    def mean_reward(self) -> float | None:
        valid = [float(t.reward or 0.0) for t in self.trajectories if t.trainable]
        return sum(valid) / len(valid) if valid else None


def select_groups(mean_rewards: Sequence[float | None], has_infra: Sequence[bool], keep: Keep,
                  rng: random.Random) -> dict[int, list[str]]:
    """Which groups a step's sample keeps, and why: index -> reasons.

    `all` keeps every group. N keeps the best and the worst group by mean reward (over episodes
    that did not fail for infrastructure reasons), then groups drawn at random up to N, and on top
    of those every group with an infrastructure-failed episode. 0 keeps nothing.
    """
    n = len(mean_rewards)
    if keep == "all":
        return {i: ["all"] for i in range(n)}
    chosen: dict[int, list[str]] = {}
    if keep <= 0:
        return chosen
    scored = {i: mean for i, mean in enumerate(mean_rewards) if mean is not None}  # in index order
    if scored:
        best = max(scored, key=scored.__getitem__)
        worst = min(scored, key=scored.__getitem__)
        chosen.setdefault(best, []).append("best")
        if len(chosen) < keep:
            chosen.setdefault(worst, []).append("worst")
    rest = [i for i in scored if i not in chosen]
    for i in rng.sample(rest, min(len(rest), max(0, keep - len(chosen)))):
        chosen[i] = ["sample"]
    for i in range(n):
        if has_infra[i]:
            chosen.setdefault(i, []).append("infra")
    return dict(sorted(chosen.items()))


class RolloutLog:
    """Writes a sample of each training step's rollouts to `RUN_DIR/rollouts/step-N.jsonl`.

    `keep` is `run.keep_rollouts`. The choice of groups is seeded by the run's seed and the step,
    so a resumed run writes the same sample for the same step.
    """

    def __init__(self, run_dir: str | Path, tokenizer: Any, keep: Keep, *, seed: int = 0) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)  # later, a missing run directory is one that vanished
        self.dir = self.run_dir / "rollouts"
        self.keep = keep
        self.seed = seed
        self.pieces = TokenPieces(tokenizer)
        self.last_seconds = 0.0

    def path(self, step: int) -> Path:
        """The file of step `step` (1-based: the step that made policy version `step`)."""
        return self.dir / f"step-{step:06d}.jsonl"

    def _choose(self, step: int, trained: Sequence[StepGroup], discarded: Sequence[StepGroup],
                rows: Sequence[dict[str, Any] | None] | None) -> tuple[list[_Group], dict[int, list[str]]]:
        groups = [_Group(list(g.trajectories), "trained", _row(rows, g)) for g in trained]
        groups += [
            _Group(list(g.trajectories), "filtered" if any(t.trainable for t in g.trajectories) else "infra",
                   _row(rows, g))
            for g in discarded
        ]
        chosen = select_groups([g.mean_reward for g in groups], [g.has_infra for g in groups], self.keep,
                               random.Random(self.seed * 1_000_003 + step))
        return groups, chosen

    def kept_trained(self, step: int, trained: Sequence[StepGroup],
                     discarded: Sequence[StepGroup] = ()) -> list[Trajectory]:
        """The trained trajectories that `write_step` with the same arguments will keep (the choice is
        seeded): the ones whose per-token trainer values are worth fetching from the trainer."""
        if self.keep == 0:
            return []
        groups, chosen = self._choose(step, trained, discarded, None)
        return [t for i in chosen if groups[i].status == "trained" for t in groups[i].trajectories if t.trainable]

    def write_step(self, step: int, trained: Sequence[StepGroup], discarded: Sequence[StepGroup] = (),
                   rows: Sequence[dict[str, Any] | None] | None = None,
                   trainer: Callable[[Trajectory], TrainerTokens | None] | None = None,
                   masked: Callable[[Trajectory], Mapping[str, int] | None] | None = None) -> Path | None:
        """Write step `step`'s sample (`step` 0-based as the scheduler counts; the file is 1-based).

        `trained` and `discarded` are the step's `GroupResult`s (trained, and filtered or failed);
        `rows` the training rows their `prompt.index` points into; `trainer` gives the trainer's
        per-token values of a kept trained trajectory (None: not measured), `masked` its sampled
        tokens out of the loss by cause (None: not known). Returns the file, or None when `keep` is 0.
        """
        if self.keep == 0:
            return None
        start = time.perf_counter()
        groups, chosen = self._choose(step, trained, discarded, rows)
        path = self.path(step + 1)
        write_trajectories(path, (
            trajectory_record(t, self.pieces, source="train", step=step + 1, status=groups[i].status,
                              kept_as=why, ground_truth=_ground_truth(groups[i].row),
                              trainer=trainer(t) if trainer is not None and groups[i].status == "trained" else None,
                              masked_tokens=masked(t) if masked is not None and groups[i].status == "trained" else None)
            for i, why in chosen.items() for t in groups[i].trajectories
        ), run_dir=self.run_dir)  # fmt: skip
        self.last_seconds = time.perf_counter() - start
        return path


    def write_stopped(self, step: int, trajectories: Sequence[Trajectory]) -> Path:
        """Write the infrastructure-failed episodes that stopped the run in step `step` (0-based) to
        `rollouts/step-N-stopped.jsonl`, whatever `keep` is: they are what a user needs to see."""
        path = self.dir / f"step-{step + 1:06d}-stopped.jsonl"
        write_trajectories(path, (
            trajectory_record(t, self.pieces, source="train", step=step + 1, status="infra",
                              kept_as=("stopped",))
            for t in trajectories if not t.trainable
        ), run_dir=self.run_dir)  # fmt: skip
        return path


def _row(rows: Sequence[dict[str, Any] | None] | None, group: StepGroup) -> dict[str, Any] | None:
    prompt: RowIndex | None = getattr(group, "prompt", None)
    if rows is None or prompt is None or not 0 <= prompt.index < len(rows):
        return None
    return rows[prompt.index]
