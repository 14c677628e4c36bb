"""Rewards from an LLM judge the run serves itself: score answers with rule + judge, see each verdict.

    python examples/judged_reward.py --judge /path/to/hf/model

It builds the reward a run or an evaluation would build from these overrides (printed, so
`agentrl run` / `agentrl eval` can take them as they are):

    reward.judge.model_path=MODEL reward.judge.engine=hf
    'reward.combine=[{source: rule, weight: 0.5}, {source: judge, weight: 0.5}]'

The first judge request starts the judge: a separate `agentrl gateway` of the `--judge` model on the
hf engine, on a free loopback port, under a lifeline (`agentrl.envs.judge_server`). It scores a right
and a wrong answer to a few arithmetic problems. For each it prints the reward with the judge's
verdict, or the cause the reward is missing (`infra`, `timeout`, `parse`, `truncated`: never a 0)
with what the judge replied; then it stops the judge. A random-weight judge (the tiny test model)
answers noise, so its rewards are all missing; a real instruct model gives verdicts. It exits 0 when
every answer was either scored or recorded with its cause, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from agentrl.config import load_config
from agentrl.envs.arithmetic import make_arithmetic_row
from agentrl.envs.reward_sources import ascore_row, build_reward
from agentrl.errors import RewardMissingError


async def _score_all(reward: object, rows: list[dict], answers: list[tuple[str, str]]) -> list[object]:
    return list(await asyncio.gather(*(ascore_row(reward, row, text) for row, (_, text) in zip(rows, answers, strict=True)),
                                     return_exceptions=True))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--judge", default="smollm2-135m-instruct", help="the judge model (a Hugging Face directory)")
    parser.add_argument("--problems", type=int, default=2, help="arithmetic problems to answer (twice each)")
    ns = parser.parse_args()
    overrides = [f"reward.judge.model_path={ns.judge}", "reward.judge.engine=hf", "reward.judge.max_tokens=48",
                 "reward.judge.timeout_s=300",
                 "reward.combine=[{source: rule, weight: 0.5}, {source: judge, weight: 0.5}]"]
    print("overrides:", " ".join(f"'{o}'" if " " in o else o for o in overrides), flush=True)
    reward = build_reward(load_config(overrides=["env=arithmetic", *overrides]).reward)
    try:
        rows, answers = [], []
        for seed in range(ns.problems):
            row = make_arithmetic_row(seed)
            truth = row["reward_model"]["ground_truth"]
            rows += [row, row]
            answers += [("right", f"The result is \\boxed{{{truth}}}."), ("wrong", "The result is \\boxed{7}.")]
        outcomes = asyncio.run(_score_all(reward, rows, answers))
    finally:
        reward.stop()  # the judge server and the inference server it started
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
