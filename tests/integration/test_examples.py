"""Every example script runs as a user would run it, and does what it says."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_custom_env_example_runs_and_earns_the_reward() -> None:
    out = subprocess.run([sys.executable, str(EXAMPLES / "custom_env.py")], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "prompt: What is the capital of Japan? | tools: ['lookup_capital']" in out.stdout
    assert "tool said: Tokyo" in out.stdout
    assert "reward=1.0 done=True" in out.stdout
