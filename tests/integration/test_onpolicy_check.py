"""`agentrl check onpolicy` and the on-policy gate against a planted chat-template mismatch.

The planted template renders a past assistant message with one extra space after its role line, so
a re-render of any conversation no longer gives the tokens the model sampled. Guards: the check's
(a) catches it and the command exits non-zero, while the same config with the right template
passes (a) and (b) with the trainer's logprobs within 1e-4 of the hf engine's (fp32 on CPU), and
(e): the hf engine in the check's process, after an in-memory push of the trainer's tensors, draws
the same ids with the same logprobs (within 1e-4) as the server process from the same seeded probes; a
healthy run trips nothing, and with the stop threshold at 100% the planted run trains on with every
sequence masked and the reason in each prompt's ledger line; and a real training run (`agentrl run`, hf engine, Ray trainer, `rollout.verify_template=true`) with the
planted template stops at its first step, non-zero, naming template re-tokenisation and the check
command, with its prompts closed as unfinished in the ledger.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def planted_template(tmp_path: Path) -> Path:
    from agentrl.models import TOOL_CHATML_TEMPLATE

    right = "{% if message.content %}{{ '\\n' }}{{ message.content }}{% endif %}{% for call"
    assert TOOL_CHATML_TEMPLATE.count(right) == 1
    path = tmp_path / "extra_space.jinja"
    path.write_text(TOOL_CHATML_TEMPLATE.replace(right, right.replace("}}{{ message", "}} {{ message")))
    return path


def base_args(assets: Path, template: str | Path) -> list[str]:
    return [
        "env=arithmetic", f"model.path={assets / 'tiny-random-qwen2'}", f"model.chat_template={template}",
        "inference.engine=hf", "trainer.device=cpu", "rollout.max_tokens_per_turn=12", "rollout.max_turns=1",
        "rollout.max_total_tokens=512",
    ]  # fmt: skip


def agentrl(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agentrl.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=1200, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_check_passes_the_right_template_and_fails_the_planted_one(tmp_path: Path, assets: Path) -> None:
    good = agentrl(["check", "onpolicy", *base_args(assets, "chatml-tools"), "--rows", "2", "--json", "--no-dtype"],
                   tmp_path)
    report = json.loads(good.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert good.returncode == 0 and report["passed"], good.stderr[-2000:]
    assert checks["template"]["status"] == "PASS" and checks["template"]["figures"]["mismatched"] == 0
    assert checks["rescore"]["status"] == "PASS" and checks["rescore"]["figures"]["max_gap"] < 1e-4
    assert checks["cache"]["status"] == "PASS" and checks["cache"]["figures"]["after"] != checks["cache"]["figures"]["before"]
    assert checks["kept_set"]["status"] == "SKIP"
    placement = checks["placement"]["figures"]
    assert checks["placement"]["status"] == "PASS" and placement["identical"] == placement["probes"] == 2
    assert placement["compared_tokens"] > 0 and placement["max_gap"] < 1e-4 and placement["pushed_tensors"] > 0
    served = checks["served"]["figures"]  # the check of a run's pushes, on the cache check's push
    assert checks["served"]["status"] == "PASS" and served["tol"] == 1e-3 and served["gap_max"] < 1e-4
    assert served["moved_tokens_min"] > 0 and served["moved_gap_max"] < 1e-4
    assert served["verify_s"] > 0 and served["load_s"] > 0 and served["pause_s"] >= 0

    bad = agentrl(["check", "onpolicy", *base_args(assets, planted_template(tmp_path)), "--rows", "2", "--no-dtype",
                   "--no-placement"], tmp_path)
    assert bad.returncode == 1, bad.stdout + bad.stderr[-2000:]
    assert "FAIL  (template) episodes=2 mismatched=2" in bad.stdout
    assert "PASS  (rescore)" in bad.stdout  # the ids are scored right; only the re-render differs
    assert "SKIP  (placement)" in bad.stdout and "--no-placement was given" in bad.stdout


def run_args(tmp_path: Path, name: str) -> list[str]:
    return ["rollout.verify_template=true", "data.prompts_per_step=2", "rollout.samples_per_prompt=2",
            "run.total_steps=2", "run.eval_every=0", "run.save_every=0", "data.num_val_rows=1", "eval.k=1",
            f"run.output_dir={tmp_path}", f"run.name={name}", "run.loggers=[jsonl]"]


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_a_healthy_run_trips_nothing_and_a_gated_sequence_reaches_the_ledger(tmp_path: Path, assets: Path) -> None:
    healthy = agentrl(["run", *base_args(assets, "chatml-tools"), *run_args(tmp_path, "healthy")], tmp_path)
    assert healthy.returncode == 0, healthy.stderr[-3000:]
    metrics = lines(tmp_path / "healthy" / "metrics.jsonl")
    assert [m["onpolicy/gated_sequences"] for m in metrics] == [0.0, 0.0]
    assert metrics[1]["onpolicy/out_of_window_tokens"] == 0.0 and metrics[1]["onpolicy/logprob_gap_max"] < 1e-4
    # The planted template with the stop threshold at 100%: the run goes on, every sequence masked.
    lenient = agentrl(["run", *base_args(assets, planted_template(tmp_path)), *run_args(tmp_path, "lenient"),
                       "algorithm.mismatch_gate.max_gated_share=1.0"], tmp_path)
    assert lenient.returncode == 0, lenient.stderr[-3000:]
    assert [m["onpolicy/gated_sequences/template"] for m in lines(tmp_path / "lenient" / "metrics.jsonl")] == [4.0, 4.0]
    trained = [e for e in lines(tmp_path / "lenient" / "ledger.jsonl") if e["status"] == "trained"]
    assert len(trained) == 4
    assert {e["reason"] for e in trained} == {"gated: 2 of 2 sequences masked out of the loss (template 2)"}


def test_the_gate_stops_a_run_whose_template_re_tokenises_differently(tmp_path: Path, assets: Path) -> None:
    run = agentrl(["run", *base_args(assets, planted_template(tmp_path)), *run_args(tmp_path, "planted")], tmp_path)
    assert run.returncode == 1, run.stderr[-3000:]
    assert "Step 0: 4 of 4 sequences (100%) failed the on-policy gate" in run.stderr
    assert "Likely cause: template re-tokenisation" in run.stderr
    assert f"agentrl check onpolicy {tmp_path / 'planted' / 'config.yaml'}" in run.stderr
    ledger = lines(tmp_path / "planted" / "ledger.jsonl")
    assert not [e for e in ledger if e["status"] == "trained"]
    assert {e["status"] for e in ledger if e["status"] != "taken"} == {"unfinished"}
