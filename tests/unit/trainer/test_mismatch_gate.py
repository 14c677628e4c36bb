"""The on-policy mismatch gate: which sequences it masks, why, and when the run stops.

Guards: a sequence whose rollout logprobs, template re-render or policy versions do not match is
masked out of the loss with its reason (and only that sequence); the decisions travel typed in
the step's report (which row, why, its figures), never in the metrics, and reach each group's
ledger text; a step where more than `max_gated_share` trip raises with the likely cause and the
`agentrl check onpolicy` command; a healthy batch (equal logprobs) trips nothing.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_step import FakeBackend, fsdp2, needs_model, weights, with_flat_groups

from agentrl.config import AgentRLConfig, AlgorithmConfig, MismatchGateConfig, TrainerConfig
from agentrl.config import AlgorithmConfig as _AlgorithmConfig
from agentrl.orchestration.onpolicy_gate import (
    LIKELY_CAUSES,
    OnPolicyMismatchError,
    allowed_staleness,
    check_gated_share,
    gated_groups,
)
from agentrl.trainer.mismatch_gate import gate_sequences
from agentrl.trainer.packing import pad_trajectories
from agentrl.trainer.step import train_step, train_step_with_tokens
from agentrl.types import GATE_REASONS, GatedRow, TokenOrigin, Trajectory


def traj(logprobs: list[float], *, version: int = 0, template_mismatch: float | None = None) -> Trajectory:
    t = Trajectory(reward=float(len(logprobs) % 2), group_id="g")
    t.extend([1, 2], TokenOrigin.PROMPT, 0)
    t.extend([5] * len(logprobs), TokenOrigin.SAMPLED, 1, logprobs=logprobs, version=version)
    if template_mismatch is not None:
        t.metrics["template_mismatch"] = template_mismatch
    return t


def gate(trajs: list[Trajectory], shift: dict[int, list[float]] | None = None, **kw):
    layout = pad_trajectories(trajs)
    old = layout.rollout_logprobs.clone()
    for row, deltas in (shift or {}).items():
        old[row, : len(deltas)] += torch.tensor(deltas)
    return gate_sequences(trajs, old, layout.rollout_logprobs, layout.loss_mask, MismatchGateConfig(), **kw)


def test_every_reason_the_trainer_gives_has_a_likely_cause_for_the_run_to_name():
    assert set(GATE_REASONS) <= set(LIKELY_CAUSES)


def row(i: int, reason) -> GatedRow:
    return GatedRow(row=i, reason=reason, logprob_gap=0.0, mean_logprob_gap=0.0, log_ratio_spread=0.0, ess=1.0)


def test_a_healthy_batch_trips_nothing():
    d = gate([traj([-1.0, -2.0, -0.5]) for _ in range(4)], shift={0: [1e-5, -1e-5]}, policy_version=0)
    assert d.reasons == [None] * 4 and d.gated == []
    assert d.metrics["onpolicy/gated_sequences"] == 0.0 and d.metrics["onpolicy/batch_ess"] == pytest.approx(1.0)
    assert d.metrics["onpolicy/logprob_gap_max"] == pytest.approx(1e-5, rel=1e-2)


def test_each_figure_gates_only_its_sequence_with_its_reason():
    trajs = [
        traj([-1.0, -1.0], version=2, template_mismatch=1.0),  # template re-render differed
        traj([-1.0, -1.0], version=3),  # sampled by a version outside the window [1, 2]
        traj([-1.0, -1.0, -1.0], version=2),  # one token 2.5 nats off
        traj([-1.0, -1.0, -1.0], version=2),  # every token 0.3 nats off
        traj([-1.0, -1.0], version=2),  # healthy
    ]
    d = gate(trajs, shift={2: [0.0, 2.5, 0.0], 3: [0.3, 0.3, 0.3]}, policy_version=2, allowed_staleness=1)
    assert d.reasons == ["template", "version", "logprob_gap", "mean_logprob_gap", None]
    assert d.keep.tolist() == [0.0, 0.0, 0.0, 0.0, 1.0]
    assert d.metrics["onpolicy/out_of_window_tokens"] == 2.0
    assert d.metrics["onpolicy/gated_sequences/template"] == 1.0
    assert d.metrics["onpolicy/gated_share"] == pytest.approx(0.8)
    assert [(g.row, g.reason) for g in d.gated] == [(0, "template"), (1, "version"), (2, "logprob_gap"),
                                                    (3, "mean_logprob_gap")]
    template, version, gap, mean_gap = d.gated  # each with the figures the gate saw
    assert (template.template_mismatches, template.out_of_window_tokens) == (1.0, 0)
    assert (version.out_of_window_tokens, version.template_mismatches) == (2, 0.0)
    assert gap.logprob_gap == pytest.approx(2.5) and gap.mean_logprob_gap == pytest.approx(2.5 / 3)
    assert gap.log_ratio_spread == pytest.approx(2.5)
    # its shift lands on two of its three sampled tokens: log ratios (0.3, 0.3, 0)
    assert mean_gap.logprob_gap == pytest.approx(0.3) and mean_gap.mean_logprob_gap == pytest.approx(0.2)
    weights = [1.0, 1.0, math.exp(-0.3)]
    assert mean_gap.ess == pytest.approx(sum(weights) ** 2 / (3 * sum(w * w for w in weights)), rel=1e-5)
    assert all(isinstance(v, float) for v in d.metrics.values())
    assert not any(k.startswith("onpolicy/gated_row") for k in d.metrics)


def test_versions_inside_the_staleness_window_pass():
    d = gate([traj([-1.0], version=1), traj([-1.0], version=2)], policy_version=2, allowed_staleness=1)
    assert d.reasons == [None, None]
    assert gate([traj([-1.0], version=1)], policy_version=2).reasons == ["version"]  # sync: no lag allowed


def test_allowed_staleness_follows_the_mode():
    assert allowed_staleness(AgentRLConfig()) == 0
    assert allowed_staleness(AgentRLConfig.model_validate({"run": {"mode": "one_step_off"}})) == 1
    assert allowed_staleness(AgentRLConfig.model_validate({"run": {"mode": "async", "max_staleness": 3}})) == 3


def test_train_step_masks_the_gated_sequence_out_of_the_loss():
    backend = FakeBackend()
    trajs = [traj([-1.0, -1.0]) for _ in range(3)] + [traj([-1.0, -1.0], template_mismatch=2.0)]
    report, _ = train_step_with_tokens(backend, trajs, AlgorithmConfig(), TrainerConfig(), policy_version=0)
    (batch,) = backend.policy_batches
    assert batch.loss_mask.sum(-1).tolist() == [2.0, 2.0, 2.0, 0.0]
    m = report.metrics
    assert m["onpolicy/gated_sequences"] == 1.0 and m["onpolicy/gated_sequences/template"] == 1.0
    assert m["batch/scored_in_update"] == 0.0  # the fake backend cannot score in its update
    assert report.gated == [GatedRow(row=3, reason="template", logprob_gap=0.0, mean_logprob_gap=0.0,
                                     log_ratio_spread=0.0, ess=1.0, template_mismatches=2.0)]
    assert not any(k.startswith("onpolicy/gated_row") for k in m)
    plain = train_step(FakeBackend(), trajs, AlgorithmConfig(), TrainerConfig(), policy_version=0)
    assert plain.keys() == m.keys() and plain["onpolicy/gated_sequences"] == 1.0  # train_step: the metrics alone


def test_ledger_text_names_the_gated_sequences_per_group():
    assert gated_groups([2, 3], [row(1, "template"), row(3, "version"), row(4, "version")]) == [
        "gated: 1 of 2 sequences masked out of the loss (template 1)",
        "gated: 2 of 3 sequences masked out of the loss (version 2)",
    ]
    assert gated_groups([2], []) == [""]


def test_too_many_gated_sequences_stop_the_run_naming_the_cause_and_the_check(tmp_path):
    config = AgentRLConfig()
    metrics = {"onpolicy/gated_share": 0.75, "onpolicy/gated_sequences": 3.0, "batch/trajectories": 4.0,
               "onpolicy/gated_sequences/template": 3.0}
    with pytest.raises(OnPolicyMismatchError) as err:
        check_gated_share(config, metrics, 5, tmp_path / "run")
    text = str(err.value)
    assert "template re-tokenisation" in text and f"agentrl check onpolicy {tmp_path / 'run' / 'config.yaml'}" in text
    assert "Step 5: 3 of 4 sequences (75%)" in text
    check_gated_share(config, {**metrics, "onpolicy/gated_share": 0.25}, 5, tmp_path)  # at the threshold: runs on
    off = AgentRLConfig.model_validate({"algorithm": {"mismatch_gate": {"enabled": False}}})
    check_gated_share(off, metrics, 5, tmp_path)


def test_kept_set_disagreement_over_its_threshold_stops_the_run(tmp_path):
    with pytest.raises(OnPolicyMismatchError, match="kept set.*Likely cause: sampling settings"):
        check_gated_share(AgentRLConfig(), {"onpolicy/kept_set_disagreement": 0.2}, 1, tmp_path)
    check_gated_share(AgentRLConfig(), {"onpolicy/kept_set_disagreement": 0.01}, 1, tmp_path)


def test_batch_ess_gates_weights_piled_on_one_sequence():
    # 0.05 nats on each of 60 tokens passes every per-sequence figure, but puts e^3 on one of three
    d = gate([traj([-1.0] * 60) for _ in range(3)], shift={0: [0.05] * 60})
    assert d.metrics["onpolicy/batch_ess"] < 0.5 and d.reasons == ["ess", "ess", "ess"]
    assert d.metrics["onpolicy/ess_min"] == pytest.approx(1.0, abs=1e-4)  # each sequence alone is even


def test_tokens_of_an_older_allowed_version_do_not_count_as_mismatch():
    """Async modes train on tokens one version old: their gap is the policy's own change (the IS
    correction weighs it), so only tokens of the trained version count toward the gap figures."""
    stale = traj([-1.0, -1.0, -1.0], version=1)
    d = gate([stale, traj([-1.0, -1.0], version=2)], shift={0: [0.5, 0.5, 0.5]}, policy_version=2,
             allowed_staleness=1)
    assert d.reasons == [None, None] and d.metrics["onpolicy/mean_logprob_gap_max"] == 0.0
    assert gate([stale], shift={0: [0.5, 0.5, 0.5]}).reasons == ["mean_logprob_gap"]  # versions unknown: all count


# ── the gate decided in the update's own forward against a separate scoring pass ────────────────
def near_policy(trajs: list[Trajectory], old: torch.Tensor, shifts: dict[int, list[float]],
                versions: dict[int, int], templates: dict[int, float]) -> list[Trajectory]:  # fmt: skip
    """`trajs` rebuilt with rollout logprobs equal to the trainer's `old` ones (B, L) plus `shifts`
    per row (one per sampled token, the rest 0), a row's version, a row's template mismatches."""
    out = []
    for i, t in enumerate(trajs):
        start = t.response_mask.index(1)
        n = t.num_sampled
        deltas = [*shifts.get(i, []), *[0.0] * n][:n]
        logprobs = [old[i, start - 1 + k].item() + d for k, d in enumerate(deltas)]
        new = Trajectory(reward=t.reward, group_id=t.group_id)
        new.extend(t.token_ids[:start], TokenOrigin.PROMPT, 0)
        new.extend(t.token_ids[start:], TokenOrigin.SAMPLED, 0, logprobs=logprobs, version=versions.get(i, 0))
        if i in templates:
            new.metrics["template_mismatch"] = templates[i]
        out.append(new)
    return out


@needs_model
@pytest.mark.parametrize("case", ["rows", "batch_ess", "none"])
def test_the_gate_decided_in_the_update_equals_a_separate_scoring_pass(case):
    """With one optimizer step the update's own forward gives the gate's old logprobs: the same
    decisions and figures (1e-6) as a separate pass, the same loss over the kept tokens (its
    normaliser corrected after the backward) and the same weights. Rows 0-3 and 12-15 learn, 4-11
    are flat groups (no backward); 32-token micro-batches put them in several."""
    gate = {"max_logprob_gap": 2.0, "min_ess": 0.999 if case == "batch_ess" else 0.5}
    algo = _AlgorithmConfig(rollout_is="tis", mismatch_gate=gate)
    fused, separate = fsdp2(algo={"rollout_is": "tis"}), fsdp2(algo={"rollout_is": "tis"})
    old = fused.compute_logprobs(with_flat_groups())  # both start from the same weights
    if case == "rows":  # four reasons, two rows that learn and two flat ones; the rest kept
        trajs = near_policy(with_flat_groups(), old, shifts={0: [0.0, 2.5], 2: [0.3] * 6, 7: [1e-3, -1e-3]},
                            versions={13: 1}, templates={5: 1.0})
    elif case == "batch_ess":  # each row even on its own, but the rows' weights differ: all gated
        trajs = near_policy(with_flat_groups(), old, shifts={i: [0.04 * (i % 3)] * 8 for i in range(16)},
                            versions={}, templates={})
    else:
        trajs = near_policy(with_flat_groups(), old, shifts={}, versions={}, templates={})
    rf, tf = train_step_with_tokens(fused, trajs, algo, TrainerConfig(), policy_version=0)
    rs, ts = train_step_with_tokens(separate, trajs, algo, TrainerConfig(score_in_update=False), policy_version=0)
    assert rf.metrics["batch/scored_in_update"] == 1.0 and rs.metrics["batch/scored_in_update"] == 0.0

    assert [(g.row, g.reason) for g in rf.gated] == [(g.row, g.reason) for g in rs.gated]
    for a, b in zip(rf.gated, rs.gated, strict=True):
        for name in ("logprob_gap", "mean_logprob_gap", "log_ratio_spread", "ess", "template_mismatches"):
            assert getattr(a, name) == pytest.approx(getattr(b, name), abs=1e-6), (a.row, name)
        assert a.out_of_window_tokens == b.out_of_window_tokens
    figures = [k for k in rs.metrics if k.startswith("onpolicy/")]
    assert figures and sorted(figures) == sorted(k for k in rf.metrics if k.startswith("onpolicy/"))
    for name in figures:
        assert rf.metrics[name] == pytest.approx(rs.metrics[name], abs=1e-6), name
    expected = {"rows": [(0, "logprob_gap"), (2, "mean_logprob_gap"), (5, "template"), (13, "version")],
                "batch_ess": [(i, "ess") for i in range(16)], "none": []}[case]  # fmt: skip
    assert [(g.row, g.reason) for g in rf.gated] == expected
    assert rf.metrics["batch/loss_tokens"] == rs.metrics["batch/loss_tokens"]
    assert tf is not None and ts is not None
    torch.testing.assert_close(tf.old_logprobs * ts.mask, ts.old_logprobs * ts.mask, atol=1e-6, rtol=0)

    if case == "batch_ess":  # nothing left to learn from: no optimizer step on either path
        assert rf.metrics["actor/skipped"] == rs.metrics["actor/skipped"] == 1.0
        assert fused.global_step == separate.global_step == 0
    else:
        # the gradient before clipping, the loss and its metrics over the kept tokens
        for name in ("actor/grad_norm", "actor/pg_loss", "actor/loss", "actor/entropy", "actor/ratio_mean",
                     "rollout/is_ratio_mean", "rollout/logprob_abs_diff"):  # fmt: skip
            assert rf.metrics[name] == pytest.approx(rs.metrics[name], rel=1e-5, abs=1e-7), name
    wf, ws = weights(fused), weights(separate)
    for name in ws:
        # Adam's first step is lr·sign(g) (lr 1e-3): a row wrongly kept or dropped moves weights by
        # ~1e-3, while the summation order moves the few entries with |g| near eps by ~1e-4 at most.
        torch.testing.assert_close(wf[name], ws[name], atol=2e-4, rtol=0)
