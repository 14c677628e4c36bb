"""Dashboard numbers from a step's episodes, the metrics JSONL, and `agentrl plot`."""

from __future__ import annotations

import json

import pytest

from agentrl.orchestration.metrics import MetricsLogger, episode_metrics, read_metrics
from agentrl.types import FinishReason, TokenOrigin, Trajectory


def episode(reward, *, sampled=2, calls=0, model_errors=0, finish=FinishReason.DONE, fault=None, version=0):
    t = Trajectory()
    t.extend([1, 2, 3], TokenOrigin.PROMPT, 0)
    t.extend(list(range(sampled)), TokenOrigin.SAMPLED, 1, [-1.0] * sampled, version=version)
    t.reward, t.finish_reason, t.fault = reward, finish, fault
    t.metrics = {"tool_calls": float(calls), "tool_errors_model": float(model_errors), "turns": 1.0}
    return t


def test_episode_metrics_are_worked_out_by_hand():
    groups = [
        [episode(1.0, sampled=4, calls=2, model_errors=1), episode(0.0, sampled=2, calls=1)],
        [episode(0.0, finish=FinishReason.MAX_LENGTH, version=1), episode(0.0, version=1)],
        [episode(0.0, fault="infra", finish=FinishReason.ERROR), episode(1.0, calls=1)],
    ]
    m = episode_metrics(groups, trainer_version=2, group_versions=[0, 1, 2])
    assert m["episodes/count"] == 6
    assert m["episodes/infra_failed"] == 1
    assert m["episodes/reward_mean"] == pytest.approx(2 / 5)  # infra episode left out
    assert m["episodes/solved_frac"] == pytest.approx(2 / 5)
    # the second group (0, 0) and the third (one valid sample left) teach GRPO nothing
    assert m["episodes/zero_var_group_frac"] == pytest.approx(2 / 3)
    assert m["episodes/response_tokens_mean"] == pytest.approx((4 + 2 + 2 + 2 + 2 + 2) / 6)
    assert m["finish/max_length"] == pytest.approx(1 / 6)
    assert m["episodes/truncated_frac"] == pytest.approx(1 / 6)
    assert m["tools/calls_per_episode"] == pytest.approx(4 / 6)
    assert m["tools/error_rate_model"] == pytest.approx(1 / 4)
    assert m["tools/error_rate_infra"] == 0.0
    assert m["staleness/max"] == 2 and m["staleness/mean"] == pytest.approx(1.0)
    assert m["staleness/token_max"] == 2


def test_no_episodes_give_no_nan():
    assert episode_metrics([]) == {"episodes/count": 0.0}


def test_metrics_jsonl_round_trip_and_resume_truncation(tmp_path):
    logger = MetricsLogger(tmp_path, ["jsonl"], total_steps=4)
    for step in range(3):
        logger.log(step, {"episodes/reward_mean": step / 10, "bad": float("nan")})
    logger.truncate_after(0)
    logger.log(1, {"episodes/reward_mean": 0.5})
    logger.close()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    assert records[1]["episodes/reward_mean"] == 0.5
    assert "bad" not in records[0]


def test_plot_draws_a_png_per_metric_and_a_dashboard(tmp_path):
    pytest.importorskip("matplotlib")
    from agentrl.errors import ConfigError
    from agentrl.orchestration.plot import plot_run

    with (tmp_path / "metrics.jsonl").open("w") as f:
        for step in range(3):
            f.write(json.dumps({"step": step, "episodes/reward_mean": step / 3, "actor/grad_norm": 1.0}) + "\n")
    (tmp_path / "eval.jsonl").write_text(json.dumps({"step": 0, "pass_at_1": 0.1}) + "\n"
                                         + json.dumps({"step": 3, "pass_at_1": 0.3}) + "\n")
    written = plot_run(tmp_path)
    names = sorted(p.name for p in written)
    assert names == ["actor_grad_norm.png", "dashboard.png", "episodes_reward_mean.png", "eval_pass_at_1.png"]
    assert all(p.stat().st_size > 1000 and p.read_bytes()[:4] == b"\x89PNG" for p in written)
    with pytest.raises(ConfigError, match="no metric named"):
        plot_run(tmp_path, keys=["nope/x"])
    with pytest.raises(ConfigError, match="no metrics.jsonl"):
        plot_run(tmp_path / "missing")
