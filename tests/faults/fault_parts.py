"""Pieces the fault-injection tests plug into real runs: sandboxes that break, envs that break things.

`BreakingSandbox` is a real `LocalSandbox` that serves its first `works_for` executions and then
fails every later one as an infrastructure failure would (`SandboxError`). The pre-flight check
builds an instance of its own and runs two snippets on it, so `works_for=2` passes the
pre-flight and breaks the run. `DyingSandbox` is a real `LocalSandbox` whose worker process (bwrap
and the fork server in it) is SIGKILLed in the middle of its `die_on`-th jobs.
`SandboxParityEnv` runs one sandbox command when each episode starts (as a SWE env sets up its
repository), so every episode meets the sandbox whatever the tiny random model writes.
`KillingParityEnv` SIGKILLs a process of the run (an inference server the run started, the trainer
actor, or the colocated trainer actor that hosts the engine) when the `at`-th training episode
starts, the way the OOM killer or a failing node would, and logs when (`agentrl.faults`, so the
time is in the run's `driver.log`); it looks only among the descendants of its own process, so no
other job's processes are touched.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from agentrl.errors import SandboxError
from agentrl.sandboxes.local import LocalSandbox
from agentrl.tools.core import ToolContext

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from parity_env import ParityEnv

__all__ = ["BreakingSandbox", "DyingSandbox", "KillingParityEnv", "SandboxParityEnv", "descendants"]


class BreakingSandbox(LocalSandbox):
    """A LocalSandbox whose executions fail after the first `works_for` (see the module docstring)."""

    def __init__(self, works_for: int = 2, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.works_for = works_for
        self.calls = 0

    async def exec(self, command: str | None = None, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls > self.works_for:
            raise SandboxError("the sandbox's worker process is gone (injected fault)")
        return await super().exec(command, **kwargs)


class DyingSandbox(LocalSandbox):
    """A LocalSandbox whose worker is SIGKILLed `after_s` into its `die_on`-th jobs (1-based)."""

    def __init__(self, die_on: list[int] | None = None, after_s: float = 0.3, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.die_on = set(die_on or [])
        self.after_s = after_s
        self.jobs = 0
        self.killed: list[int] = []

    async def _take(self) -> Any:
        worker = await super()._take()
        self.jobs += 1
        if self.jobs in self.die_on:
            pid = worker.proc.pid
            asyncio.get_running_loop().call_later(self.after_s, self._kill, pid)
        return worker

    def _kill(self, pid: int) -> None:
        try:
            os.kill(pid, signal.SIGKILL)
            self.killed.append(pid)
        except ProcessLookupError:
            pass


class SandboxParityEnv(ParityEnv):
    """ParityEnv whose episodes start with a sandbox command (see the module docstring)."""

    def __init__(self, max_turns: int = 1, sandbox: Any | None = None, command: str = "echo ready") -> None:
        super().__init__(max_turns=max_turns)
        self.sandbox = sandbox
        self.command = command

    async def create_context(self, episode_id: str, row: dict[str, Any]) -> ToolContext:
        if self.sandbox is None:
            raise SandboxError("SandboxParityEnv was built without a sandbox")
        result = await self.sandbox.exec(self.command, timeout_s=30)
        if result.stdout.strip() != "ready":
            raise SandboxError(f"the episode's set-up command failed: {result.stderr[-200:]}")
        return ToolContext(episode_id=episode_id, sandbox=self.sandbox)


def descendants(pid: int | None = None) -> list[Any]:
    """psutil processes descended from `pid` (default: this process)."""
    import psutil

    try:
        return psutil.Process(pid or os.getpid()).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _cmdline(proc: Any) -> str:
    try:
        return " ".join(proc.cmdline())
    except Exception:  # gone, or not ours to read
        return ""


_RESETS: dict[str, itertools.count[int]] = {}


class KillingParityEnv(ParityEnv):
    """ParityEnv that SIGKILLs a process of the run when training episode number `at` starts.

    `kill`: "server" (an agentrl inference server, vLLM's or hf's, among our descendants whose
    command line contains `match`, never its lifeline), "trainer" (the Ray trainer actor of placement split) or "colocated" (the
    trainer actor that hosts the engine). `tag` keeps the count of each test apart. Only training
    rows count (evaluation episodes do not).
    """

    def __init__(self, max_turns: int = 1, kill: str = "server", at: list[int] | None = None, match: str = "",
                 tag: str = "") -> None:
        super().__init__(max_turns=max_turns)
        self.kill, self.at, self.match, self.tag = kill, set(at or []), match, tag

    async def areset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        row = (options or {}).get("row") or {}
        if "train-" in str(row.get("prompt")):
            n = next(_RESETS.setdefault(f"{self.kill}:{self.tag}", itertools.count(1)))
            if n in self.at:
                self._kill_now()
        return await super().areset(seed=seed, options=options)

    def _kill_now(self) -> None:
        for proc in descendants():
            line = _cmdline(proc)
            if self.kill == "server":
                server = "agentrl.inference.vllm_server" in line or "agentrl.inference.hf_server" in line
                hit = server and "lifeline.py" not in line and self.match in line
            elif self.kill == "colocated":
                hit = line.startswith("ray::ColocatedTrainerWorker")
            else:
                hit = line.startswith("ray::TrainerWorker")
            if hit:
                proc.kill()
                logging.getLogger("agentrl.faults").warning("KillingParityEnv SIGKILLed %s (pid %d)", line[:40],
                                                            proc.pid)
                return
        raise RuntimeError(f"KillingParityEnv found no {self.kill} process to kill (match {self.match!r})")
