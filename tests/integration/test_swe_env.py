"""The SWE env in real bubblewrap sandboxes: every shipped task, grading, whose fault, budgets, eval.

Each shipped task is played twice through the env's tools: by a scripted agent applying the
reference fix (reward 1) and by one that submits at once (reward 0). The rest pins the promises of
`agentrl.envs.swe`: hidden tests restored from pristine copies, per-test limits, infrastructure
failures raised (and masked by the AgentLoop) instead of scored 0, budgets that grade, sessions
always closed, instances from directories, archives and pytest commands, and `agentrl eval`'s
resolved rate.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

from agentrl.envs import check_env
from agentrl.envs.swe import SweEnv, reference_fix_actions
from agentrl.envs.swe_tasks import SweTask, shipped_tasks, task_row
from agentrl.errors import SandboxError
from agentrl.types import Action, FinishReason, Generation, SamplingParams, ToolCall

REPO = Path(__file__).resolve().parents[2]
TASKS = {t.instance_id: t for t in shipped_tasks()}
SLUG = TASKS["textkit__slugify-separators"]


def call(name: str, **arguments: Any) -> Action:
    return Action(f"calling {name}", (ToolCall(name, arguments, id="c1"),))


SUBMIT = call("submit", summary="done")


def edit(path: str, old: str, new: str) -> Action:
    return call("str_replace_editor", command="str_replace", path=path, old_str=old, new_str=new)


async def play(env: SweEnv, task: SweTask, actions: list[Action]) -> tuple[float, bool, bool, dict]:
    await env.areset(options={"row": task_row(task)})
    for action in actions:
        _, reward, terminated, truncated, info = await env.astep(action)
        if terminated or truncated:
            return float(reward), terminated, truncated, info
    raise AssertionError("the episode did not end")


def run(coro_fn, env: SweEnv):  # type: ignore[no-untyped-def]
    async def body():  # type: ignore[no-untyped-def]
        try:
            return await coro_fn()
        finally:
            await env.aclose()

    return asyncio.run(body())


@pytest.mark.parametrize("instance_id", sorted(TASKS))
def test_reference_fix_resolves_and_doing_nothing_does_not(instance_id: str) -> None:
    task, env = TASKS[instance_id], SweEnv()

    async def both():  # type: ignore[no-untyped-def]
        return await play(env, task, reference_fix_actions(task)), await play(env, task, [SUBMIT])

    (fixed, term, _, info), (idle, _, _, idle_info) = run(both, env)
    assert (fixed, term, info["metrics"]["resolved"]) == (1.0, True, 1.0), info["swe"]
    assert set(info["swe"]["statuses"].values()) == {"PASSED"}
    assert info["swe"]["model_patch"].startswith("diff --git")
    assert (idle, idle_info["metrics"]["resolved"]) == (0.0, 0.0)
    failing = {t for t, s in idle_info["swe"]["statuses"].items() if s != "PASSED"}
    assert failing == set(task.fail_to_pass)  # the bug is caught by exactly its FAIL_TO_PASS tests


def test_swe_env_passes_check_env_with_tool_calls() -> None:
    actions = [call("bash", command="ls textkit && git status --short"), SUBMIT]
    check_env(SweEnv(), actions=actions, options={"row": task_row(SLUG)})


def test_hidden_tests_are_absent_until_grading_and_agent_edits_to_tests_do_not_count() -> None:
    env = SweEnv()
    cheat = "def test_runs_of_punctuation_collapse():\n    pass\n\n\ndef test_custom_separator_collapses():\n    pass\n"

    async def body():  # type: ignore[no-untyped-def]
        obs, _ = await env.areset(options={"row": task_row(SLUG)})
        seen, *_ = await env.astep(call("bash", command="grep -rc collapse tests || true; ls -a"))
        await env.astep(call("bash", command=f"printf '%s' {json.dumps(cheat)} > tests/test_slug.py"))
        _, reward, _, _, info = await env.astep(SUBMIT)
        return obs, seen[0]["content"], reward, info

    obs, listing, reward, info = run(body, env)
    assert "Hello,   World!" in obs[1]["content"] and "test_runs_of_punctuation_collapse" not in obs[1]["content"]
    assert listing.startswith("tests/test_slug.py:0") and ".agentrl" not in listing
    assert reward == 0.0  # the pristine tests plus the hidden patch ran, not the agent's version
    assert info["swe"]["statuses"]["tests/test_slug.py::test_simple_words"] == "PASSED"
    assert info["swe"]["statuses"]["tests/test_slug.py::test_runs_of_punctuation_collapse"] == "FAILED"


def test_partial_credit_counts_fail_to_pass_tests_unless_a_passing_test_broke() -> None:
    half = edit("textkit/slug.py", 'r"[^a-zA-Z0-9]"', 'r"[^a-zA-Z0-9]+"')  # collapses runs, keeps the ends
    env = SweEnv(partial_credit=True)

    async def body():  # type: ignore[no-untyped-def]
        partial = await play(env, SLUG, [half, SUBMIT])
        broke = await play(env, SLUG, [half, edit("textkit/slug.py", "return text\n", "return text.upper()\n"), SUBMIT])
        return partial, broke

    (partial, _, _, info), (broke, _, _, broke_info) = run(body, env)
    assert (partial, info["swe"]["resolved"], info["metrics"]["resolved"]) == (0.5, False, 0.0)
    assert broke == 0.0 and broke_info["swe"]["pass_to_pass_passed"] == 0


def test_a_hanging_fix_fails_its_tests_and_the_episode_is_scored() -> None:
    hang = edit("textkit/slug.py", '    text = unicodedata', '    while True:\n        pass\n    text = unicodedata')
    env = SweEnv(per_test_timeout_s=1.0)
    reward, terminated, _, info = run(lambda: play(env, SLUG, [hang, SUBMIT]), env)
    assert (reward, terminated) == (0.0, True)
    assert set(info["swe"]["statuses"].values()) == {"TIMEOUT"}


def test_a_test_run_past_its_deadline_is_an_infrastructure_failure_and_the_session_is_closed() -> None:
    hang = edit("textkit/slug.py", '    text = unicodedata', '    import time\n    time.sleep(60)\n    text = unicodedata')
    env = SweEnv(per_test_timeout_s=30.0, test_timeout_s=2.0)

    async def body():  # type: ignore[no-untyped-def]
        await env.areset(options={"row": task_row(SLUG)})
        session = env._ctx.sandbox
        await env.astep(hang)
        with pytest.raises(SandboxError, match="did not finish within 2 s"):
            await env.astep(SUBMIT)
        return await session.is_alive(), env._ctx

    alive, ctx = run(body, env)
    assert alive is False and ctx is None


def test_a_dead_sandbox_is_an_infrastructure_failure_not_a_reward_of_zero() -> None:
    env = SweEnv()

    async def body():  # type: ignore[no-untyped-def]
        await env.areset(options={"row": task_row(SLUG)})
        session = env._ctx.sandbox
        os.kill(session._worker.proc.pid, 9)  # the sandbox dies under the episode
        await asyncio.sleep(0.2)
        with pytest.raises(SandboxError, match="died before grading"):
            await env.astep(SUBMIT)
        return await session.is_alive(), env._ctx

    alive, ctx = run(body, env)
    assert alive is False and ctx is None


def test_the_agent_loop_masks_an_infra_failed_episode(assets: Path) -> None:
    from agentrl.chat import ChatTemplate
    from agentrl.rollout import AgentLoop
    from agentrl.tools.parsers import HermesParser

    template = ChatTemplate.from_pretrained(assets / "qwen2.5-0.5b-instruct")
    env = SweEnv()

    class KillThenSubmit:
        async def generate(self, prompt_ids: list[int], sampling: SamplingParams, *, session_id: str,
                           timeout_s: float | None = None) -> Generation:
            os.kill(env._ctx.sandbox._worker.proc.pid, 9)
            text = '<tool_call>\n{"name": "submit", "arguments": {}}\n</tool_call><|im_end|>'
            ids = template.tokenizer.encode(text, add_special_tokens=False)
            return Generation(ids, [-0.1] * len(ids), "stop", 1)

    loop = AgentLoop(KillThenSubmit(), template, HermesParser())
    traj = run(lambda: loop.run_episode(env, row=task_row(SLUG)), env)
    assert (traj.finish_reason, traj.fault, traj.trainable) == (FinishReason.ERROR, "infra", False)
    assert "died before grading" in (traj.error or "")


def test_a_test_command_that_cannot_start_is_infra_and_swe_check_names_it() -> None:
    import dataclasses

    from agentrl.envs.swe_check import check_instances
    from agentrl.errors import GradingError
    from agentrl.sandboxes.local import LocalSandbox

    broken = dataclasses.replace(SLUG, test_cmd="no-such-test-runner -rA {tests}")
    env = SweEnv()

    async def body():  # type: ignore[no-untyped-def]
        with pytest.raises(GradingError, match="could not start") as info:
            await play(env, broken, reference_fix_actions(broken))
        sandbox = LocalSandbox()
        try:
            return info.value.cause, await check_instances([broken], sandbox)
        finally:
            await sandbox.close()

    cause, (checked,) = run(body, env)
    assert cause == checked.problem == "the test command could not start"
    assert "no-such-test-runner" in checked.detail and not checked.ok


def test_budgets_end_the_episode_and_grade_it() -> None:
    fix = reference_fix_actions(TASKS["pager__page-count-remainder"])[0]
    look = call("bash", command="cat pager/pages.py")
    pager = TASKS["pager__page-count-remainder"]
    turns, tokens, wall = SweEnv(max_turns=2), SweEnv(max_tokens=50), SweEnv(max_wall_s=0.001)

    async def body():  # type: ignore[no-untyped-def]
        out = [await play(turns, pager, [fix, look, look]), await play(tokens, pager, [fix, look, look]),
               await play(wall, pager, [fix, look])]
        for e in (turns, tokens, wall):
            await e.aclose()
        return out

    results = run(body, turns)
    assert [(r[0], r[1], r[2], r[3]["truncated_by"]) for r in results] == [
        (1.0, False, True, "max_turns"), (1.0, False, True, "max_tokens"), (1.0, False, True, "max_wall_s")]


def test_a_turn_without_a_tool_call_gets_a_reminder() -> None:
    env = SweEnv()

    async def body():  # type: ignore[no-untyped-def]
        await env.areset(options={"row": task_row(SLUG)})
        return await env.astep(Action("Let me think about this."))

    obs, reward, terminated, truncated, _ = run(body, env)
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert obs[-1]["role"] == "user" and "did not call a tool" in obs[-1]["content"]


def _write_repo(root: Path) -> None:
    (root / "calc").mkdir(parents=True)
    (root / "calc" / "__init__.py").write_text("")
    (root / "calc" / "ops.py").write_text("def add(a, b):\n    return a - b\n")
    (root / "tests").mkdir()
    (root / "tests" / "test_ops.py").write_text("from calc.ops import add\n\n\ndef test_zero():\n    assert add(0, 0) == 0\n")


@pytest.mark.parametrize("source", ["directory", "archive", "pytest_command"])
def test_instances_from_a_directory_an_archive_or_with_a_pytest_command(tmp_path: Path, source: str) -> None:
    _write_repo(tmp_path / "repo")
    if source == "archive":
        with tarfile.open(tmp_path / "repo.tar.gz", "w:gz") as tar:
            tar.add(tmp_path / "repo", arcname="calc-1.0")  # one top folder, like a GitHub tarball
    hidden = (tmp_path / "repo/tests/test_ops.py").read_text() + "\n\ndef test_add():\n    assert add(2, 3) == 5\n"
    from agentrl.envs.patches import make_patch

    instance = {
        "instance_id": f"calc__{source}", "problem_statement": "add() subtracts",
        "repo_path": "repo.tar.gz" if source == "archive" else "repo",
        "FAIL_TO_PASS": json.dumps(["tests/test_ops.py::test_add"]), "PASS_TO_PASS": '["tests/test_ops.py::test_zero"]',
        "test_patch": make_patch({"tests/test_ops.py": (tmp_path / "repo/tests/test_ops.py").read_text()},
                                 {"tests/test_ops.py": hidden}),
        "patch": make_patch({"calc/ops.py": "def add(a, b):\n    return a - b\n"},
                            {"calc/ops.py": "def add(a, b):\n    return a + b\n"}),
    }
    if source == "pytest_command":
        instance["test_cmd"] = "python -m pytest -rA -p no:cacheprovider {tests}"
    tasks_file = tmp_path / "tasks.jsonl"
    tasks_file.write_text(json.dumps(instance) + "\n")
    env = SweEnv(tasks=str(tasks_file))

    async def body():  # type: ignore[no-untyped-def]
        await env.areset(seed=0)  # no row: the env's own task file
        out = [await env.astep(a) for a in reference_fix_actions(env.tasks[0])]
        return out[-1]

    _, reward, terminated, _, info = run(body, env)
    assert (reward, terminated) == (1.0, True), info["swe"]
    assert info["swe"]["statuses"] == {"tests/test_ops.py::test_add": "PASSED", "tests/test_ops.py::test_zero": "PASSED"}


def test_the_shipped_task_file_is_what_the_generator_makes() -> None:
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "make_swe_tasks.py"), "--check"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert re.search(r"(\d+) tasks, up to date", out.stdout).group(1) == str(len(TASKS))


class _ScriptedModel:
    """A stand-in policy for `agentrl eval`: finds the task in the prompt, emits the fix (or nothing)."""

    def __init__(self, tokenizer: Any, fix: bool) -> None:
        self.tok, self.fix, self.turns = tokenizer, fix, {}

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, *, session_id: str,
                       timeout_s: float | None = None) -> Generation:
        prompt = self.tok.decode(prompt_ids)
        task = next(t for t in TASKS.values() if t.problem_statement.strip() in prompt)
        turn = self.turns.setdefault(session_id, 0)
        self.turns[session_id] += 1
        actions = reference_fix_actions(task) if self.fix else [SUBMIT]
        c = actions[turn].tool_calls[0]
        text = f"<tool_call>\n{json.dumps({'name': c.name, 'arguments': c.arguments})}\n</tool_call><|im_end|>"
        ids = self.tok.encode(text, add_special_tokens=False)
        return Generation(ids, [-0.1] * len(ids), "stop", 1)


@pytest.mark.parametrize("fix", [True, False])
def test_agentrl_eval_reports_the_resolved_rate(assets: Path, tmp_path: Path, fix: bool) -> None:
    from agentrl.chat import ChatTemplate
    from agentrl.config import load_config
    from agentrl.orchestration.evaluate import run_eval

    model = assets / "qwen2.5-0.5b-instruct"
    config = load_config(overrides=["env=swe", f"model.path={model}", "eval.max_rows=3",
                                    f"eval.output_dir={tmp_path}", "rollout.max_tokens_per_turn=1024"])
    client = _ScriptedModel(ChatTemplate.from_pretrained(model).tokenizer, fix)
    report = run_eval(config, client=client)
    assert (report.problems, report.k, report.infra_failed_episodes) == (3, 1, 0)
    assert report.resolved_rate == report.pass_at_1 == (1.0 if fix else 0.0)
    assert json.loads((tmp_path / "report.json").read_text())["resolved_rate"] == report.resolved_rate


@pytest.mark.parametrize("fix", [True, False])
def test_agentrl_eval_keeps_each_verdict_and_writes_swe_bench_predictions(assets: Path, tmp_path: Path,
                                                                         fix: bool) -> None:
    from agentrl.chat import ChatTemplate
    from agentrl.config import load_config
    from agentrl.orchestration.evaluate import run_eval
    from agentrl.records.trajectory_log import read_trajectory_file

    model = assets / "qwen2.5-0.5b-instruct"
    config = load_config(overrides=["env=swe", f"model.path={model}", "eval.max_rows=3",
                                    f"eval.output_dir={tmp_path}", "rollout.max_tokens_per_turn=1024"])
    run_eval(config, client=_ScriptedModel(ChatTemplate.from_pretrained(model).tokenizer, fix))
    records = read_trajectory_file(tmp_path / "trajectories.jsonl")
    verdicts = {r["info"]["swe"]["instance_id"]: r["info"]["swe"] for r in records}
    assert len(records) == len(verdicts) == 3
    for iid, verdict in verdicts.items():
        task = TASKS[iid]
        assert set(verdict["statuses"]) == set(task.tests)
        failing = {t for t, s in verdict["statuses"].items() if s != "PASSED"}
        assert failing == (set() if fix else set(task.fail_to_pass))
        assert verdict["resolved"] is fix and verdict["model_patch"].startswith("diff --git") is fix
    predictions = [json.loads(line) for line in (tmp_path / "predictions.jsonl").read_text().splitlines()]
    assert {p["instance_id"] for p in predictions} == set(verdicts)
    for p in predictions:
        assert set(p) == {"instance_id", "model_name_or_path", "model_patch"}
        assert p["model_name_or_path"] == str(model) and p["model_patch"] == verdicts[p["instance_id"]]["model_patch"]


def test_the_runs_one_sandbox_reaches_every_env_it_builds(assets: Path) -> None:
    from agentrl.config import load_config
    from agentrl.orchestration.build import build_job
    from agentrl.sandboxes.local import LocalSandbox

    config = load_config(overrides=["env=swe", f"model.path={assets / 'qwen2.5-0.5b-instruct'}", "eval.max_rows=1"])
    job = build_job(config, "eval", own_client=True)  # a tokenizer-only model directory: no server loads it
    first, second = job.make_env(), job.make_env()
    assert isinstance(job.sandbox, LocalSandbox) and first.sandbox is second.sandbox is job.sandbox
    assert (first.max_turns, first.tool_timeout_s) == (config.rollout.max_turns, config.rollout.tool_timeout_s)
    task = TASKS["casing__acronyms"]

    async def body():  # type: ignore[no-untyped-def]
        try:
            return await play(first, task, reference_fix_actions(task))
        finally:
            await first.aclose()
            await job.aclose()  # the job closes the run's sandbox, never the env

    assert run(body, second)[0] == 1.0


def test_the_agent_loop_masks_an_episode_whose_test_command_cannot_start(assets: Path) -> None:
    import dataclasses

    from agentrl.chat import ChatTemplate
    from agentrl.rollout import AgentLoop
    from agentrl.tools.parsers import HermesParser

    template = ChatTemplate.from_pretrained(assets / "qwen2.5-0.5b-instruct")
    broken = dataclasses.replace(SLUG, test_cmd="no-such-test-runner -rA {tests}")
    env = SweEnv()
    loop = AgentLoop(_ScriptedModel(template.tokenizer, fix=False), template, HermesParser())
    traj = run(lambda: loop.run_episode(env, row=task_row(broken)), env)
    assert (traj.finish_reason, traj.fault, traj.trainable, traj.reward) == (FinishReason.ERROR, "infra", False, None)
    assert "The test command could not start" in (traj.error or "") and "swe" not in traj.info


@pytest.mark.slow
def test_the_swe_env_resolves_with_compaction_dropping_long_tool_outputs(assets: Path) -> None:
    import json as _json

    from agentrl.chat import ChatTemplate
    from agentrl.config import RolloutConfig
    from agentrl.rollout import AgentLoop
    from agentrl.tools.parsers import HermesParser

    template = ChatTemplate.from_pretrained(assets / "qwen2.5-0.5b-instruct")
    tok = template.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    task = TASKS["pager__page-count-remainder"]
    # long outputs first (each about 700 tokens), then the reference fix and submit: the scripted SWE agent
    actions = [call("bash", command="seq 100000 100140")] * 4 + reference_fix_actions(task)

    class Scripted:
        turn = 0

        async def generate(self, prompt_ids: list[int], sampling: SamplingParams, *, session_id: str,
                           timeout_s: float | None = None) -> Generation:
            action = actions[self.turn]
            self.turn += 1
            (c,) = action.tool_calls
            text = f"{action.text}\n<tool_call>\n{_json.dumps({'name': c.name, 'arguments': c.arguments})}\n</tool_call>"
            ids = tok.encode(text, add_special_tokens=False) + [end]
            return Generation(ids, [-0.1] * len(ids), "stop", 1)

    env = SweEnv()  # its own budgets: 30 turns, outputs cut at 8,000 characters
    config = RolloutConfig(max_turns=30, max_total_tokens=3072, max_tokens_per_turn=512, verify_template=True,
                           compaction={"policy": "drop_tool_outputs", "tool_output_chars": 0})
    loop = AgentLoop(Scripted(), template, HermesParser(), config)
    segments = run(lambda: loop.run_episode_segments(env, row=task_row(task)), env)
    last = segments[-1]
    assert len(segments) >= 2 and last.metrics["compactions"] == len(segments) - 1
    assert {(t.finish_reason, t.reward) for t in segments} == {(FinishReason.DONE, 1.0)}, last.error
    assert last.metrics["resolved"] == 1.0 and last.info["swe"]["model_patch"].startswith("diff --git")
    assert all(t.metrics["template_mismatch"] == 0.0 and len(t) <= 3072 for t in segments)
    dropped = [m for m in segments[-1].messages if m["role"] == "tool" and "dropped to save context" in m["content"]]
    assert dropped  # the old `seq` outputs were dropped in the last context
