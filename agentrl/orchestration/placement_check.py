"""Check (e) of `agentrl check onpolicy`: do colocated and split placement sample the same thing?

A run's engine is either a server process of its own (placement `split`; its weights pushed as
files) or lives in the trainer's process (placement `colocated`; its weights pushed in memory from
the trainer's tensors). Both must give the trainer the same distribution. This module compares
them on the same probes: for each rolled-out episode, the prefix its first generation started from,
sampled with the rollout's settings (temperature, top_p/top_k/min_p) and a fixed seed per probe
(`group_seed(run.seed, i)`), one request at a time so batching cannot differ.

- split: the probes go to the check's server process(es), before any other weights are pushed;
- colocated: the configured engine is built in this process (`colocated.InProcessVLLM` for `vllm`,
  `hf_server.HFEngine` for `hf`), given the trainer backend's own tensors by an in-memory push
  (the in-process checkpoint engine, as a colocated run pushes), and asked through
  `ColocatedClient`, the client a colocated run's router holds.

`compare_placements` then compares what can be compared: over each probe's common prefix of
sampled ids (the tokens both placements drew from the same context), the |logprob| gap, token for
token, and the kept sets; after the first differing id the contexts differ and nothing more is
compared. It passes when the largest gap is within `placement_tolerance(model.dtype)`. Engines that
cannot run in the trainer's process (`sglang`, an `external` server, servers of `inference.urls`)
are skipped with the reason (`placement_skip_reason`). This module does not start the split
servers (the check does) and trains nothing.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from agentrl.config import AgentRLConfig
from agentrl.rollout import group_seed
from agentrl.sampling import sampling_params
from agentrl.types import Generation, SamplingParams, Trajectory

__all__ = [
    "PlacementComparison",
    "PlacementProbe",
    "compare_placements",
    "engine_dtype",
    "generate_colocated",
    "generate_split",
    "placement_probes",
    "placement_skip_reason",
    "placement_tolerance",
]

# Largest |logprob| gap (nats) between the placements on one shared token. Both run the same
# engine code on the same weights, so in float32 only summation order differs (measured ~1e-6);
# in 16-bit dtypes rounding of the same sums differs by more (bf16 vs fp32 scoring of the tiny
# model: 1.6e-3), so they get a looser bound.
FLOAT32_TOLERANCE = 1e-3
LOW_PRECISION_TOLERANCE = 5e-2


def placement_tolerance(dtype: str) -> float:
    """The largest gap (e) accepts for the engine's dtype (`engine_dtype`; unresolved `auto`: the looser)."""
    return FLOAT32_TOLERANCE if dtype == "float32" else LOW_PRECISION_TOLERANCE


def engine_dtype(config: AgentRLConfig, model_path: str) -> str:
    """The dtype the engine computes in: `model.dtype`, with `auto` resolved as the engines do (hf:
    float32; vLLM: the checkpoint's `torch_dtype`)."""
    dtype = config.model.dtype
    if dtype != "auto":
        return dtype
    if config.inference.engine == "hf":
        return "float32"
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return "auto"
    return str(cfg.get("torch_dtype") or cfg.get("dtype") or "auto")


def placement_skip_reason(config: AgentRLConfig) -> str | None:
    """Why this config's engine cannot be compared in both placements, or None when it can."""
    inf = config.inference
    if inf.engine == "external" or inf.urls:
        return ("the servers were not started by this check (inference.engine=external or inference.urls), so "
                "the engine cannot also be placed in the trainer's process")
    if inf.engine not in ("vllm", "hf"):
        return (f"inference.engine={inf.engine} cannot run in the trainer's process (placement colocated runs "
                "vLLM, and this check runs hf there too); only split placement exists for it")
    return None


@dataclass(frozen=True)
class PlacementProbe:
    """One request both placements answer: a prefix and the sampling (seed included)."""

    prompt_ids: list[int]
    sampling: SamplingParams


def placement_probes(config: AgentRLConfig, trajs: Sequence[Trajectory]) -> list[PlacementProbe]:
    """One probe per episode: the prefix of its first generation, the rollout's sampling settings
    and a seed of its own, at most `rollout.max_tokens_per_turn` tokens."""
    r = config.rollout
    return [PlacementProbe(list(t.token_ids[: t.prompt_length]),
                           sampling_params(r, max_tokens=r.max_tokens_per_turn, seed=group_seed(config.run.seed, i)))
            for i, t in enumerate(trajs)]


@dataclass
class PlacementComparison:
    """What `compare_placements` saw: PASS or FAIL, its figures and a sentence."""

    status: Literal["PASS", "FAIL"]
    figures: dict[str, float] = field(default_factory=dict)
    detail: str = ""


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def compare_placements(split: Sequence[Generation], colocated: Sequence[Generation],
                       tolerance: float) -> PlacementComparison:
    """Compare the two placements' answers to the same probes (see the module docstring)."""
    if len(split) != len(colocated):
        raise ValueError(f"{len(split)} split answers against {len(colocated)} colocated ones: one each per probe")
    gaps: list[float] = []
    identical = kept_mismatches = 0
    divergences: list[int] = []
    for a, b in zip(split, colocated, strict=True):
        n = _common_prefix(a.token_ids, b.token_ids)
        if a.token_ids == b.token_ids:
            identical += 1
        else:
            divergences.append(n)
        gaps.extend(abs(a.logprobs[j] - b.logprobs[j]) for j in range(n))
        if (a.kept_sets is None) != (b.kept_sets is None):
            kept_mismatches += n  # one placement truncated the vocabulary, the other did not
        elif a.kept_sets is not None and b.kept_sets is not None:
            kept_mismatches += sum(a.kept_sets[j] != b.kept_sets[j] for j in range(n))
    figures = {"probes": float(len(split)), "identical": float(identical), "compared_tokens": float(len(gaps)),
               "kept_set_mismatches": float(kept_mismatches)}
    if divergences:
        figures["first_divergence"] = float(min(divergences))
    if not gaps:
        return PlacementComparison("FAIL", figures, (
            "no sampled token could be compared: from the same prefix and seed the two placements drew a "
            "different first token on every probe (or drew nothing). The colocated engine does not sample "
            "what the server samples: check that the in-memory push carries the trainer's weights "
            "(model.dtype) and that both honour the request seed."))
    figures["max_gap"] = max(gaps)
    figures["mean_gap"] = math.fsum(gaps) / len(gaps)
    seen = (f"{identical} of {len(split)} probes drew the same ids in both placements"
            + (f"; the others agree on their first {min(divergences)}+ tokens" if divergences else "")
            + f"; {kept_mismatches} kept sets differ on the shared tokens")
    if figures["max_gap"] > tolerance:
        return PlacementComparison("FAIL", figures, (
            f"the same tokens from the same context get logprobs up to {figures['max_gap']:.3g} nats apart in "
            f"colocated and split placement (tolerance {tolerance:g}); {seen}. The engine in the trainer's "
            "process does not compute what the server computes: compare model.dtype with the server's, and the "
            "weights the in-memory push delivers with the checkpoint's."))
    return PlacementComparison("PASS", figures, f"max gap within the tolerance {tolerance:g}; {seen}")


async def generate_split(router: Any, probes: Sequence[PlacementProbe]) -> list[Generation]:
    """The probes on the split servers, one at a time."""
    return [await router.generate(p.prompt_ids, p.sampling, session_id=f"check-placement-{i}")
            for i, p in enumerate(probes)]


def _in_process_engine(config: AgentRLConfig, model_path: str) -> Any:
    """The configured engine built in this process, as a colocated run builds it."""
    inf = config.inference
    if inf.engine == "hf":
        from agentrl.inference.hf_server import HFEngine

        return HFEngine(model_path, trust_remote_code=config.model.trust_remote_code, dtype=config.model.dtype)
    from agentrl.inference.colocated import InProcessVLLM

    return InProcessVLLM(
        model_path, max_model_len=inf.max_model_len, kv_cache_bytes=int(inf.cpu_kv_cache_gb * 2**30),
        prefix_caching=inf.prefix_caching, enforce_eager=inf.enforce_eager, dtype=config.model.dtype,
        seed=config.run.seed, gpu_memory_utilization=inf.gpu_memory_utilization,
        trust_remote_code=config.model.trust_remote_code,
    )  # fmt: skip


def _local_host(server: Any) -> Any:
    """The `HostCall` of an engine served in this very process (`colocated_client.HostCall`)."""

    async def call(method: str, *args: Any) -> Any:
        if method == "engine_generate":
            return await server.generate(args[0])
        if method == "engine_score":
            return await server.score(args[0])
        if method == "engine_pause":
            await server.pause(abort=args[0])
        elif method == "engine_resume":
            server.resume()
        elif method == "engine_metrics":
            return server.metrics
        elif method != "engine_health":
            raise ValueError(f"the check's colocated host has no method {method!r}")
        return server.health()

    return call


async def generate_colocated(config: AgentRLConfig, model_path: str, backend: Any,
                             probes: Sequence[PlacementProbe]) -> tuple[list[Generation], int]:
    """The probes on the engine built in this process after an in-memory push of `backend`'s
    tensors (version 1); returns the answers and how many tensors the push carried."""
    from agentrl.inference.colocated_client import ColocatedClient
    from agentrl.inference.server_app import ServerState
    from agentrl.weights import make_checkpoint_engine

    engine = _in_process_engine(config, model_path)
    await engine.start()
    try:
        server = ServerState(engine)
        sender = make_checkpoint_engine("inprocess", bucket_bytes=config.weights.bucket_mb << 20)
        await server.pause(abort=False)
        try:
            _, pushed = await asyncio.gather(
                asyncio.to_thread(sender.send, backend.export_weights(), 1),
                engine.load_tensors(lambda: sender.receive(copy=True)),
            )
            server.weight_version = 1
        finally:
            server.resume()
        client = ColocatedClient(_local_host(server), "colocated-check")
        answers = [await client.generate(p.prompt_ids, p.sampling, session_id=f"check-placement-{i}")
                   for i, p in enumerate(probes)]
    finally:
        await engine.shutdown()
    return answers, int(pushed)
