"""Start-up failures say what failed, why and what to do: Ray (a transient timeout is retried once,
a second failure names the temp folder and the fixes), the trainer and the inference engine as the
run starts them, and `agentrl run` prints the message with exit 1 and no traceback."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from agentrl.errors import ConfigError, PreflightError, ServerUnavailableError, StartupError
from agentrl.orchestration.startup import init_ray, starting

RAY_TIMEOUT = ("The current node timed out during startup. This could happen because some of the raylet failed "
               "to startup or the GCS has become overloaded.")
THEN = "start it again with: agentrl run runs/mine/config.yaml run.name=mine"


class FakeRay:
    """`ray.init` failing the first `failures` times; counts the calls and the shutdowns between."""

    def __init__(self, failures: int, error: Exception) -> None:
        self.failures, self.error = failures, error
        self.calls: list[str | None] = []
        self.shutdowns = 0

    def init(self, address: str | None = None, **_: Any) -> None:
        self.calls.append(address)
        if len(self.calls) <= self.failures:
            raise self.error

    def shutdown(self) -> None:
        self.shutdowns += 1


@pytest.fixture
def fake_ray(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    import ray

    def make(failures: int, error: Exception | None = None) -> FakeRay:
        fake = FakeRay(failures, error or Exception(RAY_TIMEOUT))
        monkeypatch.setattr(ray, "init", fake.init)
        monkeypatch.setattr(ray, "shutdown", fake.shutdown)
        monkeypatch.setattr(ray, "is_initialized", lambda: False)
        return fake

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    return make


def test_a_transient_ray_timeout_is_retried_once_after_ending_what_it_started(fake_ray) -> None:
    ray = fake_ray(failures=1)
    init_ray(None, THEN)
    assert ray.calls == ["local", "local"] and ray.shutdowns == 1  # a Ray of its own, never a stray cluster


def test_ray_failing_twice_names_the_temp_folder_its_space_and_the_fixes(fake_ray, tmp_path: Path) -> None:
    ray = fake_ray(failures=2)
    with pytest.raises(StartupError) as caught:
        init_ray(None, THEN)
    message = str(caught.value)
    assert len(ray.calls) == 2 and caught.value.part.startswith("Ray")
    assert message.startswith(f"Could not start Ray (a local instance, sessions under {tmp_path / 'ray'}; tried "
                              f"twice): Exception: {RAY_TIMEOUT.split('. ')[0]}")
    assert "End stale Ray processes with 'ray stop --force'" in message
    assert f"make room on the disk of {tmp_path / 'ray'} (its disk has " in message and " MiB free)" in message
    assert "or set RAY_TMPDIR to a folder on a disk with room" in message
    assert message.endswith(f"; then {THEN}.")
    assert isinstance(caught.value.__cause__, Exception) and RAY_TIMEOUT in str(caught.value.__cause__)


def test_joining_ray_address_is_not_retried_and_says_to_check_it_or_unset_it(fake_ray, monkeypatch) -> None:
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.9:6379")
    ray = fake_ray(failures=1, error=ConnectionError("could not connect to 10.0.0.9:6379"))
    with pytest.raises(StartupError) as caught:
        init_ray(None, THEN)
    assert ray.calls == ["10.0.0.9:6379"] and ray.shutdowns == 0
    message = str(caught.value)
    assert message.startswith("Could not start Ray (joining RAY_ADDRESS=10.0.0.9:6379): ConnectionError: could not")
    assert "('ray status'), or unset RAY_ADDRESS" in message and message.endswith(f"then {THEN}.")


def test_cluster_address_keeps_its_preflight_message(fake_ray) -> None:
    fake_ray(failures=1, error=ConnectionError("no head there"))
    with pytest.raises(PreflightError, match=r"cluster.address=h:1: cannot join .*'ray start --head'"):
        init_ray("h:1", THEN)


def test_starting_converts_any_error_and_lets_config_errors_and_ctrl_c_through() -> None:
    with pytest.raises(StartupError) as caught, starting("the sandbox hosts", "Check the backend", THEN):
        raise OSError(98, "Address already in use")
    assert str(caught.value) == (f"Could not start the sandbox hosts: OSError: [Errno 98] Address already in use. "
                                 f"Check the backend; then {THEN}.")
    with pytest.raises(ConfigError, match="bad key"), starting("the trainer", "fix"):
        raise ConfigError("bad key")
    with pytest.raises(KeyboardInterrupt), starting("the trainer", "fix"):
        raise KeyboardInterrupt


class _NoTrainer:
    def shutdown(self) -> None:
        pass


def _run_for(tmp_path: Path, *overrides: str) -> Any:
    """A `Run` over a real config, with the parts `_open` needs before the trainer and the engine."""
    from agentrl.config import load_config
    from agentrl.orchestration.checkpoints import CheckpointStore
    from agentrl.orchestration.driver import Run

    config = load_config(None, ["env=arithmetic", "run.name=mine", f"run.output_dir={tmp_path}", *overrides])
    job = SimpleNamespace(config=config, plan=SimpleNamespace(cluster=None, colocated=False), sandbox_hosts=None,
                          make_env=None, model_path="/models/tiny", template=None, gateway=None)
    run = Run(job)  # type: ignore[arg-type]
    books = SimpleNamespace(run_dir=tmp_path / "mine", store=CheckpointStore(tmp_path / "mine" / "checkpoints"))
    return run, books


async def _open(run: Any, books: Any) -> None:
    with run.signals.installed():  # as run_training does: the handlers `_open` installs are restored after
        async with contextlib.AsyncExitStack() as stack:
            await run._open(stack, books)


def test_a_trainer_that_fails_to_start_is_named_with_why_and_what_to_do(tmp_path: Path, monkeypatch) -> None:
    import agentrl.orchestration.driver as driver
    import agentrl.orchestration.trainer_group as trainer_group

    def no_gpu(*_: Any, **__: Any) -> None:
        raise RuntimeError("No CUDA GPUs are available")

    monkeypatch.setattr(driver, "_init_ray", lambda *_: None)
    monkeypatch.setattr(trainer_group, "TrainerGroup", no_gpu)
    run, books = _run_for(tmp_path, "trainer.device=cpu")
    with pytest.raises(StartupError) as caught:
        asyncio.run(_open(run, books))
    message = str(caught.value)
    assert message.startswith("Could not start the trainer (fsdp2, model.path=/models/tiny, trainer.device=cpu): "
                              "RuntimeError: No CUDA GPUs are available. ")
    assert "('agentrl doctor')" in message and f"the logs in {tmp_path / 'mine' / 'logs'}" in message
    assert message.endswith(f"then start it again with: agentrl run {tmp_path / 'mine' / 'config.yaml'} "
                            f"run.name=mine run.output_dir={tmp_path}.")


def test_an_engine_that_fails_to_start_is_named_with_its_log_and_what_to_do(tmp_path: Path, monkeypatch) -> None:
    import agentrl.orchestration.driver as driver
    import agentrl.orchestration.placement as placement
    import agentrl.orchestration.trainer_group as trainer_group

    async def exits(*_: Any, **__: Any) -> None:
        raise ServerUnavailableError("The vllm server exited with code 1 before it became healthy; command: "
                                     "python -m vllm ...\nlast lines of runs/mine/logs/server-0.log:\nImportError: x")

    monkeypatch.setattr(driver, "_init_ray", lambda *_: None)
    monkeypatch.setattr(trainer_group, "TrainerGroup", lambda *_, **__: _NoTrainer())
    monkeypatch.setattr(placement, "start_inference", exits)
    run, books = _run_for(tmp_path, "inference.engine=vllm")
    with pytest.raises(StartupError) as caught:
        asyncio.run(_open(run, books))
    message = str(caught.value)
    assert message.startswith("Could not start the inference engine (vllm, model.path=/models/tiny): The vllm "
                              "server exited with code 1 before it became healthy")
    assert "ImportError: x" in message and "AGENTRL_VLLM_PYTHON" in message
    assert isinstance(caught.value.__cause__, ServerUnavailableError)


def test_agentrl_run_prints_a_start_up_failure_without_a_traceback(monkeypatch, capsys) -> None:
    import agentrl.cli as cli
    import agentrl.orchestration.driver as driver

    def fails(config: object) -> None:
        with starting("Ray (a local instance)", "End stale Ray processes with 'ray stop --force'", THEN):
            raise Exception(RAY_TIMEOUT)

    monkeypatch.setattr(driver, "run_training", fails)
    monkeypatch.setattr(cli, "_log_to_console", lambda: None)
    assert cli.main(["run", "env=arithmetic", "run.name=mine"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("agentrl run: Could not start Ray (a local instance): Exception: The current node timed "
                          "out during startup") and "ray stop --force" in err and THEN in err
    assert "Traceback" not in err
