"""The tool contract: derived schemas, argument validation, fault classes, per-episode lifecycle."""

from __future__ import annotations

import asyncio

import pytest

from agentrl.errors import ToolInfrastructureError
from agentrl.tools import Tool, ToolContext, make_tool, tool
from agentrl.tools.calculator import calculator


@tool
async def search(query: str, k: int = 3, ctx: ToolContext | None = None) -> list[str]:
    """Search the notes.

    Args:
        query: What to look for. Can span
            two lines.
        k: How many results to return.
    """
    return [f"{query}-{i}" for i in range(k)]


def test_schema_is_derived_from_signature_and_docstring() -> None:
    fn = search.schema["function"]
    assert fn["name"] == "search"
    assert fn["description"] == "Search the notes."
    params = fn["parameters"]
    assert params["required"] == ["query"]
    assert params["properties"]["query"] == {"type": "string", "description": "What to look for. Can span two lines."}
    assert params["properties"]["k"] == {"type": "integer", "default": 3, "description": "How many results to return."}
    assert "ctx" not in params["properties"]
    assert params["additionalProperties"] is False


def test_arguments_are_validated_and_errors_are_the_models_fault() -> None:
    ok = asyncio.run(search.invoke({"query": "x", "k": 2}, tool_call_id="t1"))
    assert (ok.content, ok.fault, ok.tool_call_id) == ('["x-0", "x-1"]', None, "t1")
    bad = asyncio.run(search.invoke({"query": "x", "k": "many"}))
    assert bad.fault == "model"
    assert "'k': Input should be a valid integer" in bad.content and "Expected arguments: query, k" in bad.content
    missing = asyncio.run(search.invoke('{"k": 1}'))
    assert missing.fault == "model" and "'query': Field required" in missing.content
    not_json = asyncio.run(search.invoke("{query: x}"))
    assert not_json.fault == "model" and "not valid JSON" in not_json.content
    not_object = asyncio.run(search.invoke("[1, 2]"))
    assert not_object.fault == "model" and "must be a JSON object" in not_object.content


def test_failures_are_classified_by_fault() -> None:
    @tool
    def divide(a: int, b: int) -> float:
        """Divide a by b."""
        return a / b

    @tool
    async def flaky() -> str:
        """Talk to a service that is down."""
        raise ToolInfrastructureError("sandbox service unreachable")

    @tool
    async def broken() -> str:
        """A tool with a bug."""
        raise KeyError("oops")

    @tool(timeout_s=0.05)
    async def slow() -> str:
        """Hang."""
        await asyncio.sleep(10)
        return "never"

    assert asyncio.run(divide.invoke({"a": 1, "b": 0})).fault == "model"
    assert asyncio.run(divide.invoke({"a": 3, "b": 2})).content == "1.5"
    r = asyncio.run(flaky.invoke({}))
    assert (r.fault, r.content) == ("infra", "Error: sandbox service unreachable")
    r = asyncio.run(broken.invoke({}))
    assert r.fault == "infra" and "KeyError" in r.content
    r = asyncio.run(slow.invoke({}))
    assert r.fault == "infra" and "did not answer within 0.05 s" in r.content


def test_stateful_tool_lifecycle_and_context() -> None:
    events: list[str] = []

    class CounterTool(Tool):
        async def create(self, ctx: ToolContext) -> None:
            ctx.state["count"] = 0
            events.append(f"create {ctx.episode_id}")

        async def run(self, ctx: ToolContext, step: int = 1) -> str:
            """Add `step` to the episode's counter.

            Args:
                step: How much to add.
            """
            ctx.state["count"] += step
            return str(ctx.state["count"])

        async def release(self, ctx: ToolContext) -> None:
            events.append(f"release {ctx.episode_id}")

    t = CounterTool()
    assert t.tool_name == "counter"
    assert t.schema["function"]["parameters"]["properties"]["step"]["description"] == "How much to add."

    async def episode() -> list[str]:
        ctx = ToolContext(episode_id="e7")
        await t.create(ctx)
        outs = [(await t.invoke({"step": s}, ctx)).content for s in (1, 2, 3)]
        await t.release(ctx)
        return outs

    assert asyncio.run(episode()) == ["1", "3", "6"]
    assert events == ["create e7", "release e7"]


def test_bad_tool_definitions_fail_at_definition_time() -> None:
    def untyped(x):  # type: ignore[no-untyped-def]
        """No hints."""

    with pytest.raises(TypeError, match="Parameter 'x' of tool 'untyped' has no type hint"):
        tool(untyped)
    with pytest.raises(ValueError, match="is not valid"):
        tool(name="has space")(search.__wrapped__)


def test_calculator_is_exact_and_refuses_code() -> None:
    assert asyncio.run(calculator.invoke({"expression": "(1234 * 5678) - 91"})).content == "7006561"
    assert asyncio.run(calculator.invoke({"expression": "7 / 2"})).content == "3.5"
    assert asyncio.run(calculator.invoke({"expression": "2 ** 100"})).content == str(2**100)
    for evil in ("__import__('os').system('id')", "[1] * 10**9", "9 ** 9 ** 9", "1/0"):
        r = asyncio.run(calculator.invoke({"expression": evil}))
        assert r.fault == "model", evil
    assert make_tool("calculator") is calculator
