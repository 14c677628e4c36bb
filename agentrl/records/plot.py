"""`agentrl plot RUN_DIR`: draw a run's dashboard (from `metrics.jsonl` and `eval.jsonl`) to PNG files.

The pictures are the dashboard's panels (`agentrl.records.metrics.PANELS`, the same ones
`agentrl view` and TensorBoard's custom scalars show): reward, held-out pass@k, infrastructure
failures, tool use and the model's tool errors, finish reasons, response length, groups without
signal, KL, entropy, clip fraction, grad norm, the rollout/trainer mismatch, staleness and the time
split. A panel with nothing to show (never logged, or 0 at every step) is left out, and
`dashboard.png` names what was left out and why, so a flat line never hides among the others;
reward, held-out pass@k and infrastructure failures are drawn whenever they were logged, even at
0 throughout, since that is what a failing run shows.
A panel of infrastructure failures above zero gets a red title: they are episodes that were never trained.

Written: `dashboard.png` with every drawn panel, and one PNG per panel (`reward.png`,
`infrastructure_failures.png`, ...). `keys=[...]` draws one panel per named metric instead.
matplotlib draws with its non-interactive backend, so it works without a display. Nothing here trains.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from agentrl.errors import ConfigError
from agentrl.records.metrics import Panel, PanelData, dashboard_panels, read_evals, read_metrics

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["plot_run"]

_ALARM = "Infrastructure failures"
_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#17becf")


def _slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", title.lower()).strip("_")


def _label(key: str) -> str:
    return key.rsplit("/", 1)[-1]


def _draw(ax: Axes, data: PanelData, *, small: bool) -> None:
    from matplotlib.ticker import MaxNLocator  # matplotlib is optional: imported only where a plot is drawn

    panel = data.panel
    series = data.series
    alarm = panel.title == _ALARM and any(v > 0 for _, ys in series.values() for v in ys)
    if panel.stacked:
        xs = sorted({x for sx, _ in series.values() for x in sx})
        series = {k: v for k, v in series.items() if any(v[1])} or series  # a share that is always 0 adds nothing
        stacks = []
        for sx, sy in series.values():
            at = dict(zip(sx, sy, strict=True))
            stacks.append([at.get(x, 0.0) for x in xs])
        ax.stackplot(xs, *stacks, labels=[_label(k) for k in series], colors=_COLOURS[: len(stacks)], alpha=0.85)
    else:
        for i, (key, (sx, sy)) in enumerate(series.items()):
            colour = _COLOURS[i % len(_COLOURS)]
            ax.plot(sx, sy, marker="o" if len(sx) < 30 else None, markersize=3, label=_label(key), color=colour)
    title = panel.title
    if alarm:
        worst = max(v for _, ys in series.values() for v in ys)
        title += f" (up to {worst:.0%})" if worst <= 1 else ""
    ax.set_title(title, fontsize=9 if small else 11, color="#d62728" if alarm else "black")
    ax.grid(alpha=0.3)
    locator = ax.xaxis.get_major_locator()
    if isinstance(locator, MaxNLocator):  # a fresh axis's AutoLocator is one; other locators take no `integer`
        locator.set_params(integer=True)
    ax.ticklabel_format(axis="y", useOffset=False)  # 11.9184 rather than "1e-5 + 1.19184e1"
    if len(series) > 1 or panel.stacked:
        ax.legend(fontsize=6 if small else 8, loc="best", framealpha=0.6)
    if not small:
        ax.set_xlabel("step")
        if panel.hint:
            ax.text(0.0, -0.2, panel.hint, transform=ax.transAxes, fontsize=7, color="#555555", va="top")


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None, *, keys: Sequence[str] | None = None) -> list[Path]:
    """Draw the dashboard of the run in `run_dir`; return the PNG files written (see the module docstring)."""
    run_dir = Path(run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise ConfigError(f"'{run_dir}' has no metrics.jsonl; pass the directory of an 'agentrl run'.")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    evals = read_evals(run_dir / "eval.jsonl")
    panels = None
    if keys:
        panels = [Panel(k, (k,)) for k in keys]
    data = dashboard_panels(records, evals, panels) if panels else dashboard_panels(records, evals)
    if keys:
        unknown = [d.panel.title for d in data if d.empty == "not logged"]
        if unknown:
            raise ConfigError(f"no metric named {', '.join(unknown)} in {metrics_path}; see its keys with 'head -1'.")
    drawn = [d for d in data if not d.empty or keys]
    left_out = [d for d in data if d.empty and not keys]
    out = Path(out_dir) if out_dir else run_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)

    written = []
    for d in drawn:
        fig, ax = plt.subplots(figsize=(6, 3.6))
        _draw(ax, d, small=False)
        fig.tight_layout()
        path = out / f"{_slug(d.panel.title)}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)

    cols = 4
    rows = max(1, -(-len(drawn) // cols))
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 2.9 * rows + 0.6), squeeze=False)
    for ax, d in zip(axes.flat, drawn, strict=False):
        _draw(ax, d, small=True)
    for ax in list(axes.flat)[len(drawn):]:
        ax.axis("off")
    last = int(max((r.get("step", 0) for r in records), default=-1)) + 1
    fig.suptitle(f"{run_dir.name}: {last} step(s)", fontsize=12)
    if left_out:
        note = "Nothing to show: " + "; ".join(f"{d.panel.title} ({d.empty})" for d in left_out)
        fig.text(0.01, 0.005, note, fontsize=8, color="#555555", va="bottom", wrap=True)
    fig.tight_layout(rect=(0, 0.03 if left_out else 0, 1, 0.97))
    dashboard = out / "dashboard.png"
    fig.savefig(dashboard, dpi=90)
    plt.close(fig)
    written.append(dashboard)
    return written
