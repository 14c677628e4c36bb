"""Check (e) of `agentrl check onpolicy`: comparing colocated and split answers to the same probes.

Guards: only tokens drawn from the same context are compared (nothing after the first differing
id), a gap over the tolerance fails with its figure, nothing comparable fails instead of passing
on zero tokens, engines that cannot be colocated are skipped with the reason, probes carry the
rollout's sampling and a seed of their own, and the hf engine's in-memory push really replaces its
weights (the tiny random Qwen2: its answer changes, and comes back when the original tensors are
pushed again).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from agentrl.config import load_config
from agentrl.orchestration.placement_check import (
    FLOAT32_TOLERANCE,
    LOW_PRECISION_TOLERANCE,
    compare_placements,
    placement_probes,
    placement_skip_reason,
    placement_tolerance,
)
from agentrl.types import Generation, TokenOrigin, Trajectory


def gen(ids: list[int], lps: list[float], kept: list[list[int]] | None = None) -> Generation:
    return Generation(token_ids=ids, logprobs=lps, finish_reason="length", kept_sets=kept)


def test_identical_answers_pass_with_their_gap() -> None:
    split = [gen([1, 2, 3], [-0.5, -1.0, -2.0]), gen([4, 5], [-0.1, -0.2])]
    colocated = [gen([1, 2, 3], [-0.5000004, -1.0, -2.0000002]), gen([4, 5], [-0.1, -0.2])]
    result = compare_placements(split, colocated, FLOAT32_TOLERANCE)
    assert result.status == "PASS"
    assert result.figures["identical"] == 2 and result.figures["compared_tokens"] == 5
    assert result.figures["max_gap"] == pytest.approx(4e-7, abs=1e-9)
    assert "first_divergence" not in result.figures


def test_only_the_common_prefix_is_compared() -> None:
    # After the second token the contexts differ: the third logprobs (far apart) are not compared.
    split = [gen([1, 2, 3, 9], [-0.5, -1.0, -2.0, -3.0])]
    colocated = [gen([1, 2, 7], [-0.5, -1.0, -9.0])]
    result = compare_placements(split, colocated, FLOAT32_TOLERANCE)
    assert result.status == "PASS"
    assert result.figures["compared_tokens"] == 2 and result.figures["first_divergence"] == 2
    assert result.figures["identical"] == 0 and result.figures["max_gap"] == 0.0


def test_a_gap_over_the_tolerance_fails_with_the_figure() -> None:
    split = [gen([1, 2], [-0.5, -1.0])]
    colocated = [gen([1, 2], [-0.5, -1.25])]
    result = compare_placements(split, colocated, FLOAT32_TOLERANCE)
    assert result.status == "FAIL" and result.figures["max_gap"] == pytest.approx(0.25)
    assert "0.25 nats apart" in result.detail and "tolerance 0.001" in result.detail
    assert compare_placements(split, colocated, 0.3).status == "PASS"


def test_nothing_comparable_fails() -> None:
    result = compare_placements([gen([1], [-0.5]), gen([], [])], [gen([2], [-0.5]), gen([3], [-1.0])], 1.0)
    assert result.status == "FAIL" and result.figures["compared_tokens"] == 0
    assert "max_gap" not in result.figures  # never reported as a gap of 0
    assert "different first token on every probe" in result.detail


def test_kept_sets_are_compared_on_shared_tokens() -> None:
    split = [gen([1, 2], [-0.5, -1.0], [[1, 4], [2, 5]])]
    assert compare_placements(split, [gen([1, 2], [-0.5, -1.0], [[1, 4], [2, 6]])], 1.0).figures[
        "kept_set_mismatches"] == 1
    assert compare_placements(split, [gen([1, 2], [-0.5, -1.0])], 1.0).figures["kept_set_mismatches"] == 2
    assert compare_placements(split, split, 1.0).figures["kept_set_mismatches"] == 0


def test_one_answer_per_probe_is_required() -> None:
    with pytest.raises(ValueError, match="one each per probe"):
        compare_placements([gen([1], [-0.5])], [], 1.0)


def test_tolerance_by_dtype() -> None:
    assert placement_tolerance("float32") == FLOAT32_TOLERANCE
    assert placement_tolerance("bfloat16") == placement_tolerance("auto") == LOW_PRECISION_TOLERANCE


def test_engines_that_cannot_be_colocated_are_skipped_with_the_reason() -> None:
    assert placement_skip_reason(load_config(None, ["env=arithmetic", "inference.engine=hf"])) is None
    assert placement_skip_reason(load_config(None, ["env=arithmetic"])) is None  # vllm
    sglang = placement_skip_reason(load_config(None, ["env=arithmetic", "inference.engine=sglang"]))
    assert sglang is not None and "inference.engine=sglang cannot run in the trainer's process" in sglang
    urls = placement_skip_reason(load_config(None, ["env=arithmetic", "inference.urls=[http://127.0.0.1:9]"]))
    assert urls is not None and "not started by this check" in urls


def test_probes_carry_the_prefix_the_rollout_sampling_and_a_seed_each() -> None:
    config = load_config(None, ["env=arithmetic", "rollout.top_p=0.9", "rollout.top_k=20", "rollout.temperature=0.7",
                                "rollout.max_tokens_per_turn=24", "run.seed=3"])
    trajs = []
    for first in (10, 20):
        t = Trajectory()
        t.extend([first, first + 1], TokenOrigin.PROMPT, 0)
        t.extend([first + 2], TokenOrigin.SAMPLED, 0, logprobs=[-1.0], version=0, kept_sets=[[first + 2]])
        trajs.append(t)
    probes = placement_probes(config, trajs)
    assert [p.prompt_ids for p in probes] == [[10, 11], [20, 21]]
    s = probes[0].sampling
    assert (s.temperature, s.top_p, s.top_k, s.max_tokens) == (0.7, 0.9, 20, 24)
    assert probes[0].sampling.seed is not None and probes[0].sampling.seed != probes[1].sampling.seed
    assert placement_probes(config, trajs)[1].sampling.seed == probes[1].sampling.seed  # fixed, not drawn


def test_hf_engine_in_memory_push_replaces_its_weights(assets: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from agentrl.inference.hf_server import HFEngine
    from agentrl.inference.protocol import GenerateRequest, SamplingSpec

    path = str(assets / "tiny-random-qwen2")
    engine = HFEngine(path, dtype="float32")
    request = GenerateRequest(prompt_ids=[1, 2, 3], sampling=SamplingSpec(temperature=1.0, max_tokens=4, seed=0,
                                                                           stop_token_ids=[]))
    original = {k: v.clone() for k, v in AutoModelForCausalLM.from_pretrained(path).state_dict().items()}

    async def scenario() -> tuple[list[float], list[float], list[float], int]:
        await engine.start()
        before = (await engine.generate(request, 0)).logprobs
        noisy = {k: v + 0.5 * torch.randn(v.shape, generator=torch.Generator().manual_seed(0)) for k, v in
                 original.items()}
        pushed = await engine.load_tensors(lambda: iter(noisy.items()))
        after = (await engine.generate(request, 1)).logprobs
        await engine.load_tensors(lambda: iter(original.items()))
        return before, after, (await engine.generate(request, 2)).logprobs, pushed

    before, after, restored, pushed = asyncio.run(scenario())
    assert pushed == len(original)
    assert after != before and restored == before


def test_hf_engine_in_memory_push_refuses_a_foreign_tensor(assets: Path) -> None:
    import torch

    from agentrl.inference.hf_server import HFEngine
    from agentrl.inference.server_app import WeightLoadError

    engine = HFEngine(str(assets / "tiny-random-qwen2"), dtype="float32")

    async def scenario() -> None:
        await engine.start()
        await engine.load_tensors(lambda: iter([("not.a.weight", torch.zeros(2))]))

    with pytest.raises(WeightLoadError, match="1 pushed tensors match no parameter"):
        asyncio.run(scenario())


def test_engine_dtype_resolves_auto_as_the_engines_do(tmp_path: Path) -> None:
    from agentrl.orchestration.placement_check import engine_dtype

    (tmp_path / "config.json").write_text('{"torch_dtype": "bfloat16"}')
    hf = load_config(None, ["env=arithmetic", "inference.engine=hf"])
    vllm = load_config(None, ["env=arithmetic"])
    assert engine_dtype(hf, str(tmp_path)) == "float32"  # the hf engine runs auto in float32
    assert engine_dtype(vllm, str(tmp_path)) == "bfloat16"  # vLLM takes the checkpoint's dtype
    assert engine_dtype(load_config(None, ["env=arithmetic", "model.dtype=float32"]), str(tmp_path)) == "float32"
