"""Process groups for the trainer backends: join or create one, split work across ranks, spawn ranks.

`init_distributed` joins the process group that a launcher (torchrun, Ray, `launch`) described in
the environment (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`), or creates a one-rank group
in memory when there is none, so a single process runs exactly the code path of many. On CUDA the
group has both NCCL (for GPU tensors) and gloo (for CPU tensors such as metrics). `balanced_shares`
splits sequences across ranks by tokens. `launch` spawns N local ranks on 127.0.0.1 with a free
port and returns what each rank's function returned; it is for tests, benchmarks and one-machine
runs, not a cluster scheduler (that is the orchestration layer's job).
"""

from __future__ import annotations

import heapq
import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from agentrl.errors import TrainerError

__all__ = ["balanced_shares", "free_port", "init_distributed", "launch", "resolve_device"]


def resolve_device(device: str = "auto") -> torch.device:
    """`auto` -> this rank's CUDA device when CUDA is visible, else the CPU."""
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise TrainerError("trainer.device is 'cuda' but no CUDA device is visible; use 'cpu' or 'auto'.")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def init_distributed(device: torch.device) -> tuple[int, int]:
    """Join (or create) the default process group; return (rank, world_size).

    An existing group is reused, so several backends (policy, reference, critic) and several
    backends in one test share it.
    """
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend=backend, init_method="env://")
        else:
            # No launcher: a one-rank group held in memory, no port needed.
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


def balanced_shares(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Split indices into `parts` lists of near-equal total length (longest first to the lightest).

    Deterministic, so every rank computes the same split without talking to the others. A part
    may be empty when there are fewer sequences than parts. Each list is sorted.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}.")
    heap = [(0, p) for p in range(parts)]
    shares: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        load, p = heapq.heappop(heap)
        shares[p].append(i)
        heapq.heappush(heap, (load + lengths[i], p))
    return [sorted(s) for s in shares]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, fn: Callable[..., Any], args: tuple[Any, ...], world: int, port: int, queue: Any) -> None:
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    try:
        # Plain pickle copies tensors into the message; torch's queue pickler would share their
        # memory, which dies with this process before the parent reads it.
        queue.put((rank, True, pickle.dumps(fn(*args))))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(fn: Callable[..., Any], nprocs: int, *args: Any, timeout_s: float = 600.0) -> list[Any]:
    """Run `fn(*args)` in `nprocs` spawned ranks of one gloo/NCCL group; return their results by rank.

    `fn` must be importable by name (a module-level function) and its result picklable. Each
    rank sees torchrun's environment variables, so `init_distributed` joins the group. A rank
    that raises makes `launch` raise TrainerError with that rank's traceback.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, fn, args, nprocs, port, queue), daemon=False)
        for r in range(nprocs)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: list[str] = []
    deadline = time.monotonic() + timeout_s
    while len(results) < nprocs and not failures:
        try:
            rank, ok, value = queue.get(timeout=1.0)
        except queue_mod.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
            if dead:
                failures.append(
                    f"ranks {dead} died without a result (exit codes {[procs[r].exitcode for r in dead]})"
                )
            elif time.monotonic() > deadline:
                failures.append(f"no result within {timeout_s:.0f} s")
            continue
        if ok:
            results[rank] = pickle.loads(value)
        else:
            failures.append(f"rank {rank}:\n{value}")
    for p in procs:
        p.join(timeout=60.0 if not failures else 5.0)
        if p.is_alive():
            p.kill()
            p.join()
    if failures:
        raise TrainerError("a trainer rank failed:\n" + "\n".join(failures))
    bad = [r for r, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise TrainerError(f"trainer ranks {bad} exited with codes {[procs[r].exitcode for r in bad]}.")
    return [results[r] for r in range(nprocs)]
