"""A trainer worker's native stderr goes to its log file; its Python stderr still reaches the driver.

Run in a child process of its own: pointing file descriptor 2 elsewhere is for a worker's whole life.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CHILD = r"""
import logging, os, sys
from agentrl.orchestration.worker_logs import route_native_stderr, route_worker_logs
log = route_worker_logs(sys.argv[1], "trainer-0")
assert route_native_stderr(log)
os.write(2, b"[W utils.cpp:68] Warning: NUMA binding: native code writes here\n")
print("a traceback Python prints", file=sys.stderr)
logging.getLogger("agentrl.trainer").warning("agentrl's own warning")
logging.getLogger("torch._library.triton").warning("Triton not available")
"""


def test_native_writes_go_to_the_log_and_python_stderr_to_the_driver(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "logs")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    written = (tmp_path / "logs" / "trainer-0.log").read_text()
    assert "NUMA binding" in written and "Triton not available" in written and "agentrl's own warning" in written
    assert "NUMA binding" not in done.stderr and "Triton not available" not in done.stderr
    assert "a traceback Python prints" in done.stderr and "agentrl's own warning" in done.stderr
