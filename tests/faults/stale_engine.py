"""Planted engine faults: `hf` servers that report every pushed version but do not serve it whole.

Each receives a push exactly as the hf engine does (every bucket's checksum compared with the
sender's, every tensor read), so the push is reported verified and the server reports the new
version; what it then computes with is chosen by `--fault`:

- `nothing`: it loads none of the tensors and keeps computing with the weights it started with;
- `skip-embedding`: it loads every tensor but the input embedding (`model.embed_tokens.weight`, and
  the LM head where the model ties it to the embedding);
- `stale-kernel`: it loads every tensor, but its output projection computes with a copy of the LM
  head taken at start (as a kernel's packed copy of a weight that a reload does not refresh).

Run it as `python -m stale_engine --model PATH --port N --fault F` (tests/faults on the path), or
`launch_server("stale_engine:STALE_HF", PATH, fault=F)`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from agentrl.inference.hf_server import HFEngine
from agentrl.inference.launcher import EngineSpec
from agentrl.inference.protocol import WeightLoadReport
from agentrl.inference.server_app import run_server, server_arg_parser, weight_load_report

__all__ = ["FAULTS", "STALE_HF", "StaleHFEngine"]

STALE_HF = EngineSpec(name="stale-hf", module="stale_engine", description="hf, reloads that do not serve what they load")
FAULTS = ("nothing", "skip-embedding", "stale-kernel")
EMBEDDING = "model.embed_tokens.weight"


class StaleHFEngine(HFEngine):
    """The hf engine with one planted reload fault (`FAULTS`)."""

    def __init__(self, model_path: str, fault: str) -> None:
        if fault not in FAULTS:
            raise ValueError(f"fault must be one of {FAULTS}, got {fault!r}")
        super().__init__(model_path)
        self.fault = fault

    def _load(self) -> None:
        super()._load()
        if self.fault == "stale-kernel":
            import torch

            head = self.model.get_output_embeddings()
            frozen = head.weight.detach().clone()  # the "kernel's" copy, taken once
            head.forward = lambda hidden: torch.nn.functional.linear(hidden, frozen)

    def _load_weights(self, source: str, version: int, token: str | None) -> WeightLoadReport:
        from agentrl.weights import load_into_module, receive_weights

        start = time.perf_counter()

        skipped = {EMBEDDING}
        if getattr(self.model.config, "tie_word_embeddings", False):
            skipped.add("lm_head.weight")  # the same tensor: loading it would load the embedding

        def kept(stream: Any) -> Iterator[tuple[str, Any]]:
            for name, tensor in stream:
                if self.fault != "nothing" and not (self.fault == "skip-embedding" and name in skipped):
                    yield name, tensor

        with receive_weights(source, version=version, token=token, owned=False) as stream:
            load_into_module(self.model, kept(stream), strict=False, allow_cast=True)
            for _ in stream:  # what was not loaded is still received and checked
                pass
        stats: dict[str, Any] = stream.stats.as_dict()
        return weight_load_report(source, version, stats, time.perf_counter() - start)


def main() -> None:
    parser = server_arg_parser("stale_hf")
    parser.add_argument("--fault", default="nothing", choices=FAULTS)
    args = parser.parse_args()
    run_server(StaleHFEngine(args.model, args.fault), host=args.host, port=args.port,
               weight_version=args.weight_version, log_level=args.log_level)


if __name__ == "__main__":
    main()
