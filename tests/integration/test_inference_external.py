"""`ExternalClient` against a real OpenAI-compatible server: vLLM's own `vllm serve` API server.

Needs vLLM (installed, or in the python named by AGENTRL_VLLM_PYTHON); skipped with the reason otherwise.
"""

from __future__ import annotations

import asyncio

import pytest

from agentrl.inference import ExternalClient, Router
from agentrl.inference.launcher import EngineSpec, ServerProcess
from agentrl.types import SamplingParams

pytestmark = pytest.mark.slow

OPENAI_VLLM = EngineSpec(
    "vllm-openai", "vllm.entrypoints.openai.api_server", python_env="AGENTRL_VLLM_PYTHON"
)


@pytest.fixture(scope="module")
def model_dir(assets):
    return str(assets / "tiny-random-qwen2")


@pytest.fixture(scope="module")
def openai_server(model_dir, vllm_ready):  # vllm_ready (tests/conftest.py) skips where vLLM is missing
    proc = ServerProcess(
        OPENAI_VLLM,
        model_dir,
        dtype="float32",
        max_model_len=2048,
        enforce_eager=True,
        env={"VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    proc.start().wait_healthy(600)
    yield proc
    proc.stop()
    assert not proc.alive


def test_external_client_gets_token_ids_and_logprobs_from_vllm_serve(openai_server, model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    msgs = [{"role": "user", "content": "List three prime numbers."}]
    prompt = list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))

    async def go():
        router = Router([ExternalClient(openai_server.url, weight_version=5)], current_version=5)
        try:
            return await router.generate(
                prompt, SamplingParams(temperature=0.0, max_tokens=24), session_id="e"
            )
        finally:
            await router.aclose()

    gen = asyncio.run(go())
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref_ids = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=len(gen.token_ids),
            min_new_tokens=len(gen.token_ids),
            repetition_penalty=1.0,
            temperature=None,
            top_p=None,
            top_k=None,
        )[0, len(prompt) :].tolist()
        logits = model(torch.tensor([prompt + gen.token_ids])).logits[0, len(prompt) - 1 : -1]
    ref_lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(gen.token_ids)[:, None])[:, 0].tolist()
    assert gen.token_ids == ref_ids and len(gen.token_ids) >= 1
    assert gen.logprobs == pytest.approx(ref_lp, abs=1e-3)
    assert gen.weight_version == 5 and gen.server_id == openai_server.url
