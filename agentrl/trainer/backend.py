"""The interface every training backend implements (FSDP2 and Megatron-core), and the update loop.

A backend owns models, optimizers and process groups; it turns trajectories into per-token
numbers (`compute_logprobs`, `compute_ref_logprobs`, `compute_values`), trains on a batch
(`update`: `ppo_epochs` x `mini_batches` optimizer steps of the policy and, for GAE, the critic),
streams its full weights under Hugging Face names (`export_weights`, for the checkpoint engine)
and saves or restores its whole state.

The update loop lives here, once: mini-batches and epochs; each step's token-budget micro-batches
with gradients accumulated against the whole mini-batch's normaliser; rows whose loss is exactly
zero (`trainer.zero_advantage_rows`); the on-policy shortcut (the old logprobs scored by the
update's own forward and returned); metrics combined over micro-batches, ranks and steps;
gradient clipping and the optimizer and LR-schedule steps. A backend fills the hooks: which of the
rows this rank runs and in what micro-batches (`_micro_batches`), how a micro-batch is forwarded
and scored (`_token_scores`, `_values`), how the loss is back-propagated (`_backward`), how
gradients are reduced and their norm taken (`_grad_norm`), and how results are combined over ranks
(`_all_reduce`). The update returns its results (`UpdateResult`); it never writes into its input.

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
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from agentrl.config import AgentRLConfig, AlgorithmConfig, TrainerConfig
from agentrl.errors import TrainerError, UnknownNameError
from agentrl.registry import closest_names, import_object
from agentrl.sampling import KeptSetRule
from agentrl.trainer.mismatch_gate import GateDecision, SequenceGate
from agentrl.trainer.objective import (
    MetricSums,
    ScoredRows,
    critic_objective,
    loss_denominator,
    policy_objective,
    zero_loss_rows,
)
from agentrl.trainer.packing import PackedBatch
from agentrl.types import Trajectory

__all__ = [
    "BACKENDS",
    "BackendFactory",
    "CriticBatch",
    "PolicyBatch",
    "TrainerBackend",
    "UpdateResult",
    "make_backend",
    "mini_batch_indices",
]

_STATE_FILE = "trainer_state.pt"
_Batch = TypeVar("_Batch", "PolicyBatch", "CriticBatch")
# (micro-batch, real): `real` False marks an empty micro-batch a rank runs to keep in step.
MicroBatches = list[tuple[PackedBatch, bool]]


def mini_batch_indices(n: int, parts: int) -> list[list[int]]:
    """Split range(n) into `parts` contiguous, near-equal chunks (empty chunks dropped), so that
    the samples of one prompt (adjacent in a batch) mostly land in the same mini-batch."""
    bounds = [round(k * n / parts) for k in range(parts + 1)]
    return [list(range(a, b)) for a, b in itertools.pairwise(bounds) if b > a]


def _select(batch: _Batch, idx: Sequence[int]) -> _Batch:
    """The sub-batch of trajectories `idx` (a mini-batch): every tensor and list cut to them."""
    rows = list(idx)
    cut: dict[str, Any] = {}
    for f in fields(batch):
        value = getattr(batch, f.name)
        if isinstance(value, torch.Tensor):
            value = value[rows]
        elif isinstance(value, list):
            value = [value[i] for i in rows]
        cut[f.name] = value
    return replace(batch, **cut)


@dataclass
class PolicyBatch:
    """What one policy optimizer step needs. Tensors are `(len(trajectories), max_len)` (see module).

    `loss_mask` is the mask the loss is taken over: the response mask, zero for untrainable
    trajectories and for tokens a rollout correction dropped. `is_weights` (None: all 1) are the
    rollout importance weights; `ref_logprobs` is needed only for a KL loss. `max_len` is the
    constant of `seq-mean-token-sum-norm` aggregation; `temperature` the sampling temperature the
    logprobs are scored at. `old_logprobs` None asks for the on-policy shortcut (see `objective`):
    the update's own forward gives the old logprobs and the TIS weights, and returns them.

    `skip_rows` (None: none), set by `TrainerBackend.update` from `trainer.zero_advantage_rows`,
    marks trajectories whose loss and gradient are exactly zero: the step runs no backward for
    them but keeps them in the loss's normaliser, and still steps the optimizer. With
    `score_skipped` it still runs their forward, without a graph, so the step's metrics and the
    shortcut's old logprobs cover them; otherwise they are left out entirely.
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
    keep_entropy: bool = False
    """Return the per-token entropy the update's forward computed (`UpdateResult.entropy`)."""
    kept_rule: KeptSetRule | None = None
    """The rollout's truncation settings, for the update's forward to measure the kept-set
    disagreement (`TrainerBackend.take_kept_set_disagreement`); None: not measured there."""
    gate: SequenceGate | None = None
    """The on-policy gate to decide from the update's own forward (with `old_logprobs` None, one
    optimizer step): each row it gates is masked out of the loss before its micro-batch's backward,
    and the loss is normalised by the tokens kept (`UpdateResult.gate` is its decision)."""

    def select(self, idx: Sequence[int]) -> PolicyBatch:
        return _select(self, idx)

    def objective_inputs(self, loss_mask: torch.Tensor) -> dict[str, torch.Tensor | None]:
        """The `(batch, max_len)` tensors `objective.policy_objective` reads, for the update loop to
        gather per micro-batch; `loss_mask` is the batch's mask with untrainable rows zeroed.
        On-policy (`old_logprobs` None) the rollout logprobs come along for the TIS weights."""
        tensors = {
            "loss_mask": loss_mask,
            "advantages": self.advantages,
            "old_logprobs": self.old_logprobs,
            "ref_logprobs": self.ref_logprobs,
            "is_weights": self.is_weights,
        }
        if self.old_logprobs is None:
            tensors["rollout_logprobs"] = self.rollout_logprobs
        return tensors

    def rows_to_train(self) -> list[int]:
        """The rows the step runs forward and backward: all but `skip_rows`."""
        if self.skip_rows is None:
            return list(range(len(self.trajectories)))
        return [i for i, skip in enumerate(self.skip_rows.tolist()) if not skip]

    def rows_to_score(self) -> list[int]:
        """The rows the step runs forward only (for metrics): `skip_rows` with `score_skipped`."""
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
        return _select(self, idx)


@dataclass
class UpdateResult:
    """What an update returns: its metrics and, for the on-policy shortcut, what it scored.

    `old_logprobs` (batch, max_len) are the logprobs the update's forward gave (no gradient), None
    unless the batch came with `old_logprobs=None` and a step ran. `scored_rows` (batch,) bool
    names the rows they (and `entropy`) cover (None: all); rows left out under
    `zero_advantage_rows=skip` read 0.
    `entropy` (batch, max_len), asked for with `PolicyBatch.keep_entropy`, is the policy's entropy
    at each token its forward scored; None unless the update was one optimizer step (after more,
    the later steps' forwards saw a policy the earlier steps had already changed).
    `gate` is the on-policy gate's decision when the batch asked for it (`PolicyBatch.gate`).
    """

    metrics: dict[str, float] = field(default_factory=dict)
    old_logprobs: torch.Tensor | None = None
    scored_rows: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    gate: GateDecision | None = None


class TrainerBackend(abc.ABC):
    """A policy (and optionally a critic and a frozen reference) that can be scored and trained.

    Subclasses build `policy`, `optimizer` and `scheduler` (`_optimizer` makes the pair), and
    `reference`, `critic`, `critic_optimizer`, `critic_scheduler` when asked for; they set `config`
    (the `TrainerConfig`: micro-batch budget, gradient clipping, learning rates), `device`, `rank`
    and `world_size`, and fill the hooks below.
    """

    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    config: TrainerConfig
    scores_in_update: bool = False
    """Whether the update loop may take `old_logprobs=None` (the on-policy shortcut)."""
    policy: nn.Module
    optimizer: Optimizer
    scheduler: LRScheduler
    reference: nn.Module | None = None
    critic: nn.Module | None = None
    critic_optimizer: Optimizer | None = None
    critic_scheduler: LRScheduler | None = None
    _step: int = 0
    _disagreement: torch.Tensor | None = None  # (outside, counted) tokens since the last take

    @property
    def has_reference(self) -> bool:
        """Whether a frozen reference model is loaded (needed for a KL penalty)."""
        return self.reference is not None

    @property
    def has_critic(self) -> bool:
        """Whether a value model is loaded (needed for GAE)."""
        return self.critic is not None

    @property
    def global_step(self) -> int:
        """Policy optimizer steps taken so far (restored by `load`)."""
        return self._step

    # ── scoring ─────────────────────────────────────────────────────────────────────────────
    def compute_logprobs(
        self, trajectories: Sequence[Trajectory], *, temperature: float = 1.0, kept_rule: KeptSetRule | None = None
    ) -> torch.Tensor:
        """Per-token logprobs under the current policy, no gradient; each sampled token over its
        kept set when its trajectory records one (`Trajectory.kept_sets`), renormalised.

        Only the tokens the loss uses (sampled tokens of trainable trajectories) must be scored; a
        backend may leave the others at 0 to save work (FSDP2 does unless `score_all_tokens`).
        With `kept_rule` (the rollout's truncation settings) it also counts the tokens that lie
        outside the kept set the policy's own logits give (`take_kept_set_disagreement`)."""
        return self._score(self.policy, trajectories, self._logprobs_at(temperature, kept_rule))

    def compute_ref_logprobs(self, trajectories: Sequence[Trajectory], *, temperature: float = 1.0) -> torch.Tensor:
        """Per-token logprobs under the frozen reference model, no gradient."""
        if self.reference is None:
            raise TrainerError("this backend has no reference model; build it with with_reference=True.")
        return self._score(self.reference, trajectories, self._logprobs_at(temperature, None))

    def compute_values(self, trajectories: Sequence[Trajectory]) -> torch.Tensor:
        """Per-token critic values, no gradient."""
        return self._score(self._critic(), trajectories, self._values)

    def _logprobs_at(
        self, temperature: float, kept_rule: KeptSetRule | None
    ) -> Callable[[nn.Module, PackedBatch], torch.Tensor]:
        return lambda model, packed: self._token_scores(
            model, packed, temperature, with_entropy=False, kept_rule=kept_rule
        )[0]

    # ── kept-set disagreement ───────────────────────────────────────────────────────────────
    def _count_disagreement(self, outside: torch.Tensor, counted: torch.Tensor) -> None:
        """Add a micro-batch's tokens outside the trainer's own kept set (`outside`, 1.0/0.0) among
        those `counted` (a mask of the same shape: the sampled tokens scored)."""
        counted = counted.detach().float()
        pair = torch.stack([(outside.detach().float() * counted).sum(), counted.sum()]).double().cpu()
        self._disagreement = pair if self._disagreement is None else self._disagreement + pair

    def take_kept_set_disagreement(self) -> float | None:
        """The share of sampled tokens, counted since the last call over all ranks, that lie outside
        the kept set the trainer's own logits give under the rollout's rule (0: the trainer would
        have kept every token the engine sampled); None when nothing was measured. Every rank must
        call it alike (it all-reduces)."""
        pair = self._disagreement if self._disagreement is not None else torch.zeros(2, dtype=torch.float64)
        self._disagreement = None
        pair = pair.to(self.device)
        self._all_reduce(pair, "sum")
        outside, counted = pair.tolist()
        return outside / counted if counted > 0 else None

    @torch.no_grad()
    def _score(
        self, model: nn.Module, trajectories: Sequence[Trajectory], forward: Callable[..., torch.Tensor]
    ) -> torch.Tensor:
        """`forward(model, micro_batch) -> (1, N)` over this rank's share, scattered into (B, L)
        rows and summed over ranks (each row is written by exactly one rank)."""
        out = ScoredRows(trajectories)
        was_training = model.training
        model.eval()
        for packed, real in self._micro_batches(trajectories):
            values = forward(model, packed)
            if real:
                out.add(packed, values)
        model.train(was_training)
        return out.result(self._all_reduce)

    # ── updates ─────────────────────────────────────────────────────────────────────────────
    def scores_old_logprobs(self, trainer: TrainerConfig) -> bool:
        """Whether `update` can score the old logprobs itself under `trainer`'s schedule (the
        on-policy shortcut): the backend can, `trainer.score_in_update` allows it, and the batch
        gets exactly one optimizer step."""
        one_step = trainer.ppo_epochs == 1 and trainer.mini_batches == 1
        return bool(self.scores_in_update and trainer.score_in_update and one_step)

    def update(
        self,
        batch: PolicyBatch,
        algorithm: AlgorithmConfig,
        trainer: TrainerConfig,
        critic_batch: CriticBatch | None = None,
    ) -> UpdateResult:
        """Train on one batch: `trainer.ppo_epochs` passes of `trainer.mini_batches` optimizer
        steps on contiguous mini-batches, of the policy and (given `critic_batch`) the critic.

        `algorithm` (an `AlgorithmConfig`) picks the loss. Rows whose loss and gradient are exactly
        zero (`objective.zero_loss_rows`) get what `trainer.zero_advantage_rows` says (counted in
        `batch/zero_adv_skipped`). The steps' metrics are averaged (`*_max` and `*_min` take the
        extreme), prefixed `actor/` and `critic/`; `actor/updates` counts the steps.
        `batch.old_logprobs` None (the on-policy shortcut) needs `scores_old_logprobs(trainer)`.
        """
        if batch.old_logprobs is None and not self.scores_old_logprobs(trainer):
            raise TrainerError(
                "old_logprobs=None (scoring them in the update) needs one optimizer step on a backend "
                "that scores in its update (ppo_epochs=1, mini_batches=1, score_in_update=True); "
                "pass the old logprobs from compute_logprobs."
            )
        if batch.gate is not None and batch.old_logprobs is not None:
            raise TrainerError(
                "PolicyBatch.gate decides the on-policy gate from the update's own forward, which needs "
                "old_logprobs=None (one optimizer step); with old logprobs given, gate the batch before "
                "the update (mismatch_gate.gate_sequences, as train_step does)."
            )
        metrics: dict[str, float] = {}
        skip = zero_loss_rows(batch.advantages, batch.loss_mask, algorithm)
        if skip is not None and trainer.zero_advantage_rows != "train":
            # A gate judges every row, so rows without a loss are still scored (without a graph).
            score = trainer.zero_advantage_rows == "score" or batch.gate is not None
            batch = replace(batch, skip_rows=skip, score_skipped=score)
            metrics["batch/zero_adv_skipped"] = float(skip.sum().item())
        steps: list[dict[str, float]] = []
        result = UpdateResult()
        parts = mini_batch_indices(len(batch.trajectories), trainer.mini_batches)
        for _ in range(trainer.ppo_epochs):
            for idx in parts:
                whole = len(idx) == len(batch.trajectories)
                result = self.update_policy(batch if whole else batch.select(idx), algorithm)
                step = {f"actor/{k}": v for k, v in result.metrics.items()}
                if critic_batch is not None:
                    step.update(self.update_critic(critic_batch if whole else critic_batch.select(idx), algorithm))
                steps.append(step)
        for name in sorted({k for s in steps for k in s}):
            seen = [s[name] for s in steps if name in s]
            pick = max if name.endswith("_max") else min if name.endswith("_min") else None
            metrics[name] = pick(seen) if pick else sum(seen) / len(seen)
        metrics["actor/updates"] = float(len(steps))
        return replace(result, metrics=metrics, entropy=result.entropy if len(steps) == 1 else None)

    def update_policy(self, batch: PolicyBatch, algorithm: AlgorithmConfig) -> UpdateResult:
        """One optimizer step of the policy on `batch` (an `AlgorithmConfig` picks the loss).

        This rank's share of the rows is cut into token-budget micro-batches whose gradients
        accumulate, with the loss normalised by the whole batch's count (over all ranks); the
        gradient norm is clipped and the optimizer and LR schedule step. Metrics are combined over
        the batch. With `batch.old_logprobs` None the result carries the logprobs it scored.

        With `batch.gate` each micro-batch's rows are judged by the gate right after their forward
        and the rows it gates leave the loss before the backward. The loss is normalised by the
        tokens before the gate and the accumulated gradient rescaled by (that count / the count
        kept) before clipping: the loss is linear in 1 / its normaliser, so this is the gradient
        of the loss over the kept tokens, without a second forward. When the batch's ESS gates
        every row still kept, the gradient is dropped and no optimizer step is taken, as for a
        batch with no loss token.
        """
        # Infrastructure failures never reach the loss, whatever mask the caller built.
        loss_mask = batch.loss_mask * _trainable_rows(batch.trajectories)
        denominator = loss_denominator(loss_mask, algorithm.loss_agg)
        gate = batch.gate
        if denominator == 0:
            # Nothing to learn from (all masked): no optimizer step, on every rank alike.
            if gate is not None:  # nothing to score: the rows are judged on their ledgers alone
                return UpdateResult({"skipped": 1.0}, gate=_ungated(gate))
            return UpdateResult({"skipped": 1.0})
        self.policy.train()
        scored = ScoredRows(batch.trajectories) if batch.old_logprobs is None else None
        entropies = ScoredRows(batch.trajectories) if batch.keep_entropy else None
        no_entropy: list[bool] = []  # a backend whose forward gives none: report None, never zeros
        # Rows with a zero loss are scored without a graph before the backward passes: a no-grad
        # forward of a sharded FSDP2 model after them left wrong gradients on two ranks.
        plan: list[tuple[PackedBatch, bool, bool]] = []
        if batch.rows_to_score():
            plan += [(p, real, False) for p, real in self._micro_batches(batch.trajectories, batch.rows_to_score())]
        trained = self._micro_batches(batch.trajectories, batch.rows_to_train(), at_least_one=True)
        plan += [(p, real, True) for p, real in trained]

        def forward(
            packed: PackedBatch, real: bool, tokens: dict[str, torch.Tensor]
        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            logprobs, entropy = self._token_scores(
                self.policy, packed, batch.temperature, with_entropy=True, entropy_grad=bool(algorithm.entropy_coef),
                kept_rule=batch.kept_rule,
            )
            if scored is not None and real:
                scored.add(packed, logprobs)
                if gate is not None:  # judged before the backward: a gated row leaves the loss now
                    gate.judge(packed.indices, scored.rows)
                    keep = packed.gather(gate.keep[:, None].expand_as(loss_mask)).to(self.device)
                    tokens["loss_mask"] = tokens["loss_mask"] * keep
            if entropies is not None and entropy is None:
                no_entropy.append(True)
            elif entropies is not None and real and entropy is not None:
                entropies.add(packed, entropy.detach())
            if not algorithm.entropy_coef and entropy is not None:
                entropy = entropy.detach()  # reported only
            return policy_objective(
                logprobs, tokens, algorithm, denominator=denominator, entropy=entropy, max_len=batch.max_len
            )

        sums = self._accumulate(plan, batch.objective_inputs(loss_mask), forward)
        decision, loss_scale = None, 1.0
        if gate is not None and scored is not None:
            decision = gate.decide(self._all_reduce)
            kept = loss_denominator(loss_mask * decision.keep[:, None], algorithm.loss_agg)
            if kept == 0:  # the batch's ESS (or every row's own figures) gated everything
                self.optimizer.zero_grad(set_to_none=True)
                return UpdateResult({"skipped": 1.0}, scored.result(self._all_reduce), gate=decision)
            loss_scale = denominator / kept
            _scale_gradients(self.policy, loss_scale)
        metrics = self._optimizer_step(self.policy, self.optimizer, self.scheduler)
        self._step += 1
        metrics.update(sums.reduce(self._all_reduce, loss_scale=loss_scale))
        entropy = entropies.result(self._all_reduce) if entropies is not None else None
        if no_entropy:
            entropy = None
        skipped = batch.skip_rows
        scored_rows = ~skipped if skipped is not None and not batch.score_skipped else None
        if scored is None:
            return UpdateResult(metrics, entropy=entropy, scored_rows=scored_rows if entropy is not None else None)
        return UpdateResult(metrics, scored.result(self._all_reduce), scored_rows, entropy, decision)

    def update_critic(self, batch: CriticBatch, algorithm: AlgorithmConfig) -> dict[str, float]:
        """One optimizer step of the critic on `batch`; metrics prefixed `critic/`."""
        critic, critic_optimizer, critic_scheduler = self._critic_parts()
        loss_mask = batch.loss_mask * _trainable_rows(batch.trajectories)
        denominator = loss_denominator(loss_mask, algorithm.loss_agg)
        if denominator == 0:
            return {"critic/skipped": 1.0}
        critic.train()
        tensors = {"loss_mask": loss_mask, "returns": batch.returns, "old_values": batch.old_values}

        def forward(
            packed: PackedBatch, real: bool, tokens: dict[str, torch.Tensor]
        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            values = self._values(critic, packed)
            return critic_objective(values, tokens, algorithm, denominator=denominator, max_len=batch.max_len)

        plan = [(p, real, True) for p, real in self._micro_batches(batch.trajectories)]
        sums = self._accumulate(plan, tensors, forward)
        out = self._optimizer_step(critic, critic_optimizer, critic_scheduler)
        out.update(sums.reduce(self._all_reduce))
        return {f"critic/{k}": v for k, v in out.items()}

    def _critic(self) -> nn.Module:
        if self.critic is None:
            raise TrainerError(
                "this backend has no critic (GAE needs one); build the FSDP2 backend with with_critic=True."
            )
        return self.critic

    def _critic_parts(self) -> tuple[nn.Module, Optimizer, LRScheduler]:
        """The critic with its optimizer and LR schedule."""
        critic = self._critic()
        if self.critic_optimizer is None or self.critic_scheduler is None:
            raise TrainerError(f"{type(self).__name__} built a critic without its optimizer; build both.")
        return critic, self.critic_optimizer, self.critic_scheduler

    def _accumulate(
        self,
        plan: Sequence[tuple[PackedBatch, bool, bool]],
        tensors: Mapping[str, torch.Tensor | None],
        forward: Callable[[PackedBatch, bool, dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, torch.Tensor]]],
    ) -> MetricSums:
        """Run `forward(micro_batch, real, tokens) -> (loss, metrics)` over `plan`'s (micro-batch,
        real, backward) entries, back-propagating where `backward` (gradients accumulate), with
        `tokens` the rows of `tensors` laid out like the micro-batch; combine the metrics, each
        weighted by the micro-batch's loss tokens. `forward` may narrow `tokens["loss_mask"]` (the
        on-policy gate drops rows it judges from the forward's own logprobs): the weight is the
        mask it leaves."""
        sums = MetricSums()
        for packed, real, backward in plan:
            tokens: dict[str, torch.Tensor] = {"segment_ids": packed.segment_ids.to(self.device)}
            for name, value in tensors.items():
                if value is not None:
                    tokens[name] = (
                        packed.gather(value).to(self.device, torch.float32)
                        if real
                        else torch.zeros((1, packed.num_tokens), device=self.device)
                    )
            with torch.set_grad_enabled(backward):
                loss, metrics = forward(packed, real, tokens)
            if backward:
                self._backward(loss)
            sums.add(metrics, float(tokens["loss_mask"].sum()))
        return sums

    def _optimizer_step(self, model: nn.Module, optimizer: Optimizer, scheduler: LRScheduler) -> dict[str, float]:
        """Clip the accumulated gradient by its global norm, step (skipped when the norm is not
        finite) and advance the LR schedule either way."""
        norm = self._grad_norm(model)
        grad_norm = float(norm)
        lr = float(scheduler.get_last_lr()[0])
        if math.isfinite(grad_norm):
            params = [p for p in model.parameters() if p.grad is not None]
            torch.nn.utils.clip_grads_with_norm_(params, self.config.grad_clip, norm)
            optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": grad_norm, "lr": lr, "grad_nonfinite": float(not math.isfinite(grad_norm))}

    def _optimizer(self, params: Iterable[torch.Tensor], lr: float) -> tuple[Optimizer, LRScheduler]:
        """AdamW (`trainer.weight_decay`) and its linear warm-up (`trainer.warmup_steps`)."""
        # The fused AdamW kernel (CPU and CUDA) updates each tensor in one pass: on SmolLM2's CPU
        # step 5x faster than the foreach one, without its whole-model temporaries.
        optimizer = torch.optim.AdamW(
            params, lr=lr, weight_decay=self.config.weight_decay, fused=self.device.type in ("cpu", "cuda")
        )
        warmup = self.config.warmup_steps
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup > 0 else 1.0
        )
        return optimizer, schedule

    # ── hooks a backend fills ───────────────────────────────────────────────────────────────
    def _micro_batches(
        self, trajectories: Sequence[Trajectory], rows: Sequence[int] | None = None, *, at_least_one: bool = False
    ) -> MicroBatches:
        """This rank's micro-batches of `trajectories` (only `rows` of them when given), each with
        `indices` into `trajectories`, and whether it is real. Add empty micro-batches
        (`packing.zero_loss_micro_batch`, real False) where the ranks must run alike, and one when
        `at_least_one` and the rank has none (an update whose every row is skipped still runs a
        backward, so each parameter gets its zero gradient and every collective runs)."""
        raise NotImplementedError(f"{type(self).__name__} does not run the shared update loop.")

    def _token_scores(
        self, model: nn.Module, batch: PackedBatch, temperature: float, *, with_entropy: bool,
        entropy_grad: bool = True, kept_rule: KeptSetRule | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """(logprobs, entropy or None), each (1, N) in the packed layout, of `model` on a
        micro-batch at `temperature`; with `entropy_grad=False` the entropy may come without a
        graph (it is only reported). Tokens with a kept set (`batch.kept_ids`) are scored over it,
        renormalised (entropy too); with `kept_rule` the backend counts the sampled tokens outside
        its own kept set (`_count_disagreement`)."""
        raise NotImplementedError(f"{type(self).__name__} does not run the shared update loop.")

    def _values(self, model: nn.Module, batch: PackedBatch) -> torch.Tensor:
        """(1, N) critic values of a micro-batch."""
        raise NotImplementedError(f"{type(self).__name__} has no critic.")

    def _backward(self, loss: torch.Tensor) -> None:
        """Back-propagate one micro-batch's share of the loss (already normalised globally)."""
        torch.autograd.backward(loss)

    def _grad_norm(self, model: nn.Module) -> torch.Tensor:
        """Sum the accumulated gradients over data-parallel ranks (unless the framework did) and
        return the L2 norm of the whole model's gradient."""
        raise NotImplementedError(f"{type(self).__name__} does not run the shared update loop.")

    def _all_reduce(self, tensor: torch.Tensor, op: str) -> None:
        """Combine `tensor` in place (`op` "sum" or "max") over the ranks that split the rows."""
        return None  # one process: nothing to combine

    # ── weights and checkpoints ─────────────────────────────────────────────────────────────
    def _write_state(self, path: Path, data_position: dict[str, Any] | None, **extra: Any) -> None:
        """Rank 0 writes the step count, LR schedule and data position beside the models."""
        if self.rank == 0:
            state = {"global_step": self._step, "world_size": self.world_size, "scheduler": self.scheduler.state_dict()}
            torch.save({**state, "data_position": dict(data_position or {}), **extra}, path / _STATE_FILE)

    def _read_state(self, path: Path) -> dict[str, Any]:
        """What `_write_state` wrote under `path`."""
        if not (path / _STATE_FILE).is_file():
            raise TrainerError(f"no trainer checkpoint at '{path}' (missing {_STATE_FILE}); pass a folder `save` wrote.")
        return dict(torch.load(path / _STATE_FILE, weights_only=True))

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


def _trainable_rows(trajectories: Sequence[Trajectory]) -> torch.Tensor:
    return torch.tensor([[1.0 if t.trainable else 0.0] for t in trajectories])


def _scale_gradients(model: nn.Module, scale: float) -> None:
    """Multiply the accumulated gradient by `scale` (the loss's normaliser corrected after the fact)."""
    if scale != 1.0:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)


def _ungated(gate: SequenceGate) -> GateDecision:
    """The gate's decision on a batch without a loss token: no row has a logprob to compare, so
    every rank judges every row on its ledger alone (templates, versions)."""
    gate.judge(range(len(gate.trajectories)), torch.zeros_like(gate.mask))
    return gate.decide()


class BackendFactory(Protocol):
    """How every backend class is built: what `make_backend` passes it."""

    def __call__(
        self,
        model_path: str | Path,
        trainer: TrainerConfig,
        algorithm: AlgorithmConfig | None = None,
        *,
        dtype: str = "auto",
        seed: int = 0,
        trust_remote_code: bool = False,
    ) -> TrainerBackend: ...


BACKENDS: dict[str, str] = {
    "fsdp2": "agentrl.trainer.fsdp2:FSDP2Backend",
    "megatron": "agentrl.trainer.megatron:MegatronBackend",
}
"""`trainer.backend` -> the backend class, as `"module:Class"` imported when first built: each
backend module imports this one, and megatron-core is an optional extra."""


def make_backend(config: AgentRLConfig, model_path: str | None = None) -> TrainerBackend:
    """The backend an `AgentRLConfig` names (`trainer.backend`, a key of `BACKENDS`), built on this rank.

    The policy comes from `model_path` (the resolved model directory; `model.path` when not given)
    in `model.dtype` (running the repository's model code only
    with `model.trust_remote_code`), initial weights are seeded with `run.seed`, and the reference
    model and critic are loaded when the algorithm needs them.
    """
    name = config.trainer.backend
    if name not in BACKENDS:
        close = closest_names(name, list(BACKENDS))
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise UnknownNameError(
            f"Unknown trainer.backend '{name}'.{hint} Known backends: {', '.join(sorted(BACKENDS))}.",
            suggestions=close,
        )
    backend_cls: BackendFactory = import_object(BACKENDS[name])
    return backend_cls(
        model_path or config.model.path, config.trainer, config.algorithm, dtype=config.model.dtype, seed=config.run.seed,
        trust_remote_code=config.model.trust_remote_code,
    )
