"""Build the pieces a job needs from its config: rows, the env factory, the chat template, the loop.

Shared by `agentrl eval` and the training driver so both read the config the same way. Nothing
here starts processes; `agentrl.inference.serve` does that.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from agentrl.chat import ChatTemplate
from agentrl.config import AgentRLConfig
from agentrl.datasets import load_rows
from agentrl.envs import Env, make_env
from agentrl.errors import ConfigError
from agentrl.models import TOOL_CHATML_TEMPLATE, resolve_model_path
from agentrl.registry import ENVS, TOOL_PARSERS
from agentrl.rollout import AgentLoop, AgentLoopConfig, GenerateClient

__all__ = ["build_agent_loop", "build_chat_template", "env_factory", "load_split_rows"]

_BUILTIN_TEMPLATES = {"chatml-tools": TOOL_CHATML_TEMPLATE}


def env_factory(config: AgentRLConfig) -> Callable[[], Env]:
    """A zero-argument constructor of the configured env (checked once, here)."""
    make_env(config.env.name, **config.env.kwargs)  # fail now, in the config's words (nothing to close yet)
    return functools.partial(make_env, config.env.name, **config.env.kwargs)


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
    return AgentLoop(client, build_chat_template(config), parser, loop_config)
