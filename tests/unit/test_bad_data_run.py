"""Bad data on the `agentrl run` path: refused with file, row and field before anything starts, or
skipped under `data.skip_bad_rows` with each skipped row in the prompt ledger at its row number."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentrl.cli import main
from agentrl.config import load_config
from agentrl.orchestration.build import build_job
from agentrl.orchestration.checkpoints import CheckpointStore
from agentrl.orchestration.ledger import LedgerError, PromptLedger, PromptRef, PromptSampler
from agentrl.orchestration.training import RunBooks

GOOD = {"prompt": [{"role": "user", "content": "Compute 2 * 21."}], "data_source": "agentrl/arithmetic",
        "reward_model": {"style": "rule", "ground_truth": "42"}}


def write_files(tmp_path: Path) -> tuple[Path, Path]:
    first = tmp_path / "first.jsonl"
    first.write_bytes(b"\n".join([
        json.dumps(GOOD).encode(),
        json.dumps({**GOOD, "prompt": 123}).encode(),
        json.dumps(GOOD).encode().replace(b"Compute", b"Compute\xff"),
        json.dumps(GOOD).encode(),
    ]))
    second = tmp_path / "second.jsonl"
    second.write_text("\n".join([json.dumps({**GOOD, "reward_model": {"style": "rule"}}), json.dumps(GOOD)]))
    return first, second


def test_agentrl_run_refuses_bad_rows_naming_file_row_and_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first, second = write_files(tmp_path)
    code = main(["run", "env=arithmetic", f"data.train_files=[{first}, {second}]",
                 f"run.output_dir={tmp_path / 'runs'}", "run.name=bad"])
    err = capsys.readouterr().err
    assert code == 1
    assert "agentrl run: 3 malformed row(s) of 6:" in err
    assert f"{first} row 1: 'prompt' must be a list of chat messages or a string, got int" in err
    assert f"{first} row 2: line 3 is not valid UTF-8 (byte 0xff at column" in err
    assert f"{second} row 0: 'reward_model.ground_truth' is missing" in err
    assert "data.skip_bad_rows=true" in err
    assert not (tmp_path / "runs" / "bad" / "ledger.jsonl").exists()


def test_skipped_rows_keep_their_numbers_in_the_ledger_and_are_never_sampled(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first, second = write_files(tmp_path)
    config = load_config(None, ["env=arithmetic", f"data.train_files=[{first}, {second}]", "data.skip_bad_rows=true",
                                f"run.output_dir={tmp_path / 'runs'}", "run.name=skip"])
    run_dir = tmp_path / "runs" / "skip"
    run_dir.mkdir(parents=True)
    with caplog.at_level("WARNING", logger="agentrl.orchestration.build"):
        run = RunBooks(build_job(config, "run"), run_dir, CheckpointStore(run_dir / "checkpoints"), None)
    assert [r is None for r in run.train_rows] == [False, True, True, False, True, False]
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 3 and f"skipping {second} row 0 (dataset row 4)" in logged[2]
    lines = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    assert [(e["index"], e["status"]) for e in lines] == [(1, "skipped"), (2, "skipped"), (4, "skipped")]
    assert lines[0]["reason"] == f"{first} row 1: 'prompt' must be a list of chat messages or a string, got int"
    taken = run.sampler.take(12)  # four epochs of the three good rows
    assert sorted({r.index for r in taken}) == [0, 3, 5] and len({(r.epoch, r.index) for r in taken}) == 12
    for ref in taken:
        run.ledger.taken(ref)
        run.ledger.trained(ref, 0)
    summary = run.ledger.check(allow_in_flight=False)
    assert summary["taken"] == summary["trained"] == 12 and summary["skipped"] == 3
    with pytest.raises(LedgerError, match="row 2, which was skipped"):
        run.ledger.taken(PromptRef(9, 2))


def test_the_sampler_checkpoint_knows_the_skipped_rows() -> None:
    sampler = PromptSampler(6, seed=1, skip=[1, 4])
    state = sampler.state()
    assert state["num_skipped"] == 2
    resumed = PromptSampler(6, seed=1, skip=[1, 4])
    resumed.load_state(state)
    assert [r.index for r in resumed.take(4)] == [r.index for r in sampler.take(4)]
    with pytest.raises(Exception, match="had 2 malformed rows skipped, this one has 0"):
        PromptSampler(6, seed=1).load_state(state)
    with pytest.raises(ValueError, match="no rows to train on"):
        PromptSampler(2, skip=[0, 1])


def test_the_ledger_balances_with_skipped_rows_across_a_checkpoint(tmp_path: Path) -> None:
    ledger = PromptLedger(tmp_path / "ledger.jsonl")
    ledger.skipped(3, "data.jsonl row 3: 'prompt' is missing")
    ref = PromptRef(0, 0)
    ledger.taken(ref)
    assert ledger.check() == {"taken": 1, "failed": 0, "filtered": 0, "requeued": 0, "trained": 0,
                              "unfinished": 0, "in_flight": 1, "skipped": 1}
    restored = PromptLedger()
    restored.load_state(ledger.state())
    with pytest.raises(LedgerError, match="skipped as malformed"):
        restored.taken(PromptRef(1, 3))
    with pytest.raises(LedgerError, match="recorded as skipped twice"):
        restored.skipped(3, "again")
