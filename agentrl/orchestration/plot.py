"""`agentrl plot RUN_DIR`: draw a run's metric curves (from `metrics.jsonl`) to PNG files.

One PNG per metric, named after it (`reward.png` for `episodes/reward_mean`...), plus
`dashboard.png` with the main curves on one page. The held-out evaluation points come from
`eval.jsonl` (they include the evaluation before the first step). matplotlib draws them with its
non-interactive backend, so it works on a machine without a display. Nothing here trains.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentrl.errors import ConfigError
from agentrl.orchestration.metrics import read_metrics

__all__ = ["DASHBOARD_KEYS", "plot_run"]

DASHBOARD_KEYS: tuple[str, ...] = (
    "episodes/reward_mean",
    "episodes/solved_frac",
    "eval/pass_at_1",
    "tools/calls_per_episode",
    "tools/error_rate_model",
    "episodes/response_tokens_mean",
    "episodes/truncated_frac",
    "episodes/zero_var_group_frac",
    "actor/ppo_kl",
    "actor/entropy",
    "actor/pg_clipfrac",
    "actor/grad_norm",
    "rollout/logprob_abs_diff",
    "staleness/max",
    "time/step_s",
    "time/weight_sync_s",
)


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    xs = [float(r["step"]) + 1 for r in records if key in r]
    ys = [float(r[key]) for r in records if key in r]
    return xs, ys


def _eval_series(run_dir: Path) -> tuple[list[float], list[float]]:
    path = run_dir / "eval.jsonl"
    if not path.is_file():
        return [], []
    by_step: dict[int, float] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            by_step[int(record["step"])] = float(record.get("pass_at_1", 0.0))
    steps = sorted(by_step)
    return [float(s) for s in steps], [by_step[s] for s in steps]


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None, *, keys: Sequence[str] | None = None) -> list[Path]:
    """Draw the curves of the run in `run_dir`; return the PNG files written."""
    run_dir = Path(run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise ConfigError(f"'{run_dir}' has no metrics.jsonl; pass the directory of an 'agentrl run'.")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    out = Path(out_dir) if out_dir else run_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    wanted = list(keys) if keys else list(DASHBOARD_KEYS)
    available = {k for r in records for k in r}
    unknown = [k for k in wanted if k not in available and k != "eval/pass_at_1"]
    if keys and unknown:
        raise ConfigError(f"no metric named {', '.join(unknown)} in {metrics_path}; see its keys with 'head -1'.")
    drawn = [k for k in wanted if k in available or k == "eval/pass_at_1"]

    def series(key: str) -> tuple[list[float], list[float]]:
        return _eval_series(run_dir) if key == "eval/pass_at_1" else _series(records, key)

    written = []
    for key in drawn:
        xs, ys = series(key)
        if not xs:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(xs, ys, marker="o" if len(xs) < 30 else None)
        ax.set_xlabel("step")
        ax.set_title(key)
        ax.grid(alpha=0.3)
        path = out / (key.replace("/", "_") + ".png")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    cols = 4
    rows = max(1, -(-len(drawn) // cols))
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 2.8 * rows), squeeze=False)
    for ax, key in zip(axes.flat, drawn, strict=False):
        xs, ys = series(key)
        ax.plot(xs, ys)
        ax.set_title(key, fontsize=9)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(drawn):]:
        ax.axis("off")
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    dashboard = out / "dashboard.png"
    fig.savefig(dashboard, dpi=90)
    plt.close(fig)
    written.append(dashboard)
    return written
