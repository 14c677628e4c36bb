"""The in-process and files checkpoint engines: round trips, versions, buffer reuse and failures.

The broadcast engine needs several processes and is tested in tests/integration/test_weight_sync.py.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from agentrl.errors import ChecksumError, UnknownNameError, WeightSyncError
from agentrl.weights import (
    FilesCheckpointEngine,
    InProcessCheckpointEngine,
    WeightStream,
    make_checkpoint_engine,
    read_checkpoint_dir,
)

BUCKET = 1024


def _weights(dtype: torch.dtype = torch.float32, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    shapes = {"embed": (40, 3), "layer.0.w": (10, 10), "layer.0.b": (10,), "layer.1.w": (9, 7), "head": (2, 5)}
    out = []
    for name, shape in shapes.items():
        if dtype.is_floating_point:
            out.append((name, torch.randn(shape, generator=gen).to(dtype)))
        else:
            out.append((name, torch.randint(-(2**40), 2**40, shape, generator=gen, dtype=dtype)))
    return out


class _Collector:
    """A consumer that keeps its own copies and records the stream's version and bucket count."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.version: int | None = None
        self.num_buckets: int | None = None

    def __call__(self, stream: WeightStream) -> None:
        self.version = stream.version
        for name, tensor in stream:
            self.tensors[name] = tensor.clone()
        self.num_buckets = stream.num_buckets


def _push(backend: str, tmp_path: Path, tensors, version: int, **kw) -> tuple[_Collector, object]:
    got = _Collector()
    kw.setdefault("bucket_bytes", BUCKET)
    if backend == "inprocess":
        engine = make_checkpoint_engine("inprocess", consumer=got, **kw)
        engine.send(iter(tensors), version)
    else:
        engine = make_checkpoint_engine("files", directory=tmp_path, **kw)
        engine.send(iter(tensors), version)
        got(engine.receive())
    return got, engine


BACKENDS = ["inprocess", "files"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64], ids=str)
def test_round_trip_is_exact_and_carries_the_version(backend: str, dtype: torch.dtype, tmp_path: Path) -> None:
    tensors = _weights(dtype)
    # 256 elements per bucket whatever the dtype, so every push spans several buckets
    got, _ = _push(backend, tmp_path, tensors, version=41, bucket_bytes=256 * tensors[0][1].element_size())
    assert got.version == 41
    assert set(got.tensors) == {n for n, _ in tensors}
    for name, tensor in tensors:
        assert got.tensors[name].dtype == dtype and torch.equal(got.tensors[name], tensor), name
    assert got.num_buckets is not None and got.num_buckets > 1  # the push really was bucketed


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_dtypes_and_an_oversized_tensor(backend: str, tmp_path: Path) -> None:
    tensors = [*_weights(torch.bfloat16, 1)[:2], ("huge", torch.randn(1000)), *_weights(torch.int64, 2)[2:]]
    got, engine = _push(backend, tmp_path, tensors, version=2)
    for name, tensor in tensors:
        assert torch.equal(got.tensors[name], tensor), name
    assert engine.send_buffers.allocations <= 2  # the 4000-byte tensor did not grow a 1024-byte buffer


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_push_still_delivers_the_version(backend: str, tmp_path: Path) -> None:
    got, _ = _push(backend, tmp_path, [], version=9)
    assert got.version == 9 and got.tensors == {} and got.num_buckets == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_buffers_are_reused_across_pushes(backend: str, tmp_path: Path) -> None:
    got = _Collector()
    if backend == "inprocess":
        engine = InProcessCheckpointEngine(bucket_bytes=BUCKET, consumer=got)
    else:
        engine = FilesCheckpointEngine(directory=tmp_path, bucket_bytes=BUCKET)
    pointers = []
    for version in range(4):
        tensors = _weights(seed=version)
        engine.send(iter(tensors), version)
        if backend == "files":
            got(engine.receive())
        assert got.version == version
        assert all(torch.equal(got.tensors[n], t) for n, t in tensors)
        pools = [engine.send_buffers, engine.recv_buffers]
        pointers.append([b.data_ptr() for pool in pools for b in pool.buffers if b is not None])
    assert engine.send_buffers.allocations == 2
    assert engine.recv_buffers.allocations == (2 if backend == "files" else 0)
    assert all(p == pointers[0] for p in pointers)


def test_sender_packs_the_next_bucket_while_the_receiver_holds_one() -> None:
    holding = threading.Event()
    release = threading.Event()
    engine = InProcessCheckpointEngine(bucket_bytes=BUCKET)
    tensors = _weights()
    received: dict[str, torch.Tensor] = {}

    def receiver() -> None:
        stream = engine.receive()
        for name, tensor in stream:
            received[name] = tensor.clone()
            if not holding.is_set():
                holding.set()
                release.wait(5)

    thread = threading.Thread(target=receiver)
    thread.start()
    sender = threading.Thread(target=engine.send, args=(iter(tensors), 1))
    sender.start()
    assert holding.wait(5)
    # While the receiver sits on bucket 0, the sender has already packed bucket 1 into buffer 2.
    deadline = threading.Event()
    for _ in range(100):
        if engine.send_buffers.allocations == 2:
            break
        deadline.wait(0.02)
    assert engine.send_buffers.allocations == 2
    assert len(received) == 1
    release.set()
    sender.join(5)
    thread.join(5)
    assert set(received) == {n for n, _ in tensors}


def test_copy_true_yields_tensors_that_outlive_the_buffers() -> None:
    engine = InProcessCheckpointEngine(bucket_bytes=BUCKET)
    thread = threading.Thread(target=lambda: engine.send(iter(_weights(seed=1)), 1))
    thread.start()
    owned = dict(engine.receive(copy=True))
    thread.join(5)
    buffers = [b for b in engine.send_buffers.buffers if b is not None]
    for name, tensor in _weights(seed=1):
        assert torch.equal(owned[name], tensor)
        assert all(not (b.data_ptr() <= owned[name].data_ptr() < b.data_ptr() + b.numel()) for b in buffers)


class _CorruptingEngine(InProcessCheckpointEngine):
    """Flips one byte of bucket 1 after its checksum was computed: corruption in transit."""

    def _transmit(self, bucket) -> None:
        if bucket.meta.index == 1:
            bucket.data[3] ^= 0xFF
        super()._transmit(bucket)


def test_inprocess_corrupted_bucket_raises_checksum_error() -> None:
    engine = _CorruptingEngine(bucket_bytes=BUCKET, consumer=_Collector())
    with pytest.raises(ChecksumError, match="Bucket 1 of weight version 5"):
        engine.send(iter(_weights()), 5)
    # The engine is still usable: the failed push was drained and its buffers returned.
    engine.__class__ = InProcessCheckpointEngine
    got = _Collector()
    engine.consumer = got
    engine.send(iter(_weights()), 6)
    assert got.version == 6 and len(got.tensors) == len(_weights())


def test_files_corrupted_shard_raises_checksum_error(tmp_path: Path) -> None:
    engine = FilesCheckpointEngine(directory=tmp_path, bucket_bytes=BUCKET)
    engine.send(iter(_weights()), 3)
    shard = sorted(engine.path_for(3).glob("*.safetensors"))[1]
    raw = bytearray(shard.read_bytes())
    raw[-5] ^= 0x01
    shard.write_bytes(bytes(raw))
    with pytest.raises(ChecksumError, match="Bucket 1 of weight version 3"):
        list(engine.receive())


def test_failing_sender_iterator_aborts_the_receiver() -> None:
    def broken():
        yield from _weights()[:3]
        raise RuntimeError("gather failed")

    errors: list[BaseException] = []

    def consumer(stream: WeightStream) -> None:
        try:
            list(stream)
        except WeightSyncError as exc:
            errors.append(exc)

    engine = InProcessCheckpointEngine(bucket_bytes=BUCKET, consumer=consumer)
    with pytest.raises(RuntimeError, match="gather failed"):
        engine.send(broken(), 1)
    assert len(errors) == 1 and "aborted weight push 1" in str(errors[0]) and "gather failed" in str(errors[0])


def test_files_layout_is_a_plain_hf_sharded_checkpoint(tmp_path: Path) -> None:
    engine = FilesCheckpointEngine(directory=tmp_path, bucket_bytes=BUCKET, keep_last=2)
    tensors = _weights()
    for version in (1, 2, 3):
        engine.send(iter(tensors), version)
    assert engine.versions() == [2, 3]  # keep_last=2 pruned version 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["version-00000002", "version-00000003"]
    path = engine.path_for(3)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in path.glob("*.safetensors"))
    assert shards == [f"model-{k:05d}-of-{len(shards):05d}.safetensors" for k in range(1, len(shards) + 1)]
    assert set(index["weight_map"]) == {n for n, _ in tensors}
    assert set(index["weight_map"].values()) == set(shards)
    meta = index["metadata"]["agentrl"]
    assert meta["version"] == 3 and meta["checksum"] == "sum64" and set(meta["checksums"]) == set(shards)
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for _, t in tensors)
    loaded = {}
    for shard in shards:  # the reference safetensors reader accepts every shard
        loaded.update(load_file(str(path / shard)))
    assert all(torch.equal(loaded[n], t) for n, t in tensors)


def test_read_checkpoint_dir_reads_a_foreign_single_file_checkpoint(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    tensors = dict(_weights(torch.bfloat16))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    stream = read_checkpoint_dir(tmp_path)
    got = dict(stream)
    assert stream.version == -1 and all(torch.equal(got[n], t) for n, t in tensors.items())


def test_files_receive_without_any_version_and_unknown_backend(tmp_path: Path) -> None:
    with pytest.raises(WeightSyncError, match="No published weight version"):
        FilesCheckpointEngine(directory=tmp_path).receive()
    with pytest.raises(UnknownNameError, match="Did you mean 'files'"):
        make_checkpoint_engine("file", directory=tmp_path)
    with pytest.raises(WeightSyncError, match="non-negative int"):
        InProcessCheckpointEngine().send([], -1)


def test_receiver_stopping_early_drains_the_push_and_frees_the_buffers() -> None:
    seen: list[str] = []

    def first_only(stream: WeightStream) -> None:
        for name, _ in stream:
            seen.append(name)
            stream.close()
            break

    engine = InProcessCheckpointEngine(bucket_bytes=BUCKET, consumer=first_only)
    engine.send(iter(_weights()), 1)  # returns: the rest of the push was drained, not left blocking
    assert len(seen) == 1
    got = _Collector()
    engine.consumer = got
    engine.send(iter(_weights(seed=3)), 2)
    assert got.version == 2 and all(torch.equal(got.tensors[n], t) for n, t in _weights(seed=3))
    assert engine.send_buffers.allocations == 2


def test_a_stream_closed_before_reading_releases_the_sender(tmp_path: Path) -> None:
    engine = InProcessCheckpointEngine(bucket_bytes=BUCKET, consumer=lambda stream: stream.close())
    engine.send(iter(_weights()), 1)
    files = FilesCheckpointEngine(directory=tmp_path, bucket_bytes=BUCKET)
    files.send(iter(_weights()), 1)
    with files.receive() as stream:
        assert stream.version == 1
    with files.receive() as stream:  # the buffers came back: a second read works
        assert sum(1 for _ in stream) == len(_weights())
    assert files.recv_buffers.allocations == 2


def test_pushes_on_one_engine_do_not_overlap() -> None:
    release = threading.Event()

    def slow(stream: WeightStream) -> None:
        release.wait(5)
        list(stream)

    engine = InProcessCheckpointEngine(bucket_bytes=BUCKET, consumer=slow)
    first = threading.Thread(target=engine.send, args=(iter(_weights()), 1))
    first.start()
    for _ in range(100):
        if engine._sending.locked():
            break
        release.wait(0.01)
    with pytest.raises(WeightSyncError, match="already in progress"):
        engine.send(iter(_weights()), 2)
    release.set()
    first.join(5)
    assert not first.is_alive()


def test_files_versions_carry_their_assets_and_kept_versions_survive_pruning(tmp_path: Path) -> None:
    assets = {"config.json": b'{"model_type": "toy"}', "tokenizer.json": b"{}", "chat_template.jinja": b"{{ x }}"}
    engine = FilesCheckpointEngine(directory=tmp_path, bucket_bytes=BUCKET, keep_last=2, assets=assets)
    for version in range(1, 6):
        engine.send(iter(_weights(seed=version)), version)
        if version == 2:
            engine.keep(2)  # a checkpoint was taken at version 2
    assert engine.versions() == [2, 4, 5]
    for version in (2, 4, 5):
        path = engine.path_for(version)
        assert {name: (path / name).read_bytes() for name in assets} == assets
        assert json.loads((path / "model.safetensors.index.json").read_text())["metadata"]["agentrl"]["version"] == version
    with pytest.raises(WeightSyncError, match="not published"):
        engine.keep(1)
    with pytest.raises(WeightSyncError, match="plain file names"):
        FilesCheckpointEngine(directory=tmp_path, assets={"../config.json": b""})
