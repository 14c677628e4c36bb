"""verl-format GSM8K, DAPO-Math and MATH rows (parquet and JSONL) through `agentrl eval` with the
retool env: each row scored in its own format by the default reward, or by a user function named in
the config. The policy is a scripted stand-in that answers from a table; everything else (the chat
template of a real tokenizer, the AgentLoop, the env, the report) is the real path."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agentrl.chat import ChatTemplate
from agentrl.config import load_config
from agentrl.datasets import read_rows
from agentrl.errors import ConfigError
from agentrl.inference.protocol import Generation, SamplingParams
from agentrl.orchestration.evaluate import run_eval

DATA = Path(__file__).resolve().parents[1] / "data" / "verl"

# The reply the scripted policy gives to each problem (found by a phrase of its prompt).
REPLIES = {
    "Natalia sold clips": "Natalia sold 48/2 = 24 clips in May, 72 in all.\n#### 72",  # right
    "Weng earns $12": "She earned 0.2 x 50 = 10 dollars.\n#### 10",  # right
    "Betty is saving": "Betty needs 100 - 50 - 30 = 20 more.\n#### 20",  # wrong (forgot the parents)
    "In triangle $ABC$": "The sum works out to 34.\nAnswer: 34",  # right
    "Let $a_1, a_2": "a_10 = 2^10 = 1024\nAnswer: 1024",  # wrong
    "positive divisors does $2024$": "2024 = 2^3 * 11 * 23 has 16 divisors.",  # right number, no answer line
    "vertical asymptotes": "The denominator factors as (x+3)(x-2): $\\boxed{2}$.",  # right
    "foci of the ellipse": "c = 10\\sqrt{3}, so the foci are \\boxed{20\\sqrt{3}} apart.",  # right
    "largest possible value of $|x|+|y|$": "At x = y it is \\boxed{\\sqrt{2}}.",  # right
    "sqrt{36 \\times": "\\boxed{12}",  # right
}


class ScriptedPolicy:
    """Answers each problem with its line of REPLIES, in one turn, as token ids."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, *, session_id: str,
                       timeout_s: float | None = None) -> Generation:
        prompt = self.tok.decode(prompt_ids)
        reply = next(text for phrase, text in REPLIES.items() if phrase in prompt)
        ids = self.tok.encode(reply + "<|im_end|>", add_special_tokens=False)
        return Generation(ids, [-0.1] * len(ids), "stop", 0)


@pytest.fixture
def val_files(tmp_path: Path) -> list[str]:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    parquet = tmp_path / "gsm8k.parquet"  # verl ships its preprocessed data as parquet
    pq.write_table(pa.Table.from_pylist(read_rows(DATA / "gsm8k.jsonl")), parquet)
    return [str(parquet), str(DATA / "dapo_math.jsonl"), str(DATA / "math_lighteval.jsonl")]


def eval_config(assets: Path, tmp_path: Path, val_files: list[str], *extra: str) -> Any:
    files = ", ".join(val_files)
    return load_config(overrides=[
        "env=retool", f"model.path={assets / 'qwen2.5-0.5b-instruct'}", f"data.val_files=[{files}]",
        "eval.k=1", f"eval.output_dir={tmp_path / 'eval'}", *extra])


def test_eval_scores_each_published_format_by_its_data_source(assets: Path, tmp_path: Path, val_files: list[str]) -> None:
    config = eval_config(assets, tmp_path, val_files)
    policy = ScriptedPolicy(ChatTemplate.from_pretrained(config.model.path).tokenizer)
    report = run_eval(config, client=policy)
    assert (report.problems, report.infra_failed_episodes) == (10, 0)
    by_source = {s: round(v["pass_at_1"], 3) for s, v in report.by_data_source.items()}
    assert by_source == {"openai/gsm8k": 0.667, "math_dapo": 0.333, "DigitalLearningGmbH/MATH-lighteval": 1.0}
    assert report.pass_at_1 == pytest.approx(0.7)
    episodes = [json.loads(line) for line in (tmp_path / "eval" / "trajectories.jsonl").read_text().splitlines()]
    assert sorted(e["ground_truth"] for e in episodes if e["reward"] == 1.0) == sorted(
        ["72", "10", "34", "2", "20\\sqrt3", "\\sqrt{2}", "12"])


def test_eval_with_a_user_reward_function_from_a_file(assets: Path, tmp_path: Path, val_files: list[str]) -> None:
    user = tmp_path / "rewards_by_number.py"
    user.write_text(
        "import re\n\n"
        "def last_number(data_source, solution_str, ground_truth, extra_info=None, partial=0.0):\n"
        "    numbers = re.findall(r'-?\\d+', solution_str)\n"
        "    return {'score': 1.0 if numbers and numbers[-1] == ground_truth else partial, 'numbers': len(numbers)}\n"
    )
    config = eval_config(assets, tmp_path, val_files, f"reward.function={user}:last_number",
                         "reward.kwargs={partial: 0.25}")
    policy = ScriptedPolicy(ChatTemplate.from_pretrained(config.model.path).tokenizer)
    report = run_eval(config, client=policy)
    by_source = {s: round(v["pass_at_1"], 3) for s, v in report.by_data_source.items()}
    # its own rule: the last integer in the reply. The divisor count (no answer line) now counts,
    # the MATH answers with a root do not.
    assert by_source == {"openai/gsm8k": 0.667, "math_dapo": 0.667, "DigitalLearningGmbH/MATH-lighteval": 0.5}
    assert report.mean_reward == pytest.approx((6 + 0.25 * 4) / 10)
    with pytest.raises(ConfigError, match="has no function 'nope'"):
        run_eval(eval_config(assets, tmp_path, val_files, f"reward.function={user}:nope"), client=policy)
