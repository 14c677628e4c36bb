"""Packaging: the plugin folders install inside the agentrl namespace and refuse their bare names."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PLUGIN_DIRS = {"envs": "agentrl.envs", "tools": "agentrl.tools", "sandboxes": "agentrl.sandboxes",
               "configs": "agentrl.configs"}


def _python(code: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("bare", sorted(PLUGIN_DIRS))
def test_bare_name_import_is_refused_from_repo_root(bare: str) -> None:
    out = _python(f"import {bare}")
    assert out.returncode != 0
    assert "ImportError" in out.stderr
    assert f"import it as '{PLUGIN_DIRS[bare]}'" in out.stderr


@pytest.mark.parametrize("bare", sorted(PLUGIN_DIRS))
def test_namespaced_import_works_from_anywhere(bare: str, tmp_path: Path) -> None:
    out = _python(f"import {PLUGIN_DIRS[bare]} as m; print(m.__name__)", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == PLUGIN_DIRS[bare]


def test_every_python_package_is_listed_in_pyproject() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    mapping = config["package-dir"]
    found = set()
    for pkg, folder in mapping.items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder)
            found.add(".".join([pkg, *rel.parts]))
    assert found - listed == set(), "add these packages to [tool.setuptools] packages"


def test_importing_agentrl_loads_no_heavy_or_optional_dependency() -> None:
    out = _python(
        "import sys, agentrl, agentrl.config, agentrl.registry, agentrl.types;"
        "heavy = [m for m in ('torch', 'transformers', 'vllm', 'ray', 'gymnasium', 'docker')"
        " if m in sys.modules]; print(heavy)"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_cli_help_and_envs_list_do_not_import_torch() -> None:
    out = _python(
        "import sys, io, contextlib; from agentrl.cli import main\n"
        "buf = io.StringIO()\n"
        "with contextlib.redirect_stdout(buf):\n"
        "    rc = main(['envs', 'list'])\n"
        "print(rc, 'torch' in sys.modules, 'arithmetic' in buf.getvalue())"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "False", "True"]


def test_public_api_is_sorted_and_every_name_resolves() -> None:
    import agentrl

    names = [n for n in agentrl.__all__ if n != "__version__"]
    assert names == sorted(names)
    for name in names:
        assert getattr(agentrl, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        agentrl.nope  # noqa: B018


def test_package_data_covers_every_file_a_package_ships() -> None:
    """The viewer's page (html, js, css) must be in the wheel: `agentrl view` needs no build step."""
    import fnmatch

    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    data = config["package-data"]
    static = REPO / "agentrl" / "viewer" / "static"
    files = sorted(p.relative_to(static.parent).as_posix() for p in static.iterdir() if p.is_file())
    assert {"static/index.html", "static/viewer.js", "static/viewer.css"} <= set(files)
    missing = [f for f in files if not any(fnmatch.fnmatch(f, g) for g in data.get("agentrl.viewer", []))]
    assert missing == [], "add these files to [tool.setuptools.package-data] agentrl.viewer"


def test_the_viewer_loads_no_model_server_or_trainer_code() -> None:
    out = _python(
        "import sys, agentrl.viewer;"
        "print([m for m in ('torch', 'transformers', 'vllm', 'ray', 'docker', 'matplotlib') if m in sys.modules])"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_readme_layout_names_every_package_and_each_says_its_layer() -> None:
    import ast

    readme = (REPO / "README.md").read_text()
    table = readme.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    missing = [p for p in packages if p != "agentrl" and f"`{p}`" not in table]
    assert not missing, f"README's layout table does not name {missing}"
    assert "`lifeline`" in table  # a module, not a package, but its own process-management layer
    folders = {"agentrl.envs": "envs", "agentrl.tools": "tools", "agentrl.sandboxes": "sandboxes"}
    for package in packages:
        if package in ("agentrl", "agentrl.configs"):
            continue
        folder = folders.get(package, package.replace(".", "/"))
        doc = ast.get_docstring(ast.parse((REPO / folder / "__init__.py").read_text())) or ""
        assert "Layer L" in doc, f"{folder}/__init__.py's docstring does not say which layer it sits in"


def test_no_two_test_modules_share_a_name() -> None:
    """pytest imports test modules by their file name (the folders are not packages): a second
    `test_x.py` anywhere stops the whole collection with "import file mismatch"."""
    from collections import Counter

    tests = Path(__file__).resolve().parents[1]
    names = Counter(p.name for p in tests.rglob("test_*.py") if "__pycache__" not in p.parts)
    assert [n for n, count in names.items() if count > 1] == []
