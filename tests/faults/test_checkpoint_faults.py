"""Faults of checkpoints on disk, in real runs.

- The disk fills while a checkpoint is written (a small tmpfs mounted on the run's `checkpoints/`,
  as root): the run stops saying the disk is full and which checkpoint is intact, leaves no partial
  checkpoint, loses no prompt, and resumes from the intact one once there is room.
- A same-size corruption inside a shard of the newest checkpoint: the resume names the file, sets
  the checkpoint aside, and continues from the newest intact one, retraining the same prompts.
- A truncated `driver_state.json` (and no intact checkpoint left): `resume=true` stops before any
  server is touched, naming each checkpoint's problem.
- A fresh start in a directory holding an earlier attempt's records (no checkpoint) keeps them.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from fault_common import check_books, lines, make_config, trained_by_step

pytestmark = pytest.mark.slow

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("mount") is None, reason="mounting a small tmpfs needs root"
)


@needs_root
def test_a_full_disk_while_checkpointing_stops_the_run_cleanly_and_it_resumes(
    tmp_path: Path, shared_url: str, assets: Path
) -> None:
    from agentrl.errors import CheckpointError
    from agentrl.orchestration.driver import run_training

    run_dir = tmp_path / "full"
    checkpoints = run_dir / "checkpoints"
    checkpoints.mkdir(parents=True)
    # One checkpoint of the tiny model (fp32 weights and AdamW moments, about 160 MB) fits, two do not.
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=240m", "tmpfs", str(checkpoints)], check=True)
    try:
        # the run directory holds only the empty mount point: a fresh start may use it
        with pytest.raises(CheckpointError) as caught:
            run_training(make_config(tmp_path, "full", assets, "run.total_steps=3", "run.keep_checkpoints=2",
                                     url=shared_url))
        message = str(caught.value)
        assert "Could not write checkpoint step-000002" in message and "is full" in message
        assert "step-000001 is intact" in message
        # the command to continue names this run and where it lives, not a placeholder
        assert f"agentrl run {run_dir}/config.yaml resume=true run.name=full run.output_dir={tmp_path}" in message
        assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step-000001"], "no partial checkpoint"
        books = check_books(run_dir)
        assert books["trained"] == 6 and books.get("unfinished", 0) == 0
        subprocess.run(["mount", "-o", "remount,size=1g", str(checkpoints)], check=True)
        resumed = run_training(make_config(tmp_path, "full", assets, "run.total_steps=3", "resume=true",
                                           url=shared_url))
        assert resumed.steps_done == 3 and sorted(trained_by_step(run_dir)) == [0, 1, 2]
        assert sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("step-")) == [
            "step-000002", "step-000003"]
    finally:
        subprocess.run(["umount", "-l", str(checkpoints)], check=False)


def test_a_corrupted_checkpoint_is_found_named_and_skipped_for_the_newest_intact_one(
    tmp_path: Path, shared_url: str, assets: Path
) -> None:
    from agentrl.errors import CheckpointError
    from agentrl.inference import HTTPServerClient
    from agentrl.orchestration.driver import run_training

    first = run_training(make_config(tmp_path, "corrupt", assets, "run.total_steps=2", "run.keep_checkpoints=0",
                                     url=shared_url))
    run_dir = Path(first.run_dir)
    before = trained_by_step(run_dir)
    newest = run_dir / "checkpoints" / "step-000002"
    shard = max((p for p in (newest / "trainer").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    size = shard.stat().st_size
    with shard.open("r+b") as f:  # flip bytes in the middle: the same size, different weights
        f.seek(size // 2)
        chunk = f.read(64)
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in chunk))
    assert shard.stat().st_size == size

    resumed = run_training(make_config(tmp_path, "corrupt", assets, "run.total_steps=3", "resume=true",
                                       "run.keep_checkpoints=0", url=shared_url))
    assert resumed.steps_done == 3 and resumed.policy_version == 3
    log = (run_dir / "driver.log").read_text()
    assert f"{shard.name} does not match its SHA-256 checksum" in log and "resuming from step-000001" in log
    assert (run_dir / "checkpoints" / "step-000002.bad").is_dir()
    after = trained_by_step(run_dir)
    assert after[1] == before[1], "step 1 is retrained on exactly the prompts it had"
    assert sorted(after) == [0, 1, 2] and check_books(run_dir)["trained"] >= 12

    # Now no checkpoint is intact: the resume stops before any server is touched.
    (run_dir / "checkpoints" / "step-000003" / "driver_state.json").write_text('{"steps_done": 3, "trai')
    for name in ("step-000001", "step-000002"):
        state = run_dir / "checkpoints" / name / "MANIFEST.json"
        if state.exists():
            state.unlink()
            (run_dir / "checkpoints" / name / "driver_state.json").unlink()

    async def served() -> int | None:
        client = HTTPServerClient(shared_url)
        try:
            return (await client.health()).weight_version
        finally:
            await client.aclose()

    version = asyncio.run(served())
    with pytest.raises(CheckpointError) as caught:
        run_training(make_config(tmp_path, "corrupt", assets, "run.total_steps=4", "resume=true", url=shared_url))
    message = str(caught.value)
    assert "step-000003: " in message and "driver_state.json has" in message and "truncated" in message
    assert "step-000001: MANIFEST.json is missing" in message
    assert "nothing was started" in message
    assert asyncio.run(served()) == version, "no weights were pushed: nothing started"


def test_a_fresh_start_keeps_an_earlier_attempts_records(tmp_path: Path, shared_url: str, assets: Path) -> None:
    from agentrl.orchestration.driver import run_training

    run_dir = tmp_path / "again"
    run_dir.mkdir()
    (run_dir / "ledger.jsonl").write_text('{"key": "e0-r1-a0", "status": "taken", "session": 0}\n')
    (run_dir / "metrics.jsonl").write_text('{"step": 0, "episodes/count": 6}\n')
    result = run_training(make_config(tmp_path, "again", assets, "run.total_steps=1", url=shared_url))
    assert result.steps_done == 1
    [aside] = list((run_dir / "previous").iterdir())
    assert (aside / "ledger.jsonl").read_text().startswith('{"key": "e0-r1-a0"')
    assert lines(aside / "metrics.jsonl") == [{"step": 0, "episodes/count": 6}]
    assert "were moved to" in (run_dir / "driver.log").read_text()
    assert check_books(run_dir)["trained"] == 3
