"""The job's resource table (`agentrl.orchestration.job_resources`) and `Job` as an async context, with
fake rows: a row is made only for an env that takes it, opens eagerly only when it has an `open`,
closes in reverse order, once, every close running even when one fails (then all failures are raised
together, or logged when the block itself failed); `env.kwargs` setting a row's parameter is refused
naming its key. The real table's reward rows: the job owns the judge server and reward model its
reward scores with."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from agentrl.config import load_config
from agentrl.envs import Env
from agentrl.envs.arithmetic import ArithmeticEnv
from agentrl.envs.judge import JudgeReward
from agentrl.envs.judge_server import JudgeServer
from agentrl.envs.reward_model import RewardModelScorer
from agentrl.envs.reward_sources import CombinedReward
from agentrl.errors import ConfigError, ResourceCloseError
from agentrl.orchestration.build import ENV_RESOURCES, Job, env_arguments
from agentrl.orchestration.job_resources import (
    JUDGE_SERVER,
    REWARD_FN,
    REWARD_MODEL,
    JobResources,
    ResourceRow,
    build_resources,
    refuse_resource_kwargs,
)


class Gadget:
    """A fake resource that records what happens to it in a shared list."""

    def __init__(self, name: str, events: list[str], *, fail_close: bool = False) -> None:
        self.name, self.events, self.fail_close = name, events, fail_close
        events.append(f"make {name}")

    async def start(self) -> None:
        self.events.append(f"open {self.name}")

    async def stop(self) -> None:
        self.events.append(f"close {self.name}")
        if self.fail_close:
            raise RuntimeError(f"{self.name} would not stop")


class GadgetEnv(Env):
    """Takes `lazy`, `eager` and `limit` (a plain value), not `unused`."""

    def __init__(self, lazy: Gadget | None = None, eager: Gadget | None = None, limit: int = 0) -> None:
        super().__init__()
        self.lazy, self.eager, self.limit = lazy, eager, limit


def _rows(events: list[str], *, failing: str = "") -> list[ResourceRow[Any]]:
    def gadget(name: str) -> Any:
        return lambda r: Gadget(name, events, fail_close=name == failing)

    def refuse(config: Any, env_cls: type[Env]) -> None:
        events.append("refused unused")

    return [
        ResourceRow("lazy", gadget("lazy"), close=lambda g: g.stop()),
        ResourceRow("eager", gadget("eager"), key="gadgets.eager", open=lambda g: g.start(), close=lambda g: g.stop()),
        ResourceRow("unused", gadget("unused"), close=lambda g: g.stop(), unwanted=refuse),
        ResourceRow("limit", lambda r: 7, key="gadgets.limit"),
        ResourceRow("helper", gadget("helper"), close=lambda g: g.stop(), to_env=False, wanted_by="lazy"),
    ]


def _resources(events: list[str], *, failing: str = "") -> JobResources:
    return build_resources(load_config(None, ["env=arithmetic"]), GadgetEnv, _rows(events, failing=failing))


def _job(resources: JobResources) -> Job:
    """A Job around `resources` only (the rest is never touched by these tests)."""
    return Job(resources.config, "eval", "model", None, lambda: None, "hermes", (), GadgetEnv,  # type: ignore[arg-type]
               resources.env_kwargs(), resources)


def test_the_env_gets_the_rows_it_takes_made_in_order_and_none_opened_before_the_job_is_entered() -> None:
    events: list[str] = []
    resources = _resources(events)
    assert events == ["make lazy", "make eager", "refused unused", "make helper"]
    kwargs = resources.env_kwargs()
    assert sorted(kwargs) == ["eager", "lazy", "limit"]  # the helper is the job's, not the env's
    assert kwargs["limit"] == 7 and resources.values["helper"].name == "helper"
    env = GadgetEnv(**kwargs)
    assert env.lazy is resources.values["lazy"] and env.eager is resources.values["eager"] and env.limit == 7


def test_entering_the_job_opens_the_eager_rows_and_leaving_it_closes_all_in_reverse_order_once() -> None:
    events: list[str] = []
    job = _job(_resources(events))
    events.clear()

    async def main() -> None:
        async with job as entered:
            assert entered is job
            assert events == ["open eager"]  # `lazy` and `helper` start on first use
        await job.aclose()  # twice: nothing more happens

    asyncio.run(main())
    assert events == ["open eager", "close helper", "close eager", "close lazy"]
    assert "lazy" not in job.env_kwargs and job.env_kwargs["limit"] == 7  # a closed resource is handed to no new env
    assert job.resources.get(ResourceRow("lazy", lambda r: None)) is job.resources.values["lazy"]  # closed, kept


def test_a_failing_close_does_not_stop_the_others_and_is_raised_naming_it(caplog: pytest.LogCaptureFixture) -> None:
    events: list[str] = []
    resources = _resources(events, failing="eager")
    events.clear()
    with caplog.at_level(logging.ERROR), pytest.raises(ResourceCloseError) as info:
        asyncio.run(resources.aclose())
    assert events == ["close helper", "close eager", "close lazy"]
    assert [name for name, _ in info.value.failures] == ["eager"]
    assert "eager (RuntimeError: eager would not stop)" in str(info.value)
    assert "closing the job's eager failed: RuntimeError: eager would not stop" in caplog.text
    asyncio.run(resources.aclose())  # closing again: nothing left to close, nothing raised
    assert events == ["close helper", "close eager", "close lazy"]


def test_the_blocks_own_error_wins_over_a_failing_close(caplog: pytest.LogCaptureFixture) -> None:
    events: list[str] = []
    job = _job(_resources(events, failing="lazy"))

    async def main() -> None:
        async with job:
            raise KeyError("the eval's own failure")

    with caplog.at_level(logging.ERROR), pytest.raises(KeyError, match="the eval's own failure"):
        asyncio.run(main())
    assert events[-3:] == ["close helper", "close eager", "close lazy"]
    assert "closing the job's lazy failed" in caplog.text


def test_a_failing_open_closes_what_was_made() -> None:
    events: list[str] = []

    async def broken(gadget: Gadget) -> None:
        raise OSError("no room")

    rows = [*_rows(events)[:1], ResourceRow("eager", lambda r: Gadget("eager", events), open=broken,
                                            close=lambda g: g.stop())]
    job = _job(build_resources(load_config(None, ["env=arithmetic"]), GadgetEnv, rows))

    async def main() -> None:
        async with job:
            raise AssertionError("never entered")

    with pytest.raises(OSError, match="no room"):
        asyncio.run(main())
    assert events == ["make lazy", "make eager", "close eager", "close lazy"]


def test_a_failing_build_closes_the_rows_made_before_it() -> None:
    events: list[str] = []

    def broken(resources: JobResources) -> Any:
        raise ConfigError("gadgets.eager: no such gadget")

    rows = [*_rows(events)[:1], ResourceRow("eager", broken, key="gadgets.eager")]
    with pytest.raises(ConfigError, match="gadgets.eager: no such gadget"):
        build_resources(load_config(None, ["env=arithmetic"]), GadgetEnv, rows)
    assert events == ["make lazy", "close lazy"]


def test_env_kwargs_setting_a_resource_is_refused_naming_the_key() -> None:
    rows = _rows([])
    with pytest.raises(ConfigError, match=r"env.kwargs.eager: the run sets this for every env through "
                                          r"gadgets.eager; set gadgets.eager instead"):
        refuse_resource_kwargs({"eager": 1}, rows)
    with pytest.raises(ConfigError, match="env.kwargs.lazy: the job gives every env that takes one its lazy"):
        refuse_resource_kwargs({"lazy": 1}, rows)
    refuse_resource_kwargs({"helper": 1, "other": 2}, rows)  # no env takes the helper from the table
    # the real table, through the config
    assert ENV_RESOURCES["max_turns"] == "rollout.max_turns" and ENV_RESOURCES["gateway"] is None
    assert "judge_server" not in ENV_RESOURCES
    for given, key in (("{max_turns: 3}", "rollout.max_turns"), ("{tool_timeout_s: 3}", "rollout.tool_timeout_s"),
                       ("{sandbox: x}", "sandbox")):
        with pytest.raises(ConfigError, match=f"env.kwargs.{given[1:].split(':')[0]}: .* through {key};"):
            env_arguments(load_config(None, ["env=arithmetic", f"env.kwargs={given}"]))
    for name in ("gateway", "shared_mcp", "verifiers_worker"):
        with pytest.raises(ConfigError, match=f"env.kwargs.{name}: the job gives every env"):
            env_arguments(load_config(None, ["env=arithmetic", f"env.kwargs={{{name}: x}}"]))


def test_the_job_owns_the_judge_server_and_reward_model_its_reward_scores_with(
        monkeypatch: pytest.MonkeyPatch) -> None:
    closed: list[str] = []
    monkeypatch.setattr(JudgeServer, "close", lambda self: closed.append("judge server"))
    monkeypatch.setattr(RewardModelScorer, "close", lambda self: closed.append("reward model"))
    config = load_config(None, ["env=arithmetic", "reward.judge.model_path=/models/judge",
                                "reward.model.path=/models/rm",
                                "reward.combine=[{source: judge, weight: 0.5}, {source: model, weight: 0.5}]"])
    env_cls, kwargs, resources = env_arguments(config)
    server, model, reward = resources.get(JUDGE_SERVER), resources.get(REWARD_MODEL), resources.get(REWARD_FN)
    assert isinstance(server, JudgeServer) and server.pid is None  # made, not started
    assert isinstance(model, RewardModelScorer) and model.path == "/models/rm"
    assert isinstance(reward, CombinedReward) and kwargs["reward_fn"] is reward
    assert "judge_server" not in kwargs and "reward_model" not in kwargs  # the reward's, through the job
    judge = next(scorer for source, _, scorer in reward.parts if source == "judge")
    assert isinstance(judge, JudgeReward) and judge.server is server
    assert next(scorer for source, _, scorer in reward.parts if source == "model") is model
    env = env_cls(**kwargs)
    assert isinstance(env, ArithmeticEnv) and env.reward_fn is reward
    env.close()
    reward.stop()  # what the job gave the reward is the job's to close
    assert closed == []
    asyncio.run(resources.aclose())
    assert closed == ["reward model", "judge server"]  # reverse table order
    # a reward with neither (a judge at a URL) makes no such rows
    url_only = env_arguments(load_config(None, ["env=arithmetic", "reward.judge.url=http://127.0.0.1:9/v1"]))[2]
    assert url_only.get(JUDGE_SERVER) is None and url_only.get(REWARD_MODEL) is None
    assert isinstance(url_only.get(REWARD_FN), CombinedReward)


def test_a_reward_built_alone_still_owns_and_stops_its_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    from agentrl.envs.reward_sources import build_reward

    closed: list[str] = []
    monkeypatch.setattr(JudgeServer, "close", lambda self: closed.append("judge server"))
    monkeypatch.setattr(RewardModelScorer, "close", lambda self: closed.append("reward model"))
    config = load_config(None, ["reward.judge.model_path=/models/judge", "reward.model.path=/models/rm",
                                "reward.combine=[{source: judge, weight: 0.5}, {source: model, weight: 0.5}]"])
    reward = build_reward(config.reward)
    assert isinstance(reward, CombinedReward)
    reward.stop()
    assert closed == ["judge server", "reward model"]
