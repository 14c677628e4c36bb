"""A slice of `bench/onpolicy_matrix.py` on CPU: one hf cell with top_p 0.9, one with top_k 20.

Guards: the matrix writes a markdown row per cell with measured figures; the top_k cell's template
check passes and the trainer, replaying each token's kept set, re-scores the sampled ids to fp32
rounding; the top_p cell (whose every kept set overflows the cap on the tiny random model) fails
its scoring checks saying so, never with an error.
"""

from __future__ import annotations

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
    top_p, top_k = rows["top_p=0.9"], rows["top_k=20"]
    assert "PASS 0/1 differ" in top_p and "error" not in top_p
    # the tiny random model's nucleus holds most of the vocabulary: every kept set overflows the cap,
    # and the check says nothing can be scored instead of comparing over the full vocabulary
    assert top_p.split(" | ")[6].startswith("FAIL no token scored (") and "kept sets overflowed" in top_p
    assert "PASS 0/1 differ" in top_k and "error" not in top_k
    seq_mean = float(re.search(r"seq-mean ([0-9.e+-]+)", top_k.split(" | ")[6]).group(1))
    assert seq_mean < 1e-5  # kept-set replay: the trainer scores over the engine's kept set
