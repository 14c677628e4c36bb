"""The `hf` server against transformers itself: greedy ids, exact logprobs, seeds, weight updates, pause.

One real server process (tiny-random-qwen2 on CPU) serves every test in this module.
"""

from __future__ import annotations

import asyncio

import pytest

from agentrl.inference import HTTPServerClient, launch_server
from agentrl.types import SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(assets):
    return str(assets / "tiny-random-qwen2")


@pytest.fixture(scope="module")
def server(model_dir):
    proc = launch_server("hf", model_dir, startup_timeout_s=300, num_threads=1)
    yield proc
    proc.stop()
    assert not proc.alive


@pytest.fixture(scope="module")
def prompt_ids(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    msgs = [{"role": "user", "content": "What is 17 * 3? Use the calculator."}]
    return list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))


def generate(server, prompt, sampling):
    async def go():
        client = HTTPServerClient(server.url)
        try:
            return await client.generate(prompt, sampling, session_id="s")
        finally:
            await client.aclose()

    return asyncio.run(go())


def forward_logprobs(model, prompt, gen_ids, temperature):
    import torch

    ids = torch.tensor([prompt + gen_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(gen_ids)[:, None])[:, 0].tolist()


def test_greedy_equals_transformers_generate(server, hf_model, prompt_ids):
    import torch

    out = generate(server, prompt_ids, SamplingParams(temperature=0.0, max_tokens=24))
    ref = hf_model.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        do_sample=False,
        max_new_tokens=24,
        min_new_tokens=24,  # the tiny random model emits no EOS in these 24 greedy steps
        repetition_penalty=1.0,
        temperature=None,
        top_p=None,
        top_k=None,
    )[0, len(prompt_ids) :].tolist()
    assert out.token_ids == ref
    assert out.finish_reason == "length" and len(out.token_ids) == 24
    assert out.logprobs == pytest.approx(forward_logprobs(hf_model, prompt_ids, out.token_ids, 0.0), abs=1e-4)


def test_sampled_logprobs_match_a_forward_pass_and_seeds_repeat(server, hf_model, prompt_ids):
    sp = SamplingParams(temperature=0.7, max_tokens=32, seed=1234)
    a = generate(server, prompt_ids, sp)
    b = generate(server, prompt_ids, sp)
    c = generate(server, prompt_ids, SamplingParams(temperature=0.7, max_tokens=32, seed=99))
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    assert a.token_ids != c.token_ids
    ref = forward_logprobs(hf_model, prompt_ids, a.token_ids, 0.7)
    assert a.logprobs == pytest.approx(ref, abs=1e-4)


def score_logprobs(model, ids, start):
    """Transformers' own logprob of each of `ids[start:]` given the ids before it (temperature 1)."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, start - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[start:])[:, None])[:, 0].tolist()


SCORE_TOLERANCE = 1e-4
"""Largest |served - transformers| logprob gap the scoring call may show in float32 on CPU: the same
model code in the same dtype (measured 0 on the tiny model); the bound only allows for thread counts."""


def test_score_equals_transformers_logprobs_of_the_same_ids(server, hf_model, prompt_ids):
    ids = prompt_ids + [int(t) for t in range(300, 340)]

    async def go():
        client = HTTPServerClient(server.url)
        try:
            return await client.score(ids), await client.score(ids, start=len(prompt_ids))
        finally:
            await client.aclose()

    whole, tail = asyncio.run(go())
    ref = score_logprobs(hf_model, ids, 1)
    assert len(whole.logprobs) == len(ids) - 1 and len(tail.logprobs) == 40
    gap = max(abs(a - b) for a, b in zip(whole.logprobs, ref, strict=True))
    print(f"hf served vs transformers scores: largest gap {gap:.2e} over {len(ref)} ids")
    assert gap <= SCORE_TOLERANCE
    assert tail.logprobs == pytest.approx(ref[len(prompt_ids) - 1 :], abs=SCORE_TOLERANCE)
    assert whole.weight_version == server_version(server)


def server_version(server):
    async def go():
        client = HTTPServerClient(server.url)
        try:
            return (await client.health()).weight_version
        finally:
            await client.aclose()

    return asyncio.run(go())


def test_stop_token_ends_generation_and_is_included(server, prompt_ids):
    free = generate(server, prompt_ids, SamplingParams(temperature=0.0, max_tokens=8))
    stop_id = free.token_ids[3]
    out = generate(
        server, prompt_ids, SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=(stop_id,))
    )
    first = free.token_ids.index(stop_id)
    assert out.token_ids == free.token_ids[: first + 1]
    assert out.finish_reason == "stop"


def test_update_weights_changes_outputs_and_version(server, hf_model, prompt_ids, tmp_path):
    import torch
    from safetensors.torch import save_file

    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    before = generate(server, prompt_ids, greedy)
    torch.manual_seed(0)
    state = {
        k: v.detach().clone().contiguous() for k, v in hf_model.state_dict().items() if k != "lm_head.weight"
    }
    noisy = {k: v + 0.05 * torch.randn_like(v) for k, v in state.items()}
    (tmp_path / "v1").mkdir()
    (tmp_path / "v0").mkdir()
    save_file(noisy, str(tmp_path / "v1" / "model.safetensors"))
    save_file(state, str(tmp_path / "v0" / "model.safetensors"))

    async def update(path, version):
        client = HTTPServerClient(server.url)
        try:
            return await client.update_weights(str(path), version)
        finally:
            await client.aclose()

    health = asyncio.run(update(tmp_path / "v1", 1))
    assert health.weight_version == 1
    after = generate(server, prompt_ids, greedy)
    assert after.weight_version == 1
    assert after.token_ids != before.token_ids or after.logprobs != pytest.approx(before.logprobs, abs=1e-3)
    # back to the original weights: the original outputs return, so the load was in place and exact
    assert asyncio.run(update(tmp_path / "v0", 2)).weight_version == 2
    again = generate(server, prompt_ids, greedy)
    assert again.token_ids == before.token_ids and again.weight_version == 2


def test_pause_holds_new_requests_until_resume(server, prompt_ids):
    async def go():
        client = HTTPServerClient(server.url)
        try:
            assert (await client.pause()).status == "paused"
            task = asyncio.create_task(
                client.generate(prompt_ids, SamplingParams(temperature=0.0, max_tokens=4), session_id="p")
            )
            await asyncio.sleep(1.0)
            held = not task.done()
            load = (await client.health()).load
            assert (await client.resume()).status == "ok"
            return held, load, await asyncio.wait_for(task, 60)
        finally:
            await client.aclose()

    held, load, out = asyncio.run(go())
    assert held and load == 1
    assert len(out.token_ids) >= 1


def test_pause_with_abort_ends_running_and_queued_requests(server, prompt_ids):
    long = SamplingParams(temperature=0.0, max_tokens=4000)

    async def go():
        client = HTTPServerClient(server.url)
        try:
            running = asyncio.create_task(client.generate(prompt_ids, long, session_id="r"))
            await until_load(client, 1)
            await asyncio.sleep(0.5)
            queued = asyncio.create_task(client.generate(prompt_ids, long, session_id="q"))
            await until_load(client, 2)
            await client.pause(abort=True)
            outs = await asyncio.wait_for(asyncio.gather(running, queued), 60)
            await client.resume()
            after = await client.generate(
                prompt_ids, SamplingParams(temperature=0.0, max_tokens=3), session_id="n"
            )
            metrics = await client.metrics()
            return outs, after, metrics
        finally:
            await client.aclose()

    (running, queued), after, metrics = asyncio.run(go())
    assert running.finish_reason == "abort" and len(running.token_ids) < 4000
    assert queued.finish_reason == "abort" and queued.token_ids == []
    assert after.finish_reason == "length" and len(after.token_ids) == 3
    assert metrics.aborted >= 2


async def until_load(client, n):
    for _ in range(600):
        if (await client.health()).load >= n:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"server load never reached {n}")


def test_truncated_sampling_reports_the_truncated_distribution(server, hf_model, prompt_ids):
    import torch

    out = generate(server, prompt_ids, SamplingParams(temperature=0.8, top_k=5, max_tokens=16, seed=3))
    with torch.no_grad():
        logits = (
            hf_model(torch.tensor([prompt_ids + out.token_ids])).logits[0, len(prompt_ids) - 1 : -1] / 0.8
        )
    masked = logits.masked_fill(logits < logits.topk(5, dim=-1).values[:, -1:], float("-inf"))
    ref = torch.log_softmax(masked, -1).gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0].tolist()
    assert out.logprobs == pytest.approx(ref, abs=1e-4)
