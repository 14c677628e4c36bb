"""A planted engine fault: an `hf` server that reports every pushed version but keeps its old weights.

`StaleHFEngine` receives each push exactly as the hf engine does (every bucket's checksum compared
with the sender's, every tensor read), then loads none of it, so the push is reported verified and
the server reports the new version while it keeps computing with the weights it started with. Run it
as `python -m stale_engine --model PATH --port N` (tests/faults on the path), or
`launch_server("stale_engine:STALE_HF", PATH)`.
"""

from __future__ import annotations

import time
from typing import Any

from agentrl.inference.hf_server import HFEngine
from agentrl.inference.launcher import EngineSpec
from agentrl.inference.protocol import WeightLoadReport
from agentrl.inference.server_app import run_server, server_arg_parser, weight_load_report

__all__ = ["STALE_HF", "StaleHFEngine"]

STALE_HF = EngineSpec(name="stale-hf", module="stale_engine", description="hf, reloads that load nothing")


class StaleHFEngine(HFEngine):
    """The hf engine whose weight loads consume the verified stream and load nothing."""

    def _load_weights(self, source: str, version: int, token: str | None) -> WeightLoadReport:
        from agentrl.weights import receive_weights

        start = time.perf_counter()
        with receive_weights(source, version=version, token=token, owned=False) as stream:
            for _name, _tensor in stream:
                pass
        stats: dict[str, Any] = stream.stats.as_dict()
        return weight_load_report(source, version, stats, time.perf_counter() - start)


def main() -> None:
    args = server_arg_parser("stale_hf").parse_args()
    run_server(StaleHFEngine(args.model), host=args.host, port=args.port, weight_version=args.weight_version,
               log_level=args.log_level)


if __name__ == "__main__":
    main()
