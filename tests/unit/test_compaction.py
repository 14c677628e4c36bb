"""Context compaction in the AgentLoop, played on the `recall` env by a scripted note-taking policy.

Without compaction the episode runs out of its context; with each policy it finishes and is scored,
every context is a segment with an exact ledger (what was sent is its prefix, a re-render agrees, the
sampled tokens are exactly what the client returned), and all segments share the episode's outcome.
"""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

import pytest

from agentrl.chat import ChatTemplate, render_difference
from agentrl.config import RolloutConfig
from agentrl.envs.recall import RecallEnv, make_recall_row, scripted_recall_turn
from agentrl.rollout import AgentLoop, RolloutWorker
from agentrl.rollout.compaction import dropped_tool_outputs
from agentrl.tools.parsers import HermesParser
from agentrl.types import FinishReason, Generation, SamplingParams, Segment, TokenOrigin, Trajectory

PAGES = 12


@pytest.fixture(scope="module")
def template(assets: Path) -> ChatTemplate:
    return ChatTemplate.from_pretrained(assets / "qwen2.5-0.5b-instruct")


class RecallClient:
    """Plays `scripted_recall_turn` on the decoded prompt; keeps every request and every generation."""

    def __init__(self, template: ChatTemplate, summary_prompt: str | None = None, *, pages: int = PAGES) -> None:
        self.tok = template.tokenizer
        self.pages = pages
        self.summary_prompt = summary_prompt
        self.end = self.tok.convert_tokens_to_ids("<|im_end|>")
        self.requests: list[list[int]] = []
        self.generations: list[list[int]] = []

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, *, session_id: str,
                       timeout_s: float | None = None) -> Generation:
        self.requests.append(list(prompt_ids))
        text = scripted_recall_turn(self.tok.decode(prompt_ids), pages=self.pages, summary_prompt=self.summary_prompt)
        ids = (self.tok.encode(text, add_special_tokens=False) + [self.end])[: sampling.max_tokens]
        self.generations.append(ids)
        return Generation(ids, [-0.5] * len(ids), "stop", 3)


def _play(template: ChatTemplate, config: RolloutConfig, **env: Any) -> tuple[list[Trajectory], RecallClient]:
    client = RecallClient(template, config.compaction.summary_prompt if config.compaction.policy == "summary" else None)
    loop = AgentLoop(client, template, HermesParser(), config)
    segments = asyncio.run(loop.run_episode_segments(RecallEnv(**env), row=make_recall_row(1), episode_id="ep"))
    return segments, client


def _config(policy: str, **compaction: Any) -> RolloutConfig:
    return RolloutConfig(max_turns=40, max_total_tokens=2048, verify_template=True,
                         compaction={"policy": policy, **compaction})


def _assert_exact_segments(template: ChatTemplate, segments: list[Trajectory], client: RecallClient) -> None:
    tools = [RecallEnv().tools["read_log"].schema]
    for seg in segments:
        seg.validate()
        assert render_difference(template, seg, tools, prefix=True) == ""
        assert seg.metrics["template_mismatch"] == 0.0
    # every request is exactly a prefix of one segment's ledger, in order: segment k's requests, then k+1's
    k, used = 0, set()
    for request in client.requests:
        while k < len(segments) and segments[k].token_ids[: len(request)] != request:
            k += 1
        assert k < len(segments), "a request that is not the prefix of its segment's ledger"
        used.add(k)
    assert used == set(range(len(segments)))
    # the sampled tokens of the segments, in order, are every generation the client returned, in order
    sampled = [i for seg in segments for i in seg.tokens_of(TokenOrigin.SAMPLED)]
    assert sampled == [i for g in client.generations for i in g]


def test_without_compaction_the_episode_runs_out_of_its_context(template: ChatTemplate) -> None:
    (traj,), _ = _play(template, _config("off"))
    assert (traj.finish_reason, traj.reward, traj.segment) == (FinishReason.MAX_LENGTH, 0.0, None)
    assert traj.info["truncated_by"] == "rollout.max_total_tokens"
    assert "segments" not in traj.metrics  # nothing of compaction is recorded when it is off


def test_dropping_old_tool_outputs_finishes_and_scores_the_episode_in_exact_segments(template: ChatTemplate) -> None:
    config = _config("drop_tool_outputs")
    segments, client = _play(template, config)
    n = len(segments)
    assert n >= 3
    assert [s.segment for s in segments] == [Segment(k, n) for k in range(n)]
    assert {(s.finish_reason, s.reward, s.fault, s.episode_id) for s in segments} == {(FinishReason.DONE, 1.0, None, "ep")}
    _assert_exact_segments(template, segments, client)
    last = segments[-1]
    assert (last.metrics["segments"], last.metrics["compactions"]) == (n, n - 1)
    assert last.metrics["turns"] == PAGES + 1  # the episode's turns: every page, then the answer
    assert sum(s.metrics["turns"] for s in segments[:-1]) + last.num_turns == PAGES + 1
    high, low = int(0.75 * 2048), int(0.4 * 2048)
    for seg in segments:
        assert len(seg) < 2048
    for before, after in itertools.pairwise(segments):
        # compaction fired when the next page (~330 tokens with its call) would pass the high watermark,
        # and the next context opened under it
        assert len(before) < high <= len(before) + 400 and after.prompt_length < high
        # old tool outputs were cut; every note the agent wrote (its assistant turns) is still there
        notes = [m["content"] for m in before.messages if m["role"] == "assistant" and m["content"]]
        assert all(any(m["content"] == note for m in after.messages) for note in notes)
    assert segments[1].prompt_length <= low + 300  # the latest page (~280 tokens) stays whole
    assert last.metrics["tool_outputs_cut"] > 0


def test_a_summary_turn_is_sampled_in_the_full_context_and_opens_the_next(template: ChatTemplate) -> None:
    config = _config("summary")
    segments, client = _play(template, config)
    n = len(segments)
    assert n >= 2
    assert {(s.finish_reason, s.reward, s.segment.of) for s in segments} == {(FinishReason.DONE, 1.0, n)}
    _assert_exact_segments(template, segments, client)
    tok = template.tokenizer
    for before, after in itertools.pairwise(segments):
        # the context closed on the summary: asked for in a user message, answered by a sampled turn
        assert before.messages[-2] == {"role": "user", "content": config.compaction.summary_prompt}
        summary = before.messages[-1]["content"]
        assert summary.startswith("Summary: the code of vault 1 is")
        last_turn = [i for i, t, o in zip(before.token_ids, before.turns, before.origins, strict=True)
                     if t == before.num_turns and o == TokenOrigin.SAMPLED]
        assert tok.decode(last_turn).startswith(summary)  # the summary's tokens are sampled ones (trained)
        # the next context: system prompt, task, the summary as the agent's message, a user turn to go on
        assert [m["role"] for m in after.messages[:4]] == ["system", "user", "assistant", "user"]
        assert after.messages[:2] == before.messages[:2] and after.messages[2]["content"] == summary
        assert summary in tok.decode(after.token_ids[: after.prompt_length])  # prompt tokens there, not trained
    last = segments[-1]
    assert last.metrics["summary_turns"] == n - 1 == last.metrics["compactions"]


def test_the_episode_budget_of_sampled_tokens_ends_a_compacting_episode(template: ChatTemplate) -> None:
    segments, _ = _play(template, _config("drop_tool_outputs", max_sampled_tokens=200))
    last = segments[-1]
    assert (last.finish_reason, last.info["truncated_by"], last.reward) == (
        FinishReason.MAX_LENGTH, "rollout.compaction.max_sampled_tokens", 0.0)
    assert sum(s.num_sampled for s in segments) == last.metrics["sampled_tokens"] == 200


def test_the_worker_returns_every_segment_and_run_episode_refuses_to_drop_them(template: ChatTemplate) -> None:
    config = _config("summary")
    client = RecallClient(template, config.compaction.summary_prompt)
    loop = AgentLoop(client, template, HermesParser(), config)
    worker = RolloutWorker(loop, lambda: RecallEnv(), freeze_gc=False)
    (group,) = asyncio.run(worker.run_batch([make_recall_row(1)], 2))
    assert [t.segment.index for t in group] == [*range(group[0].segment.of)] * 2
    with pytest.raises(ValueError, match="run_episode_segments"):
        asyncio.run(loop.run_episode(RecallEnv(), row=make_recall_row(1)))


def test_compaction_settings_that_cannot_work_are_refused() -> None:
    with pytest.raises(ValueError, match="low_watermark"):
        RolloutConfig(compaction={"policy": "drop_tool_outputs", "low_watermark": 0.8, "high_watermark": 0.7})
    with pytest.raises(ValueError, match="leaves 205 of rollout.max_total_tokens=2048"):
        RolloutConfig(max_tokens_per_turn=256, compaction={"policy": "summary", "high_watermark": 0.9})
    RolloutConfig(compaction={"low_watermark": 0.8, "high_watermark": 0.7})  # off: not checked


def test_the_rule_truncates_oldest_first_then_drops_and_keeps_the_latest_turn() -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "task"}]
    for k in range(3):
        messages += [{"role": "assistant", "content": f"note {k}"}, {"role": "tool", "content": str(k) * 100}]

    def count(ms: Any) -> int:
        return sum(len(m["content"]) for m in ms)

    out, cut = dropped_tool_outputs(messages, count=count, count_text=len, low_tokens=count(messages) - 30,
                                    keep_chars=10)
    assert cut == 1 and out[2]["content"].startswith("0" * 10 + "\n[... 90 more characters dropped")
    assert out[4:] == messages[4:] and messages[2]["content"] == "0" * 100  # the input is not modified
    out, cut = dropped_tool_outputs(messages, count=count, count_text=len, low_tokens=0, keep_chars=10)
    assert cut == 2 and out[6] == messages[6]  # the latest turn's output stays whole, whatever the budget
    assert out[2]["content"] == out[4]["content"] == "[tool output of 100 characters dropped to save context]"


def test_eval_and_the_dashboard_report_segments_and_compactions_per_episode(template: ChatTemplate) -> None:
    from agentrl.config import AgentRLConfig
    from agentrl.orchestration.evaluate import summarise
    from agentrl.records.metrics import segment_metrics

    compacted, _ = _play(template, _config("drop_tool_outputs"))
    (whole,), _ = _play(template, _config("off"))  # one context: it runs out of room
    n = len(compacted)
    report = summarise(AgentRLConfig(), [compacted, [whole]], 1.0)
    assert (report.episodes, report.segments_per_episode, report.compactions_per_episode) == (2, (n + 1) / 2,
                                                                                              (n - 1) / 2)
    assert report.mean_sampled_tokens == sum(t.num_sampled for t in [*compacted, whole]) / 2  # every segment's
    assert f"segments/episode {(n + 1) / 2:.2f}" in report.summary()
    assert segment_metrics(compacted)["rollout/segments_per_episode"] == n
    assert segment_metrics(compacted)["rollout/compactions_per_episode"] == n - 1
