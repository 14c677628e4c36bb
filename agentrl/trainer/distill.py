"""On-policy distillation's per-token advantage, read from the teacher's logprobs in the ledger.

With `distill`, each trained episode carries `Trajectory.teacher_logprobs`: the logprob a teacher
gave each token the student sampled, in the same context (the run's teacher filled it; the trainer
never sees the teacher). The per-token signal on a sampled token t is the negative of the one-sample
(k1) estimate of the reverse KL at that position:

    d_t = log pi_teacher(y_t | x, y_<t) - log pi_student(y_t | x, y_<t)

where pi_student's logprob is the rollout's (`Trajectory.logprobs`, the policy that sampled the
token). Maximising E[sum_t d_t] over the student's own samples is minimising KL(pi_student || pi_teacher)
on the states the student visits. `distill_advantages` turns d into the advantage of each loss token:

- `mode=advantage`: A_t = coef * d_t (the env's reward is not used);
- `mode=mixed`: A_t = coef * d_t + A_env_t, with A_env the configured estimator's advantage of the
  episode's reward (for GRPO the group-normalised reward, the same on every token of an episode).

The policy loss then treats A_t as any advantage (PPO's clipped ratio, its aggregation and
corrections unchanged). Only loss tokens carry it: prompt, template and tool tokens are context,
and a sampled token the loss leaves out (an overflowed kept set, a masked row) gets nothing. This
module holds the arithmetic only; `step.train_step` calls `apply_distillation` after the estimator.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from agentrl.config import DistillConfig
from agentrl.errors import TrainerError
from agentrl.types import Trajectory

__all__ = ["apply_distillation", "distill_advantages", "distill_metrics", "teacher_gaps"]


def teacher_gaps(trajectories: Sequence[Trajectory], shape: tuple[int, int]) -> torch.Tensor:
    """(B, L) d_t in the trainer's next-token alignment (`packing.pad_trajectories`: column t holds
    token t+1): `teacher_logprobs[t+1] - logprobs[t+1]`, 0 on every token the teacher did not score.
    Raises TrainerError for a trajectory with sampled tokens and no teacher logprobs."""
    out = torch.zeros(shape, dtype=torch.float32)
    for row, t in enumerate(trajectories):
        if not t.teacher_logprobs:
            if t.num_sampled:
                raise TrainerError(
                    f"trajectory {row} (episode '{t.episode_id}') has {t.num_sampled} sampled tokens but no teacher "
                    "logprobs, and distill is set: every trained episode must be scored by the teacher (the run "
                    "does it; an episode the teacher could not score is an infrastructure failure, never trained)."
                )
            continue
        n = len(t.token_ids)
        if len(t.teacher_logprobs) != n:
            raise TrainerError(f"trajectory {row} (episode '{t.episode_id}') has {n} tokens but "
                               f"{len(t.teacher_logprobs)} teacher logprobs; Trajectory.validate says why.")
        teacher = torch.tensor(t.teacher_logprobs[1:], dtype=torch.float32)
        student = torch.tensor(t.logprobs[1:], dtype=torch.float32)
        sampled = torch.tensor(t.response_mask[1:], dtype=torch.float32)
        out[row, : n - 1] = (teacher - student) * sampled
    return out


def distill_advantages(env_advantages: torch.Tensor, gaps: torch.Tensor, mask: torch.Tensor, *,
                       mode: str, coef: float) -> torch.Tensor:
    """A_t on the loss tokens (`mask` > 0), 0 elsewhere: coef * d_t (`advantage`), or
    coef * d_t + env_advantages_t (`mixed`). All tensors (B, L)."""
    signal = coef * gaps
    if mode == "advantage":
        out = signal
    elif mode == "mixed":
        out = signal + env_advantages
    else:
        raise TrainerError(f"distill.mode is '{mode}'; give 'advantage' or 'mixed'")
    return out * (mask > 0).to(out.dtype)


def distill_metrics(gaps: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """The batch's mean teacher-student gap over the loss tokens (`distill/teacher_gap_mean`, nats per
    token; 0 when the student matches the teacher) and the reverse KL it estimates (its negative, k1)."""
    kept = gaps[mask > 0]
    if kept.numel() == 0:
        return {}
    gap = kept.mean().item()
    return {"distill/teacher_gap_mean": gap, "distill/reverse_kl": -gap,
            "distill/teacher_gap_min": kept.min().item(), "distill/teacher_gap_max": kept.max().item()}


def apply_distillation(trajectories: Sequence[Trajectory], env_advantages: torch.Tensor, mask: torch.Tensor,
                       distill: DistillConfig, metrics: dict[str, float]) -> torch.Tensor:
    """The step's advantages under `distill` (its `mode` and `coef`), its metrics added to `metrics`."""
    gaps = teacher_gaps(trajectories, (int(mask.shape[0]), int(mask.shape[1])))
    metrics.update(distill_metrics(gaps, mask))
    metrics["distill/coef"] = distill.coef
    return distill_advantages(env_advantages, gaps, mask, mode=distill.mode, coef=distill.coef)
