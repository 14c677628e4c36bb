"""Grading a SWE episode: hidden tests copied into the agent's sandbox session, run, and judged.

`grade` is called once per episode, when the agent submits or its budget is spent. It restores
every file the instance's `test_patch` touches, and every test file hidden from the agent, to its
pristine content (read at reset, so edits the agent made to those tests do not count), applies
the patch on the host, writes the results into the session, and runs the tests there: with
agentrl's own runner (`RUNNER`, a small script for any Python from 3.6 on that imports each test
file and calls each test function or unittest method under a per-test alarm, so a hanging test
fails alone) or with the instance's `test_cmd`, whose log is read by the instance's `log_parser`
(`LOG_PARSERS`: pytest `-rA`/`-v`, unittest and Django's runner at `--verbosity 2`, sympy's
`bin/test`, R2E-Gym's test names). A test that does not report PASSED fails.

Whose fault: the agent's code failing, hanging past its per-test limit, crashing the runner or
filling the disk is a failed test (reward 0). These are infrastructure failures, for either runner:
the session dying or the sandbox not answering after the run (`docker kill`, a daemon restart: "the
sandbox was killed during grading"); the run killed by SIGKILL or the memory limit before any of
the instance's tests reported (an OOM kill: "the test run was killed during grading"); the test
command not starting (exit 126/127, or none of the tests reported and the log has a shell's "not
found" / "No such file or directory", `python: No module named pytest` or a missing conda env,
before any runner banner: "the test command could not start"); and agentrl's runner passing its
deadline although each test has its own limit. `grade` then raises `GradingError` (a
`SandboxError`) whose `cause` is that phrase; the AgentLoop records the episode as fault "infra"
with the message as its error, so the trainer masks it and `agentrl eval` counts it, and `agentrl
swe check` reports the cause. With a custom `test_cmd` (no per-test limit) a run past the deadline
in a sandbox that still answers counts as the agent's failure, as in SWE-bench.

Not a defence against reward hacking by code in the test process itself (it shares the runner's
interpreter and could forge results); the hidden tests are kept from the agent, not from its code.
"""

from __future__ import annotations

import json
import re
import shlex
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from agentrl.envs.patches import apply_patch, parse_patch
from agentrl.envs.swe_tasks import SweTask
from agentrl.errors import GradingError, SandboxError
from agentrl.types import ExecResult

__all__ = [
    "LOG_PARSERS",
    "RUNNER",
    "SANDBOX_KILLED",
    "TESTS_TIMED_OUT",
    "TEST_CMD_NOT_STARTED",
    "TEST_RUN_KILLED",
    "Grade",
    "grade",
    "parse_django_log",
    "parse_pytest_log",
    "parse_r2e_log",
    "parse_sympy_log",
    "pristine_test_files",
]

SANDBOX_KILLED = "the sandbox was killed during grading"
TEST_RUN_KILLED = "the test run was killed during grading"
TEST_CMD_NOT_STARTED = "the test command could not start"
TESTS_TIMED_OUT = "the hidden tests ran past their deadline"

PASSED = "PASSED"

RUNNER = r'''
"""agentrl's hidden-test runner: python runner.py < config.json; one JSON line per test to `out`."""
import importlib.util, io, json, os, signal, sys, traceback, unittest
cfg = json.loads(sys.stdin.read())
sys.stdin = io.StringIO("")
root = os.getcwd()
sys.path.insert(0, root)
class _Timeout(BaseException):
    pass
def _alarm(signum, frame):
    raise _Timeout()
signal.signal(signal.SIGALRM, _alarm)
modules = {}
def load(path):
    if path not in modules:
        name = "agentrl_test_" + "".join(c if c.isalnum() else "_" for c in path)
        spec = importlib.util.spec_from_file_location(name, os.path.join(root, path))
        if spec is None:
            raise ImportError("cannot import " + path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        modules[path] = mod
    return modules[path]
def run(test_id):
    parts = test_id.split("::")
    obj = load(parts[0])
    owner = None
    for p in parts[1:]:
        owner, obj = obj, getattr(obj, p)
    if isinstance(owner, type) and issubclass(owner, unittest.TestCase):
        result = unittest.TestResult()
        owner(parts[-1]).run(result)
        if result.failures:
            return "FAILED", result.failures[0][1]
        if result.errors:
            return "ERROR", result.errors[0][1]
        if result.skipped:
            return "SKIPPED", result.skipped[0][1]
        return "PASSED", ""
    if isinstance(owner, type):
        obj = getattr(owner(), parts[-1])
    obj()
    return "PASSED", ""
devnull = open(os.devnull, "w")
with open(cfg["out"], "w") as out:
    for test_id in cfg["tests"]:
        status, detail = "ERROR", ""
        real_out, real_err = sys.stdout, sys.stderr
        sys.stdout = sys.stderr = devnull
        try:
            signal.setitimer(signal.ITIMER_REAL, cfg["per_test_timeout_s"])
            try:
                status, detail = run(test_id)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except _Timeout:
            status, detail = "TIMEOUT", "the test ran past %s s" % cfg["per_test_timeout_s"]
        except AssertionError:
            status, detail = "FAILED", traceback.format_exc()
        except BaseException:
            status, detail = "ERROR", traceback.format_exc()
        finally:
            sys.stdout, sys.stderr = real_out, real_err
        out.write(json.dumps({"test": test_id, "status": status, "detail": detail[-1500:]}) + "\n")
        out.flush()
'''

_RUN_RUNNER = ('py=$(command -v python3 || command -v python) || {{ echo "no python3 or python on PATH" >&2; exit 127; }}; '
               'exec "$py" -B {runner}')
_PYTEST_LINE = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED)\s+(\S+::\S+)")
_PYTEST_VERBOSE = re.compile(r"^(\S+::\S+)\s+(PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED)\b")


@dataclass
class Grade:
    """The verdict on one episode's repository."""

    resolved: bool
    reward: float
    statuses: dict[str, str] = field(default_factory=dict)
    fail_to_pass_passed: int = 0
    fail_to_pass_total: int = 0
    pass_to_pass_passed: int = 0
    pass_to_pass_total: int = 0
    note: str = ""

    def info(self) -> dict[str, Any]:
        """What the step's info reports (`info["swe"]`)."""
        return asdict(self)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def parse_pytest_log(log: str) -> dict[str, str]:
    """Test id -> status from pytest output (`-rA` summary lines or `-v` lines)."""
    statuses: dict[str, str] = {}
    for line in _ANSI.sub("", log).splitlines():
        m = _PYTEST_LINE.match(line.strip())
        if m:
            statuses[m.group(2)] = m.group(1)
            continue
        m = _PYTEST_VERBOSE.match(line.strip())
        if m:
            statuses.setdefault(m.group(1), m.group(2))
    return {k: (PASSED if v == "XFAIL" else v) for k, v in statuses.items()}


def parse_django_log(log: str) -> dict[str, str]:
    """Test id -> status from unittest `-v` / Django `runtests.py --verbosity 2` output.

    Ids as SWE-bench writes them: `test_name (module.Class)` (or `(module.Class.test_name)` from
    Python 3.11 on). A test whose "... ok" lands on a later line (it printed in between) passes.
    """
    verdicts = {"ok": PASSED, "OK": PASSED, "FAIL": "FAILED", "ERROR": "ERROR", "expected failure": PASSED,
                "unexpected success": "FAILED"}
    statuses: dict[str, str] = {}
    pending = None
    for raw in _ANSI.sub("", log).splitlines():
        line = raw.strip()
        if " ... " in line:
            pending = line.split(" ... ", 1)[0]
            name, verdict = line.rsplit(" ... ", 1)
            verdict = verdict.strip()
            if verdict in verdicts:
                statuses[name] = verdicts[verdict]
            elif verdict.startswith("skipped"):
                statuses[pending] = "SKIPPED"
        elif line.startswith(("FAIL: ", "ERROR: ")):
            statuses[line.split(": ", 1)[1].strip()] = "FAILED" if line.startswith("FAIL") else "ERROR"
        elif line == "ok" and pending is not None:
            statuses[pending] = PASSED  # the test printed something between "..." and "ok"
    return statuses


def parse_sympy_log(log: str) -> dict[str, str]:
    """Test name -> status from sympy's `bin/test --verbose` output (`test_name ok`, `E`, `F`)."""
    statuses: dict[str, str] = {}
    for m in re.finditer(r"(_*) (.*)\.py:(.*) (_*)", log):
        statuses[f"{m.group(2)}.py:{m.group(3)}"] = "FAILED"
    for raw in _ANSI.sub("", log).splitlines():
        line = raw.strip()
        if not line.startswith("test_"):
            continue
        name = line.split()[0]
        if line.endswith(" ok"):
            statuses[name] = PASSED
        elif line.endswith(" E"):
            statuses[name] = "ERROR"
        elif line.endswith(" F"):
            statuses[name] = "FAILED"
    return statuses


def parse_r2e_log(log: str) -> dict[str, str]:
    """R2E-Gym's test names (`Class.test` or `test`, no file) -> status, from a pytest `-rA` summary."""
    text = _ANSI.sub("", log)
    if "short test summary info" not in text:
        return {}
    statuses: dict[str, str] = {}
    for line in text.split("short test summary info", 1)[1].splitlines():
        for status in ("PASSED", "FAILED", "ERROR"):
            if line.startswith(status + " ") and "::" in line:
                name = ".".join(line.split(None, 1)[1].split("::")[1:]).split(" - ")[0].strip()
                statuses[name] = status
                break
    return statuses


LOG_PARSERS = {
    "pytest": parse_pytest_log,
    "unittest": parse_django_log,
    "django": parse_django_log,
    "sympy": parse_sympy_log,
    "r2e": parse_r2e_log,
}
"""Test-log parsers by the name an instance's `log_parser` gives."""


async def pristine_test_files(session: Any, task: SweTask) -> dict[str, str | None]:
    """The content of every file the test patch touches, as it is now (None: absent). Call at reset."""
    out: dict[str, str | None] = {}
    paths = [(fp.path, fp.old_path or fp.path) for fp in parse_patch(task.test_patch)] if task.test_patch else []
    for target, source in [*paths, *((p, p) for p in task.hidden_files)]:
        try:
            out[target] = (await session.read_file(source)).decode("utf-8", errors="surrogateescape")
        except FileNotFoundError:
            out[target] = None
    return out


async def _answers(session: Any) -> bool:
    try:
        if not await session.is_alive():
            return False
        probe = await session.exec("true", timeout_s=15)
    except SandboxError:
        return False
    return probe.exit_code == 0 and probe.killed_reason is None


# A shell, `python -m` or conda saying the runner itself is missing (not a test's own error text).
_NOT_FOUND = re.compile(
    r"^(?:\S+: )?(?:line \d+: |\d+: )?\S+: (?:command )?not found$"
    r"|^(?:\S+: )?(?:line \d+: |\d+: )?\S+: No such file or directory$"
    r"|^\S*python[\d.]*: (?:can't open file .*No such file or directory|No module named \S+)$"
    r"|EnvironmentNameNotFound|Could not find conda environment|^(?:\S+: )?(?:line \d+: |\d+: )?\S+: Permission denied$",
    re.M,
)
# Banners a test runner prints once it runs (pytest, unittest / Django, sympy): it started.
_STARTED = re.compile(r"test session starts|^Ran \d+ tests? in |^Testing against Django|test process starts", re.M)


def _sigkilled(result: ExecResult) -> bool:
    return result.killed_reason == "memory" or (result.killed_reason in (None, "signal")
                                                 and result.exit_code in (-9, 137))


def _how(result: ExecResult) -> str:
    if result.killed_reason == "memory":
        return "killed at the sandbox's memory limit"
    if result.exit_code in (-9, 137):
        return "killed by SIGKILL"
    return result.killed_reason or f"exit code {result.exit_code}"


async def _check_run(session: Any, task: SweTask, result: ExecResult, reported: int, log: str, what: str) -> None:
    """Raise `GradingError` when the test run failed for a reason that is not the agent's (see the module doc).

    `reported`: how many of the task's tests have a status; `log`: what the run printed.
    """
    iid = task.instance_id
    if result.killed_reason == "closed":
        raise GradingError(f"The sandbox was killed during grading: the session of {iid} was closed while its "
                           "hidden tests ran; the episode is not scored.", SANDBOX_KILLED)
    troubled = (result.timed_out or result.killed_reason is not None or result.exit_code is None
                or not 0 <= result.exit_code < 126 or reported < len(task.tests))
    if troubled and not await _answers(session):
        raise GradingError(
            f"The sandbox was killed during grading: the sandbox of {iid} stopped answering after its hidden tests "
            f"ran ({_how(result)}); the episode is not scored. Check the sandbox backend (for docker: the daemon's "
            "log, OOM kills, `docker kill`).", SANDBOX_KILLED)
    if result.exit_code is None and not result.timed_out and result.killed_reason is None:
        raise GradingError(f"The sandbox was killed during grading: it gave no exit status for the hidden tests "
                           f"of {iid}; the episode is not scored.", SANDBOX_KILLED)
    if reported:
        return
    if _sigkilled(result):
        raise GradingError(
            f"The test run was killed during grading: the {what} of {iid} was {_how(result)} before any of its "
            "tests reported; the episode is not scored. If the tests need more memory, raise the sandbox's memory "
            "limit.", TEST_RUN_KILLED)
    if not _STARTED.search(log) and (result.exit_code in (126, 127) or _NOT_FOUND.search(log)):
        tail = log.strip()[-300:]
        raise GradingError(
            f"The test command could not start: the {what} of {iid} exited {result.exit_code} in its sandbox: "
            f"{tail!r}. Check the instance's test_cmd and env_setup against its image (`agentrl swe check`).",
            TEST_CMD_NOT_STARTED)


def _verdict(task: SweTask, statuses: dict[str, str], partial: bool, note: str) -> Grade:
    f2p = sum(statuses.get(t) == PASSED for t in task.fail_to_pass)
    p2p = sum(statuses.get(t) == PASSED for t in task.pass_to_pass)
    resolved = f2p == len(task.fail_to_pass) and p2p == len(task.pass_to_pass)
    if resolved:
        reward = 1.0
    elif partial and task.fail_to_pass and p2p == len(task.pass_to_pass):
        reward = f2p / len(task.fail_to_pass)  # a fix that breaks a passing test earns nothing
    else:
        reward = 0.0
    return Grade(resolved, reward, {t: statuses.get(t, "MISSING") for t in task.tests}, f2p,
                 len(task.fail_to_pass), p2p, len(task.pass_to_pass), note)


async def grade(
    session: Any,
    task: SweTask,
    pristine: dict[str, str | None],
    *,
    partial_credit: bool = False,
    timeout_s: float = 300.0,
    per_test_timeout_s: float = 20.0,
) -> Grade:
    """Run `task`'s hidden tests in `session` and judge them (see the module docstring)."""
    if not await session.is_alive():
        raise SandboxError(f"The sandbox session of {task.instance_id} died before grading; the episode is not scored.")
    writes: list[tuple[str, str | None]] = [(p, pristine.get(p)) for p in task.hidden_files if pristine.get(p) is not None]
    if task.test_patch:
        for fp in parse_patch(task.test_patch):
            writes.append((fp.path, apply_patch(pristine.get(fp.path), fp)))
    nonce = uuid.uuid4().hex[:12]
    runner, results = f".agentrl_runner_{nonce}.py", f".agentrl_results_{nonce}.jsonl"
    if task.test_cmd is None:
        writes.append((runner, RUNNER))
    for path, text in writes:
        try:
            if text is None:
                await session.exec(f"rm -f -- {shlex.quote(path)}", timeout_s=30)
            else:
                await session.write_file(path, text)
        except SandboxError:
            raise
        except (OSError, ValueError) as exc:
            if not await _answers(session):
                raise SandboxError(f"The sandbox stopped answering while the hidden tests were copied in: {exc}") from exc
            return _verdict(task, {}, partial_credit, f"the hidden test file {path} could not be written: {exc}")

    if task.test_cmd is not None:
        command = task.test_cmd.replace("{tests}", " ".join(shlex.quote(t) for t in task.tests))
        result = await session.exec(command, timeout_s=timeout_s)
        log = result.stdout + "\n" + result.stderr
        parsed = LOG_PARSERS[task.log_parser or "pytest"](log)
        await _check_run(session, task, result, sum(t in parsed for t in task.tests), log, "test command")
        if result.timed_out:
            note = f"the test command ran past {timeout_s:g} s"
        elif result.killed_reason is not None or (result.exit_code or 0) < 0:
            note = f"the test command was stopped ({_how(result)}); tests without a result count as failed"
        else:
            note = ""
        return _verdict(task, parsed, partial_credit, note)

    config = {"tests": list(task.tests), "out": results, "per_test_timeout_s": per_test_timeout_s}
    result = await session.exec(_RUN_RUNNER.format(runner=shlex.quote(runner)), stdin=json.dumps(config),
                                timeout_s=timeout_s)
    if (result.timed_out or result.killed_reason is not None) and not await _answers(session):
        raise GradingError(
            f"The sandbox was killed during grading: the sandbox of {task.instance_id} stopped answering after its "
            f"hidden tests ran ({_how(result)}); the episode is not scored.", SANDBOX_KILLED)
    if result.timed_out:
        raise GradingError(
            f"The hidden tests ran past their deadline: those of {task.instance_id} did not finish within "
            f"{timeout_s:g} s although each test "
            f"stops at {per_test_timeout_s:g} s: the sandbox is too slow or wedged. Raise test_timeout_s "
            "or give the sandbox more CPU.", TESTS_TIMED_OUT)
    try:
        raw = (await session.read_file(results)).decode("utf-8", errors="replace")
    except FileNotFoundError:
        raw = ""
    except (OSError, ValueError) as exc:
        raise SandboxError(f"The test results of {task.instance_id} could not be read back: {exc}") from exc
    statuses: dict[str, str] = {}
    for line in raw.splitlines():
        try:
            rec = json.loads(line)
            statuses[str(rec["test"])] = str(rec["status"])
        except (ValueError, KeyError, TypeError):
            continue  # a torn last line when the runner was killed mid-write
    if not statuses and result.exit_code in (126, 127):
        raise GradingError(
            f"The test command could not start: agentrl's test runner for {task.instance_id} exited "
            f"{result.exit_code}: {result.stderr.strip()[-300:]!r}. The sandbox needs a `python3` or `python` on PATH.",
            TEST_CMD_NOT_STARTED)
    await _check_run(session, task, result, sum(t in statuses for t in task.tests),
                     result.stdout + "\n" + result.stderr, "test runner")
    note = ""
    if len(statuses) < len(task.tests):
        why = result.killed_reason or f"exit code {result.exit_code}"
        note = f"the test runner stopped early ({why}); tests without a result count as failed"
    return _verdict(task, statuses, partial_credit, note)
