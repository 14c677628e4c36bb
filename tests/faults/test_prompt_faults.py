"""Prompts the run cannot roll out, in a real run against the session's vLLM server.

A dataset where two of six rows have a first prompt longer than `rollout.max_total_tokens`: pre-flight
names them before anything starts, the run filters each with its length and the budget in the ledger,
replaces it with another row, counts it on the dashboard (`data/filtered_too_long`), and never trains
an episode that sampled nothing (what a too-long prompt used to become: 0 tokens, reward 0, trained).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
from fault_common import check_books, lines, make_config

pytestmark = pytest.mark.slow

BUDGET = 256  # fault_common's rollout.max_total_tokens
LONG_ROWS = (1, 4)


def write_rows(path: Path) -> None:
    rows = []
    for i in range(6):
        text = f"Say something about the number {i}."
        if i in LONG_ROWS:
            text = "Count every clip in the box once more, slowly. " * 40 + text  # well over 256 tokens
        rows.append({"prompt": [{"role": "user", "content": text}], "data_source": "parity",
                     "reward_model": {"style": "rule", "ground_truth": "even"}})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_over_long_prompts_are_named_by_preflight_filtered_with_their_reason_and_never_trained(
    tmp_path: Path, shared_url: str, assets: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from agentrl.orchestration.driver import run_training

    data = tmp_path / "rows.jsonl"
    write_rows(data)
    config = make_config(tmp_path, "long", assets, f"data.train_files=[{data}]", "data.shuffle=false",
                         "data.prompts_per_step=2", "run.total_steps=2", "run.save_every=0",
                         "data.max_prompt_tokens=4096", url=shared_url)
    with caplog.at_level(logging.INFO, logger="agentrl"):
        result = run_training(config)
    assert result.steps_done == 2

    warned = [r.getMessage() for r in caplog.records if "prompt lengths" in r.getMessage() or
              "over rollout.max_total_tokens" in r.getMessage()]
    assert any(f"2 of 6 rows have prompts over rollout.max_total_tokens={BUDGET}" in m for m in warned), warned

    run_dir = tmp_path / "long"
    ledger = lines(run_dir / "ledger.jsonl")
    filtered = [e for e in ledger if e["status"] == "filtered"]
    assert sorted(e["index"] for e in filtered) == list(LONG_ROWS)
    for e in filtered:
        found = re.fullmatch(rf"prompt of (\d+) tokens over rollout.max_total_tokens={BUDGET}", e["reason"])
        assert found and int(found.group(1)) >= BUDGET, e["reason"]
    trained = {e["index"] for e in ledger if e["status"] == "trained"}
    assert trained == {0, 2, 3, 5}  # two steps of 2 prompts: the long rows were replaced by the next ones
    assert not trained & set(LONG_ROWS)
    books = check_books(run_dir)
    assert books["trained"] == 4 and books["filtered"] == 2 and books.get("unfinished", 0) == 0

    steps = [m for m in lines(run_dir / "metrics.jsonl") if "data/filtered_too_long" in m]
    assert sum(m["data/filtered_too_long"] for m in steps) == 2
