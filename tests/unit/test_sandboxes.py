"""Sandbox backends and sandbox tools without processes: argument checks, command lines, fakes.

The real isolation is tested in tests/integration/test_sandbox_adversarial.py; here the pieces
around it are pinned with fakes (an in-memory sandbox, httpx MockTransport, the ASGI app in-process).
"""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest

from agentrl.errors import SandboxError, SandboxUnavailableError
from agentrl.registry import SANDBOXES, TOOLS
from agentrl.sandboxes import bwrap as bwrap_mod
from agentrl.sandboxes import local as local_mod
from agentrl.sandboxes.local import LocalSandbox, _check_relative
from agentrl.sandboxes.remote import RemoteSandbox
from agentrl.sandboxes.server import create_app, serve
from agentrl.tools import ToolContext, make_tool
from agentrl.tools.exec_output import format_exec_result, truncate_middle
from agentrl.types import ExecResult


def run(coro):
    return asyncio.run(coro)


class FakeSandbox:
    """Answers every job with a fixed result, or raises a fixed error; records what it was asked."""

    def __init__(self, result: ExecResult | None = None, error: Exception | None = None) -> None:
        self.result = result or ExecResult("out\n", "", 0, duration_s=0.01)
        self.error = error
        self.calls: list[dict] = []
        self.max_concurrency = 2

    async def exec(self, command=None, *, code=None, timeout_s, stdin=None, files=None):
        self.calls.append({"command": command, "code": code, "timeout_s": timeout_s, "stdin": stdin,
                           "files": dict(files or {})})
        if self.error:
            raise self.error
        return self.result

    async def session(self):
        return self

    async def read_file(self, path):
        return b"data"

    async def write_file(self, path, data):
        pass

    async def close(self):
        pass

    async def is_alive(self):
        return True


# ── local backend: checks that need no process ──────────────────────────────────────────────
@pytest.mark.parametrize("path", ["a.txt", "dir/b.txt", "./c", "/workspace/d.txt", "x/../y"])
def test_relative_paths_inside_the_work_dir_are_accepted(path):
    assert not _check_relative(path).startswith(("/", ".."))


@pytest.mark.parametrize("path", ["", "/etc/passwd", "../x", "a/../../x", "/workspace/../etc", "a\x00b"])
def test_paths_that_could_escape_are_refused(path):
    with pytest.raises(ValueError):
        _check_relative(path)


def test_missing_bubblewrap_names_the_package_to_install(monkeypatch):
    monkeypatch.setattr(local_mod, "find_bwrap", lambda: None)
    with pytest.raises(SandboxUnavailableError, match="apt-get install bubblewrap"):
        LocalSandbox()


def test_unisolated_mode_must_be_named_and_warns(monkeypatch, caplog):
    monkeypatch.setattr(local_mod, "find_bwrap", lambda: None)
    with caplog.at_level(logging.WARNING, logger="agentrl.sandboxes.local"):
        sandbox = LocalSandbox(isolation="none")
    assert sandbox.isolation == "none"
    assert "UNISOLATED" in caplog.text
    with pytest.raises(ValueError, match="isolation"):
        LocalSandbox(isolation="nsjail")


def test_job_requests_are_checked_before_anything_runs(monkeypatch):
    monkeypatch.setattr(local_mod, "find_bwrap", lambda: "/usr/bin/bwrap")
    sandbox = LocalSandbox()
    with pytest.raises(ValueError, match="exactly one"):
        sandbox._request("ls", "print(1)", 1.0, None, None, wipe=True)
    with pytest.raises(ValueError, match="exactly one"):
        sandbox._request(None, None, 1.0, None, None, wipe=True)
    with pytest.raises(ValueError, match="timeout_s"):
        sandbox._request("ls", None, 0, None, None, wipe=True)
    with pytest.raises(ValueError, match="outside"):
        sandbox._request("ls", None, 1.0, None, {"../x": "y"}, wipe=True)
    header, blobs = sandbox._request(None, "print(1)", 2.5, "in", {"/workspace/a.txt": "x"}, wipe=True)
    assert header["rlimits"]["RLIMIT_CPU"] == [4, 5]  # timeout rounded up, plus a second
    assert header["kind"] == "python"
    assert blobs == [b"print(1)", b"in", b"a.txt", b"x"]  # job data travels as raw blobs only
    assert "print(1)" not in json.dumps(header)


def test_bwrap_command_line_isolates_and_hides_the_host():
    argv = bwrap_mod.bwrap_argv("/usr/bin/bwrap", privileged=True, extra_ro=("/root/.pyenv/versions/3.11",))
    joined = " ".join(argv)
    for flag in ("--unshare-net", "--unshare-pid", "--unshare-ipc", "--die-with-parent", "--new-session",
                 "--clearenv", "--cap-drop ALL", "--remount-ro /"):
        assert flag in joined
    assert "--unshare-user" not in argv  # as root, real per-job uids instead
    assert "--ro-bind / /" not in joined and "/home" not in joined
    assert "--perms 0755 --dir /root --perms 0755 --dir /root/.pyenv" in joined
    assert argv[-1] == "--"
    unprivileged = bwrap_mod.bwrap_argv("/usr/bin/bwrap", privileged=False)
    assert "--unshare-user" in unprivileged and "--cap-add" not in unprivileged


def test_registries_name_the_sandboxes_and_tools():
    assert SANDBOXES.resolve("local") is LocalSandbox
    assert SANDBOXES.resolve("remote") is RemoteSandbox
    assert SANDBOXES.resolve("docker").__name__ == "DockerSandbox"  # importing it needs no SDK
    for name in ("python", "bash", "str_replace_editor", "submit", "finish"):
        assert make_tool(name).tool_name == name
        assert name in TOOLS


def test_a_missing_or_shadowed_docker_sdk_is_named_with_its_install_command(tmp_path, monkeypatch):
    import sys

    from agentrl.sandboxes.docker_reaper import import_docker_sdk

    monkeypatch.setitem(sys.modules, "docker", None)  # not installed
    with pytest.raises(SandboxUnavailableError, match=r"needs the Docker SDK: pip install 'agentrl\[docker\]'"):
        import_docker_sdk()
    # Not installed, but a folder named docker/ on sys.path: Python imports it as a namespace package.
    del sys.modules["docker"]  # (monkeypatch puts back what was there)
    (tmp_path / "docker").mkdir()
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    with pytest.raises(SandboxUnavailableError, match="not the Docker SDK") as info:
        import_docker_sdk()
    assert str(tmp_path / "docker") in str(info.value) and "pip install 'agentrl[docker]'" in str(info.value)


# ── tool output ─────────────────────────────────────────────────────────────────────────────
def test_truncate_middle_keeps_head_and_tail_and_says_what_it_cut():
    text = "".join(f"{i:04d}\n" for i in range(1000))
    cut = truncate_middle(text, 100)
    assert cut.startswith("0000\n") and cut.endswith("0999\n")
    assert f"[... {len(text) - 100} characters omitted ...]" in cut
    assert truncate_middle("short", 100) == "short"


def test_format_exec_result_describes_failures():
    ok, failed = format_exec_result(ExecResult("42\n", "", 0))
    assert (ok, failed) == ("42", False)
    text, failed = format_exec_result(ExecResult("", "boom\n", 1))
    assert failed and text == "[stderr]\nboom\n[exit code 1]"
    text, failed = format_exec_result(ExecResult("partial", "", None, True, "timeout"), timeout_s=5)
    assert failed and text.endswith("[the program was stopped: it ran past its time limit of 5 s]")
    text, _ = format_exec_result(ExecResult("", "", None, False, "memory"))
    assert "more memory" in text
    closed = run(make_tool("python").invoke({"code": "x"}, ToolContext(sandbox=FakeSandbox(
        ExecResult("", "[sandbox session closed]", None, False, "closed")))))
    assert closed.fault == "infra" and "session was closed" in closed.content  # not the program's doing


# ── tools with a fake sandbox ───────────────────────────────────────────────────────────────
def test_python_tool_separates_model_faults_from_infrastructure_faults():
    tool = make_tool("python", exec_timeout_s=3)
    fine = FakeSandbox()
    res = run(tool.invoke({"code": "print('out')"}, ToolContext(sandbox=fine)))
    assert res.content == "out" and res.fault is None
    assert fine.calls[0]["code"] == "print('out')" and fine.calls[0]["timeout_s"] == 3
    crashed = run(tool.invoke({"code": "1/0"}, ToolContext(sandbox=FakeSandbox(ExecResult("", "Trace", 1)))))
    assert crashed.fault == "model"
    down = run(tool.invoke({"code": "1"}, ToolContext(sandbox=FakeSandbox(error=SandboxError("pool is down")))))
    assert down.fault == "infra" and "pool is down" in down.content
    bad = run(tool.invoke({"cod": "1"}, ToolContext(sandbox=fine)))
    assert bad.fault == "model" and "code" in bad.content


def test_submit_and_finish_end_the_episode_with_the_answer():
    for name in ("submit", "finish"):
        ctx = ToolContext()
        res = run(make_tool(name).invoke({"answer": "42"}, ctx))
        assert res.fault is None
        assert ctx.state == {"answer": "42", "done": True}


# ── the server app in-process, and the client against fakes ─────────────────────────────────
async def _asgi(app, method, path, **kwargs):
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, **kwargs)


def test_server_checks_tokens_and_answers_in_sandboxfusion_shape():
    fake = FakeSandbox(ExecResult("hi\n", "", 0, duration_s=0.5))
    app = create_app(fake, token="s3cret")
    assert run(_asgi(app, "POST", "/v1/exec", json={"code": "x"})).status_code == 401
    assert run(_asgi(app, "GET", "/health")).status_code == 200
    auth = {"Authorization": "Bearer s3cret"}
    both = run(_asgi(app, "POST", "/v1/exec", json={"code": "x", "command": "y"}, headers=auth))
    assert both.status_code == 400
    body = run(_asgi(app, "POST", "/run_code", headers=auth,
                     json={"code": "print('hi')", "language": "python", "run_timeout": 7})).json()
    assert body["status"] == "Success" and body["compile_result"] is None
    assert body["run_result"] | {"killed_reason": None} == {
        "status": "Finished", "execution_time": 0.5, "return_code": 0, "stdout": "hi\n", "stderr": "",
        "killed_reason": None,
    }
    assert fake.calls[-1]["timeout_s"] == 7 and fake.calls[-1]["code"] == "print('hi')"


def test_server_maps_sandbox_failures_to_503():
    app = create_app(FakeSandbox(error=SandboxError("no bwrap")))
    resp = run(_asgi(app, "POST", "/v1/exec", json={"command": "ls"}))
    assert resp.status_code == 503 and "no bwrap" in resp.json()["detail"]


def test_serve_refuses_a_public_address_without_a_token():
    with pytest.raises(ValueError, match="without a token"):
        serve("0.0.0.0", 9, None)


def _client_with(handler, **kwargs) -> RemoteSandbox:
    remote = RemoteSandbox("http://sandbox.test", **kwargs)
    remote._client = httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://sandbox.test")
    return remote


def test_remote_client_maps_http_answers():
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/run_code":
            return httpx.Response(200, json={"status": "Failed", "message": "", "run_result": {
                "status": "TimeLimitExceeded", "execution_time": 1.0, "return_code": None,
                "stdout": "x", "stderr": ""}})
        if request.url.path == "/v1/exec":
            return httpx.Response(503, json={"detail": "overloaded"})
        return httpx.Response(401)

    fusion = _client_with(handler, api="sandboxfusion")
    res = run(fusion.exec(code="while 1: pass", timeout_s=1))
    assert res.killed_reason == "timeout" and res.timed_out and res.stdout == "x"
    with pytest.raises(SandboxError, match="no sessions"):
        run(fusion.session())
    own = _client_with(handler)
    with pytest.raises(SandboxError, match="overloaded"):
        run(own.exec("ls", timeout_s=1))
    with pytest.raises(SandboxError, match="token"):
        run(own.session())
    with pytest.raises(ValueError):
        run(own.exec(timeout_s=1))


def test_backends_are_exported_lazily_from_the_package():
    import agentrl.sandboxes as sandboxes

    assert sandboxes.LocalSandbox is LocalSandbox
    assert sandboxes.RemoteSandbox is RemoteSandbox
    assert sorted(sandboxes.__all__) == sandboxes.__all__
    with pytest.raises(AttributeError):
        sandboxes.NoSuchSandbox  # noqa: B018
