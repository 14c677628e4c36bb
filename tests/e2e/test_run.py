"""`agentrl run` end to end on CPU: a real vLLM server, Ray trainer actors, FSDP2, weight pushes.

The tiny random Qwen2 plays `ParityEnv` (reward for an even-length answer, so groups have reward
variance and every step a real gradient). A random model almost never samples its end-of-turn
token, so one token id in ten also ends a turn (`rollout.extra_stop_token_ids`): answers end at
varied lengths instead of all being cut at the token budget. One vLLM server (the session's) serves every split run
here through `inference.urls`; each run first pushes its own initial weights to it. The colocated
runs (`placement=colocated`) start their vLLM engine inside the trainer actor instead. Checked: the
prompt ledger balances, the dashboard metrics are there with sane values, weights reach the
server every step, the staleness bound holds in the async modes, a resumed run continues with
exactly the prompts the uninterrupted run took, and colocated rollouts agree with the trainer's
logprobs to 1e-6.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server_url(vllm_server, assets):
    from agentrl.inference import HTTPServerClient

    global TINY
    TINY = str(assets / "tiny-random-qwen2")
    yield vllm_server.url

    async def restore() -> None:  # later tests expect the base weights
        client = HTTPServerClient(vllm_server.url)
        await client.update_weights(str(assets / "tiny-random-qwen2"), 0)
        await client.aclose()

    asyncio.run(restore())
    import ray

    ray.shutdown()


STOP_IDS = list(range(0, 151_000, 10))
TINY = ""  # the tiny model's directory, set by the `server_url` fixture


def config(tmp_path: Path, url: str | None, name: str, mode: str, steps: int, *extra: str):
    from agentrl.config import load_config

    inference = [f"inference.urls=[{url}]"] if url else [
        "placement=colocated", "inference.max_model_len=512", "inference.cpu_kv_cache_gb=0.25"]
    return load_config(None, [
        "env=parity_env:ParityEnv", f"model.path={TINY}", "model.chat_template=chatml-tools", *inference,
        "data.prompts_per_step=3", "rollout.samples_per_prompt=2", "rollout.max_tokens_per_turn=12",
        "rollout.max_turns=1", "rollout.max_total_tokens=256", "rollout.temperature=1.0",
        "trainer.lr=1e-3", "trainer.device=cpu", f"run.mode={mode}", f"run.total_steps={steps}",
        f"run.output_dir={tmp_path}", f"run.name={name}", "run.eval_every=2", "data.num_val_rows=2",
        "eval.k=1", "run.loggers=[console,jsonl,tensorboard]", f"rollout.extra_stop_token_ids={STOP_IDS}",
        *extra,
    ])  # fmt: skip


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def trained_by_step(run_dir: Path) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for e in lines(run_dir / "ledger.jsonl"):
        if e["status"] == "trained":
            out.setdefault(e["step"], []).append(e["uid"])
    return {k: sorted(v) for k, v in out.items()}


def test_sync_run_logs_the_dashboard_and_resumes_with_the_same_next_batch(tmp_path, server_url):
    from agentrl.orchestration.driver import run_training

    full = run_training(config(tmp_path, server_url, "full", "sync", 3, "run.save_every=1"))
    run_dir = Path(full.run_dir)
    assert full.steps_done == 3 and full.policy_version == 3
    assert full.ledger["trained"] == 9 and full.ledger["in_flight"] == 0
    assert full.ledger["taken"] == sum(v for k, v in full.ledger.items() if k not in ("taken",))
    metrics = lines(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2]
    for m in metrics:
        assert m["episodes/count"] == 6
        assert m["finish/done"] > 0
        assert 0.0 <= m["episodes/reward_mean"] <= 1.0
        assert m["staleness/max"] == 0
        assert m["actor/grad_norm"] >= 0 and "actor/entropy" in m and "actor/pg_clipfrac" in m
        assert m["time/train_s"] > 0 and m["time/weight_sync_s"] > 0
        assert "tools/calls_per_episode" in m and "episodes/zero_var_group_frac" in m
    assert sum(m["actor/grad_norm"] for m in metrics) > 0, "reward variance must give a gradient"
    assert metrics[-1]["policy/version"] == 3
    evals = lines(run_dir / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 2, 3] and all(e["problems"] == 2 for e in evals)
    assert (run_dir / "tensorboard").is_dir() and any((run_dir / "tensorboard").iterdir())
    assert sorted(p.name for p in (run_dir / "weights").iterdir())[-1] == "version-00000003"
    assert (run_dir / "checkpoints" / "latest").read_text() == "step-000003"

    # Stop after 2 steps, then resume to 3: step 2 trains exactly the prompts the full run did.
    short = run_training(config(tmp_path, server_url, "cut", "sync", 2, "run.save_every=1"))
    assert short.steps_done == 2
    resumed = run_training(config(tmp_path, server_url, "cut", "sync", 3, "run.save_every=1", "resume=true"))
    assert resumed.steps_done == 3 and resumed.policy_version == 3
    cut_dir = Path(resumed.run_dir)
    assert trained_by_step(cut_dir) == trained_by_step(run_dir)
    assert [m["step"] for m in lines(cut_dir / "metrics.jsonl")] == [0, 1, 2]
    assert resumed.ledger["trained"] == 9

    from agentrl.errors import ConfigError

    with pytest.raises(ConfigError, match="already holds a run"):
        run_training(config(tmp_path, server_url, "cut", "sync", 3))


@pytest.mark.parametrize(("mode", "extra"), [
    ("one_step_off", ()),
    ("async", ("run.max_staleness=1", "run.partial_rollout=true")),
    ("async", ("run.max_staleness=2",)),
])  # fmt: skip
def test_overlapped_modes_keep_the_staleness_bound_and_the_books(tmp_path, server_url, mode, extra):
    from agentrl.orchestration.driver import run_training

    result = run_training(config(tmp_path, server_url, mode, mode, 4, "run.eval_every=0", *extra))
    bound = 1 if mode == "one_step_off" else int(extra[0].split("=")[1])
    assert result.steps_done == 4 and result.policy_version == 4
    assert result.max_staleness <= bound
    assert result.ledger["trained"] >= 12 and result.ledger["in_flight"] == 0
    assert result.ledger["unfinished"] == 0, "no generated group may be thrown away"
    metrics = lines(Path(result.run_dir) / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]
    assert max(m["staleness/max"] for m in metrics) <= bound
    if mode != "sync":
        assert max(m["staleness/max"] for m in metrics) >= 1, "the modes must actually overlap"


@pytest.fixture(scope="module")
def colocated_ready(vllm_ready, assets):
    global TINY
    TINY = str(assets / "tiny-random-qwen2")
    yield
    import ray

    ray.shutdown()


# Colocated, one async run stands for both bounds and partial rollouts (split placement runs each
# of them separately above); a third engine start would add 20 s of CI for no new path.
@pytest.mark.parametrize(("mode", "extra"), [
    ("sync", ()),
    ("async", ("run.max_staleness=2", "run.partial_rollout=true")),
])  # fmt: skip
def test_colocated_runs_push_weights_in_memory_and_keep_the_bounds(tmp_path, colocated_ready, mode, extra, capfd):
    from agentrl.orchestration.driver import run_training

    steps = 3 if mode == "sync" else 4
    result = run_training(config(tmp_path, None, f"colocated-{mode}", mode, steps, "run.eval_every=0", *extra))
    run_dir = Path(result.run_dir)
    # The engine's start-up (vLLM's INFO lines, forwarded by Ray from the trainer actor) is in the
    # run's worker log, not on the console; nor is the deprecation agentrl's own prompt call caused.
    console = re.sub(r"\x1b\[[0-9;]*m", "", "".join(capfd.readouterr()))
    assert not re.search(r"INFO \d\d-\d\d \d\d:\d\d:\d\d", console), console[-3000:]
    assert "Passing raw prompts" not in console
    worker_log = (run_dir / "logs" / "trainer-0.log").read_text()
    assert "vllm" in worker_log and "Passing raw prompts" not in worker_log
    assert result.steps_done == steps and result.policy_version == steps
    assert result.ledger["in_flight"] == 0 and result.ledger["unfinished"] == 0
    assert result.ledger["trained"] >= 3 * steps
    # weights move in memory, never through files per step; the checkpoint (the last step) keeps the
    # trainer's version as a complete HF directory, for `agentrl eval model.path=...`
    kept = sorted(p.name for p in (run_dir / "weights").iterdir() if not p.name.startswith("."))
    assert kept == [f"version-{steps:08d}"]
    files = {p.name for p in (run_dir / "weights" / kept[0]).iterdir()}
    assert "config.json" in files and any(name.endswith(".safetensors") for name in files)
    metrics = lines(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(steps))
    assert sum(m["actor/grad_norm"] for m in metrics) > 0
    for m in metrics:
        assert m["time/engine_sleep_s"] >= 0 and m["time/weight_sync_s"] > 0
    if mode == "sync":
        # every batch was generated on the weights it is trained from: the engine and the trainer agree
        assert max(m["rollout/logprob_abs_diff"] for m in metrics) <= 1e-6
        assert max(m["staleness/max"] for m in metrics) == 0
        evals = lines(run_dir / "eval.jsonl")
        assert [e["step"] for e in evals] == [0, steps] and all(e["problems"] == 2 for e in evals)
    else:
        # the engine generated on older weights while the trainer updated or waited, within the bound
        bound = int(extra[0].split("=")[1])
        assert 1 <= result.max_staleness <= bound
        assert max(m["staleness/max"] for m in metrics) <= bound
