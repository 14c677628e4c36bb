"""Truncated sampling replayed exactly: the `hf` engine's kept sets, scored by the FSDP2 trainer.

The engine samples with top-k / top-p / min-p and reports each token's logprob renormalised over
its kept set; the trainer, given the kept sets the ledger recorded, must score the same tokens to
the same logprobs (step-0 ratio 1 within fp32 precision), and without them (the whole vocabulary)
it must not. Real parts only: the tiny random Qwen2 (its output head scaled by 4 and saved, so
that min-p and top-p keep sets of a few dozen tokens rather than most of the vocabulary), the
`hf` engine's own generation loop, and a one-process FSDP2 backend.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
import torch

from agentrl.config import AlgorithmConfig, TrainerConfig
from agentrl.inference.hf_server import HFEngine
from agentrl.inference.protocol import GenerateRequest, SamplingSpec
from agentrl.kept_set import kept_mask
from agentrl.sampling import KeptSetRule
from agentrl.types import TokenOrigin, Trajectory

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
RATIO_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def sharp_model(assets: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("sharp-qwen2")
    model = AutoModelForCausalLM.from_pretrained(assets / "tiny-random-qwen2", dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(assets / "tiny-random-qwen2").save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def engine(sharp_model: str) -> HFEngine:
    eng = HFEngine(sharp_model)
    eng._load()
    return eng


@pytest.fixture(scope="module")
def backend(sharp_model: str):
    from agentrl.trainer.fsdp2 import FSDP2Backend

    trainer = TrainerConfig(device="cpu", lr=1e-4, micro_batch_tokens=64)
    return FSDP2Backend(sharp_model, trainer, AlgorithmConfig(), seed=0, deterministic=True)


def rollout(engine: HFEngine, spec: SamplingSpec) -> list[Trajectory]:
    trajs = []
    for seed, prompt in enumerate(PROMPTS):
        request = GenerateRequest(prompt_ids=prompt, sampling=spec.model_copy(update={"seed": seed}))
        gen = asyncio.run(engine.generate(request, 0)).to_generation()
        t = Trajectory()
        t.extend(prompt, TokenOrigin.PROMPT, 0)
        t.extend(gen.token_ids, TokenOrigin.SAMPLED, 1, logprobs=gen.logprobs, version=0, kept_sets=gen.kept_sets)
        t.validate()
        trajs.append(t)
    return trajs


def ratios(backend, trajs: list[Trajectory], temperature: float, rule: KeptSetRule | None) -> torch.Tensor:
    from agentrl.trainer.packing import pad_trajectories

    layout = pad_trajectories(trajs)
    trainer_lp = backend.compute_logprobs(trajs, temperature=temperature, kept_rule=rule)
    mask = layout.loss_mask > 0
    return (trainer_lp - layout.rollout_logprobs)[mask].exp()


SETTINGS = [
    pytest.param(0.7, {"top_k": 20}, id="T0.7-top_k20"),
    pytest.param(1.0, {"top_k": 20}, id="T1.0-top_k20"),
    pytest.param(0.7, {"min_p": 0.05}, id="T0.7-min_p0.05"),
    pytest.param(0.7, {"top_p": 0.9, "top_k": 20}, id="T0.7-top_p0.9-top_k20"),
    pytest.param(0.7, {"top_p": 0.9, "top_k": 20, "min_p": 0.05}, id="T0.7-all-three"),
    pytest.param(1.0, {"top_p": 0.9, "top_k": 20, "min_p": 0.05}, id="T1.0-all-three"),
]


@pytest.mark.parametrize(("temperature", "truncation"), SETTINGS)
def test_replayed_kept_sets_give_step0_ratios_of_one(engine, backend, temperature: float, truncation: dict) -> None:
    spec = SamplingSpec(temperature=temperature, max_tokens=12, stop_token_ids=[], max_kept_set=128, **truncation)
    trajs = rollout(engine, spec)
    sizes = [len(k) for t in trajs for k in t.kept_sets]
    assert len(sizes) == sum(t.num_sampled for t in trajs) == 24
    assert all(0 < n <= 128 for n in sizes), sizes  # every set recorded, none overflowed
    assert max(sizes) > 1  # a real choice, not greedy in disguise
    rule = KeptSetRule(**truncation)

    replayed = ratios(backend, trajs, temperature, rule)
    assert replayed.numel() == 24
    assert (replayed - 1).abs().max().item() < RATIO_TOLERANCE
    # The trainer's own rule keeps every token the engine sampled: no disagreement.
    assert backend.take_kept_set_disagreement() == 0.0

    full_vocab = [dataclasses.replace(t, kept_sets=[]) for t in trajs]
    unreplayed = ratios(backend, full_vocab, temperature, None)
    assert (unreplayed - 1).abs().max().item() > 0.05  # the bias replay removes
    assert (unreplayed < 1 + RATIO_TOLERANCE).all()  # the full vocabulary only adds mass


def test_overflowed_kept_sets_are_recorded_empty_and_left_out_of_the_loss(engine) -> None:
    from agentrl.trainer.packing import pad_trajectories
    from agentrl.trainer.step import kept_set_metrics

    # top_p alone on this model keeps tens of thousands of tokens: far past a cap of 16.
    spec = SamplingSpec(temperature=1.0, top_p=0.9, max_tokens=6, stop_token_ids=[], max_kept_set=16)
    trajs = rollout(engine, spec)
    assert all(k == [] for t in trajs for k in t.kept_sets)
    assert pad_trajectories(trajs).loss_mask.sum().item() == 0.0
    metrics = kept_set_metrics(trajs)
    assert metrics["onpolicy/kept_set_overflow"] == 12.0
    assert metrics["onpolicy/kept_set_overflow_share"] == 1.0
    assert "onpolicy/kept_set_size_mean" not in metrics  # nothing recorded: no mean reported


def test_full_vocabulary_settings_store_nothing(engine) -> None:
    trajs = rollout(engine, SamplingSpec(temperature=1.0, max_tokens=4, stop_token_ids=[]))
    assert all(t.kept_sets == [] for t in trajs)


def test_disagreement_counts_tokens_outside_the_trainers_own_kept_set(backend) -> None:
    # A token sampled from outside what the trainer's logits keep under top_k=1: the argmax only.
    prompt = PROMPTS[0]
    with torch.no_grad():
        logits = backend.policy(input_ids=torch.tensor([prompt])).logits[0, -1]
    top = int(logits.argmax())
    other = int(logits.argsort(descending=True)[5])
    assert kept_mask(logits[None], top_k=1)[0].nonzero().flatten().tolist() == [top]
    trajs = []
    for token in (top, other):
        t = Trajectory()
        t.extend(prompt, TokenOrigin.PROMPT, 0)
        t.extend([token], TokenOrigin.SAMPLED, 1, logprobs=[0.0], version=0, kept_sets=[[token]])
        trajs.append(t)
    backend.compute_logprobs(trajs, temperature=1.0, kept_rule=KeptSetRule(top_k=1))
    assert backend.take_kept_set_disagreement() == 0.5
    assert backend.take_kept_set_disagreement() is None  # taken: nothing measured since


def test_a_training_step_reports_kept_sets_and_refuses_a_truncated_rollout_without_them(engine, backend) -> None:
    # Last in this module: it takes an optimizer step on the shared backend.
    from agentrl.errors import TrainerError
    from agentrl.trainer.step import train_step

    truncation = {"top_p": 0.9, "top_k": 20, "min_p": 0.05}
    spec = SamplingSpec(temperature=0.7, max_tokens=8, stop_token_ids=[], max_kept_set=128, **truncation)
    trajs = rollout(engine, spec)
    for i, t in enumerate(trajs):
        t.reward, t.group_id, t.episode_id = float(i), "g", f"e{i}"
    rule = KeptSetRule(**truncation)
    lost = [dataclasses.replace(t, kept_sets=[]) for t in trajs]
    with pytest.raises(TrainerError, match="record no kept sets"):
        train_step(backend, lost, AlgorithmConfig(), TrainerConfig(), temperature=0.7, kept_rule=rule)
    metrics = train_step(backend, trajs, AlgorithmConfig(), TrainerConfig(), temperature=0.7, kept_rule=rule)
    sizes = [len(k) for t in trajs for k in t.kept_sets]
    assert metrics["onpolicy/kept_set_size_mean"] == pytest.approx(sum(sizes) / len(sizes))
    assert metrics["onpolicy/kept_set_overflow"] == 0.0
    assert metrics["onpolicy/kept_set_disagreement"] == 0.0
    assert metrics["actor/updates"] == 1.0
