"""train_step and the FSDP2 backend in one process: what a step computes and that it learns.

The first tests drive `train_step` with a fake backend whose logprobs are chosen by hand, so the
advantages, masks, importance weights and update schedule it hands to the backend can be checked
exactly. The rest run the real `FSDP2Backend` (a one-rank gloo group) on the tiny random Qwen2:
step-0 identities, the direction GRPO moves the policy, gradient accumulation, masking of
infrastructure failures, exported weights and the critic/reference paths.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from agentrl.config import AlgorithmConfig as _AlgorithmConfig
from agentrl.config import TrainerConfig
from agentrl.trainer.backend import CriticBatch, PolicyBatch, TrainerBackend, UpdateResult, mini_batch_indices
from agentrl.trainer.step import train_step
from agentrl.types import TokenOrigin, Trajectory


def AlgorithmConfig(**kw: Any) -> _AlgorithmConfig:
    """The algorithm config with the on-policy gate off: the toy batches carry made-up rollout
    logprobs, which the gate would rightly mask (tests/unit/trainer/test_mismatch_gate.py tests it)."""
    return _AlgorithmConfig(**{"mismatch_gate": {"enabled": False}, **kw})


TINY_QWEN2 = Path("/work/shared/assets/tiny-random-qwen2")
X, Y = 100, 200  # rewarded and unrewarded response tokens


def make_traj(
    prompt: list[int], response: list[int], *, reward: float, group: str = "g", fault: str | None = None,
    rollout_logprob: float = -12.0,
) -> Trajectory:  # fmt: skip
    traj = Trajectory(reward=reward, group_id=group, fault=fault)
    traj.extend(prompt, TokenOrigin.PROMPT, 0)
    traj.extend(response, TokenOrigin.SAMPLED, 0, logprobs=[rollout_logprob] * len(response), version=0)
    return traj


def toy_batch() -> list[Trajectory]:
    """Two prompts x four samples; a sample is rewarded when it answered with token X."""
    out = []
    for g, prompt in enumerate(([1, 2, 3], [4, 5, 6, 7])):
        for k in range(4):
            rewarded = k % 2 == 0
            out.append(
                make_traj(prompt, [X if rewarded else Y] * (3 + k), reward=float(rewarded), group=f"p{g}")
            )
    return out


# ── train_step against a fake backend ───────────────────────────────────────────────────────────
class FakeBackend(TrainerBackend):
    """Logprobs are `rollout + shift` on every token; updates are recorded, not applied."""

    def __init__(self, shift: float = 0.0) -> None:
        self.shift = shift
        self.policy_batches: list[PolicyBatch] = []
        self.scored: list[int] = []

    has_reference = False  # type: ignore[assignment]
    has_critic = False  # type: ignore[assignment]
    global_step = 0  # type: ignore[assignment]

    def compute_logprobs(
        self, trajectories: Sequence[Trajectory], *, temperature: float = 1.0
    ) -> torch.Tensor:
        from agentrl.trainer.packing import pad_trajectories

        self.scored.append(len(trajectories))
        b = pad_trajectories(trajectories)
        return b.rollout_logprobs + self.shift * b.loss_mask

    def compute_ref_logprobs(self, trajectories, *, temperature=1.0):  # pragma: no cover - unused
        raise AssertionError

    def compute_values(self, trajectories):  # pragma: no cover - unused
        raise AssertionError

    def update_policy(self, batch: PolicyBatch, algorithm: Any) -> UpdateResult:
        self.policy_batches.append(batch)
        return UpdateResult({"pg_loss": float(len(self.policy_batches))})

    def update_critic(self, batch: CriticBatch, algorithm: Any) -> dict[str, float]:  # pragma: no cover
        raise AssertionError

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:  # pragma: no cover
        yield from ()

    def save(self, path, data_position=None):  # pragma: no cover
        pass

    def load(self, path):  # pragma: no cover
        return {}


def test_mini_batch_indices_are_contiguous_and_cover_everything():
    assert mini_batch_indices(5, 2) == [[0, 1], [2, 3, 4]]
    assert mini_batch_indices(2, 4) == [[0], [1]]
    assert [i for part in mini_batch_indices(17, 3) for i in part] == list(range(17))


def test_infra_failures_never_reach_the_backend_and_grpo_advantages_are_exact():
    trajs = [
        make_traj([1], [5, 6], reward=1.0), make_traj([1], [7], reward=0.0),
        make_traj([1], [5], reward=1.0), make_traj([1], [8, 9], reward=0.0),
        make_traj([1], [5, 5], reward=0.0, fault="infra"),  # would change the group stats if kept
    ]  # fmt: skip
    backend = FakeBackend()
    algo, trainer = AlgorithmConfig(advantage="grpo", rollout_is="none"), TrainerConfig()
    m = train_step(backend, trajs, algo, trainer)
    assert m["batch/infra_masked"] == 1.0 and backend.scored == [4]
    (batch,) = backend.policy_batches
    assert len(batch.trajectories) == 4 and all(t.trainable for t in batch.trajectories)
    # rewards 1,0,1,0: mean 0.5, unbiased std sqrt(1/3) -> ±0.5·sqrt(3) on every response token
    a = 0.5 * math.sqrt(3) / (1 + 1e-6 * math.sqrt(3))
    expected = torch.tensor([[a, a, 0.0], [-a, 0.0, 0.0], [a, 0.0, 0.0], [-a, -a, 0.0]])
    torch.testing.assert_close(batch.advantages, expected, atol=1e-5, rtol=0)
    assert batch.loss_mask.tolist() == [[1, 1, 0], [1, 0, 0], [1, 0, 0], [1, 1, 0]]
    assert batch.is_weights is None
    assert m["adv/max"] == pytest.approx(a, abs=1e-5) and m["reward/mean"] == 0.5


def test_epochs_times_mini_batches_optimizer_steps():
    backend = FakeBackend()
    trainer = TrainerConfig(ppo_epochs=2, mini_batches=2)
    m = train_step(backend, toy_batch(), AlgorithmConfig(), trainer)
    assert [len(b.trajectories) for b in backend.policy_batches] == [4, 4, 4, 4]
    assert m["actor/updates"] == 4.0 and m["actor/pg_loss"] == pytest.approx(2.5)  # mean of 1..4


def test_rollout_mismatch_is_measured_and_truncated():
    backend = FakeBackend(shift=math.log(3.0))  # trainer logprob = rollout + log 3: ratio 3
    no_gate = {"mismatch_gate": {"enabled": False}}  # a ratio of 3 on every token would be gated
    algo = AlgorithmConfig(rollout_is="tis", rollout_is_cap=2.0, **no_gate)
    m = train_step(backend, toy_batch(), algo, TrainerConfig())
    (batch,) = backend.policy_batches
    assert m["rollout/is_ratio_mean"] == pytest.approx(3.0, rel=1e-5)
    assert m["rollout/logprob_abs_diff"] == pytest.approx(math.log(3.0), rel=1e-5)
    kept = batch.loss_mask > 0
    assert torch.all(batch.is_weights[kept] == 2.0) and torch.all(batch.is_weights[~kept] == 0.0)
    icepop = FakeBackend(shift=math.log(3.0))  # ratio 3 is outside [1/2, 2]: every token dropped
    m = train_step(icepop, toy_batch(), AlgorithmConfig(rollout_is="icepop", **no_gate), TrainerConfig())
    assert m["rollout/masked_fraction"] == 1.0
    assert icepop.policy_batches[0].loss_mask.sum() == 0


def test_stop_properly_penalty_reshapes_truncated_scores_before_the_advantages():
    from agentrl.types import FinishReason

    def batch() -> list[Trajectory]:
        trajs = [make_traj([1], [5, 6], reward=r) for r in (1.0, 1.0, 0.0, 0.0)]
        for t, reason in zip(trajs, ("max_length", "done", "done", "max_turns"), strict=True):
            t.finish_reason = FinishReason(reason)  # only max_length is a truncation
        return trajs

    algo = AlgorithmConfig(rollout_is="none", stop_properly_penalty=0.0)
    backend = FakeBackend()
    m = train_step(backend, batch(), algo, TrainerConfig())
    # scores 0,1,0,0: mean 0.25, unbiased std 0.5 -> advantages -0.5, 1.5, -0.5, -0.5
    adv = backend.policy_batches[0].advantages[:, 0]
    torch.testing.assert_close(adv, torch.tensor([-0.25, 0.75, -0.25, -0.25]) / (0.5 + 1e-6))
    assert m["reward/truncated_fraction"] == 0.25 and m["reward/mean"] == 0.5  # raw rewards reported
    backend = FakeBackend()  # a negative coefficient replaces the score: -1,1,0,0, std sqrt(2/3)
    train_step(backend, batch(), algo.model_copy(update={"stop_properly_penalty": -1.0}), TrainerConfig())
    adv = backend.policy_batches[0].advantages[:, 0]
    torch.testing.assert_close(adv, torch.tensor([-1.0, 1.0, 0.0, 0.0]) / (math.sqrt(2 / 3) + 1e-6))
    backend = FakeBackend()  # off by default: the truncated sample keeps its reward
    train_step(backend, batch(), AlgorithmConfig(rollout_is="none"), TrainerConfig())
    assert backend.policy_batches[0].advantages[0, 0] > 0


class RefFakeBackend(FakeBackend):
    """FakeBackend with a reference whose logprobs are `rollout + ref_shift` on response tokens."""

    has_reference = True  # type: ignore[assignment]

    def __init__(self, ref_shift: float) -> None:
        super().__init__()
        self.ref_shift = ref_shift
        self.algorithms: list[Any] = []

    def compute_ref_logprobs(self, trajectories, *, temperature=1.0):
        from agentrl.trainer.packing import pad_trajectories

        b = pad_trajectories(trajectories)
        return b.rollout_logprobs + self.ref_shift * b.loss_mask

    def update_policy(self, batch: PolicyBatch, algorithm: Any) -> UpdateResult:
        self.algorithms.append(algorithm)
        return super().update_policy(batch, algorithm)


@pytest.mark.parametrize(("ref_shift", "coefs"), [(-0.5, [0.1, 0.11, 0.121]), (-0.1, [0.1, 0.09, 0.081])])
def test_adaptive_kl_controller_steers_the_coefficient_toward_the_target(ref_shift, coefs):
    from agentrl.errors import ConfigError
    from agentrl.trainer.step import make_kl_controller

    # k1 KL per token = logp - ref = -ref_shift: 0.5 (twice the 0.25 target) or 0.1 (below it).
    # error = clip(KL / 0.25 - 1, ±0.2) = ±0.2; beta *= 1 + error * 4 samples / horizon 8 = 1 ± 0.1
    algo = AlgorithmConfig(kl_coef=0.1, kl_estimator="k1", kl_target=0.25, kl_horizon=8, rollout_is="none")
    trajs = [make_traj([1], [5, 6], reward=r) for r in (1.0, 0.0, 1.0, 0.0)]
    backend, controller = RefFakeBackend(ref_shift), make_kl_controller(algo)
    for step in range(2):
        m = train_step(backend, trajs, algo, TrainerConfig(), kl_controller=controller)
        assert m["actor/kl_coef"] == pytest.approx(coefs[step])
        assert m["actor/kl_coef_next"] == pytest.approx(coefs[step + 1])
    # the loss of each step used that step's coefficient; the config itself is untouched
    assert [a.kl_coef for a in backend.algorithms] == pytest.approx(coefs[:2]) and algo.kl_coef == 0.1
    with pytest.raises(ConfigError, match="kl_controller"):
        train_step(backend, trajs, algo, TrainerConfig())
    fixed = make_kl_controller(algo.model_copy(update={"kl_target": None}))
    train_step(
        backend, trajs, algo.model_copy(update={"kl_target": None}), TrainerConfig(), kl_controller=fixed
    )
    assert fixed.value == 0.1


# ── the micro-batch objective and the rank split ────────────────────────────────────────────────
def _tokens(n: int = 6) -> dict[str, torch.Tensor]:
    return {
        "loss_mask": torch.tensor([[1.0, 1, 0, 1, 1, 1]]),
        "advantages": torch.tensor([[1.0, 1, 0, -2, -2, -2]]),
        "old_logprobs": torch.tensor([[-1.0, -2, -3, -1, -2, -3]]),
        "segment_ids": torch.tensor([[0, 0, 0, 1, 1, 1]]),
    }


@pytest.mark.parametrize("loss", ["ppo_clip", "gspo"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_objective_at_ratio_one_is_minus_the_mean_advantage_and_splits_over_micro_batches(loss, agg):
    from agentrl.trainer.objective import loss_denominator, policy_objective

    algo = AlgorithmConfig(policy_loss=loss, loss_agg=agg, kl_coef=0.5)
    tok = _tokens()
    tok["ref_logprobs"] = tok["old_logprobs"].clone()
    lp = tok["old_logprobs"].clone().requires_grad_(True)
    denom = loss_denominator(tok["loss_mask"].view(2, 3), agg)  # (sequences, len): one row each
    total, m = policy_objective(lp, tok, algo, denominator=denom)
    # token-mean: -(1+1-2-2-2)/5; seq-mean: -((1+1)/2 + (-6)/3)/2
    expected = 4 / 5 if agg == "token-mean" else 0.5
    assert total.item() == pytest.approx(expected, abs=1e-6) and m["kl_loss"] == 0.0
    assert m["ratio_max"] == m["ratio_min"] == 1.0 and m["ppo_kl"] == 0.0
    # the same tokens cut into two micro-batches with the whole batch's denominator add up
    halves = []
    for sl in (slice(0, 3), slice(3, 6)):
        part = {k: v[:, sl] for k, v in tok.items()}
        part["segment_ids"] = part["segment_ids"] - part["segment_ids"].min()
        halves.append(policy_objective(lp[:, sl], part, algo, denominator=denom)[0].item())
    assert sum(halves) == pytest.approx(total.item(), abs=1e-6)


def test_balanced_shares_split_tokens_evenly_and_deterministically():
    from agentrl.trainer.distributed import balanced_shares

    # longest first to the lighter rank: 100->a, 90->b, 80->b, 10->a, 10->a, 5->a (125 vs 170)
    assert balanced_shares([100, 90, 10, 10, 5, 80], 2) == [[0, 2, 3, 4], [1, 5]]
    assert balanced_shares([5, 5, 5, 5], 2) == [[0, 2], [1, 3]]
    assert balanced_shares([7], 3) == [[0], [], []]


def test_overlong_penalty_needs_the_length_limit():
    from agentrl.errors import ConfigError

    with pytest.raises(ConfigError, match="max_response_tokens"):
        train_step(FakeBackend(), toy_batch(), AlgorithmConfig(overlong_buffer_tokens=2), TrainerConfig())


# ── the real FSDP2 backend, one rank ────────────────────────────────────────────────────────────
def fsdp2(**trainer_kw: Any) -> Any:
    from agentrl.trainer.fsdp2 import FSDP2Backend

    algo_kw = trainer_kw.pop("algo", {})
    trainer = TrainerConfig(device="cpu", **{"lr": 1e-3, "micro_batch_tokens": 32, **trainer_kw})
    return FSDP2Backend(TINY_QWEN2, trainer, AlgorithmConfig(**algo_kw), seed=0)


def weights(backend: Any) -> dict[str, torch.Tensor]:
    return dict(backend.export_weights())


needs_model = pytest.mark.skipif(not TINY_QWEN2.is_dir(), reason="tiny Qwen2 not found in shared assets")


@needs_model
def test_step_zero_ratio_is_exactly_one_and_nothing_is_clipped():
    backend = fsdp2()
    m = train_step(
        backend, toy_batch(), AlgorithmConfig(rollout_is="none", mismatch_gate={"enabled": False}),
        TrainerConfig(micro_batch_tokens=32),
    )  # the toy batch's rollout logprobs are made up: the gate would mask it
    assert m["actor/ratio_min"] == 1.0 and m["actor/ratio_max"] == 1.0
    assert m["batch/scored_in_update"] == 1.0 and "actor/ppo_kl" not in m  # 0 by construction: not measured
    assert m["actor/pg_clipfrac"] == 0.0 and m["actor/pg_clipfrac_lower"] == 0.0
    assert m["actor/grad_norm"] > 0 and math.isfinite(m["actor/entropy"])


@needs_model
def test_grpo_raises_the_logprob_of_rewarded_answers():
    backend = fsdp2()
    batch = toy_batch()
    rewarded = torch.tensor([t.reward == 1.0 for t in batch])
    from agentrl.trainer.packing import pad_trajectories

    mask = pad_trajectories(batch).loss_mask

    def mean_logprob() -> torch.Tensor:
        lp = backend.compute_logprobs(batch)
        return (lp * mask).sum(-1) / mask.sum(-1)

    before = mean_logprob()
    for _ in range(3):
        train_step(backend, batch, AlgorithmConfig(), TrainerConfig())
    after = mean_logprob()
    assert torch.all(after[rewarded] > before[rewarded] + 0.5), (before, after)
    assert torch.all(after[~rewarded] < before[~rewarded] - 0.5), (before, after)

    # within one step (fixed old logprobs and advantages) the surrogate loss falls update by update
    losses: list[float] = []
    update = backend.update_policy
    backend.update_policy = lambda b, a: (r := update(b, a), losses.append(r.metrics["pg_loss"]))[0]
    train_step(backend, batch, AlgorithmConfig(), TrainerConfig(ppo_epochs=3))
    assert losses[0] > losses[1] > losses[2], losses


@needs_model
def test_micro_batches_accumulate_to_the_full_batch_update():
    batch, algo = toy_batch(), AlgorithmConfig(rollout_is="none")
    small, big = fsdp2(micro_batch_tokens=16), fsdp2(micro_batch_tokens=4096)
    m_small = train_step(small, batch, algo, TrainerConfig())
    m_big = train_step(big, batch, algo, TrainerConfig())
    assert m_small["actor/grad_norm"] == pytest.approx(m_big["actor/grad_norm"], rel=1e-5)
    ws, wb = weights(small), weights(big)
    for name in wb:
        # Adam's first step is lr·g/(|g| + eps) ≈ lr·sign(g): a wrong accumulation moves weights by
        # ~lr (1e-3), while summation order alone moves the few entries with |g| near eps by ~1e-4.
        torch.testing.assert_close(ws[name], wb[name], atol=2e-4, rtol=0)


@needs_model
@pytest.mark.parametrize("algo_kw", [{"rollout_is": "tis"}, {"rollout_is": "none", "kl_coef": 0.05}])
def test_scoring_in_the_update_equals_a_separate_scoring_pass(algo_kw):
    """The on-policy shortcut skips the old-logprob forward and must change nothing else: the same
    weights after the step, the same mismatch, ratio and KL metrics."""
    algo_kw = {**algo_kw, "mismatch_gate": {"enabled": False}}  # the gate needs the old logprobs first
    batch, algo = toy_batch(), AlgorithmConfig(**algo_kw)
    fused, separate = fsdp2(algo=algo_kw), fsdp2(algo=algo_kw)
    m_fused = train_step(fused, batch, algo, TrainerConfig())
    m_separate = train_step(separate, batch, algo, TrainerConfig(score_in_update=False))
    assert m_fused["batch/scored_in_update"] == 1.0 and m_separate["batch/scored_in_update"] == 0.0
    for name in ("rollout/is_ratio_mean", "rollout/is_ess", "rollout/logprob_abs_diff", "actor/pg_loss",
                 "actor/ratio_max", "actor/entropy", "actor/grad_norm"):  # fmt: skip
        assert m_fused[name] == pytest.approx(m_separate[name], rel=1e-5, abs=1e-7), name
    if "kl_coef" in algo_kw:
        assert m_fused["actor/kl_ref"] == pytest.approx(m_separate["actor/kl_ref"], abs=1e-7)
    else:
        assert m_fused["rollout/is_ratio_max"] > 1.0  # the mismatch is real, so TIS weights act
    wf, ws = weights(fused), weights(separate)
    for name in ws:
        torch.testing.assert_close(wf[name], ws[name], atol=1e-6, rtol=0)


def test_the_shortcut_is_not_taken_when_the_old_logprobs_are_needed_first():
    for algo, trainer in [
        (AlgorithmConfig(rollout_is="icepop"), TrainerConfig()),
        (AlgorithmConfig(), TrainerConfig(ppo_epochs=2)),
        (AlgorithmConfig(), TrainerConfig(mini_batches=2)),
    ]:
        backend = FakeBackend()
        backend.scores_in_update = True
        m = train_step(backend, toy_batch(), algo, trainer)
        assert m["batch/scored_in_update"] == 0.0 and backend.scored
        assert all(b.old_logprobs is not None for b in backend.policy_batches)


def test_the_update_refuses_to_score_old_logprobs_over_several_steps():
    from agentrl.errors import TrainerError
    from agentrl.trainer.packing import pad_trajectories

    backend = FakeBackend()
    backend.scores_in_update = True
    layout = pad_trajectories(toy_batch())
    batch = PolicyBatch(
        trajectories=toy_batch(), loss_mask=layout.loss_mask, advantages=layout.loss_mask, old_logprobs=None,
        rollout_logprobs=layout.rollout_logprobs,
    )  # fmt: skip
    for trainer in (TrainerConfig(ppo_epochs=2), TrainerConfig(mini_batches=2), TrainerConfig(score_in_update=False)):
        with pytest.raises(TrainerError, match="old_logprobs=None"):
            backend.update(batch, AlgorithmConfig(), trainer)
    assert not backend.policy_batches


def with_flat_groups() -> list[Trajectory]:
    """`toy_batch` plus two groups whose four rewards are equal (all 1, all 0): advantage 0."""
    flat = [make_traj([9, 8, 7], [X] * (2 + k), reward=1.0, group="all-right") for k in range(4)]
    flat += [make_traj([6, 5], [Y] * (3 + k), reward=0.0, group="all-wrong") for k in range(4)]
    return toy_batch()[:4] + flat + toy_batch()[4:]


def test_zero_advantage_rows_are_marked_only_when_nothing_else_moves_them():
    cases = [
        (AlgorithmConfig(), TrainerConfig(), [False] * 4 + [True] * 8 + [False] * 4),
        (AlgorithmConfig(advantage="rloo"), TrainerConfig(), [False] * 4 + [True] * 8 + [False] * 4),
        (AlgorithmConfig(entropy_coef=0.01), TrainerConfig(), None),  # the bonus has a gradient
        (AlgorithmConfig(kl_coef=0.1), TrainerConfig(), None),  # so does a KL loss
        (AlgorithmConfig(), TrainerConfig(zero_advantage_rows="train"), None),
    ]
    for algo, trainer, expected in cases:
        backend = FakeBackend()
        backend.has_reference = True  # type: ignore[assignment]
        backend.compute_ref_logprobs = backend.compute_logprobs  # type: ignore[method-assign]
        m = train_step(backend, with_flat_groups(), algo, trainer)
        (batch,) = backend.policy_batches
        if expected is None:
            assert batch.skip_rows is None and "batch/zero_adv_skipped" not in m
        else:
            assert batch.skip_rows.tolist() == expected and m["batch/zero_adv_skipped"] == 8.0
            assert batch.rows_to_train() == [i for i, skip in enumerate(expected) if not skip]


@needs_model
@pytest.mark.parametrize("mode", ["score", "skip"])
@pytest.mark.parametrize("score_in_update", [True, False])
def test_zero_advantage_rows_without_backward_leave_the_weights_unchanged(mode, score_in_update):
    """Two steps, one mixed and one where every group is flat (no row is trained at all), with
    weight decay so that even the all-zero-gradient step moves the weights: they must match
    training every row. `score` keeps every metric; `skip` measures the trained rows only."""
    algo = AlgorithmConfig()
    skip, full = fsdp2(weight_decay=0.1), fsdp2(weight_decay=0.1)
    flat_only = with_flat_groups()[4:12]
    for batch, skipped in ((with_flat_groups(), 8.0), (flat_only, 8.0)):
        m_skip = train_step(skip, batch, algo, TrainerConfig(score_in_update=score_in_update, zero_advantage_rows=mode))
        m_full = train_step(
            full, batch, algo, TrainerConfig(score_in_update=score_in_update, zero_advantage_rows="train")
        )
        assert m_skip["batch/zero_adv_skipped"] == skipped
        if mode == "score":  # the same metrics, measured on the same rows
            for name in ("actor/entropy", "actor/ratio_max", "actor/pg_loss", "rollout/is_ratio_mean",
                         "rollout/logprob_abs_diff"):  # fmt: skip
                assert m_skip[name] == pytest.approx(m_full[name], rel=1e-5, abs=1e-7), name
        assert m_skip["actor/grad_norm"] == pytest.approx(m_full["actor/grad_norm"], rel=1e-5, abs=1e-9)
        ws, wf = weights(skip), weights(full)
        for name in wf:
            # as in the micro-batch test: a dropped row or a missed optimizer step moves weights by
            # ~lr (1e-3); packing the rows differently moves a few entries by ~1e-4 at most.
            torch.testing.assert_close(ws[name], wf[name], atol=2e-4, rtol=0)
    assert m_full["actor/grad_norm"] == 0.0  # the flat step: nothing to learn, and yet a step
    assert "actor/entropy" in m_full
    assert ("actor/entropy" in m_skip) == (mode == "score")  # `skip`: no trained token to measure


@needs_model
@pytest.mark.parametrize("mode", ["score", "skip"])
def test_the_update_returns_the_old_logprobs_it_scored_and_leaves_its_input_alone(mode):
    """On-policy shortcut: the update hands back the logprobs its forward gave (those of the
    weights before the step) for the rows it ran; it writes nothing into the batch it was given."""
    from agentrl.trainer.packing import pad_trajectories

    backend, trajs = fsdp2(), with_flat_groups()
    before = backend.compute_logprobs(trajs)
    layout = pad_trajectories(trajs)
    adv = layout.loss_mask * torch.tensor([[1.0], [-1.0]] * 2 + [[0.0]] * 8 + [[1.0], [-1.0]] * 2)
    batch = PolicyBatch(
        trajectories=trajs, loss_mask=layout.loss_mask, advantages=adv, old_logprobs=None,
        rollout_logprobs=layout.rollout_logprobs,
    )  # fmt: skip
    result = backend.update(batch, AlgorithmConfig(), TrainerConfig(zero_advantage_rows=mode))
    assert batch.old_logprobs is None and batch.skip_rows is None  # the input is untouched
    flat = torch.tensor([False] * 4 + [True] * 8 + [False] * 4)
    assert result.metrics["batch/zero_adv_skipped"] == 8.0 and result.metrics["actor/updates"] == 1.0
    if mode == "score":
        assert result.scored_rows is None
        torch.testing.assert_close(result.old_logprobs, before * layout.loss_mask, atol=1e-5, rtol=0)
    else:  # the flat rows were not run at all: they read 0
        assert result.scored_rows.tolist() == (~flat).tolist()
        torch.testing.assert_close(result.old_logprobs[~flat], (before * layout.loss_mask)[~flat], atol=1e-5, rtol=0)
        assert torch.all(result.old_logprobs[flat] == 0)


@needs_model
def test_gradient_checkpointing_changes_memory_not_results():
    batch, algo = toy_batch(), AlgorithmConfig(rollout_is="none")
    plain, ckpt = fsdp2(), fsdp2(gradient_checkpointing=True)
    m_plain, m_ckpt = (
        train_step(plain, batch, algo, TrainerConfig()),
        train_step(ckpt, batch, algo, TrainerConfig()),
    )
    assert m_plain["actor/grad_norm"] == pytest.approx(m_ckpt["actor/grad_norm"], rel=1e-6)
    wp, wc = weights(plain), weights(ckpt)
    for name in wp:
        torch.testing.assert_close(wp[name], wc[name], atol=1e-6, rtol=0)


@needs_model
def test_infra_failed_trajectories_contribute_zero_gradient():
    from agentrl.trainer.packing import pad_trajectories

    clean = toy_batch()[:4]
    broken = make_traj([9, 9, 9], [X, Y, X, Y], reward=1.0, fault="infra")

    def update(trajs: list[Trajectory], broken_adv: float) -> dict[str, torch.Tensor]:
        backend = fsdp2(micro_batch_tokens=4096)
        layout = pad_trajectories(trajs)
        adv = layout.loss_mask.clone() * torch.tensor([[1.0], [-1.0], [1.0], [-1.0], [0.0]][: len(trajs)])
        raw_mask = torch.zeros_like(layout.loss_mask)
        for i, t in enumerate(trajs):  # the caller "forgot" to mask the failure: ones on its tokens
            raw_mask[i, t.prompt_length - 1 : len(t) - 1] = 1.0
        if len(trajs) == 5:
            adv[4] = broken_adv * raw_mask[4]
        batch = PolicyBatch(
            trajectories=trajs, loss_mask=raw_mask, advantages=adv,
            old_logprobs=backend.compute_logprobs(trajs), rollout_logprobs=layout.rollout_logprobs,
        )  # fmt: skip
        backend.update_policy(batch, AlgorithmConfig())
        return weights(backend)

    w_clean = update(clean, 0.0)
    w_plus, w_minus = update([*clean, broken], 100.0), update([*clean, broken], -100.0)
    for name in w_clean:
        assert torch.equal(w_plus[name], w_minus[name]), name
        torch.testing.assert_close(w_plus[name], w_clean[name], atol=1e-5, rtol=0)  # other packing


@needs_model
def test_export_weights_are_the_full_hf_state_dict_and_load_into_hf():
    from transformers import AutoModelForCausalLM

    from agentrl.trainer.packing import compute_token_logprobs, pack_trajectories

    backend = fsdp2()
    assert type(backend.policy.lm_head).__name__ == "ScoringHead"  # names survive the head swap
    hf = AutoModelForCausalLM.from_pretrained(TINY_QWEN2, dtype=torch.float32)
    exported = weights(backend)
    reference = hf.state_dict()
    assert set(exported) == set(reference)
    for name, tensor in reference.items():
        assert exported[name].shape == tensor.shape and torch.equal(exported[name], tensor), name

    train_step(backend, toy_batch(), AlgorithmConfig(), TrainerConfig())
    exported = weights(backend)
    assert not torch.equal(
        exported["model.layers.0.mlp.up_proj.weight"], reference["model.layers.0.mlp.up_proj.weight"]
    )
    hf.load_state_dict(exported)
    batch = toy_batch()
    packed = pack_trajectories(batch)
    with torch.no_grad():
        hf_lp = compute_token_logprobs(hf(**packed.model_inputs()).logits, packed.labels)[0]
    backend.score_all_tokens = True  # by default only the loss's tokens are scored
    ours = backend.compute_logprobs(batch)
    flat = torch.cat([ours[i, : len(t) - 1] for i, t in enumerate(batch)])
    ends = packed.cu_seqlens[1:].long() - 1
    keep = torch.ones(packed.num_tokens, dtype=torch.bool)
    keep[ends] = False
    torch.testing.assert_close(flat, hf_lp[keep], atol=1e-5, rtol=0)


@needs_model
def test_gae_with_critic_and_kl_to_reference():
    backend = fsdp2(algo={"advantage": "gae", "kl_coef": 0.1})
    assert backend.has_critic and backend.has_reference
    algo = AlgorithmConfig(advantage="gae", kl_coef=0.1, rollout_is="none")
    first = train_step(backend, toy_batch(), algo, TrainerConfig(critic_lr=1e-2))
    assert first["actor/kl_ref"] == 0.0  # the policy starts as the reference
    assert first["actor/ratio_max"] == 1.0 and "critic/vf_loss" in first
    later = [train_step(backend, toy_batch(), algo, TrainerConfig()) for _ in range(3)]
    assert later[-1]["actor/kl_ref"] > 0.0
    assert later[-1]["critic/vf_loss"] < first["critic/vf_loss"]


@needs_model
@needs_model
def test_lora_trains_only_the_adapters():
    pytest.importorskip("peft", reason="LoRA needs peft (pip install 'agentrl[lora]')")
    backend = fsdp2(lora_rank=4)
    trainable = {n for n, p in backend.policy.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    names = {n for n, _ in backend.export_weights()}
    assert not any("lora" in n or "base_layer" in n for n in names) and "model.embed_tokens.weight" in names


@needs_model
def test_make_backend_builds_what_the_config_names():
    from agentrl.config import AgentRLConfig
    from agentrl.errors import FeatureUnavailableError
    from agentrl.trainer import make_backend

    config = AgentRLConfig.model_validate(
        {"model": {"path": str(TINY_QWEN2)}, "trainer": {"device": "cpu"}, "algorithm": {"kl_coef": 0.1}}
    )
    backend = make_backend(config)
    assert type(backend).__name__ == "FSDP2Backend" and backend.has_reference and not backend.has_critic
    config.trainer.backend = "megatron"
    try:
        import megatron.core  # noqa: F401
    except ImportError:  # the optional extra: refused with the command that installs it
        with pytest.raises(FeatureUnavailableError, match=r"agentrl\[megatron\]"):
            make_backend(config)
    else:
        backend = make_backend(config)
        assert (
            type(backend).__name__ == "MegatronBackend" and backend.has_reference and not backend.has_critic
        )


def test_the_backend_table_matches_the_config_and_an_unknown_name_lists_the_known_ones():
    import typing

    from agentrl.config import AgentRLConfig
    from agentrl.errors import UnknownNameError
    from agentrl.registry import import_object
    from agentrl.trainer.backend import BACKENDS, make_backend

    assert set(BACKENDS) == set(typing.get_args(TrainerConfig.model_fields["backend"].annotation))
    for target in BACKENDS.values():
        assert issubclass(import_object(target), TrainerBackend)
    # The config refuses an unknown name first; a config built without validation reaches the table.
    config = AgentRLConfig.model_construct(trainer=TrainerConfig.model_construct(backend="fsdp3"))
    with pytest.raises(UnknownNameError, match=r"Did you mean 'fsdp2'\? Known backends: fsdp2, megatron\.") as info:
        make_backend(config)
    assert info.value.suggestions == ["fsdp2"]


@needs_model
@pytest.mark.parametrize("score_in_update", [True, False])
def test_the_step_returns_the_trainers_logprob_and_entropy_of_each_trained_token(score_in_update):
    """What a run stores beside the rollout's logprobs of the episodes it keeps: the old logprob the
    loss used (scored in the update or by a separate pass) and the policy's entropy, on the loss's
    tokens only, as long as each ledger; an infra-failed trajectory is not among them."""
    from agentrl.trainer.packing import pad_trajectories
    from agentrl.trainer.step import train_step_with_tokens

    batch = toy_batch()
    batch.insert(2, make_traj([1, 2, 3], [X, X], reward=0.0, group="p0", fault="infra"))
    trainable = [t for t in batch if t.trainable]
    expected = fsdp2().compute_logprobs(trainable)  # the same initial weights, before any update
    report, tokens = train_step_with_tokens(fsdp2(), batch, AlgorithmConfig(rollout_is="tis"),
                                            TrainerConfig(score_in_update=score_in_update))
    metrics = report.metrics
    assert tokens is not None and metrics["batch/scored_in_update"] == float(score_in_update)
    assert [id(t) for t in tokens.trained] == [id(t) for t in trainable]
    mask = pad_trajectories(trainable).loss_mask
    entropies = []
    for i, t in enumerate(trainable):
        logprobs, entropy = tokens.of(i)
        assert entropy is not None and len(logprobs) == len(entropy) == len(t.token_ids)
        sampled = [o == int(TokenOrigin.SAMPLED) for o in t.origins]
        assert [v is not None for v in logprobs] == sampled == [v is not None for v in entropy]
        want = [expected[i, j - 1].item() for j in range(len(t.token_ids)) if sampled[j]]
        assert [v for v in logprobs if v is not None] == pytest.approx(want, abs=1e-5)
        assert all(v is not None and v > 0 for v, s in zip(entropy, sampled, strict=True) if s)
        entropies += [v for v in entropy if v is not None]
    assert len(entropies) == int(mask.sum().item())
    # The entropy is the one the step reports, token by token: its mean is the step's actor/entropy.
    assert sum(entropies) / len(entropies) == pytest.approx(metrics["actor/entropy"], rel=1e-4)


@needs_model
def test_the_entropy_is_left_out_when_the_update_takes_several_steps():
    from agentrl.trainer.step import train_step_with_tokens

    _, tokens = train_step_with_tokens(fsdp2(), toy_batch(), AlgorithmConfig(rollout_is="tis"),
                                       TrainerConfig(mini_batches=2, score_in_update=False))
    assert tokens is not None and tokens.entropy is None
    logprobs, entropy = tokens.of(0)
    assert entropy is None and sum(v is not None for v in logprobs) == tokens.trained[0].num_sampled
