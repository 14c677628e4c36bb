"""The run's reward from its configured sources: a rule function, an LLM judge, a reward model, combined.

`build_reward(config.reward)` is what the envs get as `reward_fn`: the plain `RewardFunction`
(`reward.function`, verl's signature) when the rule is the only source, as before; else a
`CombinedReward`, the weighted sum of `reward.combine`'s parts (`rule`, `judge`: `JudgeReward`,
`model`: `RewardModelScorer`), scored concurrently. `ascore_row(reward_fn, row, answer)` is how an
env scores with either: it awaits the sources and returns a `RewardResult` whose `record` (what
each part scored, and for a judge what it was asked and answered) the env keeps in the trajectory's
`info["reward"]`.

A reward is a value or missing with a cause: any part that cannot score raises
`RewardMissingError` (`infra`: a rule function that raised or returned no finite score, a judge or
reward model that is down; `timeout`; `parse`: an unreadable verdict; `truncated`), and then the
whole reward is missing with the first missing part's cause (in `reward.combine`'s order), its
record holding every part's outcome. The AgentLoop masks such an episode like an infrastructure
failure (the run stops past `run.max_infra_failure_rate`) and never trains on it as 0.

The processes a reward needs, a judge server the run serves (`reward.judge.model_path`) and a
reward-model process, are made by `judge_server_for` and `reward_model_for` for their owner, the
job (two rows of its resource table), which passes them to `build_reward` and closes them. A reward
built without them (alone, or unpickled in another process) makes its own, which `stop` ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from agentrl.config import RewardConfig
from agentrl.envs.judge import JudgeReward, judge_server_of
from agentrl.envs.judge_server import JudgeServer
from agentrl.envs.reward_model import RewardModelScorer
from agentrl.envs.rewards import RewardFn, RewardFunction, RewardResult, score_row
from agentrl.errors import EnvError, RewardMissingError

__all__ = ["CombinedReward", "ascore_row", "build_reward", "judge_server_for", "reward_model_for"]


class CombinedReward:
    """The weighted sum of `reward.combine`'s sources (see the module docstring).

    Called synchronously with verl's signature it scores only when every part is the rule (an env
    that scores asynchronously uses `ascore_row`). Pickles as its config.

    `judge_server`, `reward_model`: the processes its owner made for it (`judge_server_for`,
    `reward_model_for`) and closes; without them it makes its own, which `stop` ends.
    """

    def __init__(self, config: RewardConfig, *, judge_server: JudgeServer | None = None,
                 reward_model: RewardModelScorer | None = None) -> None:
        self.config = config
        self.rule: RewardFunction | None = None
        self.parts: list[tuple[str, float, Any]] = []
        self._own_models: list[RewardModelScorer] = []
        for part in _parts(config):
            if part.source == "rule":
                self.rule = RewardFunction(config.function, config.kwargs)
                scorer: Any = self.rule
            elif part.source == "judge":
                assert config.judge is not None  # RewardConfig's validator refuses a combine naming an unset judge
                scorer = JudgeReward(config.judge, server=judge_server)
            else:
                assert config.model is not None  # likewise for the reward model
                if reward_model is None:
                    reward_model = RewardModelScorer(config.model)
                    self._own_models.append(reward_model)
                scorer = reward_model
            self.parts.append((part.source, float(part.weight), scorer))
        self.name = " + ".join(f"{w:g}*{s}" for s, w, _ in self.parts)

    def __reduce__(self) -> tuple[Any, ...]:
        return (CombinedReward, (self.config,))

    def stop(self) -> None:
        """Stop what the parts made for themselves: a judge server the run serves, a reward-model
        process (both also die with the process). What its owner gave it is the owner's to close."""
        for _, _, scorer in self.parts:
            if isinstance(scorer, JudgeReward):
                scorer.stop()
        for model in self._own_models:
            model.close()

    def __repr__(self) -> str:
        return f"CombinedReward({self.name})"

    def __call__(self, data_source: str | None, solution_str: str, ground_truth: Any, extra_info: Any = None) -> Any:
        if any(source != "rule" for source, _, _ in self.parts):
            raise NotImplementedError(
                f"the reward {self.name} has a judge or reward model, which score asynchronously, and this env "
                "scores synchronously; use an env that scores with agentrl.envs.reward_sources.ascore_row "
                "(retool, arithmetic) or only reward.function"
            )
        assert self.rule is not None  # every part is the rule
        return self.rule(data_source, solution_str, ground_truth, extra_info)

    async def ascore(self, row: Mapping[str, Any], answer: str, default_data_source: str | None) -> RewardResult:
        """Every part's score, concurrently; their weighted sum, or `RewardMissingError`."""
        outcomes = await asyncio.gather(
            *(_score_part(source, scorer, row, answer, default_data_source) for source, _, scorer in self.parts),
            return_exceptions=True,
        )
        record: dict[str, Any] = {"parts": {}}
        total = 0.0
        extra: dict[str, Any] = {}
        missing: RewardMissingError | None = None
        for (source, weight, _), outcome in zip(self.parts, outcomes, strict=True):
            if isinstance(outcome, RewardMissingError):
                record["parts"][source] = {"weight": weight, "missing": outcome.cause, "error": outcome.detail,
                                           **outcome.record}
                missing = missing or outcome
                continue
            if isinstance(outcome, BaseException):
                raise outcome
            score, part_record, part_extra = outcome
            record["parts"][source] = {"weight": weight, "score": score, **part_record}
            total += weight * score
            extra.update(part_extra)
            if source != "rule":
                extra[f"{source}_score"] = score
        if missing is not None:
            raise RewardMissingError(missing.cause, missing.detail, record)
        record["score"] = total
        return RewardResult(total, extra, record)


def _parts(config: RewardConfig) -> list[Any]:
    """The sources `config` combines: `reward.combine`, else its one source."""
    from agentrl.config import RewardPartConfig

    if config.combine:
        return list(config.combine)
    source = "judge" if config.judge is not None else "model" if config.model is not None else "rule"
    return [RewardPartConfig(source=source, weight=1.0)]


def _combines(config: RewardConfig) -> bool:
    return bool(config.combine) or config.judge is not None or config.model is not None


def judge_server_for(config: RewardConfig) -> JudgeServer | None:
    """The judge server the reward `config` describes needs (a judge part with `reward.judge.model_path`),
    made, not started (it starts on the first judge request); None when it needs none."""
    if config.judge is None or all(p.source != "judge" for p in _parts(config)):
        return None
    return judge_server_of(config.judge)


def reward_model_for(config: RewardConfig) -> RewardModelScorer | None:
    """The reward-model process the reward `config` describes needs (a `model` part), made, not started
    (it starts on the first score); None when it needs none."""
    if config.model is None or all(p.source != "model" for p in _parts(config)):
        return None
    return RewardModelScorer(config.model)


async def _score_part(source: str, scorer: Any, row: Mapping[str, Any], answer: str,
                      default_data_source: str | None) -> tuple[float, dict[str, Any], dict[str, Any]]:
    if source == "rule":
        result = _rule_result(scorer, row, answer, default_data_source)
        return result.score, {}, result.extra
    score, record = await scorer.ascore(row, answer)
    return float(score), record, {}


def _rule_result(reward_fn: RewardFn, row: Mapping[str, Any], answer: str,
                 default_data_source: str | None) -> RewardResult:
    try:
        return score_row(reward_fn, row, answer, default_data_source=default_data_source)
    except (RewardMissingError, EnvError):
        raise  # EnvError: the row has no ground truth, the dataset's fault (raised as is, as before)
    except Exception as exc:  # a rule that cannot score: the reward is missing, never 0
        name = getattr(reward_fn, "name", None) or repr(reward_fn)
        raise RewardMissingError("infra", f"the reward function {name} raised {type(exc).__name__}: {exc}") from exc


async def ascore_row(reward_fn: RewardFn, row: Mapping[str, Any], answer: str, *,
                     default_data_source: str | None = None) -> RewardResult:
    """Score `answer` to `row` with the run's `reward_fn` (a `CombinedReward`, or any function with
    verl's signature); raises `RewardMissingError` when the reward cannot be measured."""
    if isinstance(reward_fn, CombinedReward):
        return await reward_fn.ascore(row, answer, default_data_source)
    return _rule_result(reward_fn, row, answer, default_data_source)


def build_reward(config: RewardConfig, *, judge_server: JudgeServer | None = None,
                 reward_model: RewardModelScorer | None = None) -> RewardFunction | CombinedReward:
    """The reward `config` describes (see the module docstring); raises ConfigError on a bad part.
    `judge_server`, `reward_model`: the processes its owner made for it (`judge_server_for`,
    `reward_model_for`) and closes."""
    if not _combines(config):
        return RewardFunction(config.function, config.kwargs)
    return CombinedReward(config, judge_server=judge_server, reward_model=reward_model)
