"""The reward-model server process: `python -m agentrl.inference.reward_model_server --path DIR --max-length N`.

It loads a Hugging Face `AutoModelForSequenceClassification` (float32, eval mode) and its tokenizer,
writes `{"ready": true, ...}` on stdout, then answers one JSON line per request line on stdin:
`{"id", "messages"}` -> `{"id", "score", "tokens"}` (the first logit of the conversation rendered
with the tokenizer's chat template, or its contents joined by blank lines without one), or
`{"id", "error", "cause"}` (`truncated` when it is longer than `--max-length`, `infra` otherwise).
One bad request never ends the process. `agentrl.envs.reward_model.RewardModelScorer` starts it
and is its only client; it is a server process, so it may import torch (DESIGN.md §2).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from typing import Any

__all__ = ["main"]


def _serve(path: str, max_length: int) -> int:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    out = sys.stdout
    out.write(json.dumps({"ready": True, "num_labels": model.config.num_labels}) + "\n")
    out.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        reply: dict[str, Any] = {"id": request["id"]}
        try:
            messages = request["messages"]
            if tokenizer.chat_template:
                ids = tokenizer.apply_chat_template(messages, tokenize=True)
                if isinstance(ids, Mapping):  # newer transformers return a BatchEncoding
                    ids = ids["input_ids"]
            else:
                ids = tokenizer("\n\n".join(m["content"] for m in messages))["input_ids"]
            if len(ids) > max_length:
                reply.update(error=f"the conversation has {len(ids)} tokens, over reward.model.max_length="
                                   f"{max_length}", cause="truncated")
            else:
                with torch.no_grad():
                    logits = model(input_ids=torch.tensor([list(ids)])).logits
                reply.update(score=float(logits[0, 0]), tokens=len(ids))
        except Exception as exc:  # one bad request must not end the process: report it as that request's
            reply.update(error=f"{type(exc).__name__}: {exc}", cause="infra")
        out.write(json.dumps(reply) + "\n")
        out.flush()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Serve a sequence-classification reward model over stdin/stdout.")
    parser.add_argument("--path", required=True)
    parser.add_argument("--max-length", type=int, required=True)
    ns = parser.parse_args(argv)
    return _serve(ns.path, ns.max_length)


if __name__ == "__main__":
    sys.exit(main())
