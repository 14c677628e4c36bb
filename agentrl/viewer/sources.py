"""What `agentrl view` reads: a run directory, an eval directory, or one trajectory file.

`RunReader(path)` finds what there is to look at, again at every request (a run still going gains
steps): the training steps whose rollouts were kept (`rollouts/step-N.jsonl`), the held-out
evaluations (`eval/step-N/trajectories.jsonl`), the episodes of an `agentrl eval` directory
(`trajectories.jsonl` beside `report.json`), or the file it was given. A run directory that
holds nothing to look at yet, only what a run writes first (`config.yaml`, its lock, its identity,
its ledger), is `waiting`: it is looked at
again at every request, and becomes a run or an evaluation once one writes there. It serves the dashboard
curves (`metrics.jsonl`, `eval.jsonl`, drawn as `agentrl plot` draws them), a short summary of
each episode of a source for the list and its filters, and whole episodes. Files are parsed once
and kept until they change. Everything is read-only: nothing here writes, starts a process or
loads a model; a tokenizer is loaded only to give text to the tokens of a file written before
tokens carried their text (`agentrl.records.trajectory_log`).
"""

from __future__ import annotations

import json
import logging
import re
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from agentrl.errors import ConfigError
from agentrl.records.metrics import dashboard_panels, read_evals, read_metrics
from agentrl.records.trajectory_log import TokenPieces, scan_trajectory_file

__all__ = ["RunReader", "Source"]

log = logging.getLogger(__name__)

_STEP = re.compile(r"step-(\d+)")
_CACHED_FILES = 8  # parsed trajectory files kept in memory (a step of a big run can be tens of MB)


@dataclass(frozen=True)
class Source:
    """A set of episodes to look at: one training step's kept rollouts, or one evaluation."""

    id: str
    kind: Literal["train", "eval"]
    label: str
    step: int | None
    path: Path

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("path")
        return d


Kind = Literal["run", "eval", "file", "waiting"]
_RUN_START_FILES = ("config.yaml", "run.lock", "run_identity.json", "ledger.jsonl")
"""What a run (or an evaluation) writes before anything there is to look at."""


def _kind_of(root: Path) -> Kind:
    if root.is_file():
        return "file"
    if (root / "trajectories.jsonl").is_file() and not (root / "metrics.jsonl").is_file():
        return "eval"
    if any((root / name).exists() for name in ("metrics.jsonl", "rollouts", "eval", "eval.jsonl")):
        return "run"
    return "waiting"


def _run_starting(root: Path) -> bool:
    """Whether a folder with nothing to look at yet is a run that has only started. An empty folder
    is not: a run writes its config.yaml as it makes its directory, and a mistyped or unrelated
    empty folder would otherwise be waited on forever."""
    return any((root / name).exists() for name in _RUN_START_FILES)


def _step_of(name: str) -> int | None:
    match = _STEP.search(name)
    return int(match.group(1)) if match else None


def _short(value: object, limit: int) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    text = text.strip()
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _count(value: object) -> float:
    """A metric the list adds up: a number, or 0 for anything else a file may hold."""
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


class RunReader:
    """Reads one run directory, eval directory or trajectory file (see the module docstring)."""

    def __init__(self, path: str | Path) -> None:
        root = Path(path).expanduser()
        if not root.exists():
            raise ConfigError(f"'{path}' does not exist; give a run directory (runs/NAME), an eval directory "
                              "or a trajectories .jsonl file.")
        self.root = root.resolve()
        self._kind = _kind_of(self.root)
        if self._kind == "waiting" and not _run_starting(self.root):
            raise ConfigError(
                f"'{path}' holds no run (metrics.jsonl, rollouts/, eval/) and no evaluation (trajectories.jsonl); "
                "give the directory 'agentrl run' or 'agentrl eval' wrote (it prints it at the end)."
            )
        self._lock = threading.Lock()
        self._files: dict[Path, tuple[tuple[int, int], list[dict[str, Any]], int]] = {}
        self._pieces: TokenPieces | None = None
        self._pieces_tried = False

    # ── what there is ──────────────────────────────────────────────────────────────────────
    @property
    def kind(self) -> Kind:
        """`run`, `eval`, `file`, or `waiting`: a run or evaluation that has written nothing to look at
        yet (looked at again at every call, so the page fills in as the run writes)."""
        if self._kind == "waiting":
            self._kind = _kind_of(self.root)
        return self._kind

    def sources(self) -> list[Source]:
        """Every set of episodes, training steps first (by step), then evaluations (by step)."""
        root = self.root
        if self.kind == "file":
            return [Source("file", "eval" if "eval" in root.name or root.name == "trajectories.jsonl" else "train",
                           root.name, _step_of(root.stem), root)]
        if self.kind == "eval":
            return [Source("eval", "eval", "evaluation", None, root / "trajectories.jsonl")]
        out: list[Source] = []
        if self.kind == "waiting":
            return out
        for path in sorted((root / "rollouts").glob("step-*.jsonl")):
            step = _step_of(path.stem)
            label = f"step {step} rollouts" + (" (the run stopped here)" if path.stem.endswith("-stopped") else "")
            out.append(Source(f"rollouts/{path.stem}", "train", label, step, path))
        for path in sorted((root / "eval").glob("step-*/trajectories.jsonl")):
            step = _step_of(path.parent.name)
            label = "eval before training" if step == 0 else f"eval after step {step}"
            out.append(Source(f"eval/{path.parent.name}", "eval", label, step, path))
        return out

    def source(self, source_id: str) -> Source:
        for s in self.sources():
            if s.id == source_id:
                return s
        raise KeyError(source_id)

    def summary(self) -> dict[str, Any]:
        """The run's name, kind, config highlights, sources and whether it has curves."""
        kind = self.kind
        config = self._config()
        report = self._json(self.root / "report.json") if kind == "eval" else None
        result = self._json(self.root / "result.json") if kind == "run" else None
        highlights = {}
        if config:
            for section, key in (("env", "name"), ("model", "path"), ("run", "mode"), ("run", "total_steps"),
                                 ("data", "prompts_per_step"), ("rollout", "samples_per_prompt"),
                                 ("algorithm", "advantage"), ("trainer", "lr"), ("run", "keep_rollouts")):
                value = (config.get(section) or {}).get(key)
                if value is not None:
                    highlights[f"{section}.{key}"] = value
        return {
            "name": self.root.name if kind != "file" else self.root.stem,
            "path": str(self.root),
            "kind": kind,
            "config": highlights,
            "report": report,
            "result": result,
            "sources": [s.to_json() for s in self.sources()],
            "has_metrics": (self.root / "metrics.jsonl").is_file() if kind == "run" else False,
        }

    # ── curves ──────────────────────────────────────────────────────────────────────────────
    def dashboard(self) -> dict[str, Any]:
        """The dashboard panels with their curves (x: steps done), and the steps that have rollouts."""
        records = read_metrics(self.root / "metrics.jsonl") if (self.root / "metrics.jsonl").is_file() else []
        evals = read_evals(self.root / "eval.jsonl") if self.kind == "run" else []
        panels = []
        for d in dashboard_panels(records, evals):
            panels.append({
                "title": d.panel.title, "hint": d.panel.hint, "stacked": d.panel.stacked, "empty": d.empty,
                "series": {k: {"x": xs, "y": ys} for k, (xs, ys) in d.series.items()},
            })  # fmt: skip
        return {"panels": panels, "steps": len(records)}

    # ── episodes ────────────────────────────────────────────────────────────────────────────
    def episodes(self, source_id: str) -> list[dict[str, Any]]:
        """A short summary of each episode of a source: what the list shows and filters on."""
        return [self._summary(i, r) for i, r in enumerate(self._records(self.source(source_id).path))]

    def skipped_lines(self, source_id: str) -> int:
        """How many lines of a source's file are not episodes (cut by a crash, or foreign): left out
        of `episodes`, and counted so that the page can say so."""
        return self._read(self.source(source_id).path)[1]

    def episode(self, source_id: str, index: int) -> dict[str, Any]:
        """One whole episode (its trajectory-file line), and for a training step's episode the
        step's on-policy verdict (`onpolicy`: its `onpolicy/*` metrics, {} when it has none)."""
        source = self.source(source_id)
        records = self._records(source.path)
        if not 0 <= index < len(records):
            raise KeyError(index)
        record = records[index]
        if any("pieces" not in s for s in record["segments"]):
            record = self._with_pieces(record)
        if source.kind == "train" and source.step is not None:
            record = {**record, "onpolicy": self.step_metrics(source.step, "onpolicy/")}
        return record

    def step_metrics(self, step: int, prefix: str) -> dict[str, float]:
        """The metrics named `prefix...` of training step `step` (1-based, as the rollout files
        count; metrics.jsonl counts from 0), {} when the step has none."""
        path = self.root / "metrics.jsonl"
        if self.kind != "run" or not path.is_file():
            return {}
        for record in read_metrics(path):
            if record.get("step") == step - 1:
                return {k: v for k, v in record.items() if k.startswith(prefix)}
        return {}

    @staticmethod
    def _summary(index: int, r: dict[str, Any]) -> dict[str, Any]:
        metrics = r.get("metrics") or {}
        answer = ""
        # The messages end with the model's turns; a prompt's own assistant messages (worked
        # examples, an earlier conversation) come before them and are never its answer.
        if max((s["turn"] for s in r["segments"]), default=0) > 0:
            for m in reversed(r.get("messages") or []):
                if m.get("role") == "assistant":
                    answer = str(m.get("content") or "")
                    break
        kept_as = r.get("kept_as")
        return {
            "index": index,
            "episode_id": r.get("episode_id", ""),
            "group_id": r.get("group_id", ""),
            "status": r.get("status", ""),
            "kept_as": [str(k) for k in kept_as] if isinstance(kept_as, list) else [],
            "trained": bool(r.get("trained")),
            "reward": r.get("reward"),
            "finish_reason": r.get("finish_reason") or "none",
            "fault": r.get("fault") or "none",
            "error": _short(r.get("error") or "", 200),
            "data_source": r.get("data_source") or "unknown",
            "ground_truth": _short(r.get("ground_truth"), 80) if r.get("ground_truth") is not None else "",
            "answer": _short(answer, 140),
            "num_tokens": r.get("num_tokens", 0),
            "num_sampled": r.get("num_sampled", 0),
            "num_turns": r.get("num_turns", 0),
            "tool_calls": _count(metrics.get("tool_calls")),
            "tool_errors_model": _count(metrics.get("tool_errors_model")),
            "tool_errors_infra": _count(metrics.get("tool_errors_infra")),
            "parse_errors": _count(metrics.get("parse_errors")),
        }

    # ── files ───────────────────────────────────────────────────────────────────────────────
    def _records(self, path: Path) -> list[dict[str, Any]]:
        return self._read(path)[0]

    def _read(self, path: Path) -> tuple[list[dict[str, Any]], int]:
        """A file's episodes and how many of its lines are not episodes, parsed once per version."""
        stat = path.stat()
        stamp = (stat.st_mtime_ns, stat.st_size)
        with self._lock:
            cached = self._files.get(path)
            if cached is not None and cached[0] == stamp:
                self._files[path] = self._files.pop(path)
                return cached[1], cached[2]
        records, skipped = scan_trajectory_file(path)
        with self._lock:
            self._files.pop(path, None)
            self._files[path] = (stamp, records, skipped)
            while len(self._files) > _CACHED_FILES:  # the least recently read go first
                del self._files[next(iter(self._files))]
        return records, skipped

    def _config(self) -> dict[str, Any]:
        """The resolved config of the run or evaluation (a file's: the nearest one above it)."""
        folders = ([self.root] if self.root.is_dir() else []) + list(self.root.parents)[:3]
        for folder in folders:
            path = folder / "config.yaml"
            if path.is_file():
                try:
                    loaded = yaml.safe_load(path.read_text())
                except yaml.YAMLError:
                    return {}
                return loaded if isinstance(loaded, dict) else {}
        return {}

    @staticmethod
    def _json(path: Path) -> object:
        try:
            return json.loads(path.read_text()) if path.is_file() else None
        except json.JSONDecodeError:
            return None

    def _with_pieces(self, record: dict[str, Any]) -> dict[str, Any]:
        """A record from before tokens carried their text: decode them with the run's tokenizer,
        when its config names one that is on this machine."""
        pieces = self._tokenizer_pieces()
        if pieces is None:
            return record
        record = dict(record)
        segments = []
        for seg in record["segments"]:
            seg = dict(seg)
            seg["pieces"] = pieces(seg["ids"])
            seg["text"] = "".join(seg["pieces"])
            segments.append(seg)
        record["segments"] = segments
        return record

    def _tokenizer_pieces(self) -> TokenPieces | None:
        with self._lock:
            if self._pieces_tried:
                return self._pieces
            self._pieces_tried = True
        model = self._config().get("model") or {}
        name = model.get("tokenizer") or model.get("path")
        candidates = [Path(str(name)).expanduser()] if name else []
        if name:
            from agentrl.models import cache_dir

            candidates.append(cache_dir() / str(name))
        for folder in candidates:
            if (folder / "tokenizer_config.json").is_file() or (folder / "tokenizer.json").is_file():
                try:
                    from transformers import AutoTokenizer

                    self._pieces = TokenPieces(AutoTokenizer.from_pretrained(str(folder)))
                except (OSError, ValueError) as exc:
                    log.warning("cannot load the tokenizer at %s to decode old trajectory files: %s", folder, exc)
                break
        return self._pieces
