"""The broadcast checkpoint engine across real processes: torch.distributed gloo on 127.0.0.1.

Each test spawns 2 or 3 processes with torch.multiprocessing; rank 0 sends, the others receive
and write what they saw to a JSON file that the test then checks.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from agentrl.errors import ChecksumError, WeightSyncError
from agentrl.weights import BroadcastCheckpointEngine, load_into_module, make_checkpoint_engine

BUCKET = 1024
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int64": torch.int64}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _weights(dtype: torch.dtype, seed: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    shapes = {"embed": (40, 3), "w0": (10, 10), "b0": (10,), "w1": (9, 7), "huge": (300,), "scalar": ()}
    if dtype.is_floating_point:
        return [(n, torch.randn(s, generator=gen).to(dtype)) for n, s in shapes.items()]
    return [(n, torch.randint(-(2**40), 2**40, s, generator=gen, dtype=dtype)) for n, s in shapes.items()]


class _Corrupting(BroadcastCheckpointEngine):
    """Flips a byte of bucket 1 after its checksum was taken, as a bad link would."""

    def _transmit(self, bucket) -> None:
        if bucket.meta.index == 1:
            bucket.data[0] ^= 0xFF
        super()._transmit(bucket)


class _CorruptingDirect(BroadcastCheckpointEngine):
    """Flips the last byte of the first tensor sent from its own storage (not the bucket buffer)."""

    def _transmit(self, bucket) -> None:
        direct = [s for s in getattr(bucket, "sources", []) if s is not None]
        if bucket.meta.index == 0 and direct:
            direct[0][-1] ^= 0xFF
        super()._transmit(bucket)


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        engine = make_checkpoint_engine("broadcast", bucket_bytes=BUCKET)
        report: dict = {"pushes": []}
        version = 0
        # One push per dtype (the "huge" tensor is bigger than a bucket), then an empty push.
        for seed, (dtype_name, dtype) in enumerate(DTYPES.items()):
            tensors = _weights(dtype, seed)
            if rank == 0:
                engine.send(iter(tensors), version)
            else:
                stream = engine.receive()
                got = {n: t.clone() for n, t in stream}
                report["pushes"].append({
                    "dtype": dtype_name, "version": stream.version, "buckets": stream.num_buckets,
                    "names_match": sorted(got) == sorted(n for n, _ in tensors),
                    "equal": all(torch.equal(got[n], t) and got[n].dtype == dtype for n, t in tensors),
                })
            version += 1
        if rank == 0:
            engine.send(iter([]), 100)
        else:
            stream = engine.receive()
            report["empty"] = {"version": stream.version, "count": len(list(stream))}
        # A bucket holding only empty tensors has no pieces; its checksum must still match.
        hollow = [("empty.a", torch.zeros(0)), ("empty.b", torch.zeros(0, 3, dtype=torch.int64))]
        if rank == 0:
            engine.send(iter(hollow), 102)
        else:
            got = {n: t.clone() for n, t in engine.receive()}
            report["hollow"] = sorted(got) == ["empty.a", "empty.b"] and got["empty.b"].shape == (0, 3)
        # 3000 tensors in one bucket: the metadata outgrows the 64 KiB control buffer.
        many = [(f"blocks.{i}.scale", torch.full((2,), float(i))) for i in range(3000)]
        wide = make_checkpoint_engine("broadcast", bucket_bytes=64 << 10)
        if rank == 0:
            wide.send(iter(many), 101)
        else:
            stream = wide.receive()
            got = {n: t.clone() for n, t in stream}
            report["many"] = {"version": stream.version, "buckets": stream.num_buckets,
                              "equal": len(got) == 3000 and all(torch.equal(got[n], t) for n, t in many)}
        pools = [engine.send_buffers, engine.recv_buffers]
        report["allocations"] = [engine.send_buffers.allocations, engine.recv_buffers.allocations]
        report["pointers_before"] = [b.data_ptr() for p in pools for b in p.buffers if b is not None]

        # A module push: the receiver's perturbed copy must end up identical.
        torch.manual_seed(0)
        module = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        if rank != 0:
            with torch.no_grad():
                for p in module.parameters():
                    p.add_(1.0)
        if rank == 0:
            engine.send(module.named_parameters(), 200)
        else:
            load_into_module(module, engine.receive())
        total = sum(float(p.double().sum()) for p in module.parameters())
        gathered = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(gathered, torch.tensor([total], dtype=torch.float64))
        report["module_sums_equal"] = len({float(g) for g in gathered}) == 1
        report["pointers_after"] = [b.data_ptr() for p in pools for b in p.buffers if b is not None]
        report["allocations_after"] = [engine.send_buffers.allocations, engine.recv_buffers.allocations]

        # Corruption in transit: every receiver raises ChecksumError naming the bucket, then all
        # ranks are still in step for the next push.
        bad = _Corrupting(bucket_bytes=BUCKET)
        if rank == 0:
            bad.send(iter(_weights(torch.float32, 9)), 300)
        else:
            try:
                list(bad.receive())
                report["corrupt"] = "no error"
            except ChecksumError as exc:
                report["corrupt"] = str(exc)
        if rank == 0:
            engine.send(iter(_weights(torch.float32, 10)), 301)
        else:
            stream = engine.receive()
            got = {n: t.clone() for n, t in stream}
            report["after_corrupt"] = stream.version == 301 and all(
                torch.equal(got[n], t) for n, t in _weights(torch.float32, 10))

        # Tensors of at least direct_bytes travel from their own storage, as pieces of a bucket:
        # same tensors out, and corruption in such a piece is caught for its bucket.
        direct = make_checkpoint_engine("broadcast", bucket_bytes=BUCKET, direct_bytes=256)
        if rank == 0:
            direct.send(iter(_weights(torch.float32, 11)), 400)
        else:
            stream = direct.receive()
            got = {n: t.clone() for n, t in stream}
            report["direct"] = stream.version == 400 and all(
                torch.equal(got[n], t) for n, t in _weights(torch.float32, 11))
        bad_direct = _CorruptingDirect(bucket_bytes=BUCKET, direct_bytes=256)
        if rank == 0:
            sent = _weights(torch.float32, 12)
            bad_direct.send(iter(sent), 401)
        else:
            try:
                list(bad_direct.receive())
                report["corrupt_direct"] = "no error"
            except ChecksumError as exc:
                report["corrupt_direct"] = str(exc)

        # Wrong side: send() on a receiving rank and receive() on the sender fail clearly.
        try:
            engine.receive() if rank == 0 else engine.send([], 0)
        except WeightSyncError as exc:
            report["wrong_side"] = str(exc)
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_broadcast_engine_over_gloo(world: int, tmp_path: Path) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(_worker, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=True)
    sender = json.loads((tmp_path / "rank0.json").read_text())
    assert "rank 0, the sending rank" in sender["wrong_side"]
    assert sender["allocations"] == [2, 0]  # the sender never used receive buffers
    assert sender["pointers_after"] == sender["pointers_before"]
    for rank in range(1, world):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert [p["version"] for p in report["pushes"]] == [0, 1, 2, 3]
        for push in report["pushes"]:
            assert push["names_match"] and push["equal"], push
            assert push["buckets"] > 1, push
        assert report["empty"] == {"version": 100, "count": 0}
        assert report["many"] == {"version": 101, "buckets": 1, "equal": True}
        assert report["hollow"] is True
        assert report["module_sums_equal"]
        assert report["allocations"] == report["allocations_after"] == [0, 2]
        assert report["pointers_after"] == report["pointers_before"]
        assert report["corrupt"].startswith("Bucket 1 of weight version 300"), report["corrupt"]
        assert report["after_corrupt"] is True
        assert report["direct"] is True
        assert report["corrupt_direct"].startswith("Bucket 0 of weight version 401"), report["corrupt_direct"]
        assert f"send() called on rank {rank}" in report["wrong_side"]
