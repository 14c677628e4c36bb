"""`agentrl sft` and `agentrl dpo` on the tiny random Qwen2: they train through the FSDP2 backend, write what
a run writes, resume exactly, and leave a policy directory that `agentrl run model.path=...` takes.

The commands are docs/preferences.md's, run in this process (`agentrl.cli.main`) from the repository (the
example rows are its files) with the tiny model and a few steps appended, and the run directory in a
scratch folder."""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest

from agentrl.cli import main

REPO = Path(__file__).resolve().parents[2]
TINY = Path("/work/shared/assets/tiny-random-qwen2")
PAGE = REPO / "docs" / "preferences.md"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not TINY.is_dir(), reason="tiny Qwen2 not found in shared assets"),
]


def page_command(start: str) -> list[str]:
    """The arguments of the page's one command line that starts with `start` (after `agentrl`)."""
    lines = [ln.strip() for block in re.findall(r"```bash\n(.*?)```", PAGE.read_text(), re.S)
             for ln in block.splitlines() if ln.strip().startswith(start)]
    assert len(lines) == 1, f"docs/preferences.md should show one `{start}` command, shows {lines}"
    return shlex.split(lines[0])[1:]


def sized(tmp_path: Path, steps: int, *extra: str) -> list[str]:
    return [f"model.path={TINY}", f"run.total_steps={steps}", "data.prompts_per_step=4", "trainer.lr=1e-3",
            "trainer.device=cpu", f"run.output_dir={tmp_path}", "run.loggers=[jsonl]", *extra]


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_sft_trains_the_assistant_tokens_and_writes_a_policy_agentrl_run_starts_from(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main([*page_command("agentrl sft"), *sized(tmp_path, 3)]) == 0
    run_dir = tmp_path / "sft-demo"
    evals = lines(run_dir / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 3]
    assert evals[0]["rows"] == 4 and evals[0]["tokens"] > 0
    assert evals[1]["nll"] < evals[0]["nll"] - 0.1  # the held-out assistant tokens got likelier
    steps = lines(run_dir / "metrics.jsonl")
    assert [s["step"] for s in steps] == [0, 1, 2]
    assert all(s["batch/rows"] == 4 and s["actor/updates"] == 1 for s in steps)
    # each step's rows, as `agentrl view` shows them: the assistant's turns are the sampled (trained) tokens
    shown = lines(run_dir / "rollouts" / "step-000001.jsonl")
    assert len(shown) == 4 and all(r["trained"] and r["status"] == "trained" for r in shown)
    sampled = [seg["text"] for seg in shown[0]["segments"] if seg["origin"] == "sampled"]
    assert len(sampled) == 2 and sampled[0].startswith("<tool_call>") and sampled[1].startswith("The answer is")
    assert [seg["origin"] for seg in shown[0]["segments"]] == ["prompt", "sampled", "template", "tool", "template",
                                                               "sampled"]
    weights = run_dir / "weights" / "version-00000003"
    assert (weights / "config.json").is_file() and (weights / "tokenizer_config.json").is_file()
    # The directory holds the trained policy: a plain transformers load scores the held-out rows as the run did.
    import torch
    from transformers import AutoModelForCausalLM

    from agentrl.chat import ChatTemplate
    from agentrl.offline_rows import load_demonstrations
    from agentrl.trainer.offline_losses import sft_loss
    from agentrl.trainer.packing import pad_trajectories

    rows = load_demonstrations([REPO / "examples/data/demonstrations_val.jsonl"], ChatTemplate.from_pretrained(weights))
    layout = pad_trajectories(rows.examples)
    model = AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=layout.input_ids, attention_mask=layout.attention_mask).logits.float()
    logprobs = torch.log_softmax(logits, -1).gather(-1, layout.labels[..., None])[..., 0]
    assert float(sft_loss(logprobs.double(), layout.loss_mask.double())[0]) == pytest.approx(evals[1]["nll"], abs=1e-3)
    # ... and `agentrl run` builds its job on it (what it does before starting anything)
    assert main(["validate", "env=arithmetic", f"model.path={weights}"]) == 0


def test_dpo_raises_the_held_out_margin_and_resumes_exactly(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    args = page_command("agentrl dpo")
    assert main([*args, *sized(tmp_path, 3, "run.save_every=1", "run.keep_checkpoints=0")]) == 0
    run_dir = tmp_path / "dpo-demo"
    evals = lines(run_dir / "eval.jsonl")
    assert evals[0]["loss"] == pytest.approx(0.693147, abs=1e-5)  # at the reference: log 2
    assert evals[0]["margin"] == pytest.approx(0.0, abs=1e-6)
    assert evals[-1]["margin"] > 0.1 and evals[-1]["logp_margin"] > evals[0]["logp_margin"]
    first = lines(run_dir / "metrics.jsonl")
    assert first[0]["prefs/loss"] == pytest.approx(0.693147, abs=1e-4) and first[-1]["prefs/loss"] < 0.6
    reference = lines(run_dir / "reference_logprobs.jsonl")
    assert [r["split"] for r in reference] == ["train"] * 16 + ["val"] * 4
    # Resume from the checkpoint after step 1: steps 2 and 3 come out as they did the first time.
    for later in ("step-000002", "step-000003"):
        shutil.rmtree(run_dir / "checkpoints" / later)
    (run_dir / "checkpoints" / "latest").write_text("step-000001")
    assert main([*args, *sized(tmp_path, 3, "run.save_every=1", "run.keep_checkpoints=0", "resume=true")]) == 0
    again = lines(run_dir / "metrics.jsonl")
    assert [r["step"] for r in again] == [0, 1, 2]
    for key in ("prefs/loss", "prefs/margin", "actor/grad_norm"):
        assert [r[key] for r in again[1:]] == pytest.approx([r[key] for r in first[1:]], abs=1e-6), key
    assert lines(run_dir / "reference_logprobs.jsonl") == reference
    assert main(["plot", str(run_dir)]) == 0
    assert (run_dir / "plots" / "preference_margin.png").is_file()
    assert (run_dir / "plots" / "supervised_loss.png").is_file()


def test_ipo_and_length_normalised_dpo_run_from_the_same_command(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    for objective, at_reference in (("ipo", (1 / (2 * 0.1)) ** 2), ("dpo_norm", 0.693147)):
        extra = sized(tmp_path, 1, f"algorithm.objective={objective}", f"run.name={objective}")
        assert main([*page_command("agentrl dpo"), *extra]) == 0
        evals = lines(tmp_path / objective / "eval.jsonl")
        assert evals[0]["loss"] == pytest.approx(at_reference, rel=1e-5)
