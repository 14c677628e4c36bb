"""The shipped ReTool problem set: deterministic, verified answers, disjoint splits, valid rows."""

from __future__ import annotations

import json
import math
import re

from agentrl.datasets import check_row
from agentrl.envs.answers import answers_match
from agentrl.envs.retool import RetoolEnv, shipped_rows
from agentrl.envs.retool_data import FAMILIES, make_retool_rows, shipped_path
from agentrl.tools.core import ToolContext


def test_shipped_files_are_exactly_what_the_generator_makes() -> None:
    for split in ("train", "test"):
        lines = shipped_path(split).read_text().splitlines()
        assert lines == [json.dumps(r, sort_keys=True) for r in make_retool_rows(split, len(lines))]
    assert len(shipped_rows("train")) == 1000 and len(shipped_rows("test")) == 200


def test_splits_are_disjoint_valid_and_cover_every_family() -> None:
    train, test = shipped_rows("train"), shipped_rows("test")
    questions = lambda rows: {r["extra_info"]["question"] for r in rows}  # noqa: E731
    assert questions(train).isdisjoint(questions(test))
    assert len(questions(train)) == len(train)
    for row in train + test:
        assert check_row(row) is None
    assert {r["extra_info"]["family"] for r in test} == set(FAMILIES)


def test_answers_are_right_on_independent_recomputation() -> None:
    checked = 0
    for row in shipped_rows("test"):
        q, truth = row["extra_info"]["question"], int(row["reward_model"]["ground_truth"])
        nums = [int(n) for n in re.findall(r"\d+", q)]
        family = row["extra_info"]["family"]
        if family == "product":
            assert truth == nums[0] * nums[1] - nums[2]
        elif family == "powmod":
            assert truth == pow(nums[0], nums[1], nums[2])
        elif family == "comb":
            assert truth == math.comb(nums[1], nums[0])
        elif family == "gcd":
            assert truth == math.gcd(nums[0], nums[1])
        elif family == "sum_squares":
            assert truth == sum(k * k for k in range(1, nums[1] + 1))
        else:
            continue
        checked += 1
    assert checked == 100


def test_retool_scores_boxed_answers_with_optional_format_reward() -> None:
    row = shipped_rows("test")[0]
    truth = row["reward_model"]["ground_truth"]
    env, shaped = RetoolEnv(), RetoolEnv(format_reward=0.1)
    ctx = ToolContext()
    assert env.score(f"so \\boxed{{{truth}}}", row, ctx) == 1.0
    assert env.score(f"so \\boxed{{{int(truth):,}}}", row, ctx) == 1.0
    assert env.score("so \\boxed{1}", row, ctx) == 0.0
    assert shaped.score("so \\boxed{1}", row, ctx) == 0.1
    assert shaped.score(f"the answer is {truth}", row, ctx) == 0.0  # no box, no credit
    assert answers_match(truth, truth)
