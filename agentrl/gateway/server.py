"""`Gateway`: the OpenAI-compatible HTTP server in front of the router, one session per episode.

Routes (Starlette on uvicorn, inside the caller's event loop):

    POST /v1/chat/completions            streamed or not, tools and tool_choice   (wire.py)
    POST /v1/responses                   the Responses API over the same sessions  (responses.py)
    GET  /v1/models, /v1/models/{id}     the one model served, under any name the agent asks for
    GET  /health
    POST /agentrl/sessions/{key}/end     end a session (standalone gateway): its trajectories are written

Every `/v1/...` route also answers under `/s/{key}/v1/...`. A call belongs to the session named by
that path, else by its API key (`Authorization: Bearer <key>`): `open_session` gives each episode a
fresh unguessable key and a base URL that carries it, so an agent needs nothing but
`OPENAI_BASE_URL` and `OPENAI_API_KEY`, and its calls all go to its own session, whose generations
stay on one inference server (the router keys stickiness on the episode id). A gateway made with a
`default_backend` (the standalone `agentrl gateway`) opens a session for any key it has not seen;
without one, an unknown key is refused with 401.

Errors are OpenAI-style bodies (`{"error": {"message", "type", "param", "code"}}`): 400 for what the
gateway cannot serve (bad fields, images, n > 1, context too long, bodies that are not UTF-8 JSON
nested at most 64 deep), 413 for a body over `rollout.gateway_max_request_mb` (refused by its
Content-Length before it is read, so one agent's huge request cannot hold up the event loop the
other sessions share), 401/404/410 for sessions, 503 for generation failures the client may retry;
a bug is logged and answered 500 with the same shape.
The gateway does not run agents (`agent_env.py`) and does not decide what an episode is worth.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from agentrl.gateway.session import GatewaySession
from agentrl.gateway.wire import (
    WireError,
    completion_body,
    completion_chunks,
    decode_body,
    error_body,
    parse_chat_request,
)

if TYPE_CHECKING:
    from agentrl.envs import TurnBackend

__all__ = ["Gateway", "SharedGateway"]

log = logging.getLogger(__name__)

_DRAIN_S = 5.0


class Gateway:
    """An OpenAI-compatible server over `GatewaySession`s (see the module docstring).

    >>> async with Gateway() as gateway:
    ...     session = gateway.open_session(agent_loop, episode_id="ep1")
    ...     # the agent calls gateway.base_url(session) with api_key=session.key
    ...     segments = gateway.end_session(session.key).trajectories(reward=1.0, finish_reason=...)
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        model_name: str = "agentrl",
        default_backend: TurnBackend | None = None,
        on_session_end: Callable[[GatewaySession], Awaitable[None] | None] | None = None,
        idle_timeout_s: float | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.model_name = model_name
        self.default_backend = default_backend
        self.on_session_end = on_session_end
        self.idle_timeout_s = idle_timeout_s
        self.sessions: dict[str, GatewaySession] = {}
        self.requests = 0
        self._server: Any = None
        self._socket: socket.socket | None = None
        self._reaper: asyncio.Task[None] | None = None
        self.app = self._build_app()

    # ── lifecycle ───────────────────────────────────────────────────────────────────────────
    @property
    def url(self) -> str:
        if self._socket is None:
            raise RuntimeError("The gateway is not started; call `await gateway.start()` first.")
        host = self.host if self.host not in ("0.0.0.0", "") else "127.0.0.1"
        return f"http://{host}:{self.port}"

    async def start(self) -> Gateway:
        """Listen on `host:port` (port 0: a free one) in the running event loop."""
        import uvicorn

        if self._server is not None:
            return self
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(2048)
        sock.setblocking(False)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_config=None, access_log=False, lifespan="off", date_header=False,
                                server_header=False, timeout_keep_alive=75, backlog=2048)
        config.load()
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)
        # startup() without serve(): serve() would take over the process's SIGINT/SIGTERM handlers.
        await server.startup(sockets=[sock])
        self._server, self._socket = server, sock
        if self.idle_timeout_s:
            self._reaper = asyncio.create_task(self._reap_idle(), name="agentrl-gateway-reaper")
        log.info("agentrl gateway listening at %s", self.url)
        return self

    async def aclose(self) -> None:
        """Stop listening and end every open session (the standalone gateway writes them out)."""
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
            self._reaper = None
        for key in list(self.sessions):
            await self._end(key)
        server, self._server = self._server, None
        if server is not None:
            # uvicorn's own shutdown() sleeps 0.1 s whatever is left; this waits only for live requests.
            for listener in server.servers:
                listener.close()
            for connection in list(server.server_state.connections):
                connection.shutdown()
            if server.server_state.tasks:
                await asyncio.wait(list(server.server_state.tasks), timeout=_DRAIN_S)
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    async def __aenter__(self) -> Gateway:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ── sessions ────────────────────────────────────────────────────────────────────────────
    def open_session(
        self, backend: TurnBackend, *, episode_id: str, group_id: str = "", data_source: str = "",
        deadline: float | None = None, key: str | None = None,
    ) -> GatewaySession:
        """A new session for one episode, under a fresh key unless `key` is given."""
        key = key or f"agentrl-{secrets.token_urlsafe(18)}"
        if key in self.sessions:
            raise ValueError(f"A session with key {key!r} is already open.")
        session = GatewaySession(backend, key=key, episode_id=episode_id, group_id=group_id,
                                 data_source=data_source, deadline=deadline)
        self.sessions[key] = session
        return session

    def base_url(self, session: GatewaySession) -> str:
        """The OpenAI base URL (ending in /v1) whose calls go to `session` whatever the API key."""
        return f"{self.url}/s/{session.key}/v1"

    def end_session(self, key: str) -> GatewaySession | None:
        """Close a session and forget it; later calls with its key are refused."""
        session = self.sessions.pop(key, None)
        if session is not None:
            session.close()
        return session

    async def _end(self, key: str) -> GatewaySession | None:
        session = self.end_session(key)
        if session is not None and self.on_session_end is not None:
            result = self.on_session_end(session)
            if asyncio.iscoroutine(result):
                await result
        return session

    async def _reap_idle(self) -> None:
        assert self.idle_timeout_s is not None
        while True:
            await asyncio.sleep(min(self.idle_timeout_s / 4, 5.0))
            now = time.monotonic()
            for key, s in list(self.sessions.items()):
                if now - s.last_used > self.idle_timeout_s and not s.in_flight:
                    log.info("session %s idle for %.0f s: ended", s.episode_id, now - s.last_used)
                    await self._end(key)

    def _session_for(self, request: Any) -> GatewaySession:
        key = request.path_params.get("key")
        if key is None:
            auth = request.headers.get("authorization", "")
            key = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        session = self.sessions.get(key) if key else None
        if session is not None:
            return session
        if self.default_backend is not None and key:
            return self.open_session(self.default_backend, episode_id=key, key=key)
        if self.default_backend is not None:
            raise WireError("Give each agent run its own API key (or base URL /s/<key>/v1): the key names "
                            "its session.", status=401, code="invalid_api_key")
        raise WireError("No open agentrl session has this key; each episode gets its own OPENAI_BASE_URL and "
                        "OPENAI_API_KEY from the env that runs it.", status=401, code="invalid_api_key")

    # ── HTTP ────────────────────────────────────────────────────────────────────────────────
    def _build_app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, StreamingResponse
        from starlette.routing import Route

        from agentrl.gateway.responses import (
            conversation_after,
            parse_responses_request,
            response_body,
            response_events,
        )

        async def body_of(request: Any, session: GatewaySession) -> Any:
            return decode_body(await _read_capped(request, session))

        def guarded(handler: Callable[[Any], Awaitable[Any]]) -> Callable[[Any], Awaitable[Any]]:
            async def route(request: Any) -> Any:
                self.requests += 1
                try:
                    return await handler(request)
                except WireError as exc:
                    return JSONResponse(exc.body(), status_code=exc.status)
                except Exception as exc:  # a bug: logged and answered in the API's shape, not as a bare 500
                    log.exception("gateway: %s %s failed", request.method, request.url.path)
                    return JSONResponse(error_body(f"Internal gateway error: {type(exc).__name__}: {exc}",
                                                   kind="server_error"), status_code=500)
            return route

        async def chat(request: Any) -> Any:
            started = time.perf_counter()
            session = self._session_for(request)
            chat_request = parse_chat_request(await body_of(request, session))
            completion = await session.complete(chat_request)
            if not completion.model:
                completion.model = self.model_name
            if chat_request.stream:
                chunks = list(completion_chunks(completion, include_usage=chat_request.include_usage))
                response: Any = StreamingResponse(iter(chunks), media_type="text/event-stream")
            else:
                response = JSONResponse(completion_body(completion))
            session.counters["handling_s"] += time.perf_counter() - started
            return response

        async def responses(request: Any) -> Any:
            started = time.perf_counter()
            session = self._session_for(request)
            parsed = parse_responses_request(await body_of(request, session), session.stored_responses)
            completion = await session.complete(parsed.chat)
            if not completion.model:
                completion.model = self.model_name
            session.store_response(completion.id.replace("chatcmpl-", "resp_"), conversation_after(parsed, completion))
            if parsed.stream:
                events = list(response_events(completion, parsed))
                response: Any = StreamingResponse(iter(events), media_type="text/event-stream")
            else:
                response = JSONResponse(response_body(completion, parsed))
            session.counters["handling_s"] += time.perf_counter() - started
            return response

        def model_entry(name: str) -> dict[str, Any]:
            return {"id": name, "object": "model", "created": 0, "owned_by": "agentrl"}

        async def models(request: Any) -> Any:
            return JSONResponse({"object": "list", "data": [model_entry(self.model_name)]})

        async def model(request: Any) -> Any:
            return JSONResponse(model_entry(request.path_params["model"]))

        async def health(request: Any) -> Any:
            return JSONResponse({"status": "ok", "sessions": len(self.sessions), "requests": self.requests})

        async def end(request: Any) -> Any:
            key = request.path_params["key"]
            session = self.sessions.get(key)
            if session is None:
                raise WireError("No open session has this key.", status=404, code="session_not_found")
            raw = await _read_capped(request, session)
            body = decode_body(raw) if raw.strip() else {}
            reward = body.get("reward") if isinstance(body, dict) else None
            if reward is not None:
                if not isinstance(reward, (int, float)) or isinstance(reward, bool):
                    raise WireError(f"'reward' must be a number, got {type(reward).__name__}.", param="reward")
                if not math.isfinite(reward):
                    raise WireError(f"'reward' must be a finite number, got {reward!r}; trajectories are written "
                                    "as strict JSON, which has no NaN or Infinity.", param="reward")
                session.reward = float(reward)
            await self._end(key)
            return JSONResponse({"key": session.key, "segments": len(session.segments),
                                 "calls": int(session.counters["llm_calls"])})

        routes = [Route("/health", guarded(health), methods=["GET"]),
                  Route("/agentrl/sessions/{key}/end", guarded(end), methods=["POST"])]
        for prefix in ("", "/s/{key}"):
            routes += [
                Route(f"{prefix}/v1/chat/completions", guarded(chat), methods=["POST"]),
                Route(f"{prefix}/v1/responses", guarded(responses), methods=["POST"]),
                Route(f"{prefix}/v1/models", guarded(models), methods=["GET"]),
                Route(f"{prefix}/v1/models/{{model:path}}", guarded(model), methods=["GET"]),
            ]
        return Starlette(routes=routes)


async def _read_capped(request: Any, session: GatewaySession) -> bytes:
    """The request's body, refused with 413 past the session's `rollout.gateway_max_request_mb`
    without reading it (by its Content-Length) or, when it is streamed, as soon as it passes the cap."""
    limit_mb = session.backend.config.gateway_max_request_mb
    cap = int(limit_mb * 1_000_000)

    def too_large(size: str) -> WireError:
        return WireError(f"The request body is {size} bytes; this gateway reads at most {limit_mb:g} MB "
                         "(rollout.gateway_max_request_mb). Shorten the conversation, or raise the limit if "
                         "rollout.max_total_tokens really needs it.", status=413, code="request_too_large")

    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > cap:
        raise too_large(declared)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > cap:
            raise too_large(f"more than {cap}")
        chunks.append(chunk)
    return b"".join(chunks)


class SharedGateway:
    """One gateway for every episode of a run or an evaluation, owned by whoever made it.

    The gateway starts when the first episode asks for it (`get`), on that episode's event loop,
    and stays up until its owner closes it (`aclose`, or `async with`); the owner (the job that
    built it) passes it to each env, so nothing is found through a module-level table. Closing
    ends its open sessions; a later `get` starts a fresh gateway.
    """

    def __init__(self, **gateway_kwargs: Any) -> None:
        self._kwargs = gateway_kwargs
        self._gateway: Gateway | None = None
        self._lock: asyncio.Lock | None = None

    @property
    def started(self) -> bool:
        return self._gateway is not None

    async def get(self) -> Gateway:
        """The running gateway, started now if no episode has asked for it yet."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._gateway is None:
                self._gateway = await Gateway(**self._kwargs).start()
        return self._gateway

    async def aclose(self) -> None:
        """Stop the gateway if it started. Closing twice is harmless."""
        gateway, self._gateway, self._lock = self._gateway, None, None
        if gateway is not None:
            await gateway.aclose()

    async def __aenter__(self) -> SharedGateway:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
