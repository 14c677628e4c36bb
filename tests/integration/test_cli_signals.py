"""Ctrl-C stops a console command even when it starts with SIGINT ignored, as a shell starts a
script's background jobs (and as CI may start the whole suite): `agentrl view`, which relies on
Python's KeyboardInterrupt, exits 0 on SIGINT instead of serving on until it is killed."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path


def test_agentrl_view_stops_on_ctrl_c_when_started_with_sigint_ignored(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text("env:\n  name: arithmetic\n")  # a run that has only started

    def ignore_sigint() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    proc = subprocess.Popen([sys.executable, "-m", "agentrl.cli", "view", str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=ignore_sigint)
    try:
        first = proc.stdout.readline() if proc.stdout else ""
        url = re.search(r"http://\S+", first)
        assert url, f"no URL: {first!r}"
        with urllib.request.urlopen(url.group(0), timeout=30) as page:
            assert "<html" in page.read().decode().lower()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-2000:]
