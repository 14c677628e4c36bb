"""The RL algorithms of the trainer as pure tensor functions: advantages, losses, KL, corrections.

Every function here takes tensors and returns tensors (plus a dict of detached metric tensors for
the losses); none of them owns a model, an optimizer or a process group, so each can be tested
with a handful of numbers worked out by hand. Token-level tensors are `(batch, seq_len)` with a
`response_mask` that is 1 on the tokens trained on; every masked reduction returns 0, never NaN,
when the mask is empty. Group-relative estimators take `index`, one group id per sequence (a
tensor of ints, or any hashable ids such as `Trajectory.group_id` strings).

Per-turn rewards (`Trajectory.turn_rewards`) reach the group estimators as `turns=TurnRewards(...)`:
each turn's tokens get, besides the outcome advantage, the discounted sum over that turn and the later
ones of each turn's reward minus its group baseline at that turn position (`turn_advantages`; a missing
reward is NaN and is masked: it is in no baseline and adds nothing, never a 0). The token-level
estimators (gae, reinforce_pp) take them as token rewards on each turn's last token (`turn_token_rewards`).

This module is not the training loop: which of these run, in what order and with which
coefficients is decided by the trainer backend and its config.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "LOSS_AGG_MODES",
    "AdaptiveKLController",
    "FixedKLController",
    "TurnRewards",
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
    "turn_advantages",
    "turn_token_rewards",
    "value_loss",
]

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
ROLLOUT_CORRECTIONS = ("tis", "icepop", "seq-mask-tis")

# exp() of a log-ratio beyond this is inf in fp32 or meaningless; clamp before exponentiating.
_MAX_LOG_RATIO = 20.0


# ── masked reductions ───────────────────────────────────────────────────────────────────────────
def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ values·mask, over `dim` or everything. Masked-out NaN/inf values do not leak in."""
    m = mask.to(values.dtype)
    kept = torch.where(m > 0, values * m, torch.zeros_like(values))
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ values·mask / Σ mask, and 0 where the mask is empty."""
    total = masked_sum(values, mask, dim)
    count = mask.to(values.dtype).sum() if dim is None else mask.to(values.dtype).sum(dim)
    return total / count.clamp(min=1.0)


def masked_whiten(
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    shift_mean: bool = True,
    divide_std: bool = True,
    eps: float = 1e-8,
) -> torch.Tensor:
    """(x - mean) / (std + eps) over the masked entries; masked-out entries come back as 0.

    `std` is the unbiased (Bessel-corrected) standard deviation; with fewer than two entries it is
    taken as 0, so a lone value whitens to 0. `divide_std=False` only centres, `shift_mean=False`
    only rescales (for advantages that are already centred by a baseline).
    """
    m = mask.to(values.dtype)
    n = m.sum()
    mean = masked_mean(values, m)
    centred = values - mean
    out = centred if shift_mean else values
    if divide_std:
        var = masked_sum(centred * centred, m) / (n - 1).clamp(min=1.0)
        out = out / (var.sqrt() + eps)
    return torch.where(m > 0, out * m, torch.zeros_like(out))


def _per_sequence_sum(
    values: torch.Tensor, mask: torch.Tensor, segment_ids: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ values·mask, Σ mask) per sequence: per row of a 2D batch, or per segment of a packed one."""
    m = mask.to(values.dtype)
    vm = torch.where(m > 0, values * m, torch.zeros_like(values))
    if segment_ids is None:
        return vm.sum(-1), m.sum(-1)
    seg = segment_ids.reshape(-1).long()
    n_seg = int(seg.max().item()) + 1 if seg.numel() else 0
    sums = vm.new_zeros(n_seg).index_add(0, seg, vm.reshape(-1))
    counts = m.new_zeros(n_seg).index_add(0, seg, m.reshape(-1))
    return sums, counts


def _sequence_mean_per_token(
    values: torch.Tensor, mask: torch.Tensor, segment_ids: torch.Tensor | None
) -> torch.Tensor:
    """Each token gets the masked mean of `values` over its own sequence (0 for empty sequences)."""
    sums, counts = _per_sequence_sum(values, mask, segment_ids)
    means = sums / counts.clamp(min=1.0)
    if segment_ids is None:
        return means.unsqueeze(-1).expand_as(values)
    return means[segment_ids.long()].reshape(values.shape)


# ── loss aggregation ────────────────────────────────────────────────────────────────────────────
def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    max_len: int | None = None,
    segment_ids: torch.Tensor | None = None,
    denominator: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar.

    - `token-mean`: Σ_i Σ_t l_it·m_it / Σ_i Σ_t m_it (DAPO, Yu et al. 2025): every token weighs the same.
    - `seq-mean-token-mean`: mean over sequences of each sequence's token mean (GRPO, Shao et al. 2024).
    - `seq-mean-token-sum-norm`: mean over sequences of Σ_t l_it·m_it / max_len, with `max_len` a
      constant such as the max response length (Dr. GRPO, Liu et al. 2025), so no length bias.

    The sequence means count only sequences with at least one unmasked token; rows of a 2D batch
    are the sequences, or `segment_ids` (one id per token, 0..S-1) names them in a packed batch.
    An empty mask gives 0.

    `denominator` replaces the count divided by (tokens for `token-mean`, sequences otherwise).
    With gradient accumulation, give every micro-batch the count of the whole mini-batch (summed
    over data-parallel ranks too): the micro-batch losses then add up to the full-batch loss.
    """
    if mode == "token-mean":
        if denominator is None:
            return masked_mean(loss_mat, mask)
        return masked_sum(loss_mat, mask) / _positive(denominator)
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"Unknown loss_agg_mode '{mode}'; use one of {', '.join(LOSS_AGG_MODES)}.")
    sums, counts = _per_sequence_sum(loss_mat, mask, segment_ids)
    present = (counts > 0).to(loss_mat.dtype)
    if mode == "seq-mean-token-mean":
        per_seq = sums / counts.clamp(min=1.0)
    else:
        if max_len is None or max_len <= 0:
            raise ValueError(
                "loss_agg_mode 'seq-mean-token-sum-norm' needs max_len, a positive constant such as "
                f"the max response length; got {max_len!r}."
            )
        per_seq = sums / float(max_len)
    if denominator is None:
        return (per_seq * present).sum() / present.sum().clamp(min=1.0)
    return (per_seq * present).sum() / _positive(denominator)


def _positive(denominator: float | torch.Tensor) -> float | torch.Tensor:
    if float(denominator) <= 0:
        raise ValueError(
            f"loss denominator must be positive, got {float(denominator)}; pass None to use the batch's own count."
        )
    return denominator


# ── advantage estimators ────────────────────────────────────────────────────────────────────────
def _group_index(index: torch.Tensor | Sequence[Hashable], n: int, device: torch.device) -> torch.Tensor:
    """Dense group ids 0..G-1 (LongTensor of shape (n,)) from ints or any hashable ids."""
    if isinstance(index, torch.Tensor):
        ids = index.reshape(-1).to(device)
        if ids.numel() != n:
            raise ValueError(f"index has {ids.numel()} group ids for a batch of {n} sequences.")
        inverse: torch.Tensor = torch.unique(ids, return_inverse=True)[1]
        return inverse.long()
    ids_list = list(index)
    if len(ids_list) != n:
        raise ValueError(f"index has {len(ids_list)} group ids for a batch of {n} sequences.")
    dense: dict[Hashable, int] = {}
    return torch.tensor([dense.setdefault(g, len(dense)) for g in ids_list], dtype=torch.long, device=device)


def _sequence_scores(rewards: torch.Tensor) -> torch.Tensor:
    """One score per sequence: the rewards as given if 1D, else the sum of token-level rewards."""
    rewards = rewards if rewards.is_floating_point() else rewards.float()
    if rewards.dim() == 1:
        return rewards
    if rewards.dim() == 2:
        return rewards.sum(-1)
    raise ValueError(
        f"rewards must be (batch,) scores or (batch, seq_len) token rewards; got {tuple(rewards.shape)}."
    )


def _group_stats(scores: torch.Tensor, gid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample (group size, group mean, unbiased group std; 0 for groups of one)."""
    n_groups = int(gid.max().item()) + 1 if gid.numel() else 0
    counts = scores.new_zeros(n_groups).index_add(0, gid, torch.ones_like(scores))
    means = scores.new_zeros(n_groups).index_add(0, gid, scores) / counts.clamp(min=1.0)
    dev = scores - means[gid]
    sq = scores.new_zeros(n_groups).index_add(0, gid, dev * dev)
    std = (sq / (counts - 1).clamp(min=1.0)).sqrt()
    return counts[gid], means[gid], std[gid]


def _broadcast(per_seq: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    adv = per_seq.unsqueeze(-1) * response_mask.to(per_seq.dtype)
    return adv, adv


@dataclass(frozen=True)
class TurnRewards:
    """Per-turn rewards of a batch, for the group estimators' `turns` (see `turn_advantages`).

    `rewards` is (episodes, turns): entry [e, k - 1] is the reward of episode e's turn k, NaN where none was
    given or its source failed (masked, never read as 0). `token_turns` is (batch, seq_len), aligned with
    the estimator's `response_mask`: the episode turn (1-based) of each token, 0 where there is none.
    `episode_of` (batch,) names the episode of each sequence when an episode comes in several segments
    (None: sequence b is episode b). `gamma` discounts later turns.
    """

    rewards: torch.Tensor
    token_turns: torch.Tensor
    episode_of: torch.Tensor | None = None
    gamma: float = 1.0


def turn_advantages(
    turns: TurnRewards,
    index: torch.Tensor | Sequence[Hashable],
    *,
    norm_by_std: bool = False,
    leave_one_out: bool = False,
    eps: float = 1e-6,
) -> torch.Tensor:
    """(batch, seq_len) per-turn advantages: A_{e,k} = Σ_{j≥k} γ^{j-k} (r_{e,j} - b_{g,j}) on turn k's tokens.

    b_{g,j} is the mean reward at turn position j over the episodes of group g (`index`, one id per sequence)
    that were given one; with `norm_by_std` each term is divided by that position's unbiased std (+ eps),
    as GRPO does, and with `leave_one_out` the baseline leaves the episode itself out (RLOO). A position
    where fewer than two episodes of the group have a reward contributes 0, as a group of one does in GRPO.
    A missing reward (NaN) is in no baseline and contributes nothing: it is masked, not a reward of 0, which
    would be scored below its group's mean. Baselining each turn position, rather than the returns, keeps a
    missing reward out of every sum, and compares turn k with the turns k of the other samples of the same
    prompt (the natural first choice for a group estimator with no critic; per matching state needs a
    notion of state the trajectories do not carry).
    """
    rewards = turns.rewards.float()
    n_episodes, n_turns = rewards.shape
    device = rewards.device
    episode_of = (torch.arange(turns.token_turns.shape[0], device=device) if turns.episode_of is None
                  else turns.episode_of.to(device).long())
    rows_gid = _group_index(index, episode_of.shape[0], device)
    gid = torch.zeros(n_episodes, dtype=torch.long, device=device).scatter_(0, episode_of, rows_gid)
    n_groups = int(gid.max().item()) + 1 if gid.numel() else 0
    given = ~torch.isnan(rewards)
    values = torch.where(given, rewards, torch.zeros_like(rewards))
    flat = (gid[:, None] * n_turns + torch.arange(n_turns, device=device)[None, :]).reshape(-1)
    size = n_groups * n_turns
    counts = torch.zeros(size, device=device).index_add(0, flat, given.float().reshape(-1))
    sums = torch.zeros(size, device=device).index_add(0, flat, values.reshape(-1))
    means = (sums / counts.clamp(min=1.0))[flat].reshape(rewards.shape)
    n = counts[flat].reshape(rewards.shape)
    centred = torch.where(given, values - means, torch.zeros_like(values))
    if norm_by_std:
        sq = torch.zeros(size, device=device).index_add(0, flat, (centred * centred).reshape(-1))
        std = (sq / (counts - 1).clamp(min=1.0)).sqrt()[flat].reshape(rewards.shape)
        centred = centred / (std + eps)
    if leave_one_out:
        centred = centred * n / (n - 1).clamp(min=1.0)
    per_turn = torch.where(given & (n > 1), centred, torch.zeros_like(centred))
    returns = torch.zeros_like(per_turn)
    running = per_turn.new_zeros(n_episodes)
    for k in reversed(range(n_turns)):
        running = per_turn[:, k] + turns.gamma * running
        returns[:, k] = running
    token_turns = turns.token_turns.to(device).long()
    if token_turns.numel() and int(token_turns.max().item()) > n_turns:
        raise ValueError(f"token_turns names turn {int(token_turns.max().item())} but rewards has {n_turns} turns; "
                         "give a reward (or NaN) for every turn of every episode")
    padded = torch.cat([returns.new_zeros(n_episodes, 1), returns], dim=1)  # column 0: no turn
    return padded[episode_of[:, None], token_turns]


def turn_token_rewards(turns: TurnRewards) -> torch.Tensor:
    """(batch, seq_len) token rewards: each given turn reward on the last token of its turn (NaN: none), for
    the token-level estimators. Needs one sequence per episode (`episode_of` None)."""
    if turns.episode_of is not None:
        raise ValueError("turn_token_rewards places per-turn rewards in one sequence per episode; "
                         "segments are placed in their own sequences (episode_of must be None)")
    token_turns = turns.token_turns.long()
    rewards = torch.nan_to_num(turns.rewards.float(), nan=0.0)  # a missing reward places nothing
    out = torch.zeros(token_turns.shape, dtype=rewards.dtype, device=token_turns.device)
    positions = torch.arange(token_turns.shape[1], device=token_turns.device)
    for k in range(1, rewards.shape[1] + 1):
        in_turn = token_turns == k
        last = torch.where(in_turn, positions, torch.full_like(positions, -1)).max(-1).values
        has = last >= 0
        rows = has.nonzero().squeeze(-1)
        out[rows, last[has]] += rewards[rows, k - 1].to(out.device)
    return out


def grpo(
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: torch.Tensor | Sequence[Hashable],
    *,
    eps: float = 1e-6,
    norm_by_std: bool = True,
    turns: TurnRewards | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage (Shao et al. 2024, DeepSeekMath): A_i = (r_i - mean_g) / (std_g + eps).

    mean and std (unbiased) are over the group g of samples answering the same prompt, and A_i is
    given to every response token of sample i. Groups of one sample, and groups whose rewards are
    all equal, get advantage 0. Returns (advantages, returns), both (batch, seq_len); the returns
    of an outcome estimator are the advantages. With per-turn rewards (`turns`), each turn's tokens
    also get `turn_advantages` (normalised per turn position as the outcome is, with `norm_by_std`).
    """
    scores = _sequence_scores(rewards)
    gid = _group_index(index, scores.shape[0], scores.device)
    counts, mean, std = _group_stats(scores, gid)
    adv = scores - mean
    if norm_by_std:
        adv = adv / (std + eps)
    adv = torch.where(counts > 1, adv, torch.zeros_like(adv))
    if turns is None:
        return _broadcast(adv, response_mask)
    out = (adv.unsqueeze(-1) + turn_advantages(turns, index, norm_by_std=norm_by_std, eps=eps))
    out = out * response_mask.to(out.dtype)
    return out, out


def dr_grpo(
    rewards: torch.Tensor, response_mask: torch.Tensor, index: torch.Tensor | Sequence[Hashable], *,
    turns: TurnRewards | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr. GRPO advantage (Liu et al. 2025, "Understanding R1-Zero-Like Training"): A_i = r_i - mean_g.

    GRPO without the std division, which over-weights groups of nearly equal rewards. Pair it with
    `seq-mean-token-sum-norm` aggregation to also remove the length bias. Per-turn rewards (`turns`) are
    centred per turn position the same way (`turn_advantages`).
    """
    return grpo(rewards, response_mask, index, norm_by_std=False, turns=turns)


def rloo(
    rewards: torch.Tensor, response_mask: torch.Tensor, index: torch.Tensor | Sequence[Hashable], *,
    turns: TurnRewards | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024): A_i = r_i - mean_{j≠i} r_j.

    Over a group of n samples this equals n/(n-1)·(r_i - mean_g). Groups of one sample get 0. Per-turn
    rewards (`turns`) get a leave-one-out baseline per turn position (`turn_advantages`).
    """
    scores = _sequence_scores(rewards)
    gid = _group_index(index, scores.shape[0], scores.device)
    counts, mean, _ = _group_stats(scores, gid)
    adv = (scores - mean) * counts / (counts - 1).clamp(min=1.0)
    adv = torch.where(counts > 1, adv, torch.zeros_like(adv))
    if turns is None:
        return _broadcast(adv, response_mask)
    out = (adv.unsqueeze(-1) + turn_advantages(turns, index, leave_one_out=True)) * response_mask.to(adv.dtype)
    return out, out


def _discounted_returns(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float
) -> torch.Tensor:
    """G_t = r_t + γ·G_next over response tokens, right to left, skipping masked positions.

    Skipping (rather than resetting at) masked tokens keeps a multi-turn trajectory one chain: the
    final reward flows back through the tool-result tokens into earlier assistant turns.
    """
    mask = response_mask.to(token_rewards.dtype)
    returns = torch.zeros_like(token_rewards)
    running = token_rewards.new_zeros(token_rewards.shape[0])
    for t in reversed(range(token_rewards.shape[1])):
        m = mask[:, t]
        candidate = token_rewards[:, t] + gamma * running
        running = m * candidate + (1 - m) * running
        returns[:, t] = running
    return returns * mask


def reinforce_pp(
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: torch.Tensor | Sequence[Hashable] | None = None,
    *,
    gamma: float = 1.0,
    divide_std: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): discounted returns G_t = Σ_{k≥t} γ^{k-t} r_k, whitened over the batch.

    A_t = (G_t - mean_batch) / std_batch over all response tokens of the batch (`divide_std=False`
    only subtracts the mean). `index` is accepted for a uniform signature and ignored. Given 1D
    scores, the score is placed on each sequence's last response token. Returns (advantages, returns).
    """
    token_rewards = _token_rewards(rewards, response_mask)
    returns = _discounted_returns(token_rewards, response_mask, gamma)
    return masked_whiten(returns, response_mask, divide_std=divide_std), returns


def _token_rewards(rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    if rewards.dim() == 2:
        return rewards if rewards.is_floating_point() else rewards.float()
    scores = _sequence_scores(rewards)
    mask = response_mask.long()
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, positions, torch.full_like(positions, -1)).max(-1).values
    out = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
    has = last >= 0
    out[has.nonzero().squeeze(-1), last[has]] = scores[has]
    return out


def reinforce_pp_baseline(
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: torch.Tensor | Sequence[Hashable],
    *,
    divide_std: bool = True,
    eps: float = 1e-8,
    turns: TurnRewards | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (Hu 2025): A_i = (r_i - mean_g) / std_batch.

    The group mean is the baseline; the result is then divided by the std over all response tokens
    of the batch. It is not re-centred: the group baseline already centres each group, and
    re-centring on the token-weighted batch mean would give equal-reward groups a non-zero
    advantage. Groups of one sample and equal-reward groups get 0. Per-turn rewards (`turns`) are centred
    per turn position (`turn_advantages`) and added before the division.
    """
    centred, _ = dr_grpo(rewards, response_mask, index, turns=turns)
    if not divide_std:
        return centred, centred
    adv = masked_whiten(centred, response_mask, shift_mean=False, eps=eps)
    return adv, adv


def gae(
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: torch.Tensor | Sequence[Hashable] | None = None,
    *,
    values: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over response tokens.

    δ_t = r_t + γ·V_{t+1} - V_t and A_t = δ_t + γλ·A_{t+1}, right to left over the response tokens
    (masked positions are skipped, so the next value of an assistant turn's last token is the value
    at the next turn's first token, and the last response token bootstraps from 0). Returns
    R_t = A_t + V_t are the critic targets; advantages are whitened over the batch if `whiten`.
    `index` is ignored. Returns (advantages, returns).
    """
    if values.shape != response_mask.shape:
        raise ValueError(
            f"values {tuple(values.shape)} must match response_mask {tuple(response_mask.shape)}."
        )
    token_rewards = _token_rewards(rewards, response_mask)
    mask = response_mask.to(token_rewards.dtype)
    values = values.detach().to(token_rewards.dtype)
    adv = torch.zeros_like(token_rewards)
    next_value = token_rewards.new_zeros(token_rewards.shape[0])
    running = token_rewards.new_zeros(token_rewards.shape[0])
    for t in reversed(range(token_rewards.shape[1])):
        m = mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        candidate = delta + gamma * lam * running
        running = m * candidate + (1 - m) * running
        next_value = m * values[:, t] + (1 - m) * next_value
        adv[:, t] = running
    adv = adv * mask
    returns = (adv + values) * mask
    if whiten:
        adv = masked_whiten(adv, mask)
    return adv, returns


# ── policy losses ───────────────────────────────────────────────────────────────────────────────
def ppo_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    clip_c: float | None = None,
    loss_agg_mode: str = "token-mean",
    max_len: int | None = None,
    is_weights: torch.Tensor | None = None,
    segment_ids: torch.Tensor | None = None,
    denominator: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017) with clip-higher and dual clip.

    ρ_t = exp(logπ_t - logπ_old,t);  l_t = max(-A_t·ρ_t, -A_t·clip(ρ_t, 1-ε_low, 1+ε_high)).
    Clip-higher (DAPO, Yu et al. 2025) sets ε_high > ε_low (default ε_high = ε_low) so that
    low-probability tokens with A > 0 can grow further. Dual clip (Ye et al. 2020) bounds the loss
    of tokens with A < 0 by -A·c (c > 1): l_t = min(l_t, -A_t·c), so a huge ratio on a bad token
    cannot blow the update up. `is_weights` (from `rollout_correction`) multiply l_t.
    `loss_agg_mode`, `max_len`, `segment_ids` and `denominator` go to `aggregate_loss`.

    Metrics: `pg_clipfrac` (tokens where the clip is active), `pg_clipfrac_lower` (where the dual
    clip is active), `ppo_kl` (mean of logπ_old - logπ, the k1 estimate of KL(old‖new)).
    """
    if clip_high is None:
        clip_high = clip_low
    if clip_c is not None and clip_c <= 1.0:
        raise ValueError(
            f"dual-clip constant clip_c must be > 1.0, got {clip_c}; or pass None to disable it."
        )
    log_ratio = (log_prob - old_log_prob).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_mat = torch.maximum(loss_unclipped, loss_clipped)
    clipfrac = masked_mean((loss_clipped > loss_unclipped).float(), response_mask)
    dual_active = torch.zeros_like(loss_mat, dtype=torch.bool)
    if clip_c is not None:
        bound = -advantages * clip_c
        dual_active = (advantages < 0) & (loss_mat > bound)
        loss_mat = torch.where(dual_active, bound, loss_mat)
    if is_weights is not None:
        loss_mat = loss_mat * is_weights.detach()
    loss = aggregate_loss(
        loss_mat,
        response_mask,
        loss_agg_mode,
        max_len=max_len,
        segment_ids=segment_ids,
        denominator=denominator,
    )
    metrics = {
        "pg_loss": loss.detach(),
        "pg_clipfrac": clipfrac.detach(),
        "pg_clipfrac_lower": masked_mean(dual_active.float(), response_mask).detach(),
        "ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
    }
    return loss, metrics


def gspo_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    loss_agg_mode: str = "seq-mean-token-mean",
    max_len: int | None = None,
    segment_ids: torch.Tensor | None = None,
    denominator: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): clip a sequence-level ratio.

    s_i = exp((1/|y_i|)·Σ_t (logπ_t - logπ_old,t)), the length-normalised (geometric-mean) ratio.
    The token form s_it = sg[s_i]·π_t / sg[π_t] has the value of s_i and the gradient of
    s_i·∇logπ_t, so with `seq-mean-token-mean` aggregation the gradient is exactly GSPO's, while
    per-token advantages stay possible (GSPO-token). The clip ranges are small (3e-4, 4e-4 in the
    paper) because s_i is a geometric mean. Metrics as in `ppo_policy_loss`.
    """
    diff = log_prob - old_log_prob
    seq_log_ratio = _sequence_mean_per_token(diff.detach(), response_mask, segment_ids)
    log_ratio = (log_prob - log_prob.detach() + seq_log_ratio).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_mat = torch.maximum(loss_unclipped, loss_clipped)
    loss = aggregate_loss(
        loss_mat,
        response_mask,
        loss_agg_mode,
        max_len=max_len,
        segment_ids=segment_ids,
        denominator=denominator,
    )
    metrics = {
        "pg_loss": loss.detach(),
        "pg_clipfrac": masked_mean((loss_clipped > loss_unclipped).float(), response_mask).detach(),
        "ppo_kl": masked_mean(-diff.detach(), response_mask),
    }
    return loss, metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_range: float = 0.2,
    loss_agg_mode: str = "token-mean",
    max_len: int | None = None,
    segment_ids: torch.Tensor | None = None,
    denominator: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped critic loss (PPO as in OpenAI baselines): ½·max((V - R)², (V_clip - R)²).

    V_clip = V_old + clip(V - V_old, -ε, ε) keeps the critic near the values the advantages were
    computed with. Metric `vf_clipfrac`: tokens where the clipped term is the larger one.
    """
    clipped = old_values + (values - old_values).clamp(-clip_range, clip_range)
    err_unclipped = (values - returns) ** 2
    err_clipped = (clipped - returns) ** 2
    loss_mat = 0.5 * torch.maximum(err_unclipped, err_clipped)
    loss = aggregate_loss(
        loss_mat,
        response_mask,
        loss_agg_mode,
        max_len=max_len,
        segment_ids=segment_ids,
        denominator=denominator,
    )
    metrics = {
        "vf_loss": loss.detach(),
        "vf_clipfrac": masked_mean((err_clipped > err_unclipped).float(), response_mask).detach(),
    }
    return loss, metrics


# ── KL ──────────────────────────────────────────────────────────────────────────────────────────
def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(π‖π_ref) from samples of π (Schulman 2020, "Approximating KL").

    With x = logπ_ref - logπ (so r = π_ref/π = eˣ):
    - `k1` = -x: unbiased, high variance, can be negative;
    - `k2` = ½·x²: biased, low variance, its gradient is the true KL gradient for small steps;
    - `k3` = (eˣ - 1) - x: unbiased, low variance, always ≥ 0 (GRPO's KL term).
    """
    x = (ref_log_prob - log_prob).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    if kind == "k1":
        return -x
    if kind == "k2":
        return 0.5 * x * x
    if kind == "k3":
        return torch.expm1(x) - x
    raise ValueError(f"Unknown KL estimator '{kind}'; use one of {', '.join(KL_ESTIMATORS)}.")


def apply_kl_penalty(
    token_rewards: torch.Tensor,
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    kl_coef: float,
    kind: str = "k1",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL in the reward (Ziegler et al. 2019; InstructGPT): r'_t = r_t - β·KL_t on response tokens.

    Returns the new token rewards and `kl` (the batch mean of the per-sequence token-mean KL, to
    feed an `AdaptiveKLController`) and `kl_coef`.
    """
    kl = kl_penalty(log_prob, ref_log_prob, kind) * response_mask.to(log_prob.dtype)
    new_rewards = token_rewards - kl_coef * kl
    per_seq = masked_mean(kl, response_mask, dim=-1)
    has = (response_mask.sum(-1) > 0).to(kl.dtype)
    current = (per_seq * has).sum() / has.sum().clamp(min=1.0)
    return new_rewards, {"kl": current.detach(), "kl_coef": torch.tensor(float(kl_coef))}


def kl_loss(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    kind: str = "k3",
    loss_agg_mode: str = "token-mean",
    max_len: int | None = None,
    segment_ids: torch.Tensor | None = None,
    denominator: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """KL in the loss (GRPO, Shao et al. 2024): aggregate(KL_t), to be added as β·kl_loss."""
    kl = kl_penalty(log_prob, ref_log_prob, kind)
    return aggregate_loss(
        kl, response_mask, loss_agg_mode, max_len=max_len, segment_ids=segment_ids, denominator=denominator
    )


class FixedKLController:
    """A KL coefficient that never changes."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Does nothing; here so both controllers are used the same way."""


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, "Fine-Tuning LMs from Human Preferences").

    e = clip(KL/KL_target - 1, -0.2, 0.2);  β ← β·(1 + e·n_steps/horizon). β rises while the
    policy drifts further than the target from the reference, and decays while it stays closer.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"target_kl and horizon must be > 0, got {target_kl} and {horizon}.")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Adjust β after `n_steps` samples (or steps) that had mean KL `current_kl`."""
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


# ── rollout / trainer mismatch correction ───────────────────────────────────────────────────────
def rollout_correction(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    mode: str = "tis",
    low: float = 0.5,
    high: float = 2.0,
    segment_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Importance weights for the gap between the inference engine and the trainer.

    With ρ_t = π_train(y_t)/π_rollout(y_t) = exp(old_log_prob - rollout_log_prob):
    - `tis` (truncated IS, Yao et al. 2025 "Your efficient RL framework secretly brings you
      off-policy RL"): w_t = min(ρ_t, high); the mask is unchanged.
    - `icepop` (Ling Team 2025, IcePop): tokens with ρ_t outside [low, high] are masked out,
      the rest keep w_t = ρ_t.
    - `seq-mask-tis`: sequences whose geometric-mean ratio exp(mean_t log ρ_t) lies outside
      [low, high] are masked out whole; the others get w_t = min(ρ_t, high).

    Sequences are the rows, or the `segment_ids` of a packed batch. Returns (weights, new_mask,
    metrics), weights detached. Metrics over the original mask:
    `is_ratio_mean/min/max`, `is_ess` (normalised effective sample size (Σρ)²/(n·Σρ²), 1 when
    the engines agree), `rollout_kl_k3` (k3 estimate of KL(π_rollout‖π_train)) and
    `masked_fraction` (share of tokens the correction removed).
    """
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"Unknown rollout correction '{mode}'; use one of {', '.join(ROLLOUT_CORRECTIONS)}.")
    if not 0 <= low <= 1 <= high:
        raise ValueError(f"rollout correction bounds need 0 <= low <= 1 <= high, got low={low}, high={high}.")
    mask = response_mask.to(old_log_prob.dtype)
    log_ratio = (old_log_prob - rollout_log_prob).detach().clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    if mode == "tis":
        weights, new_mask = ratio.clamp(max=high), mask
    elif mode == "icepop":
        inside = ((ratio >= low) & (ratio <= high)).to(mask.dtype)
        new_mask = mask * inside
        weights = ratio * inside
    else:
        seq_log = _sequence_mean_per_token(log_ratio, mask, segment_ids)
        keep = seq_log <= math.log(high)
        if low > 0:
            keep = keep & (seq_log >= math.log(low))
        new_mask = mask * keep.to(mask.dtype)
        weights = ratio.clamp(max=high) * new_mask
    weights = weights * new_mask
    n = mask.sum()
    big, small = torch.finfo(ratio.dtype).max, torch.finfo(ratio.dtype).min
    has = n > 0
    if ratio.numel() == 0:
        ratio, mask = ratio.new_zeros(1), mask.new_zeros(1)
    zero = ratio.new_zeros(())
    sum_r = masked_sum(ratio, mask)
    sum_r2 = masked_sum(ratio * ratio, mask)
    metrics = {
        "is_ratio_mean": masked_mean(ratio, mask),
        "is_ratio_min": torch.where(has, torch.where(mask > 0, ratio, ratio.new_full((), big)).min(), zero),
        "is_ratio_max": torch.where(has, torch.where(mask > 0, ratio, ratio.new_full((), small)).max(), zero),
        "is_ess": torch.where(has, sum_r * sum_r / (n * sum_r2).clamp(min=1e-30), zero),
        "rollout_kl_k3": masked_mean(torch.expm1(log_ratio) - log_ratio, mask),
        "masked_fraction": (mask.sum() - new_mask.sum()) / n.clamp(min=1.0),
    }
    return weights, new_mask, metrics


# ── reward shaping and filtering ────────────────────────────────────────────────────────────────
def overlong_penalty(
    response_lengths: torch.Tensor,
    *,
    max_response_length: int,
    buffer_length: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025), one value per sequence, ≤ 0.

    With L_max the max response length and L_cache the buffer:
    0 if |y| ≤ L_max - L_cache;  ((L_max - L_cache) - |y|)/L_cache · f inside the buffer;
    -f if |y| > L_max. Add it to the task reward.
    """
    if not 0 < buffer_length <= max_response_length:
        raise ValueError(
            f"buffer_length must be in (0, max_response_length={max_response_length}], got {buffer_length}."
        )
    lengths = response_lengths.to(torch.float32)
    start = float(max_response_length - buffer_length)
    penalty = (start - lengths) / buffer_length * penalty_factor
    penalty = torch.where(lengths <= start, torch.zeros_like(penalty), penalty)
    return torch.where(lengths > max_response_length, torch.full_like(penalty, -penalty_factor), penalty)


def stop_properly_penalty(scores: torch.Tensor, stopped: torch.Tensor, *, coef: float = 0.0) -> torch.Tensor:
    """Penalise responses that did not stop on their own (truncated at the length limit).

    For a truncated sample the score becomes coef·score when 0 ≤ coef ≤ 1 (0 zeroes it), or the
    constant coef when coef < 0; samples that stopped properly keep their score.
    """
    if coef > 1:
        raise ValueError(
            f"stop_properly_penalty coef must be <= 1 (a scale in [0, 1] or a negative reward), got {coef}."
        )
    truncated_score = scores * coef if coef >= 0 else torch.full_like(scores, coef)
    return torch.where(stopped.bool(), scores, truncated_score)


def dynamic_group_filter(scores: torch.Tensor, index: torch.Tensor | Sequence[Hashable]) -> torch.Tensor:
    """DAPO dynamic sampling (Yu et al. 2025): keep only groups whose rewards are not all equal.

    A group with equal rewards (all solved, all failed, or a single sample) has zero advantage
    under every group-relative estimator and only dilutes the batch. Returns the indices of the
    kept samples, in their original order (a LongTensor, possibly empty).
    """
    scores = _sequence_scores(scores).float()
    gid = _group_index(index, scores.shape[0], scores.device)
    if gid.numel() == 0:
        return torch.zeros(0, dtype=torch.long, device=scores.device)
    n_groups = int(gid.max().item()) + 1
    hi = scores.new_full((n_groups,), -math.inf).scatter_reduce(0, gid, scores, "amax")
    lo = scores.new_full((n_groups,), math.inf).scatter_reduce(0, gid, scores, "amin")
    varied = hi > lo
    return varied[gid].nonzero().squeeze(-1)
