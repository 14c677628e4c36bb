"""One RL training step over a batch of trajectories, for any `TrainerBackend`.

`train_step` is the algorithm-level recipe of DESIGN.md §3, in named stages: keep the trainable
trajectories (infrastructure failures are masked out, never scored 0); shape the rewards (DAPO
overlong penalty, stop-properly penalty for episodes truncated at the length limit); score the
batch with the current policy (old logprobs, unless the update scores them itself), the reference
(when `kl_coef > 0`) and the critic (GAE); put the KL penalty in the reward if asked; form
advantages with the configured estimator (`ADVANTAGE_ESTIMATORS`), with `distill` the teacher's
per-token signal in them (`distill.apply_distillation`); weigh the rollout/trainer
mismatch and mask the sequences the on-policy gate finds too far off (`mismatch_gate`: here when
the old logprobs were scored first, else inside the update, from its own forward); then hand the
batch to the backend's update loop (`TrainerBackend.update`). It returns the metrics an RL practitioner watches, named `group/metric`
(numbers only; the gate's per-row decisions travel typed, see below). The KL coefficient comes from a
controller (`make_kl_controller`) that the caller keeps across steps: fixed, or adaptive when
`algorithm.kl_target` is set, updated after each step with the batch's KL to the reference.

An episode an external agent played through the gateway may arrive as several trajectory segments
(`Trajectory.segment`, same `group_id` and `episode_id`, same reward). The group-relative estimators
(grpo, dr_grpo, rloo, reinforce_pp_baseline) then count each episode once: the group statistics use
one reward per episode and every segment's tokens get its episode's advantage (the step-wise
"broadcast" of rLLM and SkyRL), so an agent that rewrites its history more often does not weigh
more in its group. Token-level estimators (gae, reinforce_pp) see each segment as a sequence that
ends with the episode's reward.

Per-turn rewards (`Trajectory.turn_rewards`, None where missing) reach the estimators when any
trajectory of the batch has them (`_turn_rewards`): the group estimators add each turn's discounted
sum of per-position-baselined rewards to the outcome advantage (`algos.turn_advantages`), numbering
an episode's turns across its segments (segment k's turns follow segment k-1's), with `algorithm.gamma`
as the discount over turns; the token-level ones get each reward on its turn's last token
(`algos.turn_token_rewards`). A missing reward is masked (NaN), never 0.

`train_step_with_tokens` does the same and returns the step's `StepReport` (its metrics and the
on-policy gate's per-row decisions, `GatedRow`: which sequences were masked, why, their figures),
which the run reads to ledger and police the gate, and what the trainer computed per token
(`StepTokens`: the old logprob the loss used and, when the update is one optimizer step, the
policy's entropy), so that the run can store it beside the rollout's logprobs of the episodes it
keeps: where the two differ, the rollout was off-policy on that token. The tensors are already in
the trainer's memory; the caller picks the few rows it keeps (`StepTokens.of`).

It owns no model and no process group: every rank calls it with the same batch and the backend
splits the work. It does not collect trajectories, push weights, or drop groups whose rewards are
all equal (`algorithm.filter_groups`, DAPO's dynamic sampling): the orchestration layer drops
those as the groups arrive, so that the batch is refilled with groups that teach something.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from agentrl.config import AlgorithmConfig, DistillConfig, TrainerConfig
from agentrl.errors import ConfigError, TrainerError
from agentrl.registry import ADVANTAGE_ESTIMATORS
from agentrl.sampling import KeptSetRule
from agentrl.trainer import algos
from agentrl.trainer.backend import CriticBatch, PolicyBatch, TrainerBackend, UpdateResult
from agentrl.trainer.distill import apply_distillation
from agentrl.trainer.mismatch_gate import SequenceGate, gate_sequences
from agentrl.trainer.packing import PaddedBatch, pad_trajectories
from agentrl.types import MASK_CAUSES, FinishReason, GatedRow, MaskCause, StepReport, Trajectory

__all__ = ["StepTokens", "kept_set_metrics", "make_kl_controller", "train_step", "train_step_with_tokens"]

KLController = algos.FixedKLController | algos.AdaptiveKLController
# An entry of ADVANTAGE_ESTIMATORS: (rewards, mask, group ids, **options) -> (advantages, returns).
Estimator = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def make_kl_controller(algorithm: AlgorithmConfig) -> KLController:
    """The KL coefficient controller an `AlgorithmConfig` asks for, starting at `kl_coef`."""
    if algorithm.kl_target is None:
        return algos.FixedKLController(algorithm.kl_coef)
    return algos.AdaptiveKLController(algorithm.kl_coef, algorithm.kl_target, algorithm.kl_horizon)


@dataclass(frozen=True)
class StepTokens:
    """What one step's trainer computed per token of the trajectories it trained.

    `old_logprobs` and `entropy` (None: not measured) are `(len(trained), max_len)` in the
    next-token alignment of `packing.pad_trajectories` (column t: token t+1); `mask` and
    `entropy_mask` name the tokens each was measured on (the loss's tokens, less the rows a skipping
    update left out); `trained` are the trajectories of the rows, in order (the trainable ones of
    the batch). `of(i)` gives one trajectory's values as long as its ledger.
    """

    trained: list[Trajectory]
    old_logprobs: torch.Tensor
    mask: torch.Tensor
    entropy: torch.Tensor | None = None
    entropy_mask: torch.Tensor | None = None

    def of(self, index: int) -> tuple[list[float | None], list[float | None] | None]:
        """(logprobs, entropy or None) of `trained[index]`, one value per ledger token: the trainer's
        values on the tokens of the loss, None on every other token."""
        n = len(self.trained[index].token_ids)

        def per_token(values: torch.Tensor, mask: torch.Tensor) -> list[float | None]:
            pairs = zip(values[index, : n - 1].tolist(), mask[index, : n - 1].tolist(), strict=True)
            out: list[float | None] = [None]  # the first token is predicted by nothing
            out += [v if m > 0 else None for v, m in pairs]
            return out

        logprobs = per_token(self.old_logprobs, self.mask)
        if self.entropy is None:
            return logprobs, None
        return logprobs, per_token(self.entropy, self.mask if self.entropy_mask is None else self.entropy_mask)


def train_step(
    backend: TrainerBackend,
    trajectories: Sequence[Trajectory],
    algorithm: AlgorithmConfig,
    trainer: TrainerConfig,
    *,
    temperature: float = 1.0,
    max_response_tokens: int | None = None,
    kl_controller: KLController | None = None,
    kept_rule: KeptSetRule | None = None,
    policy_version: int | None = None,
    allowed_staleness: int = 0,
    distill: DistillConfig | None = None,
) -> dict[str, float]:
    """Train the backend's policy (and critic) on one batch; return the step's metrics.

    `algorithm` is an `AlgorithmConfig`, `trainer` a `TrainerConfig`; see `train_step_with_tokens`
    for the rest of the arguments.
    """
    report, _ = _train_step(backend, trajectories, algorithm, trainer, temperature=temperature,
                            max_response_tokens=max_response_tokens, kl_controller=kl_controller,
                            kept_rule=kept_rule, policy_version=policy_version,
                            allowed_staleness=allowed_staleness, distill=distill, with_tokens=False)
    return report.metrics


def train_step_with_tokens(
    backend: TrainerBackend,
    trajectories: Sequence[Trajectory],
    algorithm: AlgorithmConfig,
    trainer: TrainerConfig,
    *,
    temperature: float = 1.0,
    max_response_tokens: int | None = None,
    kl_controller: KLController | None = None,
    kept_rule: KeptSetRule | None = None,
    policy_version: int | None = None,
    allowed_staleness: int = 0,
    distill: DistillConfig | None = None,
) -> tuple[StepReport, StepTokens | None]:
    """`train_step`'s step as a `StepReport` (its metrics and the on-policy gate's per-row
    decisions), and what the trainer computed per token (None when nothing was trained).

    `algorithm` is an `AlgorithmConfig`, `trainer` a `TrainerConfig` (the update's schedule:
    `ppo_epochs`, `mini_batches`, `zero_advantage_rows`, `score_in_update`). `temperature` is the
    rollout sampling temperature (logprobs are scored at it). `max_response_tokens` is the
    response length limit: the DAPO overlong penalty needs it, and `seq-mean-token-sum-norm`
    divides by it (by the batch's longest response when None). `kl_controller` (from
    `make_kl_controller`, kept by the caller across steps and saved with its checkpoints) gives
    this step's KL coefficient and is updated at the end; it is required when
    `algorithm.kl_target` is set, and without it the coefficient is `algorithm.kl_coef`.
    `kept_rule` is the rollout's truncation (top-k, top-p, min-p): with it, the share of sampled
    tokens outside the kept set the trainer's own logits give is measured where the old logprobs
    are scored (`onpolicy/kept_set_disagreement`). Tokens are scored over the kept sets their
    trajectories recorded whether or not it is given (`Trajectory.kept_sets`).
    `policy_version` (the trainer version this step trains at) and `allowed_staleness` (how many
    versions older a sampled token may be) let the mismatch gate check the ledger's versions.
    `distill` (the run's `distill` section, None without a teacher) turns each trajectory's teacher
    logprobs into the per-token advantage its `mode` and `coef` say (`trainer.distill`).
    """
    return _train_step(backend, trajectories, algorithm, trainer, temperature=temperature,
                       max_response_tokens=max_response_tokens, kl_controller=kl_controller,
                       kept_rule=kept_rule, policy_version=policy_version,
                       allowed_staleness=allowed_staleness, distill=distill, with_tokens=True)


def _train_step(
    backend: TrainerBackend, trajectories: Sequence[Trajectory], algorithm: AlgorithmConfig, trainer: TrainerConfig,
    *, temperature: float, max_response_tokens: int | None, kl_controller: KLController | None,
    kept_rule: KeptSetRule | None, policy_version: int | None, allowed_staleness: int, with_tokens: bool,
    distill: DistillConfig | None = None,
) -> tuple[StepReport, StepTokens | None]:  # fmt: skip
    kl_coef = _kl_coefficient(algorithm, kl_controller)
    start = time.perf_counter()
    trajs = [t for t in trajectories if t.trainable]
    metrics = {"batch/trajectories": float(len(trajectories)), "batch/infra_masked": float(len(trajectories) - len(trajs))}
    if not trajs:
        return StepReport({**metrics, "batch/skipped": 1.0}), None
    scores = _shaped_scores(trajs, algorithm, max_response_tokens, metrics)
    layout = pad_trajectories(trajs)

    in_update = backend.scores_old_logprobs(trainer) and not _needs_old_logprobs_first(algorithm)
    metrics["batch/scored_in_update"] = float(in_update)
    metrics.update(kept_set_metrics(trajs))
    rule = kept_rule if kept_rule is not None and kept_rule.truncates else None
    if rule is not None:
        _check_kept_sets_recorded(trajs, rule)
    rule_arg = {"kept_rule": rule} if rule is not None else {}
    old_logprobs = None if in_update else backend.compute_logprobs(trajs, temperature=temperature, **rule_arg)
    ref_logprobs = backend.compute_ref_logprobs(trajs, temperature=temperature) if algorithm.kl_coef > 0 else None

    rewards, kl = _kl_in_reward(scores, old_logprobs, ref_logprobs, layout.loss_mask, algorithm, kl_coef, metrics)
    advantages, returns, values = _advantages(backend, trajs, rewards, layout.loss_mask, algorithm, metrics)
    if distill is not None:  # the teacher's per-token signal, alone or beside the reward's advantage
        advantages = apply_distillation(trajs, advantages, layout.loss_mask, distill, metrics)
        metrics.update(_stats("adv", advantages, layout.loss_mask))

    policy_batch, critic_batch, gated, corrected = _update_batches(
        trajs, layout, advantages, returns, values, old_logprobs, ref_logprobs, algorithm, metrics,
        temperature=temperature, max_len=max_response_tokens, kept_rule=rule if in_update else None,
        gate=(policy_version, allowed_staleness),
    )  # fmt: skip
    # The backend reads the loss's KL weight from the config: hand it this step's coefficient.
    step_algorithm = algorithm if kl_coef == algorithm.kl_coef else algorithm.model_copy(update={"kl_coef": kl_coef})
    if with_tokens:
        policy_batch = replace(policy_batch, keep_entropy=True)
    update_start = time.perf_counter()
    result = backend.update(policy_batch, step_algorithm, trainer, critic_batch)
    update_s = time.perf_counter() - update_start

    metrics.update(result.metrics)
    trained_mask = policy_batch.loss_mask
    if result.gate is not None:  # decided in the update, from its own forward
        metrics.update(result.gate.metrics)
        gated = result.gate.gated
        trained_mask = trained_mask * result.gate.keep[:, None]
    masked_tokens = _token_books(trajs, layout.loss_mask, corrected, trained_mask, metrics)
    if rule is not None and (disagreement := backend.take_kept_set_disagreement()) is not None:
        metrics["onpolicy/kept_set_disagreement"] = disagreement
    if in_update:
        # The update's own logprobs were its old ones: the ratio is 1 and ppo_kl 0 by construction,
        # not measured, so it is left out (the console shows it as missing) rather than logged as 0.
        metrics.pop("actor/ppo_kl", None)
        kl = _measured_in_update(metrics, result, layout.rollout_logprobs, ref_logprobs, layout.loss_mask, algorithm)
    if kl_controller is not None and kl is not None:
        kl_controller.update(kl, n_steps=len(trajs))
        metrics["actor/kl_coef_next"] = kl_controller.value
    tokens = metrics["batch/tokens"]
    step_s = time.perf_counter() - start
    metrics["perf/update_tokens_per_s"] = tokens * trainer.ppo_epochs / max(update_s, 1e-9)
    metrics["perf/step_s"] = step_s
    metrics["perf/step_tokens_per_s"] = tokens / max(step_s, 1e-9)
    report = StepReport(metrics, gated, masked_tokens)
    if not with_tokens:
        return report, None
    # Rows a skipping update left out (`zero_advantage_rows=skip`) were not scored in the update.
    in_update_mask = layout.loss_mask if result.scored_rows is None else layout.loss_mask * result.scored_rows[:, None]
    used = old_logprobs if old_logprobs is not None else result.old_logprobs
    if used is None:  # the update skipped an all-masked batch: it scored nothing
        return report, None
    mask = layout.loss_mask if old_logprobs is not None else in_update_mask
    return report, StepTokens(trajs, used, mask, result.entropy, in_update_mask)


def kept_set_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """What the rollout's kept sets looked like (nothing when no trajectory records them): the mean
    size of the recorded ones, how many sampled tokens overflowed the cap (`rollout.max_kept_set`;
    masked out of the loss) and their share of the sampled tokens."""
    sizes = [len(k) for t in trajectories for k in t.kept_sets]
    if not sizes:
        return {}
    overflow = sum(1 for n in sizes if n == 0)
    recorded = [n for n in sizes if n]
    out = {"onpolicy/kept_set_overflow": float(overflow), "onpolicy/kept_set_overflow_share": overflow / len(sizes)}
    if recorded:
        out["onpolicy/kept_set_size_mean"] = sum(recorded) / len(recorded)
    return out


def _check_kept_sets_recorded(trajs: list[Trajectory], rule: KeptSetRule) -> None:
    """Truncated sampling whose kept sets did not come back cannot be scored without bias: stop."""
    missing = [t for t in trajs if t.num_sampled and not t.kept_sets]
    if missing:
        raise TrainerError(
            f"{len(missing)} of {len(trajs)} trajectories were sampled with truncation ({rule}) but record "
            f"no kept sets (episode '{missing[0].episode_id}'), so their tokens cannot be scored under the "
            "distribution they were drawn from. Serve with an engine that returns kept sets "
            "(inference.engine=vllm or hf, agentrl's own servers), or train with rollout.top_p=1.0 "
            "rollout.top_k=0 rollout.min_p=0.0."
        )


# ── stages ──────────────────────────────────────────────────────────────────────────────────────
def _kl_coefficient(algorithm: AlgorithmConfig, kl_controller: KLController | None) -> float:
    if algorithm.kl_target is not None and (kl_controller is None or algorithm.kl_coef <= 0):
        raise ConfigError(
            "algorithm.kl_target needs algorithm.kl_coef > 0 (the starting coefficient) and a "
            "kl_controller=make_kl_controller(algorithm) kept across train_step calls."
        )
    return kl_controller.value if kl_controller is not None else algorithm.kl_coef


def _shaped_scores(
    trajs: list[Trajectory], algorithm: AlgorithmConfig, max_response_tokens: int | None, metrics: dict[str, float]
) -> torch.Tensor:
    """(B,) sequence scores: the rewards (reported as they came), then the length shaping."""
    scores = torch.tensor([float(t.reward or 0.0) for t in trajs])
    metrics.update(_stats("reward", scores, torch.ones_like(scores)))
    if algorithm.overlong_buffer_tokens > 0:
        if max_response_tokens is None:
            raise ConfigError(
                "algorithm.overlong_buffer_tokens > 0 needs the response length limit; pass "
                "max_response_tokens to train_step (or set overlong_buffer_tokens=0)."
            )
        lengths = torch.tensor([t.num_sampled for t in trajs])
        penalty = algos.overlong_penalty(
            lengths, max_response_length=max_response_tokens, buffer_length=algorithm.overlong_buffer_tokens
        )
        metrics["reward/overlong_penalty_mean"] = penalty.mean().item()
        scores = scores + penalty
    if algorithm.stop_properly_penalty is not None:
        stopped = torch.tensor([t.finish_reason != FinishReason.MAX_LENGTH for t in trajs])
        scores = algos.stop_properly_penalty(scores, stopped, coef=algorithm.stop_properly_penalty)
        metrics["reward/truncated_fraction"] = 1.0 - stopped.float().mean().item()
    return scores


def _needs_old_logprobs_first(algorithm: AlgorithmConfig) -> bool:
    """Whether the old logprobs are needed before the update: a masking rollout correction
    (ICEPOP, seq-mask-TIS) or a KL penalty in the reward. Otherwise the update may score them."""
    return algorithm.rollout_is not in ("none", "tis") or (algorithm.kl_coef > 0 and algorithm.kl_in_reward)


def _kl_in_reward(
    scores: torch.Tensor, old_logprobs: torch.Tensor | None, ref_logprobs: torch.Tensor | None,
    mask: torch.Tensor, algorithm: AlgorithmConfig, kl_coef: float, metrics: dict[str, float],
) -> tuple[torch.Tensor, float | None]:  # fmt: skip
    """(rewards for the estimator, the batch's KL to the reference or None if not measured yet):
    the scores, or with `kl_in_reward` token rewards with the KL penalty subtracted."""
    if ref_logprobs is None:
        return scores, None
    metrics["actor/kl_coef"] = kl_coef
    if old_logprobs is None:
        return scores, None
    shaped, kl_metrics = algos.apply_kl_penalty(
        _on_last_token(scores, mask), old_logprobs, ref_logprobs, mask, kl_coef=kl_coef, kind=algorithm.kl_estimator
    )
    kl = kl_metrics["kl"].item()
    if not algorithm.kl_in_reward:
        return scores, kl
    metrics["actor/kl_in_reward"] = kl
    return shaped, kl


def _advantages(
    backend: TrainerBackend, trajs: list[Trajectory], rewards: torch.Tensor, mask: torch.Tensor, algorithm: AlgorithmConfig,
    metrics: dict[str, float],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """(advantages, returns, critic values or None) from the configured estimator."""
    estimator: Estimator = ADVANTAGE_ESTIMATORS.resolve(algorithm.advantage)
    kwargs: dict[str, Any] = {}
    values = None
    if algorithm.advantage == "gae":
        values = backend.compute_values(trajs)
        kwargs = {"values": values, "gamma": algorithm.gamma, "lam": algorithm.lam}
    elif algorithm.advantage == "reinforce_pp":
        kwargs = {"gamma": algorithm.gamma}
    groups = [t.group_id for t in trajs]
    episode_of = _episode_index(trajs)
    group_estimator = algorithm.advantage in _PER_EPISODE_ESTIMATORS
    turns = _turn_rewards(trajs, mask, episode_of if group_estimator else None, algorithm.gamma)
    if turns is not None:
        metrics["batch/turn_rewards_given"] = float((~torch.isnan(turns.rewards)).sum().item())
        if not group_estimator:
            if algorithm.advantage not in _TOKEN_ESTIMATORS:
                raise ConfigError(
                    f"the batch has per-turn rewards, which algorithm.advantage={algorithm.advantage!r} does not "
                    f"read; use one of {', '.join(_PER_EPISODE_ESTIMATORS + _TOKEN_ESTIMATORS)}")
            token = algos.turn_token_rewards(turns)
            rewards = (_on_last_token(rewards, mask) if rewards.dim() == 1 else rewards) + token
    if episode_of is not None and group_estimator:
        advantages, returns = _per_episode_advantages(estimator, rewards, mask, groups, episode_of)
        if turns is not None:  # the per-turn part alone: every episode's outcome set to 0
            per_turn, _ = estimator(torch.zeros(len(trajs)), mask, groups, turns=turns)
            advantages = returns = advantages + per_turn
        metrics["batch/segments"] = float(len(trajs))
        metrics["batch/episodes"] = float(max(episode_of) + 1)
    elif turns is not None and group_estimator:
        advantages, returns = estimator(rewards, mask, groups, turns=turns, **kwargs)
    else:
        advantages, returns = estimator(rewards, mask, groups, **kwargs)
    metrics.update(_stats("adv", advantages, mask))
    if values is not None:
        metrics.update(_stats("critic/returns", returns, mask))
    return advantages, returns, values


_PER_EPISODE_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")
_TOKEN_ESTIMATORS = ("gae", "reinforce_pp")


def _turn_rewards(
    trajs: Sequence[Trajectory], mask: torch.Tensor, episode_of: list[int] | None, gamma: float
) -> algos.TurnRewards | None:
    """The batch's per-turn rewards (None when no trajectory has any): one row per episode, its segments'
    turns numbered in segment order, or one row per sequence when `episode_of` is None."""
    if not any(t.turn_rewards for t in trajs):
        return None
    of = episode_of if episode_of is not None else list(range(len(trajs)))
    per_episode: list[list[float | None]] = [[] for _ in range(max(of) + 1)]
    offset = [0] * len(trajs)
    def position(i: int) -> tuple[int, int]:
        segment = trajs[i].segment
        return of[i], 0 if segment is None else segment.index

    for i in sorted(range(len(trajs)), key=position):
        t = trajs[i]
        offset[i] = len(per_episode[of[i]])
        per_episode[of[i]].extend([*t.turn_rewards, *[None] * (t.num_turns - len(t.turn_rewards))])
    width = max(1, max(len(r) for r in per_episode))
    table = torch.full((len(per_episode), width), float("nan"))
    for e, values in enumerate(per_episode):
        for k, r in enumerate(values):
            if r is not None:
                table[e, k] = float(r)
    token_turns = torch.zeros(mask.shape, dtype=torch.long)
    for i, t in enumerate(trajs):
        local = torch.tensor(t.turns[1:], dtype=torch.long)  # column c predicts token c + 1
        token_turns[i, : len(local)] = torch.where(local > 0, local + offset[i], 0)
    token_turns = token_turns * (mask > 0).long()
    return algos.TurnRewards(table, token_turns, None if episode_of is None else torch.tensor(of), gamma)


def _episode_index(trajs: Sequence[Trajectory]) -> list[int] | None:
    """Each trajectory's episode number when some episodes come in segments (module docstring), else None."""
    seen: dict[tuple[str, str] | int, int] = {}
    index = []
    for i, t in enumerate(trajs):
        segmented = t.segment is not None and t.episode_id
        key = (t.group_id, t.episode_id) if segmented else i
        index.append(seen.setdefault(key, len(seen)))
    return index if len(seen) < len(trajs) else None


def _per_episode_advantages(
    estimator: Estimator, rewards: torch.Tensor, mask: torch.Tensor, groups: list[str], episode_of: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """A group estimator over one score per episode, each segment given its episode's advantage."""
    n_episodes = max(episode_of) + 1
    of = torch.tensor(episode_of)
    first: dict[int, int] = {}
    for i, e in enumerate(episode_of):
        first.setdefault(e, i)
    # Segments share the reward. Shaping that differs per segment is combined: token rewards (a KL
    # penalty in the reward) add up over the episode, per-sequence scores (overlong penalty) average.
    total = rewards.float().sum(-1) if rewards.dim() == 2 else rewards.float()
    per_episode = total.new_zeros(n_episodes).index_add(0, of, total)
    if rewards.dim() == 1:
        per_episode = per_episode / torch.bincount(of, minlength=n_episodes).float()
    adv, _ = estimator(per_episode, torch.ones(n_episodes, 1), [groups[first[e]] for e in range(n_episodes)])
    advantages = adv[:, 0][of].unsqueeze(-1) * mask.to(adv.dtype)
    return advantages, advantages


def _rollout_mismatch(
    metrics: dict[str, float], old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
    algorithm: AlgorithmConfig,
) -> tuple[torch.Tensor | None, torch.Tensor]:  # fmt: skip
    """Record the rollout/trainer mismatch metrics; return (importance weights or None, loss mask)."""
    mode = "tis" if algorithm.rollout_is == "none" else algorithm.rollout_is.replace("_", "-")
    is_weights, loss_mask, is_metrics = algos.rollout_correction(
        old_logprobs, rollout_logprobs, mask, mode=mode,
        low=1.0 / algorithm.rollout_is_cap, high=algorithm.rollout_is_cap,
    )  # fmt: skip
    metrics.update({f"rollout/{k}": float(v) for k, v in is_metrics.items()})
    metrics["rollout/logprob_abs_diff"] = algos.masked_mean((old_logprobs - rollout_logprobs).abs(), mask).item()
    if algorithm.rollout_is == "none":
        return None, mask
    return is_weights, loss_mask


def _update_batches(
    trajs: list[Trajectory], layout: PaddedBatch, advantages: torch.Tensor, returns: torch.Tensor,
    values: torch.Tensor | None, old_logprobs: torch.Tensor | None, ref_logprobs: torch.Tensor | None,
    algorithm: AlgorithmConfig, metrics: dict[str, float], *, temperature: float, max_len: int | None,
    kept_rule: KeptSetRule | None = None,
    gate: tuple[int | None, int] = (None, 0),
) -> tuple[PolicyBatch, CriticBatch | None, list[GatedRow], torch.Tensor]:  # fmt: skip
    """The policy batch (with the rollout correction and the mismatch gate when the old logprobs
    are known), for GAE the critic batch, the rows the gate masked, and the loss mask after the
    rollout correction, before the gate (for the step's books). `max_len` None: the batch's
    longest response. `gate`: (the policy version this step trains at, the staleness it allows)."""
    mask = layout.loss_mask
    is_weights, loss_mask = None, mask
    gated: list[GatedRow] = []
    corrected = mask
    if old_logprobs is not None:
        is_weights, loss_mask = _rollout_mismatch(metrics, old_logprobs, layout.rollout_logprobs, mask, algorithm)
        corrected = loss_mask
        if algorithm.mismatch_gate.enabled:
            decision = gate_sequences(trajs, old_logprobs, layout.rollout_logprobs, mask, algorithm.mismatch_gate,
                                      policy_version=gate[0], allowed_staleness=gate[1])
            metrics.update(decision.metrics)
            gated = decision.gated
            loss_mask = loss_mask * decision.keep[:, None].to(loss_mask.dtype)
    in_update_gate = None
    if old_logprobs is None and algorithm.mismatch_gate.enabled:  # the update gates from its own forward
        in_update_gate = SequenceGate(trajs, layout.rollout_logprobs, mask, algorithm.mismatch_gate,
                                      policy_version=gate[0], allowed_staleness=gate[1])
    max_len = max_len or max(1, int(mask.sum(-1).max().item()))
    policy = PolicyBatch(
        trajectories=trajs, loss_mask=loss_mask, advantages=advantages, old_logprobs=old_logprobs,
        rollout_logprobs=layout.rollout_logprobs, ref_logprobs=ref_logprobs, is_weights=is_weights,
        temperature=temperature, max_len=max_len, kept_rule=kept_rule, gate=in_update_gate,
    )  # fmt: skip
    critic = None
    if values is not None:
        critic = CriticBatch(trajs, loss_mask=mask, returns=returns, old_values=values, max_len=max_len)
    metrics["batch/tokens"] = float(sum(len(t.token_ids) for t in trajs))
    return policy, critic, gated, corrected


def _token_books(
    trajs: list[Trajectory], packed: torch.Tensor, corrected: torch.Tensor, trained: torch.Tensor,
    metrics: dict[str, float],
) -> list[dict[MaskCause, int]]:  # fmt: skip
    """Account for every sampled token of the batch: in the loss, or out of it with its cause
    (`MASK_CAUSES`). `packed` is the loss mask the batch was laid out with (sampled tokens but the
    first and the kept-set overflows), `corrected` that mask after the rollout correction, `trained`
    the mask the loss was taken over (after the gate). Records `batch/sampled_tokens`,
    `batch/masked_tokens/<cause>` and `batch/loss_tokens` (the first less the others, exactly);
    returns each row's causes (those with none left out)."""
    in_packed, in_corrected, in_loss = (m.sum(-1).round().long().tolist() for m in (packed, corrected, trained))
    rows: list[dict[MaskCause, int]] = []
    for t, a, b, c in zip(trajs, in_packed, in_corrected, in_loss, strict=True):
        first = t.response_mask[0] if t.token_ids else 0
        counts: dict[MaskCause, int] = {
            "unpredicted": first, "kept_set_overflow": t.num_sampled - first - a, "rollout_is": a - b, "gate": b - c,
        }  # fmt: skip
        rows.append({cause: n for cause, n in counts.items() if n})
    sampled = sum(t.num_sampled for t in trajs)
    metrics["batch/sampled_tokens"] = float(sampled)
    for cause in MASK_CAUSES:
        metrics[f"batch/masked_tokens/{cause}"] = float(sum(r.get(cause, 0) for r in rows))
    metrics["batch/loss_tokens"] = float(trained.sum().item())
    return rows


def _measured_in_update(
    metrics: dict[str, float], result: UpdateResult, rollout_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor | None, mask: torch.Tensor, algorithm: AlgorithmConfig,
) -> float | None:  # fmt: skip
    """The on-policy shortcut: the update scored the old logprobs (zeros if it skipped an
    all-masked batch), so the mismatch and the KL to the reference are measured after it, over
    the rows it scored. Returns the KL (None when not measured)."""
    old_logprobs = result.old_logprobs if result.old_logprobs is not None else torch.zeros_like(rollout_logprobs)
    scored = mask if result.scored_rows is None else mask * result.scored_rows[:, None]
    if scored.sum() == 0:
        return None
    _rollout_mismatch(metrics, old_logprobs, rollout_logprobs, scored, algorithm)
    if ref_logprobs is None:
        return None
    _, kl_metrics = algos.apply_kl_penalty(
        torch.zeros_like(scored), old_logprobs, ref_logprobs, scored, kl_coef=0.0, kind=algorithm.kl_estimator
    )
    return float(kl_metrics["kl"].item())


# ── helpers ─────────────────────────────────────────────────────────────────────────────────────
def _on_last_token(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) scores -> (B, L) token rewards with each score on its sequence's last loss token."""
    positions = torch.arange(mask.shape[1]).expand_as(mask)
    last = torch.where(mask > 0, positions, -1).max(-1).values
    out = torch.zeros(mask.shape, dtype=torch.float32)
    rows = (last >= 0).nonzero().squeeze(-1)
    out[rows, last[rows]] = scores[rows].float()
    return out


def _stats(prefix: str, values: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    kept = values[mask > 0]
    if kept.numel() == 0:
        return {}
    return {
        f"{prefix}/mean": kept.mean().item(),
        f"{prefix}/std": kept.std().item() if kept.numel() > 1 else 0.0,
        f"{prefix}/min": kept.min().item(),
        f"{prefix}/max": kept.max().item(),
    }
