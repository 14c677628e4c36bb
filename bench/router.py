"""Router benchmarks: decision overhead at 10k live sessions, prefix-cache hit rate, p90 under skew.

    python bench/router.py            # all three, one run, ratios printed at the end
    python bench/router.py --quick    # smaller sizes, for a smoke test

1. Overhead. `Router.acquire` + `release` (one routing decision) with 10,000 live sessions on
   8 servers, timed one call at a time (p50/p99) against a bare `dict` lookup timed the same way,
   and as a share of a 50 ms turn. Also the whole async `Router.generate` path against calling an
   instant in-process server directly.
2. Prefix-cache hit rate on a synthetic multi-turn trace, simulated in virtual time (no sleeping):
   each server holds an LRU cache of session contexts (in tokens); a turn's cached tokens are the
   longest context of that session the chosen server still holds. Policies: the router (sticky,
   moves when overloaded), pure stickiness (the router with moving disabled), round-robin, and an
   oracle that always picks the server holding the longest cached prefix.
3. Skew: the same trace with one hot server (4x slower), comparing p90 episode latency of the
   router against pure stickiness.

Service model per server: `slots` requests run at once, the rest queue FIFO; a turn costs
`base + uncached_prompt_tokens * prefill + generated_tokens * decode`, times the server's slowness.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import random
import statistics
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from agentrl.inference.router import Router
from agentrl.types import Generation, SamplingParams


class NullServer:
    """An instant in-process server: the cost of routing is all that remains."""

    def __init__(self, server_id: str) -> None:
        self.server_id = server_id
        self._gen = Generation([1], [-0.1], "stop", 0, server_id)

    async def generate(self, prompt_ids, sampling, *, session_id, timeout_s=None):
        return self._gen

    async def aclose(self) -> None:
        pass


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# ── 1. overhead ─────────────────────────────────────────────────────────────────────────────
def bench_overhead(n_sessions: int, n_calls: int, service_ms: float) -> dict[str, float]:
    router = Router([NullServer(f"s{i}") for i in range(8)], health_interval_s=3600)
    sids = [f"session-{i}" for i in range(n_sessions)]
    for sid in sids:
        router.release(router.acquire(sid))
    table = {sid: i for i, sid in enumerate(sids)}
    rng = random.Random(0)
    picks = [rng.choice(sids) for _ in range(n_calls)]
    clock = time.perf_counter_ns

    route_ns, dict_ns = [], []
    acquire, release = router.acquire, router.release
    for sid in picks:
        t0 = clock()
        s = acquire(sid)
        release(s)
        route_ns.append(clock() - t0)
    for sid in picks:
        t0 = clock()
        table[sid]
        dict_ns.append(clock() - t0)
    t0 = clock()
    for sid in picks:
        release(acquire(sid))
    route_mean_ns = (clock() - t0) / n_calls

    async def end_to_end() -> tuple[list[float], list[float]]:
        direct = NullServer("d")
        sp = SamplingParams(max_tokens=1)
        via, raw = [], []
        for sid in picks[: n_calls // 4]:
            t = clock()
            await router.generate([1], sp, session_id=sid)
            via.append(clock() - t)
            t = clock()
            await direct.generate([1], sp, session_id=sid)
            raw.append(clock() - t)
        await router.aclose()
        return via, raw

    via, raw = asyncio.run(end_to_end())
    p50_ms = pct(route_ns, 0.5) / 1e6
    return {
        "sessions": router.num_sessions,
        "route_p50_ms": p50_ms,
        "route_p99_ms": pct(route_ns, 0.99) / 1e6,
        "route_mean_ms": route_mean_ns / 1e6,
        "dict_p50_ms": pct(dict_ns, 0.5) / 1e6,
        "route_pct_of_turn": 100 * p50_ms / service_ms,
        "generate_overhead_p50_ms": (pct(via, 0.5) - pct(raw, 0.5)) / 1e6,
    }


# ── 2 and 3. the simulated workload ─────────────────────────────────────────────────────────
@dataclass
class Trace:
    episodes: int = 256
    turns: int = 8
    prompt_tokens: int = 600
    gen_tokens: int = 100
    tool_tokens: int = 150
    tool_ms: float = 20.0
    start_spread_ms: float = 200.0
    seed: int = 0


@dataclass
class SimServer:
    slowness: float
    slots: int
    cache_tokens: int
    running: int = 0
    queue: list = field(default_factory=list)
    cache: OrderedDict = field(default_factory=OrderedDict)  # session -> cached context length
    cached_total: int = 0

    def lookup(self, sid: str, prompt_len: int) -> int:
        n = self.cache.get(sid, 0)
        if n:
            self.cache.move_to_end(sid)
        return min(n, prompt_len)

    def store(self, sid: str, length: int) -> None:
        self.cached_total += length - self.cache.pop(sid, 0)
        self.cache[sid] = length
        while self.cached_total > self.cache_tokens and self.cache:
            _, n = self.cache.popitem(last=False)
            self.cached_total -= n


def simulate(
    policy: str,
    trace: Trace,
    slowness: list[float],
    *,
    slots: int = 8,
    cache_tokens: int = 200_000,
    base_ms: float = 5.0,
    prefill_ms: float = 0.02,
    decode_ms: float = 0.3,
) -> dict[str, float]:
    rng = random.Random(trace.seed)
    servers = [SimServer(s, slots, cache_tokens) for s in slowness]
    router = None
    if policy in ("router", "sticky"):
        threshold = 2.0 if policy == "router" else float("inf")
        router = Router([NullServer(f"s{i}") for i in range(len(servers))], overload_threshold=threshold)
        index = {id(rs): i for i, rs in enumerate(router.servers)}
    rr = 0
    events: list = []  # (time_ms, seq, kind, payload)
    seq = 0

    def push(t: float, kind: str, payload: tuple) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, payload))

    ctx_len = {}
    started = {}
    latency = []
    prompt_total = hit_total = 0
    for e in range(trace.episodes):
        sid = f"ep{e}"
        ctx_len[sid] = trace.prompt_tokens
        t0 = rng.uniform(0, trace.start_spread_ms)
        started[sid] = t0
        push(t0, "turn", (sid, 0))

    def choose(sid: str) -> tuple[int, object]:
        nonlocal rr
        if router is not None:
            rs = router.acquire(sid)
            return index[id(rs)], rs
        if policy == "round_robin":
            rr += 1
            return rr % len(servers), None
        # oracle: the server holding the longest prefix of this session, else the least busy
        best = max(
            range(len(servers)),
            key=lambda i: (servers[i].cache.get(sid, 0), -servers[i].running - len(servers[i].queue)),
        )
        return best, None

    def start(i: int, job: tuple, now: float) -> None:
        nonlocal prompt_total, hit_total
        sid, turn, handle = job
        srv = servers[i]
        srv.running += 1
        prompt = ctx_len[sid]
        hit = srv.lookup(sid, prompt)
        prompt_total += prompt
        hit_total += hit
        cost = srv.slowness * (base_ms + (prompt - hit) * prefill_ms + trace.gen_tokens * decode_ms)
        push(now + cost, "done", (i, sid, turn, handle))

    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "turn":
            sid, turn = payload
            i, handle = choose(sid)
            job = (sid, turn, handle)
            if servers[i].running < servers[i].slots:
                start(i, job, now)
            else:
                servers[i].queue.append(job)
        else:
            i, sid, turn, handle = payload
            srv = servers[i]
            srv.running -= 1
            if router is not None:
                router.release(handle)
            ctx_len[sid] += trace.gen_tokens
            srv.store(sid, ctx_len[sid])
            if srv.queue:
                start(i, srv.queue.pop(0), now)
            if turn + 1 < trace.turns:
                ctx_len[sid] += trace.tool_tokens
                push(now + rng.expovariate(1 / trace.tool_ms), "turn", (sid, turn + 1))
            else:
                latency.append(now - started[sid])
    out = {
        "hit_rate": hit_total / prompt_total,
        "p50_episode_ms": statistics.median(latency),
        "p90_episode_ms": pct(latency, 0.9),
    }
    if router is not None:
        out["moves"] = router.counters["moves"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    args = ap.parse_args()
    n_sessions, n_calls = (2_000, 20_000) if args.quick else (10_000, 200_000)
    trace = Trace(episodes=64 if args.quick else 256)

    print(f"== 1. routing overhead: {n_sessions} live sessions, 8 servers, {n_calls} decisions")
    o = bench_overhead(n_sessions, n_calls, service_ms=50.0)
    print(
        f"router acquire+release  p50 {o['route_p50_ms'] * 1e3:.2f} us   p99 {o['route_p99_ms'] * 1e3:.2f} us   "
        f"mean (batched) {o['route_mean_ms'] * 1e3:.2f} us"
    )
    print(f"bare dict lookup        p50 {o['dict_p50_ms'] * 1e3:.2f} us   (same per-call timer)")
    print(
        f"async Router.generate overhead over calling the server directly: p50 {o['generate_overhead_p50_ms'] * 1e3:.1f} us"
    )

    balanced = [1.0] * 4
    skewed = [4.0, 1.0, 1.0, 1.0]
    print(
        f"\n== 2. prefix-cache hit rate: {trace.episodes} episodes x {trace.turns} turns, 4 servers, balanced"
    )
    bal = {p: simulate(p, trace, balanced) for p in ("router", "sticky", "round_robin", "oracle")}
    for p, r in bal.items():
        print(
            f"{p:12s} hit rate {r['hit_rate']:.3f}   p90 episode {r['p90_episode_ms']:.0f} ms   moves {r.get('moves', '-')}"
        )

    tight = 120_000
    print(f"\n== 2b. same, but each server caches only {tight} tokens (below the live working set, so LRU evicts)")
    bal_t = {
        p: simulate(p, trace, balanced, cache_tokens=tight)
        for p in ("router", "sticky", "round_robin", "oracle")
    }
    for p, r in bal_t.items():
        print(
            f"{p:12s} hit rate {r['hit_rate']:.3f}   p90 episode {r['p90_episode_ms']:.0f} ms   moves {r.get('moves', '-')}"
        )

    print("\n== 3. skew: server 0 is 4x slower")
    skw = {p: simulate(p, trace, skewed) for p in ("router", "sticky", "round_robin", "oracle")}
    for p, r in skw.items():
        print(
            f"{p:12s} hit rate {r['hit_rate']:.3f}   p50 episode {r['p50_episode_ms']:.0f} ms   "
            f"p90 episode {r['p90_episode_ms']:.0f} ms   moves {r.get('moves', '-')}"
        )

    print("\n== ratios (targets in brackets)")
    print(
        f"routing p50: {o['route_p50_ms']:.4f} ms [< 0.2 ms]; {o['route_pct_of_turn']:.3f}% of a 50 ms turn [< 1%]; "
        f"{o['route_p50_ms'] / max(o['dict_p50_ms'], 1e-9):.1f}x a dict lookup"
    )
    print(
        f"sticky / oracle hit rate (balanced): {bal['sticky']['hit_rate'] / bal['oracle']['hit_rate']:.3f} [>= 0.9]; "
        f"router / oracle: {bal['router']['hit_rate'] / bal['oracle']['hit_rate']:.3f}; "
        f"round-robin / oracle: {bal['round_robin']['hit_rate'] / bal['oracle']['hit_rate']:.3f}"
    )
    print(
        f"sticky / oracle hit rate (tight cache): {bal_t['sticky']['hit_rate'] / bal_t['oracle']['hit_rate']:.3f} [>= 0.9]; "
        f"round-robin / oracle: {bal_t['round_robin']['hit_rate'] / bal_t['oracle']['hit_rate']:.3f}"
    )
    print(
        f"p90 episode under skew, router / pure stickiness: "
        f"{skw['router']['p90_episode_ms'] / skw['sticky']['p90_episode_ms']:.3f} [< 1]; "
        f"router hit rate under skew {skw['router']['hit_rate']:.3f} vs sticky {skw['sticky']['hit_rate']:.3f}"
    )


if __name__ == "__main__":
    main()
