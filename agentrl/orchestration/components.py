"""Build the pieces a job needs from its config: rows, the env factory, the chat template, the loop.

Shared by `agentrl eval` and the training driver so both read the config the same way. Nothing
here starts processes; `agentrl.inference.serve` does that.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

from agentrl.chat import ChatTemplate
from agentrl.config import AgentRLConfig
from agentrl.datasets import LoadedRows, check_row, load_rows
from agentrl.envs import Env, make_env
from agentrl.envs.rewards import RewardFn, RewardFunction
from agentrl.errors import ConfigError, DatasetError
from agentrl.models import TOOL_CHATML_TEMPLATE, resolve_model_path
from agentrl.registry import ENVS, TOOL_PARSERS
from agentrl.rollout import AgentLoop, AgentLoopConfig, GenerateClient
from agentrl.rollout.agent_loop import end_of_turn_ids

__all__ = ["build_agent_loop", "build_chat_template", "build_reward_fn", "env_factory", "load_split",
           "load_split_rows"]

log = logging.getLogger("agentrl.data")

_BUILTIN_TEMPLATES = {"chatml-tools": TOOL_CHATML_TEMPLATE}


def build_reward_fn(config: AgentRLConfig) -> RewardFunction:
    """The run's reward function from `reward.function` and `reward.kwargs` (ConfigError when broken)."""
    return RewardFunction(config.reward.function, config.reward.kwargs)


def _takes(env_cls: Any, name: str) -> bool:
    try:
        return name in inspect.signature(env_cls).parameters
    except (TypeError, ValueError):
        return False


def env_factory(config: AgentRLConfig, *, reward_fn: RewardFn | None = None) -> Callable[[], Env]:
    """A zero-argument constructor of the configured env (checked once, here).

    An env whose constructor takes `reward_fn` gets the run's reward function (`reward_fn`, else
    built from `reward.function`); naming a reward function for an env that takes none is an error.
    """
    kwargs = dict(config.env.kwargs)
    env_cls = ENVS.resolve(config.env.name)
    if _takes(env_cls, "reward_fn"):
        if "reward_fn" in kwargs:
            raise ConfigError("env.kwargs.reward_fn: name the reward function with reward.function=module:fn instead.")
        kwargs["reward_fn"] = reward_fn if reward_fn is not None else build_reward_fn(config)
    elif config.reward.function is not None or config.reward.kwargs:
        raise ConfigError(
            f"reward.function is set, but env '{config.env.name}' scores its episodes itself (its constructor "
            "takes no reward_fn); remove reward.function and reward.kwargs."
        )
    make_env(config.env.name, **kwargs)  # fail now, in the config's words (nothing to close yet)
    return functools.partial(make_env, config.env.name, **kwargs)


def load_split(config: AgentRLConfig, split: str) -> LoadedRows:
    """Rows for `split` ("train" or "test"), numbered: the configured files, else the env's own dataset.

    Rows must carry `reward_model.ground_truth` unless the env declares `requires_ground_truth =
    False`. Rows skipped under `data.skip_bad_rows` are logged here, one line each.
    """
    files = config.data.train_files if split == "train" else config.data.val_files
    env_cls = ENVS.resolve(config.env.name)
    require_truth = bool(getattr(env_cls, "requires_ground_truth", True))
    if files:
        loaded = load_rows(files, skip_bad_rows=config.data.skip_bad_rows, require_ground_truth=require_truth)
        for bad in loaded.skipped:
            log.warning("data.skip_bad_rows: skipping %s row %d (dataset row %d): %s",
                        bad.file, bad.row, bad.index, bad.reason)
        return loaded
    rows_of = getattr(env_cls, "dataset_rows", None)
    if rows_of is None:
        key = "data.train_files" if split == "train" else "data.val_files"
        raise ConfigError(f"Env '{config.env.name}' ships no dataset; give {key}=[path.jsonl or .parquet].")
    loaded = LoadedRows.of(list(rows_of(split)), f"env '{config.env.name}' {split} split")
    problems = [f"{where}: {problem}" for where, row in zip(loaded.sources, loaded.rows, strict=True)
                if (problem := check_row(row, require_ground_truth=require_truth))]
    if problems:  # a bug in the env, not in the user's data
        raise DatasetError(f"{len(problems)} of the env's own rows are malformed:\n  " + "\n  ".join(problems[:20]))
    return loaded


def load_split_rows(config: AgentRLConfig, split: str) -> list[dict[str, Any]]:
    """The good rows of `load_split`, in order."""
    return load_split(config, split).rows


def build_chat_template(config: AgentRLConfig) -> ChatTemplate:
    """The policy's chat template: `model.chat_template` (built-in name or Jinja file) or its own."""
    tokenizer_path = resolve_model_path(config.model.tokenizer or config.model.path)
    choice = config.model.chat_template
    template = None
    if choice is not None:
        if choice in _BUILTIN_TEMPLATES:
            template = _BUILTIN_TEMPLATES[choice]
        else:
            from pathlib import Path

            path = Path(choice)
            if not path.is_file():
                raise ConfigError(
                    f"model.chat_template '{choice}' is neither a built-in ({', '.join(_BUILTIN_TEMPLATES)}) "
                    "nor a Jinja file."
                )
            template = path.read_text()
    return ChatTemplate.from_pretrained(tokenizer_path, template=template)


def build_agent_loop(config: AgentRLConfig, client: GenerateClient, *, temperature: float | None = None) -> AgentLoop:
    """The AgentLoop of this config over `client` (the router or a single server client)."""
    parser = TOOL_PARSERS.resolve(config.model.tool_parser)()
    loop_config = AgentLoopConfig.from_rollout_config(config.rollout)
    if temperature is not None:
        loop_config = AgentLoopConfig(**{**loop_config.__dict__, "temperature": temperature})
    template = build_chat_template(config)
    stop_ids = None
    if config.rollout.extra_stop_token_ids:
        stop_ids = tuple(sorted({*end_of_turn_ids(template.tokenizer), *config.rollout.extra_stop_token_ids}))
    return AgentLoop(client, template, parser, loop_config, stop_token_ids=stop_ids)
