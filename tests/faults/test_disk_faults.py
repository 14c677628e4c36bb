"""A full disk under a real `agentrl run`, where it first bites: the rollout log.

The run's directory is a small tmpfs (as root). Just before the rollout log of the second step is
written, the disk is filled to its last byte. The run stops at once with exit 1, saying the disk is
full on that mount and giving the command that continues the run, with no traceback on the
console; `metrics.jsonl` and the ledger agree about the last completed step (the first); and once
the space is free, `resume=true` finishes the run (its second and last step) from its checkpoint,
the journal balanced.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fault_common import E2E, HERE, check_books, lines, overrides, shutdown_ray, trained_by_step

pytestmark = pytest.mark.slow

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("mount") is None, reason="mounting a small tmpfs needs root"
)

# `agentrl run` as a user starts it, with one change: the disk fills up to its last byte just before
# the rollout log of step index 1 (the second step, after the first checkpoint) is written.
_FILL_THEN_RUN = """
import errno, sys
from pathlib import Path
from agentrl.records.trajectory_log import RolloutLog

real_write_step = RolloutLog.write_step

def fill(path):
    with open(path, "wb", buffering=0) as f:
        for size in (1 << 20, 4096, 1):
            try:
                while True:
                    f.write(b"\\0" * size)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise

def write_step(self, step, *args, **kwargs):
    if step == 1:
        fill(self.run_dir / "filler")
    return real_write_step(self, step, *args, **kwargs)

RolloutLog.write_step = write_step
from agentrl.cli import main
sys.exit(main())
"""


@needs_root
def test_a_full_disk_at_the_rollout_log_stops_the_run_cleanly_and_it_resumes(
    tmp_path: Path, shared_url: str, assets: Path
) -> None:
    shutdown_ray()  # the run below is a process of its own, with its own Ray
    run_dir = tmp_path / "diskfull"
    run_dir.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1g", "tmpfs", str(run_dir)], check=True)
    try:
        args = overrides(tmp_path, "diskfull", assets, "run.total_steps=2", "run.keep_checkpoints=1", url=shared_url)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(E2E), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run([sys.executable, "-c", _FILL_THEN_RUN, "run", *args], capture_output=True, text=True,
                              env=env, cwd=tmp_path, timeout=1800)
        assert (run_dir / "filler").is_file(), f"the run never reached the second step: {proc.stderr[-3000:]}"
        assert proc.returncode == 1, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr and "Logging error" not in proc.stderr, proc.stderr[-3000:]
        [message] = [line for line in proc.stderr.splitlines() if line.startswith("agentrl run: ")]
        assert message.startswith(f"agentrl run: Could not write {run_dir}/rollouts/step-000002.jsonl: "
                                  "the disk is full (OSError: [Errno 28] No space left on device"), message
        assert f"on {run_dir} (tmpfs, tmpfs). Free space on {run_dir} or move run.output_dir, then resume with: " \
            f"agentrl run {run_dir}/config.yaml resume=true run.name=diskfull run.output_dir={tmp_path}." in message

        # The records agree about the last completed step: the first; the second is in neither.
        metric_steps = [r["step"] for r in lines(run_dir / "metrics.jsonl")]
        assert metric_steps == [0] and sorted(trained_by_step(run_dir)) == [0]
        assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-000001"

        (run_dir / "filler").unlink()
        shutdown_ray()
        resumed = subprocess.run([sys.executable, "-c", "import sys; from agentrl.cli import main; sys.exit(main())",
                                  "run", *args, "resume=true"], capture_output=True, text=True, env=env, cwd=tmp_path,
                                 timeout=1800)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        result = json.loads((run_dir / "result.json").read_text())
        assert result["steps_done"] == 2
        assert sorted(trained_by_step(run_dir)) == [0, 1]
        assert [r["step"] for r in lines(run_dir / "metrics.jsonl")] == [0, 1]
        books = check_books(run_dir)  # every attempt of both sessions has exactly one final line
        assert books["trained"] == sum(len(uids) for uids in trained_by_step(run_dir).values()), \
            "no trained line outside the run's lineage: the stopped step's prompts were closed unfinished"
    finally:
        subprocess.run(["umount", "-l", str(run_dir)], check=False)

