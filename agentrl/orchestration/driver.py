"""`agentrl run`: the training driver that ties servers, rollouts, the trainer and weight sync together.

One run, on Ray (a local instance by default; the cluster when `ray start` made one or
`RAY_ADDRESS` names it; with `cluster.address`, that cluster, every role reserved in one placement
group before anything starts: `cluster.py`):

1. The run directory (`run.output_dir/run.name`) gets the resolved config. With `run.resume` it
   must hold an intact checkpoint: the newest is verified against its checksums (and a damaged one
   set aside for the newest intact one, `checkpoints.py`) before anything starts. Without it, it
   must hold none (a run is never silently overwritten), and the records of an earlier attempt
   that saved no checkpoint are moved into `previous/`, never deleted.
2. The LLM servers start (`serve_from_config`, behind the session-sticky router, supervised: a
   dead server is restarted and re-synced) while the trainer actors load the policy (`TrainerGroup`);
   with placement `colocated` the vLLM engine starts inside the trainer actor instead, and the
   router reaches it there (`placement.py`).
3. The `Scheduler` runs the steps in `run.mode`: rollouts are asyncio tasks in this process (the
   AgentLoop over the router), training is a Ray call, and each new policy reaches the servers
   through the checkpoint engine `weights.backend` selects (`weights/version-N` directories, or an
   HTTP endpoint on the trainer's node), every bucket checksummed and verified by each server, or
   in memory into the colocated engine, after which the router serves only that version.
4. After every step the dashboard metrics go to the console, `metrics.jsonl` and TensorBoard;
   every `run.eval_every` steps (and before the first and after the last) the held-out split is
   evaluated (`eval/pass_at_1`, ...), with its report under `eval/step-N/`; every `run.save_every`
   steps (and at the end) a checkpoint holds the trainer (model, optimizer, scheduler, RNG) and
   the driver (data position, prompt ledger, versions), written safely and pruned to
   `run.keep_checkpoints` (`CheckpointStore`). `resume=true` continues from it with the same next
   batch.

The prompt ledger (`ledger.jsonl`) accounts for every prompt taken: trained, filtered, requeued
after infrastructure failures, failed, or unfinished when the run stopped, whatever stopped it
(the scheduler closes its in-flight prompts on an exception or Ctrl-C; a resumed run closes those
of a run that was killed outright before it continues). A run that can make no progress stops
with a non-zero exit and the cause: too many infrastructure failures, every server given up,
`run.max_skipped_steps` steps in a row with nothing to train. Training never sees an env class, and
envs never see the trainer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.config import AgentRLConfig, save_config
from agentrl.errors import AgentRLError, ConfigError, InfraFailureError, PreflightError
from agentrl.orchestration.build import Job, build_job
from agentrl.orchestration.checkpoints import Checkpoint, CheckpointStore, move_aside_earlier_attempt
from agentrl.orchestration.evaluate import check_infra_failures, evaluate
from agentrl.orchestration.infra import InfraMonitor
from agentrl.orchestration.ledger import PromptLedger, PromptRef, PromptSampler, close_orphans, next_session
from agentrl.orchestration.preflight import preflight
from agentrl.orchestration.schedule import GroupResult, Scheduler, StepRecord, Verdict, default_classify
from agentrl.records.metrics import MetricsLogger, episode_metrics, segment_metrics
from agentrl.records.trajectory_log import RolloutLog
from agentrl.rollout import RolloutWorker
from agentrl.rollout.worker import group_seed
from agentrl.types import final_segments, is_first_segment

__all__ = ["RunResult", "resolve_run_dir", "run_training"]

log = logging.getLogger("agentrl.run")


@dataclass
class RunResult:
    """What a finished `agentrl run` reports."""

    run_dir: str
    steps_done: int
    policy_version: int
    ledger: dict[str, int]
    eval_before: dict[str, float | None] = field(default_factory=dict)
    eval_after: dict[str, float | None] = field(default_factory=dict)
    max_staleness: int = 0
    seconds: float = 0.0
    steps_skipped: int = 0
    """Steps (of this session) that had nothing to train: every group filtered or failed."""

    def summary(self) -> str:
        steps = f"{self.steps_done} steps"
        if self.steps_skipped:
            steps += f" ({self.steps_skipped} skipped with nothing to train)"
        parts = [f"run {self.run_dir}: {steps}, policy version {self.policy_version}"]
        if self.eval_before and self.eval_after:
            parts.append(
                f"held-out pass@1 {_score(self.eval_before)} -> {_score(self.eval_after)} "
                f"({int(self.eval_after.get('problems') or 0)} problems)"
            )
        parts.append(f"{self.seconds / 60:.1f} min")
        return ", ".join(parts)


def _score(result: dict[str, float | None]) -> str:
    """pass@1 of an evaluation, or why there is none (never a 0 that was not measured)."""
    value = result.get("pass_at_1")
    if value is None:
        return f"not measured ({int(result.get('infra_failed') or 0)} infra-failed episodes)"
    return f"{value:.3f}"


def resolve_run_dir(config: AgentRLConfig) -> Path:
    """The run's directory: `run.output_dir/run.name`, named after the env and the time when unnamed."""
    name = config.run.name or f"{config.env.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    return Path(config.run.output_dir) / name


def _prepare_run_dir(config: AgentRLConfig, plan_cluster: bool = False
                     ) -> tuple[Path, CheckpointStore, Checkpoint | None, list[str]]:
    """The run directory, its checkpoint store, the checkpoint to resume from (verified), and notes
    for the log. Raises before anything starts when the directory does not fit `run.resume`."""
    run_dir = resolve_run_dir(config)
    if plan_cluster:  # actors on the driver's node work in other directories: give them absolute paths
        run_dir = run_dir.absolute()
    store = CheckpointStore(run_dir / "checkpoints", keep=config.run.keep_checkpoints)
    notes: list[str] = []
    checkpoint = None
    if config.run.resume:
        if config.run.name is None:
            raise ConfigError("resume=true needs the run to continue: give run.name=NAME (a folder under run.output_dir).")
        checkpoint = store.resumable()  # verifies checksums and the driver state; raises if none is intact
        if checkpoint is None:
            raise ConfigError(
                f"resume=true but '{run_dir}' holds no checkpoint; start it without resume=true (the "
                "records already there are moved into previous/, not deleted; checkpoints are written "
                "every run.save_every steps)."
            )
    elif store.complete():
        raise ConfigError(
            f"'{run_dir}' already holds a run with checkpoints; continue it with resume=true, or choose "
            "another run.name."
        )
    else:
        aside = move_aside_earlier_attempt(run_dir)
        if aside is not None:
            notes.append(f"{run_dir} held the records of an earlier attempt that saved no checkpoint; they "
                         f"were moved to {aside}")
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir, store, checkpoint, notes


def _init_ray(cluster_address: str | None) -> None:
    import ray

    from agentrl.lifeline import start_reaper

    # Ray's processes, the trainer actors, the servers and the sandboxes end when this process
    # does, however it ends (SIGKILL included): Ray's own clean-up does not cover a killed driver.
    start_reaper()
    if ray.is_initialized():
        return
    address = cluster_address or os.environ.get("RAY_ADDRESS")
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=True, configure_logging=False,
                 ignore_reinit_error=True)
    except (ConnectionError, RuntimeError) as exc:
        if not cluster_address:
            raise
        raise PreflightError(
            f"cluster.address={address}: cannot join the Ray cluster there ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}). Start its head with 'ray start --head', give "
            "the HOST:PORT it prints, and run from a node of the cluster (with its token, when Ray's token "
            "authentication is on).") from exc


class _Run:
    """The state of one training run inside the driver's event loop."""

    def __init__(self, job: Job, run_dir: Path, store: CheckpointStore, checkpoint: Checkpoint | None) -> None:
        config = job.config
        self.job = job
        self.config = config
        self.run_dir = run_dir
        self.store = store
        self.checkpoint = checkpoint
        # Indexed by dataset row number (the ledger's indices); None where a malformed row was skipped.
        self.train_rows = job.train_rows
        self.val_rows: list[dict[str, Any]] = job.val_rows
        for note in job.notes:
            log.warning("%s", note)
        self.infra = InfraMonitor(config.run.max_infra_failure_rate, config.run.infra_failure_window,
                                  min_episodes=config.data.prompts_per_step * config.rollout.samples_per_prompt)
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
        journal.touch()  # the run's books exist from its start, even if it stops before taking a prompt
        if checkpoint is None:  # a resumed run has them in its checkpoint's ledger
            for bad in job.train_skipped:
                self.ledger.skipped(bad.index, str(bad))
        self.rollouts = RolloutLog(run_dir, job.template.tokenizer, config.run.keep_rollouts, seed=config.run.seed)
        self.eval_before: dict[str, float | None] = {}
        self.eval_after: dict[str, float | None] = {}
        self.steps_done = 0
        self.colocated = job.plan is not None and job.plan.colocated
        self.scheduler: Scheduler | None = None
        self.last_saved_step = -1
        self.last_eval_step = -1

    # ── pieces the scheduler calls ──────────────────────────────────────────────────────────
    async def rollout(self, ref: PromptRef) -> list[Any]:
        if self.router.fatal is not None:  # every server is gone for good: say so, do not fail episodes
            raise self.router.fatal
        row = self.train_rows[ref.index]
        assert row is not None, "the sampler never hands out a skipped row"
        index = ref.epoch * len(self.train_rows) + ref.index
        seed = group_seed(self.config.run.seed, index * 16 + ref.attempt)
        group = await self.worker.run_group(row, self.config.rollout.samples_per_prompt, seed=seed, group_id=ref.key)
        self.infra.record(final_segments(group))  # an agent episode in segments is one episode
        try:
            self.infra.check()
        except InfraFailureError:
            # The step never reaches after_step: keep its failed episodes for `agentrl view` here.
            path = self.rollouts.write_stopped(self.steps_done, list(self.infra.window))
            log.error("the infrastructure-failed episodes that stopped the run are in %s", path)
            raise
        return group

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
        self.infra.check()  # a run whose episodes fail for infrastructure reasons stops before training
        # Infrastructure failures are masked out of the loss: they never reach the trainer at all.
        trajectories = [t for g in groups for t in g.trajectories if t.trainable]
        metrics = await self.trainer.train(trajectories)
        assert self.scheduler is not None
        if not self.colocated:  # colocated: the engine takes the trainer's tensors at the push, in memory
            path, export_s = await self.trainer.export(self.scheduler.trainer_version + 1)
            metrics["time/export_s"] = export_s
            self.last_weights = path
        return metrics

    async def push(self, version: int) -> None:
        if self.colocated:
            await self.trainer.update_engines(version)
            await self.router.check_health()
            self.router.set_version(version)
            return
        source, token = self.trainer.weight_source(version)
        reports = await self.router.update_weights(source, version, token=token)
        done = [r for r in reports.values() if r is not None]
        each = ", ".join(f"{sid} {r.verified_buckets}/{r.buckets}" if r is not None else f"{sid} (no report)"
                         for sid, r in reports.items())
        log.info("weight version %d on %d server(s) from %s: %s bucket(s) verified of %s [%s]", version, len(reports),
                 source, sum(r.verified_buckets for r in done), sum(r.buckets for r in done), each)

    async def after_step(self, record: StepRecord) -> None:
        assert self.scheduler is not None
        step = record.step
        groups = [final_segments(g.trajectories) for g in record.groups]  # agent episodes in segments count once
        metrics = episode_metrics(groups, trainer_version=record.trainer_version,
                                  group_versions=[g.version for g in record.groups])
        metrics.update(segment_metrics(record.trajectories))
        metrics.update(record.train_metrics)
        metrics.update({f"time/{k}": v for k, v in record.timings.items()})
        metrics["time/weight_sync_s"] = record.timings.get("weight_sync_s", 0.0) + record.train_metrics.get(
            "time/export_s", 0.0)
        metrics["policy/version"] = float(self.scheduler.server_version)
        metrics["batch/groups"] = float(len(record.groups))
        metrics["batch/discarded_groups"] = float(len(record.discarded))
        metrics["episodes/infra_rate"] = self.infra.rate
        metrics["episodes/infra_failed_total"] = float(self.infra.failed)
        metrics.update({f"ledger/{k}": float(v) for k, v in self.ledger.summary().items()})
        self.rollouts.write_step(step, record.groups, record.discarded, self.train_rows)  # for `agentrl view`
        metrics["time/rollout_log_s"] = self.rollouts.last_seconds
        self.steps_done = step + 1
        last = step + 1 >= self.config.run.total_steps
        every = self.config.run.eval_every
        if self.val_rows and (last or (every and (step + 1) % every == 0)):
            result = await self.evaluate(step + 1)
            metrics.update({f"eval/{k}": v for k, v in result.items() if v is not None})  # unmeasured: absent
            if last:
                self.eval_after = result
        self.logger.log(step, metrics)
        save_every = self.config.run.save_every
        if last or (save_every and (step + 1) % save_every == 0):
            await self.save(step)
        if self.router.fatal is not None:  # every server is gone for good: stop now, the step is saved
            raise self.router.fatal

    # ── evaluation and checkpoints ──────────────────────────────────────────────────────────
    async def evaluate(self, after_steps: int) -> dict[str, float | None]:
        assert self.scheduler is not None
        start = time.perf_counter()
        out = self.run_dir / "eval" / f"step-{after_steps:06d}"
        async with self.scheduler.push_lock:  # the weights must not change under the evaluation
            report = await evaluate(self.job, self.router, self.val_rows, out)
        result: dict[str, float | None] = {
            "pass_at_1": report.pass_at_1, f"pass_at_{report.k}": report.pass_at_k,
            "mean_reward": report.mean_reward, "tool_calls_per_episode": report.tool_calls_per_episode,
            "problems": float(report.problems), "infra_failed": float(report.infra_failed_episodes),
            "policy_version": float(self.scheduler.server_version), "seconds": time.perf_counter() - start,
        }  # fmt: skip
        with (self.run_dir / "eval.jsonl").open("a") as f:
            f.write(json.dumps({"step": after_steps, **result}) + "\n")
        log.info("held-out eval after %d step(s): pass@1 %s on %d problems, %d/%d infra-failed episodes (%.0f s)",
                 after_steps, _score(result), report.problems, report.infra_failed_episodes, report.episodes,
                 result["seconds"])
        self.last_eval_step = after_steps
        check_infra_failures(self.config, report, out)  # an unmeasured evaluation stops the run
        return result

    async def save(self, step: int) -> None:
        assert self.scheduler is not None
        start = time.perf_counter()
        # The data position excludes prompts still in the system; the ledger has them in flight,
        # and a resume requeues them first.
        state = {
            "steps_done": step + 1,
            "trainer_version": self.scheduler.trainer_version,
            "sampler": self.sampler.state(),
            "ledger": self.ledger.state(),
            "in_system": [[r.epoch, r.index, r.attempt] for r in self.scheduler.in_system()],
            "eval_before": self.eval_before,
        }

        async def write_trainer(folder: Path) -> None:
            await self.trainer.save(str(folder), {"steps_done": step + 1})

        path = await self.store.save(step + 1, write_trainer, state)
        self.last_saved_step = step
        log.info("checkpoint %s written (%.1f s)", path, time.perf_counter() - start)

    def _restore(self) -> tuple[int, int]:
        assert self.checkpoint is not None
        state = self.checkpoint.state  # read and checked before anything started
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
        self.eval_before = state.get("eval_before", {})
        return int(state["steps_done"]), int(state["trainer_version"])

    # ── the run ─────────────────────────────────────────────────────────────────────────────
    async def main(self, trainer: Any, service: Any) -> None:
        try:
            await self._main(trainer, service)
        finally:
            await service.stop_supervising()  # the servers are stopped on purpose next
            await self.job.aclose()  # the sandbox's workers belong to this event loop

    async def _main(self, trainer: Any, service: Any) -> None:
        from agentrl.inference.router import Router

        config = self.config
        self.trainer = trainer
        self.router: Router = service.client
        if self.colocated:  # the router reaches the engine through the trainer actor, which loads it first
            await trainer.ready()
        await service.start()
        loop = self.job.agent_loop(self.router)
        self.worker = RolloutWorker(loop, self.job.make_env, max_concurrent=config.rollout.max_concurrent_episodes)

        start_step, version = 0, 0
        if self.checkpoint is not None:
            start_step, version = self._restore()
            await trainer.load(str(self.checkpoint.path / "trainer"))
            log.info("resuming %s from %s: step %d, policy version %d (session %d)", self.run_dir,
                     self.checkpoint.name, start_step, version, self.session)
        await trainer.ready()
        await self.router.check_health()
        if not self.colocated:
            await trainer.check_servers(self.router)  # every server reaches the trainer's weights
        served = {s["weight_version"] for s in self.router.stats()["servers"]}
        if version > 0 or served != {0}:
            # Resumed, or servers that were already running hold other weights: serve the trainer's.
            if not self.colocated:
                await trainer.export(version)
            await self.push(version)
        self.scheduler = Scheduler(
            mode=config.run.mode, prompts_per_step=config.data.prompts_per_step, sampler=self.sampler,
            ledger=self.ledger, rollout=self.rollout, train=self.train, push=self.push,
            after_step=self.after_step, classify=self.classify, max_staleness=config.run.max_staleness,
            partial_rollout=config.run.partial_rollout, version=version,
            max_skipped_steps=config.run.max_skipped_steps,
        )  # fmt: skip
        self.logger = MetricsLogger(
            self.run_dir, config.run.loggers, total_steps=config.run.total_steps, start_step=start_step,
            config=config.model_dump(mode="json"),
        )  # fmt: skip
        if start_step:
            self.logger.truncate_after(start_step - 1)
        try:
            if self.val_rows and start_step == 0:
                self.eval_before = await self.evaluate(0)
                self.logger.log_event(0, {k: v for k, v in self.eval_before.items() if v is not None}, "eval")
            await self.scheduler.run(start_step, config.run.total_steps)
        finally:
            self.logger.close()


def _start_sandbox_hosts(job: Job, reservation: Any) -> Any:
    """Start the cluster's sandbox hosts, check each runs a command, and make them the run's sandbox
    (the envs get a client of them instead of the local sandbox `build_job` made and never started)."""
    from agentrl.orchestration.sandbox_hosts import start_sandbox_hosts
    from agentrl.sandboxes.remote import RemoteSandbox

    hosts = start_sandbox_hosts(job.config, reservation)

    async def check() -> None:
        for url in hosts.urls:
            client = RemoteSandbox(url, token=hosts.token)
            try:
                res = await client.exec("echo $((6 * 7))", timeout_s=60)
            finally:
                await client.close()
            if res.exit_code != 0 or res.stdout.strip() != "42":
                raise PreflightError(f"cluster.sandbox_hosts: the sandbox host at {url} cannot run a shell command "
                                     f"(exit {res.exit_code}, {res.stderr[-300:]!r}); run 'agentrl doctor' on "
                                     "that node with the same sandbox settings.")

    try:
        asyncio.run(check())
        asyncio.run(job.aclose())  # the local sandbox, never used
        job.sandbox = hosts.sandbox()
        job.env_kwargs["sandbox"] = job.sandbox
    except BaseException:
        hosts.stop()
        raise
    return hosts


def run_training(config: AgentRLConfig) -> RunResult:
    """`agentrl run`: train `config` end to end (see the module docstring); return what happened.

    Everything is built and checked first (`build_job`, then `preflight`): a config that cannot
    do useful work fails here, in seconds, before a server, a trainer or Ray starts.
    """
    from agentrl.orchestration.placement import start_inference
    from agentrl.orchestration.trainer_group import TrainerGroup

    started = time.perf_counter()
    job = build_job(config, "run")
    try:
        preflight(job)
        run_dir, store, checkpoint, notes = _prepare_run_dir(
            config, job.plan is not None and job.plan.cluster is not None)
    except BaseException:
        asyncio.run(job.aclose())
        raise
    save_config(config, run_dir)
    handler = logging.FileHandler(run_dir / "driver.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger("agentrl").addHandler(handler)
    for note in notes:
        log.warning("%s", note)
    for damaged in checkpoint.set_aside if checkpoint else []:
        log.error("%s", damaged)
    reservation = sandbox_hosts = None
    try:
        run = _Run(job, run_dir, store, checkpoint)
        assert job.plan is not None  # build_job made it
        _init_ray(job.plan.cluster.address if job.plan.cluster is not None else None)
        if job.plan.cluster is not None:  # checked against the cluster's resources before anything starts
            from agentrl.orchestration.cluster import reserve

            reservation = reserve(job.plan.cluster)
            if job.plan.cluster.count("sandbox"):
                sandbox_hosts = _start_sandbox_hosts(job, reservation)
        # The trainer loads while the servers start (placement split), or with its engine (colocated).
        trainer = TrainerGroup(config, job.model_path, run_dir / "weights", plan=job.plan, reservation=reservation)
        try:
            served = config.model_copy(deep=True)
            served.model.path = job.model_path
            service = start_inference(job.plan, served, trainer, log_dir=run_dir / "logs", reservation=reservation)
            try:
                asyncio.run(run.main(trainer, service))
            except AgentRLError as exc:
                log.error("the run stopped: %s", exc)  # in driver.log too, with the fix
                raise
            except KeyboardInterrupt:
                log.error("the run was interrupted; its in-flight prompts are closed as unfinished in "
                          "ledger.jsonl. Continue it with resume=true run.name=%s (from %s).", run_dir.name,
                          store.latest_name() or "the start: no checkpoint was written yet")
                raise
            finally:
                service.stop()
        finally:
            trainer.shutdown()
    finally:
        if sandbox_hosts is not None:
            sandbox_hosts.stop()
        if reservation is not None:
            reservation.release()
        logging.getLogger("agentrl").removeHandler(handler)
        handler.close()
        asyncio.run(job.aclose())
    scheduler = run.scheduler
    summary = run.ledger.check()
    result = RunResult(
        run_dir=str(run_dir), steps_done=run.steps_done,
        policy_version=scheduler.server_version if scheduler else 0, ledger=summary,
        eval_before=run.eval_before, eval_after=run.eval_after,
        max_staleness=scheduler.max_staleness_seen if scheduler else 0, seconds=time.perf_counter() - started,
        steps_skipped=scheduler.steps_skipped if scheduler else 0,
    )  # fmt: skip
    (run_dir / "result.json").write_text(json.dumps(result.__dict__, indent=2))
    return result
