"""SGLang's side of the scoring call: a real SGLang server on the tiny model scores ids as transformers does.

Written against SGLang's documented native API (`input_token_logprobs` of POST /generate, see
`agentrl.inference.sglang`); SGLang needs CUDA, and this test has not run: there was no GPU with SGLang
where it was written.
"""

from __future__ import annotations

import asyncio

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def test_sglang_scores_equal_transformers_logprobs_of_the_same_ids(assets, hf_model) -> None:
    pytest.importorskip("sglang")
    import torch

    from agentrl.inference import launch_server

    model = str(assets / "tiny-random-qwen2")
    ids = list(range(100, 160))
    server = launch_server("sglang", model, startup_timeout_s=900)
    try:
        async def go():
            client = server.client()
            try:
                return await client.score(ids, start=1)
            finally:
                await client.aclose()

        answer = asyncio.run(go())
    finally:
        server.stop()
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0, :-1].float()
    ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
    # SGLang computes in the checkpoint's dtype on CUDA: the 16-bit bound of `served_policy.TOLERANCES`
    assert max(abs(a - b) for a, b in zip(answer.logprobs, ref, strict=True)) <= 5e-2
