"""agentrl.gateway: train and evaluate unmodified OpenAI-API agents, recording every token they cost.

    Gateway          an OpenAI-compatible server (/v1/chat/completions, /v1/responses, /v1/models)
                     in front of the router; one session per episode, by base URL or API key
    GatewaySession   one episode's calls, recorded as exact trajectory segments (session.py)
    AgentEnv         `env=agent`: runs your agent (a function or a command) on a dataset row, scores
                     its answer; `agentrl run` and `agentrl eval` take it like any env
    AgentTask        what an agent function is given (base_url, api_key, the row's messages, ...)
    SharedGateway    one gateway for the episodes of a run, started on first use, closed by its owner
    serve_gateway    the standalone gateway of `agentrl gateway` (offline evaluation of any agent)
    VerifiersAgentEnv  `env=verifiers`: a verifiers 0.4 taskset; verifiers plays its multi-turn episodes
                     against a gateway session (verifiers_agent.py)

Layer L3, beside `agentrl.rollout`: it generates through an AgentLoop's client, template, parser
and budgets, and knows nothing of orchestration or the trainer. Names load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentrl.gateway.agent_env import AgentEnv, AgentTask
    from agentrl.gateway.server import Gateway, SharedGateway
    from agentrl.gateway.session import GatewaySession
    from agentrl.gateway.standalone import serve_gateway
    from agentrl.gateway.verifiers_agent import VerifiersAgentEnv

_EXPORTS: dict[str, str] = {
    "AgentEnv": "agentrl.gateway.agent_env",
    "AgentTask": "agentrl.gateway.agent_env",
    "Gateway": "agentrl.gateway.server",
    "GatewaySession": "agentrl.gateway.session",
    "SharedGateway": "agentrl.gateway.server",
    "VerifiersAgentEnv": "agentrl.gateway.verifiers_agent",
    "serve_gateway": "agentrl.gateway.standalone",
}

__all__ = [
    "AgentEnv",
    "AgentTask",
    "Gateway",
    "GatewaySession",
    "SharedGateway",
    "VerifiersAgentEnv",
    "serve_gateway",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'agentrl.gateway' has no attribute '{name}'")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
