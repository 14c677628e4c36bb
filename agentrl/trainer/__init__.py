"""The trainer layer (DESIGN.md §4): RL algorithms, batch packing, backends and the training step.

`algos` holds advantage estimators, policy and value losses, KL estimators and controllers,
loss aggregation, rollout/trainer importance corrections and reward shaping; `offline_losses` the
SFT and preference (DPO, IPO, length-normalised DPO) losses, `offline_objective` their micro-batch
loss in the shared update loop and `offline_step` their steps over rendered rows; `packing` turns a
list of `Trajectory` into padding-free model inputs; `objective` assembles one micro-batch's loss;
`backend` is the interface every backend implements and the update loop they share, `fsdp2` the
FSDP2 backend and `megatron` the Megatron-core one (each imported on first use, each filling the
loop's hooks); `step.train_step` is one RL step for any backend (`train_step_with_tokens` returns
the step's `agentrl.types.StepReport`, its metrics and the on-policy gate's per-row decisions, and
the trainer's per-token logprobs and entropy, `StepTokens`); `distill` turns a teacher's per-token
logprobs in the ledger into advantages (on-policy distillation); `distributed` joins or spawns ranks.
This package imports torch, so nothing below the trainer layer may import it.

Layer L4 (DESIGN.md §2): it sees `Trajectory` batches only. It may import `agentrl.weights` and
the core modules (the kept-set rule and the sampling settings it shares with the servers among
them: `agentrl.sampling`, `agentrl.kept_set`), never inference, rollout, the gateway, envs, tools
or orchestration (import contracts in pyproject.toml check it).
"""

from typing import Any

from agentrl.trainer.algos import (
    LOSS_AGG_MODES,
    AdaptiveKLController,
    FixedKLController,
    aggregate_loss,
    apply_kl_penalty,
    dr_grpo,
    dynamic_group_filter,
    gae,
    grpo,
    gspo_policy_loss,
    kl_loss,
    kl_penalty,
    masked_mean,
    masked_sum,
    masked_whiten,
    overlong_penalty,
    ppo_policy_loss,
    reinforce_pp,
    reinforce_pp_baseline,
    rloo,
    rollout_correction,
    stop_properly_penalty,
    value_loss,
)
from agentrl.trainer.backend import CriticBatch, PolicyBatch, TrainerBackend, UpdateResult, make_backend
from agentrl.trainer.distill import distill_advantages, teacher_gaps
from agentrl.trainer.distributed import launch
from agentrl.trainer.packing import (
    PackedBatch,
    PaddedBatch,
    block_causal_mask,
    compute_entropy,
    compute_token_logprobs,
    pack_micro_batches,
    pack_trajectories,
    packed_to_padded,
    pad_trajectories,
    padded_to_packed,
    split_micro_batches,
)
from agentrl.trainer.step import StepTokens, train_step, train_step_with_tokens

__all__ = [
    "LOSS_AGG_MODES",
    "AdaptiveKLController",
    "CriticBatch",
    "FSDP2Backend",
    "FixedKLController",
    "MegatronBackend",
    "PackedBatch",
    "PaddedBatch",
    "PolicyBatch",
    "StepTokens",
    "TrainerBackend",
    "UpdateResult",
    "aggregate_loss",
    "apply_kl_penalty",
    "block_causal_mask",
    "compute_entropy",
    "compute_token_logprobs",
    "distill_advantages",
    "dr_grpo",
    "dynamic_group_filter",
    "gae",
    "grpo",
    "gspo_policy_loss",
    "kl_loss",
    "kl_penalty",
    "launch",
    "make_backend",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "overlong_penalty",
    "pack_micro_batches",
    "pack_trajectories",
    "packed_to_padded",
    "pad_trajectories",
    "padded_to_packed",
    "ppo_policy_loss",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "rloo",
    "rollout_correction",
    "split_micro_batches",
    "stop_properly_penalty",
    "teacher_gaps",
    "train_step",
    "train_step_with_tokens",
    "value_loss",
]


def __getattr__(name: str) -> Any:
    # The backends pull in torch.distributed.checkpoint and fsdp, or megatron-core (optional):
    # load them only when used.
    if name == "FSDP2Backend":
        from agentrl.trainer.fsdp2 import FSDP2Backend

        return FSDP2Backend
    if name == "MegatronBackend":
        from agentrl.trainer.megatron import MegatronBackend

        return MegatronBackend
    raise AttributeError(f"module 'agentrl.trainer' has no attribute '{name}'")
