"""The objectives that learn from rows have their own commands: `agentrl run` refuses them, naming the one to use."""

from __future__ import annotations

import pytest

from agentrl.cli import EXIT_ERROR, main


@pytest.mark.parametrize(("objective", "command"), [("sft", "sft"), ("dpo", "dpo"), ("ipo", "dpo")])
def test_run_refuses_an_objective_that_learns_from_rows(capsys: pytest.CaptureFixture[str], objective: str,
                                                        command: str) -> None:
    assert main(["validate", "env=arithmetic", f"algorithm.objective={objective}"]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert f"algorithm.objective={objective} trains on rows, not on the environment's rewards" in err
    assert f"run it with 'agentrl {command}'" in err
