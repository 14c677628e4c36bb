"""The interface every training backend implements (FSDP2 and Megatron-core).

A backend owns models, optimizers and process groups; it turns trajectories into per-token
numbers (`compute_logprobs`, `compute_ref_logprobs`, `compute_values`), takes one optimizer step
on a mini-batch (`update_policy`, `update_critic`), streams its full weights under Hugging Face
names (`export_weights`, for the checkpoint engine) and saves or restores its whole state.

Per-token tensors crossing this interface are `(batch, max_len)` float tensors on the CPU, one row
per trajectory in the order given, in the next-token alignment of `packing.pad_trajectories`:
column t holds the value for token t+1 of that trajectory (the token the logits at t score), and
columns past a trajectory's end are 0. Every rank of a backend is called with the same arguments
(SPMD): the backend splits the work across its ranks and every rank gets the same answer.

This module holds no algorithm: which tensors are computed and how advantages are formed is
`step.train_step`'s business; the loss of one micro-batch is `objective`'s.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from agentrl.errors import FeatureUnavailableError
from agentrl.types import Trajectory

__all__ = ["CriticBatch", "PolicyBatch", "TrainerBackend", "make_backend"]


def _select_rows(value: Any, idx: list[int]) -> Any:
    if isinstance(value, torch.Tensor):
        return value[idx]
    if isinstance(value, list):
        return [value[i] for i in idx]
    return value


@dataclass
class PolicyBatch:
    """What one policy optimizer step needs. Tensors are `(len(trajectories), max_len)` (see module).

    `loss_mask` is the mask the loss is taken over: the response mask, zero for untrainable
    trajectories and for tokens a rollout correction dropped. `is_weights` (None: all 1) are the
    rollout importance weights; `ref_logprobs` is needed only for a KL loss. `max_len` is the
    constant of `seq-mean-token-sum-norm` aggregation; `temperature` the sampling temperature the
    logprobs are scored at.

    `skip_rows` (None: none) marks trajectories whose loss and gradient are exactly zero (every
    loss token has advantage 0 and the loss has no other term): the backend runs no backward for
    them but keeps them in the loss's normaliser, and still takes the optimizer step. With
    `score_skipped` it still runs their forward, without a graph, so the update's metrics and the
    on-policy shortcut's `old_logprobs` cover them; otherwise they are left out entirely (metrics
    cover the trained rows; their `old_logprobs` rows stay 0).

    `old_logprobs` None asks for the on-policy shortcut (see `objective`; only for a backend whose
    `scores_in_update` is True, and only when this batch gets exactly one optimizer step): the
    update's own forward gives the old logprobs and the TIS weights, and the backend then sets
    `old_logprobs` to those logprobs (no gradient), as a separate scoring pass would have.
    """

    trajectories: list[Trajectory]
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: torch.Tensor | None
    rollout_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor | None = None
    is_weights: torch.Tensor | None = None
    temperature: float = 1.0
    max_len: int | None = None
    skip_rows: torch.Tensor | None = None
    score_skipped: bool = True

    def select(self, idx: Sequence[int]) -> PolicyBatch:
        """The sub-batch of trajectories `idx` (a mini-batch)."""
        idx = list(idx)
        return replace(self, **{f.name: _select_rows(getattr(self, f.name), idx) for f in fields(self)})

    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    def rows_to_train(self) -> list[int]:
        """The rows the update runs forward and backward: all but `skip_rows`."""
        if self.skip_rows is None:
            return list(range(len(self.trajectories)))
        return [i for i, skip in enumerate(self.skip_rows.tolist()) if not skip]

    def rows_to_score(self) -> list[int]:
        """The rows the update runs forward only (for metrics): `skip_rows` with `score_skipped`."""
        if self.skip_rows is None or not self.score_skipped:
            return []
        return [i for i, skip in enumerate(self.skip_rows.tolist()) if skip]


@dataclass
class CriticBatch:
    """What one critic optimizer step needs: value targets (`returns`) and the values they were
    computed from (`old_values`, for value clipping), `(len(trajectories), max_len)` each.
    `max_len` is the constant of `seq-mean-token-sum-norm` aggregation, as in `PolicyBatch`."""

    trajectories: list[Trajectory]
    loss_mask: torch.Tensor
    returns: torch.Tensor
    old_values: torch.Tensor
    max_len: int | None = None

    def select(self, idx: Sequence[int]) -> CriticBatch:
        idx = list(idx)
        return replace(self, **{f.name: _select_rows(getattr(self, f.name), idx) for f in fields(self)})


class TrainerBackend(abc.ABC):
    """A policy (and optionally a critic and a frozen reference) that can be scored and trained."""

    rank: int = 0
    world_size: int = 1
    scores_in_update: bool = False
    """Whether `update_policy` takes `old_logprobs=None` (the on-policy shortcut)."""

    @property
    @abc.abstractmethod
    def has_reference(self) -> bool:
        """Whether a frozen reference model is loaded (needed for a KL penalty)."""

    @property
    @abc.abstractmethod
    def has_critic(self) -> bool:
        """Whether a value model is loaded (needed for GAE)."""

    @property
    @abc.abstractmethod
    def global_step(self) -> int:
        """Policy optimizer steps taken so far (restored by `load`)."""

    @abc.abstractmethod
    def compute_logprobs(
        self, trajectories: Sequence[Trajectory], *, temperature: float = 1.0
    ) -> torch.Tensor:
        """Per-token logprobs under the current policy, no gradient.

        Only the tokens the loss uses (sampled tokens of trainable trajectories) must be scored; a
        backend may leave the others at 0 to save work (FSDP2 does unless `score_all_tokens`)."""

    @abc.abstractmethod
    def compute_ref_logprobs(
        self, trajectories: Sequence[Trajectory], *, temperature: float = 1.0
    ) -> torch.Tensor:
        """Per-token logprobs under the frozen reference model, no gradient."""

    @abc.abstractmethod
    def compute_values(self, trajectories: Sequence[Trajectory]) -> torch.Tensor:
        """Per-token critic values, no gradient."""

    @abc.abstractmethod
    def update_policy(self, batch: PolicyBatch, algorithm: Any) -> dict[str, float]:
        """One optimizer step of the policy on `batch` (an `AlgorithmConfig` picks the loss).

        The backend cuts the batch into token-budget micro-batches, accumulates their gradients
        with the loss normalised by the whole batch's count (over all ranks), clips the gradient
        norm and steps the optimizer and LR schedule. Returns metrics averaged over the batch.
        """

    @abc.abstractmethod
    def update_critic(self, batch: CriticBatch, algorithm: Any) -> dict[str, float]:
        """One optimizer step of the critic on `batch`."""

    @abc.abstractmethod
    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The policy's full (unsharded) tensors under their Hugging Face names, one at a time.

        Every rank must iterate it to the end (gathering is collective); every rank sees every
        tensor. A tensor may share storage with the live parameter (on one rank it does): copy
        any you keep past the next update.
        """

    @abc.abstractmethod
    def save(self, path: str | Path, data_position: dict[str, Any] | None = None) -> None:
        """Save models, optimizers, LR schedules, RNG states and `data_position` under `path`."""

    @abc.abstractmethod
    def load(self, path: str | Path) -> dict[str, Any]:
        """Restore everything `save` wrote; return the `data_position` it was given."""


def make_backend(config: Any) -> TrainerBackend:
    """The backend an `AgentRLConfig` names (`trainer.backend`), built on this rank.

    The policy comes from `model.path` in `model.dtype`, initial weights are seeded with `run.seed`,
    and the reference model and critic are loaded when the algorithm needs them.
    """
    if config.trainer.backend == "fsdp2":
        from agentrl.trainer.fsdp2 import FSDP2Backend

        return FSDP2Backend(
            config.model.path,
            config.trainer,
            config.algorithm,
            dtype=config.model.dtype,
            seed=config.run.seed,
        )
    if config.trainer.backend == "megatron":
        from agentrl.trainer.megatron import MegatronBackend

        return MegatronBackend(
            config.model.path,
            config.trainer,
            config.algorithm,
            dtype=config.model.dtype,
            seed=config.run.seed,
        )
    raise FeatureUnavailableError(
        f"trainer.backend '{config.trainer.backend}' is not built; use trainer.backend=fsdp2 or megatron."
    )
