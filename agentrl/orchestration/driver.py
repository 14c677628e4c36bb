"""`agentrl run`: the training driver that ties servers, rollouts, the trainer and weight sync together.

One run, on Ray (a local instance by default; the cluster when `ray start` made one or
`RAY_ADDRESS` names it; with `cluster.address`, that cluster, every role reserved in one placement
group before anything starts: `cluster.py`):

1. The run directory (`run.output_dir/run.name`) is owned by this run alone (`run.lock`, held
   while it lives: `run_lock.py`; a second run on it is refused at once). With `run.resume` it
   must hold an intact checkpoint: the newest is verified against its checksums (and a damaged one
   set aside for the newest intact one, `checkpoints.py`), and the config that shapes the data and
   the model must match what the run recorded when it started (`run_identity.py`; `run.resume_allow`
   lets named keys change), all before pre-flight and before anything starts. Without it, it
   must hold none (a run is never silently overwritten), and the records of an earlier attempt
   that saved no checkpoint are moved into `previous/`, never deleted. Only then does it get the
   resolved config (`config.yaml`) and the run's identity, or this resume in `resume_history.jsonl`.
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

`Run` is the one owner of all of it: built from the `Job`, it runs on one event loop (one
`asyncio.run`) and opens everything it starts (the job itself, `async with job`: its table of
resources, the sandbox, the gateway and the rest; the cluster's reservation and sandbox hosts, the
trainer group, the servers and their router) through one `AsyncExitStack`,
which closes it all in reverse order however the run ends: its last step, an error, Ctrl-C, a
scheduler's SIGTERM or a SIGHUP (all three handled alike, `interrupts.py`: exit 128 + the signal's
number, 130, 143 or 129), each with the command that continues the run (`run_commands.py`: the real
run name and output folder). Ray itself stays up for later runs of the process (the reaper ends it,
and all it started, with the process). The books and the steps it drives are `training.py`.

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
import contextlib
import functools
import json
import logging
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from agentrl.config import AgentRLConfig, save_config
from agentrl.envs import Env
from agentrl.errors import AgentRLError, ConfigError, RunWriteError, StartupError
from agentrl.orchestration.build import Job, build_job
from agentrl.orchestration.checkpoints import Checkpoint, CheckpointStore, move_aside_earlier_attempt
from agentrl.orchestration.interrupts import RunInterrupted, StopSignals, signal_name
from agentrl.orchestration.placement import PlacementPlan
from agentrl.orchestration.preflight import preflight
from agentrl.orchestration.run_commands import resume_command
from agentrl.orchestration.run_identity import (
    ResumeCheck,
    check_resume,
    record_resume,
    run_identity,
    write_identity,
)
from agentrl.orchestration.run_lock import LOCK_FILE, RunLock
from agentrl.orchestration.startup import init_ray, starting
from agentrl.orchestration.training import RunBooks, TrainingSteps, score_text
from agentrl.records import library_logs
from agentrl.records.metrics import MetricsLogger
from agentrl.records.run_files import classify_write_error, replace_text, writing
from agentrl.rollout import RolloutWorker

__all__ = ["Run", "RunResult", "check_run_dir", "resolve_run_dir", "run_training"]

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
                f"held-out pass@1 {score_text(self.eval_before)} -> {score_text(self.eval_after)} "
                f"({int(self.eval_after.get('problems') or 0)} problems)"
            )
        parts.append(f"{self.seconds / 60:.1f} min")
        return ", ".join(parts)


def resolve_run_dir(config: AgentRLConfig) -> Path:
    """The run's directory: `run.output_dir/run.name`, named after the env and the time when unnamed."""
    name = config.run.name or f"{config.env.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    return Path(config.run.output_dir) / name


@dataclass
class _RunDir:
    """The run directory, owned by this run (its `run.lock` is held), checked against `run.resume`."""

    path: Path
    store: CheckpointStore
    checkpoint: Checkpoint | None
    """The verified checkpoint to resume from; None for a fresh start."""
    resume: ResumeCheck


def _prepare_run_dir(config: AgentRLConfig, stack: contextlib.AsyncExitStack, plan_cluster: bool = False) -> _RunDir:
    """Own the run directory (`RunLock`, released by `stack`) and check it fits `run.resume`: the
    checkpoint to resume from (verified) and the run's recorded identity (`check_resume`). Raises
    before anything starts and before anything in the directory is written (a damaged checkpoint
    aside, set aside by `resumable`, is the one exception); `_settle_run_dir` writes, after pre-flight."""
    run_dir = resolve_run_dir(config)
    if plan_cluster:  # actors on the driver's node work in other directories: give them absolute paths
        run_dir = run_dir.absolute()
    store = CheckpointStore(run_dir / "checkpoints", keep=config.run.keep_checkpoints,
                            resume_command=resume_command(config, run_dir))
    if config.run.resume:
        _check_resumable(config, run_dir, store)  # nothing created, nothing locked
    try:
        with writing(run_dir / LOCK_FILE):
            lock = RunLock.acquire(run_dir)  # before anything is written into the directory
    except RunWriteError as exc:  # a read-only or full disk under run.output_dir
        exc.continue_with(resume_command(config, run_dir, resume=config.run.resume), resume=config.run.resume)
        raise
    stack.callback(lock.release)
    resume = check_resume(config, run_dir)  # the recorded identity; resume_allow only with resume
    checkpoint = None
    if config.run.resume:
        checkpoint = store.resumable()  # verifies checksums and the driver state; raises if none is intact
        if checkpoint is None:
            _check_resumable(config, run_dir, store)
    elif store.complete():
        raise ConfigError(
            f"'{run_dir}' already holds a run with checkpoints; continue it with: "
            f"{resume_command(config, run_dir)} (or choose another run.name)."
        )
    return _RunDir(run_dir, store, checkpoint, resume)


def _check_resumable(config: AgentRLConfig, run_dir: Path, store: CheckpointStore) -> None:
    """`resume=true` needs a named run directory that holds a checkpoint (not verified here)."""
    if config.run.name is None:
        raise ConfigError("resume=true needs the run to continue: give run.name=NAME, the name of a folder "
                          f"under run.output_dir={config.run.output_dir}{_runs_with_checkpoints(config)}.")
    if not store.complete():
        raise ConfigError(
            f"resume=true but '{run_dir}' holds no checkpoint; start it again without resume=true (the "
            "records already there are moved into previous/, not deleted; checkpoints are written "
            f"every run.save_every steps): {resume_command(config, run_dir, resume=False)}"
        )


def check_run_dir(config: AgentRLConfig) -> list[str]:
    """What `agentrl validate` checks of the run directory without taking it: with `run.resume`, that
    it holds a checkpoint (not verified here) and that the config matches the run's recorded identity
    (`check_resume`), and that `run.resume_allow` is only given with it. Raises what `agentrl run`
    would; lines to print. Writes nothing."""
    run_dir = resolve_run_dir(config)
    if config.run.resume:
        _check_resumable(config, run_dir, CheckpointStore(run_dir / "checkpoints"))
    check = check_resume(config, run_dir)
    if not config.run.resume:
        return []
    first = [] if not check.recorded else [
        f"resume: {run_dir} matches this config in what shapes its data and model"
        + (f", except what run.resume_allow lets change ({len(check.allowed)} key(s))" if check.allowed else "")]
    return first + [f"note: {n}" for n in check.notes()]


def _settle_run_dir(config: AgentRLConfig, prepared: _RunDir) -> list[str]:
    """Write what a run that passed its checks writes first: an earlier attempt's records moved aside
    (a fresh start), the resolved `config.yaml`, and the run's identity (`run_identity.json`) or
    this resume in `resume_history.jsonl`; notes for the log."""
    run_dir = prepared.path
    notes: list[str] = []
    if prepared.checkpoint is None:
        aside = move_aside_earlier_attempt(run_dir)
        if aside is not None:
            notes.append(f"{run_dir} held the records of an earlier attempt that saved no checkpoint; they "
                         f"were moved to {aside}")
    save_config(config, run_dir)
    if prepared.checkpoint is None:
        write_identity(run_dir, run_identity(config))
    else:
        record_resume(run_dir, prepared.resume, prepared.checkpoint.name)
        notes.extend(prepared.resume.notes())
    return notes


def _runs_with_checkpoints(config: AgentRLConfig, most: int = 5) -> str:
    """`; runs there with checkpoints: a, b` (the newest `most`), or nothing when there are none."""
    root = Path(config.run.output_dir)
    try:
        runs = [p for p in root.iterdir() if (p / "checkpoints" / "latest").is_file()]
    except OSError:
        return ""
    runs.sort(key=lambda p: (p / "checkpoints" / "latest").stat().st_mtime, reverse=True)
    return f"; runs there with checkpoints: {', '.join(p.name for p in runs[:most])}" if runs else ""


def _init_ray(cluster_address: str | None, then: str = "") -> None:
    from agentrl.lifeline import start_reaper

    # Ray's processes, the trainer actors, the servers and the sandboxes end when this process
    # does, however it ends (SIGKILL included): Ray's own clean-up does not cover a killed driver.
    start_reaper()
    init_ray(cluster_address, then)  # a failure says what, why and what to do (`startup.py`)


class _DriverLogHandler(logging.FileHandler):
    """`driver.log`. A line it cannot write (the disk is full) is dropped quietly: the console has
    the message, and logging's own report of the failure would put a traceback there."""

    failed = False

    def handleError(self, record: logging.LogRecord) -> None:
        self.failed = True


@contextlib.contextmanager
def _driver_log(run_dir: Path) -> Iterator[_DriverLogHandler]:
    """The run's messages also go to `driver.log` in its directory, until the run is closed."""
    handler = _DriverLogHandler(run_dir / "driver.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger("agentrl").addHandler(handler)
    library_logs.attach(run_dir / "driver.log")  # other libraries' notices, kept off the console
    try:
        yield handler
    finally:
        library_logs.detach()
        logging.getLogger("agentrl").removeHandler(handler)
        with contextlib.suppress(OSError):  # its last buffered line on a full disk
            handler.close()


def _as_write_error(exc: BaseException, run_dir: Path) -> RunWriteError | None:
    """`exc` as the `RunWriteError` it means when a write under the run directory failed where it
    writes (a full disk, a read-only filesystem, the directory gone), else None. Catches what
    did not come through `run_files`: a file another part wrote, an error that crossed from a Ray
    actor as text (the trainer's export on a full disk)."""
    if isinstance(exc, RunWriteError):
        return exc
    if isinstance(exc, AgentRLError | KeyboardInterrupt | asyncio.CancelledError):
        return None
    path = Path(getattr(exc, "filename", None) or run_dir)
    return classify_write_error(exc, path, run_dir)


class Run:
    """One `agentrl run`, built from its `Job`, the one owner of everything it starts.

    `main` is the whole run on one event loop: it checks the job (`preflight`), prepares the run
    directory and the books (`RunBooks`), opens every piece the run starts through one
    `AsyncExitStack` (the job, `async with job`; `_open`: Ray, the cluster's reservation and sandbox
    hosts, the trainer group, the servers and their router; the gateway closes before them), runs the steps (`TrainingSteps`), and closes all of
    it in that one stack, in reverse order, however the run ends: its last step, an error, Ctrl-C
    or another stop signal (`signals`, which `run_training` installs for the run).
    """

    def __init__(self, job: Job) -> None:
        if job.plan is None:
            raise ConfigError("a run needs the placement plan build_job(config, 'run') makes; build the job with it.")
        self.job = job
        self.config = job.config
        self.plan: PlacementPlan = job.plan
        self.started = time.perf_counter()
        self.signals = StopSignals()
        self.continue_command = ""
        """What continues the run once its directory is prepared: the resume command, or the one that
        starts it again while it has no checkpoint."""

    async def main(self) -> RunResult:
        """Train the job end to end (see the module docstring); what happened."""
        job, config = self.job, self.config
        self.signals.watch(asyncio.current_task(), asyncio.get_running_loop())
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(job)  # its resources (sandbox, gateway, ...) live on this loop
            prepared = _prepare_run_dir(config, stack, self.plan.cluster is not None)  # refusals before anything starts
            await asyncio.to_thread(preflight, job)  # its sandbox snippet runs on a loop of its own
            run_dir, store, checkpoint = prepared.path, prepared.store, prepared.checkpoint
            with self._writes_stop_cleanly(run_dir, store):
                notes = _settle_run_dir(config, prepared)
                driver_log = stack.enter_context(_driver_log(run_dir))
            for note in notes:
                log.warning("%s", note)
            for damaged in checkpoint.set_aside if checkpoint else []:
                log.error("%s", damaged)
            try:
                with self._writes_stop_cleanly(run_dir, store):
                    books = RunBooks(job, run_dir, store, checkpoint)
                    steps = await self._open(stack, books)
                    await steps.run()
            except (RunWriteError, StartupError) as exc:  # the message has the cause, the fix and the command
                log.error("the run stopped: %s", exc)
                # The traceback goes to driver.log only: the console shows the message, not a traceback.
                driver_log.handle(log.makeRecord(log.name, logging.ERROR, __file__, 0, "where it failed:", (),
                                                 (type(exc), exc, exc.__traceback__)))
                raise
            except AgentRLError as exc:
                log.error("the run stopped: %s", exc)  # in driver.log too, with the fix
                how = self._continue_text(run_dir, store)
                if self.continue_command not in str(exc):  # raised where the run's name is not known
                    log.error("once the cause is fixed, %s", how)
                raise
            except (KeyboardInterrupt, asyncio.CancelledError):
                log.error("the run was interrupted (%s); its in-flight prompts are closed as unfinished in "
                          "ledger.jsonl; %s", signal_name(self.signals.received or signal.SIGINT),
                          self._continue_text(run_dir, store))
                raise
        result = RunResult(
            run_dir=str(run_dir), steps_done=steps.steps_done, policy_version=steps.scheduler.server_version,
            ledger=books.ledger.check(), eval_before=steps.eval_before, eval_after=steps.eval_after,
            max_staleness=steps.scheduler.max_staleness_seen, seconds=time.perf_counter() - self.started,
            steps_skipped=steps.scheduler.steps_skipped,
        )  # fmt: skip
        replace_text(run_dir / "result.json", json.dumps(result.__dict__, indent=2), run_dir)
        return result

    @contextlib.contextmanager
    def _writes_stop_cleanly(self, run_dir: Path, store: CheckpointStore) -> Iterator[None]:
        """A write under `run_dir` that fails where it writes (`_as_write_error`) raises `RunWriteError`
        ending with the command that continues the run as it stands."""
        try:
            yield
        except Exception as exc:
            failed = _as_write_error(exc, run_dir)
            if failed is None:
                raise
            self._continue_text(run_dir, store)
            failed.continue_with(self.continue_command, resume=store.latest_name() is not None)
            if failed is exc:
                raise
            raise failed from exc

    def _then(self, run_dir: Path, store: CheckpointStore) -> str:
        """How to continue the run once a start-up failure is fixed, for `starting`."""
        self._continue_text(run_dir, store)
        return ("resume it with: " if store.latest_name() else "start it again with: ") + self.continue_command

    def _continue_text(self, run_dir: Path, store: CheckpointStore) -> str:
        """How to continue the run as it stands (and `continue_command` set to that command)."""
        latest = store.latest_name()
        self.continue_command = resume_command(self.config, run_dir, resume=latest is not None)
        if latest is None:
            return f"no checkpoint was written yet: start it again with: {self.continue_command}"
        return f"continue it from {latest} with: {self.continue_command}"

    async def _open(self, stack: contextlib.AsyncExitStack, books: RunBooks) -> TrainingSteps:
        """Start every piece of the run, each closed by `stack`; the steps over them, ready to run."""
        from agentrl.orchestration.placement import start_inference
        from agentrl.orchestration.trainer_group import TrainerGroup

        job, config, plan, run_dir = self.job, self.config, self.plan, books.run_dir
        cluster = plan.cluster
        make_env: Callable[[], Env] = job.make_env
        then = self._then(run_dir, books.store)
        logs = f"see driver.log and the logs in {run_dir / 'logs'}"
        with self.signals.raising():
            # Ray is left running for this process (a later run in it joins it); the reaper ends it
            # with the process.
            _init_ray(cluster.address if cluster is not None else None, then)
            self.signals.install()  # ray.init took SIGTERM over (it would exit 15 and close nothing)
            reservation = None
            if cluster is not None:  # checked against the cluster's resources before anything starts
                from agentrl.orchestration.cluster import reserve

                with starting(f"the placement group on the Ray cluster at {cluster.address}",
                              "See 'ray status' for the cluster's nodes and what holds their resources", then):
                    reservation = reserve(cluster)
                stack.callback(reservation.release)
        if job.sandbox_hosts is not None and reservation is not None:
            with starting(f"the sandbox hosts (cluster.sandbox_hosts={job.sandbox_hosts.count}, sandbox.name="
                          f"{job.sandbox_hosts.backend})",
                          f"Check that the backend works on those nodes ('agentrl doctor' there); {logs}", then):
                hosts = await job.sandbox_hosts.start(reservation)
            stack.callback(hosts.stop)
            # The envs reach the hosts through their client, not the local sandbox the job made for its checks.
            hosted = hosts.sandbox()
            stack.push_async_callback(hosted.close)
            make_env = functools.partial(job.make_env, sandbox=hosted)
        trainer_part = (f"the trainer ({config.trainer.backend}, model.path={job.model_path}, "
                        f"trainer.device={config.trainer.device})")
        trainer_fix = (f"Check that model.path loads and trainer.device exists here ('agentrl doctor'); {logs}; "
                       "the trainer's own output is on the console above")
        engine_part = f"the inference engine ({config.inference.engine}, model.path={job.model_path})"
        engine_fix = (f"Check that the engine is installed and the model loads ('agentrl doctor'; for vLLM in its own "
                      f"environment, AGENTRL_VLLM_PYTHON); {logs}")
        colocated = plan.colocated
        with self.signals.raising():
            # The trainer loads while the servers start (placement split), or with its engine (colocated).
            with starting(trainer_part, trainer_fix, then):
                trainer = TrainerGroup(config, job.model_path, job.template, run_dir / "weights", plan=plan,
                                       reservation=reservation)
            stack.callback(trainer.shutdown)
            with starting(engine_part, engine_fix, then):
                service = await start_inference(plan, config, job.model_path, trainer, log_dir=run_dir / "logs",
                                                reservation=reservation)
        stack.push_async_callback(service.aclose)  # stops supervising first: the servers are stopped on purpose
        if job.gateway is not None:  # the gateway's sessions end before the servers behind them
            stack.push_async_callback(job.gateway.aclose)
        router = service.client
        if colocated:  # the router reaches the engine through the trainer actor, which loads it first
            with starting(f"{trainer_part} with its colocated engine ({config.inference.engine})",
                          f"{trainer_fix}; placement=split runs the engine in a process of its own", then):
                await trainer.ready()
        await service.start()
        loop = job.agent_loop(router)
        worker = RolloutWorker(loop, make_env, max_concurrent=config.rollout.max_concurrent_episodes)

        start_step, version = 0, 0
        eval_before: dict[str, float | None] = {}
        if books.checkpoint is not None:
            start_step, version, eval_before = books.restore(books.checkpoint)
            await trainer.load(str(books.checkpoint.path / "trainer"))
            log.info("resuming %s from %s: step %d, policy version %d (session %d)", run_dir,
                     books.checkpoint.name, start_step, version, books.session)
        with starting(trainer_part, trainer_fix, then):
            await trainer.ready()
        await router.check_health()
        if not colocated:
            await trainer.check_servers(router)  # every server reaches the trainer's weights
        logger = MetricsLogger(
            run_dir, config.run.loggers, total_steps=config.run.total_steps, start_step=start_step,
            config=config.model_dump(mode="json"),
        )  # fmt: skip
        stack.callback(logger.close)
        if start_step:
            logger.truncate_after(start_step - 1)
        steps = TrainingSteps(job, books, trainer=trainer, router=router, worker=worker, logger=logger,
                              make_env=make_env, start_step=start_step, version=version, eval_before=eval_before)
        served = {s["weight_version"] for s in router.stats()["servers"]}
        if version > 0 or served != {0}:
            # Resumed, or servers that were already running hold other weights: serve the trainer's.
            if not colocated:
                await trainer.export(version)
            await steps.push(version)
        else:  # the servers loaded the weights the trainer starts from: check that before the first batch
            await steps.check_served(version)
        return steps


def run_training(config: AgentRLConfig) -> RunResult:
    """`agentrl run`: train `config` end to end (see the module docstring); return what happened.

    Everything is built and checked first (`build_job`, then `preflight`): a config that cannot
    do useful work fails here, in seconds, before a server, a trainer or Ray starts. The run is
    then one `asyncio.run` of `Run.main`, which closes whatever it started however it ends.
    SIGINT, SIGTERM and SIGHUP stop it alike; it then raises `RunInterrupted` naming the signal and
    the command that continues the run, whatever the closing raised after it.
    """
    run = Run(build_job(config, "run"))
    with run.signals.installed():
        try:
            return asyncio.run(run.main())
        except BaseException as exc:
            if run.signals.received is None and not isinstance(exc, KeyboardInterrupt):
                raise
            if isinstance(exc, RunInterrupted):
                raise
            raise RunInterrupted(run.signals.received or signal.SIGINT, run.continue_command) from exc
