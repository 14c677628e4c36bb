"""verl-format datasets: JSONL, JSON and parquet, every malformed row reported with its place."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentrl.datasets import check_row, load_rows
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
    assert msg.startswith("5 malformed row(s) of 7:")
    for expected in ("row 1: line 2 is not valid JSON", "row 2: 'prompt' is an empty list",
                     "row 3: 'prompt' is missing", "row 4: prompt[0] must be a message",
                     "row 5: 'reward_model' must be an object"):
        assert f"{path} {expected}" in msg, expected
    assert "data.skip_bad_rows=true" in msg
    kept = load_rows(path, skip_bad_rows=True)
    assert len(kept) == 2 and len(kept.problems) == 5
    assert kept.indices == [0, 6] and kept.total == 7
    assert [s.index for s in kept.skipped] == [1, 2, 3, 4, 5]


def test_missing_and_unsupported_files(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="does not exist"):
        load_rows(tmp_path / "nope.jsonl")
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(DatasetError, match="use .jsonl, .json or .parquet"):
        load_rows(tmp_path / "x.csv")


def test_a_non_utf8_line_is_a_bad_row_naming_file_row_and_line(tmp_path: Path) -> None:
    path = tmp_path / "latin1.jsonl"
    good = json.dumps(GOOD).encode()
    bad = json.dumps({**GOOD, "prompt": "caf\u00e9"}).encode().replace(b"\\u00e9", b"\xe9")
    path.write_bytes(good + b"\n\n" + bad + b"\n" + good + b"\n")
    with pytest.raises(DatasetError) as info:
        load_rows(path)
    assert f"{path} row 1: line 3 is not valid UTF-8 (byte 0xe9 at column" in str(info.value)
    kept = load_rows(path, skip_bad_rows=True)
    assert kept.indices == [0, 2] and [(s.file, s.row, s.index) for s in kept.skipped] == [(str(path), 1, 1)]


def test_unreadable_files_name_the_file(tmp_path: Path) -> None:
    bad_json = tmp_path / "rows.json"
    bad_json.write_bytes(b'[\n{"prompt": "a\xff"}]')
    with pytest.raises(DatasetError, match=r"rows.json' is not valid UTF-8: byte 0xff at line 2"):
        load_rows(bad_json)
    broken_json = tmp_path / "broken.json"
    broken_json.write_text('[{"prompt": "a"},\n {"prompt": ]')
    with pytest.raises(DatasetError, match=r"broken.json' is not valid JSON: .* at line 2 column"):
        load_rows(broken_json)
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(DatasetError, match=r"garbage.parquet' is not a readable parquet file"):
        load_rows(garbage)
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    whole = tmp_path / "whole.parquet"
    pq.write_table(pa.Table.from_pylist([GOOD] * 50), whole)
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    with pytest.raises(DatasetError, match=r"cut.parquet' is not a readable parquet file"):
        load_rows(cut)


def test_a_row_without_ground_truth_is_an_error_unless_the_env_scores_otherwise(tmp_path: Path) -> None:
    rows = [GOOD, {"prompt": "q"}, {"prompt": "q", "reward_model": {"style": "rule"}},
            {"prompt": "q", "reward_model": {"ground_truth": "  "}}]
    path = tmp_path / "truth.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(DatasetError) as info:
        load_rows(path)
    msg = str(info.value)
    assert f"{path} row 1: 'reward_model' is missing" in msg
    assert f"{path} row 2: 'reward_model.ground_truth' is missing" in msg
    assert f"{path} row 3: 'reward_model.ground_truth' is an empty string" in msg
    assert load_rows(path, require_ground_truth=False).rows == rows
    assert check_row({"prompt": "q", "reward_model": 3}, require_ground_truth=False) == (
        "'reward_model' must be an object, got int")


def test_wrong_types_are_named_not_called_missing() -> None:
    assert check_row({**GOOD, "prompt": 123}) == "'prompt' must be a list of chat messages or a string, got int"
    assert check_row({**GOOD, "prompt": None}) == "'prompt' is missing (it must be a list of chat messages or a string)"
    assert check_row({**GOOD, "prompt": [{"role": "user", "content": 5}]}).endswith("'content' is int")
    assert check_row({**GOOD, "prompt": [{"role": "robot", "content": "x"}]}).endswith("got role 'robot'")
    assert check_row({**GOOD, "data_source": 7}) == "'data_source' must be a string, got int"
    assert check_row({**GOOD, "extra_info": "x"}) == "'extra_info' must be an object, got str"
    assert check_row([1]) == "a row must be an object, got list"


def test_rows_are_numbered_across_files_and_skipped_rows_keep_their_numbers(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in [GOOD, {"prompt": 1}, GOOD]))
    (tmp_path / "b.json").write_text(json.dumps([{**GOOD, "reward_model": None}, {**GOOD, "data_source": "b"}]))
    loaded = load_rows([tmp_path / "a.jsonl", tmp_path / "b.json"], skip_bad_rows=True)
    assert loaded.total == 5 and loaded.indices == [0, 2, 4]
    assert loaded.sources == [f"{tmp_path / 'a.jsonl'} row 0", f"{tmp_path / 'a.jsonl'} row 2",
                              f"{tmp_path / 'b.json'} row 1"]
    assert [(s.index, s.file, s.row) for s in loaded.skipped] == [
        (1, str(tmp_path / "a.jsonl"), 1), (3, str(tmp_path / "b.json"), 0)]
    assert loaded.problems[0] == f"{tmp_path / 'a.jsonl'} row 1: 'prompt' must be a list of chat messages or a string, got int"
    table = loaded.by_index()
    assert table[1] is None and table[3] is None and table[4]["data_source"] == "b"


def test_skipping_cannot_leave_no_rows(tmp_path: Path) -> None:
    path = tmp_path / "all_bad.jsonl"
    path.write_text(json.dumps({"prompt": 1}) + "\n")
    with pytest.raises(DatasetError, match="No row is usable"):
        load_rows(path, skip_bad_rows=True)
