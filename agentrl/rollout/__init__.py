"""Rollout: the AgentLoop state machine and the worker that runs many episodes at once.

`AgentLoop.run_episode(env, row=...)` plays one episode against an inference client and returns
its `Trajectory` (the token ledger); `RolloutWorker` runs groups of episodes concurrently.
"""

from agentrl.rollout.agent_loop import (
    AgentLoop,
    AgentLoopConfig,
    EpisodeState,
    GenerateClient,
    end_of_turn_ids,
)
from agentrl.rollout.worker import ExternalAgentEnv, RolloutWorker, group_seed

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
