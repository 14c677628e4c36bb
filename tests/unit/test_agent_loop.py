"""The AgentLoop against a scripted client: real tokenizer, real env, exact ledger, every finish reason."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from agentrl.chat import ChatTemplate
from agentrl.envs.arithmetic import ArithmeticEnv, make_arithmetic_row
from agentrl.errors import ServerUnavailableError
from agentrl.rollout import AgentLoop, AgentLoopConfig, RolloutWorker
from agentrl.tools.parsers import HermesParser
from agentrl.types import FinishReason, Generation, SamplingParams, TokenOrigin


@pytest.fixture(scope="module")
def template(assets: Path) -> ChatTemplate:
    return ChatTemplate.from_pretrained(assets / "qwen2.5-0.5b-instruct")


class ScriptedClient:
    """Answers each turn of a session with the next scripted text, tokenised, logprob -0.5 each."""

    def __init__(self, template: ChatTemplate, script: Callable[[int, str], str], *, delay_s: float = 0.0,
                 version: int = 7) -> None:
        self.tok = template.tokenizer
        self.script = script
        self.delay_s = delay_s
        self.version = version
        self.requests: dict[str, list[list[int]]] = {}
        self.end = self.tok.convert_tokens_to_ids("<|im_end|>")

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, *, session_id: str,
                       timeout_s: float | None = None) -> Generation:
        turn = len(self.requests.setdefault(session_id, []))
        self.requests[session_id].append(list(prompt_ids))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        ids = self.tok.encode(self.script(turn, session_id), add_special_tokens=False) + [self.end]
        finish = "stop"
        if len(ids) > sampling.max_tokens:
            ids, finish = ids[: sampling.max_tokens], "length"
        return Generation(ids, [-0.5] * len(ids), finish, self.version)


def _tool_then_answer(row: dict) -> Callable[[int, str], str]:
    expr, truth = row["extra_info"]["expression"], row["reward_model"]["ground_truth"]

    def script(turn: int, session: str) -> str:
        if turn == 0:
            call = json.dumps({"name": "calculator", "arguments": {"expression": expr}})
            return f"Let me compute.\n<tool_call>\n{call}\n</tool_call>"
        return f"The answer is \\boxed{{{truth}}}."

    return script


def _run(loop: AgentLoop, row: dict | None, **kw):  # type: ignore[no-untyped-def]
    return asyncio.run(loop.run_episode(ArithmeticEnv(), row=row, **kw))


def test_tool_episode_ledger_is_exact_and_append_only(template: ChatTemplate) -> None:
    row = make_arithmetic_row(3)
    client = ScriptedClient(template, _tool_then_answer(row))
    traj = _run(AgentLoop(client, template, HermesParser()), row, episode_id="ep1")
    traj.validate()
    assert (traj.finish_reason, traj.reward, traj.fault) == (FinishReason.DONE, 1.0, None)
    (first, second) = client.requests["ep1"]
    assert second[: len(first)] == first  # ids at turn 2 extend the ids at turn 1 exactly
    # the sampled tokens are exactly what the client returned, in order, with their logprobs
    tok = template.tokenizer
    sampled = traj.tokens_of(TokenOrigin.SAMPLED)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    turn1 = tok.encode(_tool_then_answer(row)(0, ""), add_special_tokens=False) + [end]
    turn2 = tok.encode(_tool_then_answer(row)(1, ""), add_special_tokens=False) + [end]
    assert sampled == turn1 + turn2
    assert [lp for lp, m in zip(traj.logprobs, traj.response_mask, strict=True) if m] == [-0.5] * len(sampled)
    assert set(v for v, m in zip(traj.versions, traj.response_mask, strict=True) if m) == {7}
    # the tool result is in the ledger as TOOL tokens, and the second prompt ends with it + gen prompt
    assert tok.decode(traj.tokens_of(TokenOrigin.TOOL)).strip() == row["reward_model"]["ground_truth"]
    assert second[len(first):][: len(turn1)] == turn1
    assert tok.decode(second[-3:]) == "<|im_start|>assistant\n"
    assert traj.metrics["tool_calls"] == 1 and traj.metrics["turns"] == 2
    assert traj.messages[2]["tool_calls"][0]["function"]["name"] == "calculator"


def test_wrong_answer_scores_zero_but_is_trainable(template: ChatTemplate) -> None:
    traj = _run(AgentLoop(ScriptedClient(template, lambda t, s: "\\boxed{1}"), template, HermesParser()),
                make_arithmetic_row(1))
    assert (traj.finish_reason, traj.reward, traj.trainable) == (FinishReason.DONE, 0.0, True)


def test_turn_budget_ends_as_max_turns(template: ChatTemplate) -> None:
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>'
    loop = AgentLoop(ScriptedClient(template, lambda t, s: call), template, HermesParser(),
                     AgentLoopConfig(max_turns=3))
    traj = _run(loop, make_arithmetic_row(1))
    assert (traj.finish_reason, traj.metrics["turns"], traj.fault) == (FinishReason.MAX_TURNS, 3.0, None)


def test_token_budget_ends_as_max_length(template: ChatTemplate) -> None:
    long_text = "word " * 400
    loop = AgentLoop(ScriptedClient(template, lambda t, s: long_text), template, HermesParser(),
                     AgentLoopConfig(max_tokens_per_turn=512, max_total_tokens=300))
    traj = _run(loop, make_arithmetic_row(1))
    assert traj.finish_reason == FinishReason.MAX_LENGTH
    assert len(traj) == 300 and traj.num_sampled == 300 - traj.prompt_length > 0 and traj.trainable


def test_a_prompt_with_no_room_to_sample_is_masked_not_scored_0(template: ChatTemplate) -> None:
    row = make_arithmetic_row(1)
    env = ArithmeticEnv()
    prompt = len(template.encode_prompt(*env.first_prompt(row)))
    env.close()
    client = ScriptedClient(template, lambda t, s: "\\boxed{0}")
    traj = _run(AgentLoop(client, template, HermesParser(), AgentLoopConfig(max_tokens_per_turn=16,
                                                                            max_total_tokens=prompt)), row)
    assert client.requests == {}  # never sent to the server
    assert (traj.finish_reason, traj.fault, traj.num_sampled, traj.trainable) == (FinishReason.MAX_LENGTH, "request", 0, False)
    assert traj.error == f"prompt of {prompt} tokens over rollout.max_total_tokens={prompt}"
    assert traj.info["truncated_by"] == "rollout.max_total_tokens"


def test_malformed_call_is_answered_and_counted(template: ChatTemplate) -> None:
    def script(turn: int, s: str) -> str:
        return "<tool_call>\n{not json}\n</tool_call>" if turn == 0 else "\\boxed{0}"

    traj = _run(AgentLoop(ScriptedClient(template, script), template, HermesParser()), make_arithmetic_row(1))
    assert traj.finish_reason == FinishReason.DONE
    assert traj.metrics["parse_errors"] == 1
    tool_text = template.tokenizer.decode(traj.tokens_of(TokenOrigin.TOOL))
    assert "Tool call 1 was not understood" in tool_text


def test_slow_server_ends_as_timeout_and_dead_server_as_infra_error(template: ChatTemplate) -> None:
    slow = ScriptedClient(template, lambda t, s: "\\boxed{1}", delay_s=5)
    traj = _run(AgentLoop(slow, template, HermesParser(), AgentLoopConfig(episode_timeout_s=0.3)),
                make_arithmetic_row(1))
    assert (traj.finish_reason, traj.fault, traj.trainable) == (FinishReason.TIMEOUT, "infra", False)
    assert "ran out of time during the generation" in traj.error

    class DeadClient:
        async def generate(self, *a, **k):  # type: ignore[no-untyped-def]
            raise ServerUnavailableError("no healthy server at http://127.0.0.1:1")

    traj = _run(AgentLoop(DeadClient(), template, HermesParser()), make_arithmetic_row(1))
    assert (traj.finish_reason, traj.fault) == (FinishReason.ERROR, "infra")
    assert "no healthy server" in traj.error and traj.prompt_length == len(traj) > 0


def test_env_is_closed_even_when_the_episode_fails(template: ChatTemplate) -> None:
    closed = []

    class TrackedEnv(ArithmeticEnv):
        async def aclose(self) -> None:
            closed.append(True)
            await super().aclose()

    class Boom:
        async def generate(self, *a, **k):  # type: ignore[no-untyped-def]
            raise RuntimeError("bug in a client")

    traj = asyncio.run(AgentLoop(Boom(), template, HermesParser()).run_episode(TrackedEnv(), seed=1))
    assert traj.finish_reason == FinishReason.ERROR and "RuntimeError: bug in a client" in traj.error
    assert closed == [True]


def test_worker_runs_groups_concurrently_and_loses_nothing(template: ChatTemplate) -> None:
    rows = [make_arithmetic_row(i) for i in range(6)]

    def script(turn: int, session: str) -> str:
        row = rows[int(session.split("-")[0][1:])]
        return _tool_then_answer(row)(turn, session) if session.endswith(("-0", "-1")) else "\\boxed{0}"

    client = ScriptedClient(template, script, delay_s=0.01)
    worker = RolloutWorker(AgentLoop(client, template, HermesParser()), ArithmeticEnv, max_concurrent=5)
    groups = asyncio.run(worker.run_batch(rows, samples_per_prompt=4, seed=0))
    assert [len(g) for g in groups] == [4] * 6
    for i, group in enumerate(groups):
        assert {t.group_id for t in group} == {f"g{i}"}
        assert [t.reward for t in group] == [1.0, 1.0, 0.0, 0.0]
        prompts = {json.dumps(t.messages[:2]) for t in group}
        assert len(prompts) == 1  # every sample of a group saw the same task
    assert worker.in_flight == 0


def test_a_turn_cut_by_its_token_budget_ends_as_max_length(template: ChatTemplate) -> None:
    loop = AgentLoop(ScriptedClient(template, lambda t, s: "word " * 50), template, HermesParser(),
                     AgentLoopConfig(max_tokens_per_turn=8))
    traj = _run(loop, make_arithmetic_row(1))
    assert (traj.finish_reason, traj.num_sampled, traj.metrics["turns"]) == (FinishReason.MAX_LENGTH, 8, 1.0)
    assert traj.metrics.get("tool_calls", 0.0) == 0.0  # the cut turn never reached the env


def test_worker_freezes_the_startup_heap_once(template: ChatTemplate, monkeypatch: pytest.MonkeyPatch) -> None:
    import gc

    from agentrl.rollout import worker as worker_module

    calls: list[tuple] = []
    monkeypatch.setattr(worker_module, "_gc_frozen", False)
    monkeypatch.setattr(gc, "freeze", lambda: calls.append(("freeze",)))
    monkeypatch.setattr(gc, "set_threshold", lambda *t: calls.append(("threshold", *t)))
    monkeypatch.setattr(gc, "get_threshold", lambda: (700, 10, 10))
    rows = [make_arithmetic_row(0)]
    client = ScriptedClient(template, _tool_then_answer(rows[0]))
    loop = AgentLoop(client, template, HermesParser())
    for _ in range(2):
        asyncio.run(RolloutWorker(loop, ArithmeticEnv).run_batch(rows, samples_per_prompt=2))
    no_full = ("threshold", 700, 10, worker_module._NO_AUTOMATIC_FULL)
    restored = ("threshold", 700, 10, 10)  # what get_threshold reports here
    # Frozen once; while each batch's episodes run, no automatic full collection, then restored.
    assert calls[:2] == [("freeze",), ("threshold", 700, 10, 1000)]
    toggles = calls[2:]
    assert len(toggles) >= 4 and toggles == [no_full, restored] * (len(toggles) // 2)
    calls.clear()
    monkeypatch.setattr(worker_module, "_gc_frozen", False)
    asyncio.run(RolloutWorker(loop, ArithmeticEnv, freeze_gc=False).run_batch(rows, samples_per_prompt=2))
    assert calls == []


def test_worker_paces_young_collections_only_while_episodes_run(
    template: ChatTemplate, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gc

    from agentrl.rollout import worker as worker_module

    collected: list[int] = []
    real_collect = gc.collect
    monkeypatch.setattr(worker_module, "GC_PACE_S", 0.001)
    monkeypatch.setattr(worker_module, "_FULL_AT_IDLE", 0)  # a full collection whenever the worker goes idle
    monkeypatch.setattr(gc, "collect", lambda generation=2: collected.append(generation) or real_collect(0))
    rows = [make_arithmetic_row(0)]
    client = ScriptedClient(template, _tool_then_answer(rows[0]), delay_s=0.05)
    worker = RolloutWorker(AgentLoop(client, template, HermesParser()), ArithmeticEnv)

    slow = ScriptedClient(template, _tool_then_answer(rows[0]), delay_s=0.15)
    other = RolloutWorker(AgentLoop(slow, template, HermesParser()), ArithmeticEnv)
    worker_module._freeze_gc_once()  # once per process (it raises the oldest generation's threshold for good)
    threshold_before = gc.get_threshold()

    async def go() -> tuple[bool, int, int]:
        # Two workers overlap (say training and evaluation), the one that started second ending
        # last: one pacer, and the collector is handed back only when both are idle.
        batch = asyncio.create_task(worker.run_batch(rows, samples_per_prompt=2))
        await asyncio.sleep(0.02)
        running = worker_module._gc_pacer is not None and not worker_module._gc_pacer.done()
        later = asyncio.create_task(other.run_batch(rows, samples_per_prompt=1))
        await batch
        during = gc.get_threshold()[2]
        await later
        idle_at = len(collected)
        await asyncio.sleep(0.02)  # nothing in flight: no pacing
        return running, during, len(collected) - idle_at

    assert asyncio.run(go()) == (True, worker_module._NO_AUTOMATIC_FULL, 0)
    assert worker_module._gc_pacer is None and worker_module._pacing_workers == 0
    paced = [g for g in collected if g in (0, 1)]
    assert len(paced) >= 10 and 1 in paced  # the youngest every pass, the middle one every fifth
    assert set(collected) <= {0, 1, 2} and collected[-1] == 2  # the full one once the last episode ended
    assert gc.get_threshold() == threshold_before  # restored once every worker is idle


class _VerdictEnv(ArithmeticEnv):
    """Reports a verdict in its last step's info; only the key it names in `recorded_info` is kept."""

    recorded_info = ("verdict",)

    async def ascore(self, final_text: str, row: dict, ctx) -> float:  # type: ignore[no-untyped-def]
        reward = await super().ascore(final_text, row, ctx)
        ctx.state["score_info"] = {"verdict": {"statuses": {"t1": "PASSED"}, "patch": "diff"}, "scratch": "x",
                                   "metrics": {"resolved": 1.0}}
        return reward


def test_the_env_info_keys_it_names_reach_the_trajectory(template: ChatTemplate) -> None:
    row = make_arithmetic_row(3)
    loop = AgentLoop(ScriptedClient(template, _tool_then_answer(row)), template, HermesParser())
    traj = asyncio.run(loop.run_episode(_VerdictEnv(), row=row))
    assert traj.info["verdict"] == {"statuses": {"t1": "PASSED"}, "patch": "diff"}
    assert "scratch" not in traj.info and traj.metrics["resolved"] == 1.0
    plain = _run(AgentLoop(ScriptedClient(template, _tool_then_answer(row)), template, HermesParser()), row)
    assert "verdict" not in plain.info
