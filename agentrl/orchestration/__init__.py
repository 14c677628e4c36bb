"""Orchestration: what runs a whole job. Offline evaluation today; the training driver next.

`evaluate` plays an environment's dataset with k samples per problem and writes a report.
"""

from agentrl.orchestration.evaluate import EvalReport, evaluate, pass_at_k, run_eval

__all__ = ["EvalReport", "evaluate", "pass_at_k", "run_eval"]
