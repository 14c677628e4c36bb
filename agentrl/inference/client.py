"""Clients: the `InferenceClient` and `ControllableClient` protocols, and `HTTPServerClient`.

The generate call itself is `agentrl.types.GenerateClient` (L0, what the agent loop and the gateway
code against: `generate(prompt_ids, sampling, session_id=...) -> Generation`). `InferenceClient`
is that plus `aclose`, what the owner of a client holds; `ControllableClient` adds what the router
needs of one server (`server_id`, `health`). `HTTPServerClient` speaks the agentrl HTTP API
(`protocol.py`) to one server and adds `score` (`ScoringClient`) and the control calls (`health`, `pause`, `resume`,
`update_weights`, `probe_weights`, `metrics`) that the router, the launcher and the weight sync use. The router
(`router.py`) implements the same protocol over many servers; `sglang.SGLangClient` and
`serve.ExternalClient` implement it over other engines' native APIs.

Errors: a server that cannot be reached, times out or answers 5xx raises `ServerUnavailableError`
(the router retries those elsewhere); a request the server rejects (4xx: a prompt longer than its
context, bad parameters) raises `InferenceRequestError`, which says nothing about the server.
"""

from __future__ import annotations

import os
from typing import Any, Protocol, runtime_checkable

import httpx

from agentrl.errors import InferenceRequestError, ServerUnavailableError
from agentrl.inference.protocol import (
    SERVER_TOKEN_ENV,
    GenerateRequest,
    GenerateResponse,
    HealthResponse,
    MetricsResponse,
    PauseRequest,
    ProbeWeightsRequest,
    ProbeWeightsResponse,
    SamplingSpec,
    ScoreRequest,
    ScoreResponse,
    UpdateWeightsRequest,
    UpdateWeightsResponse,
)
from agentrl.types import GenerateClient, Generation, SamplingParams

__all__ = ["ControllableClient", "HTTPServerClient", "InferenceClient", "ScoringClient", "raise_for_status"]


def raise_for_status(resp: httpx.Response, request: str) -> None:
    """Raise for an HTTP error answer to `request` (its method and URL, as messages name it): 5xx is the
    server's fault (`ServerUnavailableError`: the router tries another server), 4xx the request's
    (`InferenceRequestError`: no retry); each carries the status code. Every server client uses it, so
    the router sees one vocabulary whatever the engine."""
    if resp.status_code >= 500:
        unavailable = ServerUnavailableError(f"{request} failed: HTTP {resp.status_code} {resp.text[:300]}")
        unavailable.status_code = resp.status_code
        raise unavailable
    if resp.status_code >= 400:
        rejected = InferenceRequestError(f"{request} was rejected: HTTP {resp.status_code} {resp.text[:500]}")
        rejected.status_code = resp.status_code
        raise rejected


@runtime_checkable
class InferenceClient(GenerateClient, Protocol):
    """A `GenerateClient` its owner closes. Implemented by `HTTPServerClient`, `Router` and the
    engine adapters."""

    async def aclose(self) -> None: ...


@runtime_checkable
class ControllableClient(InferenceClient, Protocol):
    """A client of one server that the router can also health-check (`HTTPServerClient` and kin)."""

    server_id: str

    async def health(self, timeout_s: float | None = None) -> HealthResponse: ...


@runtime_checkable
class ScoringClient(Protocol):
    """A client of one server that scores given token ids (`protocol.ScoreRequest`): `HTTPServerClient`,
    `ColocatedClient`, `SGLangClient`. The router's `score` and `score_each` use it."""

    server_id: str

    async def score(self, token_ids: list[int], *, start: int = 1, session_id: str = "",
                    timeout_s: float | None = None) -> ScoreResponse: ...


class HTTPServerClient:
    """Talks to ONE agentrl server over HTTP with a pooled `httpx.AsyncClient`.

    `timeout_s` is the default deadline of a `generate` call; control calls use `control_timeout_s`.
    `transport` replaces the network (tests pass an `httpx.MockTransport`). `token` is the server's
    bearer token (`server_app`); without one, `AGENTRL_SERVER_TOKEN` from this process's environment.
    """

    def __init__(
        self,
        base_url: str,
        *,
        server_id: str | None = None,
        timeout_s: float = 300.0,
        control_timeout_s: float = 10.0,
        transport: httpx.AsyncBaseTransport | None = None,
        max_connections: int = 1024,
        token: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.server_id = server_id or self.base_url
        self.timeout_s = timeout_s
        self.control_timeout_s = control_timeout_s
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        token = token or os.environ.get(SERVER_TOKEN_ENV) or None
        self._http = httpx.AsyncClient(
            base_url=self.base_url, transport=transport, limits=limits, timeout=timeout_s,
            headers={"Authorization": f"Bearer {token}"} if token else None,
        )

    def __repr__(self) -> str:
        return f"HTTPServerClient({self.base_url!r})"

    async def _call(self, method: str, path: str, *, json: Any = None, timeout_s: float | None) -> Any:
        try:
            resp = await self._http.request(method, path, json=json, timeout=timeout_s)
        except httpx.TimeoutException as exc:
            raise ServerUnavailableError(
                f"{method} {self.base_url}{path} got no answer within {timeout_s} s ({type(exc).__name__})."
            ) from exc
        except httpx.TransportError as exc:
            raise ServerUnavailableError(
                f"Cannot reach the inference server at {self.base_url} ({type(exc).__name__}: {exc}); "
                "is it running? Start one with 'agentrl serve'."
            ) from exc
        raise_for_status(resp, f"{method} {self.base_url}{path}")
        return resp.json()

    # ── GenerateClient ──────────────────────────────────────────────────────────────────────
    async def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        *,
        session_id: str,
        timeout_s: float | None = None,
    ) -> Generation:
        body = GenerateRequest(
            prompt_ids=list(prompt_ids), sampling=SamplingSpec.from_params(sampling), session_id=session_id
        )
        data = await self._call(
            "POST",
            "/generate",
            json=body.model_dump(),
            timeout_s=self.timeout_s if timeout_s is None else timeout_s,
        )
        return GenerateResponse.model_validate(data).to_generation(self.server_id)

    async def score(self, token_ids: list[int], *, start: int = 1, session_id: str = "",
                    timeout_s: float | None = None) -> ScoreResponse:
        """The logprobs of `token_ids[start:]` under the server's weights, nothing sampled (`ScoreRequest`)."""
        body = ScoreRequest(token_ids=list(token_ids), start=start, session_id=session_id)
        data = await self._call("POST", "/score", json=body.model_dump(),
                                timeout_s=self.timeout_s if timeout_s is None else timeout_s)
        return ScoreResponse.model_validate(data)

    async def aclose(self) -> None:
        await self._http.aclose()

    # ── control ─────────────────────────────────────────────────────────────────────────────
    async def health(self, timeout_s: float | None = None) -> HealthResponse:
        data = await self._call("GET", "/health", timeout_s=timeout_s or self.control_timeout_s)
        return HealthResponse.model_validate(data)

    async def pause(self, *, abort: bool = False, timeout_s: float | None = None) -> HealthResponse:
        """Stop taking new requests; in-flight ones finish (or end with "abort" if `abort`)."""
        data = await self._call(
            "POST",
            "/pause",
            json=PauseRequest(abort=abort).model_dump(),
            timeout_s=timeout_s or self.timeout_s,
        )
        return HealthResponse.model_validate(data)

    async def resume(self) -> HealthResponse:
        data = await self._call("POST", "/resume", timeout_s=self.control_timeout_s)
        return HealthResponse.model_validate(data)

    async def update_weights(
        self, source: str, version: int, *, token: str | None = None, timeout_s: float | None = None
    ) -> UpdateWeightsResponse:
        """Load weights `version` from `source` and serve them; the answer reports the verified buckets.

        `source` is a directory on the server's machine (files engine, or any HF model directory) or
        the URL of a trainer's weight endpoint (http engine, with its `token`). A load that fails
        raises InferenceError with the server's reason (see `server_app` for what the server does).
        """
        body = UpdateWeightsRequest(source=str(source), version=version, token=token).model_dump()
        data = await self._call("POST", "/update_weights", json=body, timeout_s=timeout_s or self.timeout_s)
        return UpdateWeightsResponse.model_validate(data)

    async def probe_weights(self, source: str, *, token: str | None = None) -> ProbeWeightsResponse:
        """Ask the server to read a weight source's probe nonce (can it reach the trainer's weights?)."""
        body = ProbeWeightsRequest(source=str(source), token=token).model_dump()
        data = await self._call("POST", "/probe_weights", json=body, timeout_s=self.control_timeout_s * 3)
        return ProbeWeightsResponse.model_validate(data)

    async def metrics(self) -> MetricsResponse:
        data = await self._call("GET", "/metrics", timeout_s=self.control_timeout_s)
        return MetricsResponse.model_validate(data)
