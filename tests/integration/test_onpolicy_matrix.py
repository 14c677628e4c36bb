"""A slice of `bench/onpolicy_matrix.py` on CPU: one hf cell with top_p 0.9, one with top_k 20.

Guards: the matrix writes a markdown row per cell with measured figures; the top_p cell's template
check passes and its re-scoring gap is either the nucleus renormalisation (-ln 0.9 on every token,
when the trainer does not replay the kept set) or nothing (when it does); the top_k cell either ran
or says "needs kept-set replay", never an error.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_matrix_slice_measures_top_p_and_skips_or_runs_top_k(tmp_path: Path, assets: Path) -> None:
    out = tmp_path / "matrix.md"
    done = subprocess.run([sys.executable, str(REPO / "bench" / "onpolicy_matrix.py"), "--engines", "hf",
                           "--dtypes", "float32", "--temperatures", "1.0", "--sampling", "top_p=0.9", "top_k=20",
                           "--templates", "qwen2.5", "--rows", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {line.split(" | ")[3]: line for line in out.read_text().splitlines()[2:]}
    top_p = rows["top_p=0.9"]
    assert "PASS 0/1 differ" in top_p
    seq_mean = float(re.search(r"seq-mean ([0-9.e+-]+)", top_p).group(1))
    assert math.isclose(seq_mean, -math.log(0.9), rel_tol=1e-2) or seq_mean < 1e-4
    assert "needs kept-set replay" in rows["top_k=20"] or "PASS 0/1 differ" in rows["top_k=20"]
    assert "error" not in rows["top_k=20"]
