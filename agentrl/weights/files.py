"""Files checkpoint engine: each push becomes a plain Hugging Face sharded safetensors directory.

`send` writes one safetensors file per bucket into a hidden staging directory, names them
`model-0000k-of-0000n.safetensors` once the count is known, writes `model.safetensors.index.json`
(with the usual `weight_map` and `metadata.total_size`, plus `metadata.agentrl` holding the
version, the checksum kind and one checksum per shard) and then renames the staging directory to
`<directory>/version-<version>` in one step, so a reader never sees half a checkpoint. `assets`
(file name -> bytes: config.json, generation_config.json, the tokenizer files and chat template)
are written into every version before it is published, so each one is a complete Hugging Face
model directory that `agentrl eval model.path=...`, vLLM and `from_pretrained` load as is. The
newest `keep_last` versions are kept, plus any marked with `keep(version)` (a checkpoint's
policy), and the rest deleted.

A bucket's bytes are the safetensors data section as is (see `buckets`), so writing is one header
and one buffer write. `receive` (or `read_checkpoint_dir` for any HF directory, ours or not)
reads the shards back into reused buffers and verifies their checksums when the index has them.

This backend does not notify servers that a version is ready; the caller posts the path, and it
works only where the servers read the same filesystem as the trainer (the run checks that at start).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import struct
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from agentrl.errors import WeightSyncError
from agentrl.weights.buckets import DTYPES, Bucket, BucketMeta, TensorEntry
from agentrl.weights.engine import BufferPool, CheckpointEngine, PushEnd, StreamItem, WeightStream, _Once

__all__ = [
    "INDEX_NAME",
    "KEEP_MARKER",
    "METADATA_KEY",
    "FilesCheckpointEngine",
    "index_of",
    "read_checkpoint_dir",
    "shard_name",
]

INDEX_NAME = "model.safetensors.index.json"
METADATA_KEY = "agentrl"
KEEP_MARKER = ".agentrl-keep"
"""A file in a version directory that pruning must leave alone (a checkpoint's policy)."""
_VERSION_DIR = re.compile(r"^version-(\d+)$")


def shard_name(number: int, total: int) -> str:
    """The HF shard file name for shard `number` (1-based) of `total`."""
    return f"model-{number:05d}-of-{total:05d}.safetensors"


def _write_shard(path: Path, bucket: Bucket) -> None:
    meta = bucket.meta
    header: dict[str, Any] = {
        "__metadata__": {"format": "pt", "agentrl_version": str(meta.version), "agentrl_bucket": str(meta.index)}
    }
    for entry in meta.entries:
        header[entry.name] = {"dtype": entry.dtype, "shape": list(entry.shape),
                              "data_offsets": [entry.offset, entry.offset + entry.nbytes]}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads its header to 8 bytes
    data = bucket.data if bucket.data.device.type == "cpu" else bucket.data.cpu()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        if meta.nbytes:
            f.write(data.numpy().data)


class FilesCheckpointEngine(CheckpointEngine):
    """Writes and reads `<directory>/version-<version>` HF checkpoints; buffers live on the CPU."""

    name = "files"

    def __init__(self, *, directory: str | os.PathLike[str], keep_last: int | None = 2,
                 assets: Mapping[str, bytes] | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("device", "cpu")
        super().__init__(**kwargs)
        if self.device.type != "cpu":
            raise WeightSyncError(f"The files checkpoint engine keeps its buffers on the CPU, got device={self.device}.")
        if keep_last is not None and keep_last < 1:
            raise WeightSyncError(f"keep_last must be at least 1 (or None to keep all), got {keep_last}.")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.assets = dict(assets or {})
        for name in self.assets:
            if "/" in name or name.startswith(".") or name.endswith(".safetensors") or name == INDEX_NAME:
                raise WeightSyncError(f"Asset '{name}' cannot be written beside the weights: give plain file "
                                      "names such as config.json or tokenizer.json.")
        self.last_path: Path | None = None
        self._staging: Path | None = None
        self._shards: list[tuple[BucketMeta, str]] = []
        self._read_path: Path | None = None

    def path_for(self, version: int) -> Path:
        """The directory a push of `version` is published to."""
        return self.directory / f"version-{version:08d}"

    def versions(self) -> list[int]:
        """Published versions in the directory, oldest first."""
        if not self.directory.is_dir():
            return []
        found = [int(m.group(1)) for p in self.directory.iterdir() if (m := _VERSION_DIR.match(p.name))]
        return sorted(found)

    # ---------------------------------------------------------------- sending
    def _begin_push(self, version: int) -> None:
        staging = self.directory / f".version-{version:08d}.partial"
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
        self._staging = staging
        self._shards = []

    def _transmit(self, bucket: Bucket) -> None:
        assert self._staging is not None  # set by _begin_push on the same push
        path = self._staging / f"bucket-{bucket.meta.index:05d}.safetensors"
        _write_shard(path, bucket)
        self._shards.append((bucket.meta, path.name))  # not the bytes: the buffer is reused next

    def _end_push(self, end: PushEnd) -> None:
        staging = self._staging
        assert staging is not None
        if end.error is not None:
            shutil.rmtree(staging, ignore_errors=True)
            return
        total = len(self._shards)
        weight_map: dict[str, str] = {}
        checksums: dict[str, int | None] = {}
        sizes: dict[str, int] = {}
        shards: list[str] = []
        kind = None
        for number, (meta, tmp_name) in enumerate(self._shards, start=1):
            final = shard_name(number, total)
            os.replace(staging / tmp_name, staging / final)
            shards.append(final)
            checksums[final] = meta.checksum
            sizes[final] = meta.nbytes
            kind = meta.checksum_kind
            for entry in meta.entries:
                weight_map[entry.name] = final
        index = {
            "metadata": {
                "total_size": sum(sizes.values()),
                METADATA_KEY: {"version": end.version, "checksum": kind, "shards": shards,
                               "checksums": checksums, "nbytes": sizes},
            },
            "weight_map": weight_map,
        }
        (staging / INDEX_NAME).write_text(json.dumps(index, indent=1))
        for name, content in self.assets.items():
            (staging / name).write_bytes(content)
        final_dir = self.path_for(end.version)
        if final_dir.exists():
            shutil.rmtree(final_dir)
        os.replace(staging, final_dir)
        self.last_path = final_dir
        self._prune(end.version)

    def keep(self, version: int) -> Path:
        """Exempt a published version from pruning (it backs a checkpoint); return its directory."""
        path = self.path_for(version)
        if not path.is_dir():
            raise WeightSyncError(f"Weight version {version} is not published in {self.directory}; send() it first.")
        (path / KEEP_MARKER).touch()
        return path

    def _prune(self, current: int) -> None:
        if self.keep_last is None:
            return
        old = [v for v in self.versions() if v != current and not (self.path_for(v) / KEEP_MARKER).exists()]
        for version in old[: max(0, len(old) - (self.keep_last - 1))]:
            shutil.rmtree(self.path_for(version), ignore_errors=True)

    # ---------------------------------------------------------------- receiving
    def receive(self, path: str | os.PathLike[str] | None = None, *, copy: bool = False) -> WeightStream:
        """Read a checkpoint directory: `path`, or the newest published version when None."""
        if path is None:
            versions = self.versions()
            if not versions:
                raise WeightSyncError(f"No published weight version in {self.directory}; send() one first.")
            path = self.path_for(versions[-1])
        self._read_path = Path(path)
        return super().receive(copy=copy)

    def _incoming(self) -> Iterator[Bucket | PushEnd]:
        assert self._read_path is not None
        yield from _read_shards(self._read_path, self.recv_buffers)


def _checkpoint_files(path: Path) -> tuple[list[str], dict[str, Any]]:
    index_path = path / INDEX_NAME
    if index_path.is_file():
        index = json.loads(index_path.read_text())
        info = index.get("metadata", {}).get(METADATA_KEY, {})
        files = info.get("shards") or sorted(set(index.get("weight_map", {}).values()))
        return list(files), info
    if (path / "model.safetensors").is_file():
        return ["model.safetensors"], {}
    raise WeightSyncError(
        f"No safetensors checkpoint in {path}: expected {INDEX_NAME} or model.safetensors. "
        "Point at a directory written by the files checkpoint engine or a Hugging Face model."
    )


def _read_shards(path: Path, pool: BufferPool | None) -> Iterator[Bucket | PushEnd]:
    if not path.is_dir():
        raise WeightSyncError(f"Weight checkpoint directory {path} does not exist.")
    files, info = _checkpoint_files(path)
    version = info.get("version")
    kind = info.get("checksum")
    for number, file_name in enumerate(files):
        with open(path / file_name, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
            header.pop("__metadata__", None)
            size = os.fstat(f.fileno()).st_size - 8 - header_len
            entries = []
            for name, spec in header.items():
                if spec["dtype"] not in DTYPES:
                    raise WeightSyncError(f"{path / file_name}: tensor '{name}' has unsupported dtype {spec['dtype']}.")
                begin, end = spec["data_offsets"]
                entries.append(TensorEntry(name, spec["dtype"], tuple(spec["shape"]), begin, end - begin))
            entries.sort(key=lambda e: e.offset)
            if pool is not None and size <= pool.nbytes:
                slot, buffer = pool.acquire()
                data = buffer[:size]
                release: Callable[[], None] = _Once(functools.partial(pool.release, slot))
            else:
                data = torch.empty(size, dtype=torch.uint8)
                release = _Once(lambda: None)
            view = data.numpy().data
            got = 0
            while got < size:
                n = f.readinto(view[got:])
                if not n:
                    break
                got += n
        meta = BucketMeta(
            index=number,
            version=version if version is not None else -1,
            entries=tuple(entries),
            nbytes=int(info.get("nbytes", {}).get(file_name, size)),
            checksum=info.get("checksums", {}).get(file_name),
            checksum_kind=kind,
        )
        yield Bucket(meta, data[:got], release)
    yield PushEnd(version if version is not None else -1, len(files))


def read_checkpoint_dir(path: str | os.PathLike[str]) -> WeightStream:
    """Stream the tensors of any HF safetensors directory (sharded or single-file).

    Checksums are verified when the index carries agentrl's (`stream.stats` counts them); the
    stream's version is -1 for a directory that does not record one. Each shard is read into
    fresh memory, so unlike `FilesCheckpointEngine.receive` the tensors may be kept without
    copying, and the next shard is read while the caller consumes this one.
    """
    import queue
    import threading

    items: queue.Queue[StreamItem] = queue.Queue(maxsize=1)

    def fetch() -> None:
        try:
            for item in _read_shards(Path(path), None):
                items.put(item)
        except BaseException as exc:
            items.put(exc)

    worker = threading.Thread(target=fetch, name="agentrl-weights-read", daemon=True)
    worker.start()
    return WeightStream(items, worker, copy=False)


def index_of(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """agentrl's metadata of a checkpoint directory written by this engine (None for foreign ones)."""
    index_path = Path(path) / INDEX_NAME
    if not index_path.is_file():
        return None
    try:
        info = json.loads(index_path.read_text()).get("metadata", {}).get(METADATA_KEY)
    except (OSError, ValueError) as exc:
        raise WeightSyncError(f"Cannot read {index_path}: {exc}") from exc
    return info if isinstance(info, dict) else None
