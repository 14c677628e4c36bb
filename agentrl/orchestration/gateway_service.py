"""The gateway service: LLM servers of a config and an OpenAI-compatible gateway in front of them.

`serve_gateway_service(config, ...)` is what `agentrl gateway` runs: it builds the job of `config`
(the model, its chat template, tool parser and budgets, checked), starts the configured servers,
serves the gateway (`agentrl.gateway.standalone.serve_gateway`) until SIGINT or SIGTERM, and stops
the servers. `python -m agentrl.orchestration.gateway_service CONFIG_OR_OVERRIDE... [--host H]
[--port P] [--out DIR] [--idle-timeout S]` runs it as a process of its own: the judge model a run
serves (`agentrl.envs.judge_server`) is started this way, through its module, not through the
command line. Once it listens it prints `OpenAI-compatible gateway at URL/v1` on stdout.

Not here: the command line's help and presets (`agentrl.cli`), the gateway's sessions and recording
(`agentrl.gateway`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["main", "serve_gateway_service"]


def _say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def serve_gateway_service(config: Any, *, host: str = "127.0.0.1", port: int = 8400, out: str | Path | None = None,
                          idle_timeout_s: float | None = 600.0, say: Callable[[str], None] = _say) -> int:
    """Serve the gateway of `config` until SIGINT/SIGTERM (see the module docstring); the exit status.
    `say` tells the user what happens (where it listens, where the trajectories go): stdout by default."""
    from agentrl.config import save_config
    from agentrl.gateway.standalone import serve_gateway
    from agentrl.inference.serve import serve_from_config
    from agentrl.orchestration.build import build_job

    job = build_job(config, "eval")  # the model, its chat template, tool parser and budgets, checked
    asyncio.run(job.aclose())  # the gateway runs no env: nothing of the job but its loop is needed
    out_dir = Path(out or Path(config.run.output_dir) / f"gateway-{time.strftime('%Y%m%d-%H%M%S')}")
    save_config(config, out_dir)
    say(f"starting {config.inference.num_servers} {config.inference.engine} server(s) for {config.model.path} ...")
    service = serve_from_config(config, log_dir=out_dir / "logs", model_path=job.model_path)

    def ready(gateway: Any) -> None:
        say(f"OpenAI-compatible gateway at {gateway.url}/v1 (any model name; one API key per agent run)")
        say(f"trajectories: {out_dir}/trajectories.jsonl   press Ctrl-C to stop")

    async def serve() -> Any:
        loop = job.agent_loop(service.client, evaluation=True)
        return await serve_gateway(loop, output_dir=out_dir, host=host, port=port, model_name=config.model.path,
                                   idle_timeout_s=idle_timeout_s, ready=ready)

    try:
        writer = asyncio.run(serve())
    finally:
        service.stop()
    say(f"{writer.sessions} session(s), {writer.segments} trajectory segment(s) in {writer.path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m agentrl.orchestration.gateway_service`: config overrides (`key=value`, or a config
    file first) and the gateway's `--host`, `--port`, `--out` and `--idle-timeout`."""
    from agentrl.config import load_config

    parser = argparse.ArgumentParser(prog="python -m agentrl.orchestration.gateway_service",
                                     description="The gateway service of `agentrl gateway` (module docstring).")
    parser.add_argument("args", nargs="*")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8400)
    parser.add_argument("--out", default=None)
    parser.add_argument("--idle-timeout", type=float, default=600.0)
    ns = parser.parse_args(argv)
    config_file = ns.args[0] if ns.args and "=" not in ns.args[0] else None
    overrides = ns.args[1:] if config_file is not None else ns.args
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S"))
    logging.getLogger("agentrl").addHandler(handler)
    logging.getLogger("agentrl").setLevel(logging.INFO)
    return serve_gateway_service(load_config(config_file, overrides), host=ns.host, port=ns.port, out=ns.out,
                                 idle_timeout_s=ns.idle_timeout or None)


if __name__ == "__main__":
    sys.exit(main())
