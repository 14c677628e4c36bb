"""Faults of the inference servers, met in real runs.

- The only vLLM server is SIGKILLed in the middle of a step (sync): the supervisor restarts it and
  re-syncs it to the current weights before it serves; the step's episodes wait for it instead of
  failing. In async mode the same holds (there the only server is an hf one: what is checked is the
  scheduler's and the supervisor's, and hf starts in seconds where vLLM takes a minute): the run
  finishes with every prompt in the ledger and no episode lost.
- The same server dies again after its last allowed restart (`inference.max_restarts=1`): the
  run stops with a non-zero exit and a message that names the cause, leaves no process behind, and
  a resume finishes it.
- A prompt longer than the server's context is a request error (HTTP 400): the router does not
  take the server for dead, the episode ends with `fault="request"`, its group is filtered with the
  reason; a `rollout.max_total_tokens` above a running server's context is refused before the run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fault_common import (
    HF_SERVER,
    OWN_SERVER,
    check_books,
    lines,
    make_config,
    own_servers_left,
    trained_by_step,
)

pytestmark = pytest.mark.slow


def killer(at: list[int], tag: str, match: str = OWN_SERVER) -> list[str]:
    return ["env=fault_parts:KillingParityEnv",
            f"env.kwargs={{kill: server, at: {at}, match: '{match}', tag: {tag}}}"]


def test_sync_a_server_killed_mid_step_is_restarted_resynced_then_given_up_and_the_run_resumes(
    tmp_path: Path, vllm_ready: str, shared_url: str, assets: Path
) -> None:
    from agentrl.errors import ServerUnavailableError
    from agentrl.orchestration.driver import run_training

    # Killed when the first episode of step 1 starts (restarted), and again in step 2 (given up).
    config = make_config(tmp_path, "sync", assets, *killer([7, 13], "sync"), "run.total_steps=4",
                         "inference.max_restarts=1")
    with pytest.raises(ServerUnavailableError) as caught:
        run_training(config)
    message = str(caught.value)
    assert "could not be restarted" in message and "inference.max_restarts=1" in message
    run_dir = tmp_path / "sync"
    log = (run_dir / "driver.log").read_text()
    assert "restarting it (restart 1 of at most 1)" in log and "re-synced to weights version 1" in log
    # served again only once the served-policy check passed on it at the version it was re-synced to
    assert "served-policy check of a replica that came back: replica " in log and " at weight version 1: PASS" in log
    assert "is back after" in log and "is given up" in log
    metrics = {m["step"]: m for m in lines(run_dir / "metrics.jsonl")}
    assert sorted(metrics) == [0, 1, 2]
    assert metrics[1]["episodes/infra_failed"] == 0, "step 1's episodes waited for the restarted server"
    assert metrics[1]["policy/version"] == 2 and "batch/skipped" not in metrics[1]
    assert metrics[2]["batch/skipped"] == 1 and "episodes/reward_mean" not in metrics[2], "nothing unmeasured is 0"
    books = check_books(run_dir)
    assert books["trained"] == 6 and books["requeued"] == 3
    assert own_servers_left() == [], "the run's servers (and their engine cores) are gone"

    # The resume's env kills nothing (other env.kwargs): a change the resume must be told is on purpose.
    resumed = run_training(make_config(tmp_path, "sync", assets, *killer([], "sync-resume"), "run.total_steps=4",
                                       "resume=true", "run.resume_allow=[env.kwargs]", url=shared_url))
    assert resumed.steps_done == 4 and resumed.policy_version == 3  # step 2 had nothing to train
    books = check_books(run_dir)
    assert books["trained"] == 9 and books.get("unfinished", 0) == 0
    assert sorted(trained_by_step(run_dir)) == [0, 1, 3]
    retried = [e for e in lines(run_dir / "ledger.jsonl") if e["status"] == "trained" and e["step"] == 3]
    assert retried and all(e["attempt"] == 1 for e in retried), "step 2's requeued prompts are trained first on resume"


def test_async_a_server_killed_mid_step_is_restarted_and_no_episode_is_lost(tmp_path: Path, assets: Path) -> None:
    from agentrl.orchestration.driver import run_training

    config = make_config(tmp_path, "async", assets, *killer([8], "async", HF_SERVER), "run.total_steps=3",
                         "run.mode=async", "run.max_staleness=1", "inference.engine=hf")
    result = run_training(config)
    run_dir = Path(result.run_dir)
    assert result.steps_done == 3 and result.policy_version == 3 and result.max_staleness <= 1
    log = (run_dir / "driver.log").read_text()
    assert "restarting it (restart 1 of at most 3)" in log and "is back after" in log
    assert "served-policy check of a replica that came back: replica " in log and ": PASS" in log
    metrics = lines(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert sum(m["episodes/infra_failed"] for m in metrics) == 0
    books = check_books(run_dir)
    assert books["trained"] >= 9 and books.get("requeued", 0) == 0 and books.get("failed", 0) == 0
    assert result.ledger["in_flight"] == 0
    assert own_servers_left(HF_SERVER) == []


def test_a_prompt_over_the_servers_context_is_a_request_error_not_a_dead_server(
    tmp_path: Path, shared_url: str, assets: Path
) -> None:
    import asyncio

    from agentrl.config import load_config
    from agentrl.errors import ConfigError
    from agentrl.inference import Router
    from agentrl.inference.serve import serve_from_config
    from agentrl.orchestration.build import build_job
    from agentrl.orchestration.ledger import PromptRef
    from agentrl.orchestration.schedule import GroupResult, default_classify

    # The shared server's context is 2048; this config claims 4096.
    args = ["env=parity_env:ParityEnv", f"model.path={assets / 'tiny-random-qwen2'}",
            "model.chat_template=chatml-tools", "inference.max_model_len=4096", "rollout.max_total_tokens=3000",
            "rollout.max_tokens_per_turn=8", f"inference.urls=[{shared_url}]", "eval.k=2"]
    with pytest.raises(ConfigError, match=r"rollout.max_total_tokens=3000 is more than the context of the server "
                                          r".*max_model_len=2048"):
        serve_from_config(load_config(None, args))

    # Past that check (a server whose context is lower than it says), the refusal is a request error.
    job = build_job(load_config(None, args), "eval")
    router = Router([shared_url], request_timeout_s=60)
    row = {"prompt": [{"role": "user", "content": "seven " * 2100}], "data_source": "parity",
           "reward_model": {"ground_truth": "even"}}

    async def play() -> list:
        loop = job.agent_loop(router)
        try:
            return [await loop.run_episode(job.make_env(), row=row, seed=i) for i in range(2)]
        finally:
            await router.aclose()
            await job.aclose()

    trajectories = asyncio.run(play())
    for t in trajectories:
        assert t.fault == "request" and not t.trainable
        assert "HTTP 400" in t.error and "max_model_len" in t.error and "2048" in t.error
    assert router.servers[0].healthy and router.counters["failures"] == 0 and router.counters["rejected"] == 2
    verdict, reason = default_classify(GroupResult(PromptRef(0, 0), trajectories, 0))
    assert verdict == "filtered" and "HTTP 400" in reason
