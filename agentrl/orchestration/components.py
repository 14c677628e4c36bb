"""Build the pieces a job needs from its config: rows, the env factory, the chat template, the loop.

Shared by `agentrl eval` and the training driver so both read the config the same way. Nothing
here starts processes; `agentrl.inference.serve` does that.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from agentrl.chat import ChatTemplate
from agentrl.config import AgentRLConfig
from agentrl.datasets import load_rows
from agentrl.envs import Env, make_env
from agentrl.errors import ConfigError
from agentrl.models import TOOL_CHATML_TEMPLATE, resolve_model_path
from agentrl.registry import ENVS, SANDBOXES, TOOL_PARSERS
from agentrl.rollout import AgentLoop, AgentLoopConfig, GenerateClient
from agentrl.rollout.agent_loop import end_of_turn_ids

__all__ = ["build_agent_loop", "build_chat_template", "build_sandbox", "close_run_sandbox", "env_factory",
           "load_split_rows"]

_BUILTIN_TEMPLATES = {"chatml-tools": TOOL_CHATML_TEMPLATE}


def build_sandbox(config: AgentRLConfig) -> Any:
    """The run's one sandbox, built from `config.sandbox` (its owner closes it: `close_run_sandbox`)."""
    cls = SANDBOXES.resolve(config.sandbox.name)
    try:
        return cls(**config.sandbox.kwargs)
    except TypeError as exc:
        raise ConfigError(f"Cannot build sandbox '{config.sandbox.name}' with sandbox.kwargs "
                          f"{sorted(config.sandbox.kwargs)}: {exc}") from exc


def env_factory(config: AgentRLConfig) -> Callable[[], Env]:
    """A zero-argument constructor of the configured env (checked once, here).

    An env whose constructor takes `sandbox` gets the run's one sandbox (`build_sandbox`), the same
    object for every episode; `close_run_sandbox(factory)` closes it when the run is done with it.
    """
    kwargs = dict(config.env.kwargs)
    if "sandbox" in inspect.signature(ENVS.resolve(config.env.name)).parameters:
        if "sandbox" in kwargs:
            raise ConfigError(f"env.kwargs.sandbox={kwargs['sandbox']!r}: the sandbox is the config's own section; "
                              "set sandbox.name (and sandbox.kwargs) instead.")
        kwargs["sandbox"] = build_sandbox(config)
    make_env(config.env.name, **kwargs)  # fail now, in the config's words (nothing to close yet)
    return functools.partial(make_env, config.env.name, **kwargs)


async def close_run_sandbox(factory: Callable[[], Env]) -> None:
    """Close the sandbox `env_factory` built for `factory`, if it built one."""
    sandbox = getattr(factory, "keywords", {}).get("sandbox")
    if sandbox is not None:
        await sandbox.close()


def load_split_rows(config: AgentRLConfig, split: str) -> list[dict[str, Any]]:
    """Rows for `split` ("train" or "test"): the configured files, else the env's own dataset."""
    files = config.data.train_files if split == "train" else config.data.val_files
    if files:
        return load_rows(files, skip_bad_rows=config.data.skip_bad_rows).rows
    env_cls = ENVS.resolve(config.env.name)
    rows_of = getattr(env_cls, "dataset_rows", None)
    if rows_of is None:
        key = "data.train_files" if split == "train" else "data.val_files"
        raise ConfigError(f"Env '{config.env.name}' ships no dataset; give {key}=[path.jsonl or .parquet].")
    return list(rows_of(split))


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
