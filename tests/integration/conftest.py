"""Fixtures shared by integration test modules."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def openenv_guess_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The example OpenEnv server (examples/openenv_guess_server.py) on a free port, once per session:
    it imports gradio, seconds of start-up, so the tests that need *a* server share this one."""
    pytest.importorskip("openenv.core")
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # its output to a file, never an unread pipe: a server blocked on a full pipe stops answering
    log = tmp_path_factory.mktemp("openenv-server") / "server.log"
    log_file = log.open("wb")
    proc = subprocess.Popen([sys.executable, str(REPO / "examples" / "openenv_guess_server.py"), "--port", str(port)],
                            stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the example OpenEnv server exited: {log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the example OpenEnv server did not answer /health within 180 s")
            time.sleep(0.3)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log_file.close()
