"""Rewards from an LLM judge: start a judge server, score answers with rule + judge, see each verdict.

    python examples/judged_reward.py --judge /path/to/hf/model

It starts the judge as a real local OpenAI-compatible server (`agentrl gateway` of the `--judge`
model on the hf engine, on a free loopback port), builds the reward a run or an evaluation would
build from these overrides (printed, so `agentrl run` / `agentrl eval` can take them as they are):

    reward.judge.url=http://127.0.0.1:PORT/s/judge/v1
    'reward.combine=[{source: rule, weight: 0.5}, {source: judge, weight: 0.5}]'

and scores a right and a wrong answer to a few arithmetic problems with it. For each it prints the
reward with the judge's verdict, or the cause the reward is missing (`infra`, `timeout`, `parse`,
`truncated`: never a 0) with what the judge replied. A random-weight judge (the tiny test model)
answers noise, so its rewards are all missing; a real instruct model gives verdicts. It exits 0 when
every answer was either scored or recorded with its cause, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile

from agentrl.config import load_config
from agentrl.envs.arithmetic import make_arithmetic_row
from agentrl.envs.reward_sources import ascore_row, build_reward
from agentrl.errors import RewardMissingError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_judge(model: str) -> tuple[subprocess.Popen[str], str]:
    """`agentrl gateway` of `model` on a free port; returns it and the judge's base URL once it listens."""
    command = ["agentrl", "gateway", f"model.path={model}", "inference.engine=hf", "--port", str(_free_port()),
               "--out", tempfile.mkdtemp(prefix="judge-")]
    print("judge server:", " ".join(command), flush=True)
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None  # a pipe, opened above
    for line in proc.stdout:
        found = re.search(r"gateway at (http://\S+)/v1", line)
        if found:
            # One session key for the judge's calls: the gateway records each key's calls as one agent run.
            return proc, f"{found.group(1)}/s/judge/v1"
    raise SystemExit(f"the judge server exited with code {proc.wait()} before listening; see its output above")


async def _score_all(reward: object, rows: list[dict], answers: list[tuple[str, str]]) -> list[object]:
    return list(await asyncio.gather(*(ascore_row(reward, row, text) for row, (_, text) in zip(rows, answers, strict=True)),
                                     return_exceptions=True))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--judge", default="smollm2-135m-instruct", help="the judge model (a Hugging Face directory)")
    parser.add_argument("--problems", type=int, default=2, help="arithmetic problems to answer (twice each)")
    ns = parser.parse_args()
    judge, url = _start_judge(ns.judge)
    try:
        overrides = [f"reward.judge.url={url}", "reward.judge.max_tokens=48", "reward.judge.timeout_s=300",
                     "reward.combine=[{source: rule, weight: 0.5}, {source: judge, weight: 0.5}]"]
        print("overrides:", " ".join(f"'{o}'" if " " in o else o for o in overrides), flush=True)
        reward = build_reward(load_config(overrides=["env=arithmetic", *overrides]).reward)
        rows, answers = [], []
        for seed in range(ns.problems):
            row = make_arithmetic_row(seed)
            truth = row["reward_model"]["ground_truth"]
            rows += [row, row]
            answers += [("right", f"The result is \\boxed{{{truth}}}."), ("wrong", "The result is \\boxed{7}.")]
        outcomes = asyncio.run(_score_all(reward, rows, answers))
    finally:
        os.killpg(judge.pid, signal.SIGINT)  # Ctrl-C: the gateway stops the server it started
        judge.wait(timeout=120)
    accounted = 0
    for row, (kind, _), outcome in zip(rows, answers, outcomes, strict=True):
        question = row["prompt"][-1]["content"]
        if isinstance(outcome, RewardMissingError):
            reply = outcome.record.get("parts", {}).get("judge", {}).get("reply", "")
            print(f"{question} {kind} answer: reward missing ({outcome.cause}); the judge replied {reply[:60]!r}")
            accounted += 1
        elif isinstance(outcome, BaseException):
            print(f"{question} {kind} answer: failed: {type(outcome).__name__}: {outcome}")
        else:
            verdict = outcome.record["parts"]["judge"]["verdict"]
            print(f"{question} {kind} answer: reward {outcome.score:.2f} (rule "
                  f"{outcome.record['parts']['rule']['score']:.0f}, judge {verdict['score']:.2f}: {verdict['reason']})")
            accounted += 1
    print(f"{accounted}/{len(outcomes)} answers scored by rule + judge or recorded with the cause")
    return 0 if accounted == len(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
