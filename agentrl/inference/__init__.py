"""agentrl.inference: token-in/token-out LLM servers, their clients, the launcher and the router.

    InferenceClient     agentrl.types.GenerateClient (what the agent loop awaits: generate(prompt_ids,
                        sampling, session_id)) plus aclose; ControllableClient adds server_id, health
    HTTPServerClient    one agentrl server over HTTP (hf, vllm), plus its control calls
    Router              many servers behind one InferenceClient: sticky sessions, load, failover
    ServerProcess       a server child process: start, wait for /health, stop
    launch_server       start a server of a named engine and wait until it is healthy
    serve_from_config   start `inference.num_servers` servers plus a router from an AgentRLConfig
    ExternalClient      an OpenAI-compatible /v1/completions server started by someone else
    ColocatedClient     an engine inside another process (placement colocated: the trainer's)
    ColocatedServer     vLLM inside this process, taking turns on memory with the trainer

Names load on first use: importing this package imports neither torch nor any engine. The server
modules (`hf_server`, `vllm_server`) run in their own processes and are never imported here.

Layer L1 (DESIGN.md §2): it may import `agentrl.weights` (servers receive pushed weights through
it) and the core modules of L0, never sandboxes, envs, tools, rollout, the gateway, the trainer,
orchestration or the viewer.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentrl.inference.client import ControllableClient, HTTPServerClient, InferenceClient, ScoringClient
    from agentrl.inference.colocated import ColocatedServer, InProcessVLLM
    from agentrl.inference.colocated_client import ColocatedClient
    from agentrl.inference.launcher import EngineSpec, ServerProcess, launch_server
    from agentrl.inference.router import Router
    from agentrl.inference.serve import ExternalClient, serve_from_config
    from agentrl.inference.sglang import SGLangClient

_EXPORTS: dict[str, str] = {
    "ColocatedClient": "agentrl.inference.colocated_client",
    "ColocatedServer": "agentrl.inference.colocated",
    "ControllableClient": "agentrl.inference.client",
    "EngineSpec": "agentrl.inference.launcher",
    "ExternalClient": "agentrl.inference.serve",
    "HTTPServerClient": "agentrl.inference.client",
    "InProcessVLLM": "agentrl.inference.colocated",
    "InferenceClient": "agentrl.inference.client",
    "Router": "agentrl.inference.router",
    "SGLangClient": "agentrl.inference.sglang",
    "ScoringClient": "agentrl.inference.client",
    "ServerProcess": "agentrl.inference.launcher",
    "launch_server": "agentrl.inference.launcher",
    "serve_from_config": "agentrl.inference.serve",
}

__all__ = [
    "ColocatedClient",
    "ColocatedServer",
    "ControllableClient",
    "EngineSpec",
    "ExternalClient",
    "HTTPServerClient",
    "InProcessVLLM",
    "InferenceClient",
    "Router",
    "SGLangClient",
    "ScoringClient",
    "ServerProcess",
    "launch_server",
    "serve_from_config",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'agentrl.inference' has no attribute '{name}'")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
