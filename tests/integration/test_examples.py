"""Every example script runs as a user would run it, and does what it says."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_custom_env_example_runs_and_earns_the_reward() -> None:
    out = subprocess.run([sys.executable, str(EXAMPLES / "custom_env.py")], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "prompt: What is the capital of Japan? | tools: ['lookup_capital']" in out.stdout
    assert "tool said: Tokyo" in out.stdout
    assert "reward=1.0 done=True" in out.stdout


def test_mcp_tools_example_calls_its_own_mcp_server_and_earns_the_reward() -> None:
    out = subprocess.run([sys.executable, str(EXAMPLES / "mcp_tools.py")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "tools: ['save_note', 'read_note']",
        "save_note said: saved 'launch' (1 notes)",
        "read_note said: Error: Error executing tool read_note: no note titled 'lunch'; saved titles: ['launch']",
        "read_note said: 4711",
        "reward=1.0 done=True tool errors (model)=1",
    ]


def test_swe_scripted_agent_example_resolves_with_the_fix_and_not_without() -> None:
    out = subprocess.run([sys.executable, str(EXAMPLES / "swe_scripted_agent.py"), "--limit", "3"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert sum("fix: reward 1.0" in line and "do-nothing: reward 0.0" in line for line in lines) == 3
    assert lines[-2:] == ["reference fix agent: resolved 3/3 (rate 1.00)", "do nothing agent: resolved 0/3 (rate 0.00)"]


@pytest.mark.slow
def test_openai_agent_example_trains_the_sdk_agent_with_agentrl_run(vllm_server, assets: Path, tmp_path: Path) -> None:
    """One GRPO step of the OpenAI-SDK agent on the tiny model (the session's vLLM server), then the
    server gets its base weights back for the tests after this one."""
    import asyncio
    import json
    import os

    from agentrl.inference import HTTPServerClient

    tiny = assets / "tiny-random-qwen2"
    overrides = [f"model.path={tiny}", f"inference.urls=[{vllm_server.url}]", "run.total_steps=1",
                 "data.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_tokens_per_turn=12",
                 "data.num_val_rows=2", "eval.k=1", "trainer.device=cpu", f"run.output_dir={tmp_path}",
                 "run.name=agent", "run.loggers=[jsonl]"]
    import shutil
    import tempfile

    # Ray's own directory, short: its socket paths must fit AF_UNIX's 107 bytes (tmp_path's do not).
    ray_tmp = os.environ.get("RAY_TMPDIR") or tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    env = {**os.environ, "RAY_TMPDIR": ray_tmp}
    try:
        out = subprocess.run([sys.executable, str(EXAMPLES / "openai_agent.py"), *overrides], capture_output=True,
                             text=True, timeout=900, env=env)
    finally:
        async def restore() -> None:
            client = HTTPServerClient(vllm_server.url)
            await client.update_weights(str(tiny), 0)
            await client.aclose()

        asyncio.run(restore())
        if ray_tmp != os.environ.get("RAY_TMPDIR"):
            shutil.rmtree(ray_tmp, ignore_errors=True)
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads((tmp_path / "agent" / "result.json").read_text())
    assert result["steps_done"] == 1 and result["policy_version"] == 1
    (step,) = [json.loads(line) for line in (tmp_path / "agent" / "metrics.jsonl").read_text().splitlines()
               if '"step"' in line and "episodes/count" in line]
    assert step["episodes/count"] == 4 and step["gateway/llm_calls_per_episode"] >= 1
    assert step["batch/infra_masked"] == 0
