"""The command that continues a run, written once for every message that tells a user to type it.

A run that stops (an error, Ctrl-C, a scheduler's SIGTERM, a full disk) says how to continue it.
The command names the run's real directory: `run.name` as the run resolved it (an unnamed run gets
the env's name and a timestamp, which the user never typed) and `run.output_dir` when it is not the
default. It starts from the run's own resolved `config.yaml`, so it carries every override the run
was started with. This module formats text only; it reads and starts nothing.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from agentrl.config import AgentRLConfig, RunConfig

__all__ = ["resume_command"]

_DEFAULT_OUTPUT_DIR = RunConfig.model_fields["output_dir"].default


def resume_command(config: AgentRLConfig, run_dir: str | Path, *, resume: bool = True) -> str:
    """`agentrl run RUN_DIR/config.yaml resume=true run.name=NAME [run.output_dir=DIR]`, quoted for a shell.

    `run_dir` is the run's directory as the driver resolved it (`run.output_dir/<real name>`). With
    `resume=False` the command starts the run again from the beginning in the same directory (for a
    run that wrote no checkpoint yet, which `resume=true` refuses).
    """
    run_dir = Path(run_dir)
    parts = ["agentrl", "run", str(run_dir / "config.yaml")]
    if resume:
        parts.append("resume=true")
    parts.append(f"run.name={run_dir.name}")
    if config.run.output_dir != _DEFAULT_OUTPUT_DIR:
        parts.append(f"run.output_dir={config.run.output_dir}")
    return shlex.join(parts)
