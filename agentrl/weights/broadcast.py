"""torch.distributed broadcast checkpoint engine: one trainer rank pushes, every other rank receives.

Every rank of the process group builds the engine; rank `src` (the trainer, rank 0 by default)
calls `send`, all others call `receive`. Per bucket, the pickled metadata goes out in one
broadcast of a reused 64 KiB control buffer (a second broadcast only for metadata longer than
that), then the bytes in one `broadcast` per *piece*; a final `PushEnd` message closes the push
(or aborts it, so receivers raise instead of waiting for ever when the sender's iterator fails).

Pieces. Small tensors are copied into the bucket buffer and travel together as one piece; a
contiguous tensor of at least `direct_bytes` (default 8 MiB) is broadcast straight from its own
storage, at its place in the bucket layout, so the sender never copies it (on a CPU box that copy
costs as much as the transfer itself). Receivers are unaffected: every piece lands at its offset
in one contiguous receive buffer and the tensors are views into it. The checksum is taken per
piece and combined (`agentrl.weights.buckets.bucket_checksum`); a receiver checksums each piece
as it lands (overlapped with the pieces still in flight) and compares the result before unpacking,
so corruption in any piece is caught for the bucket as a whole. gloo carries CPU buffers, NCCL GPU buffers; with NCCL the
buffers live on the current CUDA device and a checksum costs a device-to-host copy (pass
`checksum=None` there if that copy matters more than the check).

This module does not create the process group (the caller or the orchestration layer does, and
should give weight sync a group of its own), nor does it apply weights to a model.
"""

from __future__ import annotations

import functools
import pickle
import struct
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from agentrl.errors import WeightSyncError
from agentrl.weights.buckets import (
    Bucket,
    BucketMeta,
    TensorEntry,
    _copy_into,
    _dtype_code,
    combine_checksums,
    compute_checksum,
    tensor_nbytes,
)
from agentrl.weights.engine import CheckpointEngine, PushEnd, WeightStream, _Once

__all__ = ["BroadcastCheckpointEngine"]

_CONTROL_BYTES = 64 << 10
DIRECT_BYTES = 8 << 20


@dataclass
class _PiecedBucket(Bucket):
    """A bucket whose pieces are sent from `sources[i]` (a tensor's own bytes) or, where that is
    None, from the bucket buffer at the piece's offset."""

    sources: list[torch.Tensor | None] = field(default_factory=list)


class BroadcastCheckpointEngine(CheckpointEngine):
    """Bucketed broadcast from rank `src` over `group` (the default group when None)."""

    name = "broadcast"

    def __init__(self, *, group: dist.ProcessGroup | None = None, src: int = 0, device: torch.device | str | None = None,
                 direct_bytes: int = DIRECT_BYTES, **kwargs: Any) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise WeightSyncError(
                "The broadcast checkpoint engine needs torch.distributed initialised; call "
                "torch.distributed.init_process_group('gloo' or 'nccl', ...) on every rank first."
            )
        if device is None:
            nccl = dist.get_backend(group) == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        super().__init__(device=device, **kwargs)
        self.group = group
        self.src = src
        self.direct_bytes = direct_bytes
        self.rank = dist.get_rank()
        # Same size on every rank: a broadcast needs equal lengths everywhere.
        self._control = torch.zeros(_CONTROL_BYTES, dtype=torch.uint8, device=self.device)

    def _object_broadcast(self, message: object) -> object:
        """Broadcast a small picklable message from `src` in one collective when it fits.

        `broadcast_object_list` costs two collectives (size, then payload) per message, and each
        costs milliseconds on a loaded machine; a reused fixed-size control buffer costs one.
        A message too long for it travels in a second broadcast of exactly its length.
        """
        control = self._control
        if self.rank == self.src:
            payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
            header = struct.pack("<Q", len(payload))
            inline = len(payload) <= control.numel() - 8
            raw = header + (payload if inline else b"")
            control[: len(raw)].copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
            dist.broadcast(control, src=self.src, group=self.group)
            if not inline:
                extra = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
                dist.broadcast(extra, src=self.src, group=self.group)
            return message
        dist.broadcast(control, src=self.src, group=self.group)
        head = control[:8].cpu().numpy().tobytes()
        (length,) = struct.unpack("<Q", head)
        if length <= control.numel() - 8:
            payload = control[8 : 8 + length].cpu().numpy().tobytes()
        else:
            extra = torch.empty(length, dtype=torch.uint8, device=self.device)
            dist.broadcast(extra, src=self.src, group=self.group)
            payload = extra.cpu().numpy().tobytes()
        return pickle.loads(payload)

    # ---------------------------------------------------------------- sending (rank src)
    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        if self.rank != self.src:
            raise WeightSyncError(
                f"send() called on rank {self.rank}, but this engine broadcasts from rank {self.src}; "
                "other ranks call receive()."
            )
        super().send(named_tensors, version)

    def _pack(self, group: list[tuple[str, torch.Tensor]], index: int, version: int,
              abort: threading.Event) -> Bucket:
        if len(group) == 1 and tensor_nbytes(group[0][1]) > self.bucket_bytes:
            return super()._pack(group, index, version, abort)
        slot, buffer = self.send_buffers.acquire(abort)
        try:
            bucket = self._pack_pieces(group, buffer, index, version)
        except BaseException:
            self.send_buffers.release(slot)
            raise
        bucket.release = _Once(lambda: self.send_buffers.release(slot))
        return bucket

    def _is_direct(self, tensor: torch.Tensor) -> bool:
        return tensor_nbytes(tensor) >= self.direct_bytes and tensor.is_contiguous() and tensor.device == self.device

    def _pack_pieces(self, group: list[tuple[str, torch.Tensor]], buffer: torch.Tensor, index: int,
                     version: int) -> _PiecedBucket:
        """The bucket layout of `pack_bucket`, but large tensors stay where they are (see the module doc)."""
        # Larger elements first keeps offsets aligned; within one element size the copied tensors
        # come first, so that they form one piece (one collective) instead of many.
        ordered = sorted(group, key=lambda item: (-item[1].element_size(), self._is_direct(item[1])))
        entries: list[TensorEntry] = []
        pieces: list[tuple[int, int]] = []
        sources: list[torch.Tensor | None] = []
        offset = 0
        with torch.no_grad():
            for name, tensor in ordered:
                nbytes = tensor_nbytes(tensor)
                entries.append(TensorEntry(name, _dtype_code(name, tensor), tuple(tensor.shape), offset, nbytes))
                if not nbytes:
                    continue
                if self._is_direct(tensor):
                    pieces.append((offset, nbytes))
                    sources.append(tensor.detach().reshape(-1).view(torch.uint8))
                else:
                    _copy_into(buffer[offset : offset + nbytes], tensor.detach())
                    if sources and sources[-1] is None:  # extend the run of copied tensors
                        start, length = pieces[-1]
                        pieces[-1] = (start, length + nbytes)
                    else:
                        pieces.append((offset, nbytes))
                        sources.append(None)
                offset += nbytes
        data = buffer[:offset]
        value = None
        if not pieces and self.checksum:
            # Only empty tensors: no pieces, so the receiver checksums the (empty) buffer whole.
            value = compute_checksum(data, self.checksum)
        elif self.checksum:
            value = combine_checksums([
                (start, length, compute_checksum(data[start : start + length] if src is None else src, self.checksum))
                for (start, length), src in zip(pieces, sources, strict=True)
            ])
        meta = BucketMeta(index, version, tuple(entries), offset, value, self.checksum, False, tuple(pieces))
        return _PiecedBucket(meta, data, sources=sources)

    def _transmit(self, bucket: Bucket) -> None:
        self._object_broadcast(bucket.meta)
        if not bucket.meta.nbytes:
            return
        sources = bucket.sources if isinstance(bucket, _PiecedBucket) else [None]
        pieces = [
            bucket.data[start : start + length] if src is None else src
            for (start, length), src in zip(bucket.meta.pieces or ((0, bucket.meta.nbytes),), sources, strict=True)
        ]
        self._broadcast_all(pieces)

    def _broadcast_all(self, tensors: list[torch.Tensor]) -> None:
        """Broadcast every tensor, all in flight at once: each collective has a fixed latency
        (a handshake and thread wake-ups, milliseconds on a busy machine) that then overlaps."""
        works = [dist.broadcast(t, src=self.src, group=self.group, async_op=True) for t in tensors if t.numel()]
        for work in works:
            work.wait()

    def _end_push(self, end: PushEnd) -> None:
        self._object_broadcast(end)

    # ---------------------------------------------------------------- receiving (other ranks)
    def receive(self, *, copy: bool = False) -> WeightStream:
        if self.rank == self.src:
            raise WeightSyncError(f"receive() called on rank {self.rank}, the sending rank; call send() there.")
        return super().receive(copy=copy)

    def _incoming(self) -> Iterator[Bucket | PushEnd]:
        while True:
            message = self._object_broadcast(None)
            if isinstance(message, PushEnd):
                yield message
                return
            if not isinstance(message, BucketMeta):
                raise WeightSyncError(f"Rank {self.src} broadcast a {type(message).__name__} where a bucket's "
                                      "metadata or the end of a push belongs; every rank must run the same "
                                      "agentrl version.")
            meta = message
            if meta.nbytes > self.recv_buffers.nbytes:
                data = torch.empty(meta.nbytes, dtype=torch.uint8, device=self.device)
                release: Callable[[], None] = _Once(lambda: None)
            else:
                slot, buffer = self.recv_buffers.acquire()
                data = buffer[: meta.nbytes]
                release = _Once(functools.partial(self.recv_buffers.release, slot))
            yield Bucket(meta, data, release, self._receive_pieces(meta, data))

    def _receive_pieces(self, meta: BucketMeta, data: torch.Tensor) -> int | None:
        """Receive every piece of a bucket into `data`; return the checksum of what arrived.

        All pieces are in flight at once, and each is checksummed here, on the fetch thread, as
        soon as it has landed, while the later pieces are still arriving; the consumer thread then
        only compares the result with the sender's (`verify_bucket`) before it unpacks anything,
        instead of reading the whole bucket once more after the last piece.
        """
        spans = meta.pieces or ((0, meta.nbytes),)
        views = [data[start : start + length] for start, length in spans]
        works = [dist.broadcast(v, src=self.src, group=self.group, async_op=True) if v.numel() else None
                 for v in views]
        parts = []
        for (start, length), view, work in zip(spans, views, works, strict=True):
            if work is not None:
                work.wait()
            if meta.checksum_kind is not None:
                parts.append((start, length, compute_checksum(view, meta.checksum_kind)))
        if meta.checksum_kind is None:
            return None
        return combine_checksums(parts) if meta.pieces else parts[0][2]
