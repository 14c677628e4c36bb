"""On-policy distillation through a real run: `agentrl run` (in this process) with a teacher the run
serves, the tiny Qwen2 policy on the hf engine.

The teacher is the tiny model with seeded noise added to its weights (same tokenizer, other
logprobs), so the teacher-student gap is not zero. The run trains a step; the rollout file's sampled
segments carry the teacher's logprobs, which match the teacher scored here with transformers, and
the step's `distill/teacher_gap_mean` is the mean of teacher minus rollout logprob over those tokens.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

E2E = Path(__file__).resolve().parents[1] / "e2e"
if str(E2E) not in sys.path:
    sys.path.insert(0, str(E2E))

from distill_parts import distill_overrides, noisy_teacher, teacher_logprobs_of  # noqa: E402

pytestmark = pytest.mark.slow


def test_a_run_with_a_teacher_trains_on_its_per_token_signal(tmp_path: Path, assets: Path) -> None:
    from agentrl.config import load_config
    from agentrl.orchestration.driver import run_training
    from agentrl.records.trajectory_log import read_trajectory_file, trajectory_from_record
    from agentrl.types import TokenOrigin

    tiny = assets / "tiny-random-qwen2"
    teacher = noisy_teacher(tiny, tmp_path / "teacher")
    result = run_training(load_config(None, distill_overrides(tmp_path, "distill", tiny, teacher,
                                                              "run.total_steps=1")))
    assert result.steps_done == 1
    run_dir = Path(result.run_dir)
    (metrics,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert metrics["episodes/infra_failed_total"] == 0.0

    records = read_trajectory_file(run_dir / "rollouts" / "step-000001.jsonl")
    assert len(records) == 4  # two prompts x two samples, every group kept (run.keep_rollouts=all)
    gaps = []
    for record in records:
        for seg in record["segments"]:  # sampled segments carry the teacher's logprobs, no other does
            assert ("teacher_logprobs" in seg) == (seg["origin"] == "sampled")
        t = trajectory_from_record(record)
        expected = teacher_logprobs_of(teacher, t.token_ids)
        for i, (o, lp, student) in enumerate(zip(t.origins, t.teacher_logprobs, t.logprobs, strict=True)):
            if o == int(TokenOrigin.SAMPLED):
                assert lp == pytest.approx(expected[i - 1], abs=1e-4)
                gaps.append(lp - student)
            else:
                assert lp == 0.0
    assert gaps and any(abs(g) > 1e-2 for g in gaps)  # the noisy teacher disagrees with the student
    assert metrics["distill/teacher_gap_mean"] == pytest.approx(sum(gaps) / len(gaps), abs=1e-5)
    assert metrics["distill/reverse_kl"] == pytest.approx(-metrics["distill/teacher_gap_mean"], abs=1e-9)
    assert metrics["distill/coef"] == 0.5
