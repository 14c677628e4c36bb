"""Rewards from an LLM judge and typed reward outcomes, against a real loopback HTTP judge.

The judge is a small `http.server` app on 127.0.0.1 that answers chat-completions requests with
scripted verdicts, or is down, slow, or answers garbage or a cut reply. Each missing-reward cause is
proved through `JudgeReward`, through `reward.combine`, and through the AgentLoop (masked episode,
cause in `trajectory.info`, counted per cause in the step's metrics, a judge that is down stopping
the run with its URL and the fix).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from agentrl.chat import ChatTemplate
from agentrl.config import JudgeConfig, RewardConfig, load_config, save_config
from agentrl.envs.arithmetic import ArithmeticEnv, make_arithmetic_row
from agentrl.envs.judge import JudgeReward, parse_verdict
from agentrl.envs.reward_sources import CombinedReward, ascore_row, build_reward
from agentrl.envs.rewards import RewardFunction
from agentrl.errors import ConfigError, InfraFailureError, RewardMissingError
from agentrl.orchestration.infra import InfraMonitor
from agentrl.records.metrics import episode_metrics
from agentrl.rollout import AgentLoop
from agentrl.tools.parsers import HermesParser
from agentrl.types import Generation, SamplingParams


class JudgeServer:
    """A loopback chat-completions judge; `mode` picks its behaviour, `requests` keeps what it was sent."""

    def __init__(self) -> None:
        self.mode = "verdict"
        self.score = 1.0
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self.release = threading.Event()
        self.release.set()
        lock = threading.Lock()
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    judge.requests.append(body)
                    judge.headers.append(dict(self.headers))
                    judge.in_flight += 1
                    judge.most_in_flight = max(judge.most_in_flight, judge.in_flight)
                try:
                    judge.release.wait(10)
                    self._answer(body)
                finally:
                    with lock:
                        judge.in_flight -= 1

            def _answer(self, body: dict[str, Any]) -> None:
                mode = judge.mode
                if mode == "slow":
                    time.sleep(2.0)
                if mode == "error":
                    return self._send(500, b"model overloaded")
                if mode == "not_chat":
                    return self._send(200, b'{"hello": "world"}')
                text, finish = {
                    "verdict": (f'Looks right. {{"score": {judge.score}, "reason": "matches the reference"}}', "stop"),
                    "slow": ('{"score": 1.0, "reason": "late"}', "stop"),
                    "garbage": ("I think it is probably fine?", "stop"),
                    "cut": ('The student computed the product first and then {"sco', "length"),
                    "regex": ("Grade: 0.25 out of 1", "stop"),
                }[mode]
                payload = {"choices": [{"message": {"role": "assistant", "content": text}, "finish_reason": finish}]}
                self._send(200, json.dumps(payload).encode())

            def _send(self, code: int, data: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def judge_server() -> Iterator[JudgeServer]:
    server = JudgeServer()
    yield server
    server.close()


@pytest.fixture
def down_url() -> str:
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    port = server.server_address[1]
    server.server_close()  # nothing listens on this port now
    return f"http://127.0.0.1:{port}/v1"


ROW = make_arithmetic_row(5)
TRUTH = ROW["reward_model"]["ground_truth"]


def _judge(url: str, **kw: Any) -> JudgeReward:
    return JudgeReward(JudgeConfig(url=url, **kw))


# ── the verdict schema ───────────────────────────────────────────────────────────────────────


def test_verdicts_are_read_with_the_declared_schema() -> None:
    assert parse_verdict('ok ```json\n{"score": 0.5, "reason": "half"}\n```') == {"score": 0.5, "reason": "half"}
    assert parse_verdict('{"score": 0, "reason": "a"} then {"score": 1, "reason": "b"}')["score"] == 1.0
    assert parse_verdict("Grade: 0.25 out of 1", r"Grade: (?P<score>[\d.]+)") == {"score": 0.25, "reason": ""}
    assert parse_verdict("7/10 -> 0.7", r"-> ([\d.]+)")["score"] == 0.7
    for reply, match in (('{"score": 3}', r"not in \[0, 1\]"), ('{"score": "yes"}', "not a number"),
                         ("no verdict here", "no JSON object"), ('{"score": true}', "not a number"),
                         ('{"score": 1, "reason": 5}', "not a string")):
        with pytest.raises(ValueError, match=match):
            parse_verdict(reply)
    with pytest.raises(ValueError, match="does not match"):
        parse_verdict("nothing", r"Grade: (\d)")


# ── the judge over HTTP ──────────────────────────────────────────────────────────────────────


def test_the_judge_scores_with_the_rubric_and_keeps_the_exchange(judge_server: JudgeServer,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JUDGE_KEY", "sk-test-123")
    judge_server.score = 0.75
    judge = _judge(judge_server.url, model="grader", api_key_env="JUDGE_KEY", max_tokens=64, temperature=0.0)
    score, record = asyncio.run(judge.ascore(ROW, "I get \\boxed{12}."))
    assert score == 0.75
    (sent,) = judge_server.requests
    question = ROW["prompt"][-1]["content"]
    content = sent["messages"][0]["content"]
    assert question in content and TRUTH in content and "I get \\boxed{12}." in content
    assert (sent["model"], sent["max_tokens"], sent["temperature"]) == ("grader", 64, 0.0)
    assert judge_server.headers[0]["Authorization"] == "Bearer sk-test-123"
    assert record["verdict"] == {"score": 0.75, "reason": "matches the reference"}
    assert record["request"] == content and record["url"] == judge_server.url and "Looks right" in record["reply"]


@pytest.mark.parametrize(("mode", "cause", "message"), [
    ("garbage", "parse", "no readable verdict"),
    ("cut", "truncated", "cut at reward.judge.max_tokens=256"),
    ("error", "infra", "answered HTTP 500"),
    ("not_chat", "parse", "chat-completions format"),
])
def test_each_way_a_judge_fails_is_a_missing_reward_with_its_cause(judge_server: JudgeServer, mode: str,
                                                                   cause: str, message: str) -> None:
    judge_server.mode = mode
    with pytest.raises(RewardMissingError, match=message) as info:
        asyncio.run(_judge(judge_server.url).ascore(ROW, "\\boxed{1}"))
    assert info.value.cause == cause
    assert judge_server.url in str(info.value) and info.value.record["url"] == judge_server.url


def test_a_judge_that_is_down_or_slow_is_missing_not_zero(judge_server: JudgeServer, down_url: str) -> None:
    with pytest.raises(RewardMissingError, match="cannot be reached") as down:
        asyncio.run(_judge(down_url).ascore(ROW, "x"))
    assert down.value.cause == "infra" and down_url in str(down.value)
    judge_server.mode = "slow"
    with pytest.raises(RewardMissingError, match=r"did not answer within reward.judge.timeout_s=0.3 s") as slow:
        asyncio.run(_judge(judge_server.url, timeout_s=0.3).ascore(ROW, "x"))
    assert slow.value.cause == "timeout"


def test_a_regex_verdict(judge_server: JudgeServer) -> None:
    judge_server.mode = "regex"
    score, record = asyncio.run(_judge(judge_server.url, verdict_regex=r"Grade: ([\d.]+)").ascore(ROW, "x"))
    assert score == 0.25 and record["verdict"]["score"] == 0.25


def test_max_concurrency_bounds_the_requests_in_flight(judge_server: JudgeServer) -> None:
    judge = _judge(judge_server.url, max_concurrency=2)

    async def many() -> list[float]:
        judge_server.release.clear()
        tasks = [asyncio.create_task(judge.ascore(ROW, f"answer {i}")) for i in range(6)]
        while len(judge_server.requests) < 2:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # a third request, were it let through, would arrive now
        seen_while_held = len(judge_server.requests)
        judge_server.release.set()
        scores = [s for s, _ in await asyncio.gather(*tasks)]
        assert seen_while_held == 2
        return scores

    assert asyncio.run(many()) == [1.0] * 6
    assert judge_server.most_in_flight == 2 and len(judge_server.requests) == 6


def test_judge_config_errors_say_what_to_do(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="exactly one of url .* and model_path"):
        JudgeConfig()
    with pytest.raises(ValueError, match="exactly one of url"):
        JudgeConfig(url="http://127.0.0.1:1/v1", model_path="smollm2-135m-instruct")
    with pytest.raises(ValueError, match=r"reward.judge.engine, reward.judge.startup_timeout_s only apply"):
        JudgeConfig(url="http://127.0.0.1:1/v1", engine="hf", startup_timeout_s=5)
    for judge in ("reward.judge.url=http://127.0.0.1:1/v1", "reward.judge.model_path=smollm2-135m-instruct"):
        saved = tmp_path / judge.split("=")[0]
        save_config(load_config(overrides=[judge, "reward.judge.engine=hf"] if "model_path" in judge else [judge]),
                    saved)
        reloaded = load_config(str(saved / "config.yaml")).reward.judge  # every field written, defaults too
        assert reloaded is not None and (reloaded.url, reloaded.model_path) == (
            ("http://127.0.0.1:1/v1", None) if "url" in judge else (None, "smollm2-135m-instruct"))
    served = JudgeReward(JudgeConfig(model_path="smollm2-135m-instruct", engine="hf", server_args=["a=b"]))
    assert served.server is not None and served.server.command[1:] == [  # the gateway service's module, not the CLI
        "-m", "agentrl.orchestration.gateway_service", "model.path=smollm2-135m-instruct", "inference.engine=hf",
        "a=b", "--host", "127.0.0.1"]
    assert served.server.pid is None  # started by the first judge request, not before
    monkeypatch.delenv("NO_SUCH_KEY_VAR", raising=False)
    with pytest.raises(ConfigError, match=r"\$NO_SUCH_KEY_VAR, which is not set"):
        _judge("http://127.0.0.1:1/v1", api_key_env="NO_SUCH_KEY_VAR")
    with pytest.raises(ConfigError, match="not a usable template"):
        _judge("http://127.0.0.1:1/v1", prompt="grade {answer} with {rubric}")
    with pytest.raises(ConfigError, match="not a regular expression"):
        _judge("http://127.0.0.1:1/v1", verdict_regex="(")


# ── configured sources and their combination ─────────────────────────────────────────────────


def test_the_reward_section_is_checked_for_sources_that_would_do_nothing() -> None:
    url = "reward.judge.url=http://127.0.0.1:1/v1"
    for overrides, match in (
        (["reward.combine=[{source: judge, weight: 1}]"], "reward.combine names 'judge' but reward.judge is not set"),
        ([url, "reward.combine=[{source: rule, weight: 1}]"], "reward.judge is set but reward.combine does not name"),
        ([url, "reward.model.path=/m"], "both set"),
        ([url, "reward.function=m:f"], "reward.function / reward.kwargs are set but the reward does not use"),
        (["reward.combine=[{source: rule}, {source: rule}]"], "names a source twice"),
    ):
        with pytest.raises(ConfigError, match=match):
            load_config(overrides=overrides)
    assert isinstance(build_reward(RewardConfig()), RewardFunction)  # the rule alone: as before
    combined = build_reward(load_config(overrides=[url, "reward.combine=[{source: rule, weight: 0.5}, "
                                                        "{source: judge, weight: 0.5}]"]).reward)
    assert isinstance(combined, CombinedReward) and combined.name == "0.5*rule + 0.5*judge"
    assert isinstance(combined.rule, RewardFunction)


def test_combined_rewards_sum_their_weighted_parts_and_go_missing_with_any_part(judge_server: JudgeServer,
                                                                              down_url: str) -> None:
    judge_server.score = 0.5
    config = RewardConfig(judge=JudgeConfig(url=judge_server.url),
                          combine=[{"source": "rule", "weight": 0.25}, {"source": "judge", "weight": 0.75}])
    reward = build_reward(config)
    result = asyncio.run(ascore_row(reward, ROW, f"\\boxed{{{TRUTH}}}"))
    assert result.score == pytest.approx(0.25 * 1.0 + 0.75 * 0.5)
    assert result.record["parts"]["rule"] == {"weight": 0.25, "score": 1.0}
    assert result.record["parts"]["judge"]["verdict"]["score"] == 0.5
    assert result.extra["judge_score"] == 0.5
    down = build_reward(config.model_copy(update={"judge": JudgeConfig(url=down_url)}))
    with pytest.raises(RewardMissingError) as info:
        asyncio.run(ascore_row(down, ROW, f"\\boxed{{{TRUTH}}}"))
    assert info.value.cause == "infra"
    assert info.value.record["parts"]["rule"]["score"] == 1.0  # what was measured is kept, not summed
    assert info.value.record["parts"]["judge"]["missing"] == "infra"
    with pytest.raises(NotImplementedError, match="score asynchronously"):
        reward("agentrl/arithmetic", "x", "1")


def test_a_rule_function_that_raises_is_a_missing_reward(tmp_path: Path) -> None:
    path = tmp_path / "flaky.py"
    path.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    raise KeyError('lookup table not loaded')\n")
    with pytest.raises(RewardMissingError, match="raised KeyError: 'lookup table not loaded'") as info:
        asyncio.run(ascore_row(RewardFunction(str(path)), ROW, "\\boxed{1}"))
    assert info.value.cause == "infra"


# ── through the AgentLoop: masked, recorded, counted, and a judge that is down stops the run ─


class AnswerClient:
    """Answers every episode with the right boxed answer in one turn."""

    def __init__(self, template: ChatTemplate) -> None:
        self.tok = template.tokenizer
        self.end = self.tok.convert_tokens_to_ids("<|im_end|>")

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, *, session_id: str,
                       timeout_s: float | None = None) -> Generation:
        ids = self.tok.encode(f"The answer is \\boxed{{{TRUTH}}}.", add_special_tokens=False) + [self.end]
        return Generation(ids, [-0.5] * len(ids), "stop", 0)


@pytest.fixture(scope="module")
def template(assets: Path) -> ChatTemplate:
    return ChatTemplate.from_pretrained(assets / "qwen2.5-0.5b-instruct")


def _episodes(template: ChatTemplate, reward: Any, n: int) -> list[Any]:
    loop = AgentLoop(AnswerClient(template), template, HermesParser())

    async def play() -> list[Any]:
        return list(await asyncio.gather(*(loop.run_episode(ArithmeticEnv(reward_fn=reward), row=ROW)
                                           for _ in range(n))))

    return asyncio.run(play())


def test_judged_episodes_keep_the_verdict_and_missing_ones_are_masked_and_counted(
        judge_server: JudgeServer, template: ChatTemplate) -> None:
    judge_server.score = 0.5
    config = RewardConfig(judge=JudgeConfig(url=judge_server.url),
                          combine=[{"source": "rule", "weight": 0.5}, {"source": "judge", "weight": 0.5}])
    (judged,) = _episodes(template, build_reward(config), 1)
    assert (judged.fault, judged.reward, judged.trainable) == (None, 0.75, True)
    assert judged.info["reward"]["parts"]["judge"]["verdict"] == {"score": 0.5, "reason": "matches the reference"}
    assert TRUTH in judged.info["reward"]["parts"]["judge"]["request"]
    assert judged.metrics["reward/judge_score"] == 0.5

    judge_server.mode = "garbage"
    unreadable = _episodes(template, build_reward(config), 3)
    for t in unreadable:
        assert (t.fault, t.reward, t.trainable) == ("infra", None, False)  # masked, never 0
        assert t.info["reward_missing"]["cause"] == "parse"
        assert "no readable verdict" in t.info["reward_missing"]["message"]
        assert t.info["reward"]["parts"]["judge"]["reply"] == "I think it is probably fine?"
    metrics = episode_metrics([[judged], unreadable])
    assert (metrics["reward/missing_parse"], metrics["reward/missing_infra"]) == (3.0, 0.0)
    assert metrics["episodes/reward_mean"] == 0.75  # only what was measured


def test_a_judge_that_is_down_stops_the_run_naming_its_url_and_the_fix(template: ChatTemplate, down_url: str) -> None:
    episodes = _episodes(template, build_reward(RewardConfig(judge=JudgeConfig(url=down_url))), 4)
    assert {t.info["reward_missing"]["cause"] for t in episodes} == {"infra"}
    assert episode_metrics([episodes])["reward/missing_infra"] == 4.0
    monitor = InfraMonitor(0.5, 64, min_episodes=4)
    monitor.record(episodes)
    with pytest.raises(InfraFailureError) as info:
        monitor.check()
    message = str(info.value)
    assert down_url in message and "4 of the last 4 episodes" in message
    assert "Fix: the reward judge (reward.judge.url, named above) is down" in message
