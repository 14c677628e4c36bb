"""Faults of the run directory, met as a user meets them: two runs on one directory, and a resume
with another config.

- Two `agentrl run ... run.name=X` started together: the second is refused at once (exit 1) naming
  the first's pid, host and start time, and writes nothing; the first runs to the end alone. Two
  `resume=true` at once: the same, so no run prunes the checkpoint the other is loading. The
  lock is released when the run ends.
- `resume=true run.seed=7` on a run started with seed 0: refused before anything starts, naming
  the key with both values; the run's `config.yaml` and ledger are untouched.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from fault_common import check_books, lines, overrides, shutdown_ray, start_cli, trained_by_step

pytestmark = pytest.mark.slow




def wait_for_the_lock(proc: subprocess.Popen[str], run_dir: Path, timeout_s: float) -> dict:
    """Until `proc` holds the run directory's lock; the owner it wrote there."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the run ended early ({proc.returncode}): {proc.stderr.read()[-3000:]}")
        lock = run_dir / "run.lock"
        text = lock.read_text() if lock.is_file() else ""
        if text.strip() and json.loads(text).get("pid") == proc.pid:
            return json.loads(text)
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("the run never took its directory's lock")


def refused_while_held(tmp_path: Path, args: list[str], owner: dict) -> None:
    second = start_cli(tmp_path, args)
    _, stderr = second.communicate(timeout=300)
    assert second.returncode == 1, stderr[-3000:]
    assert "is in use by another live run" in stderr
    assert f"pid {owner['pid']} on host {owner['host']}, started {owner['started_at']}" in stderr
    assert "choose another run.name" in stderr


def test_two_runs_on_one_directory_the_second_is_refused_and_a_mismatched_resume_too(
    tmp_path: Path, shared_url: str, assets: Path
) -> None:
    shutdown_ray()
    run_dir = tmp_path / "twice"
    args = overrides(tmp_path, "twice", assets, "run.total_steps=2", url=shared_url)

    first = start_cli(tmp_path, args)
    owner = wait_for_the_lock(first, run_dir, timeout_s=600)
    refused_while_held(tmp_path, args, owner)
    _, stderr = first.communicate(timeout=1800)
    assert first.returncode == 0, stderr[-3000:]
    assert sorted(trained_by_step(run_dir)) == [0, 1], "the first run trained alone"
    assert {e["session"] for e in lines(run_dir / "ledger.jsonl")} == {0}
    assert (run_dir / "run.lock").read_text() == "", "released when the run ended"

    # Two resumes at once: the second is refused while the first loads and prunes checkpoints.
    resume = overrides(tmp_path, "twice", assets, "run.total_steps=3", "resume=true", url=shared_url)
    first = start_cli(tmp_path, resume)
    owner = wait_for_the_lock(first, run_dir, timeout_s=600)
    refused_while_held(tmp_path, resume, owner)
    _, stderr = first.communicate(timeout=1800)
    assert first.returncode == 0, stderr[-3000:]
    assert sorted(trained_by_step(run_dir)) == [0, 1, 2]
    check_books(run_dir)

    # A resume with another seed: refused before anything starts; the run's files stay as they were.
    config_before = (run_dir / "config.yaml").read_bytes()
    ledger_before = (run_dir / "ledger.jsonl").read_bytes()
    mismatched = start_cli(tmp_path, overrides(tmp_path, "twice", assets, "run.total_steps=4", "resume=true",
                                               "run.seed=7", url=shared_url))
    _, stderr = mismatched.communicate(timeout=300)
    assert mismatched.returncode == 1, stderr[-3000:]
    assert "run.seed: 0 -> 7" in stderr and "run.resume_allow=[run.seed]" in stderr
    assert (run_dir / "config.yaml").read_bytes() == config_before
    assert (run_dir / "ledger.jsonl").read_bytes() == ledger_before
    assert "resume with a changed" not in (run_dir / "driver.log").read_text()
