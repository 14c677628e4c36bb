"""What the distillation run tests share: a teacher that disagrees with the tiny policy, the cheap
run's overrides, and an independent scoring of ids with transformers. Imported by name (`from
distill_parts import ...`), as `parity_env` is."""

from __future__ import annotations

import shutil
from pathlib import Path

STOP_IDS = list(range(0, 151_000, 10))  # a random model rarely ends a turn by itself: one id in ten does


def noisy_teacher(source: Path, out: Path, scale: float = 0.5) -> Path:
    """The tiny model with seeded Gaussian noise on every weight, its tokenizer copied unchanged."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * scale * (p.std() if p.numel() > 1 else 1.0))
    model.save_pretrained(out)
    for f in source.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            shutil.copy(f, out / f.name)
    return out


def distill_overrides(tmp_path: Path, name: str, tiny: Path, teacher: Path, *extra: str) -> list[str]:
    """A cheap distillation run: ParityEnv, 2 prompts x 2 samples, one turn of at most 8 tokens, the
    policy and the teacher each on an hf server."""
    return [
        "env=parity_env:ParityEnv", f"model.path={tiny}", "model.chat_template=chatml-tools",
        "inference.engine=hf", f"distill.teacher.model_path={teacher}", "distill.teacher.engine=hf",
        "distill.mode=mixed", "distill.coef=0.5",
        "data.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_tokens_per_turn=8",
        "rollout.max_turns=1", "rollout.max_total_tokens=256", "inference.max_model_len=1024",
        "trainer.lr=1e-3", "trainer.device=cpu", f"run.output_dir={tmp_path}", f"run.name={name}",
        "run.eval_every=0", "data.num_val_rows=1", "eval.k=1", "run.save_every=0", "run.loggers=[jsonl]",
        "run.keep_rollouts=all", f"rollout.extra_stop_token_ids={STOP_IDS}", *extra,
    ]  # fmt: skip


def teacher_logprobs_of(model_dir: Path, ids: list[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) under the model in `model_dir`, for i >= 1 (float32, transformers)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [float(logprobs[i - 1, ids[i]]) for i in range(1, len(ids))]
