"""A distillation teacher killed mid-run: the episodes it can no longer score are infrastructure
failures (masked, counted, never a signal of 0), and the run stops past `run.max_infra_failure_rate`
naming the teacher and its log, as it does for a dead judge."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest
from distill_parts import distill_overrides, noisy_teacher
from fault_common import lines, procs_matching, wait_until_gone

pytestmark = pytest.mark.slow


def _kill_after_first_step(run_dir: Path, teacher: Path, done: threading.Event, killed: list[int]) -> None:
    """Once the run's first step is in metrics.jsonl, SIGKILL the teacher's server process."""
    while not done.wait(0.1):
        if lines(run_dir / "metrics.jsonl"):
            for p in procs_matching(str(teacher)):
                if "agentrl.inference.hf_server" in " ".join(p.cmdline()):
                    os.kill(p.pid, signal.SIGKILL)
                    killed.append(p.pid)
            return


def test_a_teacher_killed_mid_run_fails_its_episodes_and_stops_the_run_naming_it(tmp_path: Path, assets: Path) -> None:
    from agentrl.config import load_config
    from agentrl.errors import InfraFailureError
    from agentrl.orchestration.driver import run_training
    from agentrl.records.trajectory_log import read_trajectory_file

    tiny = assets / "tiny-random-qwen2"
    teacher = noisy_teacher(tiny, tmp_path / "teacher")
    run_dir = tmp_path / "killed"
    done, killed = threading.Event(), []
    killer = threading.Thread(target=_kill_after_first_step, args=(run_dir, teacher, done, killed), daemon=True)
    killer.start()
    try:
        with pytest.raises(InfraFailureError) as stopped:
            run_training(load_config(None, distill_overrides(tmp_path, "killed", tiny, teacher, "run.total_steps=5")))
    finally:
        done.set()
        killer.join()
    assert killed, "the teacher's server was found and killed after the first step"
    message = str(stopped.value)
    assert "run.max_infra_failure_rate=0.5" in message
    assert f"the distillation teacher the run serves ({teacher}, engine hf; its log is " in message
    assert "teacher.log) exited (code -9) and is not restarted" in message
    assert "Fix: the teacher model (distill.teacher" in message
    steps = lines(run_dir / "metrics.jsonl")
    assert 1 <= len(steps) < 5 and steps[0]["episodes/infra_failed_total"] == 0.0
    assert "distill/teacher_gap_mean" in steps[0]  # the step before the kill trained on the teacher's signal
    # after it, no step trained: the failed episodes were masked, never given a signal of 0
    assert all("distill/teacher_gap_mean" not in s and s.get("batch/skipped", 1.0) == 1.0 for s in steps[1:])
    # the failed episodes are kept for `agentrl view`, each naming the teacher; none was trained
    failed = read_trajectory_file(sorted((run_dir / "rollouts").glob("step-*-stopped.jsonl"))[-1])
    assert failed and all(r["fault"] == "infra" and "the distillation teacher" in r["error"] for r in failed)
    assert all("teacher_logprobs" not in seg for r in failed for seg in r["segments"])  # no signal, not 0
    assert wait_until_gone(procs_matching(str(teacher)), timeout_s=30) == []
