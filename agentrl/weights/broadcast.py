"""torch.distributed broadcast checkpoint engine: one trainer rank pushes, every other rank receives.

Every rank of the process group builds the engine; rank `src` (the trainer, rank 0 by default)
calls `send`, all others call `receive`. Per bucket, the pickled metadata goes out in one
broadcast of a reused 64 KiB control buffer (a second broadcast only for metadata longer than
that) and the bytes in one `broadcast` of the bucket's uint8 buffer; a final `PushEnd` message
closes the push (or aborts it, so receivers raise instead of waiting for ever
when the sender's iterator fails). gloo carries CPU buffers, NCCL GPU buffers; with NCCL the
buffers live on the current CUDA device and a checksum costs a device-to-host copy (pass
`checksum=None` there if that copy matters more than the check).

This module does not create the process group (the caller or the orchestration layer does, and
should give weight sync a group of its own), nor does it apply weights to a model.
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from agentrl.errors import WeightSyncError
from agentrl.weights.buckets import Bucket
from agentrl.weights.engine import CheckpointEngine, PushEnd, WeightStream, _Once

__all__ = ["BroadcastCheckpointEngine"]

_CONTROL_BYTES = 64 << 10


class BroadcastCheckpointEngine(CheckpointEngine):
    """Bucketed broadcast from rank `src` over `group` (the default group when None)."""

    name = "broadcast"

    def __init__(self, *, group: Any = None, src: int = 0, device: torch.device | str | None = None,
                 **kwargs: Any) -> None:
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
        self.rank = dist.get_rank()
        # Same size on every rank: a broadcast needs equal lengths everywhere.
        self._control = torch.zeros(_CONTROL_BYTES, dtype=torch.uint8, device=self.device)

    def _object_broadcast(self, message: Any) -> Any:
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

    def _transmit(self, bucket: Bucket) -> None:
        self._object_broadcast(bucket.meta)
        if bucket.meta.nbytes:
            dist.broadcast(bucket.data, src=self.src, group=self.group)

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
            meta = message
            if meta.nbytes > self.recv_buffers.nbytes:
                data = torch.empty(meta.nbytes, dtype=torch.uint8, device=self.device)
                release: Any = _Once(lambda: None)
            else:
                slot, buffer = self.recv_buffers.acquire()
                data = buffer[: meta.nbytes]
                release = _Once(lambda slot=slot: self.recv_buffers.release(slot))
            if meta.nbytes:
                dist.broadcast(data, src=self.src, group=self.group)
            yield Bucket(meta, data, release)
