"""The FastAPI application every agentrl server process runs, whatever engine is behind it.

An engine (`hf_server.HFEngine`, `vllm_server.VLLMEngine`) only knows how to generate from token
ids, abort what it is generating, and load weights. This module adds what is the same for all of
them: the HTTP routes of `protocol.py`, pause and resume (new requests wait while paused; in-flight
ones finish, or end with finish_reason "abort"), the weight version, the load figure the router
balances on, and the counters behind `/metrics`. It runs inside the server process; clients never
import it.

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
import logging
from typing import Any

from agentrl.inference.protocol import (
    GenerateRequest,
    GenerateResponse,
    HealthResponse,
    MetricsResponse,
    PauseRequest,
    UpdateWeightsRequest,
)

__all__ = ["RequestRejected", "ServerEngine", "ServerState", "build_app", "run_server", "server_arg_parser"]

log = logging.getLogger(__name__)


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

    @abc.abstractmethod
    async def abort_all(self) -> None:
        """Make every in-flight `generate` return soon with finish_reason "abort"."""

    @abc.abstractmethod
    async def load_weights(self, path: str) -> None:
        """Load the safetensors files in `path` into the running model, in place."""

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

    @property
    def paused(self) -> bool:
        return not self._resumed.is_set()

    async def generate(self, request: GenerateRequest) -> GenerateResponse:
        limit = self.engine.max_model_len
        if limit is not None and len(request.prompt_ids) >= limit:
            raise RequestRejected(
                f"the prompt has {len(request.prompt_ids)} tokens; the model's context (max_model_len) is "
                f"{limit} tokens, which must hold the prompt and at least one generated token"
            )
        self.inflight += 1
        try:
            while not self._resumed.is_set():
                await self._resumed.wait()
            self._running += 1
            self._idle.clear()
            try:
                out = await self.engine.generate(request, self.weight_version)
            finally:
                self._running -= 1
                if self._running == 0:
                    self._idle.set()
        finally:
            self.inflight -= 1
        m = self.metrics
        m.requests += 1
        m.prompt_tokens += len(request.prompt_ids)
        m.generated_tokens += len(out.token_ids)
        m.aborted += out.finish_reason == "abort"
        return out

    async def pause(self, abort: bool) -> None:
        self._resumed.clear()
        if abort:
            await self.engine.abort_all()
        await self._idle.wait()

    def resume(self) -> None:
        self._resumed.set()

    async def update_weights(self, path: str, version: int) -> None:
        async with self._update_lock:
            was_paused = self.paused
            await self.pause(abort=False)
            try:
                await self.engine.load_weights(path)
                self.weight_version = version
                self.metrics.weight_updates += 1
            finally:
                if not was_paused:
                    self.resume()

    def health(self) -> HealthResponse:
        return HealthResponse(
            status="paused" if self.paused else "ok",
            weight_version=self.weight_version,
            model=self.engine.model_name,
            engine=self.engine.engine_name,
            load=self.inflight,
            max_model_len=self.engine.max_model_len,
        )


def build_app(engine: ServerEngine, weight_version: int = 0) -> Any:
    """The FastAPI app serving `engine`; the engine is started in the app's lifespan."""
    import contextlib

    from fastapi import FastAPI, HTTPException

    state_box: dict[str, ServerState] = {}

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):  # type: ignore[no-untyped-def]
        await engine.start()
        state_box["s"] = ServerState(engine, weight_version)
        log.info("%s server ready: model=%s", engine.engine_name, engine.model_name)
        try:
            yield
        finally:
            await engine.shutdown()

    app = FastAPI(title=f"agentrl {engine.engine_name} server", lifespan=lifespan)

    @app.post("/generate", response_model=GenerateResponse)
    async def generate(request: GenerateRequest) -> GenerateResponse:
        try:
            return await state_box["s"].generate(request)
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

    @app.post("/update_weights", response_model=HealthResponse)
    async def update_weights(request: UpdateWeightsRequest) -> HealthResponse:
        state = state_box["s"]
        try:
            await state.update_weights(request.path, request.version)
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            raise HTTPException(
                status_code=400, detail=f"update_weights({request.path}) failed: {exc}"
            ) from exc
        return state.health()

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
    uvicorn.run(build_app(engine, weight_version), host=host, port=port, log_level=log_level)
