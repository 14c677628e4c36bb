"""The on-policy check's GPU column: the trainer (FSDP2) and the hf engine on CUDA, bf16 and fp32.

Runs `agentrl check onpolicy` (the same code as on CPU) with `trainer.device=cuda`, the hf engine's
model on the GPU (`AGENTRL_HF_DEVICE=cuda`) and `model.dtype` bfloat16, then float32, on the tiny
random Qwen2, and writes each report as JSON plus a markdown table into `--out` (default `$OUT` or
`gpu-onpolicy/`). Meant for a machine with one GPU, no network and no vLLM, where agentrl is carried
as source: it maps `envs/`, `tools/`, `sandboxes/` and `configs/` into the `agentrl` package the way
pyproject's package-dir does (a folder of links, first on `sys.path`), so nothing is installed. It
first lists which of agentrl's dependencies import; without them the check cannot run, and it says
which are missing and exits 3 instead of reporting anything it did not measure.

    python bench/onpolicy_gpu.py --assets /path/to/assets            # scripts/gpu_onpolicy.sh wraps it

It has not run on a GPU yet (docs/onpolicy.md); `--device cpu` is its dry run here.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NEEDED = ("torch", "transformers", "pydantic", "yaml", "httpx", "fastapi", "uvicorn", "jinja2", "gymnasium",
          "safetensors", "numpy")
PLUGIN_FOLDERS = ("envs", "tools", "sandboxes", "configs")
SAMPLINGS = {
    "t1.0": ("rollout.temperature=1.0",),
    "t0.7-p0.9-k20": ("rollout.temperature=0.7", "rollout.top_p=0.9", "rollout.top_k=20"),
}
"""Sampling settings per dtype: plain sampling, and a kept set the trainer must replay."""


def where(torch, device: str) -> str:
    """The device, torch and transformers versions the figures were measured with."""
    import transformers

    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    return f"{name}, torch {torch.__version__}, transformers {transformers.__version__}"


def source_tree(root: Path) -> Path:
    """A folder `root/agentrl` of links: every entry of the repo's agentrl/ plus the plugin folders,
    as installed; returns `root` (to put first on PYTHONPATH)."""
    pkg = root / "agentrl"
    pkg.mkdir(parents=True, exist_ok=True)
    for entry in (REPO / "agentrl").iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry)
    for name in PLUGIN_FOLDERS:
        (pkg / name).symlink_to(REPO / name)
    return root


def missing_modules() -> list[str]:
    out = []
    for name in NEEDED:
        try:
            importlib.import_module(name)
        except ImportError:
            out.append(name)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--assets", default=os.environ.get("AGENTRL_ASSETS", str(REPO / "shared" / "assets")))
    p.add_argument("--out", default=os.environ.get("OUT", "gpu-onpolicy"))
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--timeout", type=float, default=200.0, help="seconds per dtype")
    p.add_argument("--trainer-bench", action="store_true",
                   help="then bench/trainer.py on the tiny model (FSDP2 update_policy's memory per token on the device)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: a dry run of this same script where no GPU is (its figures are the CPU column's)")
    ns = p.parse_args(argv)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    missing = missing_modules()
    (out / "imports.json").write_text(json.dumps({"needed": NEEDED, "missing": missing}))
    if missing:
        print(f"cannot run the check here: {', '.join(missing)} do not import (agentrl needs them; carry wheels "
              "for them and put them on PYTHONPATH). Nothing was measured.", file=sys.stderr)
        return 3
    import torch

    if ns.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: this script measures the GPU column only; run `agentrl check onpolicy` on CPU.",
              file=sys.stderr)
        return 3
    tiny = Path(ns.assets) / "tiny-random-qwen2"
    rows = []
    with tempfile.TemporaryDirectory(prefix="agentrl-src-") as tmp:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(source_tree(Path(tmp))), os.environ.get("PYTHONPATH")])), "AGENTRL_HF_DEVICE": ns.device,
               "AGENTRL_ASSETS": str(ns.assets)}
        for dtype in ("bfloat16", "float32"):
            for sampling, overrides in SAMPLINGS.items():
                name = f"{dtype}-{sampling}"
                args = ["env=arithmetic", f"model.path={tiny}", "model.chat_template=chatml-tools",
                        "inference.engine=hf", f"trainer.device={ns.device}", f"model.dtype={dtype}",
                        "rollout.max_tokens_per_turn=32", "rollout.max_turns=1", "rollout.max_total_tokens=512",
                        *overrides]
                started = time.monotonic()
                try:
                    done = subprocess.run([sys.executable, "-m", "agentrl.cli", "check", "onpolicy", *args, "--rows",
                                           str(ns.rows), "--json"], capture_output=True, text=True, env=env,
                                          timeout=ns.timeout, cwd=tmp)
                except subprocess.TimeoutExpired:
                    rows.append((dtype, sampling, None, f"timed out after {ns.timeout:.0f} s"))
                    continue
                (out / f"check-{name}.stderr.txt").write_text(done.stderr[-20000:])
                try:
                    report = json.loads(done.stdout)
                except json.JSONDecodeError:
                    rows.append((dtype, sampling, None, (done.stderr.strip().splitlines() or ["no output"])[-1][:300]))
                    continue
                report["wall_s"] = round(time.monotonic() - started, 1)
                (out / f"check-{name}.json").write_text(json.dumps(report, indent=2))
                rows.append((dtype, sampling, report, ""))
        if ns.trainer_bench:
            bench = subprocess.run([sys.executable, str(REPO / "bench" / "trainer.py"), "--prefix-model", "tiny",
                                    "--repeats", "1"], capture_output=True, text=True, env=env, timeout=ns.timeout,
                                   cwd=tmp)
            (out / "trainer_bench.txt").write_text(f"exit {bench.returncode}\n{bench.stdout}\n{bench.stderr[-8000:]}")
    lines = [f"device: {where(torch, ns.device)}", "",
             "| dtype | sampling | check | status | figures |", "|---|---|---|---|---|"]
    for dtype, sampling, report, error in rows:
        if report is None:
            lines.append(f"| {dtype} | {sampling} | - | ERROR | {error} |")
            continue
        for c in report["checks"]:
            figures = " ".join(f"{k}={v:.3g}" for k, v in c["figures"].items())
            lines.append(f"| {dtype} | {sampling} | {c['name']} | {c['status']} | {figures} |")
    table = "\n".join(lines) + "\n"
    (out / "gpu_onpolicy.md").write_text(table)
    sys.stdout.write(table)
    return 0 if all(r is not None and r["passed"] for _d, _s, r, _e in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
