"""`openenv`: an OpenEnv environment (PyPI `openenv-core`) played over OpenEnv's own protocol.

    agentrl eval env=openenv env.kwargs.url=http://127.0.0.1:8000      # a server that runs already
    agentrl eval env=openenv 'env.kwargs.command=[python, my_server.py, --port, "{port}"]'

Each episode opens its own OpenEnv session (the package's `GenericEnvClient`: a WebSocket to the
server's `/ws`, where the server keeps one environment instance per session), resets it with the
row's seed and plays it: the reset observation is the first user message (after `system_prompt`
and the row's `prompt`), each assistant turn's text becomes the action (`{action_field: text}`),
and each step's observation is the next user message. Rewards are the server's, summed over the
steps; the episode ends when the server says `done`. agentrl generates every turn itself (token in,
token out); the server only sees text.

With `command` instead of `url`, agentrl starts the server for each episode on a free port (the
`{port}` placeholder of the command), waits for its `/health`, and stops it (its whole process
group, under a lifeline that also ends it if agentrl dies) when the episode ends, so nothing it
started outlives the episode. `cwd` is the directory the command runs in: a package made by
`openenv init NAME` is served from its own directory (`[python, -m, uvicorn, server.app:app, --port,
"{port}"]` with `cwd` the package's directory, as its README says), unchanged. Every session is
closed when its episode ends.

An env that never says `done` (OpenEnv's generated echo env) ends at `rollout.max_turns`: its
episode is truncated (`finish_reason` max_turns) and scored with the rewards its steps gave, which the
server measured; nothing is added for the cut. A server's own session limit (`create_app(...,
max_concurrent_envs=N)`, 1 in `openenv init`'s template) refuses the N+1st concurrent session of a
`url`: that episode fails as infrastructure with the server's reason and the fix; `command` starts
one server per episode, so it never meets the limit.

What is infrastructure, never a score: a server that does not start, dies, closes the session,
answers an error or does not answer within `message_timeout_s` (the WebSocket handshake included),
and a final step without a reward.
Each raises `EnvServerError`, which the AgentLoop records as fault "infra": the episode is masked
and counted, the others go on. Rows: the env makes its own (`dataset_rows`: one per seed, as
OpenEnv envs draw their tasks at reset); rows of yours may carry `extra_info.seed` and
`extra_info.reset_kwargs` (passed to the server's `reset`).

Not covered: OpenEnv's MCP "production" mode (tools listed by the server), Docker/HF-Space
providers (`from_docker_image`, `from_env`: start the container yourself and give its `url`), and
typed action models other than one text field.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import socket
import sys
from collections.abc import Sequence
from typing import Any, ClassVar

import gymnasium
import httpx

from agentrl.child_process import ChildProcess, HealthURL
from agentrl.envs.core import Env
from agentrl.envs.gym_env import seed_row, seed_rows
from agentrl.errors import ChildNotReadyError, ConfigError, EnvError, EnvServerError, FeatureUnavailableError
from agentrl.types import Action, Message

__all__ = ["OpenEnvEnv", "require_openenv"]

log = logging.getLogger(__name__)

DEFAULT_INSTRUCTIONS = (
    "You are acting in an environment. Each user message is what the environment shows you; "
    "answer with your next action only."
)


def require_openenv() -> Any:
    """The `openenv` package's generic client class, or an error that says how to install it."""
    try:
        from openenv.core.generic_client import GenericEnvClient
    except ImportError as exc:
        raise FeatureUnavailableError(
            f"env=openenv needs the OpenEnv client (PyPI 'openenv-core'): {exc}. Install it with "
            "pip install 'agentrl[dev]' or pip install openenv-core."
        ) from exc
    return GenericEnvClient


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _ServerProcess:
    """One OpenEnv server agentrl started (an `agentrl.child_process.ChildProcess`): its address and log."""

    def __init__(self, command: Sequence[str], startup_timeout_s: float, cwd: str | None = None) -> None:
        self.port = _free_port()
        self.cwd = cwd
        self.argv = [sys.executable if c == "python" else c.replace("{port}", str(self.port)) for c in command]
        self.startup_timeout_s = startup_timeout_s
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: ChildProcess | None = None

    async def start(self) -> None:
        # a process of its own, not an asyncio subprocess: the episode may end on another event loop than it began
        self.proc = ChildProcess(self.argv, name=f"the OpenEnv server {self.argv}", cwd=self.cwd, grace_s=5.0).start()
        try:
            await self.proc.await_ready(HealthURL(f"{self.url}/health"), self.startup_timeout_s, interval_s=0.2)
        except ChildNotReadyError as exc:
            if exc.timed_out:
                raise EnvServerError(
                    f"the OpenEnv server {self.argv} did not answer {self.url}/health within "
                    f"{self.startup_timeout_s:.0f} s; raise env.kwargs.startup_timeout_s if it starts slowly. "
                    f"Its output ends:\n{exc.tail}") from None
            where = f" (in {self.cwd})" if self.cwd else ""
            raise EnvServerError(f"the OpenEnv server {self.argv}{where} {exc.cause} before it answered; its "
                                 f"output ends:\n{exc.tail}") from None

    def log_tail(self, chars: int = 2000) -> str:
        return self.proc.log_tail(lines=200, chars=chars) if self.proc is not None else ""

    async def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            await proc.astop()  # SIGTERM, then up to its grace for the lifeline to stop the server gracefully
            proc.close_log()


class OpenEnvEnv(Env):
    """An OpenEnv environment over its protocol (see the module docstring)."""

    requires_ground_truth: ClassVar[bool] = False

    def __init__(
        self,
        *,
        url: str | None = None,
        command: Sequence[str] | None = None,
        cwd: str | None = None,
        action_field: str = "message",
        observation_field: str | None = None,
        system_prompt: str | None = None,
        instructions: str = DEFAULT_INSTRUCTIONS,
        startup_timeout_s: float = 60.0,
        message_timeout_s: float = 60.0,
    ) -> None:
        if (url is None) == (command is None):
            raise ConfigError(
                "env=openenv needs exactly one of env.kwargs.url (a running OpenEnv server, e.g. "
                "http://127.0.0.1:8000) or env.kwargs.command (a command that serves one on the port "
                "'{port}', e.g. [python, server.py, --port, '{port}'])."
            )
        if command is not None:
            if isinstance(command, str) or not command:
                raise ConfigError(f"env.kwargs.command must be a non-empty list of arguments, got {command!r}.")
            if not any("{port}" in c for c in command):
                raise ConfigError(
                    f"env.kwargs.command {list(command)} has no '{{port}}' placeholder: agentrl starts one server "
                    "per episode on a free port and needs to tell it which, e.g. [python, server.py, --port, '{port}']."
                )
        if cwd is not None:
            if command is None:
                raise ConfigError(f"env.kwargs.cwd ({cwd!r}) is the directory env.kwargs.command runs in; with "
                                  "env.kwargs.url the server runs elsewhere: drop cwd, or give a command.")
            cwd = os.path.abspath(os.path.expanduser(cwd))
            if not os.path.isdir(cwd):
                raise ConfigError(f"env.kwargs.cwd {cwd!r} is not a directory; give the directory the server's "
                                  "command runs in (for an 'openenv init' package, the package's own directory).")
        if url is not None and not url.startswith(("http://", "https://", "ws://", "wss://")):
            raise ConfigError(f"env.kwargs.url '{url}' is not an http(s):// or ws(s):// address.")
        self._client_cls = require_openenv()
        self.url = url.rstrip("/") if url else None
        self.command = list(command) if command is not None else None
        self.cwd = cwd
        self.action_field = action_field
        self.observation_field = observation_field
        self.system_prompt = system_prompt
        self.instructions = instructions
        self.startup_timeout_s = startup_timeout_s
        self.message_timeout_s = message_timeout_s
        self._server: _ServerProcess | None = None
        self._client: Any = None
        self._client_loop: asyncio.AbstractEventLoop | None = None
        self._done = True
        self._steps = 0

    @classmethod
    def dataset_rows(cls, split: str) -> list[dict[str, Any]]:
        """One row per seed (train and test disjoint): OpenEnv envs draw their task at reset."""
        return seed_rows(split, "openenv", DEFAULT_INSTRUCTIONS)

    @staticmethod
    def make_row(seed: int, instructions: str | None = None) -> dict[str, Any]:
        """A row that resets the server with `seed`."""
        return seed_row(seed, "openenv", instructions or DEFAULT_INSTRUCTIONS)

    async def apreflight(self) -> str | None:
        """With `url`: the server answers its /health within `startup_timeout_s` (at most 10 s here).
        A `command`'s server starts per episode, so there is nothing running to ask."""
        if self.url is None:
            return None

        health = self.url.replace("ws://", "http://", 1).replace("wss://", "https://", 1) + "/health"
        try:
            async with httpx.AsyncClient(timeout=min(self.startup_timeout_s, 10.0)) as client:
                answer = await client.get(health)
        except httpx.HTTPError as exc:
            raise EnvServerError(f"the OpenEnv server at {self.url} did not answer {health}: "
                                 f"{type(exc).__name__}: {exc}") from exc
        if answer.status_code != 200:
            raise EnvServerError(f"the OpenEnv server at {self.url} answered {health} with HTTP "
                                 f"{answer.status_code}: {answer.text[:200]}")
        return f"the OpenEnv server at {self.url} answers {health}"

    # ── the contract ────────────────────────────────────────────────────────────────────────
    async def areset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        gymnasium.Env.reset(self, seed=seed)  # seeds self.np_random the standard way
        await self._end_session()
        row = (options or {}).get("row") or self.make_row(seed or 0, self.instructions)
        extra = row.get("extra_info") or {}
        reset_kwargs = dict(extra.get("reset_kwargs") or {})
        episode_seed = extra.get("seed", seed)
        if episode_seed is not None:
            reset_kwargs["seed"] = int(episode_seed)
        try:
            url = self.url
            if self.command is not None:
                self._server = _ServerProcess(self.command, self.startup_timeout_s, self.cwd)
                await self._server.start()
                url = self._server.url
            assert url is not None  # one of url/command is set, checked in __init__
            self._client = self._client_cls(base_url=url, connect_timeout_s=self.message_timeout_s,
                                            message_timeout_s=self.message_timeout_s)
            self._client_loop = asyncio.get_running_loop()
            result = await self._call(self._client.reset(**reset_kwargs), "reset")
        except BaseException:
            await self._end_session()
            raise
        self._done, self._steps = False, 0
        messages: list[Message] = []
        if self.system_prompt:
            messages.append({"role": "system", "content": self.system_prompt})
        prompt = row.get("prompt")
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif isinstance(prompt, list):
            messages.extend(dict(m) for m in prompt)  # type: ignore[misc]  # a plain copy of each TypedDict message
        messages.append({"role": "user", "content": self._observation_text(result.observation)})
        return messages, {"tools": [], "seed": reset_kwargs.get("seed")}

    async def astep(self, action: Action) -> tuple[list[Message], float, bool, bool, dict[str, Any]]:
        if self._client is None or self._done:
            raise EnvError("OpenEnvEnv.step was called without an open episode; call reset first.")
        if not isinstance(action, Action):
            raise EnvError(f"step expects an agentrl.types.Action, got {type(action).__name__}.")
        self._steps += 1
        try:
            result = await self._call(self._client.step({self.action_field: action.text}), "step")
            if result.done and result.reward is None:
                raise EnvServerError("the OpenEnv server ended the episode without a reward: it could not be scored.")
        except BaseException:
            self._done = True
            await self._end_session()
            raise
        done = bool(result.done)
        info: dict[str, Any] = {"metrics": {"openenv_steps": float(self._steps)}}
        if done:
            self._done = True
            await self._end_session()
        reward = float(result.reward or 0.0)
        return [{"role": "user", "content": self._observation_text(result.observation)}], reward, done, False, info

    async def atruncate(self, reason: str) -> tuple[float, dict[str, Any]]:
        self._done = True
        await self._end_session()
        return 0.0, {"metrics": {"openenv_steps": float(self._steps)}}

    async def aclose(self) -> None:
        self._done = True
        await self._end_session()

    # ── internals ───────────────────────────────────────────────────────────────────────────
    async def _call(self, coro: Any, what: str) -> Any:
        where = self._server.url if self._server is not None else self.url
        try:
            return await coro
        except (ConnectionError, OSError, RuntimeError, TimeoutError) as exc:
            # websockets' ConnectionClosed is a ConnectionError subclass only in some versions
            raise EnvServerError(await self._failure(what, where, exc)) from exc
        except Exception as exc:
            if type(exc).__module__.startswith("websockets"):
                raise EnvServerError(await self._failure(what, where, exc)) from exc
            raise

    async def _failure(self, what: str, where: str | None, exc: BaseException) -> str:
        parting = await self._parting_error() if type(exc).__module__.startswith("websockets") else None
        # the refusal arrives either as the answer to the first message (the client raises it as a
        # RuntimeError) or, when the server closed first, as the socket's parting words
        if parting is not None and parting.get("code") == "CAPACITY_REACHED":
            refusal, limit = str(parting.get("message")), str(parting.get("max_sessions", "?"))
        elif "CAPACITY_REACHED" in str(exc):
            found = re.search(r"\d+/(\d+) sessions active", str(exc))
            refusal, limit = str(exc), found.group(1) if found else "?"
        else:
            refusal = limit = ""
        if refusal:
            return (f"the OpenEnv server at {where} refused the session during {what}, at capacity: "
                    f"{refusal} It serves at most {limit} session(s) at once (its create_app(..., "
                    f"max_concurrent_envs={limit})) and agentrl plays up to rollout.max_concurrent_episodes episodes "
                    f"at once. Set rollout.max_concurrent_episodes={limit}, serve it with a higher "
                    "max_concurrent_envs, or give env.kwargs.command instead of url (one server per episode).")
        message = f"the OpenEnv server at {where} failed during {what}: {type(exc).__name__}: {exc}"
        if parting is not None:
            message += f" (the server's last word: {parting.get('message')} (code {parting.get('code')}))"
        server = self._server
        if server is not None and server.proc is not None and server.proc.exit_cause() is not None:
            message += f" (it {server.proc.exit_cause()}; its output ends:\n{server.log_tail()})"
        return message

    async def _parting_error(self) -> dict[str, Any] | None:
        """The error a server sent as it closed the session (its session limit, a failed environment
        factory), if any: the client fails on sending its next message into the closed socket and never
        reads that answer, but the socket still holds it."""
        ws = getattr(self._client, "_ws", None)
        if ws is None or self._client_loop is not asyncio.get_running_loop():
            return None
        try:
            answer = json.loads(await asyncio.wait_for(ws.recv(), 1.0))
        except Exception:  # closed with nothing left to read, or not JSON: no parting words
            return None
        if isinstance(answer, dict) and answer.get("type") == "error" and isinstance(answer.get("data"), dict):
            data: dict[str, Any] = answer["data"]
            return data
        return None

    def _observation_text(self, observation: Any) -> str:
        if not isinstance(observation, dict):
            return str(observation)
        fields = {k: v for k, v in observation.items() if k not in ("done", "reward", "metadata")}
        if self.observation_field is not None:
            if self.observation_field not in fields:
                raise EnvServerError(
                    f"the OpenEnv observation has no field '{self.observation_field}' (env.kwargs.observation_field); "
                    f"it has {sorted(fields)}.")
            return str(fields[self.observation_field])
        texts = [v for v in fields.values() if isinstance(v, str)]
        if len(fields) == 1 and texts:
            return texts[0]
        return json.dumps(fields, default=str)

    async def _end_session(self) -> None:
        client, self._client = self._client, None
        if client is not None and self._client_loop is not asyncio.get_running_loop():
            # the session was opened on an event loop that has ended (sync and async calls mixed): its
            # socket cannot be closed politely from here, so it is dropped (the server ends the session)
            transport = getattr(getattr(client, "_ws", None), "transport", None)
            if transport is not None:
                transport.abort()
        elif client is not None:
            try:
                await asyncio.wait_for(client.close(), 10.0)
            except Exception as exc:  # the session may be gone with its server; closing goes on
                log.debug("closing the OpenEnv session: %s", exc)
        server, self._server = self._server, None
        if server is not None:
            await server.stop()
