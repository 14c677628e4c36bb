"""A prompt with no room to sample under `rollout.max_total_tokens` is filtered, never trained as a
reward of 0: the training steps of a run over fakes (trainer, router, server) with the real
tokenizer, env, AgentLoop, ledger and scheduler."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from agentrl.config import load_config
from agentrl.envs.arithmetic import ArithmeticEnv
from agentrl.orchestration.build import Job, build_job
from agentrl.orchestration.checkpoints import CheckpointStore
from agentrl.orchestration.training import RunBooks, TrainingSteps
from agentrl.types import GatedRow, Generation, SamplingParams, StepReport, Trajectory

DATA = Path(__file__).resolve().parents[1] / "data" / "verl"
BUDGET = 512


class AnswerClient:
    """A server that answers every turn with the row's answer."""

    def __init__(self, job: Job) -> None:
        tok = job.template.tokenizer
        self.ids = tok.encode("The answer is \\boxed{72}.", add_special_tokens=False) + [
            tok.convert_tokens_to_ids("<|im_end|>")]
        self.prompts: list[int] = []

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, *, session_id: str,
                       timeout_s: float | None = None) -> Generation:
        self.prompts.append(len(prompt_ids))
        return Generation(list(self.ids), [-0.5] * len(self.ids), "stop", 0)


class Fakes:
    """The trainer, router, rollout worker and metrics logger of a run, recording what they see."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.client = AnswerClient(job)
        self.loop = job.agent_loop(self.client)
        self.fatal = None
        self.trained: list[Trajectory] = []
        self.rolled_out: list[dict[str, Any]] = []
        self.metrics: list[dict[str, float]] = []
        self.gated: list[GatedRow] = []  # what the trainer's on-policy gate reports masked
        self.sinks = ["jsonl"]  # as the metrics logger: no console, so no progress ticker
        self.servers: list[Any] = []  # as the router: no replica, so no served-policy check

    async def run_group(self, row: dict[str, Any], n: int, *, seed: int, group_id: str) -> list[Trajectory]:
        self.rolled_out.append(row)
        return [await self.loop.run_episode(self.job.make_env(), row=row, group_id=group_id) for _ in range(n)]

    async def train(self, trajectories: list[Trajectory], policy_version: int | None = None,
                    allowed_staleness: int = 0) -> StepReport:
        self.trained.extend(trajectories)
        gated = len(self.gated)
        return StepReport({"loss": 0.0, "onpolicy/gated_share": gated / len(trajectories),
                           "onpolicy/gated_sequences": float(gated)}, list(self.gated))

    async def export(self, version: int) -> tuple[str, float]:
        return "weights", 0.0

    async def trainer_tokens(self, indices: list[int]) -> dict[int, tuple[list[float | None], None]]:
        self.asked_tokens = indices
        return {}

    def weight_source(self, version: int) -> tuple[str, None]:
        return "weights", None

    async def update_weights(self, source: str, version: int, token: Any = None) -> dict[str, Any]:
        return {}

    async def save(self, folder: str, extra: dict[str, Any]) -> None:
        return None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.metrics.append(metrics)


def run_one_step(tmp_path: Path, gated: list[GatedRow] | None = None) -> tuple[Job, RunBooks, Fakes]:
    rows = [json.loads(line) for line in (DATA / "gsm8k.jsonl").read_text().splitlines() if line.strip()]
    rows[0]["prompt"][0]["content"] = "Count the clips again. " * 60 + rows[0]["prompt"][0]["content"]
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = load_config(None, [
        "env=arithmetic", f"data.train_files=[{path}]", "data.shuffle=false", "data.prompts_per_step=2",
        "rollout.samples_per_prompt=2", f"rollout.max_total_tokens={BUDGET}", "run.total_steps=1",
        "run.eval_every=0", f"run.output_dir={tmp_path}", "run.name=long", "data.max_prompt_tokens=2048",
    ])  # fmt: skip
    job = build_job(config, "run")
    run_dir = tmp_path / "long"
    run_dir.mkdir()
    books = RunBooks(job, run_dir, CheckpointStore(run_dir / "checkpoints"), None)
    books.val_rows = []
    fakes = Fakes(job)
    fakes.gated = gated or []
    steps = TrainingSteps(job, books, trainer=fakes, router=fakes, worker=fakes, logger=fakes,  # type: ignore[arg-type]
                          make_env=job.make_env, start_step=0, version=0, eval_before={})
    asyncio.run(steps.run())
    return job, books, fakes


def first_prompt_length(job: Job, row: dict[str, Any]) -> int:
    """The prompt as the env's reset starts it: its first messages and tool schemas, rendered."""
    env = ArithmeticEnv()
    messages, tools = env.initial_messages(row), env.prompt_tools()
    env.close()
    return len(job.template.encode_prompt(messages, tools))


def test_a_too_long_prompt_is_filtered_before_rollout_and_counted(tmp_path: Path) -> None:
    job, books, fakes = run_one_step(tmp_path)
    long_row = books.train_rows[0]
    assert long_row is not None
    length = first_prompt_length(job, long_row)
    assert length >= BUDGET
    assert long_row not in fakes.rolled_out and len(fakes.rolled_out) == 2  # replaced by rows 1 and 2
    assert max(fakes.client.prompts) < BUDGET
    entries = {e.index: e for e in books.ledger.entries.values()}
    assert entries[0].status == "filtered"
    assert entries[0].reason == f"prompt of {length} tokens over rollout.max_total_tokens={BUDGET}"
    assert entries[1].status == entries[2].status == "trained"
    assert len(fakes.trained) == 4 and all(t.num_sampled > 0 for t in fakes.trained)
    assert fakes.asked_tokens == [0, 1, 2, 3]  # the kept rollouts ask the trainer for their per-token values
    assert fakes.metrics[0]["data/filtered_too_long"] == 1.0


def test_a_too_long_prompt_the_env_cannot_measure_is_masked_by_the_agent_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ArithmeticEnv, "first_prompt", lambda self, row: None)  # only a reset can tell
    job, books, fakes = run_one_step(tmp_path)
    long_row = books.train_rows[0]
    assert long_row is not None
    length = first_prompt_length(job, long_row)
    assert long_row in fakes.rolled_out and max(fakes.client.prompts) < BUDGET  # never sent to the server
    entries = {e.index: e for e in books.ledger.entries.values()}
    assert entries[0].status == "filtered"
    assert entries[0].reason == f"prompt of {length} tokens over rollout.max_total_tokens={BUDGET}"
    assert entries[1].status == "trained"
    assert len(fakes.trained) == 2 and all(t.num_sampled > 0 for t in fakes.trained)  # no 0-token trajectory
    assert fakes.metrics[0]["data/filtered_too_long"] == 1.0


def test_the_rows_the_trainers_gate_masked_reach_their_prompts_ledger_lines(tmp_path: Path) -> None:
    """The driver reads the gate's typed per-row decisions: row 3 of the batch is the second
    sample of the second trained prompt; the metrics it logs stay numbers only."""
    gated = GatedRow(row=3, reason="logprob_gap", logprob_gap=2.5, mean_logprob_gap=0.8, log_ratio_spread=2.5,
                     ess=0.9)
    _job, books, fakes = run_one_step(tmp_path, [gated])
    entries = {e.index: e for e in books.ledger.entries.values()}
    assert entries[1].status == entries[2].status == "trained"
    assert entries[1].reason == ""
    assert entries[2].reason == "gated: 1 of 2 sequences masked out of the loss (logprob_gap 1)"
    assert fakes.metrics[0]["onpolicy/gated_sequences"] == 1.0
    assert all(isinstance(v, float) for v in fakes.metrics[0].values())
