"""Shared end-to-end fixtures: one real short training run that several tests look at."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def short_run(tmp_path_factory: pytest.TempPathFactory, vllm_server, assets: Path) -> Path:
    """A real two-step `agentrl run` on the tiny random Qwen2 (the session's vLLM server, Ray
    trainer actors, FSDP2, weight pushes) over `ChattyParityEnv`: two turns per episode, the
    evaluation before and after training, each step's rollouts kept (`run.keep_rollouts=2`).
    The server gets its base weights back before the run directory is handed out."""
    from agentrl.config import load_config
    from agentrl.inference import HTTPServerClient
    from agentrl.orchestration.driver import run_training

    tiny = str(assets / "tiny-random-qwen2")
    config = load_config(None, [
        "env=chatty_env:ChattyParityEnv", f"model.path={tiny}", "model.chat_template=chatml-tools",
        f"inference.urls=[{vllm_server.url}]", "data.prompts_per_step=3", "rollout.samples_per_prompt=2",
        "rollout.max_tokens_per_turn=12", "rollout.max_turns=2", "rollout.max_total_tokens=256",
        "trainer.lr=1e-3", "trainer.device=cpu", "run.total_steps=2", "run.eval_every=0", "run.save_every=0",
        "data.num_val_rows=2", "eval.k=2", "run.keep_rollouts=2", "run.loggers=[jsonl,tensorboard]",
        f"run.output_dir={tmp_path_factory.mktemp('runs')}", "run.name=viewer",
        f"rollout.extra_stop_token_ids={list(range(0, 151_000, 10))}",
    ])  # fmt: skip
    try:
        result = run_training(config)
    finally:
        async def restore() -> None:  # later tests expect the base weights
            client = HTTPServerClient(vllm_server.url)
            await client.update_weights(tiny, 0)
            await client.aclose()

        asyncio.run(restore())
    assert result.steps_done == 2
    return Path(result.run_dir)
