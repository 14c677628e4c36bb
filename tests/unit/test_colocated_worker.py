"""`ColocatedTrainerWorker` holds a trainer rank and the engine's server and delegates to them: the
blocking trainer calls run on a thread (the event loop stays free for generation), an update waits
for the previous push, and a checkpoint keeps the trainer's current version. Fakes stand in for the
trainer and the engine; tests/integration/test_colocated.py runs the real ones."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from agentrl.orchestration.trainer_group import ColocatedTrainerWorker
from agentrl.types import GatedRow, StepReport

GATED = GatedRow(row=1, reason="template", logprob_gap=0.0, mean_logprob_gap=0.0, log_ratio_spread=0.0, ess=1.0,
                 template_mismatches=2.0)


class FakeTrainer:
    rank = 0

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, str]] = []

    def _note(self, name: str, detail: Any) -> None:
        self.calls.append((name, detail, threading.current_thread().name))

    def train(self, trajectories: list[Any], policy_version: int | None = None,
              allowed_staleness: int = 0) -> StepReport:
        self._note("train", len(trajectories))
        return StepReport({"loss": 1.0}, [GATED])

    def save(self, path: str, data_position: dict[str, Any], *, weights_version: int | None = None) -> tuple[float, dict]:
        self._note("save", weights_version)
        return 0.5, {}

    def load(self, path: str, files: dict[str, bytes] | None = None) -> dict[str, Any]:
        self._note("load", files)
        return {"steps_done": 3}

    def export(self, version: int) -> tuple[str, float]:
        self._note("export", version)
        return "", 0.1

    def weight_endpoint(self) -> dict[str, Any]:
        return {"backend": "files", "location": "/w", "token": None, "nonce": "n"}


class FakeEngine:
    def __init__(self) -> None:
        self.phase_s = {"sleep_s": 0.25, "wake_s": 0.5}


class FakeServer:
    def __init__(self) -> None:
        self.weight_version = 0
        self.engine = FakeEngine()
        self.events: list[str] = []

    async def sleep(self, *, weights: bool) -> None:
        self.events.append(f"sleep weights={weights}")

    async def wake(self) -> None:
        self.events.append("wake")


def make_worker(release_weights: bool = False) -> tuple[ColocatedTrainerWorker, FakeTrainer, FakeServer]:
    worker = ColocatedTrainerWorker.__new__(ColocatedTrainerWorker)  # no engine, no model
    trainer, server = FakeTrainer(), FakeServer()
    worker.trainer, worker.server = trainer, server  # type: ignore[assignment]
    worker.release_weights, worker.trainer_version, worker._pushed = release_weights, 0, None
    return worker, trainer, server


def test_train_runs_the_trainer_on_a_thread_between_sleep_and_wake() -> None:
    worker, trainer, server = make_worker()
    report = asyncio.run(worker.train([object(), object()]))
    metrics = report.metrics
    assert trainer.calls[0][:2] == ("train", 2)
    assert trainer.calls[0][2] != threading.main_thread().name
    assert server.events == ["sleep weights=False", "wake"]
    assert worker.trainer_version == 1
    assert metrics == {"loss": 1.0, "time/engine_sleep_s": 0.25, "time/wait_push_s": metrics["time/wait_push_s"],
                       "time/engine_wake_s": 0.5}
    assert report.gated == [GATED]  # the gate's decisions come back as the trainer gave them


def test_train_waits_for_the_previous_push() -> None:
    worker, trainer, server = make_worker(release_weights=True)
    worker.trainer_version = 1  # an update the engine has not received yet

    async def go() -> StepReport:
        task = asyncio.create_task(worker.train([object()]))
        await asyncio.sleep(0.05)
        assert trainer.calls == []  # still waiting
        server.weight_version = 1
        assert worker._pushed is not None
        worker._pushed.set()
        return await task

    report = asyncio.run(go())
    assert [c[0] for c in trainer.calls] == ["train"]
    assert server.events == ["sleep weights=True"]  # released weights come back with the next push
    assert "time/engine_wake_s" not in report.metrics
    assert worker.trainer_version == 2


def test_save_keeps_the_trainer_version_and_the_rest_delegates() -> None:
    worker, trainer, _ = make_worker()
    worker.trainer_version = 4
    assert asyncio.run(worker.save("/ckpt", {"steps_done": 4})) == (0.5, {})
    assert asyncio.run(worker.load("/ckpt", {"a": b"x"})) == {"steps_done": 3}
    assert asyncio.run(worker.export(5)) == ("", 0.1)
    assert asyncio.run(worker.ready()) == 0
    assert asyncio.run(worker.weight_endpoint())["location"] == "/w"
    assert [c[:2] for c in trainer.calls] == [("save", 4), ("load", {"a": b"x"}), ("export", 5)]
    assert all(c[2] != threading.main_thread().name for c in trainer.calls)


def test_the_engine_loads_the_resolved_model_the_trainer_loads(monkeypatch) -> None:
    """The config keeps the name the user gave (`smollm2-135m-instruct`); the engine must get the
    directory it was resolved to, as the trainer does, or it looks the name up on a model hub."""
    import agentrl.inference.colocated as colocated
    import agentrl.orchestration.trainer_group as trainer_group
    from agentrl.config import load_config

    config = load_config(None, ["model.path=smollm2-135m-instruct", "inference.max_model_len=256"])
    built: dict[str, Any] = {}

    class Trainer:
        def __init__(self, cfg: dict[str, Any], model_path: str, weights_dir: str, **kwargs: Any) -> None:
            self.config, self.model_path, self.rank = config, model_path, 0

    class Engine:
        def __init__(self, model_path: str, **kwargs: Any) -> None:
            built["model_path"], built["max_model_len"] = model_path, kwargs["max_model_len"]

        def start_blocking(self) -> None:
            built["started"] = True

    monkeypatch.setattr(trainer_group, "TrainerWorker", Trainer)
    monkeypatch.setattr(colocated, "InProcessVLLM", Engine)
    monkeypatch.setattr(colocated, "ColocatedServer", lambda engine: FakeServer())
    ColocatedTrainerWorker(config.model_dump(), "/models/smollm2-resolved", "/w")
    assert built == {"model_path": "/models/smollm2-resolved", "max_model_len": 256, "started": True}
