"""One DPO step in agentrl (`agentrl dpo`'s step, FSDP2 backend) and in TRL's `DPOTrainer`, on the same tokens.

    /path/to/venv-trl/bin/python bench/dpo_vs_trl.py          # every figure below, from one command

TRL lives only in a virtual environment of its own, never beside agentrl's (as for bench/vs_trl.py):
    python -m venv --system-site-packages /work/venv-trl
    /work/venv-trl/bin/pip install --no-deps -e .   &&   /work/venv-trl/bin/pip install trl==1.16.0
Without trl the script says so and exits 0.

Workload: the tiny random Qwen2 of the tests (`--model`), fp32 on the CPU, the first `--pairs` rows of
examples/data/preferences.jsonl (multi-turn pairs with tool calls and plain string pairs), rendered by
agentrl (`agentrl.offline_rows`). Both sides get the same token ids: each pair's shared prompt and the two
completions after it (TRL's `prompt_ids`, `chosen_ids`, `rejected_ids`); TRL's loss mask is then every
completion token, so the comparison uses agentrl's mask too only where they agree: on rows whose completions
are one assistant turn (`--single-turn`, the default) every completion token is the assistant's. The
reference is the initial weights on both sides (agentrl's numbers computed once before the step, TRL's
`ref_model`, a frozen copy). `--steps` optimizer steps on all pairs at once
(the first at the reference, where every loss is trivially the same; the later ones after both sides'
updates): AdamW, `--lr`, no weight decay, gradient clipping at 1.0, a constant learning rate. For each of
`--losses` (TRL's `sigmoid`, `ipo`, `sigmoid_norm`: agentrl's `dpo`, `ipo`, `dpo_norm`) it prints TRL's
logged loss and grad norm of each step, agentrl's, their differences, and the largest difference of any
weight after the last step. The issue's target: the losses agree within 1e-5.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOSSES = {"sigmoid": "dpo", "ipo": "ipo", "sigmoid_norm": "dpo_norm"}


def rows(model: str, n: int, single_turn: bool) -> list[dict[str, list[int]]]:
    """The first `n` preference rows as TRL's tokenised examples, from agentrl's ledgers."""
    from agentrl.chat import ChatTemplate
    from agentrl.offline_rows import load_preferences
    from agentrl.types import TokenOrigin

    pairs = load_preferences([REPO / "examples/data/preferences.jsonl"], ChatTemplate.from_pretrained(model)).examples
    out = []
    for pair in pairs:
        sampled = all(o == TokenOrigin.SAMPLED for t in (pair.chosen, pair.rejected) for o in t.origins[t.prompt_length:])
        if single_turn and not sampled:
            continue
        k = pair.chosen.prompt_length
        out.append({"prompt_ids": pair.chosen.token_ids[:k], "chosen_ids": pair.chosen.token_ids[k:],
                    "rejected_ids": pair.rejected.token_ids[k:]})
    return out[:n]


def trl_steps(model_path: str, examples: list[dict[str, list[int]]], loss: str, beta: float, lr: float, steps: int,
              out: Path):
    """TRL's logged (loss, grad_norm) of each step, and the weights after the last."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    ref = copy.deepcopy(model).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    args = DPOConfig(output_dir=str(out), loss_type=[loss], beta=beta, learning_rate=lr, max_steps=steps,
                     per_device_train_batch_size=len(examples), gradient_accumulation_steps=1, max_length=None,
                     weight_decay=0.0, max_grad_norm=1.0, warmup_steps=0, lr_scheduler_type="constant",
                     logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, bf16=False, fp16=False,
                     dataloader_drop_last=False, seed=0, remove_unused_columns=False)
    # A string dataset for the trainer's set-up; the tokens it trains on are agentrl's (set before train()).
    placeholder = Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c"}] * len(examples))
    trainer = DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=placeholder, processing_class=tokenizer)
    trainer.train_dataset = Dataset.from_list(examples)
    trainer.train()
    logged = [(float(r["loss"]), float(r["grad_norm"])) for r in trainer.state.log_history if "loss" in r]
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return logged, weights


def agentrl_steps(model_path: str, examples: list[dict[str, list[int]]], objective: str, beta: float, lr: float,
                  steps: int):
    """agentrl's (loss, grad_norm) of each preference step, and the weights after the last."""
    import torch

    from agentrl.config import AlgorithmConfig, TrainerConfig
    from agentrl.trainer.fsdp2 import FSDP2Backend
    from agentrl.trainer.offline_step import preference_step, score_rows
    from agentrl.types import TokenOrigin, Trajectory

    def ledger(prompt: list[int], completion: list[int]) -> Trajectory:
        t = Trajectory()
        t.extend(prompt, TokenOrigin.PROMPT, 0, ints=True)
        t.extend(completion, TokenOrigin.SAMPLED, 1, logprobs=[0.0] * len(completion), version=0)
        return t

    pairs = [(ledger(e["prompt_ids"], e["chosen_ids"]), ledger(e["prompt_ids"], e["rejected_ids"])) for e in examples]
    algorithm = AlgorithmConfig(objective=objective, beta=beta)
    trainer = TrainerConfig(device="cpu", lr=lr, grad_clip=1.0, weight_decay=0.0, warmup_steps=0)
    backend = FSDP2Backend(model_path, trainer, algorithm, seed=0)
    sums, _ = score_rows(backend, [c for c, _ in pairs] + [r for _, r in pairs])
    reference = torch.stack([sums[: len(pairs)], sums[len(pairs):]], 1)
    logged = []
    for _ in range(steps):
        metrics = preference_step(backend, pairs, reference, algorithm, trainer)
        logged.append((metrics["prefs/loss"], metrics["actor/grad_norm"]))
    weights = {k: v.detach().clone() for k, v in backend.export_weights()}
    return logged, weights


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="/work/shared/assets/tiny-random-qwen2")
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--steps", type=int, default=3, help="steps on the same batch (the first is at the reference)")
    parser.add_argument("--losses", default="sigmoid,ipo,sigmoid_norm")
    parser.add_argument("--multi-turn", action="store_true", help="also the multi-turn rows (TRL then trains on "
                        "their tool results and template tokens too: the losses differ by design)")
    parser.add_argument("--out", default="/tmp/agentrl-dpo-vs-trl")
    ns = parser.parse_args()
    if importlib.util.find_spec("trl") is None:
        print("trl is not installed in this environment; see the module docstring. Nothing measured.")
        return 0
    import trl

    examples = rows(ns.model, ns.pairs, single_turn=not ns.multi_turn)
    print(f"trl {trl.__version__}; {len(examples)} pairs, {sum(len(e['chosen_ids']) + len(e['rejected_ids']) for e in examples)} "
          f"completion tokens; beta {ns.beta}, lr {ns.lr}")
    print(f"{'loss':<13} {'step':>4} {'trl loss':>12} {'agentrl loss':>13} {'|diff|':>9} {'trl gnorm':>10} "
          f"{'agentrl gnorm':>13} {'|diff|':>9}")
    worst = 0.0
    for loss in ns.losses.split(","):
        trl_logged, t_w = trl_steps(ns.model, examples, loss, ns.beta, ns.lr, ns.steps, Path(ns.out))
        ours, a_w = agentrl_steps(ns.model, examples, LOSSES[loss], ns.beta, ns.lr, ns.steps)
        for step, ((t_loss, t_norm), (a_loss, a_norm)) in enumerate(zip(trl_logged, ours, strict=True), start=1):
            worst = max(worst, abs(t_loss - a_loss))
            print(f"{loss:<13} {step:>4} {t_loss:>12.7f} {a_loss:>13.7f} {abs(t_loss - a_loss):>9.2e} {t_norm:>10.5f} "
                  f"{a_norm:>13.5f} {abs(t_norm - a_norm):>9.2e}")
        w_diff = max(float((t_w[k] - a_w[k]).abs().max()) for k in a_w if k in t_w)
        print(f"{loss:<13} largest |weight difference| after {ns.steps} steps: {w_diff:.2e}")
    print(f"largest loss difference {worst:.2e} (target 1e-5)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
