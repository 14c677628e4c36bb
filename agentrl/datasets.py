"""Datasets in verl's row format, from JSONL, JSON or parquet files.

A row is a dict with `prompt` (a list of chat messages, or a string), `reward_model: {style,
ground_truth}` (the answer it is scored against; optional only for envs that score otherwise,
`Env.requires_ground_truth = False`), and usually `data_source` and `extra_info`; a verl dataset
(DAPO-Math, AIME, GSM8K as verl ships them) works unchanged. `load_rows` reads every file, checks
every row and reports all malformed rows at once with their file, row and field, so nothing is
silently dropped. A file that cannot be read at all (missing, not UTF-8 JSON, not parquet) is an
error naming the file; a JSONL line that is not UTF-8 or not JSON is a bad row like any other.

Rows are numbered from 0 in the order read: within a file by position (in JSONL, blank lines are
not rows; messages give the line number too), and across files consecutively, so with two files of
100 rows the second file's row 0 is row 100 of the dataset. With `skip_bad_rows=True` the bad rows
are kept out but keep their numbers: `LoadedRows.skipped` names each (index, file, row, reason),
the good rows keep theirs in `LoadedRows.indices`, and the training driver records each skipped row
in the prompt ledger so ledger indices are these row numbers. Parquet needs `pyarrow`. This module
does not tokenise, batch or shuffle.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.errors import DatasetError

__all__ = ["LoadedRows", "SkippedRow", "check_row", "ground_truth_problem", "load_rows", "read_rows"]

_ROLES = {"system", "user", "assistant", "tool"}
_MAX_SHOWN = 20


@dataclass(frozen=True)
class SkippedRow:
    """A malformed row kept out of a dataset: its dataset `index`, its `file` and `row` there, why."""

    index: int
    file: str
    row: int
    reason: str

    def __str__(self) -> str:
        return f"{self.file} row {self.row}: {self.reason}"


@dataclass
class LoadedRows:
    """The rows of one or more files: the good ones with their numbers, and the skipped ones."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    """The good rows, in the order read."""
    indices: list[int] = field(default_factory=list)
    """Each good row's number in the dataset (see the module docstring)."""
    sources: list[str] = field(default_factory=list)
    """Where each good row came from, as `file row N`."""
    skipped: list[SkippedRow] = field(default_factory=list)
    """The malformed rows kept out (only with `skip_bad_rows=True`)."""
    total: int = 0
    """Rows read, good and skipped: the dataset's row numbers are `range(total)`."""

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def problems(self) -> list[str]:
        """One line per skipped row: `file row N: reason`."""
        return [str(s) for s in self.skipped]

    def by_index(self) -> list[dict[str, Any] | None]:
        """Every row at its number; None where a row was skipped."""
        table: list[dict[str, Any] | None] = [None] * self.total
        for index, row in zip(self.indices, self.rows, strict=True):
            table[index] = row
        return table

    @classmethod
    def of(cls, rows: Sequence[dict[str, Any]], source: str) -> LoadedRows:
        """Rows that did not come from a file (an env's own tasks), numbered 0..n-1 under `source`."""
        return cls(list(rows), list(range(len(rows))), [f"{source} row {i}" for i in range(len(rows))],
                   [], len(rows))


class _BadLine:
    """A JSONL line that could not be read as a row; `line` is its 1-based line number."""

    def __init__(self, line: int, reason: str) -> None:
        self.line = line
        self.reason = reason


def read_rows(path: str | Path) -> list[Any]:
    """Every row of one file, unchecked (JSONL, a JSON list, or parquet).

    Raises `DatasetError` naming the file when it cannot be read at all. An unreadable JSONL line
    comes back as a placeholder that `check_row` reports with its line number.
    """
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"Dataset file '{path}' does not exist.")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return _read_parquet(path)
    if suffix == ".json":
        try:
            data = json.loads(_decode(path.read_bytes(), path))
        except json.JSONDecodeError as exc:
            raise DatasetError(
                f"'{path}' is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}."
            ) from exc
        if not isinstance(data, list):
            raise DatasetError(f"'{path}' must hold a JSON list of rows, got {type(data).__name__}.")
        return data
    if suffix in (".jsonl", ".ndjson"):
        return _read_jsonl(path)
    raise DatasetError(f"Unsupported dataset file '{path}': use .jsonl, .json or .parquet.")


def _decode(data: bytes, path: Path) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise DatasetError(
            f"'{path}' is not valid UTF-8: byte 0x{data[exc.start]:02x} at line {line} "
            f"(byte offset {exc.start}); re-save the file as UTF-8."
        ) from exc


def _read_jsonl(path: Path) -> list[Any]:
    rows: list[Any] = []
    data = path.read_bytes()
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]  # a UTF-8 byte-order mark
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            rows.append(_BadLine(lineno, f"line {lineno} is not valid UTF-8 (byte 0x{raw[exc.start]:02x} at "
                                         f"column {exc.start + 1}); re-save the file as UTF-8"))
            continue
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            rows.append(_BadLine(lineno, f"line {lineno} is not valid JSON ({exc.msg} at column {exc.colno})"))
    return rows


def _read_parquet(path: Path) -> list[Any]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise DatasetError(f"Reading '{path}' needs pyarrow: pip install pyarrow.") from exc
    try:
        rows: list[Any] = pq.read_table(path).to_pylist()  # pyarrow ships no type information
        return rows
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError and others for a broken file
        raise DatasetError(
            f"'{path}' is not a readable parquet file ({type(exc).__name__}: {exc}); check that it was "
            "written completely, or convert it to JSONL."
        ) from exc


def ground_truth_problem(row: dict[str, Any]) -> str | None:
    """What is wrong with `row`'s `reward_model.ground_truth`, or None when it has one."""
    reward_model = row.get("reward_model")
    if reward_model is None:
        return "'reward_model' is missing (it must hold 'ground_truth', the answer the row is scored against)"
    if not isinstance(reward_model, dict):
        return f"'reward_model' must be an object with 'ground_truth', got {type(reward_model).__name__}"
    truth = reward_model.get("ground_truth")
    if truth is None:
        return "'reward_model.ground_truth' is missing (the answer the row is scored against)"
    if isinstance(truth, str) and not truth.strip():
        return "'reward_model.ground_truth' is an empty string"
    return None


def check_row(row: object, *, require_ground_truth: bool = True) -> str | None:
    """What is wrong with `row` as a verl-format row, or None when it is fine.

    `require_ground_truth=False` accepts rows without `reward_model.ground_truth` (for envs that
    score otherwise); a `reward_model` that is there must still be an object.
    """
    if isinstance(row, _BadLine):
        return row.reason
    if not isinstance(row, dict):
        return f"a row must be an object, got {type(row).__name__}"
    prompt = row.get("prompt")
    if prompt is None:
        return "'prompt' is missing (it must be a list of chat messages or a string)"
    if isinstance(prompt, str):
        if not prompt.strip():
            return "'prompt' is an empty string"
    elif isinstance(prompt, list):
        if not prompt:
            return "'prompt' is an empty list"
        for i, m in enumerate(prompt):
            problem = _message_problem(m)
            if problem:
                return f"prompt[{i}] must be a message {{'role': system|user|assistant|tool, 'content': str}}: {problem}"
    else:
        return f"'prompt' must be a list of chat messages or a string, got {type(prompt).__name__}"
    data_source = row.get("data_source")
    if data_source is not None and not isinstance(data_source, str):
        return f"'data_source' must be a string, got {type(data_source).__name__}"
    extra_info = row.get("extra_info")
    if extra_info is not None and not isinstance(extra_info, dict):
        return f"'extra_info' must be an object, got {type(extra_info).__name__}"
    if require_ground_truth:
        return ground_truth_problem(row)
    reward_model = row.get("reward_model")
    if reward_model is not None and not isinstance(reward_model, dict):
        return f"'reward_model' must be an object, got {type(reward_model).__name__}"
    return None


def _message_problem(m: object) -> str | None:
    if not isinstance(m, dict):
        return f"got {type(m).__name__}"
    if m.get("role") not in _ROLES:
        return f"got role {m.get('role')!r}"
    if not isinstance(m.get("content"), str):
        return f"'content' is {type(m.get('content')).__name__}"
    return None


def load_rows(
    paths: str | Path | Sequence[str | Path],
    *,
    skip_bad_rows: bool = False,
    require_ground_truth: bool = True,
) -> LoadedRows:
    """Read and check every row of `paths` (see the module docstring for the numbering).

    Raises `DatasetError` listing every bad row (file, row and field) unless `skip_bad_rows`;
    with it, bad rows go to `LoadedRows.skipped`, and it still raises when no good row is left.
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    out = LoadedRows()
    for path in paths:
        for row_number, row in enumerate(read_rows(path)):
            index = out.total
            out.total += 1
            problem = check_row(row, require_ground_truth=require_ground_truth)
            if problem is None:
                out.rows.append(row)
                out.indices.append(index)
                out.sources.append(f"{path} row {row_number}")
            else:
                out.skipped.append(SkippedRow(index, str(path), row_number, problem))
    if out.skipped and (not skip_bad_rows or not out.rows):
        shown = "\n".join(f"  {p}" for p in out.problems[:_MAX_SHOWN])
        more = f"\n  ... and {len(out.skipped) - _MAX_SHOWN} more" if len(out.skipped) > _MAX_SHOWN else ""
        if out.rows:
            hint = ("Fix them, or set data.skip_bad_rows=true to use the rest (each skipped row is logged "
                    "and recorded in the run's ledger.jsonl as skipped).")
        else:
            hint = "No row is usable; fix the file(s)."
        raise DatasetError(f"{len(out.skipped)} malformed row(s) of {out.total}:\n{shown}{more}\n{hint}")
    return out
