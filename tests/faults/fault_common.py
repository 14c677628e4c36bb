"""What the fault-injection tests share besides fixtures: the cheap run config, the ledger checks,
and the process checks (nothing left running). Imported by name (`from fault_common import ...`):
a module called `conftest` would be another directory's conftest when the whole suite runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
E2E = HERE.parent / "e2e"
for folder in (HERE, E2E):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from fault_parts import descendants  # noqa: E402

STOP_IDS = list(range(0, 151_000, 10))  # a random model rarely ends a turn by itself: one id in ten does
OWN_SERVER = "--max-model-len 1024"  # on the command line of vLLM servers a run starts itself
HF_SERVER = "agentrl.inference.hf_server"  # on the command line of hf servers (the session's server is vLLM)


def shutdown_ray() -> None:
    """End this process's Ray (a test that starts `agentrl run` as a process wants the machine to itself)."""
    import ray

    ray.shutdown()


def overrides(tmp_path: Path, name: str, assets: Path, *extra: str, url: str | None = None) -> list[str]:
    """A cheap run: tiny random Qwen2, ParityEnv-like envs, 3 prompts x 2 samples, one turn."""
    server = [f"inference.urls=[{url}]"] if url else [
        "inference.max_model_len=1024", "inference.cpu_kv_cache_gb=0.25", "inference.startup_timeout_s=900"]
    return [
        "env=parity_env:ParityEnv", f"model.path={assets / 'tiny-random-qwen2'}", "model.chat_template=chatml-tools",
        *server, "data.prompts_per_step=3", "rollout.samples_per_prompt=2", "rollout.max_tokens_per_turn=8",
        "rollout.max_turns=1", "rollout.max_total_tokens=256", "rollout.temperature=1.0",
        "rollout.request_timeout_s=1500", "rollout.episode_timeout_s=1800", "trainer.lr=1e-3", "trainer.device=cpu",
        f"run.output_dir={tmp_path}", f"run.name={name}", "run.eval_every=0", "data.num_val_rows=1", "eval.k=1",
        "run.save_every=1", "run.loggers=[jsonl]", f"rollout.extra_stop_token_ids={STOP_IDS}", *extra,
    ]  # fmt: skip


def placed(placement: str, shared_url: str) -> tuple[list[str], str | None]:
    """(overrides, server URL) of a run in `placement`: split shares the session's vLLM server;
    colocated starts its own engine inside the trainer actor, so it cannot share one."""
    if placement == "colocated":
        return ["placement=colocated"], None
    return [], shared_url


def make_config(tmp_path: Path, name: str, assets: Path, *extra: str, url: str | None = None) -> Any:
    from agentrl.config import load_config

    return load_config(None, overrides(tmp_path, name, assets, *extra, url=url))


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def check_books(run_dir: Path) -> dict[str, int]:
    """The journal balances: every attempt any session took has exactly one final state."""
    from agentrl.orchestration.ledger import journal_balance

    return journal_balance(run_dir / "ledger.jsonl")


def trained_by_step(run_dir: Path) -> dict[int, list[str]]:
    """Which rows the run's lineage trained at each step (the last session to train a step wins)."""
    out: dict[int, tuple[int, list[str]]] = {}
    for e in lines(run_dir / "ledger.jsonl"):
        if e["status"] == "trained":
            session, uids = out.get(e["step"], (-1, []))
            if e.get("session", 0) > session:
                session, uids = e.get("session", 0), []
            out[e["step"]] = (session, [*uids, e["uid"]])
    return {step: sorted(uids) for step, (_, uids) in sorted(out.items())}


def wait_until_gone(procs: list[Any], timeout_s: float = 60.0) -> list[str]:
    """Wait for `procs` (psutil) to end; return the command lines of those still running."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = []
        for p in procs:
            try:
                if p.is_running() and p.status() != "zombie":
                    left.append(" ".join(p.cmdline())[:150])
            except Exception:  # gone while we looked
                continue
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def procs_matching(text: str) -> list[Any]:
    """Our descendants whose command line contains `text`."""
    out = []
    for p in descendants():
        try:
            if text in " ".join(p.cmdline()):
                out.append(p)
        except Exception:  # gone while we looked
            continue
    return out


def own_servers_left(marker: str = OWN_SERVER) -> list[str]:
    """Servers (and their lifelines) that a run of this process started and left behind: our
    descendants whose command line contains `marker` (`OWN_SERVER` for vLLM, `HF_SERVER` for hf)."""
    out = []
    for p in descendants():
        try:
            line = " ".join(p.cmdline())
        except Exception:
            continue
        if marker in line and p.status() != "zombie":
            out.append(line[:150])
    return out


def start_cli(tmp_path: Path, args: list[str]) -> subprocess.Popen[str]:
    """`agentrl run ARGS` as a process of its own in `tmp_path`, with the fault tests' envs importable."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(E2E), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen(
        [sys.executable, "-c", "import sys; from agentrl.cli import main; sys.exit(main())", "run", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
    )
