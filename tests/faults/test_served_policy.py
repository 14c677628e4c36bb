"""The served-policy check in a real run: a server that reports each new version but keeps its old weights.

The run (tiny random Qwen2, ParityEnv, the trainer on CPU) talks to one `hf` server of its own whose
reloads verify every bucket and load nothing (`stale_engine.StaleHFEngine`): every push is reported
verified, and the server reports the pushed version. The check after the push that changed the
policy stops the run with `ServedPolicyError`, naming the server, the version and the figures, and
the command that resumes the run; nothing is sampled at that version.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from fault_common import HERE, lines, make_config

pytestmark = pytest.mark.slow


def test_a_server_that_keeps_its_old_weights_stops_the_run_at_the_first_push(tmp_path: Path, assets: Path) -> None:
    from agentrl.errors import ServedPolicyError
    from agentrl.inference import launch_server
    from agentrl.orchestration.driver import run_training

    env = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    server = launch_server("stale_engine:STALE_HF", str(assets / "tiny-random-qwen2"), startup_timeout_s=300, env=env)
    try:
        # 4 samples a prompt and a large step: some group has a reward spread, so a step moves the policy
        config = make_config(tmp_path, "stale", assets, "inference.engine=hf", "rollout.samples_per_prompt=4",
                             "trainer.lr=1e-2", "run.total_steps=2", "weights.backend=files", url=server.url)
        with pytest.raises(ServedPolicyError) as stopped:
            run_training(config)
    finally:
        server.stop()
    message = str(stopped.value)
    print(message)
    assert f"replica {server.url} at weight version " in message and ": FAIL (" in message
    assert "(i) served and trainer scores differ by more than tol" in message and "(tol 0.001)" in message
    assert "do not serve the trainer's weights" in message and "resume=true" in message
    version = int(message.split("After the push of weight version ")[1].split(",")[0])
    assert version in (1, 2)
    rows = lines(tmp_path / "stale" / "metrics.jsonl")
    # the failing push ends the step that trained `version`: no batch was sampled from it
    assert len(rows) == version - 1 and all(r.get("served/gap_max", 0.0) <= 1e-3 for r in rows)
