"""Gateway overhead: OpenAI-API agents through the gateway against the AgentLoop, same scripted episodes.

    python bench/gateway.py [--agents 200] [--service-s 1.0] [--turns 2] [--ramp-s 1.0]

The model is a small fake HTTP server (agentrl's `/generate` protocol, in its own process) that
answers turn k of each session with a scripted generation after exactly `service_s` seconds:
calculator tool calls on the row's expression, then the boxed answer (the arithmetic env's tasks).
The same episodes are played both ways, alternating (`--rounds`), in one run over the same router and server:

- AgentLoop: `RolloutWorker` + `ArithmeticEnv`, the rollout path without a gateway;
- gateway: `RolloutWorker` + `AgentEnv`, whose agents are ordinary `openai` SDK tool loops
  (`AsyncOpenAI(base_url=task.base_url)`, one shared connection pool) running the same calculator
  tool, in the same process and event loop as the gateway.

Reported: the mean latency of one model call as the AgentLoop sees it (its generate call, HTTP to
the server included) and as the agents see it (`chat.completions.create`, gateway included), each
over the service time; the gateway's added latency per call is the second minus the first, over the
service time (target <= 5%). It includes the agents' own client work (the openai SDK builds and
parses every call on the same event loop) and the extra HTTP hop; the time spent inside the gateway
(request in to answer out, generation excluded) is reported too. Episode starts are spread over `--ramp-s` seconds in both runs (the
steady state of a rollout worker; 0 starts all at once). Then every episode's recorded trajectory
is compared token by token (ids, origins, turns, logprobs, versions) with the AgentLoop's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ASSETS = Path(os.environ.get("AGENTRL_ASSETS", Path(__file__).resolve().parents[2] / "shared" / "assets"))
TOKENIZER = ASSETS / "qwen2.5-0.5b-instruct"


# ── the fake model server (its own process) ────────────────────────────────────────────────
def _scripts(rows: list[dict], turns: int, tok: Any) -> list[list[list[int]]]:
    end = tok.convert_tokens_to_ids("<|im_end|>")
    out = []
    for row in rows:
        call = json.dumps({"name": "calculator", "arguments": {"expression": row["extra_info"]["expression"]}})
        texts = [f"<tool_call>\n{call}\n</tool_call>"] * (turns - 1)
        texts.append(f"The result is \\boxed{{{row['reward_model']['ground_truth']}}}.")
        out.append([tok.encode(t, add_special_tokens=False) + [end] for t in texts])
    return out


def _serve_model(port: int, n_rows: int, turns: int, service_s: float) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route
    from transformers import AutoTokenizer

    from agentrl.envs.arithmetic import make_arithmetic_row

    scripts = _scripts([make_arithmetic_row(i) for i in range(n_rows)], turns,
                       AutoTokenizer.from_pretrained(str(TOKENIZER)))
    turn_of: dict[str, int] = {}

    async def generate(request: Request) -> JSONResponse:
        body = await request.json()
        session = body["session_id"]
        turn = turn_of.get(session, 0)
        turn_of[session] = turn + 1
        await asyncio.sleep(service_s)
        ids = scripts[int(session.split("-")[0].split(".")[1])][min(turn, turns - 1)]
        return JSONResponse({"token_ids": ids, "logprobs": [-0.125] * len(ids), "finish_reason": "stop",
                             "weight_version": 0})

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "weight_version": 0, "model": "fake", "engine": "fake", "load": 0})

    app = Starlette(routes=[Route("/generate", generate, methods=["POST"]), Route("/health", health)])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, backlog=4096,
                timeout_keep_alive=300)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ── the two ways to play an episode ─────────────────────────────────────────────────────────
class TimedClient:
    """Wraps the router; the latency of each generate call as the AgentLoop sees it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.latencies: list[float] = []

    async def generate(self, prompt_ids: list[int], sampling: Any, *, session_id: str,
                       timeout_s: float | None = None) -> Any:
        t0 = time.perf_counter()
        gen = await self.inner.generate(prompt_ids, sampling, session_id=session_id, timeout_s=timeout_s)
        self.latencies.append(time.perf_counter() - t0)
        return gen


def _make_agent(http: Any, latencies: list[float], tools: list[dict]) -> Any:
    import openai

    from agentrl.gateway import AgentTask
    from agentrl.tools.calculator import calculator

    async def agent(task: AgentTask) -> str:
        client = openai.AsyncOpenAI(base_url=task.base_url, api_key=task.api_key, http_client=http, max_retries=0)
        messages: list[Any] = list(task.messages)
        while True:
            t0 = time.perf_counter()
            reply = await client.chat.completions.create(model=task.model, messages=messages, tools=tools)
            latencies.append(time.perf_counter() - t0)
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return message.content or ""
            for call in message.tool_calls:
                result = await calculator.invoke(call.function.arguments, tool_call_id=call.id)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result.content})

    return agent


async def _play(worker: Any, rows: list[dict], ramp_s: float, prefix: str, first: int = 0) -> tuple[list[Any], float]:
    """Play rows[i] as session `{prefix}.{first + i}-0` (the fake server scripts row `first + i`)."""
    async def delayed(i: int, row: dict) -> list[Any]:
        await asyncio.sleep(ramp_s * i / len(rows))
        group = f"{prefix}.{first + i}"
        return await worker.run_episode_segments(row, seed=i, group_id=group, episode_id=f"{group}-0")

    t0 = time.perf_counter()
    groups = await asyncio.gather(*(delayed(i, row) for i, row in enumerate(rows)))
    return [t for g in groups for t in g], time.perf_counter() - t0


async def _bench(url: str, agents: int, service_s: float, turns: int, ramp_s: float, rounds: int) -> dict[str, Any]:
    import httpx

    from agentrl.chat import ChatTemplate
    from agentrl.envs.arithmetic import ArithmeticEnv, make_arithmetic_row
    from agentrl.gateway import AgentEnv, shared_gateway
    from agentrl.inference import HTTPServerClient, Router
    from agentrl.rollout import AgentLoop, AgentLoopConfig, RolloutWorker
    from agentrl.tools.parsers import HermesParser

    template = ChatTemplate.from_pretrained(TOKENIZER)
    router = Router([HTTPServerClient(url)], request_timeout_s=600)
    await router.start()
    client = TimedClient(router)
    config = AgentLoopConfig(max_turns=turns, episode_timeout_s=3600, request_timeout_s=600)
    loop = AgentLoop(client, template, HermesParser(), config)
    rows = [make_arithmetic_row(i) for i in range(agents + 8)]
    warm, rows = rows[agents:], rows[:agents]
    agent_latencies: list[float] = []
    limits = httpx.Limits(max_connections=4 * agents, max_keepalive_connections=4 * agents)
    async with httpx.AsyncClient(limits=limits, timeout=600) as http, shared_gateway():  # one gateway for both
        agent = _make_agent(http, agent_latencies, [s.schema for s in ArithmeticEnv().tools.values()])
        direct = RolloutWorker(loop, lambda: ArithmeticEnv(max_turns=turns), max_concurrent=4 * agents)
        gated = RolloutWorker(loop, lambda: AgentEnv(agent), max_concurrent=4 * agents)
        # Untimed warm-up of both paths (template caches, connection pools), on rows of their own.
        await _play(direct, warm, 0.0, "w", agents)
        await _play(gated, warm, 0.0, "v", agents)
        # Two rounds, alternating, so that a change in the machine's load hits both paths alike.
        loop_latencies: list[float] = []
        a, b, a_wall, b_wall = [], [], 0.0, 0.0
        for r in range(rounds):
            client.latencies.clear()
            played, wall = await _play(direct, rows, ramp_s, f"a{r}")
            a, a_wall, loop_latencies = a + played, a_wall + wall / rounds, loop_latencies + client.latencies
            client.latencies.clear()
            played, wall = await _play(gated, rows, ramp_s, f"b{r}")
            b, b_wall = b + played, b_wall + wall / rounds
    await router.aclose()
    if not all(t.reward == 1.0 and t.fault is None for t in a + b):
        bad = next(t for t in a + b if t.reward != 1.0 or t.fault is not None)
        sys.exit(f"an episode did not solve its task ({bad.error}): the benchmark is broken")
    by_id = {t.episode_id[1:]: t for t in a}
    fields = ("token_ids", "origins", "turns", "logprobs", "versions")
    equal = sum(all(getattr(t, f) == getattr(by_id[t.episode_id[1:]], f) for f in fields) for t in b)
    loop_ms, agent_ms = 1000 * statistics.fmean(loop_latencies), 1000 * statistics.fmean(agent_latencies)
    finals = [t for t in b if t.info["segment"]["index"] == t.info["segment"]["of"] - 1]
    server_ms = 1000 * sum(t.metrics["handling_s"] - t.metrics["generate_s"] for t in finals) / len(agent_latencies)
    return {
        "agents": agents, "service_s": service_s, "turns": turns, "ramp_s": ramp_s, "rounds": rounds,
        "calls": len(agent_latencies),
        "agentloop_call_ms": loop_ms, "gateway_call_ms": agent_ms,
        "agentloop_over_service": loop_ms / (1000 * service_s) - 1,
        "gateway_over_service": agent_ms / (1000 * service_s) - 1,
        "gateway_added_over_service": (agent_ms - loop_ms) / (1000 * service_s),
        "gateway_server_ms_per_call": server_ms,
        "gateway_call_p99_ms": 1000 * sorted(agent_latencies)[int(0.99 * (len(agent_latencies) - 1))],
        "agentloop_wall_s": a_wall, "gateway_wall_s": b_wall,
        "segments": len(b), "trajectories_equal": equal, "episodes": len(a),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=200)
    parser.add_argument("--service-s", type=float, default=1.0)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--ramp-s", type=float, default=1.0, help="spread of episode starts (0: all at once)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating AgentLoop/gateway rounds")
    args = parser.parse_args()
    port = _free_port()
    server = mp.get_context("spawn").Process(
        target=_serve_model, args=(port, args.agents + 8, args.turns, args.service_s), daemon=True)
    server.start()
    try:
        import httpx

        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                httpx.get(f"{url}/health", timeout=1.0).raise_for_status()
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline or not server.is_alive():
                    sys.exit("the fake model server did not start")
                time.sleep(0.2)
        r = asyncio.run(_bench(url, args.agents, args.service_s, args.turns, args.ramp_s, args.rounds))
    finally:
        server.terminate()
        server.join(10)
    print(f"{r['agents']} agents x {r['turns']} calls, service time {r['service_s']:.2f} s, starts over "
          f"{r['ramp_s']:.1f} s, {r['rounds']} alternating rounds ({r['calls']} gateway calls)")
    print(f"  AgentLoop call latency   {r['agentloop_call_ms']:8.1f} ms  ({r['agentloop_over_service']:+.2%} over the "
          f"service time)   wall {r['agentloop_wall_s']:.2f} s")
    print(f"  gateway call latency     {r['gateway_call_ms']:8.1f} ms  ({r['gateway_over_service']:+.2%})   p99 "
          f"{r['gateway_call_p99_ms']:.1f} ms   wall {r['gateway_wall_s']:.2f} s")
    verdict = "met" if r["gateway_added_over_service"] <= 0.05 else "NOT met"
    print(f"  gateway added latency    {r['gateway_added_over_service']:+.2%} of the service time per call "
          f"(target <= 5%: {verdict})")
    print(f"  inside the gateway       {r['gateway_server_ms_per_call']:8.2f} ms per call (request in to answer out, "
          "generation excluded)")
    print(f"  trajectories equal to the AgentLoop's: {r['trajectories_equal']} of {r['episodes']} episodes "
          f"({r['segments']} segments)")
    print(json.dumps(r))


if __name__ == "__main__":
    main()
