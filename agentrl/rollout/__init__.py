"""Rollout: the AgentLoop state machine and the worker that runs many episodes at once.

`AgentLoop.run_episode(env, row=...)` plays one episode against an inference client and returns
its `Trajectory` (the token ledger); `RolloutWorker` runs groups of episodes concurrently.
`GenerateClient` (what the loop generates with) lives in `agentrl.types` and `ExternalAgentEnv`
(the hook of envs that play their own episodes) in `agentrl.envs`; both are re-exported here.

Layer L3 (DESIGN.md §2), beside `agentrl.gateway`: it may import envs, tools, inference,
sandboxes and the core modules, never the gateway, the trainer, orchestration or the viewer, and
never torch.
"""

from agentrl.envs import ExternalAgentEnv
from agentrl.rollout.agent_loop import (
    AgentLoop,
    AgentLoopConfig,
    EpisodeState,
    end_of_turn_ids,
)
from agentrl.rollout.worker import RolloutWorker, group_seed
from agentrl.types import GenerateClient

__all__ = [
    "AgentLoop",
    "AgentLoopConfig",
    "EpisodeState",
    "ExternalAgentEnv",
    "GenerateClient",
    "RolloutWorker",
    "end_of_turn_ids",
    "group_seed",
]
