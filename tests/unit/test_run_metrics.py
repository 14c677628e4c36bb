"""Dashboard numbers from a step's episodes, the metrics JSONL, and `agentrl plot`."""

from __future__ import annotations

import json
import logging

import pytest

from agentrl.records.metrics import (
    PANELS,
    MetricsLogger,
    dashboard_panels,
    episode_metrics,
    read_evals,
    read_metrics,
    step_line,
    tensorboard_layout,
    time_split,
)
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


def write_run(tmp_path, steps=3, infra=(0.0, 0.5, 0.0)):
    with (tmp_path / "metrics.jsonl").open("w") as f:
        for step in range(steps):
            f.write(json.dumps({
                "step": step, "episodes/reward_mean": step / 3, "episodes/solved_frac": 0.0, "actor/grad_norm": 1.0,
                "tools/error_rate_infra": infra[step], "tools/error_rate_model": 0.0, "actor/ppo_kl": 0.0,
                "finish/done": 0.75, "finish/max_length": 0.25, "finish/error": 0.0,
                "time/rollout_s": 10.0, "time/train_s": 6.0, "time/export_s": 1.0, "time/weight_sync_s": 2.0,
                "time/step_s": 18.5,
            }) + "\n")
    (tmp_path / "eval.jsonl").write_text(json.dumps({"step": 0, "pass_at_1": 0.1, "pass_at_4": 0.2}) + "\n"
                                         + json.dumps({"step": 3, "pass_at_1": 0.3, "pass_at_4": 0.5}) + "\n")


def test_the_step_line_shows_what_was_not_measured_as_missing_not_zero(tmp_path, caplog):
    # The on-policy update reports no ppo_kl (it would be 0 by construction); a NaN is not a value either.
    measured = {"episodes/reward_mean": 0.5, "actor/entropy": float("nan"), "actor/grad_norm": 0.0,
                "time/step_s": 12.0}
    line = step_line(measured)
    assert "kl -" in line and "ent -" in line and "eval -" in line
    assert "reward 0.5" in line and "gnorm 0" in line and "s 12" in line  # a measured 0 stays 0
    logger = MetricsLogger(tmp_path, ["console", "jsonl"], total_steps=3)
    with caplog.at_level(logging.INFO, logger="agentrl.run"):
        logger.log(0, measured)
    logger.close()
    assert caplog.messages == [f"step 1/3  {line}"]
    (record,) = read_metrics(tmp_path / "metrics.jsonl")
    assert "actor/ppo_kl" not in record and "actor/entropy" not in record


def test_time_split_adds_up_to_the_step():
    split = time_split({"time/rollout_s": 10.0, "time/train_s": 6.0, "time/export_s": 1.0,
                        "time/weight_sync_s": 2.0, "time/step_s": 18.5})
    assert split == {"time/split/wait_rollout_s": 10.0, "time/split/train_s": 5.0, "time/split/weights_s": 2.0,
                     "time/split/other_s": 1.5}
    assert time_split({"time/idle_s": 1.0}) == {}


def test_dashboard_panels_say_which_have_nothing_to_show(tmp_path):
    write_run(tmp_path)
    data = {d.panel.title: d for d in dashboard_panels(read_metrics(tmp_path / "metrics.jsonl"),
                                                       read_evals(tmp_path / "eval.jsonl"))}
    assert list(data) == [p.title for p in PANELS]
    assert data["Held-out pass@k"].series == {"eval/pass_at_1": ([0.0, 3.0], [0.1, 0.3]),
                                              "eval/pass_at_4": ([0.0, 3.0], [0.2, 0.5])}
    assert data["Reward"].series["episodes/reward_mean"] == ([1.0, 2.0, 3.0], [0.0, 1 / 3, 2 / 3])
    assert data["Infrastructure failures"].empty == "" and data["KL"].empty == "always 0"
    assert data["Entropy"].empty == "not logged"
    assert list(data["Finish reasons"].series) == ["finish/done", "finish/max_length", "finish/error"]
    assert data["Time split"].series["time/split/train_s"][1] == [5.0, 5.0, 5.0]


def tensorboard_events(folder):
    """Every event in a TensorBoard folder (TFRecord framing: length, crc, payload, crc)."""
    import struct

    from tensorboardX.proto.event_pb2 import Event

    events = []
    for path in sorted(folder.iterdir()):
        data = path.read_bytes()
        at = 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at:at + 8])
            event = Event()
            event.ParseFromString(data[at + 12:at + 12 + length])
            events.append(event)
            at += 12 + length + 4
    return events


def test_tensorboard_gets_the_same_panels(tmp_path):
    logger = MetricsLogger(tmp_path, ["tensorboard"], total_steps=2)
    logger.log(0, {"tools/error_rate_infra": 0.25, "finish/done": 1.0, "time/step_s": 3.0, "time/rollout_s": 2.0})
    logger.close()
    layout = tensorboard_layout()["agentrl dashboard"]
    assert layout["Infrastructure failures"][1][0] == "^tools/error_rate_infra$"
    assert layout["Finish reasons"] == ["Multiline", ["^finish/.*$"]]
    values = {v.tag: v for e in tensorboard_events(tmp_path / "tensorboard") for v in e.summary.value}
    assert "custom_scalars__config__" in values
    layout_bytes = values["custom_scalars__config__"].tensor.string_val[0]
    assert b"Infrastructure failures" in layout_bytes and b"Time split" in layout_bytes
    assert values["time/split/wait_rollout_s"].simple_value == 2.0
    assert values["tools/error_rate_infra"].simple_value == 0.25


def test_plot_draws_the_panels_and_names_those_left_out(tmp_path):
    pytest.importorskip("matplotlib")
    from agentrl.errors import ConfigError
    from agentrl.records.plot import plot_run

    write_run(tmp_path)
    written = plot_run(tmp_path)
    names = sorted(p.name for p in written)
    assert names == ["dashboard.png", "finish_reasons.png", "grad_norm.png", "held_out_pass_k.png",
                     "infrastructure_failures.png", "reward.png", "time_split.png"]
    assert all(p.stat().st_size > 1000 and p.read_bytes()[:4] == b"\x89PNG" for p in written)
    assert [p.name for p in plot_run(tmp_path, tmp_path / "one", keys=["actor/grad_norm"])] == [
        "actor_grad_norm.png", "dashboard.png"]
    with pytest.raises(ConfigError, match="no metric named"):
        plot_run(tmp_path, keys=["nope/x"])
    with pytest.raises(ConfigError, match="no metrics.jsonl"):
        plot_run(tmp_path / "missing")


def test_a_failing_run_still_plots_reward_pass_at_k_and_infrastructure_failures(tmp_path):
    pytest.importorskip("matplotlib")
    from agentrl.records.plot import plot_run

    with (tmp_path / "metrics.jsonl").open("w") as f:
        for step in range(2):
            f.write(json.dumps({"step": step, "episodes/reward_mean": 0.0, "episodes/solved_frac": 0.0,
                                "tools/error_rate_infra": 0.0, "actor/ppo_kl": 0.0, "finish/max_turns": 1.0}) + "\n")
    (tmp_path / "eval.jsonl").write_text(json.dumps({"step": 0, "pass_at_1": 0.0, "pass_at_4": 0.0}) + "\n")
    data = {d.panel.title: d for d in dashboard_panels(read_metrics(tmp_path / "metrics.jsonl"),
                                                       read_evals(tmp_path / "eval.jsonl"))}
    assert [t for t, d in data.items() if not d.empty] == ["Reward", "Held-out pass@k", "Infrastructure failures",
                                                           "Finish reasons"]
    assert data["Reward"].series["episodes/reward_mean"] == ([1.0, 2.0], [0.0, 0.0])
    assert data["KL"].empty == "always 0"
    names = sorted(p.name for p in plot_run(tmp_path))
    assert names == ["dashboard.png", "finish_reasons.png", "held_out_pass_k.png", "infrastructure_failures.png",
                     "reward.png"]
