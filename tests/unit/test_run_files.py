"""The run's one write path: a write that fails where it writes (a full disk, a read-only filesystem,
a run directory that vanished) is one `RunWriteError` naming the file, the cause, the mount and the
fix; the driver adds the command that continues the run; the ledger and metrics.jsonl agree about
the last step after such a stop; and driver.log never prints logging's traceback on the console."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import shutil
from pathlib import Path

import pytest

from agentrl.errors import RunWriteError
from agentrl.records.run_files import append_text, classify_write_error, mount_of, replace_text, writing

needs_dev_full = pytest.mark.skipif(not Path("/dev/full").exists(), reason="/dev/full makes a real ENOSPC")


@needs_dev_full
def test_a_full_disk_is_named_with_its_mount_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(RunWriteError) as caught:
        append_text("/dev/full", "x" * 10_000)  # /dev/full: every write fails with a real ENOSPC
    error = caught.value
    assert error.path == "/dev/full" and error.cause == "the disk is full"
    assert isinstance(error.__cause__, OSError) and error.__cause__.errno == errno.ENOSPC
    assert error.fix.startswith("Free space on /dev") and error.fix.endswith("or move run.output_dir")
    error.continue_with("agentrl run runs/x/config.yaml resume=true run.name=x")
    assert str(error).startswith("Could not write /dev/full: the disk is full (OSError: [Errno 28]")
    assert str(error).endswith("or move run.output_dir, then resume with: "
                               "agentrl run runs/x/config.yaml resume=true run.name=x.")
    error.continue_with("agentrl run runs/x/config.yaml run.name=x", resume=False)
    assert "then start it again (no checkpoint was written yet) with: agentrl run" in str(error)


def test_a_quota_a_read_only_filesystem_and_a_denied_write_each_say_their_cause(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    cases = {errno.EDQUOT: ("the disk quota is exceeded", "raise the quota"),
             errno.EROFS: ("the filesystem is read-only", f"Remount {mount_of(tmp_path).split(' (')[0]} read-write"),
             errno.EACCES: ("permission was denied", f"write access to {tmp_path}")}
    for code, (cause, fix) in cases.items():
        with pytest.raises(RunWriteError) as caught, writing(path):
            raise OSError(code, errno.errorcode[code], str(path))
        assert caught.value.cause == cause and fix in caught.value.fix, caught.value
        assert caught.value.path == str(path) and "or move run.output_dir" in caught.value.fix


def test_a_vanished_run_directory_is_told_apart_from_a_folder_never_made(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    append_text(run_dir / "ledger.jsonl", "{}\n")
    shutil.rmtree(run_dir)  # deleted (or unmounted) while the run writes to it
    with pytest.raises(RunWriteError) as caught:
        append_text(run_dir / "ledger.jsonl", "{}\n")
    assert caught.value.cause.startswith("the run directory is gone")
    assert f"Restore or remount {run_dir}" in caught.value.fix
    assert not run_dir.exists(), "nothing recreated it"
    # A subfolder the code never made, under a run directory that is there, is a bug: raised as it is.
    run_dir.mkdir()
    with pytest.raises(FileNotFoundError):
        append_text(run_dir / "never-made" / "x.jsonl", "{}\n", run_dir)


def test_errors_that_crossed_a_process_as_text_are_classified_and_others_are_not(tmp_path: Path) -> None:
    remote = RuntimeError("ray::TrainerActor.export() (pid=7)\n  OSError: [Errno 28] No space left on device")
    error = classify_write_error(remote, tmp_path / "weights", tmp_path)
    assert error is not None and error.cause == "the disk is full"
    assert classify_write_error(RuntimeError("CUDA out of memory"), tmp_path, tmp_path) is None
    assert classify_write_error(OSError(errno.EBADF, "bad file descriptor"), tmp_path, tmp_path) is None


def test_replace_text_leaves_the_old_file_and_no_temporary_file_when_the_write_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "run_identity.json"
    replace_text(path, "old")

    def full(self: Path, text: str) -> int:
        with self.open("w") as f:
            f.write(text[:2])
        raise OSError(errno.ENOSPC, "No space left on device", str(self))

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(RunWriteError, match="the disk is full"):
        replace_text(path, "new text")
    monkeypatch.undo()
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["run_identity.json"]


@needs_dev_full
def test_rollout_log_on_a_full_disk_raises_the_write_error_and_leaves_no_partial_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agentrl.records.trajectory_log import write_trajectories

    real_open = Path.open

    def onto_dev_full(self: Path, mode: str = "r", *args, **kwargs):  # the temporary file sits on a full disk
        if self.name.endswith(".tmp") and "w" in mode:
            real_open(self, mode).close()
            return real_open(Path("/dev/full"), mode, *args, **kwargs)
        return real_open(self, mode, *args, **kwargs)

    monkeypatch.setattr(Path, "open", onto_dev_full)
    with pytest.raises(RunWriteError) as caught:
        write_trajectories(tmp_path / "rollouts" / "step-000001.jsonl", ({"x": "y" * 9000} for _ in range(3)),
                           run_dir=tmp_path)
    monkeypatch.undo()
    assert caught.value.path == str(tmp_path / "rollouts" / "step-000001.jsonl")
    assert caught.value.cause == "the disk is full"
    assert list((tmp_path / "rollouts").iterdir()) == [], "the temporary file was removed"


def test_a_step_whose_records_fail_is_in_neither_the_ledger_nor_metrics(tmp_path: Path) -> None:
    """The driver's order: rollout log, metrics row, then the step's `trained` lines. A full disk at
    the rollout log of step 2 leaves steps 0-1 in both files and step 2 in neither; its prompts are
    journaled unfinished (trained again by the resume) and the journal balances."""
    from test_schedule import FakeWorld, classify_equal

    from agentrl.orchestration.ledger import PromptLedger, PromptSampler, journal_balance, read_journal
    from agentrl.orchestration.schedule import Scheduler, StepRecord
    from agentrl.records.metrics import MetricsLogger

    world = FakeWorld(seed=5)
    ledger = PromptLedger(tmp_path / "ledger.jsonl")
    ledger.hold_trained = True
    logger = MetricsLogger(tmp_path, ["jsonl"], total_steps=4)

    async def after(record: StepRecord) -> None:
        if record.step == 2:
            with writing(tmp_path / "rollouts" / "step-000003.jsonl", tmp_path):
                raise OSError(errno.ENOSPC, "No space left on device")
        logger.log(record.step, {"loss": 0.1})
        ledger.commit_trained()

    s = Scheduler(mode="sync", prompts_per_step=3, sampler=PromptSampler(20, seed=1), ledger=ledger,
                  rollout=world.rollout, train=world.train, push=world.push, after_step=after,
                  classify=classify_equal)
    with pytest.raises(RunWriteError):
        asyncio.run(s.run(0, 4))
    metric_steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    journal = read_journal(tmp_path / "ledger.jsonl")
    trained_steps = sorted({r["step"] for r in journal if r["status"] == "trained"})
    assert metric_steps == [0, 1] and trained_steps == [0, 1]
    step_2 = [r for r in journal if r["status"] == "unfinished" and "trained at step 2" in r["reason"]]
    assert len(step_2) == len(world.trained[2]) and "the run stopped (RunWriteError)" in step_2[0]["reason"]
    assert journal_balance(tmp_path / "ledger.jsonl")["trained"] == len(world.trained[0]) + len(world.trained[1])
    assert {r.uid for r in s.sampler.requeued} >= {r["uid"] for r in step_2}, "retaken first"


def test_driver_log_on_a_full_disk_prints_no_traceback(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from agentrl.orchestration.driver import _DriverLogHandler

    if not Path("/dev/full").exists():
        pytest.skip("/dev/full makes a real ENOSPC")
    handler = _DriverLogHandler("/dev/full")
    logger = logging.getLogger("agentrl.test_run_files")
    logger.addHandler(handler)
    try:
        logger.error("the run stopped: %s", "x" * 100)
    finally:
        logger.removeHandler(handler)
        with pytest.raises(OSError):
            handler.close()  # logging's own close flushes the line that failed: the driver suppresses it
    assert handler.failed
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Logging error" not in err


def test_the_driver_turns_failed_writes_under_the_run_into_the_write_error(tmp_path: Path) -> None:
    from agentrl.orchestration.driver import _as_write_error

    error = _as_write_error(OSError(errno.EROFS, "Read-only file system", str(tmp_path / "config.yaml")), tmp_path)
    assert error is not None and error.path == str(tmp_path / "config.yaml")
    assert error.cause == "the filesystem is read-only"
    assert _as_write_error(KeyError("x"), tmp_path) is None
    assert _as_write_error(asyncio.CancelledError(), tmp_path) is None
    same = RunWriteError("p", "the disk is full", "d", "/", "f")
    assert _as_write_error(same, tmp_path) is same


def test_a_run_directory_on_a_read_only_filesystem_is_refused_with_the_command_to_start_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import contextlib

    from agentrl.config import load_config
    from agentrl.orchestration import driver
    from agentrl.orchestration.run_lock import RunLock

    def read_only(run_dir: Path, command: str | None = None) -> RunLock:
        raise OSError(errno.EROFS, "Read-only file system", str(run_dir / "run.lock"))

    monkeypatch.setattr(RunLock, "acquire", read_only)
    config = load_config(None, ["env=arithmetic", "run.name=mine", f"run.output_dir={tmp_path}"])
    with pytest.raises(RunWriteError) as caught:
        driver._prepare_run_dir(config, contextlib.AsyncExitStack())
    message = str(caught.value)
    assert message.startswith(f"Could not write {tmp_path / 'mine' / 'run.lock'}: the filesystem is read-only")
    assert message.endswith(f"then start it again (no checkpoint was written yet) with: agentrl run "
                            f"{tmp_path / 'mine' / 'config.yaml'} run.name=mine run.output_dir={tmp_path}.")
