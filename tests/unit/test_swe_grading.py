"""`grade()` on fake sandbox sessions: whose fault a failed test run is.

A session killed under the tests, a test command that cannot start and a run SIGKILLed before any
test reported are infrastructure failures (`GradingError`, named by its cause); tests that ran and
failed, or a run killed after its tests reported, are scored as before. The real sandboxes are in
tests/integration/test_swe_env.py and test_swe_docker.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from agentrl.envs.swe_grading import (
    SANDBOX_KILLED,
    TEST_CMD_NOT_STARTED,
    TEST_RUN_KILLED,
    grade,
)
from agentrl.envs.swe_tasks import SweTask
from agentrl.errors import GradingError, SandboxError
from agentrl.orchestration.infra import fix_for
from agentrl.types import ExecResult

F2P, P2P = "tests/test_a.py::test_fixed", "tests/test_a.py::test_kept"
PASSING_LOG = f"===== test session starts =====\nPASSED {F2P}\nPASSED {P2P}\n"
FAILING_LOG = f"===== test session starts =====\nFAILED {F2P} - assert 1 == 2\nPASSED {P2P}\n"


def task(**kwargs: object) -> SweTask:
    fields: dict = {"instance_id": "demo__bug-1", "problem_statement": "it breaks", "fail_to_pass": (F2P,),
                    "pass_to_pass": (P2P,), "test_cmd": "pytest -rA {tests}"}
    return SweTask(**(fields | kwargs))


class FakeSession:
    """A session whose test command returns `result`; `dies` makes it stop answering after the run."""

    def __init__(self, result: ExecResult, *, dies: bool = False) -> None:
        self.result, self.dies, self.ran = result, dies, False
        self.commands: list[str] = []

    async def exec(self, command: str | None = None, *, timeout_s: float, **_: object) -> ExecResult:
        self.commands.append(command or "")
        if self.ran and self.dies:
            raise SandboxError("container is not running")
        if command == "true":
            return ExecResult("", "", 0)
        self.ran = True
        return self.result

    async def is_alive(self) -> bool:
        return not (self.ran and self.dies)

    async def read_file(self, path: str) -> bytes:
        raise FileNotFoundError(path)

    async def write_file(self, path: str, data: str | bytes) -> None:
        return None


def run_grade(result: ExecResult, *, dies: bool = False, **task_kwargs: object) -> object:
    return asyncio.run(grade(FakeSession(result, dies=dies), task(**task_kwargs), {}))


def raises_cause(cause: str, match: str) -> Callable[[Callable[[], object]], GradingError]:
    def check(fn: Callable[[], object]) -> GradingError:
        with pytest.raises(GradingError, match=match) as info:
            fn()
        assert info.value.cause == cause
        assert str(info.value).lower().startswith(cause + ":")  # the trajectory's error names the cause first
        assert isinstance(info.value, SandboxError)  # what the AgentLoop records as fault "infra"
        return info.value
    return check


def test_a_sandbox_killed_during_the_tests_is_an_infrastructure_failure_not_a_zero() -> None:
    killed = ExecResult("", "", -9, killed_reason="signal")  # `docker kill`: exit 137, reported as -9
    err = raises_cause(SANDBOX_KILLED, "stopped answering")(lambda: run_grade(killed, dies=True))
    assert "docker kill" in fix_for(str(err))
    raises_cause(SANDBOX_KILLED, "was closed")(lambda: run_grade(ExecResult("", "", None, killed_reason="closed")))


def test_a_test_run_oom_killed_before_any_test_reported_is_infra_but_after_it_is_scored() -> None:
    oom = ExecResult("===== test session starts =====\n", "", -9, killed_reason="memory")
    err = raises_cause(TEST_RUN_KILLED, "memory limit")(lambda: run_grade(oom))
    assert "demo__bug-1" in str(err)
    raises_cause(TEST_RUN_KILLED, "SIGKILL")(lambda: run_grade(ExecResult("", "", 137)))
    late = run_grade(ExecResult(f"{PASSING_LOG.splitlines()[0]}\nPASSED {P2P}\n", "", -9, killed_reason="memory"))
    assert (late.reward, late.statuses[F2P], late.statuses[P2P]) == (0.0, "MISSING", "PASSED")
    assert "memory" in late.note


@pytest.mark.parametrize(("exit_code", "stderr"), [
    (127, "sh: 1: pytest: not found"),
    (127, "/bin/bash: line 1: pytest: command not found"),
    (126, "bash: ./run_tests.sh: Permission denied"),
    (1, "EnvironmentNameNotFound: Could not find conda environment: testbed\n"),
    (1, "/opt/miniconda3/bin/python: No module named pytest"),
    (2, "python: can't open file '/testbed/tests/runtests.py': [Errno 2] No such file or directory"),
])
def test_a_test_command_that_cannot_start_is_an_infrastructure_failure(exit_code: int, stderr: str) -> None:
    err = raises_cause(TEST_CMD_NOT_STARTED, "could not start")(lambda: run_grade(ExecResult("", stderr, exit_code)))
    assert stderr.strip()[-40:] in str(err)
    assert "agentrl swe check" in fix_for(str(err))  # what a run that stops on it tells the user to do


def test_genuine_test_failures_still_score_zero() -> None:
    failed = run_grade(ExecResult(FAILING_LOG, "", 1))
    assert (failed.resolved, failed.reward, failed.statuses) == (False, 0.0, {F2P: "FAILED", P2P: "PASSED"})
    assert failed.note == ""
    passed = run_grade(ExecResult(PASSING_LOG, "", 0))
    assert (passed.resolved, passed.reward) == (True, 1.0)
    # The agent's code broke collection: the runner ran and reported an import error, not a missing runner.
    collect = ("===== test session starts =====\nE   FileNotFoundError: [Errno 2] No such file or directory: 'x'\n"
               "ERROR tests/test_a.py - FileNotFoundError\n")
    broken = run_grade(ExecResult(collect, "", 2))
    assert (broken.reward, set(broken.statuses.values())) == (0.0, {"MISSING"})
    # A test crashing the runner with its own signal (a segfault) is the agent's failure.
    crashed = run_grade(ExecResult("", "Fatal Python error: Segmentation fault", -11, killed_reason="signal"))
    assert crashed.reward == 0.0 and "signal" in crashed.note


def test_a_missing_module_inside_the_tests_is_the_agents_failure() -> None:
    log = ("===== test session starts =====\nE   ModuleNotFoundError: No module named 'textkit.slugs'\n"
           f"FAILED {F2P} - ModuleNotFoundError\nFAILED {P2P} - ModuleNotFoundError\n")
    assert run_grade(ExecResult(log, "", 1)).reward == 0.0


def test_agentrl_runner_in_a_killed_sandbox_is_infra() -> None:
    killed = ExecResult("", "", -9, killed_reason="signal")
    raises_cause(SANDBOX_KILLED, "stopped answering")(lambda: run_grade(killed, dies=True, test_cmd=None))
    raises_cause(TEST_RUN_KILLED, "SIGKILL")(lambda: run_grade(killed, test_cmd=None))
