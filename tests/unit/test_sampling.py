"""Sampling from the run's config: every sampling field of `rollout` reaches the request and the trainer's rule."""

from __future__ import annotations

import dataclasses

import pytest

from agentrl.config import RolloutConfig
from agentrl.sampling import KeptSetRule, kept_set_rule, sampling_params
from agentrl.types import SamplingParams

REQUEST_FIELDS = {"max_tokens", "stop_token_ids", "seed"}
"""What each request sets for itself (`sampling_params`' keyword arguments)."""
NOT_FROM_THE_CONFIG = {"stop", "logprobs"}
"""Fields no config sets: text stops are not sent to servers, and the loop always wants logprobs."""
# Every sampling setting the config holds, with a value unlike its default.
EVERY_FIELD_SET = {"temperature": 0.7, "top_p": 0.85, "top_k": 17, "min_p": 0.03, "max_kept_set": 40}


def _config_fields() -> set[str]:
    """The `SamplingParams` fields that `RolloutConfig` holds too: the ones a request takes from the config."""
    return {f.name for f in dataclasses.fields(SamplingParams)} & set(RolloutConfig.model_fields)


def test_every_sampling_field_is_from_the_config_or_the_request() -> None:
    # A new SamplingParams field must be one or the other, so it cannot be forgotten by the builder.
    assert _config_fields() == set(EVERY_FIELD_SET)
    assert {f.name for f in dataclasses.fields(SamplingParams)} == set(EVERY_FIELD_SET) | REQUEST_FIELDS | NOT_FROM_THE_CONFIG


def test_every_config_sampling_field_arrives_in_the_request() -> None:
    rollout = RolloutConfig(**EVERY_FIELD_SET)
    defaults = RolloutConfig()
    assert all(getattr(rollout, name) != getattr(defaults, name) for name in _config_fields())

    sampling = sampling_params(rollout, max_tokens=9, stop_token_ids=[5, 6], seed=11)

    assert {name: getattr(sampling, name) for name in _config_fields()} == EVERY_FIELD_SET
    assert (sampling.max_tokens, sampling.stop_token_ids, sampling.seed) == (9, (5, 6), 11)
    assert sampling.truncates


def test_request_defaults_stop_at_the_models_eos_with_no_seed() -> None:
    sampling = sampling_params(RolloutConfig(), max_tokens=4)
    assert (sampling.stop_token_ids, sampling.seed, sampling.top_k) == ((), None, 0)
    assert not sampling.truncates


def test_a_whole_vocabulary_probe_keeps_the_temperature_and_drops_only_the_truncation() -> None:
    probe = sampling_params(RolloutConfig(**EVERY_FIELD_SET), max_tokens=1, seed=3, whole_vocabulary=True)
    assert (probe.top_p, probe.top_k, probe.min_p) == (1.0, 0, 0.0)
    assert (probe.temperature, probe.max_kept_set, probe.max_tokens, probe.seed) == (0.7, 40, 1, 3)
    assert not probe.truncates


@pytest.mark.parametrize(
    ("settings", "rule"),
    [
        ({}, None),
        ({"top_p": 0.9}, KeptSetRule(top_p=0.9)),
        ({"top_k": 20, "min_p": 0.05}, KeptSetRule(top_k=20, min_p=0.05)),
        ({"top_k": 20, "top_p": 0.8, "min_p": 0.1}, KeptSetRule(top_k=20, top_p=0.8, min_p=0.1)),
        ({"temperature": 0.0, "top_k": 20}, None),  # greedy: the trainer cannot score it, nothing replayed
    ],
)
def test_the_trainers_rule_is_the_truncation_of_the_requests(settings: dict[str, float], rule: KeptSetRule | None) -> None:
    rollout = RolloutConfig(**settings)
    assert kept_set_rule(rollout) == rule
    sampling = sampling_params(rollout, max_tokens=1)
    assert sampling.truncates == (rule is not None)
    if rule is not None:
        assert (rule.top_k, rule.top_p, rule.min_p) == (sampling.top_k, sampling.top_p, sampling.min_p)
        assert rule.truncates
