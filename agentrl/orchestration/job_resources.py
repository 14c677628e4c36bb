"""What a job hands its environments, as one table: `ResourceRow`, `JOB_RESOURCES`, `JobResources`.

Each row is one thing a run gives its envs through their constructors, by parameter name: how to
make it from the config (starting nothing), how to open it when the job is entered (rows without an
`open` start on first use, as every row does today), how to close it, and the config key that sets
it (so `env.kwargs` cannot set it a second time; rows the job makes with no key name none). An env
gets a row's value when its `__init__` declares the row's `name` (`env_takes`); a row whose value no
env takes (`to_env=False`: the judge server, the reward-model process) is made for a later row (the
reward) when an env takes that row's name (`wanted_by`). A row may read the rows made before it.

`build_resources` makes the rows in table order; `JobResources.aopen` opens those with an `open`, in
that order; `JobResources.aclose` closes them in reverse order, runs every close even when one fails
(each failure is logged, then all are raised together as one `ResourceCloseError`) and closes each
once, however often it is called. Adding an adapter adds a row to `JOB_RESOURCES`; nothing else here
or in `Job` changes. This module makes and closes; it starts no process itself.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, cast

from agentrl.config import AgentRLConfig
from agentrl.envs import Env
from agentrl.envs.judge_server import JudgeServer
from agentrl.envs.reward_model import RewardModelScorer
from agentrl.envs.reward_sources import CombinedReward, build_reward, judge_server_for, reward_model_for
from agentrl.envs.rewards import RewardFunction
from agentrl.envs.verifiers_process import VerifiersWorker
from agentrl.errors import AgentRLError, ConfigError, ResourceCloseError, SandboxUnavailableError
from agentrl.gateway.server import SharedGateway
from agentrl.registry import SANDBOXES
from agentrl.sandboxes.protocol import Sandbox
from agentrl.tools.mcp_shared import SharedMCPServers

__all__ = [
    "GATEWAY",
    "JOB_RESOURCES",
    "JUDGE_SERVER",
    "MAX_TURNS",
    "REWARD_FN",
    "REWARD_MODEL",
    "SANDBOX",
    "SHARED_MCP",
    "TOOL_TIMEOUT_S",
    "VERIFIERS_WORKER",
    "JobResources",
    "ResourceRow",
    "build_resources",
    "build_sandbox",
    "env_takes",
    "refuse_resource_kwargs",
]

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class ResourceRow(Generic[T]):
    """One row of the table (see the module docstring)."""

    name: str
    """The env constructor parameter that receives it, and its name in the job's table."""
    build: Callable[[JobResources], T | None]
    """Makes it from `resources.config` and the rows made before it, starting nothing; None: none here."""
    key: str | None = None
    """The config key that sets it, named when `env.kwargs` sets it too; None: the job makes it, no key sets it."""
    open: Callable[[T], Awaitable[object]] | None = None
    """Starts it when the job is entered; None: it starts on first use."""
    close: Callable[[T], Awaitable[object]] | None = None
    """Stops it; None: a plain value, nothing to stop."""
    unwanted: Callable[[AgentRLConfig, type[Env]], None] | None = None
    """For a job whose env does not take it: raises ConfigError when the config sets it anyway."""
    to_env: bool = True
    """False for what the job owns for a later row and no env takes (the judge server its reward uses)."""
    wanted_by: str | None = None
    """The env parameter whose presence makes the job build it (default: `name`)."""


@dataclass
class JobResources:
    """The rows one job made, in table order; opened by `aopen`, closed (once) by `aclose`."""

    config: AgentRLConfig
    env_cls: type[Env]
    rows: Sequence[ResourceRow[Any]] = ()
    values: dict[str, Any] = field(default_factory=dict)
    """Each made row's value by name (a row with none here is absent)."""
    _opened: list[str] = field(default_factory=list, init=False, repr=False)
    _closed: set[str] = field(default_factory=set, init=False, repr=False)

    def get(self, row: ResourceRow[T]) -> T | None:
        """`row`'s value in this job (closed once the job is), or None when the job has none."""
        return cast("T | None", self.values.get(row.name))

    def env_kwargs(self) -> dict[str, Any]:
        """What every env of the job gets: each made row an env takes, by parameter name."""
        by_name = {row.name: row for row in self.rows}
        return {name: value for name, value in self.values.items() if by_name[name].to_env}

    def made(self) -> Iterator[tuple[ResourceRow[Any], Any]]:
        """The made rows with their values, in table order."""
        for row in self.rows:
            if row.name in self.values:
                yield row, self.values[row.name]

    async def aopen(self) -> None:
        """Open the rows that open eagerly, in table order; a failing open closes those already open."""
        for row, value in self.made():
            if row.open is None or row.name in self._opened:
                continue
            try:
                await row.open(value)
            except BaseException:
                try:
                    await self.aclose()
                except ResourceCloseError as exc:  # the open's error is the one to see
                    log.debug("closing after a failed open: %s", exc)
                raise
            self._opened.append(row.name)

    async def aclose(self) -> None:
        """Close every made row once, in reverse table order, each even when an earlier close failed;
        then raise `ResourceCloseError` naming every one that failed."""
        failures: list[tuple[str, BaseException]] = []
        for row, value in reversed(list(self.made())):
            if row.name in self._closed:
                continue
            self._closed.add(row.name)
            if row.close is None:
                continue
            try:
                await row.close(value)
            except Exception as exc:
                log.error("closing the job's %s failed: %s: %s", row.name, type(exc).__name__, exc)
                failures.append((row.name, exc))
        if failures:
            raise ResourceCloseError(failures)


def env_takes(env_cls: type, name: str) -> bool:
    """Whether `env_cls(...)` accepts a keyword argument `name` (declared, not through **kwargs)."""
    try:
        params = inspect.signature(env_cls).parameters
    except (TypeError, ValueError):
        return False
    param = params.get(name)
    return param is not None and param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)


def refuse_resource_kwargs(kwargs: dict[str, Any], rows: Sequence[ResourceRow[Any]]) -> None:
    """Refuse `env.kwargs` that set what a row gives every env, naming the key (one knob per budget)."""
    for row in rows:
        if not row.to_env or row.name not in kwargs:
            continue
        if row.key is None:
            raise ConfigError(f"env.kwargs.{row.name}: the job gives every env that takes one its {row.name} "
                              "(one for all episodes); remove it.")
        raise ConfigError(f"env.kwargs.{row.name}: the run sets this for every env through {row.key}; set "
                          f"{row.key} instead (one knob per budget).")


def build_resources(config: AgentRLConfig, env_cls: type[Env],
                    rows: Sequence[ResourceRow[Any]] | None = None) -> JobResources:
    """Make every row of `rows` (by default `JOB_RESOURCES`) the env takes, in order, starting nothing;
    a row it does not take is refused when the config sets it. On an error, what was made is closed."""
    resources = JobResources(config, env_cls, JOB_RESOURCES if rows is None else rows)
    try:
        for row in resources.rows:
            if not env_takes(env_cls, row.wanted_by or row.name):
                if row.unwanted is not None:
                    row.unwanted(config, env_cls)
                continue
            value = row.build(resources)
            if value is not None:
                resources.values[row.name] = value
    except BaseException:
        try:
            asyncio.run(resources.aclose())
        except Exception as exc:  # the build error is what the user needs to see
            log.debug("closing after a failed build: %s", exc)
        raise
    return resources


# ── the rows ───────────────────────────────────────────────────────────────────────────────


def build_sandbox(config: AgentRLConfig) -> Sandbox:
    """The sandbox `config.sandbox` names, made (not started). Errors name the key: a backend's
    ConfigError names its own argument (`ro_paths[1]: ...`), which becomes `sandbox.kwargs.ro_paths[1]`."""
    try:
        cls = SANDBOXES.resolve(config.sandbox.name)
    except AgentRLError as exc:
        raise ConfigError(f"sandbox.name: {exc}") from exc
    try:
        return cast(Sandbox, cls(**config.sandbox.kwargs))
    except SandboxUnavailableError as exc:
        raise SandboxUnavailableError(f"sandbox.name={config.sandbox.name}: {exc}") from exc
    except TypeError as exc:
        raise ConfigError(f"sandbox.kwargs: the '{config.sandbox.name}' sandbox does not take these arguments: {exc}") from exc
    except ConfigError as exc:
        lines = [f"sandbox.kwargs.{line}" for line in exc.errors]
        raise ConfigError("\n".join(lines), errors=lines) from exc
    except ValueError as exc:
        raise ConfigError(f"sandbox.kwargs: {exc}") from exc


def _build_sandbox(resources: JobResources) -> Sandbox:
    return build_sandbox(resources.config)


def _no_sandbox(config: AgentRLConfig, env_cls: type[Env]) -> None:
    if config.sandbox.model_fields_set:
        raise ConfigError(
            f"sandbox: env '{config.env.name}' runs no code in a sandbox (its constructor takes no "
            "'sandbox'), so these settings would do nothing; remove them."
        )


def _no_reward(config: AgentRLConfig, env_cls: type[Env]) -> None:
    reward = config.reward
    if reward.function is not None or reward.kwargs or reward.judge or reward.model or reward.combine:
        raise ConfigError(
            f"reward.function: env '{config.env.name}' scores its episodes itself (its constructor takes no "
            "reward_fn), so a reward function would do nothing; remove reward.function, reward.kwargs, "
            "reward.judge, reward.model and reward.combine."
        )


async def _close_in_thread(close: Callable[[], object]) -> None:
    await asyncio.to_thread(close)


VERIFIERS_WORKER: ResourceRow[VerifiersWorker] = ResourceRow(
    "verifiers_worker", lambda r: VerifiersWorker(), close=lambda w: w.aclose())
"""The process that loads and scores verifiers tasksets (`VerifiersEnv`); it starts when the env's rows
are first asked for. First in the table: it raises when verifiers is not installed."""

SANDBOX: ResourceRow[Sandbox] = ResourceRow(
    "sandbox", _build_sandbox, key="sandbox", close=lambda s: s.close(), unwanted=_no_sandbox)
"""The one sandbox built from `config.sandbox`; it starts its workers when first used."""

GATEWAY: ResourceRow[SharedGateway] = ResourceRow("gateway", lambda r: SharedGateway(), close=lambda g: g.aclose())
"""The gateway the envs that run agents through one share (`AgentEnv`); the first episode starts it."""

SHARED_MCP: ResourceRow[SharedMCPServers] = ResourceRow(
    "shared_mcp", lambda r: SharedMCPServers(), close=lambda m: m.aclose())
"""The MCP servers the run's episodes share (`per_episode: false`, `McpEnv`); started on first use."""

JUDGE_SERVER: ResourceRow[JudgeServer] = ResourceRow(
    "judge_server", lambda r: judge_server_for(r.config.reward), close=lambda s: _close_in_thread(s.close),
    to_env=False, wanted_by="reward_fn")
"""The judge model the run serves (`reward.judge.model_path`), for the reward; started by its first request."""

REWARD_MODEL: ResourceRow[RewardModelScorer] = ResourceRow(
    "reward_model", lambda r: reward_model_for(r.config.reward), close=lambda m: _close_in_thread(m.close),
    to_env=False, wanted_by="reward_fn")
"""The reward-model process (`reward.model`), for the reward; started by its first score."""


def _build_reward(resources: JobResources) -> RewardFunction | CombinedReward:
    return build_reward(resources.config.reward, judge_server=resources.get(JUDGE_SERVER),
                        reward_model=resources.get(REWARD_MODEL))


REWARD_FN: ResourceRow[RewardFunction | CombinedReward] = ResourceRow(
    "reward_fn", _build_reward, key="reward.function", unwanted=_no_reward)
"""The run's reward: `reward.function` with `reward.kwargs` (verl's `compute_score` by default), or the
sources `reward.combine` weighs, with the judge server and reward model above."""

TOOL_TIMEOUT_S: ResourceRow[float] = ResourceRow(
    "tool_timeout_s", lambda r: r.config.rollout.tool_timeout_s, key="rollout.tool_timeout_s")
MAX_TURNS: ResourceRow[int] = ResourceRow("max_turns", lambda r: r.config.rollout.max_turns, key="rollout.max_turns")

JOB_RESOURCES: tuple[ResourceRow[Any], ...] = (
    VERIFIERS_WORKER, SANDBOX, GATEWAY, SHARED_MCP, JUDGE_SERVER, REWARD_MODEL, REWARD_FN, TOOL_TIMEOUT_S, MAX_TURNS,
)
"""The table, in build order (closed in reverse): add a row here for a new adapter."""
