"""`agentrl sft` and `agentrl dpo`: train the policy on rows (demonstrations, preference pairs) through the trainer backend.

`run_offline(config, command)` is the whole job, on this process: it checks that
`algorithm.objective` belongs to the command (`sft` for `agentrl sft`; `dpo`, `ipo`, `dpo_norm` for
`agentrl dpo`), renders `data.train_files` and `data.val_files` into ledgers
(`agentrl.offline_rows`; a row longer than `rollout.max_total_tokens` is a bad row, as is a
malformed one, named by file, row and field), builds the configured backend (`make_backend`, the
one `agentrl run` trains with) and runs `run.total_steps` steps of `data.prompts_per_step` rows
each (`trainer.offline_step`), in an order drawn from `run.seed` each epoch (`data.shuffle`).

What it writes is what a run writes, in a run directory (`run.output_dir`/`run.name`, default
`sft-<time>` or `dpo-<time>`, owned through `run.lock`): the resolved config, `metrics.jsonl`
(through `MetricsLogger`, so `agentrl plot` draws it), each step's rows as ledgers in
`rollouts/step-N.jsonl` (`run.keep_rollouts` of them, for `agentrl view`: the assistant's tokens are the
sampled ones, the ones that carried loss), `eval.jsonl` with the held-out metrics
before the first step, every `run.eval_every` steps and after the last (SFT: the NLL of the
held-out assistant tokens; preferences: the preference loss, margin, accuracy and the policy's own
log-probability margin), checkpoints every `run.save_every` steps and at the end
(`CheckpointStore`, resumed with `run.resume`), and the final policy as a complete Hugging Face
directory `weights/version-<steps>`, which `agentrl run model.path=...` starts from.

The reference of the preference objectives is the initial weights, kept as numbers, not as a model:
before the first step each completion's summed logprob under them is computed once (one forward
without a graph over the train and held-out pairs) and written to `reference_logprobs.jsonl` in the
run directory, which a resume reads back (the rows must be the same ones). That costs 16 bytes per
pair in memory and about 150 on disk, instead of a frozen copy of the model (its weights in memory,
plus a forward per step).

Not here yet: more than one trainer process (`trainer.num_processes > 1` is refused: the Ray
trainer group of `agentrl run` does not take these steps yet), pairs built from a run's own episodes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from agentrl.config import AgentRLConfig, save_config
from agentrl.errors import ConfigError
from agentrl.offline_rows import PreferencePair, load_demonstrations, load_preferences
from agentrl.orchestration.build import model_and_template
from agentrl.orchestration.checkpoints import CheckpointStore
from agentrl.orchestration.run_lock import RunLock
from agentrl.records.metrics import MetricsLogger
from agentrl.records.run_files import append_text, replace_text
from agentrl.records.trajectory_log import RolloutLog
from agentrl.types import Trajectory

__all__ = ["COMMAND_OF", "REFERENCE_FILE", "OfflineResult", "check_offline_config", "run_offline"]

log = logging.getLogger("agentrl.run")

Command = Literal["sft", "dpo"]
COMMAND_OF: dict[str, Command] = {"sft": "sft", "dpo": "dpo", "ipo": "dpo", "dpo_norm": "dpo"}
"""`algorithm.objective` -> the command that trains it."""
REFERENCE_FILE = "reference_logprobs.jsonl"


@dataclass
class OfflineResult:
    """What a finished `agentrl sft` / `agentrl dpo` reports."""

    run_dir: str
    objective: str
    steps_done: int
    weights_dir: str
    heldout_before: dict[str, float] = field(default_factory=dict)
    heldout_after: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0

    def summary(self) -> str:
        parts = [f"{self.objective} run {self.run_dir}: {self.steps_done} steps"]
        key = "nll" if self.objective == "sft" else "logp_margin"
        if key in self.heldout_before and key in self.heldout_after:
            what = "held-out NLL" if key == "nll" else "held-out log-probability margin (chosen - rejected)"
            parts.append(f"{what} {self.heldout_before[key]:.4g} -> {self.heldout_after[key]:.4g}")
        parts.append(f"{self.seconds / 60:.1f} min")
        return ", ".join(parts)


def check_offline_config(config: AgentRLConfig, command: Command) -> None:
    """Refuse what `agentrl <command>` cannot do with `config`, naming the key."""
    objective = config.algorithm.objective
    if COMMAND_OF.get(objective) != command:
        choices = ", ".join(k for k, v in COMMAND_OF.items() if v == command)
        hint = ("'agentrl run' trains it" if objective == "rl"
                else f"'agentrl {COMMAND_OF[objective]}' trains it")
        raise ConfigError(f"algorithm.objective={objective} is not trained by 'agentrl {command}' ({hint}); "
                          f"give algorithm.objective={choices.split(', ')[0]}" + (f" (or one of {choices})"
                                                                                 if "," in choices else "") + ".")
    if not config.data.train_files:
        raise ConfigError(f"data.train_files is empty: give the {'demonstration' if command == 'sft' else 'preference'} "
                          "rows to train on (docs/preferences.md shows the formats).")
    if config.trainer.num_processes != 1:
        raise ConfigError(f"trainer.num_processes={config.trainer.num_processes}: 'agentrl {command}' trains in one "
                          "process for now; set trainer.num_processes=1.")
    if command == "dpo":
        from agentrl.trainer.offline_step import check_preference_schedule

        check_preference_schedule(config.trainer)


def _order(n: int, step: int, batch: int, seed: int, shuffle: bool) -> list[int]:
    """The row indices of step `step`: consecutive slices of one permutation per epoch (drawn from `seed`)."""
    out: list[int] = []
    start = step * batch
    while len(out) < batch:
        epoch, offset = divmod(start + len(out), n)
        perm = list(range(n))
        if shuffle:
            random.Random(seed * 1_000_003 + epoch).shuffle(perm)
        out.extend(perm[offset: offset + batch - len(out)])
    return out


@dataclass(frozen=True)
class _RowIndex:
    index: int


@dataclass(frozen=True)
class _RowGroup:
    """One row of a step as `RolloutLog` takes a group: a demonstration, or a pair's two ledgers."""

    prompt: _RowIndex
    trajectories: list[Trajectory]


class _OfflineJob:
    """The rows, the backend and the records of one offline run (see the module docstring)."""

    def __init__(self, config: AgentRLConfig, command: Command) -> None:
        self.config = config
        self.command = command
        self.objective = config.algorithm.objective
        self.model_path, self.template = model_and_template(config)
        data, rollout = config.data, config.rollout
        load = load_demonstrations if command == "sft" else load_preferences

        def rows_of(files: list[str]) -> Any:
            return load(files, self.template, max_tokens=rollout.max_total_tokens,
                        limit_name="rollout.max_total_tokens", skip_bad_rows=data.skip_bad_rows)

        train = rows_of(data.train_files)
        val = rows_of(data.val_files) if data.val_files else None
        for rows in (train, val):
            for skipped in rows.skipped if rows is not None else []:
                log.warning("skipped bad row %s", skipped)
        self.train = list(train.examples)
        self.val = list(val.examples)[: data.num_val_rows] if val is not None else []
        self.template_mismatches = train.template_mismatches
        self.backend: Any = None
        self.reference: Any = None  # (pairs, 2) tensors: train, held-out
        self.val_reference: Any = None

    # ── rows ────────────────────────────────────────────────────────────────────────────────
    @staticmethod
    def pairs(rows: list[PreferencePair]) -> list[tuple[Trajectory, Trajectory]]:
        return [(p.chosen, p.rejected) for p in rows]

    def sources(self, rows: list[Any]) -> list[str]:
        return [str(r.info["source"]) if isinstance(r, Trajectory) else r.source for r in rows]

    # ── the reference of the preference objectives ──────────────────────────────────────────
    def compute_reference(self, rows: list[PreferencePair]) -> Any:
        import torch

        from agentrl.trainer.offline_step import score_rows

        chunk = max(1, self.config.data.prompts_per_step)
        out = []
        for k in range(0, len(rows), chunk):
            pairs = self.pairs(rows[k: k + chunk])
            sums, _ = score_rows(self.backend, [c for c, _ in pairs] + [r for _, r in pairs])
            out.append(torch.stack([sums[: len(pairs)], sums[len(pairs):]], 1))
        return torch.cat(out) if out else torch.zeros((0, 2), dtype=torch.float64)

    def reference_of(self, run_dir: Path, resuming: bool) -> None:
        """Compute the reference sums with the initial weights and store them, or read them back on resume."""
        import torch

        path = run_dir / REFERENCE_FILE
        splits = {"train": self.train, "val": self.val}
        if resuming:
            if not path.is_file():
                raise ConfigError(f"{path} is missing: the reference log-probabilities of this run cannot be "
                                  "recomputed from a checkpoint (they are the initial weights'); start a new run.")
            records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            for split, rows in splits.items():
                mine = [r for r in records if r["split"] == split]
                if [r["source"] for r in mine] != self.sources(rows):
                    raise ConfigError(f"The {split} rows differ from those {path} was computed for: a resume must "
                                      "train on the same files; start a new run for new data.")
                table = torch.tensor([[r["chosen"], r["rejected"]] for r in mine], dtype=torch.float64)
                setattr(self, "reference" if split == "train" else "val_reference", table.reshape(-1, 2))
            return
        start = time.perf_counter()
        self.reference = self.compute_reference(self.train)
        self.val_reference = self.compute_reference(self.val)
        lines = []
        for split, rows, table in (("train", self.train, self.reference), ("val", self.val, self.val_reference)):
            for source, (chosen, rejected) in zip(self.sources(rows), table.tolist(), strict=True):
                lines.append(json.dumps({"split": split, "source": source, "chosen": chosen, "rejected": rejected}))
        replace_text(path, "".join(line + "\n" for line in lines), run_dir)
        log.info("reference log-probabilities of %d + %d pairs under the initial weights: %s (%.1f s)",
                 len(self.train), len(self.val), path, time.perf_counter() - start)

    # ── steps and evaluations ───────────────────────────────────────────────────────────────
    def rows_of(self, step: int) -> list[int]:
        """The train rows of step `step` (0-based)."""
        config = self.config
        batch = min(config.data.prompts_per_step, len(self.train))
        return _order(len(self.train), step, batch, config.run.seed, config.data.shuffle)

    def step(self, step: int) -> dict[str, float]:
        from agentrl.trainer.offline_step import preference_step, sft_step

        config, index = self.config, self.rows_of(step)
        if self.command == "sft":
            return sft_step(self.backend, [self.train[i] for i in index], config.algorithm, config.trainer)
        return preference_step(self.backend, self.pairs([self.train[i] for i in index]), self.reference[index],
                               config.algorithm, config.trainer)

    def groups_of(self, step: int) -> list[_RowGroup]:
        """Step `step`'s rows as the groups `agentrl view` shows (a pair: chosen, then rejected)."""
        out = []
        for i in self.rows_of(step):
            row = self.train[i]
            trajectories = [row] if isinstance(row, Trajectory) else [row.chosen, row.rejected]
            out.append(_RowGroup(_RowIndex(i), trajectories))
        return out

    def heldout(self) -> dict[str, float]:
        from agentrl.trainer.offline_step import heldout_preferences, heldout_sft

        if not self.val:
            return {}
        if self.command == "sft":
            return heldout_sft(self.backend, self.val)
        return heldout_preferences(self.backend, self.pairs(self.val), self.val_reference, self.config.algorithm)


def _run_dir(config: AgentRLConfig, command: Command) -> Path:
    name = config.run.name or f"{command}-{time.strftime('%Y%m%d-%H%M%S')}"
    return Path(config.run.output_dir) / name


def run_offline(config: AgentRLConfig, command: Command) -> OfflineResult:
    """Train `config.algorithm.objective` on rows (see the module docstring); return what was done."""
    start = time.perf_counter()
    check_offline_config(config, command)
    job = _OfflineJob(config, command)
    run = config.run
    run_dir = _run_dir(config, command)
    lock = RunLock.acquire(run_dir, f"agentrl {command}")
    try:
        store = CheckpointStore(run_dir / "checkpoints", keep=run.keep_checkpoints)
        checkpoint = store.resumable() if run.resume else None
        if run.resume and checkpoint is None:
            raise ConfigError(f"run.resume=true but {run_dir} holds no checkpoint to continue from; drop resume=true "
                              "to start it.")
        if not run.resume and store.complete():
            raise ConfigError(f"{run_dir} holds the checkpoints of an earlier run: continue it with resume=true, or "
                              "give another run.name.")
        save_config(config, run_dir)
        from agentrl.trainer.backend import make_backend

        job.backend = make_backend(config, job.model_path)
        if command == "dpo":
            job.reference_of(run_dir, resuming=checkpoint is not None)
        steps_done = 0
        if checkpoint is not None:
            job.backend.load(checkpoint.path / "trainer")
            steps_done = checkpoint.step
            log.info("resumed from %s after %d step(s)", checkpoint.path, steps_done)
        # The RL console line (reward, solved, ...) says nothing here: this job logs its own line.
        logger = MetricsLogger(run_dir, [s for s in run.loggers if s != "console"], total_steps=run.total_steps,
                               start_step=steps_done, run_name=run_dir.name)
        console = "console" in run.loggers
        # Each step's rows, rendered, for `agentrl view` (which tokens carried loss), as `run.keep_rollouts` says.
        rollouts = RolloutLog(run_dir, job.template.tokenizer, run.keep_rollouts, seed=run.seed)
        logger.truncate_after(steps_done - 1)
        before: dict[str, float] = {}
        try:
            if steps_done == 0:
                before = _evaluate(job, run_dir, 0, logger, console)
            after: dict[str, float] = {}
            for step in range(steps_done, run.total_steps):
                step_start = time.perf_counter()
                metrics = job.step(step)
                metrics["perf/step_s"] = time.perf_counter() - step_start
                metrics["data/template_mismatch_rows"] = float(job.template_mismatches)
                logger.log(step, metrics)
                rollouts.write_step(step, job.groups_of(step))
                if console:
                    log.info("step %d/%d  %s", step + 1, run.total_steps, _line(metrics))
                done = step + 1
                if done == run.total_steps or (run.eval_every and done % run.eval_every == 0):
                    after = _evaluate(job, run_dir, done, logger, console)
                if done == run.total_steps or (run.save_every and done % run.save_every == 0):
                    _save(job, store, done)
            weights = _export(job, run_dir, run.total_steps)
        finally:
            logger.close()
        return OfflineResult(str(run_dir), job.objective, run.total_steps, str(weights), before, after,
                             time.perf_counter() - start)
    finally:
        lock.release()


_CONSOLE = (("loss", "prefs/loss"), ("margin", "prefs/margin"), ("acc", "prefs/accuracy"), ("nll", "actor/nll"),
            ("gnorm", "actor/grad_norm"), ("lr", "actor/lr"), ("s", "perf/step_s"))


def _line(metrics: dict[str, float]) -> str:
    return " ".join(f"{name} {metrics[key]:.4g}" for name, key in _CONSOLE if key in metrics)


def _evaluate(job: _OfflineJob, run_dir: Path, after_steps: int, logger: MetricsLogger,
              console: bool) -> dict[str, float]:
    result = job.heldout()
    if result:
        append_text(run_dir / "eval.jsonl", json.dumps({"step": after_steps, **result}) + "\n", run_dir)
        logger.log_event(after_steps, result, "eval")
        if console:
            log.info("held-out after %d step(s): %s", after_steps, " ".join(f"{k} {v:.4g}" for k, v in result.items()))
    return result


def _save(job: _OfflineJob, store: CheckpointStore, steps_done: int) -> None:
    async def write(path: Path) -> None:
        job.backend.save(path, {"steps_done": steps_done})

    state = {"steps_done": steps_done, "trainer_version": steps_done, "ledger": {},
             "sampler": {"order": "per-epoch permutation", "seed": job.config.run.seed, "rows": len(job.train)}}
    asyncio.run(store.save(steps_done, write, state))


def _export(job: _OfflineJob, run_dir: Path, version: int) -> Path:
    """The policy as a complete Hugging Face directory `weights/version-N` (what `model.path` takes)."""
    from agentrl.orchestration.trainer_group import export_assets
    from agentrl.weights import FilesCheckpointEngine

    files = FilesCheckpointEngine(directory=run_dir / "weights", keep_last=None,
                                  bucket_bytes=job.config.weights.bucket_mb << 20,
                                  assets=export_assets(job.template, job.model_path))
    files.send(job.backend.export_weights(), version)
    path = files.path_for(version)
    log.info("policy written to %s; start RL from it with: agentrl run <config> model.path=%s", path, path)
    return path
