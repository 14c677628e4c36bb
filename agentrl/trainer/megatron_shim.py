"""Run megatron-core 0.16 on a CPU-only torch: the CUDA-only spots it touches, replaced on CPU only.

megatron-core's GPT model has no CPU path, but only three places in what `megatron.MegatronBackend`
uses actually need a GPU; everything else (tensor-parallel layers, their collectives, the local
attention and norms) is plain torch and runs on gloo. The three places, and what stands in:

1. The global memory buffer (`parallel_state.get_global_memory_buffer()`), which the local
   attention takes its score matrix from, allocates on `torch.cuda.current_device()`.
   `CpuMemoryBuffer` allocates a fresh CPU tensor instead (attention uses it with `beta=0`, so
   its contents never matter, and a fresh tensor avoids aliasing a reused buffer).
2. The model-parallel RNG tracker (`tensor_parallel.get_cuda_rng_tracker()`), whose `add` and
   `fork` save, seed and restore the CUDA generator around dropout and initialisation.
   `CpuRNGStatesTracker` does the same with the CPU generator: one named stream per tracker name,
   swapped in for the body of `fork` and swapped back after.
3. `RotaryEmbedding.get_emb` moves its frequencies to `torch.cuda.current_device()` on first use;
   on CPU the frequencies stay where they are.

A fourth, the default causal mask that the unfused softmax builds on `device="cuda"` when it is
given none, needs no patch: the backend always passes its own mask.

Importing this module imports megatron-core. `apply_cpu_shim()` installs all three (idempotent) and must run after
`parallel_state.initialize_model_parallel` (which creates the buffer it replaces). It is called
only when the backend runs on CPU; on CUDA megatron-core runs unmodified. This module is not a
general CPU port of megatron-core: sequence parallelism, fused kernels, Transformer Engine,
distributed optimizers and CUDA graphs remain GPU-only and the backend does not enable them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.models.common.embeddings import rotary_pos_embedding
from megatron.core.tensor_parallel import random as mp_random
from megatron.core.utils import GlobalMemoryBuffer

__all__ = ["CpuMemoryBuffer", "CpuRNGStatesTracker", "apply_cpu_shim", "cpu_manual_seed"]

_MODEL_PARALLEL_RNG = "model-parallel-rng"
_applied = False


class CpuMemoryBuffer(GlobalMemoryBuffer):
    """`GlobalMemoryBuffer` that hands out fresh CPU tensors."""

    def get_tensor(
        self, tensor_shape: Any, dtype: torch.dtype, name: str, mem_alloc_context: Any = None
    ) -> torch.Tensor:
        return torch.empty(tuple(tensor_shape), dtype=dtype, device="cpu")


class CpuRNGStatesTracker(mp_random.CudaRNGStatesTracker):
    """`CudaRNGStatesTracker` over the CPU generator: named streams swapped in by `fork`."""

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} is already tracked; give each RNG stream its own seed.")
        if name in self.states_:
            raise ValueError(f"RNG stream '{name}' is already tracked.")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG) -> Iterator[None]:
        if name not in self.states_:
            raise ValueError(f"RNG stream '{name}' is not tracked; call cpu_manual_seed first.")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def _cpu_get_emb(self: Any, max_seq_len: int, offset: int = 0) -> torch.Tensor:
    # RotaryEmbedding.get_emb without the move to CUDA (megatron-core 0.16, non-interleaved and
    # interleaved layouts alike).
    freqs = self.get_freqs_non_repeated(max_seq_len, offset)
    if not self.rotary_interleaved:
        emb = torch.cat((freqs, freqs), dim=-1)
    else:
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
    return emb[:, None, None, :]


def apply_cpu_shim() -> None:
    """Install the CPU stand-ins (see module). Call after `initialize_model_parallel`."""
    global _applied
    if not isinstance(parallel_state._GLOBAL_MEMORY_BUFFER, CpuMemoryBuffer):
        parallel_state._GLOBAL_MEMORY_BUFFER = CpuMemoryBuffer()
    if _applied:
        return
    mp_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    original = rotary_pos_embedding.RotaryEmbedding.get_emb

    def get_emb(self: Any, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        if self.inv_freq.device.type == "cpu":
            return _cpu_get_emb(self, max_seq_len, offset)
        emb: torch.Tensor = original(self, max_seq_len, offset)
        return emb

    rotary_pos_embedding.RotaryEmbedding.get_emb = get_emb
    _applied = True


def cpu_manual_seed(seed: int, tp_rank: int) -> None:
    """The CPU twin of megatron-core's `model_parallel_cuda_manual_seed`: seed the default stream
    and a tensor-parallel stream that differs between TP ranks (as megatron-core does, +2718)."""
    torch.manual_seed(seed)
    tracker = mp_random.get_cuda_rng_tracker()
    tracker.reset()
    tracker.add(_MODEL_PARALLEL_RNG, seed + 2718 + tp_rank)
