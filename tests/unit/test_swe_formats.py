"""Published SWE rows read as they are: SWE-bench, SWE-Gym, SWE-smith, R2E-Gym; their test logs parsed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentrl.envs.patches import apply_patch, make_patch, parse_patch, reverse_patch
from agentrl.envs.swe_formats import detect_format
from agentrl.envs.swe_grading import (
    LOG_PARSERS,
    parse_django_log,
    parse_pytest_log,
    parse_r2e_log,
    parse_sympy_log,
)
from agentrl.envs.swe_tasks import LOG_PARSER_NAMES, SweTask, load_tasks, row_task, task_row
from agentrl.errors import DatasetError

TEST_PATCH = make_patch({"tests/test_a.py": "def test_old():\n    pass\n", "docs/x.md": "a\n"},
                        {"tests/test_a.py": "def test_old():\n    pass\n\n\ndef test_new():\n    pass\n",
                         "docs/x.md": "b\n"})
SWE_BENCH = {
    "repo": "astropy/astropy", "instance_id": "astropy__astropy-12907", "base_commit": "d16bfe05a744909de4b27f5875fe0d4ed41ce607",
    "patch": make_patch({"astropy/m.py": "x = 1\n"}, {"astropy/m.py": "x = 2\n"}), "test_patch": TEST_PATCH,
    "problem_statement": "Modeling's separability_matrix does not compute separability correctly", "hints_text": "",
    "created_at": "2022-03-03T15:14:54Z", "version": "4.3", "FAIL_TO_PASS": '["tests/test_a.py::test_new"]',
    "PASS_TO_PASS": '["tests/test_a.py::test_old"]', "environment_setup_commit": "298ccb478e6bf092953bca67a3d29dc6c35f6752",
}


def test_swe_bench_rows_get_their_image_conda_env_and_test_command() -> None:
    task = SweTask.from_dict(SWE_BENCH)
    assert (task.format, task.image, task.image_repo_dir) == (
        "swe-bench", "swebench/sweb.eval.x86_64.astropy_1776_astropy-12907:latest", "/testbed")
    assert task.env_setup == "source /opt/miniconda3/bin/activate && conda activate testbed"
    assert task.test_cmd.endswith(" tests/test_a.py") and task.test_cmd.startswith("pytest -rA")  # docs/x.md is no test
    assert (task.log_parser, task.fail_to_pass, task.pass_to_pass) == ("pytest", ("tests/test_a.py::test_new",),
                                                                       ("tests/test_a.py::test_old",))
    assert task.extra["base_commit"] == SWE_BENCH["base_commit"] and task.extra["version"] == "4.3"
    local = SweTask.from_dict(SWE_BENCH, image_namespace="")
    assert local.image == "sweb.eval.x86_64.astropy_1776_astropy-12907:latest"  # built by SWE-bench's harness
    again = row_task(task_row(task))
    assert again == SweTask.from_dict(task.to_dict()) and again.test_cmd == task.test_cmd  # rows round-trip


def test_django_rows_run_test_modules_with_the_django_runner() -> None:
    patch = make_patch({}, {"tests/migrations/test_operations.py": "x\n", "tests/admin_views/tests.py": "y\n"})
    row = {**SWE_BENCH, "repo": "django/django", "instance_id": "django__django-11099", "test_patch": patch,
           "FAIL_TO_PASS": '["test_foo (migrations.test_operations.OperationTests)"]', "PASS_TO_PASS": "[]"}
    task = SweTask.from_dict(row)
    assert task.test_cmd.endswith("--verbosity 2 --settings=test_sqlite --parallel 1 admin_views.tests "
                                  "migrations.test_operations")
    assert task.log_parser == "django" and "LANG=en_US.UTF-8" in task.test_cmd


def test_swe_gym_rows_use_their_image_names_and_test_files() -> None:
    row = {**SWE_BENCH, "repo": "getmoto/moto", "instance_id": "getmoto__moto-5406",
           "FAIL_TO_PASS": '["tests/test_ec2.py::test_x", "tests/test_s3.py::TestS3::test_y[a]"]'}
    task = SweTask.from_dict(row)
    assert (task.format, task.image) == ("swe-gym", "xingyaoww/sweb.eval.x86_64.getmoto_s_moto-5406:latest")
    assert task.test_cmd.endswith("tests/test_a.py tests/test_ec2.py tests/test_s3.py")


def test_swe_smith_rows_start_from_the_bug_and_hide_their_failing_tests() -> None:
    clean = {"pkg/m.py": "def f():\n    return 1\n"}
    bug = make_patch(clean, {"pkg/m.py": "def f():\n    return 2\n"})
    row = {"instance_id": "oauthlib__oauthlib.1fd52536.func_basic__abc", "repo": "swesmith/oauthlib__oauthlib.1fd52536",
           "patch": bug, "problem_statement": "f() returns 2",
           "FAIL_TO_PASS": ["tests/test_m.py::test_f"], "PASS_TO_PASS": ["tests/test_m.py::test_g", "tests/other.py::test_h"],
           "image_name": "jyangballin/swesmith.x86_64.oauthlib__oauthlib.1fd52536"}
    task = SweTask.from_dict(row)
    assert (task.format, task.image) == ("swe-smith", "jyangballin/swesmith.x86_64.oauthlib_1776_oauthlib.1fd52536:latest")
    assert (task.start_patch, task.hidden_files, task.pass_to_pass) == (bug, ("tests/test_m.py",), ("tests/test_m.py::test_g",))
    assert task.test_cmd == "pytest --disable-warnings --color=no --tb=no --verbose tests/test_m.py"
    buggy = apply_patch(clean["pkg/m.py"], parse_patch(bug)[0])
    assert apply_patch(buggy, parse_patch(task.patch)[0]) == clean["pkg/m.py"]  # the fix is the bug reversed
    assert SweTask.from_dict({**row, "image_name": "swesmith.x86_64.a__b.1"}).image == "jyangballin/swesmith.x86_64.a_1776_b.1:latest"


def test_r2e_gym_rows_take_their_fix_from_the_commit_and_grade_the_expected_passes() -> None:
    parsed = {"file_diffs": [
        {"old_file": {"path": "aiohttp/web.py"}, "new_file": {"path": "aiohttp/web.py"},
         "hunks": [{"descriptor": {"old_range": {"start": 1, "length": 2}, "new_range": {"start": 1, "length": 2}},
                    "line_group": {"pre_context_lines": [{"content": "a = 1"}], "left_lines": [{"content": "b = 1"}],
                                   "right_lines": [{"content": "b = 2"}], "post_context_lines": []}}]},
        {"old_file": {"path": "tests/test_web.py"}, "new_file": {"path": "tests/test_web.py"}, "hunks": []}]}
    row = {"repo_name": "aiohttp", "docker_image": "namanjain12/aiohttp_final:f0d74880deec8fcd982bce639c93c5e130d41198",
           "commit_hash": "f0d74880deec8fcd982bce639c93c5e130d41198", "parsed_commit_content": json.dumps(parsed),
           "problem_statement": "[ISSUE]\nThe web app sets b wrong.\n[/ISSUE]",
           "expected_output_json": json.dumps({"TestWeb.test_b": "PASSED", "test_c": "PASSED", "test_d": "FAILED"})}
    assert detect_format(row) == "r2e-gym"
    task = SweTask.from_dict(row)
    assert (task.instance_id, task.image, task.problem_statement) == (
        "aiohttp__f0d74880deec", row["docker_image"], "The web app sets b wrong.")
    assert (task.fail_to_pass, task.log_parser) == (("TestWeb.test_b", "test_c"), "r2e")
    assert [fp.path for fp in parse_patch(task.patch)] == ["aiohttp/web.py"]  # the test file is not the fix
    assert apply_patch("a = 1\nb = 1\n", parse_patch(task.patch)[0]) == "a = 1\nb = 2\n"
    assert "mv /r2e_tests /root/r2e_tests" in task.setup_cmd and "bash /root/run_tests.sh" in task.test_cmd


def test_rows_in_no_known_format_and_broken_rows_say_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="in no SWE format agentrl knows"):
        SweTask.from_dict({"instance_id": "x", "problem_statement": "p"})
    with pytest.raises(DatasetError, match="needs the field 'FAIL_TO_PASS'|FAIL_TO_PASS and PASS_TO_PASS are both empty"):
        SweTask.from_dict({k: v for k, v in SWE_BENCH.items() if k not in ("FAIL_TO_PASS", "PASS_TO_PASS")})
    with pytest.raises(DatasetError, match="log_parser 'nose' is not one of"):
        SweTask.from_dict({"instance_id": "x", "problem_statement": "p", "FAIL_TO_PASS": ["t.py::a"],
                           "repo_files": {"t.py": ""}, "log_parser": "nose"})
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "verified.parquet"
    pq.write_table(pa.Table.from_pylist([SWE_BENCH, {**SWE_BENCH, "instance_id": "astropy__astropy-2", "FAIL_TO_PASS": "not json"}]), path)
    with pytest.raises(DatasetError, match=r"verified\.parquet, row 2: .*astropy__astropy-2"):
        load_tasks(path)
    pq.write_table(pa.Table.from_pylist([SWE_BENCH]), path)
    assert [t.instance_id for t in load_tasks(path)] == ["astropy__astropy-12907"]


def test_reverse_patch_undoes_edits_creations_and_deletions() -> None:
    before = {"a.py": "".join(f"{i}\n" for i in range(20)), "gone.py": "bye\n"}
    after = {"a.py": before["a.py"].replace("3\n", "three\n").replace("15\n", "15\nnew\n"), "new.py": "hi"}
    files = dict(after)
    for fp in parse_patch(reverse_patch(make_patch(before, after))):
        result = apply_patch(files.get(fp.old_path) if fp.old_path else None, fp)
        if fp.old_path and result is None:
            del files[fp.old_path]
        elif result is not None:
            files[fp.path] = result
    assert files == before


def test_each_log_format_is_parsed() -> None:
    assert set(LOG_PARSERS) == set(LOG_PARSER_NAMES)
    assert parse_pytest_log("\x1b[32mPASSED\x1b[0m t.py::test_a\nFAILED t.py::test_b - assert 0\n"
                            "t.py::C::test_c[x-1] PASSED [ 50%]\nXFAIL t.py::test_d\n") == {
        "t.py::test_a": "PASSED", "t.py::test_b": "FAILED", "t.py::C::test_c[x-1]": "PASSED", "t.py::test_d": "PASSED"}
    django = ("test_a (app.tests.T) ... ok\ntest_b (app.tests.T) ... FAIL\ntest_c (app.tests.T) ... skipped 'no'\n"
              "test_d (app.tests.T) ... Creating table\nok\ntest_e (app.tests.T.test_e) ... ERROR\n"
              "test_f (app.tests.T) ... expected failure\n")
    assert parse_django_log(django) == {"test_a (app.tests.T)": "PASSED", "test_b (app.tests.T)": "FAILED",
                                        "test_c (app.tests.T)": "SKIPPED", "test_d (app.tests.T)": "PASSED",
                                        "test_e (app.tests.T.test_e)": "ERROR", "test_f (app.tests.T)": "PASSED"}
    assert parse_sympy_log("test_one ok\ntest_two F\ntest_three E\n") == {
        "test_one": "PASSED", "test_two": "FAILED", "test_three": "ERROR"}
    assert parse_r2e_log("== short test summary info ==\nPASSED r2e_tests/t.py::TestX::test_a\n"
                         "FAILED r2e_tests/t.py::test_b - AssertionError\n") == {"TestX.test_a": "PASSED", "test_b": "FAILED"}
