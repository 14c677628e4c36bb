"""SWE task format, patches and verdicts: instances are checked, diffs apply exactly, rows round-trip."""

from __future__ import annotations

import json

import pytest

from agentrl.config import AgentRLConfig
from agentrl.datasets import check_row
from agentrl.envs.patches import PatchError, apply_patch, make_patch, parse_patch
from agentrl.envs.swe_grading import _verdict, parse_pytest_log
from agentrl.envs.swe_tasks import SweTask, load_tasks, row_task, shipped_tasks, task_row
from agentrl.errors import DatasetError
from agentrl.orchestration.evaluate import summarise
from agentrl.types import Trajectory

BASE = {"instance_id": "x__1", "problem_statement": "it breaks", "FAIL_TO_PASS": ["t.py::test_a"],
        "repo_files": {"m.py": "x = 1\n"}}


def test_make_patch_round_trips_edits_creations_and_deletions() -> None:
    before = {"a.py": "".join(f"line {i}\n" for i in range(30)), "gone.py": "bye\n"}
    after = {"a.py": before["a.py"].replace("line 3\n", "LINE 3\n").replace("line 25\n", "line 25\nnew\n"),
             "new.py": "hello\nworld"}
    patches = {fp.path: fp for fp in parse_patch(make_patch(before, after))}
    assert sorted(patches) == ["a.py", "gone.py", "new.py"]
    assert [len(p.hunks) for p in (patches["a.py"], patches["new.py"])] == [2, 1]
    assert apply_patch(before["a.py"], patches["a.py"]) == after["a.py"]
    assert apply_patch(None, patches["new.py"]) == "hello\nworld"
    assert apply_patch(before["gone.py"], patches["gone.py"]) is None


def test_hunks_apply_at_an_offset_and_refuse_wrong_context() -> None:
    before = {"f.py": "a\nb\nc\nd\ne\n"}
    fp = parse_patch(make_patch(before, {"f.py": "a\nb\nC\nd\ne\n"}))[0]
    assert apply_patch("new top\n" * 4 + before["f.py"], fp) == "new top\n" * 4 + "a\nb\nC\nd\ne\n"
    with pytest.raises(PatchError, match="does not apply"):
        apply_patch("a\nb\nX\nd\ne\n", fp)
    with pytest.raises(PatchError, match="holds no file diff"):
        parse_patch("just text")


def test_instances_are_checked_with_messages_that_say_what_to_fix() -> None:
    task = SweTask.from_dict({**BASE, "FAIL_TO_PASS": '["t.py::test_a"]', "PASS_TO_PASS": "[]"})
    assert task.fail_to_pass == ("t.py::test_a",) and task.pass_to_pass == ()  # SWE-bench's JSON strings
    for bad, message in [
        ({"problem_statement": ""}, "problem_statement"),
        ({"FAIL_TO_PASS": [], "PASS_TO_PASS": []}, "nothing could be graded"),
        ({"FAIL_TO_PASS": "not json"}, "not a JSON list"),
        ({"repo_path": "r"}, "exactly one repository source"),
        ({"repo_files": {"../etc/passwd": "x"}}, "stay inside the repo"),
        ({"repo_files": None, "image_repo_dir": "/testbed"}, "needs 'image'"),
        ({"test_patch": "garbage"}, "not a usable unified diff"),
    ]:
        with pytest.raises(DatasetError, match=message):
            SweTask.from_dict({**BASE, **bad})


def test_task_files_report_the_row_and_duplicate_ids(tmp_path) -> None:
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(BASE) + "\n" + json.dumps({**BASE, "instance_id": ""}) + "\n")
    with pytest.raises(DatasetError, match="row 2"):
        load_tasks(path)
    path.write_text(json.dumps(BASE) + "\n" + json.dumps(BASE) + "\n")
    with pytest.raises(DatasetError, match="more than once"):
        load_tasks(path)


def test_rows_carry_instances_both_ways() -> None:
    task = SweTask.from_dict(BASE)
    row = task_row(task)
    assert check_row(row) is None  # a valid verl row for the data loader
    assert row_task(row) == task
    assert row_task(dict(BASE)) == task  # a bare SWE-bench instance works as a row too
    with pytest.raises(DatasetError, match="holds no SWE instance"):
        row_task({"prompt": "hi"})


def test_shipped_tasks_are_complete_and_keep_their_tests_hidden() -> None:
    tasks = shipped_tasks()
    assert len(tasks) >= 20
    assert len({t.instance_id for t in tasks}) == len(tasks)
    for t in tasks:
        assert t.fail_to_pass and t.pass_to_pass and t.patch and t.test_patch and t.repo_files
        visible = "".join(t.repo_files.values())
        for test_id in t.fail_to_pass:  # the tests that catch the bug are not in the repository
            assert test_id.rsplit("::", 1)[-1] not in visible, (t.instance_id, test_id)
        for fp in parse_patch(t.patch):  # the reference fix touches source only, never tests
            assert not fp.path.startswith("tests/")
            assert apply_patch(t.repo_files[fp.path], fp) != t.repo_files[fp.path]


def test_verdicts_and_partial_credit() -> None:
    task = SweTask.from_dict({**BASE, "FAIL_TO_PASS": ["t::a", "t::b"], "PASS_TO_PASS": ["t::c"]})
    ok = _verdict(task, {"t::a": "PASSED", "t::b": "PASSED", "t::c": "PASSED"}, False, "")
    assert (ok.resolved, ok.reward) == (True, 1.0)
    half = {"t::a": "PASSED", "t::b": "FAILED", "t::c": "PASSED"}
    assert _verdict(task, half, False, "").reward == 0.0
    assert _verdict(task, half, True, "").reward == 0.5
    assert _verdict(task, {**half, "t::c": "FAILED"}, True, "").reward == 0.0  # broke a passing test
    missing = _verdict(task, {"t::a": "PASSED"}, False, "")
    assert missing.statuses == {"t::a": "PASSED", "t::b": "MISSING", "t::c": "MISSING"}


def test_pytest_logs_are_parsed() -> None:
    log = ("tests/t.py::test_a PASSED\n"
           "=== short test summary info ===\n"
           "PASSED tests/t.py::test_a\nFAILED tests/t.py::test_b - AssertionError: x\n"
           "XFAIL tests/t.py::test_c\nERROR tests/t.py::K::test_d\n")
    assert parse_pytest_log(log) == {"tests/t.py::test_a": "PASSED", "tests/t.py::test_b": "FAILED",
                                     "tests/t.py::test_c": "PASSED", "tests/t.py::K::test_d": "ERROR"}


def test_eval_report_gives_a_resolved_rate_over_valid_episodes() -> None:
    def traj(resolved: float | None, fault: str | None = None) -> Trajectory:
        t = Trajectory(reward=resolved or 0.0, fault=fault)  # type: ignore[arg-type]
        if resolved is not None:
            t.metrics["resolved"] = resolved
        return t

    config = AgentRLConfig.model_validate({"env": {"name": "swe"}})
    groups = [[traj(1.0)], [traj(0.0)], [traj(None)], [traj(None, "infra")]]
    report = summarise(config, groups, 1.0)
    assert report.resolved_rate == pytest.approx(1 / 3)  # the ungraded episode counts, the infra one not
    assert "resolved 0.333" in report.summary()
    # the env class says it reports a resolved rate (build_job passes it): it is there even when nothing was graded
    assert summarise(config, [[traj(None)]], 1.0, reports_resolved=True).resolved_rate == 0.0
    assert summarise(config, [[traj(None, "infra")]], 1.0, reports_resolved=True).resolved_rate is None
    other = AgentRLConfig.model_validate({"env": {"name": "arithmetic"}})
    assert summarise(other, [[traj(None)]], 1.0).resolved_rate is None


def test_agentrl_swe_convert_writes_rows_and_refuses_an_unknown_format(
    tmp_path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from agentrl.cli import EXIT_USAGE, main
    from agentrl.envs.swe_formats import FORMATS

    instances, rows = tmp_path / "instances.jsonl", tmp_path / "rows.jsonl"
    instances.write_text(json.dumps(BASE) + "\n")
    assert main(["swe", "convert", str(instances), str(rows)]) == 0
    written = [row_task(json.loads(line)) for line in rows.read_text().splitlines()]
    assert written == [SweTask.from_dict(BASE, base_dir=tmp_path)]
    assert main(["swe", "check", str(instances), "--format", "swebench"]) == EXIT_USAGE
    assert "none of auto, " + ", ".join(FORMATS) in capsys.readouterr().err
    monkeypatch.setenv("COLUMNS", "500")  # help on one line per option

    def shown(*argv: str) -> str:
        with pytest.raises(SystemExit):
            main(list(argv))
        return capsys.readouterr().out

    assert "check     replay each instance's reference fix" in shown("swe", "--help")
    check_help = shown("swe", "check", "--help")
    assert "--report" in check_help and all(f in check_help for f in FORMATS)  # it names every format
