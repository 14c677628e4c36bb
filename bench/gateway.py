"""Gateway overhead: OpenAI-API agents through the gateway against the AgentLoop, same scripted episodes.

    python bench/gateway.py [--agents 200] [--service-s 1.0] [--turns 2] [--ramp-s 1.0]

The model is a small fake HTTP server (agentrl's `/generate` protocol, in its own process) that
answers turn k of each session with a scripted generation after exactly `service_s` seconds:
calculator tool calls on the row's expression, then the boxed answer (the arithmetic env's tasks).
The same episodes are played both ways, alternating (`--rounds`), in one run over the same router and server:

- AgentLoop: `RolloutWorker` + `ArithmeticEnv`, the rollout path without a gateway;
- gateway: `RolloutWorker` + `AgentEnv`, whose agents are tool loops running the same calculator
  tool and speaking the OpenAI Chat Completions API to the gateway over HTTP (plain httpx + json by
  default, the `openai` SDK with `--sdk`). They run on the rollout process's event loop, as
  `async def` agents given to `env=agent` do, so both paths use the same two processes (rollout,
  model server) on a 2-core machine; their own client work is therefore counted against the
  gateway. `--agents-process` runs them in a process of their own instead (the env's function
  hands each task over HTTP), as agents deployed beside a trainer are; on 2 cores that third busy
  process competes with the other two.

Reported: the mean latency of one model call as the AgentLoop sees it (its generate call, HTTP to
the server included) and as the agents see it (request sent to answer parsed, gateway included),
each over the service time; the gateway's added latency per call is the second minus the first,
over the service time (target <= 5%); and, within the same calls, the agents' wait minus the
generation the gateway made for them (which needs no second run to compare with). Both include the
agents' own client work and the extra HTTP hop; the time spent inside the gateway (request in to
answer out, generation excluded), the rollout process's CPU per call and its event-loop lag are
reported too. Episode starts are spread over `--ramp-s` seconds (the steady state of a rollout
worker; 0 starts all at once). Then every episode's recorded trajectory is compared token by token
(ids, origins, turns, logprobs, versions) with the AgentLoop's. The latencies move by several
points from run to run on a shared 2-core machine; the router spreads its connections over small
pools (see `_bench`) for both paths alike.
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


def _wait_healthy(url: str, child: Any) -> None:
    import httpx

    deadline = time.monotonic() + 120
    while True:
        try:
            httpx.get(f"{url}/health", timeout=1.0).raise_for_status()
            return
        except httpx.HTTPError:
            if time.monotonic() > deadline or not child.is_alive():
                sys.exit(f"the helper process at {url} did not start (exit code {child.exitcode})")
            time.sleep(0.2)


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


async def _agent_loop(http: Any, base_url: str, api_key: str, model: str, messages: list[Any],
                      tools: list[dict], latencies: list[float], sdk: bool) -> str:
    """The agent: a tool loop with the calculator tool, over the `openai` SDK or plain HTTP + JSON."""
    import openai

    from agentrl.tools.calculator import calculator

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http, max_retries=0) if sdk else None
    messages = list(messages)
    while True:
        t0 = time.perf_counter()
        if client is not None:
            reply = await client.chat.completions.create(model=model, messages=messages, tools=tools)
            message = reply.choices[0].message.model_dump(exclude_none=True)
        else:
            response = await http.post(f"{base_url}/chat/completions", json={
                "model": model, "messages": messages, "tools": tools}, headers={"Authorization": f"Bearer {api_key}"})
            response.raise_for_status()
            message = response.json()["choices"][0]["message"]
        latencies.append(time.perf_counter() - t0)
        messages.append(message)
        if not message.get("tool_calls"):
            return message.get("content") or ""
        for call in message["tool_calls"]:
            result = await calculator.invoke(call["function"]["arguments"], tool_call_id=call["id"])
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result.content})


def _serve_agents(port: int, agents: int, sdk: bool) -> None:
    """The agents' own process: `POST /run` plays one agent against the base URL it is given."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    pools = _http_pools(agents)

    async def run(request: Request) -> JSONResponse:
        task = await request.json()
        latencies: list[float] = []
        answer = await _agent_loop(pools[hash(task["api_key"]) % len(pools)], task["base_url"], task["api_key"],
                                   task["model"], task["messages"], task["tools"], latencies, sdk)
        return JSONResponse({"answer": answer, "latencies": latencies})

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    app = Starlette(routes=[Route("/run", run, methods=["POST"]), Route("/health", health)])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, backlog=4096,
                timeout_keep_alive=300)


def _http_pools(agents: int, per_pool: int = 16) -> list[Any]:
    """Several small connection pools instead of one big one: httpcore scans every connection of a
    pool on each request and response, so one pool of hundreds of connections costs O(n) per call."""
    import httpx

    limits = httpx.Limits(max_connections=per_pool, max_keepalive_connections=per_pool)
    return [httpx.AsyncClient(limits=limits, timeout=600) for _ in range(max(1, 2 * agents // per_pool))]


def _make_agent(runner: str | None, agents: int, latencies: list[float], tools: list[dict], sdk: bool) -> Any:
    """The `AgentEnv` callable: hands the task to the agents' process at `runner`, or plays it here."""
    from agentrl.gateway import AgentTask

    pools = _http_pools(agents)

    async def agent(task: AgentTask) -> str:
        http = pools[hash(task.api_key) % len(pools)]
        if runner is None:
            return await _agent_loop(http, task.base_url, task.api_key, task.model, task.messages, tools, latencies,
                                     sdk)
        reply = await http.post(f"{runner}/run", json={"base_url": task.base_url, "api_key": task.api_key,
                                                       "model": task.model, "messages": task.messages,
                                                       "tools": tools})
        reply.raise_for_status()
        latencies.extend(reply.json()["latencies"])
        return str(reply.json()["answer"])

    return agent


async def _heartbeat(lags: list[float], stop: asyncio.Event) -> None:
    """How late each 1 ms sleep of the rollout process's event loop wakes up."""
    while not stop.is_set():
        t0 = time.perf_counter()
        await asyncio.sleep(0.001)
        lags.append(time.perf_counter() - t0 - 0.001)


async def _play(worker: Any, rows: list[dict], ramp_s: float, prefix: str, first: int = 0,
                lags: list[float] | None = None) -> tuple[list[Any], float]:
    """Play rows[i] as session `{prefix}.{first + i}-0` (the fake server scripts row `first + i`)."""
    lags = [] if lags is None else lags
    async def delayed(i: int, row: dict) -> list[Any]:
        await asyncio.sleep(ramp_s * i / len(rows))
        group = f"{prefix}.{first + i}"
        return await worker.run_episode_segments(row, seed=i, group_id=group, episode_id=f"{group}-0")

    t0 = time.perf_counter()
    stop = asyncio.Event()
    beat = asyncio.create_task(_heartbeat(lags, stop))
    groups = await asyncio.gather(*(delayed(i, row) for i, row in enumerate(rows)))
    stop.set()
    await beat
    return [t for g in groups for t in g], time.perf_counter() - t0


async def _bench(url: str, agents_url: str | None, agents: int, service_s: float, turns: int, ramp_s: float,
                 rounds: int, sdk: bool) -> dict[str, Any]:

    from agentrl.chat import ChatTemplate
    from agentrl.envs.arithmetic import ArithmeticEnv, make_arithmetic_row
    from agentrl.gateway import AgentEnv, SharedGateway
    from agentrl.inference import HTTPServerClient, Router
    from agentrl.rollout import AgentLoop, AgentLoopConfig, RolloutWorker
    from agentrl.tools.parsers import HermesParser
    from agentrl.types import final_segments

    template = ChatTemplate.from_pretrained(TOKENIZER)
    # The one server behind several small clients: httpcore scans every connection of a pool on each
    # request and response (with a getpeername call each), which with 200 connections in one pool
    # costs ~10 ms of CPU per call on both paths and would hide what the gateway adds.
    router = Router([HTTPServerClient(url, server_id=f"fake-{i}", max_connections=16)
                     for i in range(max(1, 2 * agents // 16))], request_timeout_s=600, health_interval_s=60)
    await router.start()
    client = TimedClient(router)
    config = AgentLoopConfig(max_turns=turns, episode_timeout_s=3600, request_timeout_s=600)
    loop = AgentLoop(client, template, HermesParser(), config)
    rows = [make_arithmetic_row(i) for i in range(agents + 8)]
    warm, rows = rows[agents:], rows[:agents]
    agent_latencies: list[float] = []
    async with SharedGateway() as shared:  # one gateway for every gateway episode of the run
        agent = _make_agent(agents_url, agents, agent_latencies, [s.schema for s in ArithmeticEnv().tools.values()],
                            sdk)
        direct = RolloutWorker(loop, lambda: ArithmeticEnv(max_turns=turns), max_concurrent=4 * agents)
        gated = RolloutWorker(loop, lambda: AgentEnv(agent, gateway=shared), max_concurrent=4 * agents)
        # Untimed warm-up of both paths (template caches, connection pools), on rows of their own.
        await _play(direct, warm, 0.0, "w", agents)
        await _play(gated, warm, 0.0, "v", agents)
        agent_latencies.clear()
        # Two rounds, alternating, so that a change in the machine's load hits both paths alike.
        loop_latencies: list[float] = []
        a, b, a_wall, b_wall, a_cpu, b_cpu = [], [], 0.0, 0.0, 0.0, 0.0
        a_lags: list[float] = []
        b_lags: list[float] = []
        gated_generate: list[float] = []
        for r in range(rounds):
            client.latencies.clear()
            cpu = time.process_time()
            played, wall = await _play(direct, rows, ramp_s, f"a{r}", lags=a_lags)
            a, a_wall, loop_latencies = a + played, a_wall + wall / rounds, loop_latencies + client.latencies
            a_cpu += time.process_time() - cpu
            client.latencies.clear()
            cpu = time.process_time()
            played, wall = await _play(gated, rows, ramp_s, f"b{r}", lags=b_lags)
            b, b_wall = b + played, b_wall + wall / rounds
            gated_generate += client.latencies
            b_cpu += time.process_time() - cpu
    await router.aclose()
    if not all(t.reward == 1.0 and t.fault is None for t in a + b):
        bad = next(t for t in a + b if t.reward != 1.0 or t.fault is not None)
        sys.exit(f"an episode did not solve its task ({bad.error}): the benchmark is broken")
    by_id = {t.episode_id[1:]: t for t in a}
    fields = ("token_ids", "origins", "turns", "logprobs", "versions")
    equal = sum(all(getattr(t, f) == getattr(by_id[t.episode_id[1:]], f) for f in fields) for t in b)
    loop_ms, agent_ms = 1000 * statistics.fmean(loop_latencies), 1000 * statistics.fmean(agent_latencies)
    finals = final_segments(b)
    server_ms = 1000 * sum(t.metrics["handling_s"] - t.metrics["generate_s"] for t in finals) / len(agent_latencies)
    return {
        "agents": agents, "service_s": service_s, "turns": turns, "ramp_s": ramp_s, "rounds": rounds,
        "agents_in_process": agents_url is None, "client": "openai SDK" if sdk else "httpx + json",
        "calls": len(agent_latencies),
        "agentloop_call_ms": loop_ms, "gateway_call_ms": agent_ms,
        "agentloop_over_service": loop_ms / (1000 * service_s) - 1,
        "gateway_over_service": agent_ms / (1000 * service_s) - 1,
        "gateway_added_over_service": (agent_ms - loop_ms) / (1000 * service_s),
        "gateway_server_ms_per_call": server_ms,
        "gateway_generate_ms": 1000 * statistics.fmean(gated_generate),
        "agentloop_cpu_ms_per_call": 1000 * a_cpu / len(loop_latencies),
        "agentloop_loop_lag_ms": 1000 * statistics.fmean(a_lags), "gateway_loop_lag_ms": 1000 * statistics.fmean(b_lags),
        "gateway_cpu_ms_per_call": 1000 * b_cpu / len(agent_latencies),
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
    parser.add_argument("--sdk", action="store_true", help="agents call through the openai SDK (default: httpx + json)")
    parser.add_argument("--agents-process", action="store_true",
                        help="run the agents in a process of their own instead of the rollout process's event loop")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    model_port, agents_port = _free_port(), _free_port()
    children = [ctx.Process(target=_serve_model, args=(model_port, args.agents + 8, args.turns, args.service_s),
                            daemon=True)]
    if args.agents_process:
        children.append(ctx.Process(target=_serve_agents, args=(agents_port, args.agents, args.sdk), daemon=True))
    for child in children:
        child.start()
    try:
        urls = [f"http://127.0.0.1:{model_port}", f"http://127.0.0.1:{agents_port}"][: len(children)]
        for url, child in zip(urls, children, strict=True):
            _wait_healthy(url, child)
        r = asyncio.run(_bench(urls[0], urls[1] if len(urls) > 1 else None, args.agents, args.service_s,
                               args.turns, args.ramp_s, args.rounds, args.sdk))
    finally:
        for child in children:
            child.terminate()
            child.join(10)
    where = "in the rollout process" if r["agents_in_process"] else "in their own process"
    print(f"{r['agents']} agents x {r['turns']} calls ({where}, {r['client']}), service time {r['service_s']:.2f} s, starts over "
          f"{r['ramp_s']:.1f} s, {r['rounds']} alternating rounds ({r['calls']} gateway calls)")
    print(f"  AgentLoop call latency   {r['agentloop_call_ms']:8.1f} ms  ({r['agentloop_over_service']:+.2%} over the "
          f"service time)   wall {r['agentloop_wall_s']:.2f} s")
    print(f"  gateway call latency     {r['gateway_call_ms']:8.1f} ms  ({r['gateway_over_service']:+.2%})   p99 "
          f"{r['gateway_call_p99_ms']:.1f} ms   wall {r['gateway_wall_s']:.2f} s")
    verdict = "met" if r["gateway_added_over_service"] <= 0.05 else "NOT met"
    print(f"  gateway added latency    {r['gateway_added_over_service']:+.2%} of the service time per call "
          f"(target <= 5%: {verdict}); within the same calls (agent's wait minus their generation): "
          f"{(r['gateway_call_ms'] - r['gateway_generate_ms']) / (10 * r['service_s']):+.2f}%")
    print(f"  inside the gateway       {r['gateway_server_ms_per_call']:8.2f} ms per call (request in to answer out, "
          f"generation excluded); its generate calls took {r['gateway_generate_ms']:.1f} ms")
    print(f"  rollout process CPU      {r['agentloop_cpu_ms_per_call']:8.2f} ms per AgentLoop call, "
          f"{r['gateway_cpu_ms_per_call']:.2f} ms per gateway call; mean event-loop lag "
          f"{r['agentloop_loop_lag_ms']:.2f} ms and {r['gateway_loop_lag_ms']:.2f} ms")
    print(f"  trajectories equal to the AgentLoop's: {r['trajectories_equal']} of {r['episodes']} episodes "
          f"({r['segments']} segments)")
    print(json.dumps(r))


if __name__ == "__main__":
    main()
