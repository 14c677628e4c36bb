"""Host paths listed read-only (`ro_paths`) under /tmp, against real bubblewrap: the local code
sandbox and an MCP stdio server both see them at the same place, read-only, and see nothing beside them.

Each test plants a secret next to what it lists, in the host's /tmp and in a folder on the way to a
deeper listed path, and asserts the secret is absent inside, as the isolation promises.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import textwrap
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agentrl.sandboxes.bwrap import find_bwrap
from agentrl.sandboxes.local import LocalSandbox

pytestmark = pytest.mark.skipif(
    find_bwrap() is None, reason="bubblewrap is not installed (apt-get install bubblewrap)"
)


@dataclass
class Planted:
    folder: Path  # listed: a folder directly in /tmp
    file: Path  # listed: a single file directly in /tmp
    deep: Path  # listed: a folder two levels down a folder of /tmp
    secrets: list[Path]  # not listed: beside each of the above


@pytest.fixture
def planted() -> Iterator[Planted]:
    tag = uuid.uuid4().hex[:12]
    folder, file, top = Path(f"/tmp/agentrl-ro-{tag}"), Path(f"/tmp/agentrl-ro-{tag}.json"), Path(f"/tmp/agentrl-deep-{tag}")
    deep = top / "a" / "data"
    secrets = [Path(f"/tmp/agentrl-secret-{tag}"), top / "a" / "secret.txt", top / "secret.txt"]
    deep.mkdir(parents=True)
    folder.mkdir()
    (folder / "data.txt").write_text("folder data")
    (folder / "sub").mkdir()
    (folder / "sub" / "more.txt").write_text("nested")
    file.write_text('{"file": "data"}')
    (deep / "rows.txt").write_text("deep data")
    for secret in secrets:
        secret.write_text(f"secret {tag}")
    for path in [folder, folder / "sub", top, top / "a", deep]:
        path.chmod(0o755)  # as root, jobs run under a uid of their own
    try:
        yield Planted(folder, file, deep, secrets)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(top, ignore_errors=True)
        file.unlink(missing_ok=True)
        secrets[0].unlink(missing_ok=True)


LOOK = """
import json, os
def attempt_write(path):
    try:
        open(path, "w").write("x")
        return "written"
    except OSError as exc:
        return exc.strerror
print(json.dumps({
    "folder": open(os.path.join(folder, "data.txt")).read(),
    "nested": open(os.path.join(folder, "sub", "more.txt")).read(),
    "file": open(file).read(),
    "deep": open(os.path.join(deep, "rows.txt")).read(),
    "tmp": sorted(os.listdir("/tmp")),
    "on_the_way": sorted(os.listdir(os.path.dirname(deep))),
    "secrets": [os.path.exists(s) for s in secrets],
    "write_in_folder": attempt_write(os.path.join(folder, "new.txt")),
    "write_the_file": attempt_write(file),
    "write_beside_deep": attempt_write(os.path.join(os.path.dirname(deep), "new.txt")),
    "write_tmp": attempt_write("/tmp/scratch.txt"),
}))
"""


def test_the_code_sandbox_sees_a_folder_and_a_file_under_tmp_read_only_and_nothing_beside(
        planted: Planted) -> None:
    paths = [str(planted.folder), str(planted.file), str(planted.deep)]

    code = f"folder, file, deep = {paths!r}\nsecrets = {[str(s) for s in planted.secrets]!r}\n{LOOK}"

    async def go() -> tuple[dict, dict, str]:
        sandbox = LocalSandbox(max_concurrency=1, pool_size=1, ro_paths=paths)
        try:
            first = await sandbox.exec(code=code, timeout_s=60)
            assert first.exit_code == 0, first.stderr
            # the pooled sandbox is wiped between jobs: the scratch file goes, the listed paths stay
            second = await sandbox.exec(code=code, timeout_s=60)
            assert second.exit_code == 0, second.stderr
            shell = await sandbox.exec(f"cat {planted.folder}/data.txt {planted.file}; ls -A /tmp", timeout_s=60)
            return json.loads(first.stdout), json.loads(second.stdout), shell.stdout
        finally:
            await sandbox.close()

    first, second, shell = asyncio.run(go())
    assert first["folder"] == "folder data" and first["nested"] == "nested"
    assert first["file"] == '{"file": "data"}' and first["deep"] == "deep data"
    listed = sorted([planted.folder.name, planted.file.name, planted.deep.parents[1].name])
    assert first["tmp"] == listed  # the private /tmp holds the listed paths and nothing of the host's
    assert first["on_the_way"] == ["data"]  # no secret.txt beside the deep path
    assert first["secrets"] == [False, False, False]
    assert first["write_in_folder"] == first["write_the_file"] == first["write_beside_deep"] == "Read-only file system"
    assert first["write_tmp"] == "written"
    assert second == first  # scratch.txt was wiped (else /tmp would list it), the listed paths kept
    assert shell == "folder data" + '{"file": "data"}' + "".join(f"{name}\n" for name in listed)
    for secret in planted.secrets:
        assert secret.read_text().startswith("secret ")  # the host's files are untouched


SERVER = '''
"""A tiny MCP server started from a folder under /tmp: where it runs and what it can see."""
import os

from fastmcp import FastMCP

mcp = FastMCP("agentrl-test-ro-paths")


@mcp.tool
def where() -> str:
    """The server's working directory."""
    return os.getcwd()


@mcp.tool
def read(path: str) -> str:
    """A file's text, or the error reading it."""
    try:
        return open(path).read()
    except OSError as exc:
        return f"error: {exc.strerror}"


@mcp.tool
def listing(path: str) -> str:
    """The sorted names in a folder."""
    return " ".join(sorted(os.listdir(path)))


if __name__ == "__main__":
    mcp.run(show_banner=False)
'''


@pytest.mark.slow
def test_an_mcp_server_under_tmp_starts_there_and_sees_only_its_ro_paths(
        planted: Planted, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mcp")
    pytest.importorskip("fastmcp")
    from agentrl.envs.mcp_env import McpEnv
    from agentrl.types import Action, ToolCall

    (planted.folder / "server.py").write_text(textwrap.dedent(SERVER))
    monkeypatch.chdir(planted.folder)  # relative args and ro_paths, as the README's example
    env = McpEnv(servers=[{"name": "demo", "command": "python", "args": ["server.py"],
                           "ro_paths": [".", str(planted.deep)]}], tool_timeout_s=60.0, max_turns=20)
    row = {"prompt": [{"role": "user", "content": "Where are you?"}], "data_source": "agentrl/arithmetic",
           "reward_model": {"style": "rule", "ground_truth": "5"}}

    def ask(name: str, **arguments: str) -> str:
        obs, *_ = env.step(Action(f"calling {name}", (ToolCall(name, arguments, id=f"call_{name}"),)))
        return str(obs[0]["content"])

    try:
        _, info = env.reset(options={"row": row})
        assert {t["function"]["name"] for t in info["tools"]} == {"where", "read", "listing"}
        assert ask("where") == str(planted.folder)
        assert ask("read", path="data.txt") == "folder data"
        assert ask("read", path=str(planted.deep / "rows.txt")) == "deep data"
        assert ask("listing", path="/tmp") == " ".join(sorted([planted.folder.name, planted.deep.parents[1].name]))
        assert ask("listing", path=str(planted.deep.parent)) == "data"
        for secret in planted.secrets:
            assert ask("read", path=str(secret)) == "error: No such file or directory"
        assert ask("read", path=str(planted.file)) == "error: No such file or directory"  # not listed here
    finally:
        env.close()
