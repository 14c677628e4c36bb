"""The env contract: check_env passes real envs and catches broken ones; ToolEnv's tool handling."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest

from agentrl.envs import Env, ToolEnv, check_env, make_env
from agentrl.envs.answers import answers_match, extract_boxed, final_answer
from agentrl.envs.arithmetic import ArithmeticEnv, make_arithmetic_row
from agentrl.errors import ConfigError, EnvContractError, EnvError, FeatureUnavailableError, UnknownNameError
from agentrl.registry import ENVS
from agentrl.tools import Tool, ToolContext, tool
from agentrl.types import PARSE_STATUSES, Action, ToolCall


def _call(name: str, **arguments: Any) -> ToolCall:
    return ToolCall(name, arguments, id=f"call_{name}")


# env=mcp starts a real MCP server process at every reset: seconds each, so it is in the slow tier, with
# env=verifiers (its worker process imports verifiers: seconds). The adapters of other standards are given
# what they adapt; env=openenv needs a server, and tests/integration/test_openenv_eval.py checks it against
# the session's one.
_SLOW_ENVS = ("mcp", "verifiers")
_ENV_KWARGS: dict[str, dict[str, Any]] = {
    "gym": {"id": "gym_text.guess_text_env:GuessText-v0"},  # tests/ is on sys.path (its conftest)
    "verifiers": {"id": "examples/verifiers_arith.py"},
}
_NEEDS = {"verifiers": pytest.mark.verifiers}  # verifiers 0.4 in its own folder: bash scripts/install.sh verifiers


REPO = Path(__file__).resolve().parents[2]
_CHECKED_ELSEWHERE = {"openenv": "tests/integration/test_openenv_eval.py checks it against a running server"}


def test_every_registered_env_is_checked() -> None:
    checked_elsewhere = set(_CHECKED_ELSEWHERE)
    assert checked_elsewhere <= set(ENVS.names()), "an env named in _CHECKED_ELSEWHERE is no longer registered"
    assert (REPO / _CHECKED_ELSEWHERE["openenv"].split()[0]).read_text().count("check_env(") >= 1


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] * (n in _SLOW_ENVS) + (
    [_NEEDS[n]] if n in _NEEDS else [])) for n in ENVS.names() if n not in _CHECKED_ELSEWHERE])
def test_every_registered_env_passes_check_env(name: str) -> None:
    if name == "verifiers":
        from agentrl.envs.verifiers_process import VerifiersWorker

        # one worker for every env check_env makes and closes, as a run's envs share the job's
        worker = VerifiersWorker()
        try:
            check_env(make_env(name, **_ENV_KWARGS[name], verifiers_worker=worker))
        finally:
            worker.close()
        return
    check_env(make_env(name, **_ENV_KWARGS.get(name, {})))


@pytest.mark.parametrize("kwargs", [{}, {"tool_format": "code", "few_shot": 1}])
def test_first_prompt_is_what_reset_starts_the_episode_with(kwargs: dict[str, Any]) -> None:
    from agentrl.envs.retool import RetoolEnv

    env = RetoolEnv(**kwargs)
    row = RetoolEnv.dataset_rows("train")[0]
    first = env.first_prompt(row)
    messages, info = env.reset(seed=0, options={"row": row})
    env.close()
    assert first == (messages, info["tools"])
    assert (info["tools"] == []) == (kwargs.get("tool_format") == "code")


def test_arithmetic_passes_check_env_with_tool_calls_and_scores_answers() -> None:
    row = make_arithmetic_row(5)
    truth = row["reward_model"]["ground_truth"]
    actions = [
        Action("let me compute", (_call("calculator", expression=row["extra_info"]["expression"]),)),
        Action(f"The result is \\boxed{{{truth}}}."),
    ]
    check_env(ArithmeticEnv(), actions=actions, options={"row": row})
    env = ArithmeticEnv()
    env.reset(options={"row": row})
    obs, reward, term, trunc, info = env.step(actions[0])
    assert obs == [{"role": "tool", "content": truth, "tool_call_id": "call_calculator", "name": "calculator"}]
    assert (reward, term, trunc) == (0.0, False, False)
    obs, reward, term, trunc, info = env.step(actions[1])
    assert (obs, reward, term, trunc) == ([], 1.0, True, False)
    assert info["metrics"]["tool_calls"] == 1
    env.reset(options={"row": row})
    assert env.step(Action("\\boxed{12}"))[1] == 0.0


def test_final_answer_extraction_and_matching() -> None:
    assert final_answer("so \\boxed{42} and later \\boxed{ 1,234 }") == "1,234"
    assert final_answer("it is 17, maybe -3.5") == "-3.5"
    assert final_answer("no idea") is None
    assert extract_boxed("x = \\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}"
    assert extract_boxed("\\boxed{unclosed") is None
    assert answers_match("1,234", "1234") and answers_match("\\frac{3}{4}", "0.75") and answers_match("6/8", "3/4")
    assert not answers_match("1235", "1234") and not answers_match(None, "1") and not answers_match("x" * 400, "1")


def test_tool_env_turns_bad_calls_into_messages_and_counts_them() -> None:
    env = ArithmeticEnv(max_turns=2)
    env.reset(seed=1)
    action = Action(
        "calls",
        (_call("calculator", expression="1 +"), _call("weather", city="Paris"), _call("calculator", expression="2*3")),
        parse_errors=("<tool_call> block 2 is not valid JSON",),
    )
    obs, reward, term, trunc, info = env.step(action)
    assert [m["content"] for m in obs] == [
        "Error: <tool_call> block 2 is not valid JSON",
        "Error: Cannot parse '1 +' as arithmetic (invalid syntax). "
        "Use numbers, parentheses and + - * / // % **, for example '(12 + 3) * 4'.",
        "Error: there is no tool named 'weather'. Available tools: calculator.",
        "6",
    ]
    # The calls of an Action without outcomes (a parser written against parse_errors) are typed by the env:
    # its parse error is `malformed`; the arithmetic error is the tool's own (its arguments fit the schema).
    typed = {f"tools/parse/{s}": 0 for s in PARSE_STATUSES} | {
        "tools/parse/ok": 2, "tools/parse/unknown_tool": 1, "tools/parse/malformed": 1}
    assert info["metrics"] == {"tool_calls": 3, "tool_errors_model": 2, "tool_errors_infra": 0, "parse_errors": 1,
                               **typed}
    assert [o.status for o in info["call_outcomes"]] == ["ok", "unknown_tool", "ok", "malformed"]
    obs, reward, term, trunc, info = env.step(Action("again", (_call("calculator", expression="1"),)))
    assert (reward, term, trunc) == (0.0, False, True)  # max_turns reached
    with pytest.raises(EnvError, match="after the episode ended"):
        env.step(Action("more"))


def test_tool_env_releases_tools_always() -> None:
    events: list[str] = []

    class Tracked(Tool):
        async def create(self, ctx: ToolContext) -> None:
            events.append("create")

        async def run(self, ctx: ToolContext) -> str:
            """Do nothing."""
            return "ok"

        async def release(self, ctx: ToolContext) -> None:
            events.append("release")

    class E(ToolEnv):
        def score(self, final_text: str, row: dict[str, Any], ctx: ToolContext) -> float:
            return 1.0

    env = E([Tracked()], max_turns=3)
    row = {"prompt": "hi"}
    env.reset(options={"row": row})
    env.reset(options={"row": row})  # a new episode releases the previous one
    assert events == ["create", "release", "create"]
    env.step(Action("done"))  # terminated: released at once
    assert events[-1] == "release"
    env.reset(options={"row": row})
    env.close()
    env.close()
    assert events.count("create") == events.count("release") == 3


def test_done_flag_from_a_tool_terminates_the_episode() -> None:
    @tool
    async def submit(answer: str, ctx: ToolContext) -> str:
        """Submit the final answer.

        Args:
            answer: The answer.
        """
        ctx.state["done"], ctx.state["answer"] = True, answer
        return "submitted"

    class E(ToolEnv):
        def score(self, final_text: str, row: dict[str, Any], ctx: ToolContext) -> float:
            return float(ctx.state.get("answer") == row["answer"])

    env = E([submit])
    env.reset(options={"row": {"prompt": "q", "answer": "7"}})
    _, reward, term, _, _ = env.step(Action("", (_call("submit", answer="7"),)))
    assert (reward, term) == (1.0, True)


class _BrokenEnv(Env):
    """An env that breaks the contract in configurable ways."""

    def __init__(self, flaw: str) -> None:
        self.flaw = flaw
        self.started = False
        self.calls = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        super().reset(seed=seed)
        self.started = True
        self.calls += 1
        content = f"q{self.calls}" if self.flaw == "nondeterministic" else "q"
        if self.flaw == "reset_tuple":
            return [{"role": "user", "content": content}]
        info: dict[str, Any] = {"tools": [{"name": "x"}]} if self.flaw == "bad_schema" else {"tools": []}
        return [{"role": "user", "content": content}], info

    def step(self, action: Action) -> Any:
        if not self.started and self.flaw != "step_before_reset":
            raise EnvError("reset first")
        if self.flaw == "step_tuple":
            return [], 1.0, True, {}
        if self.flaw == "reward_type":
            return [], "1", True, False, {}
        if self.flaw == "obs_type":
            return "tool said hi", 0.0, True, False, {}
        return [], 0.0, True, False, {}


@pytest.mark.parametrize(
    ("flaw", "expected"),
    [
        ("step_tuple", "must return (observation, reward, terminated, truncated, info)"),
        ("reset_tuple", "reset must return (observation, info)"),
        ("nondeterministic", "reset(seed=s) twice gave different observations"),
        ("step_before_reset", "step before reset did not raise"),
        ("bad_schema", "info['tools'][0] is not an OpenAI function schema"),
        ("reward_type", "reward must be a finite float"),
        ("obs_type", "observation must be a list of chat messages"),
    ],
)
def test_check_env_catches_contract_violations(flaw: str, expected: str) -> None:
    with pytest.raises(EnvContractError) as info:
        check_env(_BrokenEnv(flaw))
    assert expected in str(info.value)


def test_check_env_passes_a_correct_minimal_env() -> None:
    check_env(_BrokenEnv("none"))


def test_sync_api_refuses_to_run_inside_an_event_loop() -> None:
    env = ArithmeticEnv()

    async def misuse() -> None:
        env.reset(seed=0)

    with pytest.raises(RuntimeError, match="await env.areset"):
        asyncio.run(misuse())


def test_make_env_errors_name_the_problem() -> None:
    with pytest.raises(UnknownNameError, match="Did you mean 'arithmetic'"):
        make_env("arithmetik")
    with pytest.raises(ConfigError, match="Cannot build env 'arithmetic' with arguments \\['colour'\\]"):
        make_env("arithmetic", colour="red")
    with pytest.raises(ConfigError, match="not an agentrl.Env"):
        make_env("agentrl.types:Action", text="x")


def test_check_env_holds_envs_to_their_ground_truth_declaration() -> None:
    class NoTruth(ToolEnv):
        def generate_row(self, seed: int | None) -> dict[str, Any]:
            return {"prompt": "say hi"}

        def score(self, final_text: str, row: dict[str, Any], ctx: ToolContext) -> float:
            return 1.0

    with pytest.raises(EnvContractError, match=r"declares requires_ground_truth = True but the row of "
                                               r"generate_row\(0\) has none: 'reward_model' is missing"):
        check_env(NoTruth())
    with pytest.raises(EnvContractError, match=r"the row of options\['row'\] has none"):
        check_env(NoTruth(), options={"row": {"prompt": "q", "reward_model": {"style": "rule"}}})

    class Unscored(NoTruth):
        requires_ground_truth = False

    check_env(Unscored())

    class Odd(Unscored):
        requires_ground_truth = "no"  # type: ignore[assignment]

    with pytest.raises(EnvContractError, match="requires_ground_truth must be a bool class attribute, got 'no'"):
        check_env(Odd())


def test_verifiers_without_its_own_folder_names_the_command_that_installs_it(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(sys, "prefix", str(tmp_path))  # an environment where install.sh verifiers never ran
    with pytest.raises(FeatureUnavailableError) as caught:
        make_env("verifiers", id="examples/verifiers_arith.py")
    assert str(tmp_path / "agentrl-extras" / "verifiers") in str(caught.value)
    assert "Install it with: bash scripts/install.sh verifiers" in str(caught.value)
