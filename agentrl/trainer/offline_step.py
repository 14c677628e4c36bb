"""One supervised step and one preference step over rendered rows, for any `TrainerBackend`.

The rows arrive as `Trajectory` ledgers (`agentrl.offline_rows` renders them as the AgentLoop's
would be), so the batch layout, the loss mask (the assistant's tokens only) and the update loop are
the RL step's: `TrainerBackend.update` with `algorithm.objective` choosing the micro-batch loss
(`offline_objective`). Nothing here samples or scores rewards.

- `sft_step`: the batch's demonstrations, `trainer.ppo_epochs` x `trainer.mini_batches` optimizer
  steps of the NLL of their assistant tokens.
- `preference_step`: the batch's pairs are scored first without a graph (each completion's summed
  logprob under the current policy), the preference loss and each completion's weight dL/ds are
  formed against the reference sums given (`offline_losses.preference_weights`), and one optimizer
  step trains on the weights; its gradient is the preference loss's exactly, because the weights
  are taken at the parameters the step differentiates. That costs one forward without a graph per
  step (about a third of the step) and lets a pair's two completions land in different micro-batches
  or ranks. More optimizer steps per batch would use stale weights: `check_preference_schedule`
  refuses them.
- `score_rows` gives each row's summed logprob and token count under the current policy: the
  reference sums (taken once with the initial weights) and the held-out metrics (`heldout_sft`,
  `heldout_preferences`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from agentrl.config import AlgorithmConfig, TrainerConfig
from agentrl.errors import ConfigError
from agentrl.trainer.backend import PolicyBatch, TrainerBackend
from agentrl.trainer.offline_losses import preference_loss, preference_weights, sequence_logprobs, sft_loss
from agentrl.trainer.packing import pad_trajectories
from agentrl.types import Trajectory

__all__ = [
    "check_preference_schedule",
    "heldout_preferences",
    "heldout_sft",
    "preference_step",
    "score_rows",
    "sft_step",
]

Pairs = Sequence[tuple[Trajectory, Trajectory]]


def check_preference_schedule(trainer: TrainerConfig) -> None:
    """Refuse more than one optimizer step per preference batch (see the module docstring)."""
    if trainer.ppo_epochs != 1 or trainer.mini_batches != 1:
        raise ConfigError(
            f"trainer.ppo_epochs={trainer.ppo_epochs} and trainer.mini_batches={trainer.mini_batches}: the preference "
            "objectives take one optimizer step per batch (each completion's weight is computed at the weights "
            "of that step); set both to 1 and use data.prompts_per_step for the batch size."
        )


def _batch(trajectories: list[Trajectory], advantages: torch.Tensor | None, old: torch.Tensor | None) -> PolicyBatch:
    layout = pad_trajectories(trajectories)
    mask = layout.loss_mask
    return PolicyBatch(
        trajectories=trajectories, loss_mask=mask,
        advantages=advantages if advantages is not None else torch.zeros_like(mask),
        # Not read by the offline objectives; given so the update scores nothing twice.
        old_logprobs=old if old is not None else torch.zeros_like(mask),
        rollout_logprobs=layout.rollout_logprobs, max_len=max(1, int(mask.sum(-1).max().item())),
    )  # fmt: skip


def sft_step(
    backend: TrainerBackend, demonstrations: Sequence[Trajectory], algorithm: AlgorithmConfig, trainer: TrainerConfig
) -> dict[str, float]:
    """Train on `demonstrations` (objective `sft`); the update's metrics, `actor/nll` the batch's NLL."""
    trajectories = list(demonstrations)
    batch = _batch(trajectories, None, None)
    result = backend.update(batch, algorithm, trainer)
    return {**result.metrics, "batch/rows": float(len(trajectories)),
            "batch/loss_tokens": float(batch.loss_mask.sum().item()),
            "batch/tokens": float(sum(len(t.token_ids) for t in trajectories))}


def score_rows(backend: TrainerBackend, trajectories: Sequence[Trajectory]) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed logprob, token count) of each trajectory's loss tokens under the current policy, `(n,)` float64."""
    trajectories = list(trajectories)
    if not trajectories:
        return torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.float64)
    logprobs = backend.compute_logprobs(trajectories).double()
    return sequence_logprobs(logprobs, pad_trajectories(trajectories).loss_mask.double())


def preference_step(
    backend: TrainerBackend, pairs: Pairs, reference: torch.Tensor, algorithm: AlgorithmConfig, trainer: TrainerConfig
) -> dict[str, float]:
    """One optimizer step of `algorithm.objective` on `pairs` (see the module docstring).

    `reference` is `(len(pairs), 2)`: the reference's summed logprob of each pair's chosen and
    rejected completion. Metrics: `prefs/loss` (the preference loss before the step), `prefs/margin`,
    `prefs/accuracy`, `prefs/chosen_reward`, `prefs/rejected_reward`, `prefs/logp_margin`, and the update's."""
    check_preference_schedule(trainer)
    n = len(pairs)
    trajectories = [c for c, _ in pairs] + [r for _, r in pairs]
    layout = pad_trajectories(trajectories)
    mask = layout.loss_mask
    logprobs = backend.compute_logprobs(trajectories)
    sums, counts = sequence_logprobs(logprobs.double(), mask.double())
    ref = reference.double()
    grad_c, grad_r, loss, metrics = preference_weights(
        sums[:n], sums[n:], ref[:, 0], ref[:, 1], counts[:n], counts[n:], kind=algorithm.objective, beta=algorithm.beta
    )
    weights = torch.cat([grad_c, grad_r]).float()
    result = backend.update(_batch(trajectories, -weights[:, None] * mask, logprobs), algorithm, trainer)
    out = {**result.metrics, "prefs/loss": float(loss)}
    out.update({f"prefs/{k}": float(v) for k, v in metrics.items()})
    out.update({"batch/pairs": float(n), "batch/loss_tokens": float(mask.sum().item()),
                "batch/tokens": float(sum(len(t.token_ids) for t in trajectories))})
    return out


def heldout_sft(backend: TrainerBackend, demonstrations: Sequence[Trajectory]) -> dict[str, float]:
    """The held-out NLL (token mean over every assistant token) of `demonstrations` under the current policy."""
    trajectories = list(demonstrations)
    if not trajectories:
        return {}
    logprobs = backend.compute_logprobs(trajectories).double()
    mask = pad_trajectories(trajectories).loss_mask.double()
    loss, _ = sft_loss(logprobs, mask)
    return {"nll": float(loss), "rows": float(len(trajectories)), "tokens": float(mask.sum().item())}


def heldout_preferences(backend: TrainerBackend, pairs: Pairs, reference: torch.Tensor,
                        algorithm: AlgorithmConfig) -> dict[str, float]:
    """The preference loss and margins of held-out `pairs` under the current policy (`reference` as in
    `preference_step`)."""
    if not pairs:
        return {}
    n = len(pairs)
    sums, counts = score_rows(backend, [c for c, _ in pairs] + [r for _, r in pairs])
    ref = reference.double()
    loss, metrics = preference_loss(sums[:n], sums[n:], ref[:, 0], ref[:, 1], counts[:n], counts[n:],
                                    kind=algorithm.objective, beta=algorithm.beta)
    return {"loss": float(loss), **{k: float(v) for k, v in metrics.items()}, "pairs": float(n)}
