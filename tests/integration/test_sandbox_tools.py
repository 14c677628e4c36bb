"""The python, bash and str_replace_editor tools driving a real bubblewrap sandbox."""

from __future__ import annotations

import asyncio

import pytest

from agentrl.sandboxes.bwrap import find_bwrap
from agentrl.sandboxes.local import LocalSandbox
from agentrl.tools import ToolContext, make_tool

pytestmark = pytest.mark.skipif(
    find_bwrap() is None, reason="bubblewrap is not installed (apt-get install bubblewrap)"
)


def run(coro):
    return asyncio.run(coro)


async def with_context(fn, session: bool):
    sandbox = LocalSandbox(max_concurrency=2, pool_size=1)
    sess = await sandbox.session() if session else None
    ctx = ToolContext(episode_id="e1", sandbox=sess or sandbox)
    try:
        return await fn(ctx)
    finally:
        if sess is not None:
            await sess.close()
        await sandbox.close()


def test_python_tool_runs_code_and_reports_model_errors():
    tool = make_tool("python", exec_timeout_s=1.0)

    async def body(ctx):
        ok = await tool.invoke({"code": "import math\nprint(math.factorial(20))"}, ctx)
        boom = await tool.invoke({"code": "print('before')\n1/0"}, ctx)
        hang = await tool.invoke({"code": "while True: pass"}, ctx)
        quiet = await tool.invoke({"code": "x = 1"}, ctx)
        return ok, boom, hang, quiet

    ok, boom, hang, quiet = run(with_context(body, session=False))
    assert ok.content == "2432902008176640000" and ok.fault is None
    assert boom.fault == "model"
    assert boom.content.startswith("[stdout]\nbefore\n[stderr]\nTraceback")
    assert "ZeroDivisionError: division by zero" in boom.content and boom.content.endswith("[exit code 1]")
    assert hang.fault == "model" and "time limit of 1 s" in hang.content
    assert quiet.fault is None and "no output" in quiet.content


def test_python_tool_truncates_long_output_head_and_tail():
    tool = make_tool("python", max_output_chars=200)

    async def body(ctx):
        return await tool.invoke({"code": "for i in range(1000): print(i)"}, ctx)

    res = run(with_context(body, session=False))
    assert res.content.startswith("0\n1\n2\n")
    assert res.content.endswith("998\n999") and "characters omitted" in res.content
    assert len(res.content) < 260


def test_bash_tool_keeps_files_across_calls_in_a_session():
    tool = make_tool("bash")

    async def body(ctx):
        first = await tool.invoke({"command": "mkdir -p pkg && echo 'print(6*7)' > pkg/run.py"}, ctx)
        second = await tool.invoke({"command": "python pkg/run.py && ls pkg"}, ctx)
        failed = await tool.invoke({"command": "ls does-not-exist"}, ctx)
        return first, second, failed

    first, second, failed = run(with_context(body, session=True))
    assert first.content == "[done; no output]" and first.fault is None
    assert second.content == "42\nrun.py"
    assert failed.fault == "model" and failed.content.endswith("[exit code 2]")


def test_bash_tool_opens_and_releases_its_own_session():
    tool = make_tool("bash")

    async def body():
        sandbox = LocalSandbox(max_concurrency=1, pool_size=0)
        ctx = ToolContext(episode_id="e2", sandbox=sandbox)
        try:
            await tool.create(ctx)
            await tool.invoke({"command": "echo kept > f.txt"}, ctx)
            kept = await tool.invoke({"command": "cat f.txt"}, ctx)
            session = ctx.state["_agentrl_sandbox_session"]
            await tool.release(ctx)
            return kept, await session.is_alive()
        finally:
            await sandbox.close()

    kept, alive = run(body())
    assert kept.content == "kept"
    assert alive is False


def test_editor_tool_edits_files_through_the_session():
    editor = make_tool("str_replace_editor")
    bash = make_tool("bash")

    async def body(ctx):
        out = {}
        out["create"] = await editor.invoke({"command": "create", "path": "app.py",
                                             "file_text": "def f():\n    return 1\n\nx = 1\ny = 1\n"}, ctx)
        out["again"] = await editor.invoke({"command": "create", "path": "app.py", "file_text": ""}, ctx)
        out["ambiguous"] = await editor.invoke({"command": "str_replace", "path": "app.py",
                                                "old_str": "= 1", "new_str": "= 2"}, ctx)
        out["missing"] = await editor.invoke({"command": "str_replace", "path": "app.py",
                                              "old_str": "nope", "new_str": ""}, ctx)
        out["replace"] = await editor.invoke({"command": "str_replace", "path": "app.py",
                                              "old_str": "return 1", "new_str": "return 41 + 1"}, ctx)
        out["insert"] = await editor.invoke({"command": "insert", "path": "app.py", "insert_line": 0,
                                             "new_str": "import os"}, ctx)
        out["view"] = await editor.invoke({"command": "view", "path": "app.py", "view_range": [1, 3]}, ctx)
        out["run"] = await bash.invoke({"command": "python -c 'import app; print(app.f())'"}, ctx)
        out["undo"] = await editor.invoke({"command": "undo_edit", "path": "app.py"}, ctx)
        out["after_undo"] = await bash.invoke({"command": "head -1 app.py"}, ctx)
        out["dir"] = await editor.invoke({"command": "view", "path": "."}, ctx)
        out["escape"] = await editor.invoke({"command": "view", "path": "../etc/passwd"}, ctx)
        return out

    out = run(with_context(body, session=True))
    assert out["create"].content == "File created successfully at: app.py"
    assert out["again"].fault == "model" and "already exists" in out["again"].content
    assert out["ambiguous"].fault == "model" and "occurs 2 times" in out["ambiguous"].content
    assert "at lines [4, 5]" in out["ambiguous"].content
    assert out["missing"].fault == "model" and "does not occur" in out["missing"].content
    assert out["replace"].fault is None and "     2\t    return 41 + 1" in out["replace"].content
    assert out["view"].content.endswith("     1\timport os\n     2\tdef f():\n     3\t    return 41 + 1")
    assert out["run"].content == "42"
    assert out["after_undo"].content == "def f():"
    assert "./app.py" in out["dir"].content
    assert out["escape"].fault == "model"
