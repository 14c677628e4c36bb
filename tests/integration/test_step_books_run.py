"""A real run's books: the step's loss tokens are its trained episodes' sampled tokens less the masked ones.

`agentrl run env=agent` (hf engine, the tiny random Qwen2, one step) with an agent that makes three
calls: the second continues the first's conversation, the third rewrites it, so every episode comes
in two segments. The chat template is planted so that a re-render of a past assistant message
differs (`rollout.verify_template=true`): the first segment of an episode trips the on-policy gate
(`template`) unless its first answer began with a space, which the planted space then restores
(each one does with about a third's chance, so eight episodes all passing is not to be expected);
the rewritten second one never does. ICEPOP with a cap of 1 + 1e-7 masks the tokens where the
engine's and the trainer's logprobs differ at all (about half of them here). Guards: `batch/loss_tokens` equals the
sampled tokens of the episodes the rollout file marks as trained less the masked ones it records
per episode, cause by cause as the metrics count them, and the gated segments are the first ones.
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

AGENT = '''
import openai

async def solve(task):
    client = openai.AsyncOpenAI(base_url=task.base_url, api_key=task.api_key)
    messages = list(task.messages)
    first = await client.chat.completions.create(model=task.model, messages=messages)
    messages += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                 {"role": "user", "content": "Check it."}]
    second = await client.chat.completions.create(model=task.model, messages=messages)
    notes = [task.messages[-1], {"role": "user", "content": "Notes: " + (second.choices[0].message.content or "")[:20]}]
    third = await client.chat.completions.create(model=task.model, messages=notes)
    return third.choices[0].message.content
'''


def planted_template(tmp_path: Path) -> Path:
    """ChatML with tools, but a past assistant message's content after one extra space."""
    from agentrl.models import TOOL_CHATML_TEMPLATE

    right = "{% if message.content %}{{ '\\n' }}{{ message.content }}{% endif %}{% for call"
    assert TOOL_CHATML_TEMPLATE.count(right) == 1
    path = tmp_path / "extra_space.jinja"
    path.write_text(TOOL_CHATML_TEMPLATE.replace(right, right.replace("}}{{ message", "}} {{ message")))
    return path


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_a_steps_loss_tokens_are_its_trained_sampled_tokens_less_the_masked_ones(tmp_path: Path, assets: Path) -> None:
    (tmp_path / "seg_agent.py").write_text(AGENT)
    rows = [{"data_source": "agentrl/arithmetic", "prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
             "reward_model": {"style": "rule", "ground_truth": str(a + b)}} for a, b in ((2, 3), (4, 5))]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = [
        "run", "env=agent", "env.kwargs.agent=seg_agent.py:solve", "data.train_files=[train.jsonl]",
        f"model.path={assets / 'tiny-random-qwen2'}", f"model.chat_template={planted_template(tmp_path)}",
        "inference.engine=hf", "trainer.device=cpu", "rollout.verify_template=true", "rollout.max_turns=3",
        "rollout.max_tokens_per_turn=8", "rollout.max_total_tokens=512", "data.prompts_per_step=2",
        "rollout.samples_per_prompt=4", "run.total_steps=1", "run.eval_every=0", "run.save_every=0",
        "data.num_val_rows=1", "eval.k=1", "run.keep_rollouts=all", "algorithm.rollout_is=icepop",
        "algorithm.rollout_is_cap=1.0000001", "algorithm.mismatch_gate.max_gated_share=1.0",
        f"run.output_dir={tmp_path}", "run.name=books", "run.loggers=[jsonl]",
    ]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "agentrl.cli", *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=1200, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    (step,) = [m for m in lines(tmp_path / "books" / "metrics.jsonl") if "batch/loss_tokens" in m]
    records = [r for r in lines(tmp_path / "books" / "rollouts" / "step-000001.jsonl") if r["trained"]]
    assert len(records) == 16 and {(r["segment"]["index"], r["segment"]["of"]) for r in records} == {(0, 2), (1, 2)}

    # The file's books, episode by episode and summed, against the step's metrics.
    for r in records:
        assert r["loss_tokens"] + sum(r["masked_tokens"].values()) == r["num_sampled"], r["episode_id"]
    sampled = sum(r["num_sampled"] for r in records)
    masked = {cause: sum(r["masked_tokens"].get(cause, 0) for r in records)
              for cause in ("unpredicted", "kept_set_overflow", "rollout_is", "gate")}  # fmt: skip
    assert step["batch/sampled_tokens"] == sampled
    assert {c: step[f"batch/masked_tokens/{c}"] for c in masked} == {c: float(n) for c, n in masked.items()}
    assert step["batch/loss_tokens"] == sum(r["loss_tokens"] for r in records) == sampled - sum(masked.values())

    # Gated rows: the segments whose re-render differed (first ones, after their second call), never a
    # rewritten one; and nothing else.
    gated = [r for r in records if r["metrics"]["template_mismatch"] > 0]
    assert gated and all(r["segment"]["index"] == 0 for r in gated)
    assert step["onpolicy/gated_sequences/template"] == step["onpolicy/gated_sequences"] == len(gated)
    for r in records:
        books = r["masked_tokens"]
        if r in gated:
            assert r["loss_tokens"] == 0 and books["gate"] + books.get("rollout_is", 0) == r["num_sampled"]
        else:
            assert "gate" not in books
    print(f"books: {sampled} sampled = {step['batch/loss_tokens']:.0f} in the loss + {masked} masked; "
          f"{len(gated)} of {len(records)} segments gated")
    assert masked["gate"] > 0 and masked["rollout_is"] > 0
