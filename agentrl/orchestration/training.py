"""A run's books and its steps: what the scheduler calls once everything the run needs is up.

`RunBooks` is made from the `Job` and the run directory before anything starts: the prompt ledger
(closing the prompts a killed session left in flight), the sampler (its data position restored
from the checkpoint by `restore`), the infrastructure-failure monitor and the rollout log.
`TrainingSteps` is made by the `Run` (`driver.py`) from the books and the pieces it started (the
trainer group, the router, the rollout worker, the metrics logger); it holds the `Scheduler` and
the hooks it calls: whether a prompt may be rolled out (not when its first prompt leaves no room
under `rollout.max_total_tokens`: `PromptMeter`), a group's rollout (with `distill`, scored by the
job's teacher before it is counted: `teacher.Teacher.score_group`) and its verdict, the update, the push of new weights, and
after each step the metrics, the held-out evaluation and the checkpoint; while a step or an
evaluation runs, a `ProgressTicker` says where it stands on the console. It starts and closes
nothing: the `Run` owns every process and connection these hooks use.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentrl.envs import Env
from agentrl.errors import InfraFailureError
from agentrl.inference.router import Router
from agentrl.orchestration.actor_watch import run_watched
from agentrl.orchestration.build import Job
from agentrl.orchestration.checkpoints import Checkpoint, CheckpointStore
from agentrl.orchestration.evaluate import check_infra_failures, evaluate
from agentrl.orchestration.infra import InfraMonitor
from agentrl.orchestration.ledger import (
    LedgerError,
    PromptLedger,
    PromptRef,
    PromptSampler,
    close_orphans,
    next_session,
)
from agentrl.orchestration.onpolicy_gate import (
    allowed_staleness,
    check_gated_share,
    gated_groups,
)
from agentrl.orchestration.progress import ProgressTicker
from agentrl.orchestration.prompt_length import PromptMeter
from agentrl.orchestration.run_commands import resume_command
from agentrl.orchestration.schedule import GroupResult, Scheduler, StepRecord, Verdict, default_classify
from agentrl.orchestration.served_policy import served_check_for_run
from agentrl.records.metrics import MetricsLogger, episode_metrics, segment_metrics
from agentrl.records.run_files import append_text
from agentrl.records.trajectory_log import RolloutLog, TrainerTokens
from agentrl.rollout import RolloutWorker
from agentrl.rollout.worker import group_seed
from agentrl.types import StepReport, Trajectory, final_segments, is_first_segment

__all__ = ["RunBooks", "TrainingSteps", "score_text"]

log = logging.getLogger("agentrl.run")


def _prompt_too_long(t: Trajectory) -> bool:
    """The AgentLoop ended the episode at reset: its prompt left no room to sample a token."""
    return t.fault == "request" and t.num_sampled == 0 and t.info.get("truncated_by") == "rollout.max_total_tokens"


def score_text(result: dict[str, float | None]) -> str:
    """pass@1 of an evaluation, or why there is none (never a 0 that was not measured)."""
    value = result.get("pass_at_1")
    if value is None:
        return f"not measured ({int(result.get('infra_failed') or 0)} infra-failed episodes)"
    return f"{value:.3f}"


class RunBooks:
    """What a run accounts for, made before anything starts (see the module docstring)."""

    def __init__(self, job: Job, run_dir: Path, store: CheckpointStore, checkpoint: Checkpoint | None) -> None:
        config = job.config
        self.run_dir = run_dir
        self.store = store
        self.checkpoint = checkpoint
        self.resume_command = resume_command(config, run_dir)
        """The command that continues this run, for the messages of what stops it."""
        # Indexed by dataset row number (the ledger's indices); None where a malformed row was skipped.
        self.train_rows = job.train_rows
        self.val_rows: list[dict[str, Any]] = job.val_rows
        for note in job.notes:
            log.warning("%s", note)
        self.infra = InfraMonitor(config.run.max_infra_failure_rate, config.run.infra_failure_window,
                                  min_episodes=config.data.prompts_per_step * config.rollout.samples_per_prompt,
                                  resume_command=self.resume_command)
        self.sampler = PromptSampler(len(self.train_rows), seed=config.run.seed, shuffle=config.data.shuffle,
                                     skip=[s.index for s in job.train_skipped])
        journal = run_dir / "ledger.jsonl"
        self.session = next_session(journal)
        # A session killed outright (SIGKILL, a power cut) left prompts taken and never closed.
        orphans = close_orphans(journal, f"the run was killed while it was in flight; closed when session "
                                         f"{self.session} started")
        if orphans:
            log.warning("%d prompt(s) were in flight when an earlier session of this run was killed; they are "
                        "closed as unfinished in ledger.jsonl", orphans)
        self.ledger = PromptLedger(journal, session=self.session)
        self.ledger.hold_trained = True  # a step's `trained` lines follow its metrics row (`after_step`)
        journal.touch()  # the run's books exist from its start, even if it stops before taking a prompt
        if checkpoint is None:  # a resumed run has them in its checkpoint's ledger
            for bad in job.train_skipped:
                self.ledger.skipped(bad.index, str(bad))
        self.rollouts = RolloutLog(run_dir, job.template.tokenizer, config.run.keep_rollouts, seed=config.run.seed)

    def restore(self, checkpoint: Checkpoint) -> tuple[int, int, dict[str, float | None]]:
        """Take the data position and the ledger from `checkpoint`; (steps done, trainer version, the
        evaluation before the first step)."""
        state = checkpoint.state  # read and checked before anything started
        self.sampler.load_state(state["sampler"])
        self.ledger.load_state(state["ledger"])
        # Prompts that were in flight at the checkpoint are taken again first. The journal already
        # holds their fate (what the earlier session did with them, or `unfinished`), so only the
        # books change here.
        retries = [
            self.ledger.unfinished(PromptRef(e.epoch, e.index, e.attempt), "in flight at the checkpoint; "
                                   "requeued on resume", journal=False)
            for e in list(self.ledger.entries.values()) if e.status == "in_flight"
        ]
        self.sampler.requeue(retries, front=True)
        return int(state["steps_done"]), int(state["trainer_version"]), state.get("eval_before", {})


class TrainingSteps:
    """The scheduler and its hooks over a started run (see the module docstring)."""

    def __init__(self, job: Job, books: RunBooks, *, trainer: Any, router: Router, worker: RolloutWorker,
                 logger: MetricsLogger, make_env: Callable[[], Env], start_step: int, version: int,
                 eval_before: dict[str, float | None]) -> None:
        config = job.config
        self.job = job
        self.config = config
        self.books = books
        self.trainer = trainer
        self.router = router
        self.worker = worker
        self.logger = logger
        self.make_env = make_env
        self.start_step = start_step
        self.colocated = job.plan is not None and job.plan.colocated
        self.eval_before = eval_before
        self.eval_after: dict[str, float | None] = {}
        self.steps_done = 0  # after each step, the steps the run has done
        self.last_saved_step = -1
        self.last_eval_step = -1
        self._trained_rows: tuple[int, dict[int, int]] = (-1, {})
        # Is the served policy the trained one? Checked after every push, before the next batch samples.
        self.served_check, served_note = served_check_for_run(
            config, job.model_path, job.template, router, resume_command=books.resume_command,
            device=job.plan.device if job.plan is not None else "cpu")
        log.info("served-policy check: %s", served_note)
        self._served_metrics: dict[str, float] = {}
        self._sync_metrics: dict[str, float] = {}  # the last push's phases, as its servers report them
        if self.served_check is not None:  # no replica serves a version the check has not admitted it at
            router.require_verified(self._verify_replica)
        # By step: each trained trajectory's sampled tokens out of the loss, by cause (by `id`).
        self._masked_tokens: dict[int, dict[int, dict[str, int]]] = {}
        self.meter = PromptMeter(job.template, make_env, config.rollout.max_total_tokens)
        self.ticker = ProgressTicker()  # ticks while the console is one of the run's loggers
        self.scheduler = Scheduler(
            mode=config.run.mode, prompts_per_step=config.data.prompts_per_step, sampler=books.sampler,
            ledger=books.ledger, rollout=self.rollout, train=self.train, push=self.push,
            after_step=self.after_step, classify=self.classify, max_staleness=config.run.max_staleness,
            partial_rollout=config.run.partial_rollout, version=version,
            max_skipped_steps=config.run.max_skipped_steps, resume_command=books.resume_command,
            admit=self.admit,
        )  # fmt: skip

    async def run(self) -> None:
        """The held-out evaluation before the first step (of a fresh run), then every step. Colocated,
        while the trainer's process (and the engine in it) is watched: its death stops them at once
        (`actor_watch.run_watched`), the prompts in flight closed as `unfinished` naming it."""
        if not self.colocated:
            await self._run_steps()
            return
        await run_watched(self._run_steps(), self.trainer.watch(), on_death=self.scheduler.stop_because)

    async def _run_steps(self) -> None:
        ticking = asyncio.create_task(self.ticker.run()) if "console" in self.logger.sinks else None
        try:
            if self.books.val_rows and self.start_step == 0:
                self.eval_before = await self.evaluate(0)
                self.logger.log_event(0, {k: v for k, v in self.eval_before.items() if v is not None}, "eval")
            self._rollout_phase(self.start_step)
            await self.scheduler.run(self.start_step, self.config.run.total_steps)
        finally:
            if ticking is not None:
                ticking.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await ticking
            await self.meter.aclose()

    def _rollout_phase(self, step: int) -> None:
        episodes = self.config.data.prompts_per_step * self.config.rollout.samples_per_prompt
        self.ticker.begin(f"step {step + 1}/{self.config.run.total_steps}: rollouts", total=episodes)

    # ── pieces the scheduler calls ──────────────────────────────────────────────────────────
    async def rollout(self, ref: PromptRef) -> list[Any]:
        if self.router.fatal is not None:  # every server is gone for good: say so, do not fail episodes
            raise self.router.fatal
        books = self.books
        row = books.train_rows[ref.index]
        if row is None:  # the sampler skips them: a bug in the books, not a fault of the run
            raise LedgerError(f"the sampler handed out dataset row {ref.index}, which was skipped as malformed")
        index = ref.epoch * len(books.train_rows) + ref.index
        seed = group_seed(self.config.run.seed, index * 16 + ref.attempt)
        group = await self.worker.run_group(row, self.config.rollout.samples_per_prompt, seed=seed, group_id=ref.key)
        if self.job.teacher is not None:  # distillation: the teacher scores the group's sampled tokens
            await self.job.teacher.score_group(group)
        self.ticker.advance(len(group))
        books.infra.record(final_segments(group))  # an agent episode in segments is one episode
        try:
            books.infra.check()
        except InfraFailureError:
            # The step never reaches after_step: keep its failed episodes for `agentrl view` here.
            path = books.rollouts.write_stopped(self.steps_done, list(books.infra.window))
            log.error("the infrastructure-failed episodes that stopped the run are in %s", path)
            raise
        return group

    def admit(self, ref: PromptRef) -> str | None:
        """Why the prompt must not be rolled out: its first prompt leaves no room to sample a token."""
        row = self.books.train_rows[ref.index]
        return None if row is None else self.meter.too_long(ref.index, row)

    def classify(self, group: GroupResult) -> Verdict:
        verdict = default_classify(group)
        if verdict[0] != "ok":
            return verdict
        valid = [t for t in group.trajectories if t.trainable]
        if max(t.prompt_length for t in valid if is_first_segment(t)) > self.config.data.max_prompt_tokens:
            return "filtered", f"prompt longer than data.max_prompt_tokens={self.config.data.max_prompt_tokens}"
        if self.config.algorithm.filter_groups and len({float(t.reward or 0.0) for t in valid}) <= 1:
            return "filtered", "every sample got the same reward (dynamic group filtering)"
        return "ok", ""

    async def train(self, step: int, groups: list[GroupResult]) -> dict[str, float]:
        self.books.infra.check()  # a run whose episodes fail for infrastructure reasons stops before training
        if self.served_check is not None:  # a replica that came back serving other weights (never sampled from)
            self.served_check.raise_if_failed()
        # Infrastructure failures are masked out of the loss: they never reach the trainer at all.
        trajectories = [t for g in groups for t in g.trajectories if t.trainable]
        self.ticker.begin(f"step {step + 1}/{self.config.run.total_steps}: training on {len(trajectories)} episodes")
        # Where each trajectory sits in the trainer's batch: the kept ones' per-token values are fetched by it.
        self._trained_rows = (step, {id(t): i for i, t in enumerate(trajectories)})
        report: StepReport = await self.trainer.train(trajectories, self.scheduler.trainer_version,
                                                      allowed_staleness(self.config))
        metrics = report.metrics
        if report.masked_tokens:  # one entry per trajectory handed over: every one is trainable
            self._masked_tokens[step] = {id(t): {str(cause): n for cause, n in m.items()}
                                         for t, m in zip(trajectories, report.masked_tokens, strict=True)}
        # The on-policy gate: the sequences the trainer masked go into each group's ledger line, and
        # a step where too many tripped stops the run (its groups are closed as unfinished).
        sizes = [sum(t.trainable for t in g.trajectories) for g in groups]
        for g, note in zip(groups, gated_groups(sizes, report.gated), strict=True):
            g.note = note
        check_gated_share(self.config, metrics, step, self.books.run_dir)
        if not self.colocated:  # colocated: the engine takes the trainer's tensors at the push, in memory
            _path, export_s = await self.trainer.export(self.scheduler.trainer_version + 1)
            metrics["time/export_s"] = export_s
        return metrics

    async def push(self, version: int) -> None:
        if self.colocated:
            phases = await self.trainer.update_engines(version)
            self._sync_metrics = {"sync/pause_s": phases["pause_s"], "sync/load_s": phases["load_s"]}
            await self.router.check_health()
            self.router.set_version(version)
        else:
            await self._push_to_servers(version)
        await self.check_served(version)

    async def check_served(self, version: int) -> None:
        """The served-policy check of `version` on every replica (`served_policy`): after each push, and at
        the start of a run that pushes nothing first. A replica that fails stops the run; the ones that
        pass serve `version` from then on."""
        if self.served_check is None:
            return
        start = time.perf_counter()
        checks = await self.served_check.after_push(version, router=self.router, trainer=self.trainer)
        seconds = time.perf_counter() - start
        index = {server.server_id: i for i, server in enumerate(self.router.servers)}  # r<i>: inference.urls[i]
        self._served_metrics = {"served/gap_max": max((c.gap for c in checks), default=0.0),
                                "served/moved_gap_max": max((c.moved_gap for c in checks), default=0.0),
                                "sync/verify_s": seconds,
                                **{f"served/gap/r{index[c.replica]}": c.gap for c in checks}}
        log.debug("served-policy check of version %d in %.2f s: %s", version, seconds,
                  "; ".join(c.describe() for c in checks))

    async def _verify_replica(self, replica: str, version: int) -> None:
        """The router's check of one replica that came back (restarted, re-synced) at `version`."""
        if self.served_check is None:
            return
        check = await self.served_check.verify_replica(replica, version, router=self.router)
        if check is not None:
            (log.info if check.ok else log.error)("served-policy check of a replica that came back: %s",
                                                 check.describe())

    async def _push_to_servers(self, version: int) -> None:
        source, token = self.trainer.weight_source(version)
        reports = await self.router.update_weights(source, version, token=token)
        done = [r for r in reports.values() if r is not None]
        if done:  # the slowest server's figures: the push waits for every server
            self._sync_metrics = {"sync/pause_s": max(r.pause_seconds for r in done),
                                  "sync/transfer_s": max(r.receive_seconds for r in done),
                                  "sync/load_s": max(r.seconds - r.receive_seconds for r in done)}
        each = ", ".join(f"{sid} {r.verified_buckets}/{r.buckets}" if r is not None else f"{sid} (no report)"
                         for sid, r in reports.items())
        log.info("weight version %d on %d server(s) from %s: %s bucket(s) verified of %s [%s]", version, len(reports),
                 source, sum(r.verified_buckets for r in done), sum(r.buckets for r in done), each)

    async def after_step(self, record: StepRecord) -> None:
        self.ticker.end()
        books = self.books
        step = record.step
        groups = [final_segments(g.trajectories) for g in record.groups]  # agent episodes in segments count once
        metrics = episode_metrics(groups, trainer_version=record.trainer_version,
                                  group_versions=[g.version for g in record.groups])
        metrics.update(segment_metrics(record.trajectories))
        metrics.update(record.train_metrics)
        metrics.update(self._served_metrics)  # the check of the last push (empty before the first)
        metrics.update(self._sync_metrics)
        metrics.update({f"time/{k}": v for k, v in record.timings.items()})
        metrics["time/weight_sync_s"] = record.timings.get("weight_sync_s", 0.0) + record.train_metrics.get(
            "time/export_s", 0.0)
        metrics["policy/version"] = float(self.scheduler.server_version)
        metrics["batch/groups"] = float(len(record.groups))
        metrics["batch/discarded_groups"] = float(len(record.discarded))
        # Prompts with no room to sample: filtered before rollout, or (an env that cannot say its
        # prompt without a reset) masked by the AgentLoop, their group discarded.
        metrics["data/filtered_too_long"] = float(record.refused + sum(
            all(_prompt_too_long(t) for t in g.trajectories) for g in record.discarded if g.trajectories))
        metrics["episodes/infra_rate"] = books.infra.rate
        metrics["episodes/infra_failed_total"] = float(books.infra.failed)
        metrics.update({f"ledger/{k}": float(v) for k, v in books.ledger.summary().items()})
        trainer_tokens = await self._trainer_tokens(step, books.rollouts.kept_trained(step, record.groups, record.discarded))
        masked = self._masked_tokens.pop(step, {})
        books.rollouts.write_step(step, record.groups, record.discarded, books.train_rows,  # for `agentrl view`
                                  trainer=lambda t: trainer_tokens.get(id(t)), masked=lambda t: masked.get(id(t)))
        metrics["time/rollout_log_s"] = books.rollouts.last_seconds
        self.steps_done = step + 1
        last = step + 1 >= self.config.run.total_steps
        every = self.config.run.eval_every
        if books.val_rows and (last or (every and (step + 1) % every == 0)):
            result = await self.evaluate(step + 1)
            metrics.update({f"eval/{k}": v for k, v in result.items() if v is not None})  # unmeasured: absent
            if last:
                self.eval_after = result
        self.logger.log(step, metrics)
        books.ledger.commit_trained()  # after the metrics row: a step is in both files or in neither
        save_every = self.config.run.save_every
        if last or (save_every and (step + 1) % save_every == 0):
            await self.save(step)
        if not last:
            self._rollout_phase(step + 1)
        if self.router.fatal is not None:  # every server is gone for good: stop now, the step is saved
            raise self.router.fatal

    async def _trainer_tokens(self, step: int, kept: list[Trajectory]) -> dict[int, TrainerTokens]:
        """The trainer's logprob and entropy of each token of the kept trained trajectories of `step`
        (by `id`): fetched from the trainer for those few only. Empty when the trainer's last batch is
        not this step's (it has trained on since)."""
        at, rows = self._trained_rows
        if at != step or not kept:
            return {}
        wanted = {id(t): rows[id(t)] for t in kept if id(t) in rows}
        values = await self.trainer.trainer_tokens(sorted(set(wanted.values())))
        return {key: TrainerTokens(*values[i]) for key, i in wanted.items() if i in values}

    # ── evaluation and checkpoints ──────────────────────────────────────────────────────────
    async def evaluate(self, after_steps: int) -> dict[str, float | None]:
        start = time.perf_counter()
        out = self.books.run_dir / "eval" / f"step-{after_steps:06d}"
        self.ticker.begin(f"held-out eval after {after_steps} step(s)")
        async with self.scheduler.push_lock:  # the weights must not change under the evaluation
            report = await evaluate(self.job, self.router, self.books.val_rows, out, make_env=self.make_env,
                                    progress=lambda done, total, _s: self.ticker.set(done, total))
        self.ticker.end()
        result: dict[str, float | None] = {
            "pass_at_1": report.pass_at_1, f"pass_at_{report.k}": report.pass_at_k,
            "mean_reward": report.mean_reward, "tool_calls_per_episode": report.tool_calls_per_episode,
            "problems": float(report.problems), "infra_failed": float(report.infra_failed_episodes),
            "policy_version": float(self.scheduler.server_version), "seconds": time.perf_counter() - start,
        }  # fmt: skip
        append_text(self.books.run_dir / "eval.jsonl", json.dumps({"step": after_steps, **result}) + "\n",
                    self.books.run_dir)
        log.info("held-out eval after %d step(s): pass@1 %s on %d problems, %d/%d infra-failed episodes (%.0f s)",
                 after_steps, score_text(result), report.problems, report.infra_failed_episodes, report.episodes,
                 result["seconds"])
        self.last_eval_step = after_steps
        check_infra_failures(self.config, report, out)  # an unmeasured evaluation stops the run
        return result

    async def save(self, step: int) -> None:
        books = self.books
        start = time.perf_counter()
        # The data position excludes prompts still in the system; the ledger has them in flight,
        # and a resume requeues them first.
        state = {
            "steps_done": step + 1,
            "trainer_version": self.scheduler.trainer_version,
            "sampler": books.sampler.state(),
            "ledger": books.ledger.state(),
            "in_system": [[r.epoch, r.index, r.attempt] for r in self.scheduler.in_system()],
            "eval_before": self.eval_before,
        }

        async def write_trainer(folder: Path) -> None:
            await self.trainer.save(str(folder), {"steps_done": step + 1})

        path = await books.store.save(step + 1, write_trainer, state)
        self.last_saved_step = step
        log.info("checkpoint %s written (%.1f s)", path, time.perf_counter() - start)
