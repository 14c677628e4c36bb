"""The FSDP2 backend across real processes: 1 rank vs 2 ranks, and exact resume from a checkpoint.

The tests spawn ranks with `agentrl.trainer.launch` (gloo on 127.0.0.1, a free port), run the
tiny random Qwen2 on CPU and compare what the ranks wrote. The rank functions live at module
level so the spawned processes can import them by name. A launch costs a spawn, a torch import and
a model build per rank, so the tests that compare the same rank counts share launches through
module fixtures (`one_and_two_ranks`, `checkpoints`), each asserting its own facts about them.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from agentrl.config import AlgorithmConfig as _AlgorithmConfig
from agentrl.config import TrainerConfig
from agentrl.types import TokenOrigin, Trajectory


def AlgorithmConfig(**kw: Any) -> _AlgorithmConfig:
    """The algorithm config with the on-policy gate off: the toy batches carry made-up rollout
    logprobs, which the gate would rightly mask (tests/unit/trainer/test_mismatch_gate.py tests it)."""
    return _AlgorithmConfig(**{"mismatch_gate": {"enabled": False}, **kw})


TINY_QWEN2 = Path("/work/shared/assets/tiny-random-qwen2")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not TINY_QWEN2.is_dir(), reason="tiny Qwen2 not found in shared assets"),
]


def toy_batch(shift: int = 0) -> list[Trajectory]:
    """Three prompts x four samples of uneven lengths; token 100 is rewarded, token 200 is not."""
    out = []
    for g, prompt in enumerate(([1, 2, 3], [4, 5, 6, 7, 8], [9, 10])):
        for k in range(4):
            rewarded = (k + shift) % 2 == 0
            traj = Trajectory(reward=float(rewarded), group_id=f"p{g}")
            traj.extend([p + shift for p in prompt], TokenOrigin.PROMPT, 0)
            resp = [100 if rewarded else 200] * (2 + k + g)
            traj.extend(resp, TokenOrigin.SAMPLED, 0, logprobs=[-11.9] * len(resp), version=0)
            out.append(traj)
    return out


def _backend(**kw: Any) -> Any:
    from agentrl.trainer.fsdp2 import FSDP2Backend

    trainer = TrainerConfig(device="cpu", lr=1e-4, warmup_steps=2, micro_batch_tokens=24, **kw)
    return FSDP2Backend(TINY_QWEN2, trainer, AlgorithmConfig(), seed=0, deterministic=True)


# ── 1 rank vs 2 ranks ───────────────────────────────────────────────────────────────────────────
def train_two_steps(out: str) -> dict[str, Any]:
    from agentrl.trainer.step import train_step

    backend = _backend(mini_batches=2)
    algo, trainer = AlgorithmConfig(), TrainerConfig(mini_batches=2)
    first_logprobs = backend.compute_logprobs(toy_batch())
    metrics = [train_step(backend, toy_batch(s), algo, trainer) for s in (0, 1)]
    weights = dict(backend.export_weights())
    if backend.rank == 0:
        torch.save(weights, Path(out) / f"weights_world{backend.world_size}.pt")
    return {"metrics": metrics, "logprobs": first_logprobs, "world": backend.world_size}


def train_two_ways(out: str) -> dict[str, Any]:
    """The comparisons of 1 rank vs 2 in one launch per rank count (a launch spawns and imports torch)."""
    from gate_paths import gate_both_ways

    gate = gate_both_ways(_backend, toy_batch())
    return {"two_steps": train_two_steps(out), "flat": train_with_flat_groups(out), "gate": gate}


@pytest.fixture(scope="module")
def one_and_two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any], list[Any]]:
    """(the directory the ranks wrote their weights to, the 1-rank results, the 2-rank results)."""
    from agentrl.trainer import launch

    out = tmp_path_factory.mktemp("ranks")
    return out, launch(train_two_ways, 1, str(out)), launch(train_two_ways, 2, str(out))


def test_one_and_two_processes_give_the_same_losses_and_weights(one_and_two_ranks) -> None:
    tmp_path, one_both, two_both = one_and_two_ranks
    one, two = [r["two_steps"] for r in one_both], [r["two_steps"] for r in two_both]
    assert [r["world"] for r in two] == [2, 2]
    # both ranks hand back the whole batch's logprobs, equal to the single process's
    torch.testing.assert_close(two[0]["logprobs"], two[1]["logprobs"], atol=0, rtol=0)
    torch.testing.assert_close(two[0]["logprobs"], one[0]["logprobs"], atol=1e-5, rtol=0)
    for step in range(2):
        m1, m2 = one[0]["metrics"][step], two[0]["metrics"][step]
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/ppo_kl", "actor/entropy", "actor/pg_clipfrac"):
            assert m1[key] == pytest.approx(m2[key], abs=1e-5), (step, key, m1[key], m2[key])
        assert two[0]["metrics"][step]["actor/pg_loss"] == two[1]["metrics"][step]["actor/pg_loss"]
    w1 = torch.load(tmp_path / "weights_world1.pt")
    w2 = torch.load(tmp_path / "weights_world2.pt")
    assert set(w1) == set(w2)
    worst = max((w1[k] - w2[k]).abs().max().item() for k in w1)
    assert worst < 1e-5, worst
    (tmp_path / "report.txt").write_text(f"max weight diff {worst}\n")


def test_the_gate_decided_in_the_update_equals_a_separate_pass_on_one_and_two_ranks(one_and_two_ranks) -> None:
    """Two ranks judge their own rows in the update and combine them: the same gated rows, figures,
    loss and weights as a separate scoring pass, and as one rank."""
    from gate_paths import assert_same_gate

    _, one, two = one_and_two_ranks
    for result in (one[0]["gate"], two[0]["gate"], two[1]["gate"]):
        # Adam's first step moves each weight by lr·sign(g) = 5e-5 (lr 1e-4 warming up over 2 steps):
        # a row wrongly kept or dropped flips many signs, a 1e-4 change; summation order flips none here
        assert_same_gate(result, weight_atol=1e-5)
    assert two[0]["gate"]["gated"] == two[1]["gate"]["gated"]
    for a, b in zip(one[0]["gate"]["gated"][0], two[0]["gate"]["gated"][0], strict=True):
        assert a[:2] == b[:2] and max(abs(x - y) for x, y in zip(a[2:], b[2:], strict=True)) <= 1e-5


def train_with_flat_groups(out: str) -> dict[str, Any]:
    """A batch with two flat groups (no backward, scored without a graph), then an all-flat one."""
    from agentrl.trainer.step import train_step

    backend = _backend(weight_decay=0.1)
    algo, trainer = AlgorithmConfig(), TrainerConfig()
    flat = []
    for g, (reward, prompt) in enumerate(((1.0, [11, 12]), (0.0, [13, 14, 15]))):
        for k in range(4):
            traj = Trajectory(reward=reward, group_id=f"flat{g}")
            traj.extend(prompt, TokenOrigin.PROMPT, 0)
            traj.extend([100] * (2 + k), TokenOrigin.SAMPLED, 0, logprobs=[-11.9] * (2 + k), version=0)
            flat.append(traj)
    metrics = [train_step(backend, batch, algo, trainer) for batch in (toy_batch() + flat, flat)]
    weights = dict(backend.export_weights())
    if backend.rank == 0:
        torch.save(weights, Path(out) / f"flat_world{backend.world_size}.pt")
    return {"metrics": metrics}


def test_flat_groups_train_alike_on_one_and_two_ranks(one_and_two_ranks) -> None:
    """Ranks plan the trained and the scored rows separately, padding each plan to the busiest
    rank; with every row flat each still runs one zero-loss micro-batch, so all stay in step."""
    tmp_path, one_both, two_both = one_and_two_ranks
    one, two = [r["flat"] for r in one_both], [r["flat"] for r in two_both]
    for step, skipped in enumerate((8.0, 8.0)):
        m1, m2 = one[0]["metrics"][step], two[0]["metrics"][step]
        assert m1["batch/zero_adv_skipped"] == m2["batch/zero_adv_skipped"] == skipped
        for key in ("actor/grad_norm", "actor/entropy", "actor/pg_loss", "rollout/is_ratio_mean"):
            assert m1[key] == pytest.approx(m2[key], abs=1e-5), (step, key, m1[key], m2[key])
    assert one[0]["metrics"][1]["actor/grad_norm"] == 0.0
    w1, w2 = torch.load(tmp_path / "flat_world1.pt"), torch.load(tmp_path / "flat_world2.pt")
    worst = max((w1[k] - w2[k]).abs().max().item() for k in w1)
    assert worst < 1e-5, worst


# ── resume ──────────────────────────────────────────────────────────────────────────────────────
def _draws() -> list[float]:
    return [random.random(), float(np.random.rand()), float(torch.rand(()))]


def continue_or_resume(ckpt: str) -> dict[str, Any]:
    """Step 1, save, steps 2-4 with one backend; then a fresh backend loads and redoes steps 2-4."""
    from agentrl.trainer.step import train_step

    algo, trainer = AlgorithmConfig(), TrainerConfig()
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    first = _backend()
    train_step(first, toy_batch(0), algo, trainer)
    first.save(ckpt, data_position={"epoch": 0, "row": 12})
    draws_after_save = _draws()
    cont = [train_step(first, toy_batch(s % 2), algo, trainer) for s in range(1, 4)]
    cont_weights = dict(first.export_weights())

    random.seed(99), np.random.seed(99), torch.manual_seed(99)  # scramble: load must restore them
    second = _backend()
    position = second.load(ckpt)
    draws_after_load = _draws()
    resumed = [train_step(second, toy_batch(s % 2), algo, trainer) for s in range(1, 4)]
    res_weights = dict(second.export_weights())

    def series(key: str) -> tuple[list[float], list[float]]:
        return [m[key] for m in cont], [m[key] for m in resumed]

    return {
        "position": position,
        "steps": (first.global_step, second.global_step),
        "draws": (draws_after_save, draws_after_load),
        "losses": series("actor/pg_loss"),
        "grad_norms": series("actor/grad_norm"),
        "lrs": series("actor/lr"),
        "same_weights": all(torch.equal(cont_weights[k], res_weights[k]) for k in cont_weights),
    }


@pytest.mark.parametrize("ranks", [1, 2])
def test_resume_continues_exactly(checkpoints: dict[str, Any], ranks: int) -> None:
    for result in checkpoints["resume"][ranks]:
        assert result["position"] == {"epoch": 0, "row": 12}
        assert result["steps"] == (4, 4)
        saved, loaded = result["draws"]
        assert saved == loaded  # python, numpy and torch RNG streams continue where they were
        assert result["lrs"][0] == result["lrs"][1] == pytest.approx([1e-4] * 3)  # warm-up restored
        assert result["losses"][0] == result["losses"][1]  # three steps on, bit for bit
        assert result["grad_norms"][0] == result["grad_norms"][1]
        assert result["same_weights"]


def save_or_load(ckpt: str, out: str, save: bool) -> dict[str, Any]:
    """Saving side: a step, save, one more step. Loading side (another rank count): load, the same step."""
    from agentrl.trainer.step import train_step

    algo, trainer = AlgorithmConfig(), TrainerConfig()
    backend = _backend()
    if save:
        train_step(backend, toy_batch(0), algo, trainer)
        backend.save(ckpt, data_position={"row": 12})
        loaded = {k: v.clone() for k, v in backend.export_weights()}
    else:
        position = backend.load(ckpt)
        assert position == {"row": 12}
        loaded = {k: v.clone() for k, v in backend.export_weights()}  # on one rank: live storage
    metrics = train_step(backend, toy_batch(1), algo, trainer)
    after = dict(backend.export_weights())  # a collective: every rank calls it
    if backend.rank == 0:
        side = "saved" if save else "loaded"
        torch.save({"at_checkpoint": loaded, "after": after}, Path(out) / f"{side}.pt")
    return {"step": backend.global_step, "grad_norm": metrics["actor/grad_norm"]}


def checkpoint_work(out: str, resume: bool, load: str | None, save: str | None) -> dict[str, Any]:
    """What one launch does for the checkpoint tests: the exact resume (on this rank count), then
    the loading side of a checkpoint another rank count saved (`load`: its name under `out`), then
    the saving side of one for another rank count (`save`)."""
    done: dict[str, Any] = {}
    if resume:
        done["resume"] = continue_or_resume(str(Path(out) / "resume" / "ckpt"))
    for name, save_side in ((load, False), (save, True)):
        if name is not None:
            done[name] = save_or_load(str(Path(out) / name / "ckpt"), str(Path(out) / name), save_side)
    return done


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The resume and rank-count tests' ranks, in three launches instead of six (each spawns ranks
    that import torch and build the model): 1 rank resumes and saves "1-2"; 2 ranks resume, load
    "1-2" and save "2-1"; 1 rank loads "2-1". Results by test: `resume` by rank count, and for each
    direction the saving and the loading ranks' results and the directory they wrote to."""
    from agentrl.trainer import launch

    out = tmp_path_factory.mktemp("checkpoints")
    for name in ("1-2", "2-1"):
        (out / name).mkdir()
    first = launch(checkpoint_work, 1, str(out), True, None, "1-2")
    second = launch(checkpoint_work, 2, str(out), True, "1-2", "2-1")
    third = launch(checkpoint_work, 1, str(out), False, "2-1", None)
    return {
        "resume": {1: [r["resume"] for r in first], 2: [r["resume"] for r in second]},
        "1-2": (out / "1-2", [r["1-2"] for r in first], [r["1-2"] for r in second]),
        "2-1": (out / "2-1", [r["2-1"] for r in second], [r["2-1"] for r in third]),
    }


@pytest.mark.parametrize(("save_ranks", "load_ranks"), [(2, 1), (1, 2)])
def test_a_checkpoint_resumes_on_another_rank_count(checkpoints: dict[str, Any], save_ranks: int,
                                                    load_ranks: int) -> None:
    """One rank trains an unwrapped model, two ranks a sharded one; DCP checkpoints move between them."""
    tmp_path, saved, loaded = checkpoints[f"{save_ranks}-{load_ranks}"]
    assert [r["step"] for r in saved + loaded] == [2] * (save_ranks + load_ranks)
    assert loaded[0]["grad_norm"] == pytest.approx(saved[0]["grad_norm"], rel=1e-5)
    a, b = torch.load(tmp_path / "saved.pt"), torch.load(tmp_path / "loaded.pt")
    for name, value in a["at_checkpoint"].items():
        assert torch.equal(value, b["at_checkpoint"][name]), name  # the checkpoint is exact
    worst = max((a["after"][k] - b["after"][k]).abs().max().item() for k in a["after"])
    assert worst < 1e-5, worst  # and the next step agrees up to the reduction order


# ── LoRA ────────────────────────────────────────────────────────────────────────────────────────
def lora_train_and_export() -> dict[str, Any]:
    from agentrl.trainer.fsdp2 import FSDP2Backend
    from agentrl.trainer.packing import pack_trajectories
    from agentrl.trainer.step import train_step

    trainer = TrainerConfig(device="cpu", lr=1e-2, micro_batch_tokens=64, lora_rank=4, lora_alpha=8.0)
    backend = FSDP2Backend(TINY_QWEN2, trainer, AlgorithmConfig(), seed=0)
    # one backward by hand: which parameters receive a gradient?
    logprobs, _ = backend._token_scores(
        backend.policy, pack_trajectories(toy_batch()), 1.0, with_entropy=False
    )
    logprobs.sum().backward()
    with_grad = sorted(n for n, p in backend.policy.named_parameters() if p.grad is not None)
    backend.optimizer.zero_grad(set_to_none=True)
    for s in range(2):
        train_step(backend, toy_batch(s), AlgorithmConfig(), TrainerConfig())
    raw = {
        n: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu()
        for n, t in backend.policy.state_dict().items()
    }
    return {
        "with_grad": with_grad,
        "raw": raw,
        "exported": dict(backend.export_weights()),
        "logprobs": backend.compute_logprobs(toy_batch()),
    }


def test_lora_trains_adapters_and_exports_merged_weights() -> None:
    pytest.importorskip("peft", reason="LoRA needs peft (pip install 'agentrl[lora]')")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from agentrl.trainer import launch
    from agentrl.trainer.packing import compute_token_logprobs, pad_trajectories

    (result,) = launch(lora_train_and_export, 1)
    assert result["with_grad"] and all(".lora_A." in n or ".lora_B." in n for n in result["with_grad"])
    assert any(".lora_B." in n and result["raw"][n].abs().max() > 0 for n in result["raw"])  # adapters moved
    # peft's own merge of the trained adapters gives the exported tensors
    base = AutoModelForCausalLM.from_pretrained(TINY_QWEN2, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8.0, lora_dropout=0.0, target_modules="all-linear")
    peft_model = get_peft_model(base, config)
    peft_model.load_state_dict(result["raw"], strict=True)
    merged = peft_model.merge_and_unload().state_dict()
    exported = result["exported"]
    assert set(exported) == set(merged)
    worst = max((exported[k] - merged[k]).abs().max().item() for k in merged)
    assert worst < 1e-6, worst
    original = AutoModelForCausalLM.from_pretrained(TINY_QWEN2, dtype=torch.float32).state_dict()
    assert not torch.equal(
        exported["model.layers.0.self_attn.q_proj.weight"], original["model.layers.0.self_attn.q_proj.weight"]
    )
    assert torch.equal(exported["model.embed_tokens.weight"], original["model.embed_tokens.weight"])
    # a plain model loaded with the export scores tokens as the LoRA policy does
    plain = AutoModelForCausalLM.from_pretrained(TINY_QWEN2, dtype=torch.float32).eval()
    plain.load_state_dict(exported)
    padded = pad_trajectories(toy_batch())
    with torch.no_grad():
        logits = plain(input_ids=padded.input_ids, attention_mask=padded.attention_mask).logits
    expect = compute_token_logprobs(logits, padded.labels, 1.0) * padded.loss_mask
    torch.testing.assert_close(result["logprobs"] * (padded.loss_mask > 0), expect, atol=1e-5, rtol=0)


# ── critic and reference across ranks; failures ────────────────────────────────────────────────
def ppo_with_critic_and_kl() -> list[dict[str, float]]:
    from agentrl.trainer.fsdp2 import FSDP2Backend
    from agentrl.trainer.step import train_step

    algo = AlgorithmConfig(advantage="gae", kl_coef=0.05, rollout_is="none")
    trainer = TrainerConfig(device="cpu", lr=1e-3, critic_lr=1e-2, micro_batch_tokens=24)
    backend = FSDP2Backend(TINY_QWEN2, trainer, algo, seed=0)
    return [train_step(backend, toy_batch(), algo, trainer) for _ in range(3)]


def test_ppo_with_critic_and_reference_on_two_ranks() -> None:
    from agentrl.trainer import launch

    rank0, rank1 = launch(ppo_with_critic_and_kl, 2)
    for a, b in zip(rank0, rank1, strict=True):  # every rank reports the same step
        for key in ("actor/pg_loss", "actor/kl_ref", "critic/vf_loss", "critic/grad_norm", "adv/mean"):
            assert a[key] == b[key], key
    assert rank0[0]["actor/kl_ref"] == 0.0 and rank0[0]["actor/ratio_max"] == 1.0
    assert rank0[-1]["actor/kl_ref"] > 0.0
    assert rank0[-1]["critic/vf_loss"] < rank0[0]["critic/vf_loss"]


def fail_on_rank_one() -> int:
    import os

    if os.environ["RANK"] == "1":
        raise ValueError("boom on purpose")
    return 0


def test_launch_reports_the_failing_rank() -> None:
    from agentrl.errors import TrainerError
    from agentrl.trainer import launch

    with pytest.raises(TrainerError, match=r"(?s)rank 1.*boom on purpose"):
        launch(fail_on_rank_one, 2)
