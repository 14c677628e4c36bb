"""Datasets in verl's row format, from JSONL, JSON or parquet files.

A row is a dict with `prompt` (a list of chat messages, or a string), and usually `data_source`,
`reward_model: {style, ground_truth}` and `extra_info`; a verl dataset (DAPO-Math, AIME, GSM8K
as verl ships them) works unchanged. `load_rows` reads every file, checks every row and reports
all malformed rows at once with their file and row number, so nothing is silently dropped; with
`skip_bad_rows=True` it keeps the good rows and returns the problems for the run's ledger instead.
Parquet needs `pyarrow`. This module does not tokenise, batch or shuffle.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.errors import DatasetError

__all__ = ["LoadedRows", "check_row", "load_rows", "read_rows"]

_ROLES = {"system", "user", "assistant", "tool"}


@dataclass
class LoadedRows:
    """The good rows of one or more files, and one line per row that was refused."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.rows)


def read_rows(path: str | Path) -> list[Any]:
    """Every row of one file, unchecked (JSONL, a JSON list, or parquet)."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"Dataset file '{path}' does not exist.")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:
            raise DatasetError(f"Reading '{path}' needs pyarrow: pip install pyarrow.") from exc
        return pq.read_table(path).to_pylist()
    if suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise DatasetError(f"'{path}' is not valid JSON: {exc}") from exc
        if not isinstance(data, list):
            raise DatasetError(f"'{path}' must hold a JSON list of rows, got {type(data).__name__}.")
        return data
    if suffix in (".jsonl", ".ndjson"):
        rows: list[Any] = []
        for lineno, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                rows.append(_BadLine(f"line {lineno} is not valid JSON ({exc.msg})"))
        return rows
    raise DatasetError(f"Unsupported dataset file '{path}': use .jsonl, .json or .parquet.")


class _BadLine:
    def __init__(self, reason: str) -> None:
        self.reason = reason


def check_row(row: Any) -> str | None:
    """What is wrong with `row` as a verl-format row, or None when it is fine."""
    if isinstance(row, _BadLine):
        return row.reason
    if not isinstance(row, dict):
        return f"a row must be an object, got {type(row).__name__}"
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        if not prompt.strip():
            return "'prompt' is an empty string"
    elif isinstance(prompt, list):
        if not prompt:
            return "'prompt' is an empty list"
        for i, m in enumerate(prompt):
            if not isinstance(m, dict) or m.get("role") not in _ROLES or not isinstance(m.get("content"), str):
                return f"prompt[{i}] must be a message {{'role': system|user|assistant|tool, 'content': str}}"
    else:
        return "'prompt' is missing (it must be a list of chat messages or a string)"
    reward_model = row.get("reward_model")
    if reward_model is not None and not isinstance(reward_model, dict):
        return f"'reward_model' must be an object with 'ground_truth', got {type(reward_model).__name__}"
    return None


def load_rows(paths: str | Path | Sequence[str | Path], *, skip_bad_rows: bool = False) -> LoadedRows:
    """Read and check every row of `paths`; raise DatasetError listing every bad row (see module)."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    out = LoadedRows()
    for path in paths:
        for index, row in enumerate(read_rows(path)):
            problem = check_row(row)
            if problem is None:
                out.rows.append(row)
            else:
                out.problems.append(f"{path} row {index}: {problem}")
    if out.problems and not skip_bad_rows:
        shown = "\n".join(f"  {p}" for p in out.problems[:20])
        more = f"\n  ... and {len(out.problems) - 20} more" if len(out.problems) > 20 else ""
        raise DatasetError(
            f"{len(out.problems)} malformed row(s):\n{shown}{more}\n"
            "Fix them, or set data.skip_bad_rows=true to train on the rest (they are counted as failed)."
        )
    return out
