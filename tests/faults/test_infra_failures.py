"""Infrastructure failures stop a run instead of training it.

Two ways a sandbox breaks, as a user meets them:
- bubblewrap is not installed (hidden in a private mount namespace: the real binary is covered by
  /dev/null): `agentrl run env=retool` stops before anything starts (no server, no trainer, no run
  directory), exits 1, and its message names bubblewrap and the set-up command that installs it;
- the sandbox breaks after the run started (a real LocalSandbox that fails after the pre-flight):
  the run stops within its first step with `InfraFailureError`, which names the cause, the limit
  (`run.max_infra_failure_rate`) and the fix, and no episode reached the trainer.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("bwrap") is None,
    reason="hiding bubblewrap needs root, unshare and an installed bwrap",
)


@needs_root
def test_without_bubblewrap_the_run_stops_before_anything_starts(tmp_path: Path) -> None:
    bwrap = shutil.which("bwrap")
    script = (f"mount --bind /dev/null {bwrap} && "
              f"exec agentrl run env=retool run.output_dir={tmp_path} run.name=nobwrap")
    done = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr
    assert "bubblewrap" in done.stderr and "bash scripts/install.sh" in done.stderr
    assert "sandbox.name=local" in done.stderr
    assert not (tmp_path / "nobwrap").exists(), "nothing may start (no run directory) when the sandbox cannot run"
    # `agentrl doctor` says the same, as a failed check
    doctor = subprocess.run(["unshare", "-m", "sh", "-c", f"mount --bind /dev/null {bwrap} && exec agentrl doctor env=retool"],
                            capture_output=True, text=True, timeout=300)
    assert doctor.returncode == 1 and "[FAIL] build" in doctor.stdout and "bubblewrap" in doctor.stdout


@pytest.mark.slow
def test_a_sandbox_that_breaks_mid_run_stops_it_in_the_first_step(tmp_path: Path, vllm_server, assets: Path) -> None:
    from agentrl.config import load_config
    from agentrl.errors import InfraFailureError
    from agentrl.orchestration.driver import run_training

    config = load_config(None, [
        "env=fault_parts:SandboxParityEnv", f"model.path={assets / 'tiny-random-qwen2'}",
        "model.chat_template=chatml-tools", f"inference.urls=[{vllm_server.url}]",
        "sandbox.name=fault_parts:BreakingSandbox", "sandbox.kwargs={works_for: 2, pool_size: 0}",
        "data.prompts_per_step=3", "rollout.samples_per_prompt=2", "rollout.max_tokens_per_turn=8",
        "rollout.max_turns=1", "rollout.max_total_tokens=256", "trainer.device=cpu", "run.total_steps=3",
        f"run.output_dir={tmp_path}", "run.name=broken", "run.eval_every=0", "data.num_val_rows=2", "eval.k=1",
    ])  # fmt: skip
    # The run's sandbox serves the 2 episodes of the evaluation before training, then breaks.
    with pytest.raises(InfraFailureError) as caught:
        run_training(config)
    message = str(caught.value)
    assert "run.max_infra_failure_rate=0.5" in message
    assert "the sandbox's worker process is gone (injected fault)" in message
    assert "Fix:" in message
    run_dir = tmp_path / "broken"
    metrics = run_dir / "metrics.jsonl"
    steps = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    assert steps == [], "no step may train on infrastructure failures"
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0] and evals[0]["infra_failed"] == 0
    assert "failed for infrastructure reasons" in (run_dir / "driver.log").read_text()
    # the failed episodes are kept for `agentrl view`, each with its error
    from agentrl.records.trajectory_log import read_trajectory_file

    stopped = read_trajectory_file(run_dir / "rollouts" / "step-000001-stopped.jsonl")
    assert stopped and all(r["fault"] == "infra" and "injected fault" in r["error"] and r["kept_as"] == ["stopped"]
                           for r in stopped)
    # every prompt taken is in the ledger with its final state, none of them trained
    ledger = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines() if line.strip()]
    assert ledger and not any(e["status"] == "trained" for e in ledger)


@pytest.mark.slow
def test_a_sandbox_killed_mid_episode_fails_that_episode_only_and_leaves_nothing_behind(
    tmp_path: Path, vllm_server, assets: Path
) -> None:
    from fault_common import check_books, lines, make_config, procs_matching, wait_until_gone

    from agentrl.orchestration.driver import run_training

    config = make_config(
        tmp_path, "sandbox", assets, "env=fault_parts:SandboxParityEnv", "env.kwargs={command: 'sleep 1; echo ready'}",
        "sandbox.name=fault_parts:DyingSandbox", "sandbox.kwargs={die_on: [3], after_s: 0.3, pool_size: 1}",
        "run.total_steps=2", url=vllm_server.url,
    )  # fmt: skip
    result = run_training(config)
    run_dir = Path(result.run_dir)
    assert result.steps_done == 2
    metrics = lines(run_dir / "metrics.jsonl")
    assert sum(m["episodes/infra_failed"] for m in metrics) == 1, "the killed sandbox failed its episode only"
    assert check_books(run_dir)["trained"] >= 5
    assert wait_until_gone(procs_matching("bwrap"), timeout_s=30) == []
    assert wait_until_gone(procs_matching("agentrl-forkserver"), timeout_s=30) == []
