"""Every `type: ignore` in a strictly checked module names its error code and, on the same line, why.

The strict modules are the ones pyproject.toml's strict mypy override lists (the override that sets
`disallow_untyped_defs`), so this check grows with that list. An ignore reads
`# type: ignore[code]  # why`: the code keeps it from hiding other errors on the line, and the
reason tells the next reader when it can go (`# type: ignore[attr-defined]  # vllm ships no stubs`).
"""

from __future__ import annotations

import io
import re
import tokenize
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_IGNORE = re.compile(r"#\s*type:\s*ignore\b(?P<codes>\[[^\]]*\])?(?P<rest>.*)$")
_REASON = re.compile(r"^\s*#\s*\S")
# Lines of strict modules whose reason is still to be written, each exactly as it reads (so a new
# or changed ignore in the same file is still caught). Empty: every ignore says why.
_REASON_PENDING: set[tuple[str, str]] = set()


def strict_patterns(pyproject: dict) -> list[str]:
    """The module patterns of the strict mypy override (`agentrl.rollout.*` style)."""
    overrides = pyproject["tool"]["mypy"]["overrides"]
    strict = [o for o in overrides if o.get("disallow_untyped_defs")]
    assert len(strict) == 1, "pyproject.toml should have exactly one strict mypy override"
    modules = strict[0]["module"]
    return [modules] if isinstance(modules, str) else list(modules)


def module_name(path: Path, package_dirs: dict[str, Path]) -> str:
    """The installed module name of a source file (`tools/core.py` -> `agentrl.tools.core`)."""
    for package, folder in sorted(package_dirs.items(), key=lambda kv: -len(kv[0])):
        if path.is_relative_to(folder):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            return ".".join(parts)
    raise ValueError(f"{path} is in none of the package folders {sorted(package_dirs)}")


def matches(module: str, pattern: str) -> bool:
    """mypy's override matching: `a.b.*` is `a.b` and everything under it; otherwise the exact name."""
    if pattern.endswith(".*"):
        package = pattern[:-2]
        return module == package or module.startswith(package + ".")
    return module == pattern


def source_files(pyproject: dict) -> dict[str, Path]:
    """Every module of the package, by its installed name."""
    package_dirs = {name: REPO / folder for name, folder in pyproject["tool"]["setuptools"]["package-dir"].items()}
    files: dict[str, Path] = {}
    for folder in set(package_dirs.values()):
        for path in folder.rglob("*.py"):
            if "__pycache__" not in path.parts:
                files[module_name(path, package_dirs)] = path
    return files


def unexplained_ignores(source: str) -> list[tuple[int, str]]:
    """(line number, line) of each `type: ignore` comment without an error code or a reason after it."""
    lines = source.splitlines()
    found = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        match = _IGNORE.search(token.string)
        if match and (not match["codes"] or not _REASON.match(match["rest"])):
            found.append((token.start[0], lines[token.start[0] - 1].strip()))
    return found


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_each_strict_pattern_names_modules_that_exist(pyproject: dict) -> None:
    modules = source_files(pyproject)
    empty = [p for p in strict_patterns(pyproject) if not any(matches(m, p) for m in modules)]
    assert empty == []


def test_every_type_ignore_in_strict_modules_names_its_code_and_reason(pyproject: dict) -> None:
    patterns = strict_patterns(pyproject)
    strict = {m: p for m, p in source_files(pyproject).items() if any(matches(m, pat) for pat in patterns)}
    assert "agentrl.types" in strict and "agentrl.tools.core" in strict
    bad = [f"{path.relative_to(REPO)}:{number}: {line}"
           for path in strict.values() for number, line in unexplained_ignores(path.read_text())
           if (str(path.relative_to(REPO)), line) not in _REASON_PENDING]
    assert bad == [], "write each as `# type: ignore[code]  # why`:\n" + "\n".join(bad)


def test_the_check_tells_explained_ignores_from_bare_ones() -> None:
    source = (
        "a = f()  # type: ignore\n"
        "b = g()  # type: ignore[attr-defined]\n"
        "c = h()  # type: ignore[attr-defined]  # vllm ships no stubs\n"
        "d = k()  # type: ignore  # a reason but no code\n"
        "e = '# type: ignore'\n"
        "f = m()  # type: ignore[misc,arg-type]  #\n"
        "g = n()  # noqa: E501  # type: ignore[union-attr]  # the session is set by reset\n"
    )
    assert [line for line, _ in unexplained_ignores(source)] == [1, 2, 4, 6]


def test_module_names_follow_the_installed_layout() -> None:
    dirs = {"agentrl": REPO / "agentrl", "agentrl.tools": REPO / "tools"}
    assert module_name(REPO / "tools" / "core.py", dirs) == "agentrl.tools.core"
    assert module_name(REPO / "tools" / "__init__.py", dirs) == "agentrl.tools"
    assert module_name(REPO / "agentrl" / "rollout" / "worker.py", dirs) == "agentrl.rollout.worker"
    assert matches("agentrl.rollout", "agentrl.rollout.*") and matches("agentrl.rollout.worker", "agentrl.rollout.*")
    assert not matches("agentrl.rollouts", "agentrl.rollout.*") and not matches("agentrl.trainer.step", "agentrl.trainer")
