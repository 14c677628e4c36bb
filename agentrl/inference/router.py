"""`Router`: one `InferenceClient` over many servers, sticky per session, balanced by load.

Routing rules (DESIGN.md §4 Inference):

- A new session goes to the least-loaded eligible server. Later turns of the same session go to
  the same server, whose prefix cache already holds the conversation so far.
- A session moves to the least-loaded server when its server is no longer eligible (dead, marked
  failed, or behind in weights), or is overloaded: its load exceeds `overload_threshold` times the
  mean load of the other eligible servers (and exceeds `overload_threshold` in absolute terms, so
  that sessions do not bounce between nearly idle servers). The mean is taken over the *other*
  servers because over all of them the rule could never fire with two servers and a threshold of 2.
- A request that fails because a server is unreachable, timed out or answered 5xx is retried on
  another server (or on the same one once it is back) until the request's deadline; a request
  that got a 5xx answer `MAX_SERVER_ERRORS` times is given up (a request the servers choke on must
  not be retried forever). A request the server rejects (4xx, `InferenceRequestError`: too long for
  its context, bad parameters) is not retried and does not count against the server.
- A server whose weight_version is behind `current_version` (`set_version`) gets no requests; while
  no server is eligible, requests wait (until their deadline) instead of failing.
- A background task polls `GET /health` of every server: liveness, weight version, and the load
  that other clients put on it. A server that answers again but is behind the last weights pushed
  (it was restarted, or missed a push while it was down) is re-synced first: the router keeps
  what it pushed last (`update_weights`) and pushes it to that server alone (`resync`), so a
  server never serves from weights that are behind.
- Servers that agentrl started are supervised (`serve.ServerSupervisor`): a dead one is restarted
  (`server_down` while that happens) and re-synced; one that cannot be brought back is given up
  (`give_up`), and once every server is given up, `fatal` holds the reason and every request
  fails at once with it instead of waiting out its deadline.
- A generation the server ended with finish_reason "abort" (it was paused with abort, e.g. for a
  weight push) is returned as it is, partial tokens included: whether to continue or drop it is
  the agent loop's decision, not the router's.
- A weight push (`update_weights(source, version)`) goes to every healthy server at once; a server
  whose load fails is asked again, and one that still fails stops the push with a WeightSyncError
  that names it and its reason; a server that dies during the push is re-synced when it is back.

Verified serving (`require_verified`): a run that checks what each server serves after every weight
push (`agentrl.orchestration.served_policy`) gives the router its check; from then on a server serves
a weight version only once the check passed for that server at that version (`admit`). A server that
loaded a push, came back from a restart or was re-synced is out of rotation until then: the router
runs the check on it by itself whenever it answers /health with a version it was not admitted at
(the run runs it on every server right after a push), so no request is admitted at a version the
check has not passed, in any mode.

Scoring (the logprobs of given ids, `protocol.ScoreRequest`) goes to one named server, whatever its
eligibility (`score(..., server_id=...)`: the served-policy check scores a server that has just
loaded a version before it serves it), to the least-loaded eligible server (`score`), or to every
healthy server at once (`score_each`). It is not retried: a scoring caller wants the answer of the
server it asked, or to know that server failed.

A server's load is the requests this router has in flight there plus the part of its reported
`/health` load that is not ours. A routing decision costs one dict lookup and O(1) arithmetic on a
sticky turn, and a scan of the servers (not of the sessions) when a session is placed or moved,
so it does not grow with the number of live sessions. The router does not start servers
(`launcher.py`) and does not know about engines: anything with `generate` and `health` will do.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from agentrl.errors import InferenceError, InferenceRequestError, ServerUnavailableError, WeightSyncError
from agentrl.inference.protocol import ScoreResponse
from agentrl.types import Generation, SamplingParams

__all__ = ["MAX_SERVER_ERRORS", "RoutedServer", "Router", "ServedVerifier"]

log = logging.getLogger(__name__)

_DIED = object()

ServedVerifier = Callable[[str, int], Awaitable[None]]
"""`verify(server_id, version)`: check what one server serves at one weight version; admit it if it passes."""
"""`_push_one`'s answer for a server that died during the push."""

MAX_SERVER_ERRORS = 3
"""A request that servers answered with HTTP 5xx this many times is given up (see the module docstring)."""


class RoutedServer:
    """What the router knows about one server. `load` is what it balances on."""

    __slots__ = (
        "client",
        "eligible",
        "external_load",
        "failures",
        "given_up",
        "healthy",
        "inflight",
        "restarting",
        "server_id",
        "sessions",
        "syncing",
        "verified_version",
        "verifying",
        "weight_version",
    )

    def __init__(self, client: Any) -> None:
        self.client = client
        self.server_id: str = str(getattr(client, "server_id", "") or repr(client))
        self.inflight = 0  # requests this router has in flight there
        self.external_load = 0  # load other clients put on it, from /health
        self.healthy = True  # optimistic until a request or a health check fails
        self.weight_version: int | None = None
        self.failures = 0
        self.sessions = 0
        self.eligible = True
        self.restarting = False  # its supervisor is starting it again
        self.syncing = False  # a re-sync to the last pushed weights is under way
        self.given_up: str | None = None  # why it will not come back
        self.verified_version: int | None = None  # the version the served-policy check admitted it at
        self.verifying = False  # that check is under way

    @property
    def load(self) -> int:
        return self.inflight + self.external_load

    def __repr__(self) -> str:
        return (
            f"RoutedServer({self.server_id!r}, load={self.load}, healthy={self.healthy}, "
            f"version={self.weight_version}, sessions={self.sessions}"
            + (", restarting" if self.restarting else "") + (", given up" if self.given_up else "") + ")"
        )


class Router:
    """Sticky, load-aware routing of `generate` calls over many servers (an `InferenceClient`).

    `servers` are base URLs (an `HTTPServerClient` is made for each) or client objects with
    `generate`, `health` and `aclose`, e.g. `HTTPServerClient`, `SGLangClient` or a test fake.
    """

    def __init__(
        self,
        servers: Sequence[Any],
        *,
        overload_threshold: float = 2.0,
        current_version: int | None = None,
        health_interval_s: float = 1.0,
        health_timeout_s: float = 5.0,
        unhealthy_after: int = 2,
        request_timeout_s: float = 300.0,
        max_sessions: int = 1_000_000,
    ) -> None:
        if not servers:
            raise InferenceError("Router needs at least one server (a URL or a client); got none.")
        if overload_threshold <= 1.0:
            raise ValueError(f"overload_threshold must be > 1, got {overload_threshold}")
        self.servers = [RoutedServer(_as_client(s)) for s in servers]
        self.overload_threshold = overload_threshold
        self.current_version = current_version
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.unhealthy_after = unhealthy_after
        self.request_timeout_s = request_timeout_s
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, RoutedServer] = OrderedDict()
        self._eligible_load = 0
        self._n_eligible = 0
        self._changed: asyncio.Event | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._push_lock: asyncio.Lock | None = None
        self._syncs: set[asyncio.Task[None]] = set()
        self.last_push: tuple[str, int, str | None] | None = None
        """(source, version, token) of the last `update_weights`: what a returning server gets."""
        self.fatal: ServerUnavailableError | None = None
        """Set once every server was given up: why no request can be served any more."""
        self._verify: ServedVerifier | None = None
        self._verifies: set[asyncio.Task[None]] = set()
        self.counters = {
            "requests": 0,
            "new_sessions": 0,
            "moves": 0,
            "retries": 0,
            "failures": 0,
            "waits": 0,
            "rejected": 0,
            "resyncs": 0,
        }
        self._refresh_eligibility()

    # ── eligibility and load bookkeeping ────────────────────────────────────────────────────
    def _is_eligible(self, s: RoutedServer) -> bool:
        if not s.healthy or s.restarting or s.given_up is not None:
            return False
        if self._verify is not None and (s.weight_version is None or s.verified_version != s.weight_version):
            return False
        if self.current_version is None:
            return True
        return s.weight_version is not None and s.weight_version >= self.current_version

    def _refresh_eligibility(self) -> None:
        for s in self.servers:
            s.eligible = self._is_eligible(s)
        self._n_eligible = sum(s.eligible for s in self.servers)
        self._eligible_load = sum(s.load for s in self.servers if s.eligible)
        if self._changed is not None:
            self._changed.set()

    def _add_load(self, s: RoutedServer, delta: int) -> None:
        s.inflight += delta
        if s.eligible:
            self._eligible_load += delta

    def set_version(self, version: int | None) -> None:
        """Serve only from servers whose weight_version >= `version` (None: any version)."""
        self.current_version = version
        self._refresh_eligibility()

    # ── verified serving ────────────────────────────────────────────────────────────────────
    def require_verified(self, verify: ServedVerifier) -> None:
        """From now on, serve a weight version from a server only once it was admitted at it (`admit`).
        `verify(server_id, version)` checks one server at one version and admits it if it passes; the
        router calls it (in the background) for a healthy server that answers with a version it was
        not admitted at: after a restart, a re-sync, or a push whose check did not reach it."""
        self._verify = verify
        self._refresh_eligibility()

    def admit(self, server_id: str, version: int) -> None:
        """The served-policy check passed for `server_id` at weight `version`: it may serve it."""
        s = next((x for x in self.servers if x.server_id == server_id), None)
        if s is None:
            raise InferenceError(f"No server {server_id!r} behind this router; known: {[x.server_id for x in self.servers]}")
        s.verified_version = version
        self._refresh_eligibility()

    def _verify_later(self, s: RoutedServer) -> None:
        if (self._verify is None or self._changed is None or s.verifying or s.syncing or s.restarting
                or not s.healthy or s.given_up is not None or s.weight_version is None
                or s.verified_version == s.weight_version or self._behind(s)):
            return
        s.verifying = True
        task = asyncio.ensure_future(self._run_verify(self._verify, s, s.weight_version))
        self._verifies.add(task)
        task.add_done_callback(self._verifies.discard)

    async def _run_verify(self, verify: ServedVerifier, s: RoutedServer, version: int) -> None:
        try:
            await verify(s.server_id, version)
        except Exception:  # the check records its own failure; the server stays out of rotation
            log.exception("the served-policy check of inference server %s at weights version %d failed",
                          s.server_id, version)
        finally:
            s.verifying = False
            self._refresh_eligibility()

    # ── the routing decision (synchronous, no I/O) ──────────────────────────────────────────
    def _least_loaded(self, exclude: Iterable[RoutedServer] = ()) -> RoutedServer | None:
        best: RoutedServer | None = None
        for s in self.servers:
            if s.eligible and s not in exclude and (best is None or s.load < best.load):
                best = s
        return best

    def _overloaded(self, s: RoutedServer) -> bool:
        if self._n_eligible < 2:
            return False
        others_mean = (self._eligible_load - s.load) / (self._n_eligible - 1)
        return s.load > self.overload_threshold * max(others_mean, 1.0)

    def acquire(self, session_id: str, exclude: Sequence[RoutedServer] = ()) -> RoutedServer | None:
        """Pick the server for the next request of `session_id` and count the request on it.

        Returns None when no eligible server is left (the caller waits). Every successful call
        must be paired with `release`.
        """
        sessions = self._sessions
        current = sessions.get(session_id)
        if (
            current is not None
            and current.eligible
            and current not in exclude
            and not self._overloaded(current)
        ):
            sessions.move_to_end(session_id)
            chosen = current
        else:
            least = self._least_loaded(exclude)
            if least is None:
                return None
            chosen = least
            if current is None:
                self.counters["new_sessions"] += 1
                if len(sessions) >= self.max_sessions:
                    _, evicted = sessions.popitem(last=False)
                    evicted.sessions -= 1
            elif chosen is not current:
                self.counters["moves"] += 1
                current.sessions -= 1
            if chosen is not current:
                chosen.sessions += 1
            sessions[session_id] = chosen
            sessions.move_to_end(session_id)
        self._add_load(chosen, 1)
        return chosen

    def release(self, server: RoutedServer) -> None:
        """The request counted by `acquire` on `server` has ended."""
        self._add_load(server, -1)

    def end_session(self, session_id: str) -> None:
        """Forget a finished session (its next request, if any, is placed afresh)."""
        s = self._sessions.pop(session_id, None)
        if s is not None:
            s.sessions -= 1

    def server_of(self, session_id: str) -> str | None:
        s = self._sessions.get(session_id)
        return s.server_id if s is not None else None

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    # ── InferenceClient ─────────────────────────────────────────────────────────────────────
    async def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        *,
        session_id: str,
        timeout_s: float | None = None,
    ) -> Generation:
        """Generate on the session's server; fail over to others until the deadline."""
        self._ensure_started()
        budget = self.request_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + budget
        tried: list[RoutedServer] = []
        errors: list[str] = []
        server_errors = 0
        self.counters["requests"] += 1
        while True:
            server = await self._acquire_or_wait(session_id, tried, deadline)
            if server is None:
                if self.fatal is not None:
                    raise ServerUnavailableError(str(self.fatal))
                raise ServerUnavailableError(
                    f"No eligible inference server answered session {session_id!r} within {budget:.1f} s "
                    f"(version >= {self.current_version}; tried {[s.server_id for s in tried]}): "
                    + ("; ".join(errors[-3:]) or "none was healthy")
                )
            if tried:
                self.counters["retries"] += 1
            try:
                remaining = max(deadline - time.monotonic(), 0.001)
                gen: Generation = await server.client.generate(
                    prompt_ids, sampling, session_id=session_id, timeout_s=remaining
                )
            except ServerUnavailableError as exc:
                if time.monotonic() >= deadline:
                    # the caller's deadline ran out: that says nothing about the server's health
                    raise ServerUnavailableError(
                        f"Session {session_id!r} got no answer within its {budget:.1f} s deadline "
                        f"(last server {server.server_id}): {exc}"
                    ) from exc
                self.counters["failures"] += 1
                errors.append(f"{server.server_id}: {exc}")
                tried.append(server)
                if exc.status_code is not None:
                    server_errors += 1
                    if server_errors >= MAX_SERVER_ERRORS:
                        raise ServerUnavailableError(
                            f"Session {session_id!r}: the servers answered this request with an HTTP 5xx error "
                            f"{server_errors} times; giving up on it: " + "; ".join(errors[-3:])
                        ) from exc
                self._mark_failed(server, exc)
                continue
            except InferenceRequestError:
                self.counters["rejected"] += 1  # the request's fault, not the server's
                raise
            finally:
                self.release(server)
            server.failures = 0
            if server.weight_version is None or gen.weight_version > server.weight_version:
                server.weight_version = gen.weight_version
            if not gen.server_id:
                gen = Generation(
                    gen.token_ids, gen.logprobs, gen.finish_reason, gen.weight_version, server.server_id,
                    kept_sets=gen.kept_sets,
                )
            return gen

    async def _acquire_or_wait(
        self, session_id: str, tried: list[RoutedServer], deadline: float
    ) -> RoutedServer | None:
        while True:
            if self.fatal is not None:
                return None
            server = self.acquire(session_id, tried)
            if server is not None:
                return server
            if tried and any(s.eligible for s in tried):
                tried.clear()  # every eligible server has failed once: give them another chance
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            self.counters["waits"] += 1
            if self._changed is None:
                self._changed = asyncio.Event()
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(remaining, self.health_interval_s))

    def _mark_failed(self, server: RoutedServer, error: Exception | None = None) -> None:
        if server.healthy:
            log.warning("inference server %s failed%s; routing around it until it answers /health",
                        server.server_id, f" ({error})" if error is not None else "")
        server.healthy = False
        self._refresh_eligibility()

    # ── health checks ───────────────────────────────────────────────────────────────────────
    def _ensure_started(self) -> None:
        if self._health_task is None or self._health_task.done():
            self._changed = asyncio.Event()
            self._health_task = asyncio.create_task(self._health_loop(), name="agentrl-router-health")

    async def start(self) -> Router:
        """Start the background health checks now (they also start on the first `generate`)."""
        self._ensure_started()
        await self.check_health()
        return self

    async def check_health(self) -> None:
        """Poll every server's /health once and update liveness, version and external load."""
        await asyncio.gather(*(self._check_one(s) for s in self.servers))
        self._refresh_eligibility()

    async def _check_one(self, s: RoutedServer) -> None:
        health = getattr(s.client, "health", None)
        if health is None or s.given_up is not None:
            return
        try:
            h = await health(timeout_s=self.health_timeout_s)
        except (InferenceError, OSError, TimeoutError) as exc:
            s.failures += 1
            if s.failures >= self.unhealthy_after or not s.healthy:
                if s.healthy:
                    log.warning("inference server %s failed its health check: %s", s.server_id, exc)
                s.healthy = False
            return
        s.failures = 0
        s.healthy = h.status != "loading"
        s.weight_version = h.weight_version
        s.external_load = max(0, h.load - s.inflight)
        if self._behind(s) and not s.syncing and not s.restarting and self._changed is not None:
            # back, but behind the weights pushed last (it was restarted, or missed a push): catch up
            s.syncing = True
            task = asyncio.ensure_future(self.resync(s))
            self._syncs.add(task)
            task.add_done_callback(self._syncs.discard)
        else:
            self._verify_later(s)

    def _behind(self, s: RoutedServer) -> bool:
        return (
            self.last_push is not None and s.healthy and hasattr(s.client, "update_weights")
            and (s.weight_version is None or s.weight_version < self.last_push[1])
        )

    async def _health_loop(self) -> None:
        while True:
            try:
                await self.check_health()
            except Exception:  # never let one bad answer end the health checks
                log.exception("router health check failed")
            await asyncio.sleep(self.health_interval_s)

    # ── scoring ─────────────────────────────────────────────────────────────────────────────
    def _scorer(self, s: RoutedServer) -> Any:
        score = getattr(s.client, "score", None)
        if score is None:
            raise InferenceError(f"Server {s.server_id} cannot score token ids ({type(s.client).__name__} has no "
                                 "score call; external OpenAI-compatible servers have none). Serve the policy with "
                                 "the hf, vllm or sglang engine.")
        return score

    async def _score_on(self, s: RoutedServer, token_ids: Sequence[int], start: int,
                        timeout_s: float | None) -> ScoreResponse:
        score = self._scorer(s)
        self._add_load(s, 1)
        try:
            result: ScoreResponse = await score(list(token_ids), start=start,
                                                timeout_s=self.request_timeout_s if timeout_s is None else timeout_s)
            return result
        finally:
            self._add_load(s, -1)

    async def score(self, token_ids: Sequence[int], *, start: int = 1, server_id: str | None = None,
                    timeout_s: float | None = None) -> ScoreResponse:
        """The logprobs of `token_ids[start:]` on the server named `server_id` (any server behind this
        router, eligible or not), or on the least-loaded eligible one; not retried elsewhere."""
        if server_id is not None:
            server = next((s for s in self.servers if s.server_id == server_id), None)
            if server is None:
                raise InferenceError(f"No server {server_id!r} behind this router; known: "
                                     f"{[s.server_id for s in self.servers]}")
        else:
            server = self._least_loaded()
            if server is None:
                raise ServerUnavailableError(
                    "No inference server can score now (none is healthy at the current weight version): "
                    + "; ".join(repr(s) for s in self.servers))
        return await self._score_on(server, token_ids, start, timeout_s)

    async def score_each(self, token_ids: Sequence[int], *, start: int = 1,
                         timeout_s: float | None = None) -> dict[str, ScoreResponse]:
        """The logprobs of `token_ids[start:]` on every healthy server (not restarting, not given up), at
        once, by server id; each answer carries the weight version that computed it. Raises
        InferenceError naming every server that failed to answer (none of the answers is returned then)."""
        targets = [s for s in self.servers if s.healthy and not s.restarting and s.given_up is None]
        if not targets:
            raise ServerUnavailableError("No healthy inference server to score on: "
                                         + "; ".join(repr(s) for s in self.servers))
        for s in targets:
            self._scorer(s)
        answers = await asyncio.gather(*(self._score_on(s, token_ids, start, timeout_s) for s in targets),
                                       return_exceptions=True)
        failed = [f"{s.server_id}: {a}" for s, a in zip(targets, answers, strict=True) if isinstance(a, BaseException)]
        if failed:
            raise InferenceError(f"{len(failed)} of {len(targets)} server(s) failed to score: " + "; ".join(failed))
        return {s.server_id: a for s, a in zip(targets, answers, strict=True) if isinstance(a, ScoreResponse)}

    # ── fleet control ───────────────────────────────────────────────────────────────────────
    def _lock(self) -> asyncio.Lock:
        if self._push_lock is None:
            self._push_lock = asyncio.Lock()
        return self._push_lock

    async def update_weights(
        self, source: str, version: int, *, token: str | None = None, attempts: int = 2
    ) -> dict[str, Any]:
        """Load weights `version` from `source` on every live server, then serve only `version`.

        `source` is a weights directory the servers can read (files engine) or a trainer's weight
        endpoint URL (http engine, with its bearer `token`). Each server verifies every bucket's
        checksum before loading it. A server that dies during the push (unreachable, 5xx) is marked
        failed and gets these weights when it answers again (`resync`). A server that answers but
        cannot load them is asked again, up to `attempts` times in all, and if it still fails this
        raises WeightSyncError naming each such server and its reason (those servers refuse to
        serve until a push succeeds). Returns each server's load report (`WeightLoadReport`, or
        None for engines that give none) by server id.
        """
        cannot = [s.server_id for s in self.servers if not hasattr(s.client, "update_weights")]
        if cannot:
            raise InferenceError(
                f"Servers {cannot} cannot load weights (external OpenAI-compatible servers have no such call); "
                "update them yourself, then call set_version()."
            )
        if attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {attempts}")
        async with self._lock():
            self.last_push = (source, version, token)
            # Servers that answer but do not serve (a push that failed part-way) need this push most.
            live = [s for s in self.servers if not s.restarting and s.given_up is None]
            reachable = await asyncio.gather(*(self._answers(s) for s in live))
            targets = [s for s, ok in zip(live, reachable, strict=True) if ok]
            outcomes = await asyncio.gather(*(self._push_one(s, source, version, token, attempts) for s in targets))
        await self.check_health()
        failed = {s.server_id: out for s, out in zip(targets, outcomes, strict=True) if isinstance(out, str)}
        outcomes = [None if out is _DIED else out for out in outcomes]
        if failed:
            reasons = "; ".join(f"{sid}: {why}" for sid, why in failed.items())
            raise WeightSyncError(
                f"Weight version {version} from {source} did not load on {len(failed)} of {len(targets)} "
                f"server(s) after {attempts} attempt(s) each: {reasons}. A server whose push failed part-way "
                "serves nothing until a push succeeds. Check that the trainer's weights are readable from the "
                "servers (weights.backend) and intact, then resume the run (resume=true)."
            )
        self.set_version(version)
        return {s.server_id: getattr(out, "push", None) for s, out in zip(targets, outcomes, strict=True)}

    async def _answers(self, server: RoutedServer) -> bool:
        if server.healthy:
            return True
        health = getattr(server.client, "health", None)
        if health is None:
            return False
        try:
            await health(timeout_s=self.health_timeout_s)
        except (InferenceError, OSError, TimeoutError):
            return False
        return True

    async def _push_one(self, server: RoutedServer, source: str, version: int, token: str | None,
                        attempts: int) -> Any:
        """One server's load, retried: its answer; `_DIED` if it died meanwhile (marked failed,
        re-synced when it is back); or the reason it could not load the weights (a string)."""
        kwargs = {"token": token} if token is not None else {}
        reason = ""
        for attempt in range(1, attempts + 1):
            try:
                return await server.client.update_weights(source, version, **kwargs)
            except ServerUnavailableError as exc:
                log.warning("inference server %s failed during the push of weights version %d (%s); it gets "
                            "them when it answers again", server.server_id, version, exc)
                self._mark_failed(server)
                return _DIED
            except InferenceError as exc:
                reason = str(exc)
                log.warning("weight version %d failed on %s (attempt %d of %d): %s", version, server.server_id,
                            attempt, attempts, exc)
        return reason

    async def sync_server(self, server_id: str) -> Any:
        """Push the last pushed weights (`update_weights`' source and version) to one server, e.g. one
        that restarted; returns its load report. Raises WeightSyncError if it cannot load them."""
        if self.last_push is None:
            raise WeightSyncError("No weights were pushed through this router yet; nothing to re-sync.")
        source, version, token = self.last_push
        server = next((s for s in self.servers if s.server_id == server_id), None)
        if server is None:
            raise InferenceError(f"No server {server_id!r} behind this router; known: {[s.server_id for s in self.servers]}")
        async with self._lock():
            out = await self._push_one(server, source, version, token, 2)
        await self._check_one(server)
        self._refresh_eligibility()
        if out is _DIED or isinstance(out, str):
            raise WeightSyncError(f"Server {server_id} could not load weight version {version} from {source}: "
                                  f"{'it stopped answering' if out is _DIED else out}")
        return getattr(out, "push", None)

    async def check_weight_source(self, source: str, expected: str, *, token: str | None = None) -> None:
        """Check that every healthy server reads the nonce `expected` from `source` (see
        `agentrl.weights.sources.probe_source`); raise WeightSyncError naming the servers that do not.

        Servers whose client cannot probe (SGLang) are not checked."""
        targets = [s for s in self.servers if s.healthy and hasattr(s.client, "probe_weights")]
        kwargs = {"token": token} if token is not None else {}
        answers = await asyncio.gather(*(s.client.probe_weights(source, **kwargs) for s in targets),
                                       return_exceptions=True)
        bad = []
        for server, answer in zip(targets, answers, strict=True):
            if isinstance(answer, BaseException):
                bad.append(f"{server.server_id}: {answer}")
            elif answer.nonce != expected:
                bad.append(f"{server.server_id}: {answer.error or f'read {answer.nonce!r}, not what the trainer wrote'}")
        if bad:
            raise WeightSyncError(
                f"{len(bad)} of {len(targets)} server(s) cannot reach the trainer's weights at {source}: "
                + "; ".join(bad)
            )

    async def resync(self, server: RoutedServer | int) -> None:
        """Push the weights pushed last to `server` alone if it is behind them (it came back after a
        restart, or missed a push), so it can serve again. Safe to call at any time; a server that
        cannot load them stays out of rotation (logged) and is tried again at its next health check."""
        s = self.servers[server] if isinstance(server, int) else server
        s.syncing = True
        try:
            async with self._lock():
                await self._check_one(s)
                if not self._behind(s) or self.last_push is None:
                    return
                source, version, token = self.last_push
                start = time.monotonic()
                out = await self._push_one(s, source, version, token, 1)
                if out is _DIED or isinstance(out, str):
                    log.warning("re-syncing inference server %s to weights version %d failed: %s",
                                s.server_id, version, "it stopped answering" if out is _DIED else out)
                    return
                self.counters["resyncs"] += 1
                log.info("inference server %s re-synced to weights version %d (%.1f s)", s.server_id, version,
                         time.monotonic() - start)
                await self._check_one(s)
        finally:
            s.syncing = False
            self._refresh_eligibility()
            self._verify_later(s)

    # ── supervision (see serve.ServerSupervisor) ────────────────────────────────────────────
    def server_down(self, index: int) -> None:
        """Server `index` died and is being restarted: route around it until it is back and re-synced."""
        s = self.servers[index]
        s.restarting, s.healthy, s.verified_version = True, False, None
        self._refresh_eligibility()

    def server_restarted(self, index: int) -> None:
        """Server `index` answers /health again; it serves once it holds the current weights."""
        self.servers[index].restarting = False
        self._refresh_eligibility()

    def give_up(self, index: int, reason: str) -> None:
        """Server `index` will not come back. Once every server is given up, requests fail at once."""
        s = self.servers[index]
        s.given_up, s.restarting, s.healthy = reason, False, False
        log.error("inference server %s is given up: %s", s.server_id, reason)
        if all(x.given_up is not None for x in self.servers):
            self.fatal = ServerUnavailableError(
                "Every inference server is down and could not be restarted: "
                + "; ".join(f"{x.server_id}: {x.given_up}" for x in self.servers)
            )
        self._refresh_eligibility()

    def stats(self) -> dict[str, Any]:
        return {
            **self.counters,
            "sessions": len(self._sessions),
            "servers": [
                {
                    "server_id": s.server_id,
                    "load": s.load,
                    "healthy": s.healthy,
                    "weight_version": s.weight_version,
                    "sessions": s.sessions,
                    "restarting": s.restarting,
                    "given_up": s.given_up,
                }
                for s in self.servers
            ],
        }

    async def aclose(self) -> None:
        tasks = [*self._syncs, *self._verifies]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
            self._health_task = None
        for s in self.servers:
            await s.client.aclose()


def _as_client(server: Any) -> Any:
    if isinstance(server, str):
        from agentrl.inference.client import HTTPServerClient

        return HTTPServerClient(server)
    return server
