"""Every process the library starts goes through `agentrl.child_process`: the source of agentrl/,
envs/, tools/ and sandboxes/ is parsed (never run) and no call that starts a process
(`subprocess.Popen`, `subprocess.run`, `subprocess.call`, `subprocess.check_*`,
`asyncio.create_subprocess_*`, `os.fork`, `os.exec*`, `os.spawn*`, `os.system`, `os.posix_spawn*`)
may appear outside the files `child_process.EXEMPT_MODULES` names, each with its reason."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from agentrl.child_process import EXEMPT_MODULES

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = ("agentrl", "envs", "tools", "sandboxes")
_SUBPROCESS = {"Popen", "run", "call", "check_call", "check_output", "getoutput", "getstatusoutput"}


def _starts_process(module: str, attr: str) -> bool:
    if module == "subprocess":
        return attr in _SUBPROCESS
    if module == "asyncio":
        return attr.startswith("create_subprocess_")
    if module == "os":
        return attr in ("fork", "forkpty", "system", "popen") or attr.startswith(("exec", "spawn", "posix_spawn"))
    return False


def process_starts(source: str) -> list[tuple[int, str]]:
    """(line, call) of each process start in `source`: `subprocess.Popen(...)`, `from os import fork`
    and a call of what it imported, `asyncio.subprocess` aside (it only names the pipe constants)."""
    tree = ast.parse(source)
    imported: dict[str, tuple[str, str]] = {}  # a local name -> (module, attribute) it was imported as
    modules: dict[str, str] = {}  # a local name -> the module it stands for (`import subprocess as sp`)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                modules[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module in ("subprocess", "asyncio", "os"):
            for alias in node.names:
                imported[alias.asname or alias.name] = (node.module, alias.name)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            module = modules.get(func.value.id, func.value.id)
            if _starts_process(module, func.attr):
                found.append((node.lineno, f"{func.value.id}.{func.attr}"))
        elif isinstance(func, ast.Name) and func.id in imported and _starts_process(*imported[func.id]):
            found.append((node.lineno, func.id))
    return found


def test_the_scanner_finds_each_kind_of_start():
    source = ("import os, subprocess as sp, asyncio\nfrom os import execv\nfrom subprocess import check_output\n"
              "sp.Popen(['x'])\nasyncio.create_subprocess_exec('x')\nos.fork()\nos.execve('x', [], {})\n"
              "os.spawnlp(0, 'x')\nos.system('x')\nexecv('x', [])\ncheck_output(['x'])\nsp.run(['x'])\n"
              "os.kill(1, 9)\nasyncio.subprocess.PIPE\n")
    assert process_starts(source) == [(4, "sp.Popen"), (5, "asyncio.create_subprocess_exec"), (6, "os.fork"),
                                      (7, "os.execve"), (8, "os.spawnlp"), (9, "os.system"), (10, "execv"),
                                      (11, "check_output"), (12, "sp.run")]


def test_the_exempt_files_exist_and_say_why():
    for path, reason in EXEMPT_MODULES.items():
        assert (ROOT / path).is_file(), path
        assert len(reason) > 20, path


@pytest.mark.parametrize("family", FAMILIES)
def test_no_process_is_started_outside_child_process(family):
    offenders = []
    files = sorted((ROOT / family).rglob("*.py"))
    assert files
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        if rel in EXEMPT_MODULES:
            continue
        offenders += [f"{rel}:{line}: {call}" for line, call in process_starts(path.read_text())]
    assert offenders == [], ("start these processes through agentrl.child_process (ChildProcess, run_probe, "
                             "arun_probe), or name the file and its reason in child_process.EXEMPT_MODULES:\n"
                             + "\n".join(offenders))


def test_the_exempt_files_do_start_processes():
    """An exemption that no longer starts anything is stale: drop it."""
    for path in EXEMPT_MODULES:
        assert process_starts((ROOT / path).read_text()), path
