"""verl's reward contract: per-data_source scoring of published rows, user functions, the pre-flight check."""

from __future__ import annotations

import asyncio
import json
import pickle
import threading
from pathlib import Path
from typing import Any

import pytest

from agentrl.config import load_config
from agentrl.datasets import load_rows
from agentrl.envs.answers import answers_match
from agentrl.envs.arithmetic import ArithmeticEnv
from agentrl.envs.retool import RetoolEnv
from agentrl.envs.rewards import (
    RewardFunction,
    answer_format,
    check_ground_truths,
    compute_score,
    render_answer,
    score_row,
)
from agentrl.errors import ConfigError, EnvError
from agentrl.orchestration.build import env_arguments
from agentrl.types import Action

DATA = Path(__file__).resolve().parents[1] / "data" / "verl"


def rows(name: str) -> list[dict[str, Any]]:
    return load_rows(DATA / name).rows


def score(row: dict[str, Any], reply: str) -> float:
    return score_row(compute_score, row, reply).score


# ── the published formats, scored right and wrong ───────────────────────────────────────────


def test_gsm8k_rows_score_their_hash_answer() -> None:
    natalia, weng, betty = rows("gsm8k.jsonl")
    assert natalia["data_source"] == "openai/gsm8k" and natalia["reward_model"]["ground_truth"] == "72"
    right = "Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips altogether.\n#### 72"
    assert score(natalia, right) == 1.0
    assert score(natalia, right.replace("#### 72", "#### 73")) == 0.0
    assert score(natalia, "She sold 72 clips in total.") == 0.0  # no "####" and nothing boxed
    assert score(natalia, "She sold \\boxed{72} clips.") == 1.0  # our envs' system prompts ask for a box
    assert score(natalia, "#### 24 in May, so\n#### 72") == 1.0  # the last one counts
    assert score(weng, "0.2 x 50 = 10\n#### $10") == 1.0
    assert score(weng, "#### 10.00") == 1.0  # compared as numbers
    assert score(betty, "#### 5") == 1.0 and score(betty, "#### 50") == 0.0
    # verl's own reference solution (extra_info.answer) is a correct reply
    assert all(score(r, r["extra_info"]["answer"]) == 1.0 for r in (natalia, weng, betty))
    assert answer_format("gsm8k").name == "gsm8k"


def test_dapo_rows_score_their_answer_line() -> None:
    triangle, sequence, divisors = rows("dapo_math.jsonl")
    assert triangle["data_source"] == "math_dapo" and triangle["reward_model"]["ground_truth"] == "34"
    assert score(triangle, "Working through the angle bisector...\nAnswer: 34") == 1.0
    assert score(triangle, "Answer: 35") == 0.0
    assert score(triangle, "so a+b+c = 34") == 0.0  # no answer line
    assert score(triangle, "Answer: 12\nOn reflection that is wrong.\nAnswer: $34$.") == 1.0
    assert score(triangle, "Final Answer: The final answer is $\\boxed{34}$. I hope it is correct.") == 1.0
    assert score(sequence, "a_n = 2^n - 1\nanswer: 1023") == 1.0
    assert score(divisors, "2024 = 2^3 * 11 * 23, so 4*2*2 divisors.\n\\boxed{16}") == 1.0  # boxed fallback
    assert score(divisors, "Answer: 12") == 0.0
    for source in ("math", "math_dapo_reasoning", "aime24", "aime_2025"):
        assert answer_format(source).name == "answer_line"


def test_math_rows_score_their_boxed_answer_through_math_verify() -> None:
    asymptotes, foci, abs_sum, nested = rows("math_lighteval.jsonl")
    assert asymptotes["data_source"] == "DigitalLearningGmbH/MATH-lighteval"
    assert score(asymptotes, "x^2+x-6 = (x+3)(x-2), so there are $\\boxed{2}$ asymptotes.") == 1.0
    assert score(asymptotes, "\\boxed{3}") == 0.0
    assert score(asymptotes, "There are 2.") == 0.0  # no boxed answer
    assert score(foci, "c = 10\\sqrt{3}, so the distance is \\boxed{20\\sqrt{3}}.") == 1.0
    assert score(foci, "\\boxed{20\\sqrt{2}}") == 0.0
    assert score(abs_sum, "By Cauchy-Schwarz the maximum is $\\boxed{\\sqrt{2}}$") == 1.0
    assert score(abs_sum, "\\boxed{\\frac{2}{\\sqrt{2}}}") == 1.0  # symbolically equal
    assert score(abs_sum, "\\boxed{1}") == 0.0
    assert score(nested, "\\boxed{12}") == 1.0
    for source in ("lighteval/MATH", "HuggingFaceH4/MATH-500", "numina_olympiads", "numina_cn_k12"):
        assert answer_format(source).name == "boxed"


def test_our_own_sources_and_unknown_ones_keep_todays_behaviour() -> None:
    arithmetic = {"data_source": "agentrl/arithmetic", "reward_model": {"ground_truth": "1234"}}
    assert score(arithmetic, "The result is 1,234") == 1.0  # last number when nothing is boxed
    assert score(arithmetic, "\\boxed{1234} (not 99)") == 1.0
    for source in ("agentrl/retool-synth", "someone/new-dataset", None):
        row = {"data_source": source, "reward_model": {"ground_truth": "7"}}
        assert score(row, "\\boxed{7}") == 1.0
        assert score(row, "it is 7") == 0.0  # boxed only: shaping must not reward a missing box
    listed = {"data_source": "x", "reward_model": {"ground_truth": ["7", "seven"]}}
    assert score(listed, "\\boxed{7}") == 1.0
    full_solution = {"data_source": "openai/gsm8k", "reward_model": {"ground_truth": "48+24=72\n#### 72"}}
    assert score(full_solution, "#### 72") == 1.0


def test_compute_score_returns_verls_dict_and_score_row_takes_floats_and_dicts() -> None:
    out = compute_score("math_dapo", "Answer: 34", "34", {"index": "x"})
    assert out == {"score": 1.0, "pred": "34", "format": "answer_line"}
    row = {"data_source": "d", "reward_model": {"ground_truth": "1"}, "extra_info": {"k": 1}}
    seen: list[dict[str, Any]] = []

    def fn(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> Any:
        seen.append({"data_source": data_source, "solution_str": solution_str, "ground_truth": ground_truth,
                     "extra_info": extra_info})
        return {"score": 0.5, "acc": True, "pred": "1", "steps": 3}

    result = score_row(fn, row, "reply")
    assert seen == [{"data_source": "d", "solution_str": "reply", "ground_truth": "1", "extra_info": {"k": 1}}]
    assert result.score == 0.5 and result.extra == {"acc": True, "pred": "1", "steps": 3}
    assert result.metrics() == {"reward/acc": 1.0, "reward/steps": 3.0}
    assert score_row(lambda **kw: 1, row, "r").score == 1.0
    for bad, match in (({"reward": 1.0}, "without 'score'"), ("1.0", "must be a finite number"),
                       (float("nan"), "must be a finite number"), (None, "must be a finite number")):
        with pytest.raises(ConfigError, match=match):
            score_row(lambda bad=bad, **kw: bad, row, "r")
    with pytest.raises(EnvError, match="no reward_model.ground_truth"):
        score_row(compute_score, {"prompt": "q"}, "\\boxed{1}")


def test_math_verify_answers_are_checked_off_the_main_thread_too() -> None:
    results: list[bool] = []
    worker = threading.Thread(target=lambda: results.append(answers_match("x^2+2x", "2x+x^2")))
    worker.start()
    worker.join()
    assert results == [True] and answers_match("x^2+2x", "2x+x^2")


# ── a user function named in the config ─────────────────────────────────────────────────────

USER_MODULE = '''
def length_bonus(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    return {"score": float(ground_truth in solution_str) + bonus, "length": len(solution_str)}

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if solution_str.strip().endswith(ground_truth) else 0.0

def two_args(solution, truth):
    return 0.0

NOT_A_FUNCTION = 3

from agentrl.envs.tool_env import ToolEnv

class SelfScoringEnv(ToolEnv):
    def __init__(self):
        super().__init__([])

    def score(self, final_text, row, ctx):
        return 1.0
'''


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return path


def test_a_user_function_from_a_module_with_kwargs(user_module: Path) -> None:
    fn = RewardFunction("my_rewards:length_bonus", {"bonus": 0.25})
    assert fn("d", "it is 42", "42", None) == {"score": 1.25, "length": 8}
    row = {"reward_model": {"ground_truth": "42"}}
    assert score_row(fn, row, "no").score == 0.25
    default_name = RewardFunction("my_rewards")  # verl's default function name, compute_score
    assert default_name("d", "answer 42", "42") == 1.0
    assert pickle.loads(pickle.dumps(fn))("d", "42", "42") == {"score": 1.25, "length": 2}


def test_a_user_function_from_a_file(user_module: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(user_module.parent)
    for spec in (f"{user_module}:length_bonus", "./my_rewards.py:length_bonus"):
        fn = RewardFunction(spec)
        assert fn("d", "x 42", "42")["score"] == 1.0
        assert pickle.loads(pickle.dumps(fn))("d", "x", "42")["score"] == 0.0
    assert RewardFunction(str(user_module))("d", "=42", "42") == 1.0


@pytest.mark.parametrize("spec, kwargs, message", [
    ("no_such_module_xyz:fn", {}, "reward.function: no module named 'no_such_module_xyz' can be imported"),
    ("missing/rewards.py:fn", {}, "reward.function: the file 'missing/rewards.py' does not exist"),
    ("my_rewards:nope", {}, "reward.function: the module 'my_rewards' has no function 'nope' "
                            "(its functions: compute_score, length_bonus, two_args)"),
    ("my_rewards:NOT_A_FUNCTION", {}, "is a int, not a function"),
    ("my_rewards:two_args", {}, "reward.function 'my_rewards:two_args' has the signature (solution, truth)"),
    ("my_rewards:compute_score", {"bonus": 1}, "plus reward.kwargs ['bonus']"),
    (None, {"bonus": 1}, "reward.kwargs ['bonus'] were given but reward.function is not set"),
])
def test_broken_reward_functions_are_config_errors_naming_the_key(
    user_module: Path, spec: str | None, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        RewardFunction(spec, kwargs)
    assert message in str(info.value)


def test_a_file_that_fails_to_run_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "broken.py"
    path.write_text("import no_such_dependency_xyz\n")
    with pytest.raises(ConfigError, match=r"running '.*broken.py' failed: ModuleNotFoundError"):
        RewardFunction(f"{path}:fn")


def test_the_config_section_and_the_env_factory_read_it(user_module: Path) -> None:
    with pytest.raises(ConfigError, match="reward.function: Value error, must look like"):
        load_config(None, ["reward.function=' my_rewards:'"])
    config = load_config(None, ["env=arithmetic", "reward.function=my_rewards:length_bonus",
                                "reward.kwargs={bonus: 0.5}"])
    env_cls, kwargs, resources = env_arguments(config)
    env = env_cls(**kwargs)
    assert isinstance(env.reward_fn, RewardFunction) and env.reward_fn.kwargs == {"bonus": 0.5}
    env.close()
    asyncio.run(resources.aclose())
    with pytest.raises(ConfigError, match="no module named 'nowhere_xyz'"):
        env_arguments(load_config(None, ["env=retool", "reward.function=nowhere_xyz:fn"]))
    with pytest.raises(ConfigError, match="env.kwargs.reward_fn"):
        env_arguments(load_config(None, ["env=arithmetic", "env.kwargs={reward_fn: x}"]))
    with pytest.raises(ConfigError, match="env 'my_rewards:SelfScoringEnv' scores its episodes itself"):
        env_arguments(load_config(None, ["env=my_rewards:SelfScoringEnv", "reward.function=my_rewards:fn"]))


# ── the pre-flight check ────────────────────────────────────────────────────────────────────


def test_preflight_passes_published_rows_and_names_the_bad_ones(tmp_path: Path) -> None:
    for name in ("gsm8k.jsonl", "dapo_math.jsonl", "math_lighteval.jsonl"):
        loaded = load_rows(DATA / name)
        assert check_ground_truths(compute_score, loaded.rows, where=loaded.sources) == [], name
    # a mis-keyed dataset: GSM8K answers written as words, a DAPO row labelled as GSM8K
    bad = [{**r, "reward_model": {"style": "rule", "ground_truth": "seventy-two"}} for r in rows("gsm8k.jsonl")[:1]]
    bad += [{**rows("dapo_math.jsonl")[0], "data_source": "openai/gsm8k",
             "reward_model": {"ground_truth": "\\frac{a}{b}"}}]
    path = tmp_path / "mis-keyed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in bad))
    loaded = load_rows(path)
    problems = check_ground_truths(compute_score, loaded.rows, where=loaded.sources)
    assert len(problems) == 2
    assert problems[0].startswith(f"{path} row 0: the correct answer ")
    assert "ground truth 'seventy-two'" in problems[0] and "scored 0, not 1.0" in problems[0]
    assert problems[1].startswith(f"{path} row 1:")
    assert render_answer("openai/gsm8k", "72").endswith("#### 72")


def test_preflight_finds_broken_reward_functions() -> None:
    data = rows("dapo_math.jsonl")
    constant = check_ground_truths(lambda **kw: 1.0, data)
    assert constant == ["row 0: a reply with no answer ('I could not work this out.') scored 1; the reward "
                        "function <lambda> does not look at the answer"]

    def crashes(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
        raise KeyError("answer")

    assert check_ground_truths(crashes, data[:2]) == ["row 0: crashes raised KeyError: 'answer'",
                                                      "row 1: crashes raised KeyError: 'answer'"]
    assert check_ground_truths(compute_score, [{"prompt": "q"}]) == ["row 0: no reward_model.ground_truth to score against"]
    # each line carries its kind, which pre-flight weighs (a user's own rule may score some answers below 1)
    assert [p.kind for p in constant] == ["blind"]
    assert {p.kind for p in check_ground_truths(crashes, data[:2])} == {"raised"}
    assert [p.kind for p in check_ground_truths(lambda **kw: 0.5, data[:1])] == ["below_full"]


# ── through the envs ────────────────────────────────────────────────────────────────────────


def test_retool_scores_published_rows_with_shaping_on_top() -> None:
    gsm, dapo, math = rows("gsm8k.jsonl")[0], rows("dapo_math.jsonl")[0], rows("math_lighteval.jsonl")[0]
    env = RetoolEnv(format_reward=0.1)
    try:
        for row, right, wrong, unformatted in (
            (gsm, "48+24=72\n#### 72", "#### 70", "72 clips"),
            (dapo, "Answer: 34", "Answer: 33", "it is 34"),
            (math, "\\boxed{2}", "\\boxed{3}", "two asymptotes"),
        ):
            for reply, expected in ((right, 1.0), (wrong, 0.1), (unformatted, 0.0)):
                env.reset(options={"row": row})
                _, reward, terminated, _, info = env.step(Action(reply))
                assert terminated and reward == expected, (row["data_source"], reply)
        assert info["reward_extra"] == {"pred": None, "format": "boxed"}
    finally:
        env.close()


def test_envs_take_the_runs_reward_function(user_module: Path) -> None:
    fn = RewardFunction("my_rewards:length_bonus", {"bonus": 0.5})
    row = rows("dapo_math.jsonl")[0]
    for env in (RetoolEnv(reward_fn=fn), ArithmeticEnv(reward_fn=fn)):
        try:
            env.reset(options={"row": row})
            _, reward, _, _, info = env.step(Action("34"))
            assert reward == 1.5 and info["metrics"]["reward/length"] == 2.0
        finally:
            env.close()
    env = ArithmeticEnv()
    try:  # a row with nothing to score against is not scored 0: the episode fails loudly
        env.reset(options={"row": {"prompt": "1+1?"}})
        with pytest.raises(EnvError, match="no reward_model.ground_truth"):
            env.step(Action("\\boxed{2}"))
    finally:
        env.close()
