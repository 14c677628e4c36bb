"""AgentLoop throughput: many concurrent episodes against a server with a fixed service time.

    python bench/agent_loop.py [--episodes 1000] [--service-s 1.0] [--turns 2]

The server is an in-process fake that answers every request after exactly `service_s` seconds
(unlimited parallelism), so any wall time above `turns x service_s` is the AgentLoop's own cost:
chat-template deltas, parsing, the env's tool calls and asyncio scheduling, all on one core. A
heartbeat task measures event-loop stalls (how late a 1 ms sleep wakes up). Printed side by side:
the ideal wall time, the measured one, the overhead as a fraction of the service time, the loop's
CPU time per turn, and the worst stall. Targets: overhead <= 2% of the service time, no stall over
10 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

from agentrl.chat import ChatTemplate
from agentrl.envs.arithmetic import ArithmeticEnv, make_arithmetic_row
from agentrl.rollout import AgentLoop, AgentLoopConfig, RolloutWorker
from agentrl.tools.parsers import HermesParser
from agentrl.types import Generation, SamplingParams

ASSETS = Path(os.environ.get("AGENTRL_ASSETS", Path(__file__).resolve().parents[2] / "shared" / "assets"))


class FixedServiceServer:
    """Answers turn k of a session with a pre-tokenised script after exactly `service_s` seconds."""

    def __init__(self, template: ChatTemplate, rows: dict[str, dict], service_s: float, turns: int) -> None:
        tok = template.tokenizer
        end = tok.convert_tokens_to_ids("<|im_end|>")
        self.service_s = service_s
        self.scripts: dict[str, list[list[int]]] = {}
        for group, row in rows.items():
            call = json.dumps({"name": "calculator", "arguments": {"expression": row["extra_info"]["expression"]}})
            texts = [f"<tool_call>\n{call}\n</tool_call>"] * (turns - 1)
            texts.append(f"\\boxed{{{row['reward_model']['ground_truth']}}}")
            self.scripts[group] = [tok.encode(t, add_special_tokens=False) + [end] for t in texts]
        self.turn_of: dict[str, int] = {}

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, *, session_id: str,
                       timeout_s: float | None = None) -> Generation:
        turn = self.turn_of.get(session_id, 0)
        self.turn_of[session_id] = turn + 1
        await asyncio.sleep(self.service_s)
        ids = self.scripts[session_id.split("-")[0]][turn]
        return Generation(ids, [-0.1] * len(ids), "stop", 0)


async def _heartbeat(stalls: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        await asyncio.sleep(0.001)
        stalls.append(time.perf_counter() - t0 - 0.001)


async def _run(episodes: int, service_s: float, turns: int, group: int) -> dict[str, float]:
    template = ChatTemplate.from_pretrained(ASSETS / "qwen2.5-0.5b-instruct")
    n_groups = episodes // group
    rows = [make_arithmetic_row(i) for i in range(n_groups)]
    server = FixedServiceServer(template, {f"g{i}": r for i, r in enumerate(rows)}, service_s, turns)
    loop = AgentLoop(server, template, HermesParser(), AgentLoopConfig(max_turns=turns, episode_timeout_s=3600))
    worker = RolloutWorker(loop, ArithmeticEnv, max_concurrent=episodes)
    stalls: list[float] = []
    stop = asyncio.Event()
    beat = asyncio.create_task(_heartbeat(stalls, stop))
    cpu0, wall0 = time.process_time(), time.perf_counter()
    groups = await worker.run_batch(rows, samples_per_prompt=group)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    stop.set()
    await beat
    trajs = [t for g in groups for t in g]
    done = sum(t.reward == 1.0 for t in trajs)
    if done != len(trajs):
        sys.exit(f"only {done} of {len(trajs)} episodes solved their task: the benchmark is broken")
    ideal = turns * service_s
    return {
        "episodes": len(trajs),
        "ideal_s": ideal,
        "wall_s": wall,
        "overhead_frac_of_service": (wall - ideal) / ideal,
        "cpu_ms_per_turn": 1000 * cpu / (len(trajs) * turns),
        "stall_max_ms": 1000 * max(stalls),
        "stall_p99_ms": 1000 * statistics.quantiles(stalls, n=100)[98] if len(stalls) > 100 else float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=1000)
    parser.add_argument("--service-s", type=float, default=1.0)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--group", type=int, default=4)
    args = parser.parse_args()
    r = asyncio.run(_run(args.episodes, args.service_s, args.turns, args.group))
    print(f"episodes={r['episodes']} turns={args.turns} service={args.service_s:.3f}s")
    print(f"wall {r['wall_s']:.2f}s vs ideal {r['ideal_s']:.2f}s -> overhead "
          f"{100 * r['overhead_frac_of_service']:.1f}% of service time (target <= 2%)")
    print(f"loop CPU per turn {r['cpu_ms_per_turn']:.2f} ms -> one core orchestrates "
          f"{1000 / r['cpu_ms_per_turn']:.0f} turns/s")
    print(f"event-loop stall: max {r['stall_max_ms']:.1f} ms, p99 {r['stall_p99_ms']:.2f} ms (target max <= 10 ms)")


if __name__ == "__main__":
    main()
