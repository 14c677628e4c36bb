"""Start the inference side of a run from its config: servers plus a router, or external servers.

`serve_from_config(config)` reads `config.inference` and returns an `InferenceService`: for `hf`,
`vllm` and `sglang` it starts `num_servers` server processes (in parallel, each on its own port,
logging to `log_dir`, agentrl's own taking a bearer token made for the run, which only the run's
clients hold: `server_app`) and puts a `Router` in front of them; for `external` it starts nothing and
routes over `ExternalClient`s of the given `urls`. `InferenceService.client` is the
`InferenceClient` the rollout layer uses; `await start()` starts the router's health checks and,
for servers agentrl started, their `ServerSupervisor`; `stop()` ends what was started. The CLI
(`agentrl serve`) is a thin wrapper around this.

`ServerSupervisor` keeps the servers agentrl started alive, in the shape of slime's fault
tolerance: a server whose process died (or that failed its health checks for `HUNG_AFTER_S`) is
restarted on its port, waited for, and re-synced to the weights pushed last before the router
sends it requests again; meanwhile the router routes around it, or requests wait (until their
deadline) when it was the only one. A server that died `inference.max_restarts` times, or whose
restart failed, is given up; once every server is, the router's `fatal` says why, every request
fails at once, and the run stops with that message. Servers given as `inference.urls` belong to
someone else and are not restarted (the router still re-syncs one that comes back behind).
Before serving, `serve_from_config` checks `rollout.max_total_tokens` against what running servers
report as their context (`max_model_len` in agentrl's `/health`, or vLLM's `/v1/models`).

`ExternalClient` speaks to an OpenAI-compatible `/v1/completions` server somebody else runs (a
`vllm serve`, an SGLang or TGI OpenAI endpoint). What it can give: token-id prompts (the prompt is
sent as a list of ids), the sampled ids and their logprobs where the server returns ids (vLLM's
`return_token_ids`, or `return_tokens_as_token_ids` tokens such as "token_id:42"), and finish
reasons. What it cannot give: the weight version (the OpenAI API has none; the client reports the
`weight_version` it was constructed with, so the router's version gating is only as good as the
caller's bookkeeping), pause/resume and weight updates (not in the API), server load (the router
balances on its own in-flight counts), and the logprob convention (the server's own: vLLM's
default "raw_logprobs" is the temperature-1 distribution, not the sampled one).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx

from agentrl.config import AgentRLConfig
from agentrl.errors import ConfigError, InferenceError, ServerUnavailableError
from agentrl.inference.client import raise_for_status
from agentrl.inference.launcher import ServerProcess, launch_server
from agentrl.inference.protocol import HealthResponse
from agentrl.inference.router import Router
from agentrl.models import resolve_model_path
from agentrl.types import Generation, SamplingParams

__all__ = [
    "HUNG_AFTER_S",
    "ExternalClient",
    "InferenceService",
    "ServerSupervisor",
    "check_context",
    "engine_kwargs_from_config",
    "serve_from_config",
    "server_context",
]

log = logging.getLogger(__name__)

HUNG_AFTER_S = 60.0
"""A live server process whose health checks failed this long without a break is restarted."""


class ExternalClient:
    """An OpenAI-compatible `/v1/completions` server with token-id prompts (see the module docstring)."""

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        model_hint: str | None = None,
        weight_version: int = 0,
        api_key: str | None = None,
        timeout_s: float = 300.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        url = base_url.rstrip("/")
        self.base_url = url[: -len("/v1")] if url.endswith("/v1") else url
        self.server_id = self.base_url
        self.model = model
        self.model_hint = model_hint
        self.weight_version = weight_version
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(
            base_url=self.base_url, headers=headers, transport=transport, timeout=timeout_s
        )

    async def _call(self, method: str, path: str, *, json: Any = None, timeout_s: float | None = None) -> Any:
        try:
            resp = await self._http.request(method, path, json=json, timeout=timeout_s)
        except httpx.TransportError as exc:
            raise ServerUnavailableError(
                f"Cannot reach the OpenAI-compatible server at {self.base_url}: {exc}"
            ) from exc
        raise_for_status(resp, f"{method} {self.base_url}{path}")
        return resp.json()

    async def _model_name(self) -> str:
        if self.model is None:
            data = await self._call("GET", "/v1/models", timeout_s=10.0)
            served = [str(m["id"]) for m in data.get("data") or [] if isinstance(m, dict) and "id" in m]
            self.model = _pick_served_model(served, self.model_hint, self.base_url)
        return self.model

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        *,
        session_id: str,
        timeout_s: float | None = None,
    ) -> Generation:
        body: dict[str, Any] = {
            "model": await self._model_name(),
            "prompt": list(prompt_ids),
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "logprobs": 0,
            "echo": False,
            # vLLM extensions (ignored where unknown): ids instead of text, no special-token stripping
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
        }
        # vLLM's server fills unset parameters from the model's generation_config (e.g. top_k=20,
        # repetition_penalty=1.1); send neutral values so the tokens come from the requested distribution
        body["top_k"] = sampling.top_k if sampling.top_k > 0 else -1
        body["min_p"] = sampling.min_p
        body["repetition_penalty"] = 1.0
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if sampling.stop_token_ids:
            body["stop_token_ids"] = list(sampling.stop_token_ids)
        data = await self._call("POST", "/v1/completions", json=body, timeout_s=timeout_s)
        choice = data["choices"][0]
        lp = choice.get("logprobs") or {}
        ids = choice.get("token_ids")
        if ids is None:
            ids = [_token_id(t, self.base_url) for t in lp.get("tokens") or []]
        logprobs = [float(x) for x in lp.get("token_logprobs") or []]
        if len(logprobs) != len(ids):
            raise InferenceError(
                f"{self.base_url} returned {len(ids)} token ids but {len(logprobs)} logprobs; it must support "
                "per-token logprobs on /v1/completions."
            )
        reason = choice.get("finish_reason")
        finish: Literal["stop", "length", "abort"] = (
            "stop" if reason == "stop" else "length" if reason == "length" else "abort"
        )
        return Generation(list(ids), logprobs, finish, self.weight_version, self.server_id)

    async def health(self, timeout_s: float | None = None) -> HealthResponse:
        await self._call("GET", "/v1/models", timeout_s=timeout_s or 10.0)
        return HealthResponse(
            status="ok", weight_version=self.weight_version, model=self.model or "", engine="external", load=0
        )

    async def aclose(self) -> None:
        await self._http.aclose()


def _pick_served_model(served: list[str], hint: str | None, url: str) -> str:
    """The model name to send: the only one served, else the one named like `hint` (the model path)."""
    if len(served) == 1:
        return served[0]
    if not served:
        raise InferenceError(f"{url}/v1/models lists no model; is it an OpenAI-compatible server that has loaded one?")
    if hint:
        def base(name: str) -> str:
            return name.rstrip("/").rsplit("/", 1)[-1].lower()

        for name in served:
            if name == hint or base(name) == base(hint):
                return name
    raise InferenceError(
        f"{url} serves several models ({', '.join(served)}) and none is named like model.path={hint!r}; "
        "set model.path to the one to use (and model.tokenizer if its tokenizer lives elsewhere)."
    )


def _token_id(token: str, url: str) -> int:
    if token.startswith("token_id:"):
        return int(token.split(":", 1)[1])
    raise InferenceError(
        f"{url} returned tokens as text ({token!r}), not ids; agentrl never re-tokenises text. Use a server "
        "that supports `return_token_ids` or `return_tokens_as_token_ids` (vLLM's OpenAI server does)."
    )


class ServerSupervisor:
    """Restarts dead servers and re-syncs them (see the module docstring). Runs on the event loop."""

    def __init__(
        self, router: Router, servers: list[ServerProcess], *, startup_timeout_s: float, max_restarts: int,
        poll_s: float = 1.0, hung_after_s: float = HUNG_AFTER_S,
    ) -> None:
        self.router = router
        self.servers = servers
        self.startup_timeout_s = startup_timeout_s
        self.max_restarts = max_restarts
        self.poll_s = poll_s
        self.hung_after_s = hung_after_s
        self.restarts = [0] * len(servers)
        self._unhealthy_since: list[float | None] = [None] * len(servers)
        self._reviving: dict[int, asyncio.Task[None]] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._watch(), name="agentrl-server-supervisor")

    async def aclose(self) -> None:
        tasks = [t for t in (self._task, *self._reviving.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = None

    async def _watch(self) -> None:
        while True:
            for i, proc in enumerate(self.servers):
                if i not in self._reviving:
                    await proc.refresh()  # a placed server's proxy asks its node whether it still runs
                if i in self._reviving or self.router.servers[i].given_up is not None:
                    continue
                why = self._trouble(i, proc)
                if why:
                    task = asyncio.create_task(self._revive(i, why), name=f"agentrl-restart-{proc.port}")
                    self._reviving[i] = task
                    task.add_done_callback(self._forget_revival(i))
            await asyncio.sleep(self.poll_s)

    def _forget_revival(self, i: int) -> Callable[[asyncio.Task[None]], None]:
        """The done-callback of server `i`'s revival task."""

        def forget(_task: asyncio.Task[None]) -> None:
            self._reviving.pop(i, None)

        return forget

    def _trouble(self, i: int, proc: ServerProcess) -> str:
        if not proc.alive:
            return f"exited (code {proc.returncode})"
        routed = self.router.servers[i]
        if routed.healthy or routed.syncing:
            self._unhealthy_since[i] = None
            return ""
        now = time.monotonic()
        since = self._unhealthy_since[i] = self._unhealthy_since[i] or now
        if now - since >= self.hung_after_s:
            return f"failed its health checks for {now - since:.0f} s"
        return ""

    async def _revive(self, i: int, why: str) -> None:
        proc = self.servers[i]
        self.router.server_down(i)
        self._unhealthy_since[i] = None
        while True:
            if self.restarts[i] >= self.max_restarts:
                self.router.give_up(
                    i, f"it {why}; not restarted again after {self.restarts[i]} restart(s) "
                       f"(inference.max_restarts={self.max_restarts}); its log {proc.log_path} ends:\n"
                       f"{proc.log_tail(15)}")
                return
            self.restarts[i] += 1
            log.warning("inference server %s %s; restarting it (restart %d of at most %d)", proc.url, why,
                        self.restarts[i], self.max_restarts)
            start = time.monotonic()
            proc.restart()  # on the loop's thread: nothing is left half-started if we are cancelled
            try:
                await proc.wait_healthy_async(self.startup_timeout_s)
            except ServerUnavailableError as exc:
                why = f"could not be restarted: {str(exc).splitlines()[0]}"
                continue
            self.router.server_restarted(i)
            await self.router.resync(i)
            log.warning("inference server %s is back after %.0f s, serving weights version %s", proc.url,
                        time.monotonic() - start, self.router.servers[i].weight_version)
            return


@dataclass
class InferenceService:
    """What `serve_from_config` started: the router (`client`), the server processes behind it,
    and their supervisor (None for servers someone else runs)."""

    client: Router
    servers: list[ServerProcess] = field(default_factory=list)
    supervisor: ServerSupervisor | None = None

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    async def start(self) -> InferenceService:
        """Start the router's health checks and the supervision of the servers (on this event loop)."""
        await self.client.start()
        if self.supervisor is not None:
            self.supervisor.start()
        return self

    async def stop_supervising(self) -> None:
        """Stop restarting servers (before they are stopped on purpose)."""
        if self.supervisor is not None:
            await self.supervisor.aclose()

    async def aclose(self) -> None:
        """Stop supervising, close the router, then stop the servers."""
        await self.stop_supervising()
        await self.client.aclose()
        self.stop()

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


def engine_kwargs_from_config(config: AgentRLConfig) -> dict[str, Any]:
    """Command-line options of the configured engine's server, from `config.inference` and `model`."""
    inf = config.inference
    dtype = config.model.dtype
    # a flag only when set: `--trust-remote-code` is each server's (and SGLang's) own switch
    remote = True if config.model.trust_remote_code else None
    if inf.engine == "hf":
        return {"trust_remote_code": remote, "dtype": dtype}
    if inf.engine == "vllm":
        return {
            "enforce_eager": inf.enforce_eager,
            "prefix_caching": inf.prefix_caching,
            "max_model_len": inf.max_model_len,
            "gpu_memory_utilization": inf.gpu_memory_utilization,
            "cpu_kv_cache_gb": inf.cpu_kv_cache_gb,
            "dtype": dtype,
            "seed": config.run.seed,
            "trust_remote_code": remote,
        }
    if inf.engine == "sglang":
        return {
            "context_length": inf.max_model_len,
            "mem_fraction_static": inf.gpu_memory_utilization,
            "dtype": dtype,
            "disable_radix_cache": True if not inf.prefix_caching else None,
            "trust_remote_code": remote,
        }
    return {}


def serve_from_config(config: AgentRLConfig, *, log_dir: str | Path | None = None,
                      token: str | None = "per-run", model_path: str | None = None) -> InferenceService:
    """Start `inference.num_servers` servers of `inference.engine` and a router in front of them.

    For `engine: external` nothing is started: the router spans the OpenAI-compatible servers at
    `inference.urls`. For the other engines, `inference.urls` names running agentrl servers
    (`agentrl serve`): the router connects to them and nothing is started either. Blocks until every
    server answers /health (or raises, stopping the ones that did start). The servers it starts
    take `token` as their bearer token: by default a fresh one only this service's clients hold;
    `None` for none (`agentrl serve` without `AGENTRL_SERVER_TOKEN`: anyone who reaches the port).
    `model_path`: the model directory already resolved from `model.path` (by `build_job`); without
    it, `model.path` is resolved here.
    """
    inf = config.inference

    def make_router(clients: list[Any]) -> Router:
        return Router(clients, overload_threshold=inf.overload_threshold,
                      request_timeout_s=config.rollout.request_timeout_s)

    if inf.engine == "external":
        if not inf.urls:
            raise ConfigError(
                "inference.engine is 'external' but inference.urls is empty; give the base URLs of running "
                "OpenAI-compatible servers, e.g. inference.urls=[http://127.0.0.1:8000]."
            )
        check_context(config, inf.urls)
        # The served name is asked from the server (`vllm serve PATH` calls its model PATH); the
        # configured model path only picks among several, and is the tokenizer the loop uses.
        clients = [ExternalClient(u, model_hint=config.model.path) for u in inf.urls]
        return InferenceService(make_router(clients))
    if inf.urls:
        # Servers someone already started (`agentrl serve`, or another job): connect, start nothing.
        from agentrl.inference.client import HTTPServerClient

        check_context(config, inf.urls)
        return InferenceService(make_router([HTTPServerClient(u) for u in inf.urls]))
    kwargs = engine_kwargs_from_config(config)
    if model_path is None:
        model_path = resolve_model_path(config.model.path)  # built-in names are converted once, here
    if token == "per-run":
        token = secrets.token_urlsafe(32)  # the servers of this run answer only its own clients
    servers: list[ServerProcess] = []
    try:
        for i in range(inf.num_servers):
            log_path = Path(log_dir) / f"{inf.engine}-{i}.log" if log_dir else None
            servers.append(
                launch_server(inf.engine, model_path, log_path=log_path, wait=False, token=token, **kwargs)
            )
        for server in servers:
            server.wait_healthy(inf.startup_timeout_s)
            log.info("%s server %s healthy after %.1f s", inf.engine, server.url, server.startup_s or 0.0)
    except BaseException:
        for server in servers:
            server.stop()
        raise
    clients = [s.client() for s in servers]
    router = make_router(clients)
    supervisor = ServerSupervisor(router, servers, startup_timeout_s=inf.startup_timeout_s,
                                  max_restarts=inf.max_restarts)
    return InferenceService(router, servers, supervisor)


def server_context(url: str, *, timeout_s: float = 10.0) -> int | None:
    """The context length (`max_model_len`) the server at `url` reports, or None if it does not say:
    agentrl servers in `/health`, vLLM's OpenAI server in `/v1/models`."""
    base = url.rstrip("/").removesuffix("/v1")
    with httpx.Client(timeout=timeout_s) as http:
        for path in ("/health", "/v1/models"):
            with contextlib.suppress(httpx.HTTPError, ValueError):
                resp = http.get(base + path)
                if resp.status_code != 200:
                    continue
                data = resp.json()
                if isinstance(data, dict) and isinstance(data.get("max_model_len"), int):
                    return int(data["max_model_len"])
                models = data.get("data") if isinstance(data, dict) else None
                for m in models or []:
                    if isinstance(m, dict) and isinstance(m.get("max_model_len"), int):
                        return int(m["max_model_len"])
    return None


def check_context(config: AgentRLConfig, urls: list[str]) -> None:
    """Raise ConfigError when `rollout.max_total_tokens` is more than a running server's context:
    episodes would grow into requests the server refuses."""
    budget = config.rollout.max_total_tokens
    for url in urls:
        limit = server_context(url)
        if limit is not None and budget > limit:
            raise ConfigError(
                f"rollout.max_total_tokens={budget} is more than the context of the server at {url} "
                f"(max_model_len={limit}): longer episodes would be refused. Lower rollout.max_total_tokens "
                f"to {limit} or less, or start the server with a longer context."
            )
