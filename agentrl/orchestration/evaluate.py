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
ledger plus its decoded text, for inspection. Training is not this module's business.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agentrl.config import AgentRLConfig, save_config
from agentrl.errors import AgentRLError
from agentrl.gateway.session import final_segments
from agentrl.orchestration.components import build_agent_loop, env_factory, load_split_rows
from agentrl.registry import ENVS
from agentrl.rollout import GenerateClient, RolloutWorker
from agentrl.tools.session import close_default_sandbox
from agentrl.types import Trajectory

__all__ = ["EvalReport", "evaluate", "pass_at_k", "run_eval"]

SOLVED = 1.0 - 1e-9


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
    pass_at_1: float
    pass_at_k: float
    mean_reward: float
    episodes: int
    infra_failed_episodes: int
    finish_reasons: dict[str, int]
    tool_calls_per_episode: float
    tool_errors_model_per_episode: float
    tool_errors_infra_per_episode: float
    parse_errors_per_episode: float
    mean_sampled_tokens: float
    seconds: float
    by_data_source: dict[str, dict[str, float]] = field(default_factory=dict)
    resolved_rate: float | None = None
    output_dir: str = ""

    def summary(self) -> str:
        return (
            f"{self.env} | {self.model} | {self.problems} problems x {self.k} samples: "
            f"pass@1 {self.pass_at_1:.3f}, pass@{self.k} {self.pass_at_k:.3f}, mean reward {self.mean_reward:.3f}"
            + (f", resolved {self.resolved_rate:.3f}" if self.resolved_rate is not None else "")
            + f", tool calls/episode {self.tool_calls_per_episode:.2f}, infra failures {self.infra_failed_episodes}, "
            f"{self.seconds:.0f} s"
        )


def _rates(groups: list[list[Trajectory]], k: int) -> tuple[float, float]:
    p1, pk = [], []
    for group in groups:
        valid = [t for t in group if t.trainable]
        if not valid:
            continue
        c = sum((t.reward or 0.0) >= SOLVED for t in valid)
        p1.append(pass_at_k(len(valid), c, 1))
        pk.append(pass_at_k(len(valid), c, k))
    return (sum(p1) / len(p1) if p1 else 0.0, sum(pk) / len(pk) if pk else 0.0)


def _reports_resolved(env_name: str, trajs: list[Trajectory]) -> bool:
    if any("resolved" in t.metrics for t in trajs):
        return True
    try:
        return bool(getattr(ENVS.resolve(env_name), "reports_resolved", False))
    except AgentRLError:
        return False


def summarise(config: AgentRLConfig, groups: list[list[Trajectory]], seconds: float, out_dir: str = "") -> EvalReport:
    groups = [final_segments(g) for g in groups]  # an agent episode in segments counts once
    trajs = [t for g in groups for t in g]
    valid = [t for t in trajs if t.trainable]
    n = max(len(trajs), 1)

    def per_episode(key: str) -> float:
        return sum(t.metrics.get(key, 0.0) for t in trajs) / n

    p1, pk = _rates(groups, config.eval.k)
    by_source: dict[str, list[list[Trajectory]]] = defaultdict(list)
    for g in groups:
        by_source[g[0].data_source or "unknown"].append(g)
    breakdown = {}
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
        mean_reward=sum(t.reward or 0.0 for t in valid) / max(len(valid), 1),
        episodes=len(trajs),
        infra_failed_episodes=len(trajs) - len(valid),
        finish_reasons=dict(Counter(t.finish_reason.value if t.finish_reason else "none" for t in trajs)),
        tool_calls_per_episode=per_episode("tool_calls"),
        tool_errors_model_per_episode=per_episode("tool_errors_model"),
        tool_errors_infra_per_episode=per_episode("tool_errors_infra"),
        parse_errors_per_episode=per_episode("parse_errors"),
        mean_sampled_tokens=sum(t.num_sampled for t in trajs) / n,
        seconds=seconds,
        by_data_source=breakdown,
        resolved_rate=(sum(t.metrics.get("resolved", 0.0) for t in valid) / max(len(valid), 1)
                       if _reports_resolved(config.env.name, trajs) else None),
        output_dir=out_dir,
    )


async def evaluate(
    config: AgentRLConfig,
    client: GenerateClient,
    rows: list[dict[str, Any]],
    out_dir: str | Path,
    *,
    close_sandbox: bool = True,
) -> EvalReport:
    """Play `rows` with `eval.k` samples each through `client`; write and return the report.

    `close_sandbox=False` leaves this event loop's default sandbox open, for a caller (the training
    driver) whose other episodes still use it.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    loop = build_agent_loop(config, client, temperature=config.eval.temperature)
    worker = RolloutWorker(loop, env_factory(config), max_concurrent=config.rollout.max_concurrent_episodes)
    start = time.perf_counter()
    try:
        groups = await worker.run_batch(rows, config.eval.k, seed=config.run.seed)
    finally:
        if close_sandbox:
            await close_default_sandbox()
    seconds = time.perf_counter() - start
    tokenizer = loop.template.tokenizer
    with (out / "trajectories.jsonl").open("w") as f:
        for group, row in zip(groups, rows, strict=True):
            for t in group:
                record = t.to_dict()
                record["text"] = tokenizer.decode(t.token_ids, skip_special_tokens=False)
                record["ground_truth"] = (row.get("reward_model") or {}).get("ground_truth")
                f.write(json.dumps(record) + "\n")
    report = summarise(config, groups, seconds, str(out))
    (out / "report.json").write_text(json.dumps(asdict(report), indent=2))
    return report


def run_eval(config: AgentRLConfig, *, client: GenerateClient | None = None) -> EvalReport:
    """`agentrl eval`: start the configured servers (unless a client is given), evaluate, stop them."""
    from agentrl.inference.serve import serve_from_config

    rows = load_split_rows(config, "test")
    if config.eval.max_rows:
        rows = rows[: config.eval.max_rows]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(config.eval.output_dir or Path(config.run.output_dir) / f"eval-{config.env.name}-{stamp}")
    out.mkdir(parents=True, exist_ok=True)
    save_config(config, out)
    service = None
    if client is None:
        service = serve_from_config(config, log_dir=out / "logs")
        client = service.client
    try:
        return asyncio.run(evaluate(config, client, rows, out))
    finally:
        if service is not None:
            service.stop()
