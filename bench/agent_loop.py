"""AgentLoop throughput: many concurrent episodes against a server with a fixed service time.

    python bench/agent_loop.py [--episodes 1000] [--service-s 1.0] [--turns 2]
    python bench/agent_loop.py --curve 100,300,1000 [--ramp-s 0,1] [--workers 1,2]
    python bench/agent_loop.py --sustain-s 30           # throughput with 1,000 episodes always in flight

The server is an in-process fake that answers every request after exactly `service_s` seconds
(unlimited parallelism, a few microseconds of its own CPU per request), so any wall time above
the ideal is the AgentLoop's own cost: chat-template deltas, parsing, the env's tool calls and
asyncio scheduling, all on one core per worker process.

Two arrival patterns, side by side:
- burst (`--ramp-s 0`): every episode starts at once. The ideal wall is `turns x service_s`; the
  first requests of 1,000 episodes queue behind 1,000 start-ups, so the overhead grows with the
  episode count times the CPU per turn. Overhead = (wall - ideal) / ideal.
- ramp (`--ramp-s R`): episode starts are spread evenly over R seconds, as they are in steady
  state once completions have desynchronised. The ideal is then each episode's own
  `turns x service_s`; overhead = mean over episodes of (episode wall - ideal) / ideal (p99 too).

- sustained (`--sustain-s D`): a closed loop that keeps `episodes` in flight for D seconds (each
  slot starts its next group the moment its last one ends), the steady state of a rollout worker.
  Throughput is counted over the second half of the run, after the start-up burst has spread the
  slots out: a slot's cycle is the time from one group's end to the next one's, ideally
  `turns x service_s`; the overhead is mean cycle / ideal - 1 over the cycles that start in the
  second half (ideal / measured throughput - 1, without counting whole waves of completions).

A heartbeat task measures event-loop stalls (how late a 1 ms sleep wakes up). On a shared machine
a late wake-up is often the OS running another process, not the loop being busy, so the loop
thread's CPU time during each late wake-up is reported too ("busy"): that part is the loop's own.
Before timing, each process runs a small untimed warm-up batch (it fills the tokenisation caches
and freezes the start-up heap for the garbage collector, as a long-running worker has). Targets:
overhead <= 2% of the service time, no stall over 10 ms.

`--workers K` splits the episodes over K processes, each with its own event loop and fake server,
started together; the wall is the slowest worker's.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing as mp
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
        ids = self.scripts[session_id.split("-")[0].split(".")[0]][turn]  # `g3.7-2`: group g3, 7th repeat
        return Generation(ids, [-0.1] * len(ids), "stop", 0)


async def _heartbeat(stalls: list[tuple[float, float]], stop: asyncio.Event) -> None:
    """(wall, loop-thread CPU) seconds by which each 1 ms sleep overslept."""
    while not stop.is_set():
        t0, c0 = time.perf_counter(), time.thread_time()
        await asyncio.sleep(0.001)
        late = time.perf_counter() - t0 - 0.001
        stalls.append((late, min(late, max(0.0, time.thread_time() - c0 - 0.001))))


def _rows(first: int, n_groups: int) -> dict[str, dict]:
    return {f"g{first + i}": make_arithmetic_row(first + i) for i in range(n_groups)}


async def _warm_worker(template: ChatTemplate, rows: dict[str, dict], service_s: float, turns: int, group: int,
                       first_group: int) -> tuple[AgentLoop, RolloutWorker]:
    """A worker for `rows` against the fixed-service server, after an untimed warm-up batch: it
    fills the caches and freezes the start-up heap, as in a long-running worker."""
    server = FixedServiceServer(template, rows, service_s, turns)
    loop = AgentLoop(server, template, HermesParser(), AgentLoopConfig(max_turns=turns, episode_timeout_s=3600))
    worker = RolloutWorker(loop, ArithmeticEnv, max_concurrent=len(rows) * group)
    warm = _rows(10**6 + first_group, 1)
    server.scripts.update(FixedServiceServer(template, warm, 0.0, turns).scripts)
    await worker.run_batch(list(warm.values()), samples_per_prompt=group, first_index=10**6 + first_group)
    gc.collect()
    return loop, worker


async def _run(template: ChatTemplate, episodes: int, service_s: float, turns: int, group: int,
               ramp_s: float, first_group: int, start_at: float | None = None) -> dict[str, float]:
    n_groups = max(1, episodes // group)
    rows = _rows(first_group, n_groups)
    loop, worker = await _warm_worker(template, rows, service_s, turns, group, first_group)
    if start_at is not None:  # several worker processes start together
        await asyncio.sleep(max(0.0, start_at - time.time()))
    stalls: list[tuple[float, float]] = []
    stop = asyncio.Event()
    beat = asyncio.create_task(_heartbeat(stalls, stop))
    gen2 = gc.get_stats()[2]["collections"]

    async def delayed(i: int, row: dict) -> list:
        if ramp_s:
            await asyncio.sleep(ramp_s * i / n_groups)
        return await worker.run_group(row, group, seed=i, group_id=f"g{first_group + i}")

    cpu0, wall0 = time.process_time(), time.perf_counter()
    groups = await asyncio.gather(*(delayed(i, row) for i, row in enumerate(rows.values())))
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    stop.set()
    await beat
    trajs = [t for g in groups for t in g]
    done = sum(t.reward == 1.0 for t in trajs)
    if done != len(trajs):
        sys.exit(f"only {done} of {len(trajs)} episodes solved their task: the benchmark is broken")
    ideal = turns * service_s
    per_episode = sorted((t.metrics["episode_s"] - ideal) / ideal for t in trajs)
    late = sorted(s[0] for s in stalls)
    busy = sorted(s[1] for s in stalls)
    return {
        "episodes": len(trajs),
        "wall_s": wall,
        "batch_overhead": (wall - ideal - ramp_s * (n_groups - 1) / n_groups) / ideal,
        "episode_overhead_mean": statistics.fmean(per_episode),
        "episode_overhead_p99": per_episode[min(len(per_episode) - 1, int(0.99 * len(per_episode)))],
        "cpu_ms_per_turn": 1000 * cpu / (len(trajs) * turns),
        "stall_max_ms": 1000 * late[-1],
        "stall_p99_ms": 1000 * late[int(0.99 * (len(late) - 1))],
        "busy_max_ms": 1000 * busy[-1],
        "gen2_collections": gc.get_stats()[2]["collections"] - gen2,
        "gate_slices": getattr(getattr(loop, "gate", None), "slices", 0),
    }


async def _sustain(template: ChatTemplate, episodes: int, service_s: float, turns: int, group: int,
                   sustain_s: float) -> dict[str, float]:
    """Keep `episodes` in flight for `sustain_s` seconds; throughput over the second half."""
    n_groups = max(1, episodes // group)
    rows = _rows(0, n_groups)
    _, worker = await _warm_worker(template, rows, service_s, turns, group, 0)
    stalls: list[tuple[float, float]] = []
    stop = asyncio.Event()
    beat = asyncio.create_task(_heartbeat(stalls, stop))
    cycles: list[tuple[float, float]] = []  # (start, length) of each slot's group after its first
    finished = 0
    start = time.perf_counter()
    end = start + sustain_s

    async def slot(i: int, row: dict) -> None:
        nonlocal finished
        repeat, last = 0, None
        while time.perf_counter() < end:
            trajs = await worker.run_group(row, group, seed=repeat, group_id=f"g{i}.{repeat}")
            if any(t.reward != 1.0 for t in trajs):
                sys.exit("an episode did not solve its task: the benchmark is broken")
            now = time.perf_counter()
            if last is not None:
                cycles.append((last, now - last))
            finished, last, repeat = finished + len(trajs), now, repeat + 1

    cpu0 = time.process_time()
    await asyncio.gather(*(slot(i, row) for i, row in enumerate(rows.values())))
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu0
    stop.set()
    await beat
    half = start + sustain_s / 2
    steady = [length for began, length in cycles if began >= half]
    if not steady:
        sys.exit(f"no cycle started in the second half of {sustain_s} s: raise --sustain-s")
    mean_cycle = statistics.fmean(steady)
    ideal = n_groups * group / (turns * service_s)
    late = sorted(s[0] for s in stalls)
    return {
        "episodes": finished,
        "wall_s": wall,
        "rate": n_groups * group / mean_cycle,
        "ideal_rate": ideal,
        "overhead": mean_cycle / (turns * service_s) - 1,
        "cycles": len(steady),
        "cpu_ms_per_turn": 1000 * cpu / (finished * turns),
        "stall_max_ms": 1000 * late[-1],
        "stall_p99_ms": 1000 * late[int(0.99 * (len(late) - 1))],
    }


def _worker_main(args: tuple) -> dict[str, float]:
    episodes, service_s, turns, group, ramp_s, index, start_at = args
    template = ChatTemplate.from_pretrained(ASSETS / "qwen2.5-0.5b-instruct")
    return asyncio.run(_run(template, episodes, service_s, turns, group, ramp_s, 10_000 * index, start_at))


def _run_workers(workers: int, episodes: int, service_s: float, turns: int, group: int,
                 ramp_s: float) -> dict[str, float]:
    """Split the episodes over `workers` processes; combine their figures."""
    ctx = mp.get_context("spawn")
    start_at = time.time() + 25.0  # time for every process to import and warm up
    with ctx.Pool(workers) as pool:
        parts = pool.map(_worker_main, [(episodes // workers, service_s, turns, group, ramp_s, i, start_at)
                                        for i in range(workers)])
    out = {k: max(p[k] for p in parts) for k in parts[0]}
    out["episodes"] = sum(p["episodes"] for p in parts)
    out["cpu_ms_per_turn"] = statistics.fmean(p["cpu_ms_per_turn"] for p in parts)
    out["episode_overhead_mean"] = statistics.fmean(p["episode_overhead_mean"] for p in parts)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=1000)
    parser.add_argument("--curve", default="", help="comma-separated episode counts, e.g. 100,300,1000")
    parser.add_argument("--service-s", type=float, default=1.0)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--ramp-s", default="0", help="comma-separated start spreads in seconds (0: burst)")
    parser.add_argument("--workers", default="1", help="comma-separated worker-process counts")
    parser.add_argument("--sustain-s", type=float, default=0.0,
                        help="closed loop: keep --episodes in flight this long and report the throughput")
    args = parser.parse_args()
    if args.sustain_s:
        template = ChatTemplate.from_pretrained(ASSETS / "qwen2.5-0.5b-instruct")
        print(f"sustained: {args.episodes} episodes in flight for {args.sustain_s:.0f} s, turns={args.turns} "
              f"service={args.service_s:.3f}s group={args.group}; load average "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
        r = asyncio.run(_sustain(template, args.episodes, args.service_s, args.turns, args.group, args.sustain_s))
        print(f"{r['episodes']} episodes in {r['wall_s']:.1f} s; second half ({r['cycles']} group cycles): "
              f"{r['rate']:.1f} episodes/s against an "
              f"ideal {r['ideal_rate']:.1f}/s: overhead {100 * r['overhead']:.2f}% (target <= 2%); "
              f"cpu/turn {r['cpu_ms_per_turn']:.2f} ms; stall max {r['stall_max_ms']:.1f} ms, "
              f"p99 {r['stall_p99_ms']:.2f} ms (target <= 10 ms)")
        return
    counts = [int(x) for x in args.curve.split(",")] if args.curve else [args.episodes]
    ramps = [float(x) for x in args.ramp_s.split(",")]
    workers = [int(x) for x in args.workers.split(",")]
    print(f"turns={args.turns} service={args.service_s:.3f}s group={args.group}; {os.cpu_count()} CPUs, "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    template = ChatTemplate.from_pretrained(ASSETS / "qwen2.5-0.5b-instruct") if 1 in workers else None
    head = (f"{'episodes':>8} {'workers':>7} {'ramp_s':>6} {'wall_s':>7} {'batch_ovh':>9} {'ep_ovh':>7} "
            f"{'ep_p99':>7} {'cpu/turn':>8} {'stall_max':>9} {'stall_p99':>9} {'busy_max':>8} {'gc2':>3}")
    print(head)
    for n in counts:
        for k in workers:
            for ramp in ramps:
                if k == 1:
                    assert template is not None
                    r = asyncio.run(_run(template, n, args.service_s, args.turns, args.group, ramp, 0))
                else:
                    r = _run_workers(k, n, args.service_s, args.turns, args.group, ramp)
                print(f"{r['episodes']:>8} {k:>7} {ramp:>6.2f} {r['wall_s']:>7.2f} "
                      f"{100 * r['batch_overhead']:>8.1f}% {100 * r['episode_overhead_mean']:>6.1f}% "
                      f"{100 * r['episode_overhead_p99']:>6.1f}% {r['cpu_ms_per_turn']:>6.2f}ms "
                      f"{r['stall_max_ms']:>7.1f}ms {r['stall_p99_ms']:>7.2f}ms {r['busy_max_ms']:>6.1f}ms "
                      f"{r['gen2_collections']:>3}", flush=True)
    print("batch_ovh: (wall - ideal) / ideal, ideal = last start + turns x service; ep_ovh: mean per-episode "
          "(episode wall - turns x service) / (turns x service); targets: <= 2% and stall_max <= 10 ms "
          f"(busy_max: the loop's own CPU in the worst stall); load average now "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
