"""Faults of the driver and the trainer, met as a user meets them.

Each placement meets three faults on one run, each fault a session of it (split: a server process
beside the trainer actor; colocated: the vLLM engine inside the trainer actor): the trainer actor is
SIGKILLed and the run stops; the resume is interrupted mid-step (split with SIGTERM, colocated with
Ctrl-C: one handler serves both); the next resume, a process, is SIGKILLed mid-step; and a last
resume finishes the run, losing nothing. One run carries all three so each placement starts its
engine and its trainer once per session, not once per fault.

- The trainer actor is SIGKILLed between steps (split): the run stops with a message naming the
  trainer, loses no prompt, and resumes.
- The colocated trainer actor (trainer and vLLM engine in one process) is SIGKILLed while step 1's
  episodes wait on its engine: the run notices at once (Ray fails the driver's outstanding watch
  call), exits 1 naming the trainer, its engine and Ray's cause with the resume command, far within
  `rollout.request_timeout_s`; the step's prompts are `unfinished` and the resume continues.
- Ctrl-C (SIGINT) of `agentrl run` in the middle of a step: it exits 130 saying how to continue,
  every prompt it took already has its final state in the ledger (the in-flight ones as
  `unfinished`), nothing it started is left running, and `resume=true` continues the run.
- SIGTERM (what a scheduler sends) of `agentrl run` mid-step is handled as Ctrl-C is: it exits 143
  (128 + 15) saying it was SIGTERM and with the command that continues it, the in-flight prompts are
  `unfinished` in the ledger, and nothing it started is left running.
- SIGKILL of `agentrl run` (split: the resume started its own vLLM server): within seconds nothing it
  started is left (the vLLM server, its engine core, Ray's processes, the trainer actor); the resumed
  run closes the dead run's in-flight prompts as `unfinished` before it continues, and finishes.
"""

from __future__ import annotations

import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest
from fault_common import (
    check_books,
    lines,
    make_config,
    overrides,
    procs_matching,
    shutdown_ray,
    start_cli,
    trained_by_step,
    wait_until_gone,
)
from fault_parts import descendants

pytestmark = pytest.mark.slow

STEPS = 4  # session 0 trains step 0, each of the two resumes one more step, the last resume the last one
RESUME = ["resume=true", "run.resume_allow=[env]"]  # session 0 played the env that kills; the resumes do not


def _latest_step(run_dir: Path) -> int:
    """The step of the run's newest checkpoint (`checkpoints/latest` names `step-00000N`), -1 for none."""
    latest = run_dir / "checkpoints" / "latest"
    text = latest.read_text().strip() if latest.is_file() else ""
    return int(text.rpartition("-")[2]) if text.rpartition("-")[2].isdigit() else -1


def wait_for_open_attempts_after_a_checkpoint(proc: subprocess.Popen[str], run_dir: Path, timeout_s: float,
                                              after_step: int = -1) -> int:
    """Until a checkpoint newer than `after_step` exists and the ledger shows prompts taken and not yet
    closed (mid-step); returns that checkpoint's step."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the run ended early ({proc.returncode}): {proc.stderr.read()[-3000:]}")
        if _latest_step(run_dir) > after_step:
            open_ = {}
            for e in lines(run_dir / "ledger.jsonl"):
                if e["status"] == "taken":
                    open_[e["key"]] = e
                else:
                    open_.pop(e["key"], None)
            if open_:
                return _latest_step(run_dir)
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("the run never got past its first checkpoint with prompts in flight")


def unfinished_of(run_dir: Path, session: int) -> list[dict]:
    """The ledger's `unfinished` lines of the attempts session `session` took."""
    return [e for e in lines(run_dir / "ledger.jsonl") if e["status"] == "unfinished" and e["session"] == session]


def interrupt_with_ctrl_c(proc: subprocess.Popen[str], run_dir: Path, name: str, placement: str,
                          session: int) -> None:
    """SIGINT to the running `agentrl run` (mid-step): it exits 130 with the resume command, its
    in-flight prompts closed `unfinished` (interrupted), and nothing it started left running."""
    started = descendants(proc.pid)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=300)
    print(f"measured ({placement}): exited {time.monotonic() - sent:.1f} s after SIGINT")  # for the README, with -rP
    assert proc.returncode == 130, stderr[-3000:]
    assert "the run was interrupted" in stderr and f"resume=true run.name={name}" in stderr
    check_books(run_dir)  # balanced as it stands: the interrupted run closed its own books
    unfinished = unfinished_of(run_dir, session)
    assert unfinished and all("interrupted" in e["reason"] for e in unfinished)
    assert wait_until_gone(started) == []


def terminate_with_sigterm(proc: subprocess.Popen[str], run_dir: Path, name: str, output_dir: Path,
                           session: int) -> None:
    """SIGTERM (what a scheduler sends) to the running `agentrl run` (mid-step): handled as Ctrl-C,
    it exits 143 (not Ray's exit 15) naming SIGTERM with the command that continues the run, its
    in-flight prompts closed `unfinished` (interrupted), and nothing it started left running."""
    started = descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 143, stderr[-3000:]
    command = shlex.join(["agentrl", "run", f"{run_dir}/config.yaml", "resume=true", f"run.name={name}",
                          f"run.output_dir={output_dir}"])
    assert "the run was interrupted (SIGTERM)" in stderr and command in stderr, stderr[-3000:]
    check_books(run_dir)  # balanced as it stands: the interrupted run closed its own books
    unfinished = unfinished_of(run_dir, session)
    assert unfinished and all("interrupted" in e["reason"] for e in unfinished)
    assert wait_until_gone(started) == []


def sigkill_the_driver(proc: subprocess.Popen[str], run_dir: Path, placement: str) -> None:
    """SIGKILL of the running `agentrl run` (mid-step): within seconds nothing it started is left,
    and its books are left open (the resume closes them)."""
    started = descendants(proc.pid)
    names = " ".join(" ".join(p.cmdline()) for p in started)
    assert "raylet" in names
    if placement == "split":
        assert "agentrl.inference.vllm_server" in names
        engine = [p for p in started if p.name().startswith("VLLM::EngineCor") or "EngineCore" in " ".join(p.cmdline())]
        assert engine, "the vLLM engine core runs as a process of its own"
    else:  # the engine is inside the trainer actor: no server process, no engine core of its own
        assert "ray::ColocatedTrainerWorker" in names and "agentrl.inference.vllm_server" not in names
    killed_at = time.monotonic()
    proc.kill()
    proc.communicate(timeout=60)
    assert wait_until_gone(started, timeout_s=90) == [], "nothing the killed driver started may survive it"
    print(f"measured ({placement}): all gone {time.monotonic() - killed_at:.1f} s after SIGKILL")  # for the README
    with pytest.raises(Exception, match="never closed"):
        check_books(run_dir)  # the killed run could not close its books ...


def check_the_chain(run_dir: Path) -> None:
    """After the trainer's death (session 0), an interruption (session 1), a SIGKILL (session 2) and a
    last resume to `STEPS` steps: the last resume closed the killed session's books, then finished,
    and each fault left its own reason."""
    books = check_books(run_dir)
    assert unfinished_of(run_dir, 0) and all("TrainerError" in e["reason"] for e in unfinished_of(run_dir, 0))
    assert unfinished_of(run_dir, 1) and all("interrupted" in e["reason"] for e in unfinished_of(run_dir, 1))
    killed = unfinished_of(run_dir, 2)
    assert killed and all("killed while it was in flight" in e["reason"] for e in killed)
    assert books["trained"] >= 3 * STEPS and sorted(trained_by_step(run_dir)) == list(range(STEPS))
    log = (run_dir / "driver.log").read_text()
    assert "session 1" in log and "session 2" in log and "session 3" in log


def _logged_at(line: str) -> float:
    """The time of a `driver.log` line (`2026-11-28 00:15:43,734 LEVEL name: message`), in seconds."""
    import datetime

    stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
    return stamp.timestamp()


def kill_the_split_trainer(tmp_path: Path, name: str, assets: Path, shared_url: str) -> None:
    """Session 0 (in this process, on the session's server): the trainer actor is SIGKILLed when step 1's
    first episode starts; the run stops at its next call to the trainer, naming it, with step 0
    trained and step 1's prompts closed `unfinished`."""
    from agentrl.errors import TrainerError
    from agentrl.orchestration.driver import run_training

    kill = ["env=fault_parts:KillingParityEnv", "env.kwargs={kill: trainer, at: [7], tag: trainer}"]
    with pytest.raises(TrainerError, match="A trainer process died during 'train'.*resume=true"):
        run_training(make_config(tmp_path, name, assets, *kill, f"run.total_steps={STEPS}", url=shared_url))
    run_dir = tmp_path / name
    books = check_books(run_dir)
    assert books["trained"] == 3 and books["unfinished"] == 3  # step 0 trained; step 1's prompts closed
    assert [m["step"] for m in lines(run_dir / "metrics.jsonl")] == [0]
    assert wait_until_gone(procs_matching("ray::TrainerWorker"), timeout_s=30) == []
    log = (run_dir / "driver.log").read_text().splitlines()
    killed = [_logged_at(ln) for ln in log if "KillingParityEnv SIGKILLed ray::TrainerWorker" in ln]
    stopped = [_logged_at(ln) for ln in log if "the run stopped: A trainer process died" in ln]
    if killed and stopped:  # split notices at the next call to the trainer: after the step's rollout
        print(f"measured (split): the run stopped {stopped[0] - killed[0]:.1f} s after the SIGKILL")


def kill_the_colocated_trainer(tmp_path: Path, name: str, args: list[str]) -> None:
    """Session 0 (a process): SIGKILL of the actor that holds the trainer and the vLLM engine while
    step 1's episodes wait on that engine: Ray fails the driver's outstanding watch call at once, and
    the run stops naming the trainer and its engine (not the generation), long before
    `rollout.request_timeout_s`."""
    kill = ["env=fault_parts:KillingParityEnv", "env.kwargs={kill: colocated, at: [7], tag: colocated}"]
    proc = start_cli(tmp_path, [*args, *kill])
    _, stderr = proc.communicate(timeout=900)
    run_dir = tmp_path / name
    assert proc.returncode == 1, stderr[-3000:]
    assert "The trainer process (rank 0) died, and the vLLM engine it hosted" in stderr, stderr[-3000:]
    assert "ActorDiedError: pid " in stderr and "worker exit type" in stderr, stderr[-3000:]
    assert "continue with: agentrl run" in stderr and f"resume=true run.name={name}" in stderr, stderr[-3000:]
    log = (run_dir / "driver.log").read_text().splitlines()
    killed = [ln for ln in log if "KillingParityEnv SIGKILLed ray::ColocatedTrainerWorker" in ln]
    stopped = [ln for ln in log if "the run stopped: The trainer process (rank 0) died" in ln]
    assert len(killed) == 1 and len(stopped) == 1, "\n".join(log[-20:])
    noticed_s = _logged_at(stopped[0]) - _logged_at(killed[0])
    assert 0 <= noticed_s < 300, f"noticed {noticed_s:.1f} s after the kill; request_timeout_s is 600"
    print(f"measured (colocated): the run stopped {noticed_s:.1f} s after the SIGKILL")  # for the README, with -rP
    books = check_books(run_dir)
    assert books["trained"] == 3 and books["unfinished"] == 3  # step 0 trained; step 1's prompts closed
    assert all(e["reason"] == "the run stopped (TrainerError) while it was in flight" for e in unfinished_of(run_dir, 0))
    assert [m["step"] for m in lines(run_dir / "metrics.jsonl")] == [0]
    assert wait_until_gone(procs_matching("ray::ColocatedTrainerWorker"), timeout_s=30) == []


def test_split_a_killed_trainer_then_sigterm_then_a_sigkill_of_the_resumed_driver_and_the_last_resume_loses_nothing(
    tmp_path: Path, vllm_ready: str, shared_url: str, assets: Path
) -> None:
    """Split, three faults on one run: the trainer actor SIGKILLed (in this process, on the session's
    server); a resume (a process on that server) SIGTERMed mid-step; a resume (a process that starts
    a vLLM server of its own) SIGKILLed mid-step; and a last resume that closes the killed session's
    books and finishes."""
    from agentrl.orchestration.driver import run_training

    name, run_dir = "splitfaults", tmp_path / "splitfaults"
    kill_the_split_trainer(tmp_path, name, assets, shared_url)

    shutdown_ray()  # the resumes below are processes of their own, with their own Ray
    proc = start_cli(tmp_path, [*overrides(tmp_path, name, assets, f"run.total_steps={STEPS}", url=shared_url),
                                *RESUME])
    interrupted_after = wait_for_open_attempts_after_a_checkpoint(proc, run_dir, timeout_s=1200, after_step=1)
    terminate_with_sigterm(proc, run_dir, name, tmp_path, session=1)

    proc = start_cli(tmp_path, [*overrides(tmp_path, name, assets, f"run.total_steps={STEPS}"), *RESUME])
    wait_for_open_attempts_after_a_checkpoint(proc, run_dir, timeout_s=2400, after_step=interrupted_after)
    sigkill_the_driver(proc, run_dir, "split")

    resumed = run_training(make_config(tmp_path, name, assets, f"run.total_steps={STEPS}", *RESUME, url=shared_url))
    assert resumed.steps_done == STEPS and resumed.policy_version == STEPS
    check_the_chain(run_dir)


def test_colocated_a_killed_trainer_and_engine_then_ctrl_c_then_a_sigkill_of_the_resumed_driver_and_the_last_resume_loses_nothing(
    tmp_path: Path, vllm_ready: str, assets: Path
) -> None:
    """Colocated, three faults on one run: the actor holding the trainer and the engine SIGKILLed
    mid-step, Ctrl-C of a resume mid-step, a resume SIGKILLed mid-step, and a last resume that closes
    the killed session's books and finishes. Every session is a process but the last."""
    from agentrl.orchestration.driver import run_training

    shutdown_ray()
    name, run_dir = "colofaults", tmp_path / "colofaults"
    colocated = ["placement=colocated", "rollout.request_timeout_s=600", f"run.total_steps={STEPS}"]
    kill_the_colocated_trainer(tmp_path, name, overrides(tmp_path, name, assets, *colocated))

    args = [*overrides(tmp_path, name, assets, *colocated), *RESUME]
    proc = start_cli(tmp_path, args)
    interrupted_after = wait_for_open_attempts_after_a_checkpoint(proc, run_dir, timeout_s=1200, after_step=1)
    interrupt_with_ctrl_c(proc, run_dir, name, "colocated", session=1)

    proc = start_cli(tmp_path, args)
    wait_for_open_attempts_after_a_checkpoint(proc, run_dir, timeout_s=1200, after_step=interrupted_after)
    sigkill_the_driver(proc, run_dir, "colocated")

    resumed = run_training(make_config(tmp_path, name, assets, *colocated, *RESUME))
    assert resumed.steps_done == STEPS and resumed.policy_version == STEPS
    check_the_chain(run_dir)
