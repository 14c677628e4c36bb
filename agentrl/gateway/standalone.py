"""The standalone gateway of `agentrl gateway`: evaluate any OpenAI-API agent offline, recording its tokens.

`serve_gateway(backend, ...)` runs a `Gateway` that opens a session for every API key (or
`/s/<key>/v1` base URL) it sees, until it is stopped (SIGINT/SIGTERM or `stop`). A session ends
when its agent posts `POST /agentrl/sessions/<key>/end` (optionally `{"reward": r}` to score it),
after `idle_timeout_s` without a call, or when the gateway stops; its trajectory segments are then
appended to `output_dir/trajectories.jsonl` (the ledger, the decoded text, the session key), one
line per segment, flushed as each session ends, so nothing recorded is lost to a crash.

Point the agent at `http://HOST:PORT/v1` with a distinct API key per run (any string), or at
`http://HOST:PORT/s/<run-name>/v1`. What the agent's answer is worth is the caller's business here
(`agentrl eval env=agent` scores it with the row's reward); an unscored session has reward None.
The backend (the AgentLoop that holds the router, template, parser and budgets) and the servers
behind it are built by the caller, the CLI.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.gateway.server import Gateway
from agentrl.gateway.session import GatewaySession
from agentrl.types import FinishReason

if TYPE_CHECKING:
    from agentrl.envs import TurnBackend

__all__ = ["TrajectoryWriter", "serve_gateway"]

log = logging.getLogger(__name__)


class TrajectoryWriter:
    """Appends ended sessions' segments to a JSONL file, one line per segment."""

    def __init__(self, path: str | Path, tokenizer: Any) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tokenizer = tokenizer
        self.sessions = 0
        self.segments = 0

    def __call__(self, session: GatewaySession) -> None:
        segments = session.trajectories(reward=session.reward, finish_reason=FinishReason.DONE)
        with self.path.open("a") as f:
            for t in segments:
                record = t.to_dict()
                record["session"] = session.key
                record["text"] = self.tokenizer.decode(t.token_ids, skip_special_tokens=False)
                f.write(json.dumps(record) + "\n")
        self.sessions += 1
        self.segments += len(segments)
        log.info("session %s ended: %d call(s), %d segment(s) written to %s", session.key,
                 int(session.counters["llm_calls"]), len(segments), self.path)


async def serve_gateway(
    backend: TurnBackend,
    *,
    output_dir: str | Path,
    host: str = "127.0.0.1",
    port: int = 0,
    model_name: str = "agentrl",
    idle_timeout_s: float | None = 600.0,
    ready: Callable[[Gateway], None] | None = None,
    stop: asyncio.Event | None = None,
) -> TrajectoryWriter:
    """Serve until SIGINT/SIGTERM or `stop` is set (module docstring); return the writer's counts."""
    writer = TrajectoryWriter(Path(output_dir) / "trajectories.jsonl", backend.template.tokenizer)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
    gateway = Gateway(host=host, port=port, model_name=model_name, default_backend=backend,
                      on_session_end=writer, idle_timeout_s=idle_timeout_s)
    async with gateway:
        if ready is not None:
            ready(gateway)
        await stop.wait()
    return writer
