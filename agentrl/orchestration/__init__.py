"""Orchestration: what runs a whole job, `agentrl run` (`driver`) and `agentrl eval` (`evaluate`).

`evaluate` plays an environment's dataset with k samples per problem and writes a report; the
driver builds a run from its config (`build`), places it (`placement`, `cluster`), schedules its
steps (`schedule`) and keeps its checkpoints and prompt ledger. `onpolicy_check` is `agentrl check
onpolicy`; `onpolicy_gate` stops a run whose steps the trainer's mismatch gate finds off-policy.

Layer L5 (DESIGN.md §2): it may import everything below it (the trainer, rollout and the gateway,
envs, tools and `agentrl.records`, where it writes metrics, trajectory files and plots; inference,
sandboxes, weights and the core modules), never the CLI or the viewer.
"""

from agentrl.orchestration.evaluate import EvalReport, evaluate, pass_at_k, run_eval

__all__ = ["EvalReport", "evaluate", "pass_at_k", "run_eval"]
