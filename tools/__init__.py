"""Built-in tools and the tool contract (installed as `agentrl.tools`).

`Tool` is the base class, `@tool` turns a typed function into one, `ToolContext` is what a call
knows of its episode, and `make_tool` builds a tool by registry name or import path.

Layer L2 (DESIGN.md §2), beside `agentrl.envs`: it may import sandboxes and the core modules,
never rollout, the gateway, the trainer, orchestration or the viewer, and never torch.
"""

if __name__ != "agentrl.tools":
    # This folder sits at the repository root but installs as agentrl.tools (DESIGN.md §1):
    # loading it under a second name would create a second copy of every class and registry.
    raise ImportError(
        f"'{__name__}' is agentrl's tools package: import it as 'agentrl.tools', not '{__name__}'."
    )

from typing import Any

from agentrl.errors import ConfigError
from agentrl.registry import TOOLS
from agentrl.tools.core import FunctionTool, Tool, ToolContext, tool

__all__ = ["FunctionTool", "Tool", "ToolContext", "make_tool", "tool"]


def make_tool(name: str, **kwargs: Any) -> Tool:
    """The tool registered as `name`: an instance as is, or a `Tool` subclass built with `kwargs`."""
    obj = TOOLS.resolve(name)
    if isinstance(obj, Tool):
        if kwargs:
            raise ConfigError(f"Tool '{name}' is a ready-made instance; it takes no arguments {sorted(kwargs)}.")
        return obj
    if isinstance(obj, type) and issubclass(obj, Tool):
        return obj(**kwargs)
    raise ConfigError(f"'{name}' is a {type(obj).__name__}, not an agentrl Tool or Tool subclass.")
