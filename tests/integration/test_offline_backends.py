"""The SFT and preference steps through the real backends on the tiny random Qwen2, against transformers.

A preference step trains on per-completion weights instead of the pair's loss (trainer/offline_step.py):
its gradient must still be the preference loss's, whatever micro-batches the completions land in; here
its gradient norm is compared with that of the loss computed directly on a transformers copy of the
model. The SFT step gives the same numbers on FSDP2 and Megatron-core (one process each)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from agentrl.config import AlgorithmConfig, TrainerConfig

REPO = Path(__file__).resolve().parents[2]
TINY = Path("/work/shared/assets/tiny-random-qwen2")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not TINY.is_dir(), reason="tiny Qwen2 not found in shared assets"),
]


@pytest.fixture(scope="module")
def rows():
    from agentrl.chat import ChatTemplate
    from agentrl.offline_rows import load_demonstrations, load_preferences

    template = ChatTemplate.from_pretrained(TINY)
    demos = load_demonstrations([REPO / "examples/data/demonstrations.jsonl"], template).examples[:4]
    pairs = load_preferences([REPO / "examples/data/preferences.jsonl"], template).examples[:4]
    return demos, [(p.chosen, p.rejected) for p in pairs]


def direct_grad_norm(pairs, reference: torch.Tensor, kind: str, beta: float) -> tuple[float, float]:
    """(loss, gradient norm) of the preference loss on a plain transformers model, one padded forward."""
    from transformers import AutoModelForCausalLM

    from agentrl.trainer.offline_losses import preference_loss, sequence_logprobs
    from agentrl.trainer.packing import pad_trajectories

    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32)
    model.train()
    layout = pad_trajectories([c for c, _ in pairs] + [r for _, r in pairs])
    logits = model(input_ids=layout.input_ids, attention_mask=layout.attention_mask).logits.float()
    logprobs = torch.log_softmax(logits, -1).gather(-1, layout.labels[..., None])[..., 0]
    sums, counts = sequence_logprobs(logprobs, layout.loss_mask)
    n = len(pairs)
    loss, _ = preference_loss(sums[:n], sums[n:], reference[:, 0].float(), reference[:, 1].float(), counts[:n],
                              counts[n:], kind=kind, beta=beta)
    loss.backward()
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None))
    return float(loss), float(norm)


@pytest.mark.parametrize("kind", ["dpo", "ipo"])
def test_a_preference_step_has_the_gradient_of_the_preference_loss(rows, kind):
    from agentrl.trainer.fsdp2 import FSDP2Backend
    from agentrl.trainer.offline_step import preference_step, score_rows

    _, pairs = rows
    algorithm = AlgorithmConfig(objective=kind, beta=0.3)
    # a budget of about one completion per micro-batch: a pair's chosen and rejected are never together
    trainer = TrainerConfig(device="cpu", lr=1e-3, micro_batch_tokens=320, grad_clip=1e6)
    backend = FSDP2Backend(TINY, trainer, algorithm, seed=0)
    sums, _ = score_rows(backend, [c for c, _ in pairs] + [r for _, r in pairs])
    reference = torch.stack([sums[:4], sums[4:]], 1) + torch.tensor([[0.5, -1.0], [2.0, 0.0], [-1.5, 0.5], [0.0, 3.0]],
                                                                    dtype=torch.float64)
    metrics = preference_step(backend, pairs, reference, algorithm, trainer)
    loss, norm = direct_grad_norm(pairs, reference, kind, 0.3)
    assert metrics["prefs/loss"] == pytest.approx(loss, rel=1e-5)
    assert metrics["actor/grad_norm"] == pytest.approx(norm, rel=1e-4)


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")
def test_an_sft_step_is_the_same_on_fsdp2_and_megatron(rows):
    from agentrl.trainer.fsdp2 import FSDP2Backend
    from agentrl.trainer.megatron import MegatronBackend
    from agentrl.trainer.offline_step import sft_step

    demos, _ = rows
    algorithm = AlgorithmConfig(objective="sft")
    trainer = TrainerConfig(device="cpu", lr=1e-3, micro_batch_tokens=512)
    got = {}
    for name, cls in (("fsdp2", FSDP2Backend), ("megatron", MegatronBackend)):
        got[name] = sft_step(cls(TINY, trainer, algorithm, seed=0), demos, algorithm, trainer)
    for key in ("actor/nll", "actor/loss", "actor/grad_norm"):
        assert got["megatron"][key] == pytest.approx(got["fsdp2"][key], rel=1e-4), key
    assert got["fsdp2"]["batch/rows"] == 4 and got["fsdp2"]["actor/nll"] > 10  # a random model: about log(vocab)
