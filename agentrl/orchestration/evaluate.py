"""Offline evaluation: `agentrl eval` plays an environment's dataset and reports how well it went.

The same AgentLoop and environment as training, over a dataset (`data.val_files`, else the env's
own test split), `eval.k` samples per problem. An episode *solves* its problem when its reward is
at least 1.0. The report gives pass@1 and pass@k with the unbiased estimator of Chen et al. (2021),
`1 - C(n-c, k) / C(n, k)` averaged over problems, mean reward, finish-reason counts, tool calls
and tool errors by class per episode, and the same broken down by `data_source`. Episodes that
failed for infrastructure reasons are counted and left out of the pass rates (a problem keeps its
`n` valid samples; k shrinks to n when fewer remain), never scored as failures. Environments that
report `metrics["resolved"]` (the SWE env, whose class sets `reports_resolved = True`) also get a
resolved rate: resolved valid episodes over all valid episodes (an episode the AgentLoop ended
before the env graded it counts as not resolved).

Written to the output directory: `report.json`, and `trajectories.jsonl` with every episode's
ledger and decoded text (the format of `agentrl.records.trajectory_log`; `agentrl view DIR`
shows it; an SWE episode's verdict, per-test statuses and diff, is its `info["swe"]`). For the SWE
env also `predictions.jsonl`, the agent's diffs in the SWE-bench harness format, one per instance
(`agentrl.envs.swe.swe_predictions`). Training is not this module's business.

The eval runs on one event loop inside its job (`async with job`: pre-flight, the servers, the
episodes), which closes the job's resources (sandbox, gateway, shared servers) however it ends; the
servers it started stop after them.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agentrl.config import AgentRLConfig, save_config
from agentrl.envs import Env
from agentrl.errors import InfraFailureError
from agentrl.orchestration.build import Job, build_job
from agentrl.orchestration.infra import describe_infra_failures, fix_for
from agentrl.records.trajectory_log import write_eval_trajectories
from agentrl.rollout import GenerateClient, RolloutWorker
from agentrl.types import Trajectory, final_segments

__all__ = ["EvalProgress", "EvalReport", "evaluate", "pass_at_k", "run_eval"]

SOLVED = 1.0 - 1e-9

EvalProgress = Callable[[int, int, float], None]
"""Called with (episodes done, episodes in total, seconds since the first episode started) as each
problem's samples finish, and once with (0, total, 0.0) before the first starts."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples (drawn from n, c of them correct) is correct."""
    if n <= 0:
        return 0.0
    k = min(k, n)
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass
class EvalReport:
    """What `agentrl eval` found; `report.json` holds the same fields."""

    env: str
    model: str
    problems: int
    k: int
    pass_at_1: float | None
    pass_at_k: float | None
    mean_reward: float | None
    episodes: int
    infra_failed_episodes: int
    finish_reasons: dict[str, int]
    tool_calls_per_episode: float
    tool_errors_model_per_episode: float
    tool_errors_infra_per_episode: float
    parse_errors_per_episode: float
    mean_sampled_tokens: float
    seconds: float
    by_data_source: dict[str, dict[str, float | None]] = field(default_factory=dict)
    resolved_rate: float | None = None
    output_dir: str = ""
    reward_missing: dict[str, int] = field(default_factory=dict)
    """Episodes whose reward could not be measured, by cause (`infra`, `timeout`, `parse`,
    `truncated`; counted in `infra_failed_episodes` too: masked, never scored 0)."""
    segments_per_episode: float = 1.0
    """Trajectories per episode: contexts the AgentLoop's compaction opened (`rollout.compaction`), or
    conversations an external agent held through the gateway."""
    compactions_per_episode: float = 0.0
    """Times the AgentLoop compacted an episode's context (`rollout.compaction`)."""

    @property
    def measured(self) -> bool:
        """Whether any episode was valid (not an infrastructure failure): else nothing was measured."""
        return self.pass_at_1 is not None

    def summary(self) -> str:
        if not self.measured:
            return (
                f"{self.env} | {self.model} | {self.problems} problems x {self.k} samples: NOT MEASURED: "
                f"all {self.episodes} episodes failed for infrastructure reasons, {self.seconds:.0f} s"
            )
        return (
            f"{self.env} | {self.model} | {self.problems} problems x {self.k} samples: "
            f"pass@1 {self.pass_at_1:.3f}, pass@{self.k} {self.pass_at_k:.3f}, mean reward {self.mean_reward:.3f}"
            + (f", resolved {self.resolved_rate:.3f}" if self.resolved_rate is not None else "")
            + f", tool calls/episode {self.tool_calls_per_episode:.2f}"
            + (f", segments/episode {self.segments_per_episode:.2f}, compactions/episode "
               f"{self.compactions_per_episode:.2f}" if self.segments_per_episode > 1 else "")
            + ", infra failures "
            f"{self.infra_failed_episodes}/{self.episodes}, {self.seconds:.0f} s"
        )


def _rates(groups: list[list[Trajectory]], k: int) -> tuple[float | None, float | None]:
    """pass@1 and pass@k over the problems with a valid episode; None when there is none."""
    p1, pk = [], []
    for group in groups:
        valid = [t for t in group if t.trainable]
        if not valid:
            continue
        c = sum((t.reward or 0.0) >= SOLVED for t in valid)
        p1.append(pass_at_k(len(valid), c, 1))
        pk.append(pass_at_k(len(valid), c, k))
    if not p1:
        return None, None
    return sum(p1) / len(p1), sum(pk) / len(pk)


def summarise(
    config: AgentRLConfig, groups: list[list[Trajectory]], seconds: float, out_dir: str = "",
    *, reports_resolved: bool = False,
) -> EvalReport:
    every_segment = [t for g in groups for t in g]
    groups = [final_segments(g) for g in groups]  # an episode in segments counts once
    trajs = [t for g in groups for t in g]
    valid = [t for t in trajs if t.trainable]
    n = max(len(trajs), 1)

    def per_episode(key: str) -> float:
        return sum(t.metrics.get(key, 0.0) for t in trajs) / n

    p1, pk = _rates(groups, config.eval.k)
    by_source: dict[str, list[list[Trajectory]]] = defaultdict(list)
    for g in groups:
        by_source[g[0].data_source or "unknown"].append(g)
    breakdown: dict[str, dict[str, float | None]] = {}
    for source, gs in sorted(by_source.items()):
        s1, sk = _rates(gs, config.eval.k)
        breakdown[source] = {"problems": len(gs), "pass_at_1": s1, f"pass_at_{config.eval.k}": sk}
    return EvalReport(
        env=config.env.name,
        model=config.model.path,
        problems=len(groups),
        k=config.eval.k,
        pass_at_1=p1,
        pass_at_k=pk,
        mean_reward=sum(t.reward or 0.0 for t in valid) / len(valid) if valid else None,
        episodes=len(trajs),
        infra_failed_episodes=sum(t.fault == "infra" for t in trajs),
        finish_reasons=dict(Counter(t.finish_reason.value if t.finish_reason else "none" for t in trajs)),
        tool_calls_per_episode=per_episode("tool_calls"),
        tool_errors_model_per_episode=per_episode("tool_errors_model"),
        tool_errors_infra_per_episode=per_episode("tool_errors_infra"),
        parse_errors_per_episode=per_episode("parse_errors"),
        mean_sampled_tokens=sum(t.num_sampled for t in every_segment) / n,
        seconds=seconds,
        by_data_source=breakdown,
        resolved_rate=(sum(t.metrics.get("resolved", 0.0) for t in valid) / len(valid)
                       if valid and (reports_resolved or any("resolved" in t.metrics for t in trajs)) else None),
        output_dir=out_dir,
        reward_missing=dict(Counter(str(t.info["reward_missing"].get("cause")) for t in trajs
                                    if isinstance(t.info.get("reward_missing"), dict))),
        segments_per_episode=len(every_segment) / n if trajs else 1.0,
        compactions_per_episode=per_episode("compactions"),
    )


async def evaluate(
    job: Job,
    client: GenerateClient,
    rows: list[dict[str, Any]],
    out_dir: str | Path,
    *,
    progress: EvalProgress | None = None,
    make_env: Callable[[], Env] | None = None,
) -> EvalReport:
    """Play `rows` with `eval.k` samples each through `client`; write and return the report.

    The job's sandbox stays open: whoever built the job closes it (`Job.aclose`). `progress` hears of
    every finished problem. `make_env`: the run's env factory when it is not `job.make_env` (a
    cluster run's envs use its sandbox hosts).
    """
    config = job.config
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    loop = job.agent_loop(client, evaluation=True)
    worker = RolloutWorker(loop, make_env or job.make_env, max_concurrent=config.rollout.max_concurrent_episodes)
    start = time.perf_counter()
    if progress is None:
        groups = await worker.run_batch(rows, config.eval.k, seed=config.run.seed)
    else:
        groups = await _run_with_progress(worker, rows, config.eval.k, config.run.seed, progress, start)
    seconds = time.perf_counter() - start
    write_eval_trajectories(out / "trajectories.jsonl", groups, rows, loop.template.tokenizer)
    _write_predictions(job, groups, out)
    report = summarise(config, groups, seconds, str(out), reports_resolved=job.env_cls.reports_resolved)
    (out / "report.json").write_text(json.dumps(asdict(report), indent=2))
    return report


def _write_predictions(job: Job, groups: list[list[Trajectory]], out: Path) -> None:
    """`predictions.jsonl` for the SWE-bench harness, when the env is the SWE env (or derives from it)."""
    from agentrl.envs.swe import SweEnv, swe_predictions

    if not issubclass(job.env_cls, SweEnv):
        return
    lines = [json.dumps(p) + "\n" for p in swe_predictions(groups, job.config.model.path)]
    (out / "predictions.jsonl").write_text("".join(lines))


def check_infra_failures(config: AgentRLConfig, report: EvalReport, groups_dir: str | Path) -> None:
    """Raise `InfraFailureError` when more than `run.max_infra_failure_rate` of the evaluation's
    episodes failed for infrastructure reasons (the report is written first; nothing is lost)."""
    if not report.episodes or report.infra_failed_episodes / report.episodes <= config.run.max_infra_failure_rate:
        return
    trajs = _read_trajectories(Path(groups_dir) / "trajectories.jsonl")
    cause, count = describe_infra_failures(trajs)
    measured = "nothing was measured" if not report.measured else "the scores cover too few episodes to mean much"
    raise InfraFailureError(
        f"{report.infra_failed_episodes} of {report.episodes} evaluation episodes failed for infrastructure "
        f"reasons (more than run.max_infra_failure_rate={config.run.max_infra_failure_rate:g}): {measured}. "
        f"Commonest cause ({count} episodes): {cause}\nFix: {fix_for(cause)}. The report is in {report.output_dir}."
    )


async def _run_with_progress(
    worker: RolloutWorker, rows: list[dict[str, Any]], k: int, seed: int, progress: EvalProgress, start: float
) -> list[list[Trajectory]]:
    """`worker.run_batch`, reporting each group as it finishes (groups come back in row order)."""
    total = len(rows) * k
    progress(0, total, 0.0)
    by_index: dict[int, list[Trajectory]] = {}
    async for group in worker.stream_groups(rows, k, seed=seed):
        by_index[int(group[0].group_id.removeprefix("g"))] = group
        progress(len(by_index) * k, total, time.perf_counter() - start)
    return [by_index[i] for i in range(len(rows))]



def _read_trajectories(path: Path) -> list[Trajectory]:
    out = []
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                d = json.loads(line)
                out.append(Trajectory(fault=d.get("fault"), error=d.get("error")))
    return out


def run_eval(
    config: AgentRLConfig, *, client: GenerateClient | None = None, progress: EvalProgress | None = None
) -> EvalReport:
    """`agentrl eval`: build and check everything, start the configured servers (unless a client is
    given), evaluate, stop them. Raises `InfraFailureError` (after writing the report) when too many
    episodes failed for infrastructure reasons."""
    job = build_job(config, "eval", own_client=client is not None)
    report, out = asyncio.run(_eval_job(job, client, progress))
    check_infra_failures(config, report, out)
    return report


async def _eval_job(
    job: Job, client: GenerateClient | None, progress: EvalProgress | None
) -> tuple[EvalReport, Path]:
    """The whole eval on one event loop, inside the job (`async with job`: its sandbox's workers and
    shared servers live on this loop and close with it however the eval ends): pre-flight, the
    servers, the episodes, the report; what it reported and where. The servers stop after the job's
    resources closed (a gateway's sessions end before the servers behind them)."""
    from agentrl.inference.serve import InferenceService, serve_from_config
    from agentrl.orchestration.preflight import preflight

    config = job.config
    service: InferenceService | None = None
    try:
        async with job:
            await asyncio.to_thread(preflight, job)  # its checks run on event loops of their own
            stamp = time.strftime("%Y%m%d-%H%M%S")
            out = Path(config.eval.output_dir or Path(config.run.output_dir) / f"eval-{config.env.name}-{stamp}")
            out.mkdir(parents=True, exist_ok=True)
            save_config(config, out)
            if client is None:
                service = serve_from_config(config, log_dir=out / "logs", model_path=job.model_path)
                client = service.client
            return await evaluate(job, client, job.val_rows, out, progress=progress), out
    finally:
        if service is not None:
            service.stop()
