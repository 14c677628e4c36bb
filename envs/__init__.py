"""Built-in environments and the environment contract (installed as `agentrl.envs`).

`Env` is the base class (a `gymnasium.Env` whose observations are chat messages), `ToolEnv` the
base of tool-using environments, `ExternalAgentEnv` the hook of envs that play their own episodes
(given the rollout's loop, an `EpisodeLoop`), `check_env` the conformance checker, and `make_env`
builds an environment by registry name (`"arithmetic"`) or import path (`"my_pkg.envs:MyEnv"`).

Layer L2 (DESIGN.md §2), beside `agentrl.tools` and `agentrl.records`: it may import tools,
sandboxes, inference clients and the core modules, never rollout, the gateway, the trainer,
orchestration or the viewer, and never torch.
"""

if __name__ != "agentrl.envs":
    # This folder sits at the repository root but installs as agentrl.envs (DESIGN.md §1):
    # loading it under a second name would create a second copy of every class and registry.
    raise ImportError(
        f"'{__name__}' is agentrl's envs package: import it as 'agentrl.envs', not '{__name__}'."
    )

from typing import Any

from agentrl.envs.checker import check_env
from agentrl.envs.core import ActionSpace, ChatSpace, Env, EpisodeLoop, ExternalAgentEnv, TurnBackend
from agentrl.envs.tool_env import ToolEnv
from agentrl.errors import ConfigError
from agentrl.registry import ENVS

__all__ = [
    "ActionSpace",
    "ChatSpace",
    "Env",
    "EpisodeLoop",
    "ExternalAgentEnv",
    "ToolEnv",
    "TurnBackend",
    "check_env",
    "make_env",
]


def make_env(name: str, **kwargs: Any) -> Env:
    """Build the environment registered as `name` (or at import path `name`) with `kwargs`."""
    cls = ENVS.resolve(name)
    try:
        env = cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"Cannot build env '{name}' with arguments {sorted(kwargs)}: {exc}") from exc
    if not isinstance(env, Env):
        raise ConfigError(f"'{name}' built a {type(env).__name__}, not an agentrl.Env subclass.")
    return env
