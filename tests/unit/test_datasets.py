"""verl-format datasets: JSONL, JSON and parquet, every malformed row reported with its place."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentrl.datasets import load_rows
from agentrl.errors import DatasetError

GOOD = {"prompt": [{"role": "user", "content": "1+1?"}], "data_source": "x",
        "reward_model": {"style": "rule", "ground_truth": "2"}, "extra_info": {"i": 0}}


def test_jsonl_json_and_parquet_read_the_same_rows(tmp_path: Path) -> None:
    rows = [GOOD, {**GOOD, "prompt": "plain string prompt"}]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    (tmp_path / "a.json").write_text(json.dumps(rows))
    assert load_rows(tmp_path / "a.jsonl").rows == rows
    assert load_rows([tmp_path / "a.json", tmp_path / "a.jsonl"]).rows == rows + rows
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([GOOD]), tmp_path / "a.parquet")
    assert load_rows(tmp_path / "a.parquet").rows == [GOOD]


def test_every_bad_row_is_reported_with_file_and_row(tmp_path: Path) -> None:
    lines = [json.dumps(GOOD), "{not json", json.dumps({"prompt": []}), json.dumps({"no_prompt": 1}),
             json.dumps({"prompt": [{"role": "robot", "content": "x"}]}),
             json.dumps({**GOOD, "reward_model": "42"}), json.dumps(GOOD)]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(lines))
    with pytest.raises(DatasetError) as info:
        load_rows(path)
    msg = str(info.value)
    assert msg.startswith("5 malformed row(s):")
    for expected in ("row 1: line 2 is not valid JSON", "row 2: 'prompt' is an empty list",
                     "row 3: 'prompt' is missing", "row 4: prompt[0] must be a message",
                     "row 5: 'reward_model' must be an object"):
        assert f"{path} {expected}" in msg, expected
    kept = load_rows(path, skip_bad_rows=True)
    assert len(kept) == 2 and len(kept.problems) == 5


def test_missing_and_unsupported_files(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="does not exist"):
        load_rows(tmp_path / "nope.jsonl")
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(DatasetError, match="use .jsonl, .json or .parquet"):
        load_rows(tmp_path / "x.csv")
