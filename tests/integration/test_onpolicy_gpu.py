"""The on-policy check's GPU column (`bench/onpolicy_gpu.py`): trainer and hf engine on CUDA.

Guards: with agentrl carried as source (no install), the script runs the check in bfloat16 and
float32 and writes a report per dtype; in float32 the trainer re-scores the hf engine's sampled ids
within the gate's limits and the template check passes. Not run yet: no GPU where it was written.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def test_gpu_column_reports_both_dtypes_and_fp32_is_on_policy(tmp_path: Path, assets: Path) -> None:
    done = subprocess.run([sys.executable, str(REPO / "bench" / "onpolicy_gpu.py"), "--assets", str(assets),
                           "--out", str(tmp_path), "--rows", "2"], capture_output=True, text=True, timeout=480)
    assert json.loads((tmp_path / "imports.json").read_text())["missing"] == [], done.stderr[-2000:]
    fp32 = json.loads((tmp_path / "check-float32-t1.0.json").read_text())
    bf16 = json.loads((tmp_path / "check-bfloat16-t1.0.json").read_text())
    status = {c["name"]: c["status"] for c in fp32["checks"]}
    assert status["template"] == "PASS" and status["rescore"] == "PASS" and status["cache"] == "PASS"
    assert {c["name"] for c in bf16["checks"]} == set(status)
    assert "| float32 | t1.0 | rescore | PASS |" in (tmp_path / "gpu_onpolicy.md").read_text()
