"""The training dashboard: per-step metrics from a batch of episodes, and where they are written.

`episode_metrics` turns the groups of one step into the numbers an RL practitioner watches:
reward mean/std and solve rate, the fraction of groups with zero reward variance (they teach
GRPO nothing), response length, truncation rate and finish reasons, tool calls per episode and
tool error rates by class (model / infrastructure), the step's attempted tool calls by typed outcome
(`tools/parse/<status>`, counts, from envs that type them), episodes whose reward is missing by cause
(`reward/missing_<cause>`, from the trajectory's `info["reward_missing"]`), staleness in policy versions, and the time
episodes spent generating and in the environment. `segment_metrics` adds, for episodes an external
agent played through the gateway, its segments, rewrites and model calls per episode, and for episodes
the AgentLoop compacted (`rollout.compaction`), their segments, compactions and summary turns. The trainer's own numbers (KL, entropy, clip
fraction, grad norm, rollout/trainer mismatch) come from `train_step` and are merged in as they are.

`MetricsLogger` writes each step to its sinks: the console (a progress bar on a terminal, one log
line per step otherwise), `metrics.jsonl`, TensorBoard event files (`tensorboardX`) and Weights &
Biases when installed and asked for. `read_metrics` reads a run's JSONL back (last record per step
wins, so a resumed run's repeated steps do not double-count).
"""

from __future__ import annotations

import json
import logging
import math
import re
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.errors import ConfigError, RewardMissingError
from agentrl.records.run_files import append_text, replace_text
from agentrl.types import PARSE_STATUSES, FinishReason, Trajectory, final_segments

__all__ = [
    "CONSOLE_KEYS",
    "PANELS",
    "MetricsLogger",
    "Panel",
    "PanelData",
    "dashboard_panels",
    "episode_metrics",
    "read_evals",
    "read_metrics",
    "segment_metrics",
    "step_line",
    "tensorboard_layout",
    "time_split",
]

log = logging.getLogger("agentrl.run")

SOLVED = 1.0 - 1e-9

# What the one-line console summary shows, in order (name in the line, metric key).
CONSOLE_KEYS: tuple[tuple[str, str], ...] = (
    ("reward", "episodes/reward_mean"),
    ("solved", "episodes/solved_frac"),
    ("tools/ep", "tools/calls_per_episode"),
    ("len", "episodes/response_tokens_mean"),
    ("kl", "actor/ppo_kl"),
    ("ent", "actor/entropy"),
    ("clip", "actor/pg_clipfrac"),
    ("gnorm", "actor/grad_norm"),
    ("stale", "staleness/max"),
    ("eval", "eval/pass_at_1"),
    ("s", "time/step_s"),
)




@dataclass(frozen=True)
class Panel:
    """One picture of the dashboard: curves that are read together.

    `keys` are metric names; a key ending in `*` stands for every logged key with that prefix
    (`finish/*`: one curve per finish reason). Keys under `eval/` come from `eval.jsonl`, which
    also holds the evaluation before the first step. `stacked` panels add their curves up (shares
    of a whole, parts of a step's time). `always` panels are drawn even when every value is 0:
    a reward, a pass@k or an infrastructure failure rate of 0 is what a failing run needs to see.
    """

    title: str
    keys: tuple[str, ...]
    hint: str = ""
    stacked: bool = False
    always: bool = False


# The dashboard, in reading order: `agentrl plot`, `agentrl view` and TensorBoard's custom
# scalars all draw these, and leave out (naming them) the panels with nothing to show; the first
# three are drawn whenever they were logged, 0 or not.
PANELS: tuple[Panel, ...] = (
    Panel("Reward", ("episodes/reward_mean", "episodes/solved_frac"),
          "mean reward and share solved (reward >= 1) of each step's episodes", always=True),
    Panel("Held-out pass@k", ("eval/pass_at_*",), "held-out evaluations, the one before training included",
          always=True),
    Panel("Infrastructure failures", ("tools/error_rate_infra", "episodes/infra_failed_frac", "episodes/infra_rate"),
          "tool calls / episodes that failed for infrastructure reasons: masked, never trained", always=True),
    Panel("Missing rewards", ("reward/missing_*",),
          "episodes whose reward could not be measured, by cause (judge down, timeout, unreadable verdict, "
          "truncated): masked, never trained", stacked=True),
    Panel("Tool use", ("tools/calls_per_episode", "tools/used_frac"), "calls per episode; share of episodes with one"),
    Panel("Model's tool errors", ("tools/error_rate_model", "tools/parse_errors_per_episode"),
          "calls that failed by the model's fault; malformed calls per episode"),
    Panel("Tool-call outcomes", ("tools/parse/*",),
          "the step's attempted calls by outcome: ok, or what was wrong (agentrl.types.ParseStatus)", stacked=True),
    Panel("Finish reasons", ("finish/*",), "how episodes ended (shares)", stacked=True),
    Panel("Response length", ("episodes/response_tokens_mean", "episodes/response_tokens_max"),
          "sampled tokens per episode"),
    Panel("Groups without signal", ("episodes/zero_var_group_frac",),
          "groups whose rewards are all equal: GRPO learns nothing from them"),
    Panel("KL", ("actor/ppo_kl", "actor/kl_ref", "actor/kl_in_reward"), "between policy versions; to the reference"),
    Panel("Entropy", ("actor/entropy",)),
    Panel("Clip fraction", ("actor/pg_clipfrac",)),
    Panel("Grad norm", ("actor/grad_norm",)),
    Panel("Rollout / trainer mismatch", ("rollout/logprob_abs_diff",),
          "mean |trainer - rollout engine| logprob of the sampled tokens"),
    Panel("Served policy", ("served/gap/*", "served/moved_gap_max"),
          "after each push, the largest |served - trainer| logprob gap on the probe per replica (r<i>: "
          "inference.urls[i]), and where the trainer moved, how differently the served scores moved; the run "
          "stops above tol (docs/served-policy.md)"),
    Panel("Weight sync", ("sync/pause_s", "sync/transfer_s", "sync/load_s", "sync/verify_s"),
          "seconds of each push: the servers' wait for requests in flight, receiving and checking the buckets, "
          "loading them, the served-policy check", stacked=True),
    Panel("Staleness", ("staleness/max", "staleness/mean"), "policy versions between sampling and training"),
    Panel("Supervised loss", ("actor/nll", "eval/nll"),
          "NLL of the assistant's tokens: each step's rows, and the held-out rows of 'agentrl sft'"),
    Panel("Preference margin", ("prefs/margin", "eval/margin", "eval/logp_margin"),
          "the loss's margin on each step's pairs and the held-out pairs ('agentrl dpo'); the policy's own "
          "log-probability margin, chosen - rejected"),
    Panel("Time split", ("time/split/wait_rollout_s", "time/split/train_s", "time/split/weights_s",
                         "time/split/other_s"),
          "seconds of each step: waiting for rollouts, training, exporting and pushing weights, the rest",
          stacked=True),
)


@dataclass
class PanelData:
    """A panel with its curves: key -> (steps, values); `empty` says why there is nothing to show."""

    panel: Panel
    series: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)
    empty: str = ""


def tensorboard_layout(panels: Sequence[Panel] = PANELS) -> dict[str, dict[str, list[str | list[str]]]]:
    """The dashboard's panels as TensorBoard custom scalars (its CUSTOM SCALARS tab): one chart per
    panel, its curves together (stacked panels are drawn as lines there)."""
    def pattern(key: str) -> str:
        return f"^{re.escape(key[:-1])}.*$" if key.endswith("*") else f"^{re.escape(key)}$"

    return {"agentrl dashboard": {p.title: ["Multiline", [pattern(k) for k in p.keys]] for p in panels}}


def time_split(metrics: dict[str, Any]) -> dict[str, float]:
    """The step time cut into parts that add up to `time/step_s` (the `Time split` panel):
    waiting for rollouts, training (without the export), exporting and pushing weights, the rest."""
    if "time/step_s" not in metrics:
        return {}

    def get(key: str) -> float:
        value = metrics.get(key, 0.0)
        return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else 0.0

    wait = get("time/rollout_s") + get("time/idle_s") + get("time/wait_rollout_s") + get("time/wait_push_s")
    train = max(0.0, get("time/train_s") - get("time/export_s"))
    weights = get("time/weight_sync_s")
    return {
        "time/split/wait_rollout_s": wait,
        "time/split/train_s": train,
        "time/split/weights_s": weights,
        "time/split/other_s": max(0.0, get("time/step_s") - wait - train - weights),
    }


def dashboard_panels(
    records: Sequence[dict[str, Any]], evals: Sequence[dict[str, Any]] = (), panels: Sequence[Panel] = PANELS,
) -> list[PanelData]:
    """Each panel's curves from a run's metrics (`read_metrics`) and evaluations (`read_evals`).

    x is the number of steps done: a step's metrics (`step` s, 0-based) sit at s + 1, an evaluation
    after N steps at N (the one before training at 0). A panel none of whose keys was logged is
    empty ("not logged"), and so is one whose every value is 0 ("always 0") unless it is an `always`
    panel; callers leave the empty ones out and say so.
    """
    rows = [{**r, **time_split(r)} for r in records]
    eval_rows = [{f"eval/{k}": v for k, v in e.items() if k != "step"} | {"_x": float(e["step"])}
                 for e in evals if "step" in e]
    out = []
    for panel in panels:
        data = PanelData(panel)
        for key in panel.keys:
            source, xs_of = (eval_rows, lambda r: r["_x"]) if key.startswith("eval/") else (
                rows, lambda r: float(r["step"]) + 1)
            for name in _expand(key, source):
                points = [(xs_of(r), float(r[name])) for r in source
                          if isinstance(r.get(name), (int, float)) and math.isfinite(r[name])]
                if points:
                    data.series[name] = ([p[0] for p in points], [p[1] for p in points])
        if not data.series:
            data.empty = "not logged"
        elif not panel.always and all(v == 0 for _, ys in data.series.values() for v in ys):
            data.empty = "always 0"
        out.append(data)
    return out


def _expand(key: str, rows: Sequence[dict[str, Any]]) -> list[str]:
    if not key.endswith("*"):
        return [key]
    prefix = key[:-1]
    return list(dict.fromkeys(k for r in rows for k in r if k.startswith(prefix)))


def read_evals(path: str | Path) -> list[dict[str, Any]]:
    """The held-out evaluations of a run (`eval.jsonl`), one per step (the last written wins)."""
    path = Path(path)
    if not path.is_file():
        return []
    by_step: dict[int, dict[str, Any]] = {}
    for record in _records(path):
        if "step" in record:
            by_step[int(record["step"])] = record
    return [by_step[s] for s in sorted(by_step)]


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def episode_metrics(
    groups: Sequence[Sequence[Trajectory]], *, trainer_version: int | None = None,
    group_versions: Sequence[int] = (),
) -> dict[str, float]:
    """Dashboard numbers of one step's episodes (see the module docstring)."""
    trajs = [t for g in groups for t in g]
    if not trajs:
        return {"episodes/count": 0.0}
    valid = [t for t in trajs if t.trainable]
    rewards = [float(t.reward or 0.0) for t in valid]
    out: dict[str, float] = {
        "episodes/count": float(len(trajs)),
        "episodes/infra_failed": float(sum(t.fault == "infra" for t in trajs)),
        "episodes/infra_failed_frac": sum(t.fault == "infra" for t in trajs) / len(trajs),
        "episodes/refused": float(sum(t.fault == "request" for t in trajs)),
    }
    missing = Counter(t.info["reward_missing"].get("cause") for t in trajs
                      if isinstance(t.info.get("reward_missing"), dict))
    for cause in RewardMissingError.CAUSES:  # masked like infrastructure failures, counted by cause
        out[f"reward/missing_{cause}"] = float(missing.get(cause, 0))
    if rewards:  # with no valid episode nothing was measured: no reward, rather than a reward of 0
        out["episodes/reward_mean"] = _mean(rewards)
        out["episodes/reward_std"] = statistics.pstdev(rewards) if len(rewards) > 1 else 0.0
        out["episodes/solved_frac"] = _mean([float(r >= SOLVED) for r in rewards])
    out |= {
        "episodes/response_tokens_mean": _mean([float(t.num_sampled) for t in trajs]),
        "episodes/response_tokens_max": float(max(t.num_sampled for t in trajs)),
        "episodes/total_tokens_mean": _mean([float(len(t)) for t in trajs]),
        "episodes/turns_mean": _mean([float(t.metrics.get("turns", t.num_turns)) for t in trajs]),
    }
    zero_var = [
        len({float(t.reward or 0.0) for t in g if t.trainable}) <= 1 for g in groups if any(t.trainable for t in g)
    ]
    if zero_var:
        out["episodes/zero_var_group_frac"] = _mean([float(z) for z in zero_var])
    reasons = Counter(t.finish_reason.value if t.finish_reason else "none" for t in trajs)
    for reason in FinishReason:
        out[f"finish/{reason.value}"] = reasons.get(reason.value, 0) / len(trajs)
    out["episodes/truncated_frac"] = (reasons.get("max_length", 0) + reasons.get("max_turns", 0)) / len(trajs)

    calls = sum(t.metrics.get("tool_calls", 0.0) for t in trajs)
    out["tools/calls_per_episode"] = calls / len(trajs)
    out["tools/used_frac"] = _mean([float(t.metrics.get("tool_calls", 0.0) > 0) for t in trajs])
    for fault in ("model", "infra"):
        errors = sum(t.metrics.get(f"tool_errors_{fault}", 0.0) for t in trajs)
        out[f"tools/error_rate_{fault}"] = errors / calls if calls else 0.0
    out["tools/parse_errors_per_episode"] = _mean([t.metrics.get("parse_errors", 0.0) for t in trajs])
    if any("tools/parse/ok" in t.metrics for t in trajs):  # an env that types its calls (ToolEnv)
        for status in PARSE_STATUSES:
            out[f"tools/parse/{status}"] = sum(t.metrics.get(f"tools/parse/{status}", 0.0) for t in trajs)
    out["time/episode_s_mean"] = _mean([t.metrics.get("episode_s", 0.0) for t in trajs])
    out["time/episode_generate_s_mean"] = _mean([t.metrics.get("generate_s", 0.0) for t in trajs])
    out["time/episode_env_s_mean"] = _mean([t.metrics.get("env_s", 0.0) for t in trajs])

    if trainer_version is not None and group_versions:
        lags = [trainer_version - v for v in group_versions]
        out["staleness/max"] = float(max(lags))
        out["staleness/mean"] = _mean([float(x) for x in lags])
        token_lags = [
            trainer_version - v for t in valid for v, m in zip(t.versions, t.response_mask, strict=True) if m
        ]
        if token_lags:
            out["staleness/token_mean"] = _mean([float(x) for x in token_lags])
            out["staleness/token_max"] = float(max(token_lags))
    return out


def segment_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Dashboard numbers of episodes in segments: for gateway episodes their segments, rewrites and model calls
    per episode; for episodes the AgentLoop compacted (`rollout.compaction`), their segments and compactions
    per episode ({} if none)."""
    finals = final_segments(trajectories)
    out: dict[str, float] = {}
    compacted = [t for t in finals if "compactions" in t.metrics]
    if compacted:
        out = {f"rollout/{k}_per_episode": sum(t.metrics.get(k, 0.0) for t in compacted) / len(compacted)
               for k in ("segments", "compactions", "summary_turns")}
    episodes = [t for t in finals if "llm_calls" in t.metrics]
    if not episodes:
        return out
    n = len(episodes)
    out.update({f"gateway/{k}_per_episode": sum(t.metrics.get(k, 0.0) for t in episodes) / n
                for k in ("segments", "rewrites", "new_conversations", "llm_calls", "parse_errors", "server_errors")})
    out["gateway/rewritten_frac"] = sum(t.metrics.get("rewrites", 0.0) > 0 for t in episodes) / n
    return out


class MetricsLogger:
    """Writes each step's metrics to the configured sinks (see the module docstring)."""

    def __init__(
        self, run_dir: str | Path, sinks: Iterable[str], *, total_steps: int, start_step: int = 0,
        run_name: str = "", config: dict[str, Any] | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.sinks = list(dict.fromkeys(sinks))
        self.total_steps = total_steps
        self.jsonl_path = self.run_dir / "metrics.jsonl"
        # tqdm, tensorboardX and wandb ship no type information: their objects are Any to mypy.
        self._bar: Any = None
        self._tb: Any = None
        self._wandb: Any = None
        if "console" in self.sinks:
            import sys

            from tqdm import tqdm

            if sys.stderr.isatty():
                self._bar = tqdm(total=total_steps, initial=start_step, desc="agentrl run", unit="step",
                                 dynamic_ncols=True)
        if "tensorboard" in self.sinks:
            try:
                from tensorboardX import SummaryWriter
            except ImportError as exc:
                raise ConfigError(
                    "run.loggers includes 'tensorboard' but tensorboardX is not installed; "
                    "pip install tensorboardX, or drop 'tensorboard' from run.loggers."
                ) from exc
            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=start_step or None)
            self._tb.add_custom_scalars(tensorboard_layout())
        if "wandb" in self.sinks:
            try:
                import wandb
            except ImportError as exc:
                raise ConfigError(
                    "run.loggers includes 'wandb' but wandb is not installed; pip install wandb, "
                    "or drop 'wandb' from run.loggers."
                ) from exc
            self._wandb = wandb.init(project="agentrl", name=run_name or self.run_dir.name, config=config,
                                     dir=str(self.run_dir), resume="allow")

    def truncate_after(self, step: int) -> None:
        """Set aside records of steps after `step` (a resumed run repeats them): they move to
        `metrics.rolled_back.jsonl`, so the dashboard shows one line per step and nothing is lost."""
        if not self.jsonl_path.exists():
            return
        records = _records(self.jsonl_path)
        dropped = [r for r in records if r.get("step", -1) > step]
        if not dropped:
            return
        append_text(self.run_dir / "metrics.rolled_back.jsonl", "".join(json.dumps(r) + "\n" for r in dropped))
        kept = [r for r in records if r.get("step", -1) <= step]
        replace_text(self.jsonl_path, "".join(json.dumps(r) + "\n" for r in kept))

    def _to_dashboards(self, step: int, metrics: dict[str, Any]) -> dict[str, float]:
        """Write the finite numbers of `metrics` to TensorBoard and W&B; return them."""
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        if self._tb is not None:
            for key, value in clean.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(clean, step=step)
        return clean

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = self._to_dashboards(step, {**metrics, **time_split(metrics)})
        if "jsonl" in self.sinks:
            append_text(self.jsonl_path, json.dumps({"step": step, **clean}) + "\n")
        if "console" in self.sinks:
            line = step_line(clean)
            if self._bar is not None:
                self._bar.update(1)
                self._bar.set_postfix_str(line, refresh=True)
            log.info("step %d/%d  %s", step + 1, self.total_steps, line)

    def log_event(self, step: int, metrics: dict[str, float], prefix: str) -> None:
        """Metrics that are not a training step's (the held-out evaluation before training) under
        `prefix/`, for TensorBoard, W&B and the console; the caller keeps its own JSONL of them."""
        clean = self._to_dashboards(step, {f"{prefix}/{k}": v for k, v in metrics.items()})
        if "console" in self.sinks:
            log.info("%s after %d step(s): %s", prefix, step,
                     " ".join(f"{k.split('/', 1)[1]} {v:.3g}" for k, v in clean.items()))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def step_line(metrics: dict[str, float]) -> str:
    """The console's summary of one step: every `CONSOLE_KEYS` entry, a value that was not measured
    this step (absent, or not finite) shown as `-`, never as 0."""
    def shown(key: str) -> str:
        value = metrics.get(key)
        return f"{value:.3g}" if isinstance(value, (int, float)) and math.isfinite(value) else "-"

    return " ".join(f"{name} {shown(key)}" for name, key in CONSOLE_KEYS)


def _records(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by a crash
    return out


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics JSONL file, one per step (the last one written wins), by step."""
    by_step: dict[int, dict[str, Any]] = {}
    for record in _records(Path(path)):
        by_step[int(record.get("step", -1))] = record
    return [by_step[s] for s in sorted(by_step)]
