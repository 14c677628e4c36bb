"""`agentrl check onpolicy`: does this config's engine, model, template, sampling and dtype train on-policy?

A short conformance run of the config's own pieces, built the way a run builds them (`build_job`,
`serve_from_config`, the job's AgentLoop and env, the trainer backend `make_backend`): a few
dataset rows are rolled out on the configured engine at `rollout.temperature`/`top_p`, then

- (a) `template`: each episode's ledger against a full re-render of its conversation by the chat
  template, token for token (sampled text that re-tokenises differently but decodes to the same
  text agrees: `agentrl.chat.render_difference`);
- (b) `rescore`: the trainer re-scores the sampled ids in `model.dtype`: max, p99 and mean
  |rollout - trainer| logprob gap, against the gate's thresholds (`algorithm.mismatch_gate`);
- (c) `kept_set`: when top_p (or top_k/min_p, where the config has them) restricts sampling, the
  same gap over the restricted run, and the trainer's kept-set disagreement when it reports one;
- (d) `cache`: the same prefix sampled before and after pushing perturbed weights: the logprob of
  the first sampled token must change, and agree with the perturbed model (no stale prefix cache);
- (e) `placement`: the same seeded probes sampled in split placement (the server process) and in
  colocated placement (the engine built in this process, given the trainer's tensors by an
  in-memory push): the logprob gap over the tokens both drew (`placement_check`);
- (f) `dtype`: trainer scoring in bfloat16 vs float32 over the same tokens;
- (g) `served`: the check a run makes after every push (`served_policy`), on (d)'s push: the run's
  probe scored by every server before and after the push against the base and the perturbed model
  in this process, (i) the gap at the pushed version and (ii) the moves, within the dtype pair's
  `tol`; with the push's phases as the servers report them (pause, transfer, load) and the check's
  own seconds.

Each check is PASS, FAIL or SKIP with its figures; the run fails when any check fails. It writes
nothing into a run directory and trains nothing. What needs the servers, (a)'s rollouts, (e)'s split
side and (d), runs on one event loop inside the job (`async with job`, which closes its sandbox and
shared servers however that ends); the servers it started stop right after, before the trainer's side
of (b), (c), (e) and (f) runs in this process.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from agentrl.chat import render_difference
from agentrl.config import AgentRLConfig
from agentrl.errors import ConfigError
from agentrl.orchestration.build import Job, build_job
from agentrl.orchestration.placement_check import (
    PlacementProbe,
    compare_placements,
    engine_dtype,
    generate_colocated,
    generate_split,
    placement_probes,
    placement_skip_reason,
    placement_tolerance,
)
from agentrl.orchestration.served_policy import ServedProbe, build_probe, compare_served, served_tolerance
from agentrl.rollout import RolloutWorker
from agentrl.sampling import kept_set_rule, sampling_params
from agentrl.types import Generation, Trajectory

__all__ = ["CheckResult", "OnPolicyReport", "run_onpolicy_check"]

log = logging.getLogger(__name__)

Status = Literal["PASS", "FAIL", "SKIP"]


@dataclass
class CheckResult:
    """One check: its status, its figures and a sentence saying what was seen."""

    name: str
    status: Status
    figures: dict[str, float] = field(default_factory=dict)
    detail: str = ""


@dataclass
class OnPolicyReport:
    """Every check of one `agentrl check onpolicy` run, and the settings it ran with."""

    settings: dict[str, Any]
    checks: list[CheckResult] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return all(c.status != "FAIL" for c in self.checks)

    def to_json(self) -> str:
        return json.dumps({"passed": self.passed, **asdict(self)}, indent=2)

    def text(self) -> str:
        lines = ["on-policy check: " + ", ".join(f"{k}={v}" for k, v in self.settings.items())]
        for c in self.checks:
            figures = " ".join(f"{k}={_fmt(v)}" for k, v in c.figures.items())
            lines.append(f"  {c.status:4}  ({c.name}) {figures}" + (f"\n        {c.detail}" if c.detail else ""))
        lines.append(f"{'PASSED' if self.passed else 'FAILED'} in {self.seconds:.0f} s")
        return "\n".join(lines)


def _fmt(v: float) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def run_onpolicy_check(config: AgentRLConfig, *, rows: int = 4, bf16_vs_fp32: bool = True,
                       placement: bool = True) -> OnPolicyReport:
    """Run every check on the first `rows` training rows (one episode each); return the report.
    `bf16_vs_fp32` False skips (f), `placement` False skips (e)."""
    if rows < 1:
        raise ConfigError(f"--rows must be at least 1, got {rows}.")
    start = time.perf_counter()
    job = build_job(config, "run")
    skip_placement = "--no-placement was given" if not placement else placement_skip_reason(config)
    with tempfile.TemporaryDirectory(prefix="agentrl-check-") as tmp:
        picked, trajs, tools, (cache, served), probes, split = asyncio.run(
            _on_servers(job, rows, Path(tmp), compare_placement=skip_placement is None))
    # the trainer's side, after the servers stopped and the job closed: it needs neither
    report = OnPolicyReport({
        "engine": config.inference.engine, "model": config.model.path, "template": config.model.chat_template
        or "tokenizer's", "dtype": config.model.dtype, "temperature": config.rollout.temperature,
        "top_p": config.rollout.top_p, **_restrictions(config), "rows": len(picked),
    })  # fmt: skip
    report.checks.append(_check_template(job, trajs, tools))
    backend = _backend(config, job.model_path, config.model.dtype)
    old, disagreement = _score(backend, trajs, config)
    report.checks.append(_check_rescore("rescore", config, trajs, old))
    report.checks.append(_check_kept_set(config, trajs, old, disagreement))
    report.checks.append(cache)
    report.checks.append(CheckResult("placement", "SKIP", detail=skip_placement) if skip_placement else
                         _check_placement(config, job.model_path, backend, probes, split))
    report.checks.append(_check_dtype(config, job.model_path, trajs, backend) if bf16_vs_fp32 else
                         CheckResult("dtype", "SKIP", detail="--no-dtype was given"))
    report.checks.append(served)
    report.seconds = time.perf_counter() - start
    return report


def _restrictions(config: AgentRLConfig) -> dict[str, Any]:
    """top_k / min_p when the config has them (kept-set replay adds them to `rollout`)."""
    return {k: getattr(config.rollout, k) for k in ("top_k", "min_p") if k in type(config.rollout).model_fields}


async def _on_servers(
    job: Job, rows: int, tmp: Path, *, compare_placement: bool
) -> tuple[list[dict[str, Any]], list[Trajectory], list[Any], tuple[CheckResult, CheckResult], list[PlacementProbe],
           list[Generation]]:
    """Everything that needs the servers or the job's resources, on one event loop inside the job
    (`async with job`: closed however the check ends, then the servers stopped): the rows picked, the
    rollouts, the split side of the placement check (before the cache check pushes other weights),
    then the cache and served-policy checks (one push)."""
    from agentrl.inference.serve import InferenceService, serve_from_config

    service: InferenceService | None = None
    try:
        async with job:
            picked = [r for r in job.train_rows if r is not None][:rows]
            if not picked:
                raise ConfigError("the config's training data has no usable row to roll out; check data.train_files.")
            service = serve_from_config(job.config, log_dir=tmp / "logs", model_path=job.model_path)
            await service.start()
            try:
                trajs, tools = await _roll_out(job, service, picked)
                probes = placement_probes(job.config, trajs) if compare_placement else []
                split = await generate_split(service.client, probes)
                cache = await _check_cache(job.config, job, service.client, trajs, tmp)
            finally:
                await service.stop_supervising()
                await service.client.aclose()
    finally:
        if service is not None:
            service.stop()
    return picked, trajs, tools, cache, probes, split


async def _roll_out(job: Job, service: Any, rows: list[dict[str, Any]]) -> tuple[list[Trajectory], list[Any]]:
    """One episode per row through the job's own AgentLoop, plus the tools each env offered."""
    loop = job.agent_loop(service.client)
    worker = RolloutWorker(loop, job.make_env, max_concurrent=job.config.rollout.max_concurrent_episodes)
    groups = await worker.run_batch(rows, 1, seed=job.config.run.seed)
    trajs = [g[0] for g in groups]
    failed = [t for t in trajs if not t.trainable or t.num_sampled == 0]
    if len(failed) == len(trajs):
        raise ConfigError(f"no episode of the check sampled anything it could score (first: "
                          f"{failed[0].finish_reason} {failed[0].error or ''}); run `agentrl eval` on the config.")
    tools = []
    for row, t in zip(rows, trajs, strict=True):
        env = job.make_env()
        try:
            _obs, info = await env.areset(seed=0, options={"row": row, "episode_id": t.episode_id})
            tools.append(info.get("tools") or None)
        finally:
            await env.aclose()
    keep = [i for i, t in enumerate(trajs) if t.trainable and t.num_sampled]
    return [trajs[i] for i in keep], [tools[i] for i in keep]


def _check_template(job: Job, trajs: list[Trajectory], tools: list[Any]) -> CheckResult:
    diffs = [render_difference(job.template, t, tools_, prefix=True) for t, tools_ in zip(trajs, tools, strict=True)]
    bad = [d for d in diffs if d]
    figures = {"episodes": float(len(trajs)), "mismatched": float(len(bad))}
    if bad:
        return CheckResult("template", "FAIL", figures, f"the re-render differs from the ledger: {bad[0]}. "
                           "The chat template renders the conversation differently from what the model sampled "
                           "(model.chat_template / model.tokenizer).")
    return CheckResult("template", "PASS", figures, "every ledger equals the re-render of its conversation")


def _backend(config: AgentRLConfig, model_path: str, dtype: str) -> Any:
    from agentrl.trainer.backend import make_backend

    cfg = config.model_copy(update={"model": config.model.model_copy(update={"dtype": dtype})})
    return make_backend(cfg, model_path)


def _score(backend: Any, trajs: list[Trajectory], config: AgentRLConfig) -> tuple[Any, float | None]:
    """The trainer's logprobs of the sampled ids (over each token's recorded kept set, when the
    rollout truncated sampling) and the share of sampled tokens outside the kept set the trainer's
    own logits give under the rollout's rule (None when sampling is not truncated)."""
    rule = kept_set_rule(config.rollout)
    if rule is None:
        return backend.compute_logprobs(trajs, temperature=config.rollout.temperature), None
    old = backend.compute_logprobs(trajs, temperature=config.rollout.temperature, kept_rule=rule)
    return old, backend.take_kept_set_disagreement()


def _gaps(trajs: list[Trajectory], a: Any, b: Any) -> tuple[Any, Any]:
    """(|a - b| over every sampled token, per-sequence mean of it)."""
    import torch

    from agentrl.trainer.packing import pad_trajectories

    mask = pad_trajectories(trajs).loss_mask > 0
    gap = (a.float() - b.float()).abs()
    per_seq = torch.stack([gap[i][mask[i]].mean() for i in range(len(trajs))])
    return gap[mask], per_seq


def _gap_figures(gap: Any, per_seq: Any) -> dict[str, float]:
    import torch

    return {"max_gap": float(gap.max()), "p99_gap": float(torch.quantile(gap.double(), 0.99)),
            "mean_gap": float(gap.mean()), "max_seq_mean_gap": float(per_seq.max()), "tokens": float(gap.numel())}


def _check_rescore(name: str, config: AgentRLConfig, trajs: list[Trajectory], old: Any) -> CheckResult:
    from agentrl.trainer.packing import pad_trajectories

    rollout = pad_trajectories(trajs).rollout_logprobs
    gap, per_seq = _gaps(trajs, old, rollout)
    if gap.numel() == 0:  # every sampled token is out of the loss: its kept set overflowed the cap
        overflowed = sum(1 for t in trajs for k in t.kept_sets if not k)
        return CheckResult(name, "FAIL", {"tokens": 0.0, "kept_set_overflow": float(overflowed)}, (
            f"no sampled token can be scored: all {overflowed} kept sets overflowed rollout.max_kept_set="
            f"{config.rollout.max_kept_set} (they are masked out of the loss, so a run would train on nothing). "
            "Restrict sampling further (rollout.top_k) or raise rollout.max_kept_set."))
    per_seq = per_seq[~per_seq.isnan()]  # sequences with no scored token have no mean
    figures = _gap_figures(gap, per_seq)
    gate = config.algorithm.mismatch_gate
    over = figures["max_gap"] > gate.max_logprob_gap or figures["max_seq_mean_gap"] > gate.max_mean_logprob_gap
    limits = (f"the gate's limits: max_logprob_gap={gate.max_logprob_gap:g}, "
              f"max_mean_logprob_gap={gate.max_mean_logprob_gap:g}")
    if over:
        return CheckResult(name, "FAIL", figures, f"the trainer's logprobs of the sampled ids are over {limits}: "
                           "check model.dtype against the server's, and that the trainer replays the sampling "
                           "settings (temperature, top_p/top_k/min_p).")
    return CheckResult(name, "PASS", figures, f"within {limits}")


def _check_kept_set(config: AgentRLConfig, trajs: list[Trajectory], old: Any,
                    disagreement: float | None = None) -> CheckResult:
    restricted = {k: v for k, v in {"top_p": config.rollout.top_p, **_restrictions(config)}.items()
                  if (k == "top_p" and v < 1.0) or (k == "top_k" and v not in (None, -1, 0))
                  or (k == "min_p" and v not in (None, 0.0))}
    if not restricted:
        return CheckResult("kept_set", "SKIP", detail="sampling is not restricted (top_p=1, no top_k/min_p): "
                           "no kept set to replay")
    result = _check_rescore("kept_set", config, trajs, old)
    limit = config.algorithm.mismatch_gate.max_kept_set_disagreement
    if disagreement is not None:
        result.figures["kept_set_disagreement"] = disagreement
        if disagreement > limit:
            result.status = "FAIL"
    said = ("not measured (no kept set came back)" if disagreement is None else
            f"{disagreement:.3g} of sampled tokens lie outside the trainer's own kept set (the gate's limit: "
            f"max_kept_set_disagreement={limit:g})")
    result.detail = f"sampling restricted by {restricted}; {result.detail}; kept-set disagreement {said}"
    return result


async def _check_cache(config: AgentRLConfig, job: Job, router: Any, trajs: list[Trajectory],
                       tmp: Path) -> tuple[CheckResult, CheckResult]:
    """(d) Sample from one prefix, push perturbed weights, sample again: the server must use them;
    and (g) the served-policy check on the same push."""
    if config.inference.engine == "external" or config.inference.urls:
        why = "servers this check did not start are not given other weights"
        return CheckResult("cache", "SKIP", detail=why), CheckResult("served", "SKIP", detail=why)
    prefix = list(trajs[0].token_ids[: trajs[0].prompt_length])
    # The reference logprob is over the whole vocabulary: so is the probe's.
    sampling = sampling_params(config.rollout, max_tokens=1, seed=config.run.seed, whole_vocabulary=True)
    before = await router.generate(prefix, sampling, session_id="check-cache")
    probe = build_probe(job.template, seed=config.run.seed, max_len=config.rollout.max_total_tokens)
    served_before = await _probe_scores(router, probe)
    perturbed, perturbed_dir = await asyncio.to_thread(_perturbed_copy, job.model_path, tmp / "perturbed", config.run.seed)
    pushed = await router.update_weights(str(perturbed_dir), 1)
    served = await _check_served(config, job, router, probe, served_before, perturbed, pushed)
    after = await router.generate(prefix, sampling, session_id="check-cache")
    reference = _next_token_logprob(perturbed, prefix, after.token_ids[0], config.rollout.temperature)
    base_lp = before.logprobs[0] if before.token_ids[0] == after.token_ids[0] else float("nan")
    figures = {"before": float(base_lp), "after": float(after.logprobs[0]), "perturbed_model": float(reference),
               "after_vs_perturbed_gap": abs(after.logprobs[0] - reference)}
    gate = config.algorithm.mismatch_gate
    changed = math.isnan(base_lp) or abs(after.logprobs[0] - base_lp) > 1e-4
    if not changed or figures["after_vs_perturbed_gap"] > gate.max_logprob_gap:
        return CheckResult("cache", "FAIL", figures, "after a weight push the server's logprob of the same prefix "
                           f"{'did not change' if not changed else 'does not match the pushed weights'}: it serves "
                           "stale weights or a stale prefix cache. Check inference.prefix_caching and the weight push."
                           ), served
    return CheckResult("cache", "PASS", figures, "the pushed weights reached the server, prefix cache included"), served


async def _probe_scores(router: Any, probe: ServedProbe) -> dict[str, list[list[float]]]:
    """Every healthy server's logprobs of each probe sequence, by server id."""
    out: dict[str, list[list[float]]] = {}
    for seq in probe.sequences:
        for sid, answer in (await router.score_each(list(seq))).items():
            out.setdefault(sid, []).append(list(answer.logprobs))
    return out


async def _check_served(config: AgentRLConfig, job: Job, router: Any, probe: ServedProbe,
                        served_before: dict[str, list[list[float]]], perturbed: Any,
                        pushed: dict[str, Any]) -> CheckResult:
    """(g): the served-policy check of a run (`served_policy`) on the push of the perturbed weights."""
    start = time.perf_counter()
    served_after = await _probe_scores(router, probe)
    seconds = time.perf_counter() - start
    base, moved = await asyncio.to_thread(_reference_probe_scores, job.model_path, perturbed, probe)
    trainer_dtype = "float32"  # the references are scored in float32 in this process
    tol = served_tolerance(engine_dtype(config, job.model_path), trainer_dtype)
    checks = [compare_served(replica=sid, version=1, served=served_after[sid], trainer=moved, tol=tol,
                             previous=(0, served_before[sid], base))
              for sid in sorted(set(served_after) & set(served_before))]
    reports = [r for r in pushed.values() if r is not None]
    figures = {"tol": tol, "gap_max": max(c.gap for c in checks), "moved_gap_max": max(c.moved_gap for c in checks),
               "moved_tokens_min": float(min(c.moved_tokens for c in checks)),
               **({"pause_s": max(r.pause_seconds for r in reports), "transfer_s": max(r.receive_seconds for r in reports),
                   "load_s": max(r.seconds - r.receive_seconds for r in reports)} if reports else {}),
               "verify_s": seconds}
    failed = [c for c in checks if not c.ok]
    if failed:
        return CheckResult("served", "FAIL", figures, "after a weight push a server does not serve the pushed weights: "
                           + " | ".join(c.describe() for c in failed))
    return CheckResult("served", "PASS", figures, f"{len(checks)} server(s) serve the pushed weights: the probe's "
                       f"{probe.scored_tokens} tokens within tol of the perturbed model, and moved with it")


def _reference_probe_scores(model_path: str, perturbed: Any, probe: ServedProbe) -> tuple[list[list[float]],
                                                                                        list[list[float]]]:
    """The probe's logprobs under the base model and under `perturbed`, in float32 in this process."""
    import torch
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)

    def scores(model: Any) -> list[list[float]]:
        out = []
        with torch.no_grad():
            for seq in probe.sequences:
                logits = model(torch.tensor([list(seq)])).logits[0, :-1].float()
                lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq[1:]).unsqueeze(-1)).squeeze(-1)
                out.append([float(x) for x in lp.tolist()])
        return out

    return scores(base), scores(perturbed)


def _check_placement(config: AgentRLConfig, model_path: str, backend: Any, probes: list[PlacementProbe],
                     split: list[Generation]) -> CheckResult:
    """(e): the split answers against the same probes on the engine in this process (after an
    in-memory push of the trainer's tensors)."""
    colocated, pushed = asyncio.run(generate_colocated(config, model_path, backend, probes))
    dtype = engine_dtype(config, model_path)
    result = compare_placements(split, colocated, placement_tolerance(dtype))
    result.figures["pushed_tensors"] = float(pushed)
    return CheckResult("placement", result.status, result.figures,
                       f"{config.inference.engine} ({dtype}) as a server process vs in this process after an "
                       f"in-memory push of the trainer's tensors; {result.detail}")


def _perturbed_copy(model_path: str, out: Path, seed: int) -> tuple[Any, Path]:
    """Save the model with seeded noise on every weight into `out`; return (the perturbed model, out)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05 * (p.float().std() if p.numel() > 1 else 1.0))
    model.save_pretrained(out)
    for f in Path(model_path).iterdir():  # the tokenizer files a server may look for
        if f.is_file() and f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(f, out / f.name)
    return model, out


def _next_token_logprob(model: Any, prefix: list[int], token: int, temperature: float) -> float:
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prefix])).logits[0, -1].float()
    return float(torch.log_softmax(logits / max(temperature, 1e-6), -1)[token])


def _check_dtype(config: AgentRLConfig, model_path: str, trajs: list[Trajectory], backend: Any) -> CheckResult:
    """The same sampled tokens scored by the trainer in bfloat16 and in float32."""
    own = config.model.dtype
    scores = {}
    for dtype in ("float32", "bfloat16"):
        scorer = backend if own == dtype else _backend(config, model_path, dtype)
        scores[dtype] = _score(scorer, trajs, config)[0]
    gap, per_seq = _gaps(trajs, scores["bfloat16"], scores["float32"])
    if gap.numel() == 0:
        return CheckResult("dtype", "SKIP", detail="no sampled token is in the loss (every kept set overflowed "
                           "rollout.max_kept_set): nothing to compare")
    figures = _gap_figures(gap, per_seq[~per_seq.isnan()])
    gate = config.algorithm.mismatch_gate
    note = (f"model.dtype={own}; a gap this size between engine and trainer trips the gate"
            if figures["max_seq_mean_gap"] > gate.max_mean_logprob_gap else f"model.dtype={own}")
    return CheckResult("dtype", "PASS", figures, f"bf16 vs fp32 trainer scoring; {note}. Informational: it fails "
                       "nothing by itself; the (rescore) check compares the engine with the trainer's own dtype.")
