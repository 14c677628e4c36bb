"""The FastAPI application every agentrl server process runs, whatever engine is behind it.

An engine (`hf_server.HFEngine`, `vllm_server.VLLMEngine`) only knows how to generate from token
ids, score given token ids (`POST /score`: their logprobs under the served weights, nothing
sampled), abort what it is generating, and load weights. This module adds what is the same for all of
them: the HTTP routes of `protocol.py`, pause and resume (new requests wait while paused; in-flight
ones finish, or end with finish_reason "abort"), the weight version, the load figure the router
balances on, and the counters behind `/metrics`. It runs inside the server process; clients never
import it.

Weight pushes. `POST /update_weights {source, version, token}` pauses the server (in-flight
requests finish first), and the engine receives the weights through `agentrl.weights`
(`receive_weights`): every bucket's checksum is compared with the sender's before any tensor of it
is loaded, and the answer reports how many were verified. Buckets are loaded as they arrive, so a
push that fails part-way (a bucket still corrupted after its retries, a sender that vanished, a
tensor the model does not have) leaves the model holding two versions at once. The server then
refuses to serve rather than serve that mix: `/health` says "loading" with the reason, and
`/generate` (including the requests that waited for the push) answers 503 so the router sends them
elsewhere, until a push completes. A push that fails before it touched the model (the source was
unreachable) leaves the server serving its old version.

Authentication. With a token (`AGENTRL_SERVER_TOKEN` in the server's environment; `agentrl run`
makes one per run for the servers it starts), every route but `/health` needs `Authorization: Bearer
<token>` and answers 401 without it, as vLLM's `--api-key` does: on a cluster the servers listen on
their node's address, where anyone who reaches it could otherwise generate, pause the server or
point it at other weights. `/health` stays open (status, weight version, load, context length) so
launchers and `server_context` can poll it. Clients (`HTTPServerClient`) send the token they are
given, or the one in their own environment.

Errors are answered as what they are. A request the engine cannot serve (a prompt as long as the
model's context or longer, bad parameters: `RequestRejected` or `ValueError` from the engine) is
answered HTTP 400, so the client raises a request error and the router does not take the server for
dead; vLLM's own API server does the same. An engine that died under a live HTTP frontend (vLLM's
engine core) makes `/health` answer 503, so the router routes around the server and its supervisor
restarts it, instead of the health check calling it well while every request fails.
"""

from __future__ import annotations

import abc
import argparse
import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from agentrl.inference.protocol import (
    SERVER_TOKEN_ENV,
    GenerateRequest,
    GenerateResponse,
    HealthResponse,
    MetricsResponse,
    PauseRequest,
    ProbeWeightsRequest,
    ProbeWeightsResponse,
    ScoreRequest,
    ScoreResponse,
    UpdateWeightsRequest,
    UpdateWeightsResponse,
    WeightLoadReport,
)

__all__ = [
    "RequestRejected",
    "ServerEngine",
    "ServerState",
    "WeightLoadError",
    "WeightsIncompleteError",
    "build_app",
    "run_server",
    "server_arg_parser",
    "weight_load_report",
]

log = logging.getLogger(__name__)


class WeightLoadError(Exception):
    """A weight push failed on this server; `touched` says whether some weights were already replaced."""

    def __init__(self, message: str, *, touched: bool) -> None:
        super().__init__(message)
        self.touched = touched


def weight_load_report(source: str, version: int, stats: dict[str, Any], seconds: float) -> WeightLoadReport:
    """The wire report of one load from a receiving stream's `stats` (`TransferStats.as_dict()`)."""
    return WeightLoadReport(
        version=version, source=source, buckets=stats["buckets"], verified_buckets=stats["verified"],
        unverified_buckets=stats["unverified"], retried_buckets=stats["retried"], bytes=stats["bytes"],
        checksum=stats["checksum"], seconds=seconds, receive_seconds=stats.get("receive_seconds", 0.0),
    )  # fmt: skip


class WeightsIncompleteError(Exception):
    """The server's weights are a mix of two versions after a failed push; it serves nothing until a push succeeds."""


class RequestRejected(Exception):
    """Raised by an engine for a request it cannot serve (answered HTTP 400, see the module docstring)."""


class ServerEngine(abc.ABC):
    """What a server process needs from an engine. All methods run on the server's event loop."""

    engine_name: str = "?"
    model_name: str = "?"
    max_model_len: int | None = None
    """The longest sequence (prompt plus generation) the engine serves, once started; None: unknown."""

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Load the model (called once, before the first request)."""

    async def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release the engine (called once, at process exit)."""

    @abc.abstractmethod
    async def generate(self, request: GenerateRequest, version: int) -> GenerateResponse:
        """Generate for one request; must return finish_reason "abort" once `abort_all` is called."""

    async def score(self, request: ScoreRequest, version: int) -> ScoreResponse:
        """The logprobs of `request.token_ids` from `request.start` on (`ScoreRequest`), under the
        weights serving now. Engines that cannot score keep this default, which rejects the request."""
        raise RequestRejected(f"the {self.engine_name} engine cannot score token ids (POST /score); use the hf or "
                              "vllm engine for a policy whose served scores are checked")

    @abc.abstractmethod
    async def abort_all(self) -> None:
        """Make every in-flight `generate` return soon with finish_reason "abort"."""

    @abc.abstractmethod
    async def load_weights(self, source: str, *, version: int, token: str | None) -> WeightLoadReport:
        """Receive the weights at `source` through `agentrl.weights.receive_weights` and load them into
        the running model, in place; raise WeightLoadError (saying whether the model was touched)."""

    def prefix_cache_stats(self) -> tuple[int | None, int | None]:
        """(tokens queried, tokens hit) of the prefix cache, or (None, None) if not exposed."""
        return None, None

    async def check_health(self) -> None:  # noqa: B027 - optional hook
        """Raise if the engine can no longer serve (e.g. its engine process died)."""


class ServerState:
    """Pause/resume, versioning and counters around one engine."""

    def __init__(self, engine: ServerEngine, weight_version: int = 0) -> None:
        self.engine = engine
        self.weight_version = weight_version
        self.metrics = MetricsResponse()
        self.inflight = 0  # running plus waiting, as reported in /health
        self._running = 0
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._update_lock = asyncio.Lock()
        self.weights_error: str | None = None  # set while the weights are a mix of two versions

    @property
    def paused(self) -> bool:
        return not self._resumed.is_set()

    @contextlib.asynccontextmanager
    async def _admitted(self) -> AsyncIterator[None]:
        """One request's turn on the engine: counted in the load, held while paused, refused while the
        weights are incomplete, and awaited by a pause (which waits for the engine to be idle)."""
        self.inflight += 1
        try:
            while not self._resumed.is_set():
                await self._resumed.wait()
            if self.weights_error is not None:
                raise WeightsIncompleteError(self.weights_error)
            self._running += 1
            self._idle.clear()
            try:
                yield
            finally:
                self._running -= 1
                if self._running == 0:
                    self._idle.set()
        finally:
            self.inflight -= 1

    async def generate(self, request: GenerateRequest) -> GenerateResponse:
        limit = self.engine.max_model_len
        if limit is not None and len(request.prompt_ids) >= limit:
            raise RequestRejected(
                f"the prompt has {len(request.prompt_ids)} tokens; the model's context (max_model_len) is "
                f"{limit} tokens, which must hold the prompt and at least one generated token"
            )
        async with self._admitted():
            out = await self.engine.generate(request, self.weight_version)
        m = self.metrics
        m.requests += 1
        m.prompt_tokens += len(request.prompt_ids)
        m.generated_tokens += len(out.token_ids)
        m.aborted += out.finish_reason == "abort"
        return out

    async def score(self, request: ScoreRequest) -> ScoreResponse:
        """Score like `generate` is served: after a pause ends, never from weights left incomplete."""
        limit = self.engine.max_model_len
        if limit is not None and len(request.token_ids) > limit:
            raise RequestRejected(f"{len(request.token_ids)} token ids to score; the model's context "
                                  f"(max_model_len) is {limit} tokens")
        async with self._admitted():
            out = await self.engine.score(request, self.weight_version)
        self.metrics.scored_tokens += len(out.logprobs)
        return out

    async def pause(self, abort: bool) -> None:
        self._resumed.clear()
        if abort:
            await self.engine.abort_all()
        await self._idle.wait()

    def resume(self) -> None:
        self._resumed.set()

    async def update_weights(self, source: str, version: int, token: str | None = None) -> WeightLoadReport:
        """Pause, load `version` from `source`, resume; see the module docstring for failures."""
        async with self._update_lock:
            was_paused = self.paused
            paused_at = time.perf_counter()
            await self.pause(abort=False)
            pause_seconds = time.perf_counter() - paused_at
            m = self.metrics
            try:
                try:
                    report = await self.engine.load_weights(source, version=version, token=token)
                except WeightLoadError as exc:
                    m.weight_load_failures += 1
                    if exc.touched:
                        self.weights_error = (f"weight version {version} from {source} failed part-way and the "
                                              f"weights are incomplete until a push succeeds: {exc}")
                    log.error("weight version %d from %s failed (%s): %s", version, source,
                              "weights incomplete, not serving" if exc.touched else "weights unchanged", exc)
                    raise
                report = report.model_copy(update={"pause_seconds": pause_seconds})
                self.weights_error = None
                self.weight_version = version
                m.weight_updates += 1
                m.weight_buckets_verified += report.verified_buckets
                m.weight_buckets_retried += report.retried_buckets
                m.weight_bytes_received += report.bytes
                log.info("weight version %d from %s: %d/%d buckets verified (%s), %d retried, %.1f MB in %.2f s",
                         version, source, report.verified_buckets, report.buckets, report.checksum,
                         report.retried_buckets, report.bytes / 1e6, report.seconds)
                return report
            finally:
                if not was_paused:
                    self.resume()

    def health(self) -> HealthResponse:
        status: Literal["ok", "paused", "loading"] = "paused" if self.paused else "ok"
        if self.weights_error is not None:
            status = "loading"
        return HealthResponse(
            status=status,
            weight_version=self.weight_version,
            model=self.engine.model_name,
            engine=self.engine.engine_name,
            load=self.inflight,
            detail=self.weights_error,
            max_model_len=self.engine.max_model_len,
        )


def build_app(engine: ServerEngine, weight_version: int = 0, *, token: str | None = None) -> Any:
    """The FastAPI app serving `engine`; the engine is started in the app's lifespan. With `token`,
    every route but `/health` needs it as a bearer token (see the module docstring)."""
    import hmac

    from fastapi import FastAPI, HTTPException, Request
    from fastapi.responses import JSONResponse

    state_box: dict[str, ServerState] = {}

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        state_box["s"] = ServerState(engine, weight_version)
        log.info("%s server ready: model=%s", engine.engine_name, engine.model_name)
        try:
            yield
        finally:
            await engine.shutdown()

    app = FastAPI(title=f"agentrl {engine.engine_name} server", lifespan=lifespan)

    if token:
        expected = f"Bearer {token}".encode()

        @app.middleware("http")
        async def require_token(request: Request, call_next: Any) -> Any:
            given = request.headers.get("authorization", "").encode()
            if request.url.path != "/health" and not hmac.compare_digest(given, expected):
                return JSONResponse(status_code=401, content={
                    "detail": f"this server needs its token: send 'Authorization: Bearer <token>' (set "
                              f"{SERVER_TOKEN_ENV} to the server's token where the client runs)"})
            return await call_next(request)

    @app.exception_handler(WeightsIncompleteError)
    async def weights_incomplete(_request: Request, exc: WeightsIncompleteError) -> JSONResponse:
        return JSONResponse(status_code=503, content={"detail": f"not serving: {exc}"})

    @app.post("/generate", response_model=GenerateResponse)
    async def generate(request: GenerateRequest) -> GenerateResponse:
        try:
            return await state_box["s"].generate(request)
        except (RequestRejected, ValueError) as exc:
            raise HTTPException(status_code=400, detail=f"request rejected: {exc}") from exc

    @app.post("/score", response_model=ScoreResponse)
    async def score(request: ScoreRequest) -> ScoreResponse:
        try:
            return await state_box["s"].score(request)
        except (RequestRejected, ValueError) as exc:
            raise HTTPException(status_code=400, detail=f"request rejected: {exc}") from exc

    @app.get("/health", response_model=HealthResponse)
    async def health() -> HealthResponse:
        try:
            await engine.check_health()
        except Exception as exc:
            raise HTTPException(status_code=503, detail=f"the {engine.engine_name} engine is dead: {exc}") from exc
        return state_box["s"].health()

    @app.post("/pause", response_model=HealthResponse)
    async def pause(request: PauseRequest | None = None) -> HealthResponse:
        state = state_box["s"]
        await state.pause(abort=bool(request and request.abort))
        return state.health()

    @app.post("/resume", response_model=HealthResponse)
    async def resume() -> HealthResponse:
        state = state_box["s"]
        state.resume()
        return state.health()

    @app.post("/update_weights", response_model=UpdateWeightsResponse)
    async def update_weights(request: UpdateWeightsRequest) -> UpdateWeightsResponse:
        state = state_box["s"]
        try:
            report = await state.update_weights(request.source, request.version, request.token)
        except WeightLoadError as exc:
            raise HTTPException(
                status_code=422, detail=f"weight version {request.version} from {request.source} failed: {exc}"
            ) from exc
        return UpdateWeightsResponse(**state.health().model_dump(), push=report)

    @app.post("/probe_weights", response_model=ProbeWeightsResponse)
    async def probe_weights(request: ProbeWeightsRequest) -> ProbeWeightsResponse:
        from agentrl.weights import probe_source

        try:
            nonce = await asyncio.to_thread(probe_source, request.source, token=request.token)
        except Exception as exc:  # reported to the caller, who names the fix
            return ProbeWeightsResponse(error=f"{type(exc).__name__}: {exc}")
        return ProbeWeightsResponse(nonce=nonce)

    @app.get("/metrics", response_model=MetricsResponse)
    async def metrics() -> MetricsResponse:
        state = state_box["s"]
        queried, hits = engine.prefix_cache_stats()
        return state.metrics.model_copy(update={"prefix_cache_queries": queried, "prefix_cache_hits": hits})

    return app


def server_arg_parser(engine: str) -> argparse.ArgumentParser:
    """Command-line flags shared by every server module (`python -m agentrl.inference.<x>_server`)."""
    p = argparse.ArgumentParser(
        prog=f"agentrl.inference.{engine}_server", description=f"agentrl {engine} server"
    )
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--weight-version", type=int, default=0, help="version reported for the initial weights")
    p.add_argument("--log-level", default="info")
    return p


def run_server(engine: ServerEngine, *, host: str, port: int, weight_version: int, log_level: str) -> None:
    """Serve `engine` with uvicorn until the process is stopped."""
    import uvicorn

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_app(engine, weight_version, token=os.environ.get(SERVER_TOKEN_ENV) or None)
    uvicorn.run(app, host=host, port=port, log_level=log_level)
