"""Shared pytest set-up: markers that skip where hardware or daemons are missing, asset paths."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_ASSETS = Path(os.environ.get("AGENTRL_ASSETS", REPO_ROOT.parent / "shared" / "assets"))


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _docker_available() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    needs = {"gpu": None, "docker": None}
    for item in items:
        for marker, probe in (("gpu", _cuda_available), ("docker", _docker_available)):
            if marker in item.keywords:
                if needs[marker] is None:
                    needs[marker] = probe()
                if not needs[marker]:
                    item.add_marker(pytest.mark.skip(reason=f"needs a {marker} ({marker} not available here)"))


@pytest.fixture(scope="session")
def assets() -> Path:
    if not SHARED_ASSETS.is_dir():
        pytest.skip(f"shared assets not found at {SHARED_ASSETS}; set AGENTRL_ASSETS")
    return SHARED_ASSETS


# Property tests explore new inputs locally, but CI replays a fixed set so a run can never fail by
# luck; a failure hypothesis finds locally is fixed, not re-rolled.
try:
    from hypothesis import settings as _hypothesis_settings

    _hypothesis_settings.register_profile("ci", derandomize=True, print_blob=True)
    if os.environ.get("CI"):
        _hypothesis_settings.load_profile("ci")
except ImportError:  # hypothesis is a dev extra
    pass
