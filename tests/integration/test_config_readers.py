"""Every config field has a reader: a knob that does nothing is a bug.

Real `agentrl run` and `agentrl eval` commands run with `AGENTRL_CONFIG_TRACE` set, which makes
every process they start (the driver, the trainer actors) record each config field it reads. The
union over a few short runs that take the code's branches (sync and async modes, GRPO and GAE with
a critic, LoRA, a KL controller, resume, a server the run starts and servers it is given, an
evaluation of a code-running env on dataset files, and a cluster plan validated on the namespace
cluster) must cover every field of `AgentRLConfig`, except the few in `ONLY_ELSEWHERE`, each
with the reason it is not read on a CPU machine's run or eval path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.config import config_fields

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data" / "verl"

# Fields that no run or eval on this CPU machine reads, and why. Keep it short: every entry is a
# knob a CPU user could set and see nothing happen.
ONLY_ELSEWHERE: dict[str, str] = {
    "algorithm.beta": "read by the preference objectives only (`agentrl dpo`), which `agentrl run` refuses; "
                      "tests/integration/test_offline_training.py runs them",
    "rollout.gateway_max_request_mb": "read by the agent gateway on each request (env=agent, `agentrl gateway`), "
                                      "which these runs do not start; tests/unit/test_gateway_limits.py checks it",
}


def _section_names(model: type | None = None, prefix: str = "") -> dict[str, str]:
    """Section class name -> dotted section key as `config_fields` names it (`RolloutConfig` ->
    `rollout`; nested sections too: `TrainerResourcesConfig` -> `cluster.trainer`, the optional
    `JudgeConfig` -> `reward.judge`, the listed `RewardPartConfig` -> `reward.combine[]`)."""
    from agentrl.config import AgentRLConfig, _section_of

    out: dict[str, str] = {}
    for name, field in (model or AgentRLConfig).model_fields.items():  # type: ignore[attr-defined]
        section = _section_of(field.annotation)
        if section is not None:
            sub, how = section
            key = f"{prefix}{name}" + ("[]" if how == "list" else "")
            out[sub.__name__] = key
            out.update(_section_names(sub, f"{key}."))
    return out


def _tiny_reward_model(source: Path, out: Path) -> None:
    """A random `AutoModelForSequenceClassification` with the tiny Qwen2's config and tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    config = AutoConfig.from_pretrained(source, num_labels=1)
    config.pad_token_id = config.eos_token_id
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(config, dtype=torch.float32).save_pretrained(out)
    AutoTokenizer.from_pretrained(source).save_pretrained(out)


def _run(args: list[str], trace: Path, cwd: Path) -> None:
    env = {**os.environ, "AGENTRL_CONFIG_TRACE": str(trace),
           "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "e2e"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "agentrl.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, f"agentrl {' '.join(args)} failed:\n{done.stderr[-3000:]}"


def test_every_config_field_is_read_by_run_or_eval(tmp_path: Path, vllm_server, assets: Path, ns_cluster) -> None:
    tiny = str(assets / "tiny-random-qwen2")
    trace = tmp_path / "reads.txt"
    common = [
        "env=parity_env:ParityEnv", f"model.path={tiny}", "model.chat_template=chatml-tools",
        "data.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_tokens_per_turn=8",
        "rollout.max_turns=1", "rollout.max_total_tokens=128", "trainer.device=cpu", "data.num_val_rows=2",
        "eval.k=1", f"run.output_dir={tmp_path / 'runs'}", "rollout.extra_stop_token_ids=[0,10,20]",
    ]  # fmt: skip
    # A: sync GRPO with a KL controller and shaping, on a server the run starts, distilling a teacher the run
    # serves beside the reward; then resumed (on the shared one).
    sync = [*common, "run.name=sync", "inference.max_model_len=256", "inference.cpu_kv_cache_gb=0.25",
            f"distill.teacher.model_path={tiny}", "distill.teacher.engine=hf", "distill.teacher.startup_timeout_s=600",
            "distill.teacher.timeout_s=120", "distill.mode=mixed", "distill.coef=0.5",
            "algorithm.kl_coef=0.01", "algorithm.kl_target=0.05", "algorithm.rollout_is=icepop",
            "algorithm.overlong_buffer_tokens=2", "algorithm.stop_properly_penalty=0.5",
            "run.save_every=1", "run.eval_every=1", "run.loggers=[console,jsonl,tensorboard]"]
    _run(["run", *sync, "run.total_steps=1"], trace, tmp_path)
    # (the resume reads what only a resume reads; it needs no server of its own: the shared one serves it)
    _run(["run", *sync, "run.total_steps=2", "resume=true", f"inference.urls=[{vllm_server.url}]"], trace, tmp_path)
    # B: async GAE with a critic and LoRA on the shared server.
    _run(["run", *common, "run.name=async", f"inference.urls=[{vllm_server.url}]", "run.mode=async",
          "run.partial_rollout=true", "run.max_staleness=2", "algorithm.advantage=gae", "trainer.lora_rank=4",
          "run.total_steps=2", "run.eval_every=0"], trace, tmp_path)
    # C: an offline evaluation of an env that runs code (the run's sandbox and tool deadline reach
    # it) on dataset files (read with data.skip_bad_rows).
    # (retool's prompt, with its worked examples, is about 265 tokens: it needs a larger budget than
    # the parity runs' 128, or pre-flight refuses every row as too long.)
    _run(["eval", *common, "env=retool", "rollout.max_total_tokens=640", f"inference.urls=[{vllm_server.url}]",
          "eval.max_rows=2",
          f"data.val_files=[{DATA / 'gsm8k.jsonl'}]", "data.skip_bad_rows=true", "rollout.tool_timeout_s=20",
          "sandbox.kwargs.pool_size=1", f"eval.output_dir={tmp_path / 'eval'}"], trace, tmp_path)

    # D: a cluster plan, validated on the namespace cluster (tests/cluster_hosts.py): every `cluster` key.
    # Its rows come from a file with a malformed row, kept out by data.skip_bad_rows.
    inside = "/tmp/work/reads-cluster.txt"
    good = {"prompt": [{"role": "user", "content": "What is 1 + 1?"}], "data_source": "gsm8k",
            "reward_model": {"style": "rule", "ground_truth": "2"}}
    ns_cluster.head.write("/tmp/work/rows.jsonl", json.dumps(good) + "\n" + json.dumps({"prompt": 5}) + "\n")
    ns_cluster.head.run([
        sys.executable, "-m", "agentrl.cli", "validate", "env=retool", f"model.path={tiny}",
        "model.chat_template=chatml-tools", "inference.engine=hf", "trainer.device=cpu",
        f"cluster.address={ns_cluster.address}", "cluster.strategy=SPREAD", "cluster.trainer.cpus=1",
        "cluster.trainer.memory_gb=0.5", "cluster.server.cpus=1", "cluster.server.gpus=0",
        "cluster.sandbox_hosts=1", "cluster.sandbox_cpus=0.5", "data.train_files=[/tmp/work/rows.jsonl]",
        "data.skip_bad_rows=true",
    ], env={"AGENTRL_CONFIG_TRACE": inside}, timeout=600)  # fmt: skip
    with trace.open("a") as f:
        f.write(ns_cluster.head.run(["cat", inside]).stdout)

    # E: a reward made of a judge the run serves and a reward model, combined: validating it builds
    # both sources (the judge's and the reward model's every key), without starting either.
    rm = tmp_path / "tiny-rm"
    _tiny_reward_model(assets / "tiny-random-qwen2", rm)
    _run(["validate", *common, "env=arithmetic", "inference.engine=hf", f"reward.judge.model_path={tiny}",
          "reward.judge.engine=hf", f"reward.model.path={rm}", "reward.combine=[{source: judge, weight: 0.5}, {source: model, weight: 0.5}]"],
         trace, tmp_path)

    sections = _section_names()
    read = set()
    for line in trace.read_text().splitlines():
        cls, _, field = line.partition(".")
        if cls == "AgentRLConfig":  # a top-level key (`placement`)
            read.add(field)
        elif cls in sections:
            read.add(f"{sections[cls]}.{field}")
    every = {dotted for dotted, *_ in config_fields()}
    unread = sorted(every - read - set(ONLY_ELSEWHERE))
    assert not unread, f"config fields nothing reads on the run/eval paths (wire them or remove them): {unread}"
    stale = sorted(set(ONLY_ELSEWHERE) - every)
    assert not stale, f"ONLY_ELSEWHERE names fields that no longer exist: {stale}"
