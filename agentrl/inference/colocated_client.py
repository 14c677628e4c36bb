"""`ColocatedClient`: the router's client of an engine that lives in another process's memory.

With placement `colocated` the vLLM engine runs inside a trainer process (`colocated.py`), so there
is no URL to call: the client is given `call(method, *args)`, which runs a method of the engine's
host (the trainer actor, whose `engine_*` methods forward to its `ColocatedServer`) and returns an
awaitable of the answer. It speaks the same protocol objects as `HTTPServerClient`
(`GenerateRequest`/`ScoreRequest` in, `GenerateResponse`/`ScoreResponse`/`HealthResponse` out), so the router, the agent loop and
the scheduler treat it like any other server. The host's layer supplies `call` and maps its own
failures (a dead actor) to `ServerUnavailableError`; this module imports neither Ray nor torch.
Weights are not pushed through this client: the host loads its own trainer's tensors.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from agentrl.errors import ServerUnavailableError
from agentrl.inference.protocol import (
    GenerateRequest,
    GenerateResponse,
    HealthResponse,
    MetricsResponse,
    SamplingSpec,
    ScoreRequest,
    ScoreResponse,
)
from agentrl.types import Generation, SamplingParams

__all__ = ["ColocatedClient", "HostCall"]

HostCall = Callable[..., Awaitable[Any]]
"""`call(method_name, *args)`: run a method of the engine's host; raise ServerUnavailableError when
the host is gone."""


class ColocatedClient:
    """One colocated engine, reached through its host (see the module docstring)."""

    def __init__(self, call: HostCall, server_id: str, *, timeout_s: float = 300.0,
                 control_timeout_s: float = 30.0) -> None:
        self._host = call
        self.server_id = server_id
        self.timeout_s = timeout_s
        self.control_timeout_s = control_timeout_s

    def __repr__(self) -> str:
        return f"ColocatedClient({self.server_id!r})"

    async def _call(self, method: str, *args: Any, timeout_s: float | None) -> Any:
        try:
            return await asyncio.wait_for(self._host(method, *args), timeout_s)
        except TimeoutError as exc:
            raise ServerUnavailableError(
                f"{self.server_id}: {method} got no answer within {timeout_s} s.") from exc

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        *,
        session_id: str,
        timeout_s: float | None = None,
    ) -> Generation:
        request = GenerateRequest(prompt_ids=list(prompt_ids), sampling=SamplingSpec.from_params(sampling),
                                  session_id=session_id)
        answer: GenerateResponse = await self._call(
            "engine_generate", request, timeout_s=self.timeout_s if timeout_s is None else timeout_s)
        return answer.to_generation(self.server_id)

    async def score(self, token_ids: list[int], *, start: int = 1, session_id: str = "",
                    timeout_s: float | None = None) -> ScoreResponse:
        """The logprobs of `token_ids[start:]` under the engine's weights (`protocol.ScoreRequest`)."""
        request = ScoreRequest(token_ids=list(token_ids), start=start, session_id=session_id)
        result: ScoreResponse = await self._call(
            "engine_score", request, timeout_s=self.timeout_s if timeout_s is None else timeout_s)
        return result

    async def health(self, timeout_s: float | None = None) -> HealthResponse:
        result: HealthResponse = await self._call("engine_health", timeout_s=timeout_s or self.control_timeout_s)
        return result

    async def pause(self, *, abort: bool = False, timeout_s: float | None = None) -> HealthResponse:
        """Stop taking new requests; in-flight ones finish (or end with "abort" if `abort`)."""
        result: HealthResponse = await self._call("engine_pause", abort, timeout_s=timeout_s or self.timeout_s)
        return result

    async def resume(self) -> HealthResponse:
        result: HealthResponse = await self._call("engine_resume", timeout_s=self.control_timeout_s)
        return result

    async def metrics(self) -> MetricsResponse:
        result: MetricsResponse = await self._call("engine_metrics", timeout_s=self.control_timeout_s)
        return result

    async def aclose(self) -> None:
        """Nothing to close: the engine belongs to its host."""
