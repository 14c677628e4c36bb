"""The prompt ledger and the sampler: every prompt a run takes is accounted for, start to end.

`PromptSampler` hands out dataset rows in a seeded order, epoch after epoch, with a requeue that
takes precedence (prompts whose episodes all failed for infrastructure reasons, and prompts that
were in flight when a run stopped). Rows skipped as malformed (`data.skip_bad_rows`) keep their
numbers and are never handed out. Its `state()` is the data position a checkpoint stores, so a
resumed run takes exactly the prompts the uninterrupted run would have taken next.

`PromptLedger` records what became of each prompt *attempt*: `trained` (at which step; its reason
says which sequences the on-policy gate masked, if any),
`filtered` (why: equal rewards under dynamic filtering, prompt too long), `requeued` (its episodes
failed for infrastructure reasons; the prompt goes back to the sampler), `failed` (it failed
`max_attempts` times), or `unfinished` (still in flight or queued when the run ended; a resumed run
takes it first). A dataset row skipped as malformed has one entry of its own, `skipped` (key
`skipped-r<index>`, the reason naming file, row and field), recorded when the run starts; it is
never taken. Ledger indices are the dataset's row numbers (`agentrl.datasets`: consecutive across
files). `check()` proves the books balance: every prompt attempt taken is in exactly one of those
states or still in flight, and no skipped row was taken; `summary()["taken"]` counts attempts, and
`summary()["skipped"]` the skipped rows apart from them. It does not run episodes or train; the
scheduler calls it.

`ledger.jsonl` in the run directory is its journal, appended to and never rewritten: a `taken`
line when an attempt is taken, and one line with its final state when it gets one, each tagged
with the `session` (the n-th start of the run: 0, then 1 for the first resume, ...) that took it.
With `hold_trained` (the driver's ledger), the `trained` lines of a step wait in memory until
`commit_trained`, which the driver calls right after the step's `metrics.jsonl` row: a step is in
both files or in neither. When the run stops in between (a full disk while writing the step's
rollout log), `close_in_flight` journals those attempts `unfinished` instead (the resume trains
them again, from the checkpoint before that step); if even that cannot be written, the next
session's `close_orphans` closes them. Every line goes through `run_files`, so a full disk, a
read-only filesystem or a vanished directory is a `RunWriteError`.
A run that stops by itself, on Ctrl-C or on an exception, closes its in-flight attempts as
`unfinished` before it ends. A run killed outright cannot; the next session closes them
(`close_orphans`, before it takes anything), so every attempt any session took has exactly one
final line (`journal_balance` checks it). A resumed session restores the in-memory books from the
checkpoint and retakes what the killed session did after it, under its own session number.
"""

from __future__ import annotations

import json
import random
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from agentrl.errors import AgentRLError
from agentrl.records.run_files import append_text, writing

__all__ = [
    "LedgerError",
    "PromptLedger",
    "PromptRef",
    "PromptSampler",
    "PromptStatus",
    "close_orphans",
    "journal_balance",
    "next_session",
    "read_journal",
]

PromptStatus = Literal["in_flight", "trained", "filtered", "requeued", "failed", "unfinished", "skipped"]
_FINAL: frozenset[str] = frozenset({"trained", "filtered", "requeued", "failed", "unfinished"})
_SKIPPED: Literal["skipped"] = "skipped"


class LedgerError(AgentRLError):
    """The prompt books do not balance (a bug in the scheduler, never the user's fault)."""


@dataclass(frozen=True)
class PromptRef:
    """One attempt at one dataset row: row `index` of epoch `epoch`, attempt number `attempt`."""

    epoch: int
    index: int
    attempt: int = 0

    @property
    def uid(self) -> str:
        """Stable across attempts: the same row of the same epoch."""
        return f"e{self.epoch}-r{self.index}"

    @property
    def key(self) -> str:
        """Unique per attempt."""
        return f"{self.uid}-a{self.attempt}"

    def retry(self) -> PromptRef:
        return PromptRef(self.epoch, self.index, self.attempt + 1)


class PromptSampler:
    """Seeded epoch order over `num_rows` rows, plus a requeue served first (see module docstring).

    Rows in `skip` (skipped as malformed) are left out of every epoch; the others keep their numbers.
    """

    def __init__(self, num_rows: int, *, seed: int = 0, shuffle: bool = True, skip: Iterable[int] = ()) -> None:
        self.skip = frozenset(skip)
        self.usable_rows = num_rows - len(self.skip & set(range(num_rows)))
        """Rows an epoch serves (the dataset less the skipped ones)."""
        if self.usable_rows < 1:
            raise ValueError("the dataset has no rows to train on")
        self.num_rows = num_rows
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.cursor = 0
        self._order = self._order_of(0)
        self.requeued: deque[PromptRef] = deque()

    def _order_of(self, epoch: int) -> list[int]:
        order = [i for i in range(self.num_rows) if i not in self.skip]
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def take(self, n: int = 1) -> list[PromptRef]:
        """The next `n` prompt attempts: requeued ones first, then the epoch order."""
        out: list[PromptRef] = []
        while len(out) < n:
            if self.requeued:
                out.append(self.requeued.popleft())
                continue
            if self.cursor >= len(self._order):
                self.epoch += 1
                self.cursor = 0
                self._order = self._order_of(self.epoch)
            out.append(PromptRef(self.epoch, self._order[self.cursor]))
            self.cursor += 1
        return out

    def requeue(self, refs: Iterable[PromptRef], *, front: bool = False) -> None:
        refs = list(refs)
        if front:
            self.requeued.extendleft(reversed(refs))
        else:
            self.requeued.extend(refs)

    def state(self, in_flight: Iterable[PromptRef] = ()) -> dict[str, Any]:
        """The data position; prompts `in_flight` now are taken first after a resume."""
        pending = [*in_flight, *self.requeued]
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "requeued": [[r.epoch, r.index, r.attempt] for r in pending],
            "num_rows": self.num_rows,
            "num_skipped": len(self.skip),
            "seed": self.seed,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        if state.get("num_rows", self.num_rows) != self.num_rows:
            raise AgentRLError(
                f"The checkpoint's dataset had {state['num_rows']} rows, this one has {self.num_rows}; "
                "resume with the same data, or start a new run (run.name=...)."
            )
        if state.get("num_skipped", len(self.skip)) != len(self.skip):
            raise AgentRLError(
                f"The checkpoint's dataset had {state['num_skipped']} malformed rows skipped, this one has "
                f"{len(self.skip)}; resume with the same data, or start a new run (run.name=...)."
            )
        self.epoch = int(state["epoch"])
        self.cursor = int(state["cursor"])
        self._order = self._order_of(self.epoch)
        self.requeued = deque(PromptRef(*r) for r in state.get("requeued", []))


@dataclass
class LedgerEntry:
    key: str
    uid: str
    epoch: int
    index: int
    attempt: int
    status: PromptStatus
    step: int | None = None
    reason: str = ""
    session: int = 0


class PromptLedger:
    """What became of every prompt attempt; journaled to `path` (JSONL) when given (see the module
    docstring). `session` tags the attempts this process takes."""

    def __init__(self, path: str | Path | None = None, *, max_attempts: int = 3, session: int = 0) -> None:
        self.path = Path(path) if path else None
        self.max_attempts = max_attempts
        self.session = session
        self.entries: dict[str, LedgerEntry] = {}
        self._skipped: set[int] = set()
        self.hold_trained = False
        """Keep `trained` lines in memory until `commit_trained` (see the module docstring)."""
        self._held: list[dict[str, Any]] = []

    def _append(self, record: dict[str, Any]) -> None:
        if self.path is not None:
            append_text(self.path, json.dumps(record) + "\n")

    def commit_trained(self) -> int:
        """Journal the `trained` lines held since the last commit (one write); return how many."""
        held, self._held = self._held, []
        if held and self.path is not None:
            append_text(self.path, "".join(json.dumps(r) + "\n" for r in held))
        return len(held)

    # ── transitions ─────────────────────────────────────────────────────────────────────────
    def skipped(self, index: int, reason: str) -> None:
        """Dataset row `index` was skipped as malformed (`reason` names file, row and field)."""
        key = f"skipped-r{index}"
        if key in self.entries:
            raise LedgerError(f"row {index} was recorded as skipped twice")
        entry = LedgerEntry(key, f"r{index}", 0, index, 0, _SKIPPED, None, reason)
        self.entries[key] = entry
        self._skipped.add(index)
        self._append(asdict(entry))

    def taken(self, ref: PromptRef) -> None:
        if ref.index in self._skipped:
            raise LedgerError(f"prompt attempt {ref.key} takes row {ref.index}, which was skipped as malformed")
        if ref.key in self.entries:
            raise LedgerError(f"prompt attempt {ref.key} was taken twice")
        entry = LedgerEntry(ref.key, ref.uid, ref.epoch, ref.index, ref.attempt, "in_flight", session=self.session)
        self.entries[ref.key] = entry
        self._append({**asdict(entry), "status": "taken"})

    def trained(self, ref: PromptRef, step: int, note: str = "") -> None:
        """`ref` was trained at `step`; `note` says what of it was not (sequences the on-policy gate masked)."""
        self._close(ref, "trained", step=step, reason=note)

    def filtered(self, ref: PromptRef, reason: str, step: int | None = None) -> None:
        self._close(ref, "filtered", step=step, reason=reason)

    def infra_failed(self, ref: PromptRef, reason: str) -> PromptRef | None:
        """Every episode of `ref` failed for infrastructure reasons: requeue it (return the retry),
        or give up after `max_attempts` (return None)."""
        if ref.attempt + 1 >= self.max_attempts:
            self._close(ref, "failed", reason=f"{reason} (after {ref.attempt + 1} attempts)")
            return None
        self._close(ref, "requeued", reason=reason)
        return ref.retry()

    def unfinished(self, ref: PromptRef, reason: str = "the run ended first", *, journal: bool = True) -> PromptRef:
        """`ref` was still in flight or queued when the run stopped; return the attempt to requeue.
        `journal=False` changes the books only (the journal already holds its fate)."""
        self._close(ref, "unfinished", reason=reason, journal=journal)
        return ref.retry()

    def close_in_flight(self, reason: str) -> list[PromptRef]:
        """Close every attempt still in flight as `unfinished`; return the attempts to requeue.

        Attempts trained in a step whose `trained` lines were never committed (the run stopped
        before the step's records were written) are closed `unfinished` too: the run's records
        do not have that step, and the resume trains them again."""
        uncommitted, self._held = self._held, []
        for record in uncommitted:
            entry = self.entries[record["key"]]
            entry.status, entry.step = "in_flight", None
        why = {r["key"]: f"{reason}; trained at step {r['step']}, whose records were not written" for r in uncommitted}
        return [self.unfinished(PromptRef(e.epoch, e.index, e.attempt), why.get(e.key, reason))
                for e in list(self.entries.values()) if e.status == "in_flight"]

    def _close(
        self, ref: PromptRef, status: PromptStatus, *, step: int | None = None, reason: str = "", journal: bool = True
    ) -> None:
        entry = self.entries.get(ref.key)
        if entry is None or entry.status != "in_flight":
            found = "never taken" if entry is None else f"already {entry.status}"
            raise LedgerError(f"prompt attempt {ref.key} cannot become {status}: it was {found}")
        entry.status, entry.step, entry.reason = status, step, reason
        if journal and status == "trained" and self.hold_trained:
            self._held.append(asdict(entry))
        elif journal:
            self._append(asdict(entry))

    # ── accounting ──────────────────────────────────────────────────────────────────────────
    @property
    def in_flight(self) -> list[str]:
        return [k for k, e in self.entries.items() if e.status == "in_flight"]

    def summary(self) -> dict[str, int]:
        """Attempts `taken` and how many are in each state; `skipped` rows are counted apart."""
        by_status: Counter[str] = Counter(e.status for e in self.entries.values())
        return {"taken": len(self.entries) - by_status.get(_SKIPPED, 0),
                **{s: by_status.get(s, 0) for s in (*sorted(_FINAL), "in_flight")},
                _SKIPPED: by_status.get(_SKIPPED, 0)}

    def check(self, *, allow_in_flight: bool = True) -> dict[str, int]:
        """Raise LedgerError unless every attempt taken is in exactly one state and no skipped row
        was taken; return the counts."""
        summary = self.summary()
        total = sum(v for k, v in summary.items() if k not in ("taken", _SKIPPED))
        if total != summary["taken"]:
            raise LedgerError(f"ledger does not balance: {summary}")
        unknown = {e.status for e in self.entries.values()} - {*_FINAL, "in_flight", _SKIPPED}
        if unknown:
            raise LedgerError(f"ledger entries in unknown states {sorted(unknown)}")
        taken_skipped = sorted({e.index for e in self.entries.values() if e.status != _SKIPPED} & self._skipped)
        if taken_skipped:
            raise LedgerError(f"rows skipped as malformed were taken: {taken_skipped[:5]}")
        if not allow_in_flight and summary["in_flight"]:
            raise LedgerError(f"{summary['in_flight']} prompt attempts are unaccounted for: {self.in_flight[:5]}")
        return summary

    def state(self) -> dict[str, Any]:
        return {"entries": [asdict(e) for e in self.entries.values()], "max_attempts": self.max_attempts}

    def load_state(self, state: dict[str, Any]) -> None:
        self.entries = {e["key"]: LedgerEntry(**e) for e in state.get("entries", [])}
        self._skipped = {e.index for e in self.entries.values() if e.status == _SKIPPED}
        self.max_attempts = int(state.get("max_attempts", self.max_attempts))


# ── the journal on disk ─────────────────────────────────────────────────────────────────────


def read_journal(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ledger journal; a line cut short by a crash is skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if line.strip():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and "key" in record and "status" in record:
                out.append(record)
    return out


def next_session(path: str | Path) -> int:
    """The session number for a run (re)starting with journal `path`."""
    return 1 + max((int(r.get("session", 0)) for r in read_journal(path)), default=-1)


def _open_attempts(records: list[dict[str, Any]]) -> dict[tuple[int, str], dict[str, Any]]:
    open_: dict[tuple[int, str], dict[str, Any]] = {}
    for r in records:
        if r["status"] == _SKIPPED:
            continue
        key = (int(r.get("session", 0)), str(r["key"]))
        if r["status"] == "taken":
            open_[key] = r
        else:
            open_.pop(key, None)
    return open_


def close_orphans(path: str | Path, reason: str) -> int:
    """Append an `unfinished` line for every attempt the journal shows taken and never closed (a
    session that was killed outright); return how many. A line the crash cut short is ended first."""
    path = Path(path)
    if not path.is_file():
        return 0
    orphans = _open_attempts(read_journal(path))
    with writing(path), path.open("ab") as f:
        if f.tell() and not path.read_bytes().endswith(b"\n"):
            f.write(b"\n")  # the half-written last line stays (readers skip it); the next starts clean
        for r in orphans.values():
            f.write((json.dumps({**r, "status": "unfinished", "step": None, "reason": reason}) + "\n").encode())
    return len(orphans)


def journal_balance(path: str | Path) -> dict[str, int]:
    """Counts of the final states in journal `path`; raise `LedgerError` unless every attempt taken
    (per session) has exactly one final line after its `taken` line, and no line is final twice."""
    taken: set[tuple[int, str]] = set()
    final: dict[tuple[int, str], str] = {}
    skipped = 0
    for r in read_journal(path):
        if r["status"] == _SKIPPED:  # a malformed row, never taken
            skipped += 1
            continue
        key = (int(r.get("session", 0)), str(r["key"]))
        if r["status"] == "taken":
            if key in taken:
                raise LedgerError(f"prompt attempt {key[1]} was taken twice in session {key[0]}")
            taken.add(key)
        elif key not in taken:
            raise LedgerError(f"prompt attempt {key[1]} became {r['status']} in session {key[0]} without being taken")
        elif key in final:
            raise LedgerError(f"prompt attempt {key[1]} of session {key[0]} became {r['status']} after {final[key]}")
        else:
            final[key] = str(r["status"])
    unclosed = sorted(taken - set(final))
    if unclosed:
        raise LedgerError(f"{len(unclosed)} prompt attempts were taken and never closed: {unclosed[:5]}")
    counts = Counter(final.values())
    if skipped:
        counts["skipped"] = skipped
    return {"taken": len(taken), **dict(sorted(counts.items()))}
