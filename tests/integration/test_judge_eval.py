"""`agentrl eval` with a judged reward: the real eval path (config, job, AgentLoop, arithmetic env,
report and trajectory log) with a reward of rule + judge, the judge a real loopback HTTP server. The
policy is a scripted stand-in (right on even problems, wrong on odd ones); the judge answers with
a verdict that depends on the answer it is shown. A judge that is down stops the evaluation in
pre-flight, before anything starts; one whose replies hold no verdict stops it with a message naming
its URL and the fix, after the report and every episode (with its missing cause) were written.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from agentrl.chat import ChatTemplate
from agentrl.config import load_config
from agentrl.errors import InfraFailureError, PreflightError
from agentrl.inference.protocol import Generation, SamplingParams
from agentrl.orchestration.evaluate import run_eval
from agentrl.tools.calculator import evaluate_expression, format_number

pytestmark = pytest.mark.slow  # the eval path's build and pre-flight: about 10-20 s each on a shared CPU


class HalfRightPolicy:
    """Answers "Compute EXPR." with the right value when its first number is even, else with 7."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, *, session_id: str,
                       timeout_s: float | None = None) -> Generation:
        expr = re.findall(r"Compute (.+?)\.<\|im_end\|>", self.tok.decode(prompt_ids))[-1]
        first = int(re.findall(r"\d+", expr)[0])
        value = format_number(evaluate_expression(expr)) if first % 2 == 0 else "7"
        ids = self.tok.encode(f"The result is \\boxed{{{value}}}.<|im_end|>", add_special_tokens=False)
        return Generation(ids, [-0.1] * len(ids), "stop", 0)


@pytest.fixture
def judge_url() -> Iterator[str]:
    """A judge that gives 0.8 to a boxed answer other than 7, and 0.2 to 7; at a URL ending in
    /mumble/v1 it mumbles (no verdict)."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            answer = body["messages"][0]["content"].split("Student's answer:")[1]
            score = 0.2 if "\\boxed{7}" in answer else 0.8
            text = json.dumps({"score": score, "reason": "checked"})
            if self.path.startswith("/mumble/"):
                text = "hmm, hard to say"
            data = json.dumps({"choices": [{"message": {"role": "assistant", "content": text},
                                            "finish_reason": "stop"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def _config(assets: Path, out: Path, url: str) -> Any:
    return load_config(overrides=[
        "env=arithmetic", f"model.path={assets / 'qwen2.5-0.5b-instruct'}", "eval.k=1", "eval.max_rows=6",
        f"eval.output_dir={out}", f"reward.judge.url={url}",
        "reward.combine=[{source: rule, weight: 0.5}, {source: judge, weight: 0.5}]"])


def test_eval_scores_with_rule_and_judge_and_keeps_each_verdict(assets: Path, tmp_path: Path, judge_url: str) -> None:
    config = _config(assets, tmp_path / "eval", judge_url)
    report = run_eval(config, client=HalfRightPolicy(ChatTemplate.from_pretrained(config.model.path).tokenizer))
    assert (report.episodes, report.infra_failed_episodes, report.reward_missing) == (6, 0, {})
    episodes = [json.loads(line) for line in (tmp_path / "eval" / "trajectories.jsonl").read_text().splitlines()]
    rewards = sorted(e["reward"] for e in episodes)
    right = sum(r == pytest.approx(0.5 + 0.4) for r in rewards)
    assert right + sum(r == pytest.approx(0.0 + 0.1) for r in rewards) == 6 and 0 < right < 6
    assert report.mean_reward == pytest.approx((0.9 * right + 0.1 * (6 - right)) / 6)
    for e in episodes:
        judge = e["info"]["reward"]["parts"]["judge"]
        assert judge["url"] == judge_url and judge["verdict"]["reason"] == "checked"
        assert "Compute" in judge["request"]  # the question went to the judge


def test_a_judge_that_is_down_stops_the_eval_before_it_starts(assets: Path, tmp_path: Path) -> None:
    with ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler) as probe:
        url = f"http://127.0.0.1:{probe.server_address[1]}/v1"  # closed when the block ends: nothing listens
    config = _config(assets, tmp_path / "eval", url)
    policy = HalfRightPolicy(ChatTemplate.from_pretrained(config.model.path).tokenizer)
    with pytest.raises(PreflightError, match=rf"reward judge \({re.escape(url)}\).*cannot be reached") as info:
        run_eval(config, client=policy)
    assert "fix: start the judge server, or fix reward.judge.url" in str(info.value)
    assert not (tmp_path / "eval").exists()  # nothing was started


def test_a_judge_without_verdicts_stops_the_eval_naming_it(assets: Path, tmp_path: Path, judge_url: str) -> None:
    url = judge_url.replace("/v1", "/mumble/v1")
    config = _config(assets, tmp_path / "eval", url)
    policy = HalfRightPolicy(ChatTemplate.from_pretrained(config.model.path).tokenizer)
    with pytest.raises(InfraFailureError) as info:
        run_eval(config, client=policy)
    message = str(info.value)
    assert "6 of 6 evaluation episodes failed" in message and url in message and "no readable verdict" in message
    assert "Fix: the reward judge (reward.judge.url, named above) is down" in message
    episodes = [json.loads(line) for line in (tmp_path / "eval" / "trajectories.jsonl").read_text().splitlines()]
    assert [e["info"]["reward_missing"]["cause"] for e in episodes] == ["parse"] * 6
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert (report["reward_missing"], report["infra_failed_episodes"], report["mean_reward"]) == ({"parse": 6}, 6, None)
    assert {e["reward"] for e in episodes} == {None}  # not measured: no number, not 0
    assert {e["info"]["reward"]["parts"]["judge"]["reply"] for e in episodes} == {"hmm, hard to say"}


def test_a_judge_the_eval_serves_itself_is_checked_used_and_stopped(assets: Path, tmp_path: Path) -> None:
    """`reward.judge.model_path`: the eval starts the judge (a gateway of the tiny random model) in
    pre-flight, which warns that its replies hold no verdict; every episode's reward is then missing
    (never 0), the eval stops naming the served judge and its fix, and no judge process is left."""
    import uuid

    tag = f"run.name=judge-{uuid.uuid4().hex[:8]}"  # marks the judge's command line, to find its processes
    config = load_config(overrides=[
        "env=arithmetic", f"model.path={assets / 'qwen2.5-0.5b-instruct'}", "eval.k=1", "eval.max_rows=4",
        f"eval.output_dir={tmp_path / 'eval'}", f"reward.judge.model_path={assets / 'tiny-random-qwen2'}",
        "reward.judge.engine=hf", f"reward.judge.server_args=[model.chat_template=chatml-tools, {tag}]",
        "reward.judge.max_tokens=8", "reward.judge.verdict_regex=(?P<score>[01])",
        "reward.combine=[{source: rule, weight: 0.5}, {source: judge, weight: 0.5}]"])
    policy = HalfRightPolicy(ChatTemplate.from_pretrained(config.model.path).tokenizer)
    with pytest.raises(InfraFailureError) as info:
        run_eval(config, client=policy)
    message = str(info.value)
    assert "4 of 4 evaluation episodes failed" in message and "the reward judge the run serves" in message
    assert "Fix: the judge model the run serves (reward.judge.model_path)" in message
    episodes = [json.loads(line) for line in (tmp_path / "eval" / "trajectories.jsonl").read_text().splitlines()]
    assert {e["reward"] for e in episodes} == {None} and len(episodes) == 4
    judged = [e["info"]["reward"]["parts"]["judge"] for e in episodes]
    assert all(re.fullmatch(r"http://127\.0\.0\.1:\d+/s/judge-\d+/v1", j["url"]) for j in judged)
    assert {j["missing"] for j in judged} <= {"parse", "truncated"} and all("reply" in j for j in judged)
    left = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline_has(p, tag)]
    assert left == [], "the judge server outlived the eval"


def _cmdline_has(proc: Path, text: str) -> bool:
    try:
        return text in (proc / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
