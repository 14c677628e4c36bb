"""The served-policy check in a real run: servers that report each new version but do not serve it.

The first run (tiny random Qwen2, ParityEnv, the trainer on CPU) talks to four `hf` servers of its own: one
sound, and three whose reloads verify every bucket and then (`stale_engine`) load nothing, skip the
embedding, or leave the LM head's "kernel copy" at the starting weights. Every push is reported
verified and every server reports the pushed version. The check after the push that changed the
policy stops the run with `ServedPolicyError` naming the three faulty servers (and not the sound one),
the version and the figures, and the command that resumes the run; nothing is sampled at that version.
The second run is colocated: the vLLM engine in the trainer's process reloads nothing (a fault planted
through `planted/sitecustomize.py`); it stops at the check of the first push the same way.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from fault_common import HERE, lines, make_config

pytestmark = pytest.mark.slow


def test_servers_that_load_nothing_skip_the_embedding_or_keep_a_stale_head_stop_the_run_the_sound_one_passes(
        tmp_path: Path, assets: Path) -> None:
    from agentrl.errors import ServedPolicyError
    from agentrl.inference import launch_server
    from agentrl.orchestration.driver import run_training

    env = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    model = str(assets / "tiny-random-qwen2")
    servers = [launch_server("hf", model, startup_timeout_s=300, wait=False)] + [
        launch_server("stale_engine:STALE_HF", model, startup_timeout_s=300, env=env, fault=f, wait=False)
        for f in ("nothing", "skip-embedding", "stale-kernel")]
    try:
        for s in servers:
            s.wait_healthy(300)
        # 4 samples a prompt and a large step: some group has a reward spread, so a step moves the policy
        config = make_config(tmp_path, "stale", assets, "inference.engine=hf", "rollout.samples_per_prompt=4",
                             "trainer.lr=1e-2", "run.total_steps=2", "weights.backend=files",
                             url=",".join(s.url for s in servers))
        with pytest.raises(ServedPolicyError) as stopped:
            run_training(config)
    finally:
        for s in servers:
            s.stop()
    message = str(stopped.value)
    print(message)
    sound, *faulty = servers
    for s in faulty:
        assert f"replica {s.url} at weight version " in message
    assert f"replica {sound.url} " not in message, "the sound server passes"
    assert "(i) served and trainer scores differ by more than tol" in message and "(tol 0.001)" in message
    assert "3 of 4 inference replica(s) checked do not serve the trainer's weights" in message
    assert "resume=true" in message
    version = int(message.split("At weight version ")[1].split(",")[0])
    assert version in (1, 2)
    rows = lines(tmp_path / "stale" / "metrics.jsonl")
    # the failing push ends the step that trained `version`: no batch was sampled from it
    assert len(rows) == version - 1 and all(r.get("served/gap_max", 0.0) <= 1e-3 for r in rows)


def test_a_colocated_engine_whose_reload_loads_nothing_stops_the_run_before_it_samples_at_that_version(
        tmp_path: Path, assets: Path) -> None:
    import subprocess
    import sys

    from fault_common import E2E, overrides

    # The planted reload consumes every pushed tensor and loads none (`planted/sitecustomize.py`): the
    # push completes, every checksum passes, the engine reports version 1, and in sync mode its weights
    # are still the ones released to the trainer's step. Without the check the run met this as
    # generation failures blamed on the released weights; with it, the run stops at the check of the
    # push, naming the replica, the version and why, before any request at version 1.
    path = os.pathsep.join([str(HERE / "planted"), str(HERE), str(E2E), os.environ.get("PYTHONPATH", "")])
    args = overrides(tmp_path, "colocated-stale", assets, "placement=colocated", "rollout.samples_per_prompt=4",
                     "trainer.lr=1e-2", "run.total_steps=2")
    done = subprocess.run([sys.executable, "-m", "agentrl.cli", "run", *args], capture_output=True, text=True,
                          timeout=1200, env={**os.environ, "PYTHONPATH": path,
                                             "AGENTRL_PLANTED_FAULT": "colocated-loads-nothing"})
    output = done.stdout + done.stderr
    print(output[-3000:])
    assert done.returncode == 1, output[-3000:]
    assert "At weight version 1, 1 of 1 inference replica(s) checked do not serve the trainer's weights" in output
    assert "replica colocated-rank-0 at weight version 1: FAIL (it could not score the probe" in output
    assert "released" in output and "resume=true" in output
    rows = lines(tmp_path / "colocated-stale" / "metrics.jsonl")
    assert rows == [], "the push of version 1 ends the first step: no step's row, nothing sampled at version 1"
