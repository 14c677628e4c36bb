"""agentrl: a gym for training LLM agents with reinforcement learning on multi-turn tool use.

The names below are the public API. They are loaded on first use, so `import agentrl` stays fast
and imports no optional dependency (nor torch, nor gymnasium) until a name that needs it is used.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "AgentRLError": "agentrl.errors",
    "Action": "agentrl.types",
    "Env": "agentrl.envs.core",
    "ExecResult": "agentrl.types",
    "Generation": "agentrl.types",
    "Message": "agentrl.types",
    "SamplingParams": "agentrl.types",
    "Sandbox": "agentrl.sandboxes.protocol",
    "SandboxSession": "agentrl.sandboxes.protocol",
    "Segment": "agentrl.types",
    "TokenOrigin": "agentrl.types",
    "Tool": "agentrl.tools.core",
    "ToolCall": "agentrl.types",
    "ToolContext": "agentrl.tools.core",
    "ToolEnv": "agentrl.envs.tool_env",
    "ToolResult": "agentrl.types",
    "Trajectory": "agentrl.types",
    "check_env": "agentrl.envs.checker",
    "load_config": "agentrl.config",
    "make_env": "agentrl.envs",
    "make_tool": "agentrl.tools",
    "register_env": "agentrl.registry",
    "register_tool": "agentrl.registry",
    "tool": "agentrl.tools.core",
}

__all__ = sorted([*_EXPORTS, "__version__"])


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'agentrl' has no attribute '{name}'")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__

