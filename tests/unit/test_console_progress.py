"""What a run's console shows between step lines, and what a Ray worker keeps off it.

`ProgressTicker` (driven by a fake clock, writing to a buffer): a phase shorter than the period
prints nothing; on a terminal one line is redrawn in place at most every 10 s and cleared when the
phase ends; elsewhere a plain line at most every 30 s. `route_worker_logs` (in this process, its
handlers removed after): every record at INFO and above reaches the worker's log file, and the
console (stderr) gets only agentrl's warnings and anyone's errors, never vLLM's INFO lines.
"""

from __future__ import annotations

import io
import logging
import warnings
from pathlib import Path

import pytest

from agentrl.orchestration.progress import ProgressTicker
from agentrl.orchestration.worker_logs import route_worker_logs


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("tty", [False, True])
def test_the_ticker_says_where_a_long_phase_stands_at_its_period(tty: bool) -> None:
    clock, out = Clock(), io.StringIO()
    ticker = ProgressTicker(out, tty=tty, clock=clock)
    period = 10.0 if tty else 30.0
    ticker.begin("step 2/5: rollouts", total=12)
    clock.now += period - 1
    assert ticker.tick() is None and out.getvalue() == ""  # shorter than the period: silent
    ticker.advance(4)
    clock.now += 1
    assert ticker.tick() == f"step 2/5: rollouts: {period:.0f} s, 4/12 episodes done"
    clock.now += period / 2
    assert ticker.tick() is None  # at most one line per period
    clock.now += period / 2
    ticker.set(9, 12)
    assert ticker.tick() == f"step 2/5: rollouts: {2 * period:.0f} s, 9/12 episodes done"
    ticker.end()
    clock.now += 2 * period
    assert ticker.tick() is None  # no phase, no line
    if tty:
        assert out.getvalue() == ("\r\x1b[Kstep 2/5: rollouts: 10 s, 4/12 episodes done"
                                  "\r\x1b[Kstep 2/5: rollouts: 20 s, 9/12 episodes done\r\x1b[K")
    else:
        assert out.getvalue() == ("step 2/5: rollouts: 30 s, 4/12 episodes done\n"
                                  "step 2/5: rollouts: 60 s, 9/12 episodes done\n")


def test_a_phase_without_episodes_shows_its_time_only() -> None:
    clock, out = Clock(), io.StringIO()
    ticker = ProgressTicker(out, tty=False, clock=clock)
    ticker.begin("step 1/3: training on 8 episodes")
    clock.now += 31
    assert ticker.tick() == "step 1/3: training on 8 episodes: 31 s"


def test_a_worker_logs_everything_to_its_file_and_only_what_needs_the_user_to_the_console(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CONFIGURE_LOGGING", raising=False)
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    root, ours = logging.getLogger(), logging.getLogger("agentrl")
    before, level, ours_before = list(root.handlers), root.level, list(ours.handlers)
    # a worker process starts with no handler: those earlier tests left (the CLI's console handler,
    # some on streams pytest has closed since) are set aside so they cannot write into this test's stderr
    for handler in before:
        root.removeHandler(handler)
    for handler in ours_before:
        ours.removeHandler(handler)
    try:
        path = route_worker_logs(tmp_path / "logs", "trainer-0")
        assert route_worker_logs(tmp_path / "logs", "trainer-0") is None  # once per process
        logging.getLogger("vllm.engine").info("Automatically detected platform cpu.")
        logging.getLogger("vllm.worker").warning("Pin memory is not supported on this platform.")
        logging.getLogger("agentrl.trainer").info("loaded the policy")
        logging.getLogger("agentrl.trainer").warning("the trainer fell back to float32")
        logging.getLogger("vllm.engine").error("the engine failed")
        warnings.warn("`torch.distributed.reduce_op` is deprecated", FutureWarning, stacklevel=1)
    finally:
        logging.captureWarnings(False)
        for handler in root.handlers[:]:
            root.removeHandler(handler)
            handler.close()
        for handler in before:
            root.addHandler(handler)
        for handler in ours_before:
            ours.addHandler(handler)
        root.setLevel(level)
    import os

    assert os.environ["VLLM_CONFIGURE_LOGGING"] == "0" and os.environ["TQDM_DISABLE"] == "1"
    assert path == tmp_path / "logs" / "trainer-0.log"
    written = path.read_text()
    for text in ("detected platform cpu", "Pin memory", "loaded the policy", "fell back to float32", "engine failed",
                 "reduce_op` is deprecated"):
        assert text in written
    console = capsys.readouterr().err.splitlines()
    assert console == ["WARNING agentrl.trainer: the trainer fell back to float32", "ERROR vllm.engine: the engine failed"]
