"""The random-number state a trainer checkpoint saves: Python, NumPy, torch CPU and CUDA generators.

`rng_state()` captures this process's generators as tensors and plain values (loadable with
`torch.load(weights_only=True)`); `set_rng_state` puts them back, so a resumed run draws the same
numbers as the run that saved. Each rank saves its own. Backend-specific streams (megatron-core's
tensor-parallel RNG tracker) are the backend's business.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["load_rng", "rng_state", "save_rng", "set_rng_state"]


def rng_state() -> dict[str, Any]:
    """This process's Python, NumPy and torch (CPU, and CUDA when visible) generator states."""
    legacy = np.random.get_state(legacy=True)
    if not isinstance(legacy, tuple):  # only without legacy=True (or with a non-MT19937 generator)
        raise TypeError(f"NumPy's global generator state is a {type(legacy).__name__}; cannot save it.")
    kind, keys, pos, has_gauss, cached = legacy
    state = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` captured."""
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_rng(path: Path, rank: int, **extra: Any) -> None:
    """Save this rank's generators (and a backend's `extra` streams) under checkpoint `path`."""
    torch.save({**rng_state(), **extra}, path / f"rng_rank{rank}.pt")


def load_rng(path: Path, rank: int) -> dict[str, Any]:
    """Restore what `save_rng` wrote for `rank` (rank 0's streams when a run resumes on more ranks
    than saved) and return it, `extra` streams included."""
    file = path / f"rng_rank{rank}.pt"
    state: dict[str, Any] = torch.load(file if file.is_file() else path / "rng_rank0.pt", weights_only=True)
    set_rng_state(state)
    return state
