"""What `agentrl view` reads (agentrl/viewer/sources.py): run and eval directories, trajectory files."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from agentrl.chat import ChatTemplate
from agentrl.errors import ConfigError
from agentrl.viewer import RunReader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from viewer_runs import NOT_EPISODES, QWEN25, make_failing_run, make_run_dir, tool_episode

pytestmark = pytest.mark.skipif(not QWEN25.is_dir(), reason=f"tokenizer assets not found under {QWEN25}")


@pytest.fixture(scope="module")
def template() -> ChatTemplate:
    return ChatTemplate.from_pretrained(QWEN25)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory, template: ChatTemplate) -> Path:
    return make_run_dir(tmp_path_factory.mktemp("viewer") / "calc-run", template)


@pytest.fixture(scope="module")
def failing_run(tmp_path_factory: pytest.TempPathFactory, template: ChatTemplate) -> Path:
    return make_failing_run(tmp_path_factory.mktemp("viewer") / "failing-run", template)


def test_a_run_lists_its_steps_and_evaluations(run_dir: Path) -> None:
    reader = RunReader(run_dir)
    assert reader.kind == "run"
    assert [(s.id, s.kind, s.step, s.label) for s in reader.sources()] == [
        ("rollouts/step-000001", "train", 1, "step 1 rollouts"),
        ("rollouts/step-000002", "train", 2, "step 2 rollouts"),
        ("rollouts/step-000003", "train", 3, "step 3 rollouts"),
        ("eval/step-000000", "eval", 0, "eval before training"),
        ("eval/step-000003", "eval", 3, "eval after step 3"),
    ]
    summary = reader.summary()
    assert summary["name"] == "calc-run" and summary["has_metrics"]
    assert summary["config"] == {"env.name": "arithmetic", "model.path": str(QWEN25), "run.mode": "sync"}
    json.dumps(summary, allow_nan=False)


def test_episode_summaries_carry_what_the_filters_need(run_dir: Path) -> None:
    episodes = RunReader(run_dir).episodes("rollouts/step-000002")
    # keep_rollouts=2: the best group (g3, filtered: all rewards 1), the worst (g1, all 0) and the
    # infrastructure-failed g2, in the order the step had them
    assert [(e["group_id"], e["status"], e["kept_as"]) for e in episodes] == [
        ("g1", "trained", ["worst"]), ("g1", "trained", ["worst"]),
        ("g2", "infra", ["infra"]), ("g2", "infra", ["infra"]),
        ("g3", "filtered", ["best"]), ("g3", "filtered", ["best"]),
    ]
    worst, infra, best = episodes[0], episodes[2], episodes[4]
    assert best["reward"] == 1.0 and best["finish_reason"] == "done" and best["fault"] == "none"
    assert best["answer"] == "The answer is \\boxed{84}." and best["ground_truth"] == "84"
    assert worst["answer"] == "The answer is \\boxed{85}." and worst["trained"] and not best["trained"]
    assert best["tool_calls"] == 1.0 and best["index"] == 4
    assert infra["fault"] == "infra" and infra["tool_errors_infra"] == 1.0 and not infra["trained"]
    assert infra["finish_reason"] == "error"
    assert "worker process is gone" in infra["error"]


def test_an_episode_is_its_trajectory_file_line(run_dir: Path, template: ChatTemplate) -> None:
    reader = RunReader(run_dir)
    record = reader.episode("rollouts/step-000001", 0)
    assert record["episode_id"] == "e1-0"
    assert "".join(s["text"] for s in record["segments"]) == template.tokenizer.decode(
        [i for s in record["segments"] for i in s["ids"]], skip_special_tokens=False)
    with pytest.raises(KeyError):
        reader.episode("rollouts/step-000001", 99)
    with pytest.raises(KeyError):
        reader.episodes("../../etc/passwd")


def test_the_dashboard_has_the_plot_panels(run_dir: Path) -> None:
    dash = RunReader(run_dir).dashboard()
    panels = {p["title"]: p for p in dash["panels"]}
    assert dash["steps"] == 3
    assert panels["Infrastructure failures"]["series"]["tools/error_rate_infra"] == {"x": [1.0, 2.0, 3.0], "y": [0.0, 0.5, 0.0]}
    assert panels["Held-out pass@k"]["series"]["eval/pass_at_1"]["x"] == [0.0, 3.0]
    assert panels["KL"]["empty"] == "always 0" and panels["Entropy"]["empty"] == "not logged"
    assert panels["Finish reasons"]["stacked"]


def test_an_eval_directory_a_single_file_and_an_old_file(run_dir: Path, tmp_path: Path, template: ChatTemplate) -> None:
    eval_dir = run_dir / "eval" / "step-000003"
    (eval_dir / "report.json").write_text(json.dumps({"pass_at_1": 0.5, "k": 2, "pass_at_k": 1.0}))
    reader = RunReader(eval_dir)
    assert reader.kind == "eval" and [s.id for s in reader.sources()] == ["eval"]
    assert reader.summary()["report"]["pass_at_1"] == 0.5
    assert [e["reward"] for e in reader.episodes("eval")] == [1.0, 0.0]
    single = RunReader(eval_dir / "trajectories.jsonl")
    assert single.kind == "file" and len(single.episodes("file")) == 2

    # A file from before tokens carried their text: the run's config names the tokenizer.
    old_dir = tmp_path / "old-run" / "eval" / "step-000000"
    old_dir.mkdir(parents=True)
    t = tool_episode(template)
    (old_dir / "trajectories.jsonl").write_text(json.dumps(t.to_dict() | {"text": "all of it"}) + "\n")
    (tmp_path / "old-run" / "config.yaml").write_text(f"model:\n  path: {QWEN25}\n")
    old = RunReader(tmp_path / "old-run")
    record = old.episode("eval/step-000000", 0)
    assert [s["origin"] for s in record["segments"]][:2] == ["prompt", "sampled"]
    assert "".join(s["text"] for s in record["segments"]) == template.tokenizer.decode(t.token_ids, skip_special_tokens=False)


def test_what_is_not_a_run_is_refused_with_what_to_give(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        RunReader(tmp_path / "nope")
    (tmp_path / "notes.txt").write_text("not a run")
    with pytest.raises(ConfigError, match="holds no run"):
        RunReader(tmp_path)


def test_a_run_that_has_written_only_its_config_waits_and_fills_in(run_dir: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="holds no run"):  # a run writes its config.yaml as it starts
        RunReader(empty)
    starting = tmp_path / "starting"
    starting.mkdir()
    (starting / "config.yaml").write_text((run_dir / "config.yaml").read_text())
    reader = RunReader(starting)
    summary = reader.summary()
    assert (summary["kind"], summary["sources"], summary["has_metrics"]) == ("waiting", [], False)
    assert summary["config"]["env.name"] == "arithmetic"  # the config is shown while it waits
    assert reader.dashboard()["steps"] == 0
    (starting / "rollouts").mkdir()
    (starting / "rollouts" / "step-000001.jsonl").write_text((run_dir / "rollouts" / "step-000001.jsonl").read_text())
    assert reader.kind == "run"
    assert [s["id"] for s in reader.summary()["sources"]] == ["rollouts/step-000001"]
    assert reader.episode("rollouts/step-000001", 0)["episode_id"] == "e1-0"


def test_a_training_episode_carries_its_steps_onpolicy_metrics(run_dir: Path, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    assert RunReader(copy).episode("rollouts/step-000002", 0)["onpolicy"] == {}  # no gate ran: nothing shown
    lines = (copy / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    for r in records:  # metrics.jsonl counts steps from 0; rollouts/step-000002 is its step 1
        r.update({"onpolicy/passed": 1.0 if r["step"] == 1 else 0.0, "onpolicy/max_gap": 0.25 * r["step"]})
    (copy / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    reader = RunReader(copy)
    assert reader.episode("rollouts/step-000002", 0)["onpolicy"] == {"onpolicy/passed": 1.0, "onpolicy/max_gap": 0.25}
    assert "onpolicy" not in reader.episode("eval/step-000003", 0)  # evaluations are not a step's


def test_a_file_being_rewritten_is_read_again(run_dir: Path, tmp_path: Path, template: ChatTemplate) -> None:
    from agentrl.records.trajectory_log import write_eval_trajectories

    path = tmp_path / "t.jsonl"
    write_eval_trajectories(path, [[tool_episode(template)]], [{}], template.tokenizer)
    reader = RunReader(path)
    assert len(reader.episodes("file")) == 1
    write_eval_trajectories(path, [[tool_episode(template), tool_episode(template)]], [{}], template.tokenizer)
    os.utime(path, ns=(1, 1))  # another stamp even on a coarse clock
    assert len(reader.episodes("file")) == 2


def test_the_stopped_run_file_says_why_its_episodes_were_kept(failing_run: Path) -> None:
    reader = RunReader(failing_run)
    stopped = reader.source("rollouts/step-000003-stopped")
    assert (stopped.kind, stopped.step, stopped.label) == ("train", 3, "step 3 rollouts (the run stopped here)")
    episodes = reader.episodes(stopped.id)
    assert [(e["episode_id"], e["status"], e["kept_as"], e["fault"]) for e in episodes] == [
        ("stopped", "infra", ["stopped"], "infra"), ("stopped-tool", "infra", ["stopped"], "infra")]
    # The first failed before the model's first turn: its prompt's worked examples are no answer.
    assert episodes[0]["answer"] == "" and episodes[0]["num_turns"] == 0
    assert reader.episode(stopped.id, 0)["kept_as"] == ["stopped"]


def test_lines_that_are_not_episodes_are_left_out_and_counted(failing_run: Path, tmp_path: Path) -> None:
    reader = RunReader(failing_run)
    episodes = reader.episodes("rollouts/step-000001")
    assert [e["episode_id"] for e in episodes] == ["fs-0", "fs-1", "ch-0", "ch-1", "bidi"]
    assert reader.skipped_lines("rollouts/step-000001") == len(NOT_EPISODES) == 6
    assert reader.skipped_lines("rollouts/step-000003-stopped") == 0
    # A line with the keys of an episode but values of other types does not break the list.
    line = json.loads((failing_run / "rollouts" / "step-000001.jsonl").read_text().splitlines()[0])
    line.update(kept_as="best", metrics={"tool_calls": "many", "parse_errors": True})
    (tmp_path / "odd.jsonl").write_text(json.dumps(line) + "\nnull\n")
    odd = RunReader(tmp_path / "odd.jsonl")
    [summary] = odd.episodes("file")
    assert summary["kept_as"] == [] and summary["tool_calls"] == 0.0 and summary["parse_errors"] == 0.0
    assert odd.skipped_lines("file") == 1
    json.dumps(summary, allow_nan=False)


def test_a_prompts_own_assistant_messages_are_not_the_answer(failing_run: Path) -> None:
    reader = RunReader(failing_run)
    few_shot = reader.episode("rollouts/step-000001", 0)
    assert sum(m["role"] == "assistant" for m in few_shot["messages"]) == 6  # 4 worked, 2 sampled
    assert [e["answer"] for e in reader.episodes("rollouts/step-000001")][:4] == ["The answer is \\boxed{85}."] * 4


def test_a_failing_run_still_draws_reward_pass_at_k_and_infrastructure_failures(failing_run: Path) -> None:
    dash = RunReader(failing_run).dashboard()
    panels = {p["title"]: p for p in dash["panels"]}
    assert panels["Reward"]["empty"] == "" and panels["Reward"]["series"]["episodes/reward_mean"]["y"] == [0.0, 0.0]
    assert panels["Held-out pass@k"]["empty"] == ""
    assert panels["Held-out pass@k"]["series"]["eval/pass_at_2"] == {"x": [0.0], "y": [0.0]}
    assert panels["Infrastructure failures"]["empty"] == ""
    assert panels["Infrastructure failures"]["series"]["tools/error_rate_infra"]["y"] == [0.0, 0.0]
    assert panels["KL"]["empty"] == "always 0"  # other panels at 0 throughout are still left out
