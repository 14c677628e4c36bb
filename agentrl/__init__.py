"""agentrl: a gym for training LLM agents with reinforcement learning on multi-turn tool use."""

__version__ = "0.1.0"
