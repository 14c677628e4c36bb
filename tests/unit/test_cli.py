"""The command line: exit statuses and what each subcommand prints."""

from __future__ import annotations

import pytest

from agentrl.cli import EXIT_ERROR, EXIT_USAGE, main


def test_envs_and_tools_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["envs", "list"]) == 0
    assert "arithmetic  Multi-step arithmetic" in capsys.readouterr().out.splitlines()[1]
    assert main(["tools", "list"]) == 0
    assert "calculator" in capsys.readouterr().out


def test_validate_prints_every_error_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "env=arithmetic", "trainer.lrr=1", "rollout.max_turns=x"]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert "The config has 2 error(s)" in err
    assert "trainer.lrr: unknown key. Did you mean 'trainer.lr'?" in err
    assert "rollout.max_turns:" in err


def test_validate_accepts_a_good_config_and_shows_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "arithmetic", "trainer.lr=2e-6", "--show"]) == 0
    out = capsys.readouterr().out
    assert "lr: 2.0e-06" in out and "name: arithmetic" in out


def test_config_reference_lists_fields_with_their_docs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "trainer"]) == 0
    out = capsys.readouterr().out
    assert "trainer.lr (float, default 1e-06)\n    Learning rate of the policy (AdamW)." in out
    assert main(["config", "trainr"]) == EXIT_ERROR
    assert "Did you mean 'trainer'?" in capsys.readouterr().err


def test_run_and_plot_refuse_bad_input_before_starting_anything(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "env=retool", "trainer.lrr=1e-6"]) == EXIT_ERROR
    assert "Did you mean 'trainer.lr'?" in capsys.readouterr().err
    assert main(["run", "env=retool", "resume=true", f"run.output_dir={tmp_path}"]) == EXIT_ERROR
    assert "give run.name" in capsys.readouterr().err
    assert main(["run", "env=retool", "resume=true", "run.name=nothing", f"run.output_dir={tmp_path}"]) == EXIT_ERROR
    assert "holds no checkpoint" in capsys.readouterr().err
    assert main(["plot", str(tmp_path / "no-run")]) == EXIT_ERROR
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == EXIT_USAGE
    with pytest.raises(SystemExit) as info:
        main(["nonsense"])
    assert info.value.code == 2


def test_view_refuses_what_is_not_a_run(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["view", str(tmp_path / "nope")]) == EXIT_ERROR
    assert "does not exist" in capsys.readouterr().err
    assert main(["view", str(tmp_path)]) == EXIT_ERROR
    assert "holds no run" in capsys.readouterr().err


def test_keep_rollouts_takes_all_or_a_count(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "env=arithmetic", "run.keep_rollouts=all", "--show"]) == 0
    assert "keep_rollouts: all" in capsys.readouterr().out
    assert main(["validate", "env=arithmetic", "run.keep_rollouts=-2"]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert "run.keep_rollouts" in err and "0 keeps none" in err


@pytest.mark.parametrize("command", ["run", "eval"])
def test_run_and_eval_without_arguments_print_usage(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([command]) == EXIT_USAGE  # and nothing starts
    err = capsys.readouterr().err
    assert err.startswith(f"usage: agentrl {command} [CONFIG] key=value ...")
    assert f"agentrl {command} env=retool" in err
    assert "presets:       arithmetic, retool, swe" in err


def test_eval_progress_lines_on_a_pipe(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from agentrl.cli import _EvalProgressLine

    show = _EvalProgressLine(every_s=3600.0)
    assert not show.tty  # pytest captures stderr
    show(0, 8, 0.0)
    show(2, 8, 10.0)  # within every_s of the last line: not shown
    show(8, 8, 40.0)  # the last one always is
    assert capsys.readouterr().err.splitlines() == [
        "eval: 0/8 episodes done, 0 s elapsed", "eval: 8/8 episodes done, 40 s elapsed"]
    show = _EvalProgressLine(every_s=0.0)
    show(2, 8, 10.0)
    assert capsys.readouterr().err == "eval: 2/8 episodes done, 10 s elapsed, about 30 s to go\n"


def test_validate_refuses_a_resume_that_does_not_match_its_run(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    from agentrl.config import load_config
    from agentrl.orchestration.run_identity import run_identity, write_identity

    run_dir = tmp_path / "r"
    (run_dir / "checkpoints" / "step-000001").mkdir(parents=True)  # validate does not verify it
    write_identity(run_dir, run_identity(load_config("arithmetic", [])))
    common = ["validate", "arithmetic", "resume=true", "run.name=r", f"run.output_dir={tmp_path}"]
    assert main([*common, "run.seed=7"]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert "run.seed: 0 -> 7" in err and "run.resume_allow=[run.seed]" in err
    assert main([*common, "run.seed=7", "run.resume_allow=[run.seed]"]) == 0
    assert f"resume: {run_dir} matches this config" in capsys.readouterr().out
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints", "run_identity.json"], "validate writes nothing"
