"""`reward.model`: a sequence-classification reward model scored in a process of its own.

The model is a tiny random `AutoModelForSequenceClassification` built from the tiny Qwen2's config
(num_labels=1) and saved to a temporary directory; the scorer starts the real child process
(`agentrl.inference.reward_model_server`) and its scores are checked against the same model run in
this process on the same tokens. Missing causes: a conversation over `max_length` (`truncated`) and a
process that was killed (`infra`).
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from agentrl.config import RewardConfig, RewardModelConfig
from agentrl.envs.arithmetic import make_arithmetic_row
from agentrl.envs.reward_model import RewardModelScorer, conversation_of
from agentrl.envs.reward_sources import ascore_row, build_reward
from agentrl.errors import RewardMissingError

pytestmark = pytest.mark.slow  # it starts a model process: about 15-30 s on a shared CPU

ROW = make_arithmetic_row(2)


@pytest.fixture(scope="module")
def tiny_reward_model(assets: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    source = assets / "tiny-random-qwen2"
    config = AutoConfig.from_pretrained(source, num_labels=1)
    config.pad_token_id = config.eos_token_id
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    out = tmp_path_factory.mktemp("tiny-rm")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(source).save_pretrained(out)
    return out


def _reference_score(path: Path, messages: list[dict[str, Any]]) -> float:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    ids = tok.apply_chat_template(messages, tokenize=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    with torch.no_grad():
        return float(model(input_ids=torch.tensor([ids])).logits[0, 0])


def test_a_reward_model_scores_in_its_own_process(tiny_reward_model: Path) -> None:
    reward = build_reward(RewardConfig(model=RewardModelConfig(path=str(tiny_reward_model), max_length=512)))
    scorer = reward.parts[0][2]  # type: ignore[union-attr]
    assert isinstance(scorer, RewardModelScorer)

    async def score_three() -> list[Any]:
        return list(await asyncio.gather(*(ascore_row(reward, ROW, f"The answer is \\boxed{{{n}}}.")
                                           for n in (1, 2, 3))))

    try:
        results = asyncio.run(score_three())
        for n, result in zip((1, 2, 3), results, strict=True):
            expected = _reference_score(tiny_reward_model, conversation_of(ROW, f"The answer is \\boxed{{{n}}}."))
            assert result.score == pytest.approx(expected, abs=1e-4)
            assert result.record["parts"]["model"]["tokens"] > 10
        assert len({round(r.score, 6) for r in results}) == 3  # each answer its own score
        with pytest.raises(RewardMissingError, match="over reward.model.max_length=512") as cut:
            asyncio.run(ascore_row(reward, ROW, "many words " * 400))
        assert cut.value.cause == "truncated"
        assert scorer._proc is not None
        os.killpg(scorer._proc.pid, signal.SIGKILL)  # the process (and its lifeline) dies
        scorer._proc.wait()
        for _ in range(2):  # a dead process is not restarted: every later reward is missing
            with pytest.raises(RewardMissingError) as dead:
                asyncio.run(ascore_row(reward, ROW, "\\boxed{1}"))
            assert dead.value.cause == "infra"
    finally:
        scorer.close()
