"""agentrl.records: what a run writes, and how it is read back.

    metrics          the dashboard: per-step numbers from a batch of episodes (`episode_metrics`,
                     `segment_metrics`), their sinks (`MetricsLogger`: console, metrics.jsonl,
                     TensorBoard, W&B), the panels and `read_metrics` / `read_evals`
    trajectory_log   trajectory files, the one on-disk format of episodes (`RolloutLog` for a
                     step's sample, `write_eval_trajectories`, `read_trajectory_file`,
                     `trajectory_from_record`)
    plot             `agentrl plot`: a run's dashboard drawn to PNG files (`plot_run`)

Layer L2 (DESIGN.md §2), beside envs and tools: orchestration writes these records and the viewer
reads them, so neither has to import the other. It may import the layers below it (today it uses
`agentrl.types` and `agentrl.errors` of L0), never orchestration, the trainer, rollout, the gateway
or the viewer, and it starts no process. tqdm, tensorboardX, wandb and matplotlib load only when a
sink or a plot uses them.
"""

from __future__ import annotations

from agentrl.records.metrics import (
    CONSOLE_KEYS,
    PANELS,
    MetricsLogger,
    Panel,
    PanelData,
    dashboard_panels,
    episode_metrics,
    read_evals,
    read_metrics,
    segment_metrics,
    tensorboard_layout,
    time_split,
)
from agentrl.records.plot import plot_run
from agentrl.records.trajectory_log import (
    FORMAT,
    ORIGIN_NAMES,
    RolloutLog,
    TokenPieces,
    TrainerTokens,
    read_trajectory_file,
    select_groups,
    trajectory_from_record,
    trajectory_record,
    write_eval_trajectories,
    write_trajectories,
)

__all__ = [
    "CONSOLE_KEYS",
    "FORMAT",
    "ORIGIN_NAMES",
    "PANELS",
    "MetricsLogger",
    "Panel",
    "PanelData",
    "RolloutLog",
    "TokenPieces",
    "TrainerTokens",
    "dashboard_panels",
    "episode_metrics",
    "plot_run",
    "read_evals",
    "read_metrics",
    "read_trajectory_file",
    "segment_metrics",
    "select_groups",
    "tensorboard_layout",
    "time_split",
    "trajectory_from_record",
    "trajectory_record",
    "write_eval_trajectories",
    "write_trajectories",
]
