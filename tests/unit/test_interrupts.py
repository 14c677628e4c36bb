"""SIGINT, SIGTERM and SIGHUP stop a run alike: real signals sent to this process, handled by
`StopSignals` around a real event loop, and the exit status `agentrl run` gives each."""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import sys
import time

import pytest

from agentrl.cli import main
from agentrl.orchestration.interrupts import STOP_SIGNALS, RunInterrupted, StopSignals

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


async def stopped_by(signals: StopSignals, signum: int) -> str:
    """Send `signum` to this process while the task waits, as a scheduler would; what the task saw."""
    signals.watch(asyncio.current_task(), asyncio.get_running_loop())
    try:
        os.kill(os.getpid(), signum)
        await asyncio.sleep(30)  # the loop sleeps in select(): the handler must wake it
    except asyncio.CancelledError as exc:
        return f"cancelled: {exc}"
    return "not stopped"


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_each_stop_signal_cancels_the_run_s_task_as_ctrl_c_does(signum: int) -> None:
    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    signals = StopSignals()
    with signals.installed():
        assert signal.getsignal(signal.SIGTERM) == signals.handle  # not Ray's, not the default
        seen = asyncio.run(stopped_by(signals, signum))
    assert seen == f"cancelled: {signal.Signals(signum).name} received"
    assert signals.received == signum
    assert {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} == before, "the previous handlers are back"


def test_inside_a_blocking_start_and_on_a_second_signal_it_raises_at_once() -> None:
    signals = StopSignals()

    async def blocking_start() -> None:
        signals.watch(asyncio.current_task(), asyncio.get_running_loop())
        with signals.raising():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # a blocking call: the signal ends it (Python runs its handler at once)
            raise AssertionError("the start went on after SIGTERM")

    with signals.installed(), pytest.raises(KeyboardInterrupt):
        asyncio.run(blocking_start())
    assert signals.received == signal.SIGTERM

    async def twice() -> None:
        signals.watch(asyncio.current_task(), asyncio.get_running_loop())
        os.kill(os.getpid(), signal.SIGHUP)  # received already (SIGTERM above): a second signal
        await asyncio.sleep(30)

    with signals.installed(), pytest.raises(KeyboardInterrupt):
        asyncio.run(twice())


def test_the_handler_takes_sigterm_back_after_something_else_took_it() -> None:
    signals = StopSignals()
    with signals.installed():
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(15))  # what ray.init does
        signals.install()
        assert signal.getsignal(signal.SIGTERM) == signals.handle
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_the_exit_status_is_128_plus_the_signal_and_the_message_has_the_command() -> None:
    assert [RunInterrupted(s).exit_status for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)] == [130, 143, 129]
    exc = RunInterrupted(signal.SIGTERM, "agentrl run runs/mine/config.yaml resume=true run.name=mine")
    assert isinstance(exc, KeyboardInterrupt)
    copied = pickle.loads(pickle.dumps(exc))
    assert (copied.signum, copied.resume, str(copied)) == (exc.signum, exc.resume, str(exc))
    assert str(exc) == ("the run was interrupted (SIGTERM); continue it with: "
                        "agentrl run runs/mine/config.yaml resume=true run.name=mine")


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGTERM, 143), (signal.SIGHUP, 129), (signal.SIGINT, 130)])
def test_agentrl_run_exits_with_the_signal_s_status_and_prints_the_command(
    signum: int, status: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import agentrl.cli as cli
    import agentrl.orchestration.driver as driver

    def interrupted(config: object) -> None:
        raise RunInterrupted(signum, "agentrl run runs/mine/config.yaml resume=true run.name=mine")

    monkeypatch.setattr(driver, "run_training", interrupted)
    monkeypatch.setattr(cli, "_log_to_console", lambda: None)  # no handler left on the agentrl logger
    assert main(["run", "env=arithmetic", "run.name=mine"]) == status
    err = capsys.readouterr().err
    assert f"agentrl run: the run was interrupted ({signal.Signals(signum).name})" in err
    assert "resume=true run.name=mine" in err


@pytest.mark.parametrize("closing_raises", [None, BrokenPipeError(32, "Broken pipe")])
def test_run_training_turns_a_sigterm_into_run_interrupted_whatever_the_closing_raised(
    closing_raises: BaseException | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run's closing can fail after the signal (a cluster's connection already gone raised a
    BrokenPipeError, which the CLI took for a closed pipe and exit 0): the run still ends as interrupted."""
    from types import SimpleNamespace

    import agentrl.orchestration.driver as driver
    from agentrl.config import load_config

    config = load_config(None, ["env=arithmetic", "run.name=mine"])

    async def main(self: driver.Run) -> None:
        self.signals.watch(asyncio.current_task(), asyncio.get_running_loop())
        self.continue_command = "agentrl run runs/mine/config.yaml resume=true run.name=mine"
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.sleep(30)
        finally:
            if closing_raises is not None:
                raise closing_raises

    monkeypatch.setattr(driver, "build_job", lambda config, purpose: SimpleNamespace(config=config, plan=object()))
    monkeypatch.setattr(driver.Run, "main", main)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RunInterrupted) as caught:
        driver.run_training(config)
    assert caught.value.exit_status == 143 and caught.value.resume.endswith("resume=true run.name=mine")
    assert signal.getsignal(signal.SIGTERM) == before
