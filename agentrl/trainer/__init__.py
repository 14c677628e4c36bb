"""The trainer layer (DESIGN.md §4): RL algorithms as pure tensor functions, and batch packing.

`algos` holds advantage estimators, policy and value losses, KL estimators and controllers,
loss aggregation, rollout/trainer importance corrections and reward shaping; `packing` turns a
list of `Trajectory` into padding-free model inputs. Backends (FSDP2, Megatron) build on these;
this package imports torch, so nothing below the trainer layer may import it.
"""

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

__all__ = [
    "LOSS_AGG_MODES",
    "AdaptiveKLController",
    "FixedKLController",
    "aggregate_loss",
    "apply_kl_penalty",
    "dr_grpo",
    "dynamic_group_filter",
    "gae",
    "grpo",
    "gspo_policy_loss",
    "kl_loss",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "overlong_penalty",
    "ppo_policy_loss",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "rloo",
    "rollout_correction",
    "stop_properly_penalty",
    "value_loss",
]
