"""The real artefacts: the built wheel's layout and the installed `agentrl` console script."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _agentrl(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("agentrl", path=str(Path(sys.executable).parent)) or shutil.which("agentrl")
    if exe is None:
        pytest.skip("the agentrl console script is not installed (pip install -e .)")
    return subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})


def test_wheel_installs_plugins_inside_the_agentrl_namespace(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(REPO)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    (wheel,) = tmp_path.glob("agentrl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for expected in ("agentrl/cli.py", "agentrl/envs/arithmetic.py", "agentrl/tools/calculator.py",
                     "agentrl/sandboxes/protocol.py", "agentrl/configs/arithmetic.yaml"):
        assert expected in names, expected
    top_level = {n.split("/")[0] for n in names}
    assert {"envs", "tools", "sandboxes", "configs", "tests"} & top_level == set()
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "agentrl = agentrl.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_console_script_answers(tmp_path: Path) -> None:
    listed = _agentrl("envs", "list", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    names = [line.split()[0] for line in listed.stdout.splitlines() if line.strip()]
    assert {"agent", "arithmetic", "retool", "swe"} <= set(names), listed.stdout
    bad = _agentrl("validate", "env=arithmetic", "trainer.lrr=1", cwd=tmp_path)
    assert bad.returncode == 1
    assert "trainer.lrr: unknown key. Did you mean 'trainer.lr'?" in bad.stderr
    good = _agentrl("validate", "env=arithmetic", cwd=tmp_path)
    assert good.returncode == 0 and good.stdout.startswith("Config OK for 'agentrl run': env=arithmetic")
    version = _agentrl("version", cwd=tmp_path)
    assert version.stdout.strip().startswith("agentrl 0.")
