"""Sampling from the run's config, decided once: the request's `SamplingParams` and the kept-set rule.

Two sides apply the rollout's sampling settings (`rollout.temperature`, `top_p`, `top_k`, `min_p`,
`max_kept_set`): the sampler (the AgentLoop, the gateway, the checks that probe a server) asks an
engine for tokens with them, and the trainer scores each sampled token over the same kept set. Both
read them here, so a new sampling field reaches every request and the trainer in one edit:

    sampling_params(rollout, max_tokens=..., stop_token_ids=..., seed=...)   what a server is asked
    kept_set_rule(rollout)                                                   what the trainer replays

`KeptSetRule` is the rule's data (which truncations apply); the tensor maths that applies it, on the
engine's logits and the trainer's alike, is `agentrl.kept_set`, imported only where torch is. This
module imports neither torch nor anything that serves or trains (layer L0, DESIGN.md §2).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agentrl.config import RolloutConfig
from agentrl.types import SamplingParams

__all__ = ["KeptSetRule", "kept_set_rule", "sampling_params"]


@dataclass(frozen=True, slots=True)
class KeptSetRule:
    """The truncation settings of a rollout (`rollout.top_k`, `top_p`, `min_p`): what the trainer
    needs to compute its own kept set of each token (`agentrl.kept_set.kept_mask`)."""

    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    @property
    def truncates(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


def sampling_params(
    rollout: RolloutConfig, *, max_tokens: int, stop_token_ids: Sequence[int] = (), seed: int | None = None,
    whole_vocabulary: bool = False,
) -> SamplingParams:  # fmt: skip
    """The `SamplingParams` of one request sampled under the run's `rollout` section: its
    temperature, truncation (`top_p`, `top_k`, `min_p`) and kept-set cap (`max_kept_set`), with the
    request's own `max_tokens`, `stop_token_ids` and `seed`.

    `whole_vocabulary` turns the truncation off (top_p 1, top_k and min_p off) for a probe whose
    logprob is compared with one computed over the whole vocabulary; the temperature stays the run's.
    """
    truncated = not whole_vocabulary
    return SamplingParams(
        temperature=rollout.temperature,
        top_p=rollout.top_p if truncated else 1.0,
        top_k=rollout.top_k if truncated else 0,
        min_p=rollout.min_p if truncated else 0.0,
        max_kept_set=rollout.max_kept_set,
        max_tokens=max_tokens,
        stop_token_ids=tuple(stop_token_ids),
        seed=seed,
    )


def kept_set_rule(rollout: RolloutConfig) -> KeptSetRule | None:
    """The `KeptSetRule` the trainer replays for a run's `rollout` section: the truncation of the
    requests `sampling_params` builds from it. None when they keep the whole vocabulary, or are
    greedy (temperature 0: the trainer cannot score it, so nothing is replayed)."""
    sampling = sampling_params(rollout, max_tokens=1)
    if not sampling.truncates:
        return None
    return KeptSetRule(top_k=max(sampling.top_k, 0), top_p=sampling.top_p, min_p=sampling.min_p)
