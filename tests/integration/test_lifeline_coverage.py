"""Every process a real `agentrl eval` starts is under a lifeline: while a short eval of env=retool
(the tiny random Qwen2 served by the hf engine, the local sandbox's warm workers) runs, /proc is
walked again and again, and each descendant of the agentrl process must have a lifeline
(`agentrl/lifeline.py` in its command line) on its chain of ancestors up to the agentrl process, or
be one. Ray's own processes (and what they start) are the exception: Ray starts them, and the
driver's reaper (`lifeline.start_reaper`, itself a lifeline process) ends them when the driver dies.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentrl.lifeline import LIFELINE_PATH

pytestmark = pytest.mark.slow

_RAY_MARKERS = ("ray::", "/ray/", "raylet", "gcs_server", "ray/dashboard", "ray/_private", "ray.util")


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (ppid, command line) of every process now."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if fields[0] != "Z":
            out[int(entry)] = (int(fields[1]), cmdline.strip())
    return out


def _unguarded(root: int, lifelines: set[str]) -> dict[int, str]:
    """The descendants of `root` with no lifeline on their way up to it (Ray's processes aside);
    adds the command lines of the lifelines among them to `lifelines`."""
    procs = _processes()
    bad = {}
    for pid, (_, cmdline) in procs.items():
        chain, at = [], pid
        while at in procs and at != root and at > 1:
            chain.append(at)
            at = procs[at][0]
        if at != root or not chain:  # not a descendant of the agentrl process
            continue
        commands = [procs[p][1] for p in chain]
        if LIFELINE_PATH in cmdline:
            lifelines.add(cmdline)
        if any(LIFELINE_PATH in c for c in commands):
            continue
        if any(marker in c for c in commands for marker in _RAY_MARKERS):
            continue  # Ray's own: the reaper covers them
        bad[pid] = cmdline
    return bad


def test_every_process_of_an_eval_is_under_a_lifeline(assets: Path, tmp_path: Path) -> None:
    stops = f"rollout.extra_stop_token_ids=[{','.join(str(i) for i in range(20000))}]"
    command = [sys.executable, "-m", "agentrl.cli", "eval", "env=retool", f"model.path={assets / 'tiny-random-qwen2'}",
               "model.chat_template=chatml-tools", "inference.engine=hf", "eval.k=1", "eval.max_rows=2",
               "rollout.max_turns=2", "rollout.max_tokens_per_turn=16", f"eval.output_dir={tmp_path / 'eval'}", stops]
    proc = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: dict[int, str] = {}
    lifelines: set[str] = set()
    before: dict[int, str] = {}
    deadline = time.monotonic() + 900
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            # A process counts once two looks 0.1 s apart find it unguarded with the same command line: between
            # fork and exec a child still shows its parent's command line (or none), not yet the lifeline's.
            now = _unguarded(proc.pid, lifelines)
            seen.update({pid: c for pid, c in now.items() if c and before.get(pid) == c})
            before = now
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
        out = proc.communicate()[0]
    assert proc.returncode == 0, out[-4000:]
    # what the eval started was seen: the policy's server and the sandbox's warm workers, each under its lifeline
    assert any("agentrl.inference.hf_server" in c for c in lifelines), lifelines
    assert any("forkserver" in c for c in lifelines), lifelines
    assert seen == {}, "processes of the eval not under a lifeline:\n" + "\n".join(
        f"{pid}: {c}" for pid, c in seen.items())
