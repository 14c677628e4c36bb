"""The on-policy gate both ways on one backend kind, for the rank functions of the backend tests.

`gate_both_ways` trains two fresh backends of the same kind on one batch whose rollout logprobs sit
next to the trainer's own (`near_policy`) except where four sequences are made to trip the gate
(one token 2.5 nats off, every token 0.3 nats off, a template mismatch, an out-of-window version):
once with the gate decided inside the update from its own forward, once with a separate scoring
pass first. It returns what the tests compare: the gated rows with their figures, both steps'
metrics and the largest weight difference. Every rank must call it (training and exporting the
weights are collective). Not a test module: the rank functions of tests/integration/test_fsdp2.py
and test_megatron.py import it in their spawned processes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from agentrl.config import AlgorithmConfig, TrainerConfig
from agentrl.types import TokenOrigin, Trajectory

TRIPPED = {0: "logprob_gap", 5: "mean_logprob_gap", 6: "template", 9: "version"}
"""The rows `near_policy` makes trip, with the reason each must get."""


def near_policy(trajs: list[Trajectory], old: torch.Tensor) -> list[Trajectory]:
    """`trajs` with rollout logprobs equal to the trainer's `old` (B, L), but for the rows of `TRIPPED`."""
    out = []
    for i, t in enumerate(trajs):
        start = t.response_mask.index(1)
        n = t.num_sampled
        deltas = {0: [0.0, 2.5], 5: [0.3] * n}.get(i, [])
        deltas = [*deltas, *[0.0] * n][:n]
        logprobs = [old[i, start - 1 + k].item() + d for k, d in enumerate(deltas)]
        new = Trajectory(reward=t.reward, group_id=t.group_id)
        new.extend(t.token_ids[:start], TokenOrigin.PROMPT, 0)
        new.extend(t.token_ids[start:], TokenOrigin.SAMPLED, 0, logprobs=logprobs, version=1 if i == 9 else 0)
        if i == 6:
            new.metrics["template_mismatch"] = 1.0
        out.append(new)
    return out


def gate_both_ways(make_backend: Callable[[], Any], trajs: list[Trajectory]) -> dict[str, Any]:
    """Train two backends from `make_backend()` on `near_policy(trajs)` (12 rows or more), the gate
    in the update and in a separate pass; return the gated rows, metrics and weight difference."""
    from agentrl.trainer.step import train_step_with_tokens

    fused, separate = make_backend(), make_backend()
    batch = near_policy(trajs, fused.compute_logprobs(trajs))
    algo = AlgorithmConfig(rollout_is="tis")
    reports = [
        train_step_with_tokens(backend, batch, algo, TrainerConfig(score_in_update=in_update), policy_version=0)[0]
        for backend, in_update in ((fused, True), (separate, False))
    ]
    wf, ws = dict(fused.export_weights()), dict(separate.export_weights())
    return {
        "gated": [[_figures(g) for g in r.gated] for r in reports],
        "metrics": [r.metrics for r in reports],
        "weight_diff": max((wf[k] - ws[k]).abs().max().item() for k in ws),
    }


def _figures(g: Any) -> tuple[Any, ...]:
    """A `GatedRow` as (row, reason, its four figures)."""
    return (g.row, g.reason, g.logprob_gap, g.mean_logprob_gap, g.log_ratio_spread, g.ess)


def assert_same_gate(result: dict[str, Any], weight_atol: float) -> None:
    """What `gate_both_ways` returned: the same decisions and figures (1e-6), loss and gradient."""
    fused, separate = result["gated"]
    assert [(row, reason) for row, reason, *_ in fused] == sorted(TRIPPED.items())
    assert [g[:2] for g in fused] == [g[:2] for g in separate]
    for a, b in zip(fused, separate, strict=True):
        assert max(abs(x - y) for x, y in zip(a[2:], b[2:], strict=True)) <= 1e-6, (a, b)
    mf, ms = result["metrics"]
    assert mf["batch/scored_in_update"] == 1.0 and ms["batch/scored_in_update"] == 0.0
    for name in [k for k in ms if k.startswith("onpolicy/")] + ["batch/loss_tokens"]:
        assert abs(mf[name] - ms[name]) <= 1e-6, (name, mf[name], ms[name])
    for name in ("actor/grad_norm", "actor/pg_loss", "actor/entropy"):
        assert abs(mf[name] - ms[name]) <= 1e-5 * max(1.0, abs(ms[name])), (name, mf[name], ms[name])
    assert result["weight_diff"] <= weight_atol, result["weight_diff"]
