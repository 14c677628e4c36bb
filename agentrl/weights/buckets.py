"""Bucketing: pack a stream of named tensors into flat byte buckets, and unpack them again.

A weight push is a stream of `(name, tensor)` pairs that may be larger than memory allows to copy
at once, so it is cut into buckets of at most `bucket_bytes`. Each bucket is one flat, contiguous
`uint8` buffer plus a `BucketMeta` (names, dtypes, shapes, byte offsets, a checksum). Inside a
bucket the tensors are laid out back to back without padding, ordered by element size (8-byte
dtypes first, then 4, 2, 1), so every tensor starts at an offset that is a multiple of its own
element size and the receiver can view it in place without a copy; the same layout is a valid
safetensors data section, which the files backend writes as is.

A tensor bigger than `bucket_bytes` is not split: it becomes a bucket of its own whose buffer is
the tensor's own bytes (no copy on the sender; the receiver allocates fresh memory for it, which
the caller then owns), so the pre-allocated bucket buffers never grow.

Checksums (`CHECKSUMS`), one per bucket, computed by the sender after packing and checked by the
receiver before unpacking:
- "sum64" (the default): the buffer read as little-endian 64-bit words, word i added (mod 2**64)
  into lane i % 512; the result is the CRC-32 of the 512 lane sums, the tail bytes and the
  length. About 15 GB/s on one idle core here. It catches any single changed word (so any
  flipped bit), truncation, and most damage to several words; it misses changes that cancel
  within a lane, such as two 4 KiB-aligned 4 KiB blocks swapped (a test pins this blind spot).
- "crc32": zlib's CRC-32 over the bytes, which also catches reorderings, but runs at about
  2 GB/s on one core here: slower than a loopback gloo broadcast (2-3 GB/s), so with it the
  checksum, not the link, sets the speed of a push (bench/weight_sync.py measures both).
Pass `checksum=None` to an engine to skip checking.

A bucket may travel in *pieces* (`BucketMeta.pieces`, `(offset, nbytes)` spans that tile the
bucket): the broadcast engine sends a large tensor straight from its own storage instead of
copying it into the bucket buffer first, so the sender holds no contiguous copy of the bucket.
Its checksum is then the CRC-32 of the pieces' spans and their own checksums
(`bucket_checksum`), which the receiver recomputes over the same spans of its contiguous buffer.

This module does not move bytes between processes and does not know about modules or servers:
that is `agentrl.weights.engine` and its backends, and `agentrl.weights.loading`.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from agentrl.errors import ChecksumError, WeightSyncError

__all__ = [
    "CHECKSUMS",
    "DTYPES",
    "Bucket",
    "BucketMeta",
    "TensorEntry",
    "bucket_checksum",
    "combine_checksums",
    "compute_checksum",
    "pack_bucket",
    "plan_buckets",
    "tensor_nbytes",
    "unpack_bucket",
    "verify_bucket",
]

# One vocabulary for dtypes everywhere: the safetensors codes, so the files backend writes them as is.
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_CODES: dict[torch.dtype, str] = {dtype: code for code, dtype in DTYPES.items()}

CHECKSUMS: tuple[str, ...] = ("crc32", "sum64")
_SUM64_LANES = 512


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives inside a bucket: `nbytes` bytes from byte `offset`."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class BucketMeta:
    """Everything a receiver needs to unpack and verify one bucket, except its bytes."""

    index: int
    version: int
    entries: tuple[TensorEntry, ...]
    nbytes: int
    checksum: int | None = None
    checksum_kind: str | None = None
    oversized: bool = False
    pieces: tuple[tuple[int, int], ...] = ()
    """`(offset, nbytes)` spans the checksum was taken over, one by one; empty: the whole buffer."""


@dataclass
class Bucket:
    """A bucket in flight: its metadata, its bytes (a 1-D uint8 tensor) and how to free them.

    `release` hands a pooled buffer back for reuse; it is a no-op for a bucket that owns its
    bytes (an oversized tensor, or a buffer read into fresh memory).
    """

    meta: BucketMeta
    data: torch.Tensor
    release: Callable[[], None] = field(default=lambda: None, repr=False)
    received_checksum: int | None = None
    """The checksum a receiver already took over `data` as its pieces landed (None: not yet)."""


def tensor_nbytes(tensor: torch.Tensor) -> int:
    """Bytes the tensor's elements take once packed (its storage may be larger)."""
    return tensor.numel() * tensor.element_size()


def _dtype_code(name: str, tensor: torch.Tensor) -> str:
    code = _CODES.get(tensor.dtype)
    if code is None:
        raise WeightSyncError(
            f"Tensor '{name}' has dtype {tensor.dtype}, which weight sync cannot carry; "
            f"supported: {', '.join(str(d) for d in DTYPES.values())}."
        )
    return code


def plan_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a stream of named tensors into lists whose packed size is at most `bucket_bytes`.

    Holds references to one bucket's tensors at a time, never copies. A tensor larger than
    `bucket_bytes` comes out alone in a list of its own. Duplicate names raise WeightSyncError.
    """
    if bucket_bytes <= 0:
        raise WeightSyncError(f"bucket_bytes must be positive, got {bucket_bytes}.")
    seen: set[str] = set()
    group: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        if not isinstance(tensor, torch.Tensor):
            raise WeightSyncError(f"'{name}' is a {type(tensor).__name__}, not a torch.Tensor.")
        if name in seen:
            raise WeightSyncError(f"Tensor name '{name}' appears twice in one weight push; names must be unique.")
        seen.add(name)
        _dtype_code(name, tensor)
        nbytes = tensor_nbytes(tensor)
        if nbytes > bucket_bytes:
            if group:
                yield group
                group, size = [], 0
            yield [(name, tensor)]
            continue
        if size + nbytes > bucket_bytes:
            yield group
            group, size = [], 0
        group.append((name, tensor))
        size += nbytes
    if group:
        yield group


def compute_checksum(data: torch.Tensor, kind: str = "sum64") -> int:
    """Checksum of a 1-D uint8 tensor's bytes with the named algorithm (see the module docstring)."""
    if kind not in CHECKSUMS:
        raise WeightSyncError(f"Unknown checksum '{kind}'; choose one of {', '.join(CHECKSUMS)} or None.")
    if data.device.type != "cpu":
        data = data.cpu()  # a device-to-host copy: the cost of checksumming GPU buckets
    raw = data.numpy()
    if kind == "crc32":
        return zlib.crc32(raw.data)
    # Word i is added into lane i % 512: summing down the columns of a (rows, 512) view is a
    # stream of contiguous vector adds, about twice as fast as summing along rows.
    n_words = raw.size // 8
    full = (n_words // _SUM64_LANES) * _SUM64_LANES
    words = raw[: n_words * 8].view("<u8")
    lanes = words[:full].reshape(-1, _SUM64_LANES).sum(axis=0, dtype=np.uint64)
    extra = np.array([words[full:].sum(dtype=np.uint64), raw.size], dtype=np.uint64)
    crc = zlib.crc32(np.concatenate([lanes, extra]).astype("<u8", copy=False).data)
    return zlib.crc32(raw[n_words * 8 :].data, crc)


def bucket_checksum(data: torch.Tensor, kind: str, pieces: tuple[tuple[int, int], ...] = ()) -> int:
    """Checksum of a bucket's bytes: of the whole buffer, or combined over `pieces` (see the module doc)."""
    if not pieces:
        return compute_checksum(data, kind)
    parts = [(offset, nbytes, compute_checksum(data[offset : offset + nbytes], kind)) for offset, nbytes in pieces]
    return combine_checksums(parts)


def combine_checksums(parts: list[tuple[int, int, int]]) -> int:
    """One checksum for a bucket from its pieces' `(offset, nbytes, checksum)`."""
    return zlib.crc32(np.array(parts, dtype="<u8").tobytes())


def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy `src`'s elements into the uint8 slice `dst`.

    Host-to-host copies of contiguous tensors go through numpy as one single-threaded memcpy:
    torch's intra-op parallel copy is several times slower when the cores are busy (as they are
    while the transport thread and the receiver run), and no faster when they are idle.
    """
    if dst.device.type == "cpu" and src.device.type == "cpu" and src.is_contiguous():
        np.copyto(dst.numpy(), src.reshape(-1).view(torch.uint8).numpy())
    else:
        dst.view(src.dtype).view(src.shape).copy_(src)


def pack_bucket(
    group: list[tuple[str, torch.Tensor]],
    buffer: torch.Tensor | None,
    *,
    index: int,
    version: int,
    checksum: str | None = "sum64",
    device: torch.device | str | None = None,
) -> Bucket:
    """Copy one planned group into `buffer` (a 1-D uint8 tensor) and describe it.

    A group holding a single tensor that does not fit the buffer (or `buffer=None`) is not
    copied: the bucket's data is the tensor's own bytes, moved to `device` if it lives elsewhere.
    """
    with torch.no_grad():
        total = sum(tensor_nbytes(t) for _, t in group)
        if buffer is None or total > buffer.numel():
            if len(group) != 1:
                raise WeightSyncError(
                    f"Bucket {index} needs {total} bytes but its buffer holds "
                    f"{0 if buffer is None else buffer.numel()}; plan buckets with plan_buckets()."
                )
            name, tensor = group[0]
            data = tensor.detach()
            if device is not None:
                data = data.to(device)
            data = data.contiguous().reshape(-1).view(torch.uint8)
            entry = TensorEntry(name, _dtype_code(name, tensor), tuple(tensor.shape), 0, total)
            entries: tuple[TensorEntry, ...] = (entry,)
            oversized = True
        else:
            # Larger elements first keeps every offset a multiple of its element size.
            ordered = sorted(group, key=lambda item: -item[1].element_size())
            offset = 0
            built = []
            for name, tensor in ordered:
                nbytes = tensor_nbytes(tensor)
                if nbytes:
                    _copy_into(buffer[offset : offset + nbytes], tensor.detach())
                built.append(TensorEntry(name, _dtype_code(name, tensor), tuple(tensor.shape), offset, nbytes))
                offset += nbytes
            data = buffer[:total]
            entries = tuple(built)
            oversized = False
    value = compute_checksum(data, checksum) if checksum else None
    meta = BucketMeta(index, version, entries, total, value, checksum, oversized)
    return Bucket(meta, data)


def verify_bucket(meta: BucketMeta, data: torch.Tensor, actual: int | None = None) -> None:
    """Raise ChecksumError naming the bucket if `data` does not match `meta`'s size or checksum.

    `actual` is the checksum of `data` when the caller already took it (the broadcast receiver
    does, piece by piece while the bytes are still in cache); None computes it here.
    """
    if data.numel() != meta.nbytes:
        raise ChecksumError(
            f"Bucket {meta.index} of weight version {meta.version} arrived with {data.numel()} bytes, "
            f"expected {meta.nbytes}; the push was truncated. Push the weights again."
        )
    if meta.checksum is None or meta.checksum_kind is None:
        return
    if actual is None:
        actual = bucket_checksum(data, meta.checksum_kind, meta.pieces)
    if actual != meta.checksum:
        names = ", ".join(e.name for e in meta.entries[:3]) + (", ..." if len(meta.entries) > 3 else "")
        raise ChecksumError(
            f"Bucket {meta.index} of weight version {meta.version} ({names}) failed its "
            f"{meta.checksum_kind} check: got {actual:#010x}, sender computed {meta.checksum:#010x}. "
            "The bytes were corrupted in transit or on disk; push the weights again."
        )


def unpack_bucket(
    meta: BucketMeta, data: torch.Tensor, *, verify: bool = True
) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of a bucket, as views into `data` (copies only for misaligned offsets).

    The views share memory with `data`: clone them to keep them past the buffer's reuse.
    """
    if verify:
        verify_bucket(meta, data)
    out = []
    for entry in meta.entries:
        dtype = DTYPES.get(entry.dtype)
        if dtype is None:
            raise WeightSyncError(f"Bucket {meta.index}: tensor '{entry.name}' has unknown dtype '{entry.dtype}'.")
        raw = data[entry.offset : entry.offset + entry.nbytes]
        itemsize = torch.empty((), dtype=dtype).element_size()
        if entry.nbytes % itemsize:
            raise WeightSyncError(
                f"Bucket {meta.index}: tensor '{entry.name}' has {entry.nbytes} bytes, "
                f"not a multiple of {entry.dtype}'s {itemsize}."
            )
        if (raw.storage_offset() % itemsize) or (raw.data_ptr() % itemsize):
            raw = raw.clone()  # a foreign file may not align tensors; a copy is then unavoidable
        tensor = raw.view(dtype).view(entry.shape)
        out.append((entry.name, tensor))
    return out
