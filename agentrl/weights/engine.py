"""The checkpoint engine: one interface for pushing a trainer's weights to inference engines.

`CheckpointEngine.send(named_tensors, version)` runs on the trainer side and
`CheckpointEngine.receive()` on the inference side; it returns a `WeightStream`, an iterator of
`(name, tensor)` pairs that also carries the pushed `version`. Both sides are bucketed
(`agentrl.weights.buckets`) and double-buffered: the sender packs bucket k+1 into one of two
pre-allocated buffers while bucket k is in flight from the other, and the receiver fetches bucket
k+1 while the caller consumes bucket k. The buffers are allocated on first use and then reused by
every later push, so a long run does not grow its memory.

Tensors a `WeightStream` yields are views into a reused receive buffer: they stay valid until the
stream is asked for the item after the last tensor of their bucket. Copy them out (as
`load_into_module` does) or pass `copy=True` to `receive`.

This module holds the pipeline and the factory; the transports live in `inprocess.py`,
`broadcast.py`, `files.py` and `http.py`. It does not decide when to push: the orchestration layer does.
"""

from __future__ import annotations

import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, TypeAlias, TypeVar

import torch

from agentrl.errors import UnknownNameError, WeightSyncError
from agentrl.registry import closest_names
from agentrl.weights.buckets import CHECKSUMS, Bucket, pack_bucket, plan_buckets, unpack_bucket, verify_bucket

__all__ = [
    "BACKENDS",
    "DEFAULT_BUCKET_BYTES",
    "BufferPool",
    "CheckpointEngine",
    "PushEnd",
    "StreamItem",
    "TransferStats",
    "WeightStream",
    "make_checkpoint_engine",
]

DEFAULT_BUCKET_BYTES = 256 << 20

BACKENDS: dict[str, str] = {
    "broadcast": "agentrl.weights.broadcast:BroadcastCheckpointEngine",
    "files": "agentrl.weights.files:FilesCheckpointEngine",
    "http": "agentrl.weights.http:HTTPCheckpointEngine",
    "inprocess": "agentrl.weights.inprocess:InProcessCheckpointEngine",
}

_POLL_S = 0.05


@dataclass(frozen=True)
class PushEnd:
    """The end-of-push marker: how many buckets the push had, or why the sender gave up."""

    version: int
    num_buckets: int
    error: str | None = None


@dataclass
class TransferStats:
    """What the receiving end of one push saw; filled in as the stream is read.

    `verified` counts buckets whose checksum was compared with the sender's and matched before any
    of their tensors were handed out; `unverified` those that carried no checksum (a foreign
    checkpoint directory, or an engine built with `checksum=None`); `retried` buckets fetched
    again after a failed check (the http engine re-fetches a corrupted bucket before giving up).
    `receive_seconds` is the time the reader spent waiting for buckets and checking them (the
    transfer as the loader saw it); the rest of a load's time is the loading itself.
    """

    buckets: int = 0
    verified: int = 0
    unverified: int = 0
    retried: int = 0
    bytes: int = 0
    checksum: str | None = None
    receive_seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


StreamItem: TypeAlias = Bucket | PushEnd | BaseException
"""What a receiving queue carries: a push's buckets, then its PushEnd, or the error that stopped it."""

_Item = TypeVar("_Item")


class BufferPool:
    """A fixed set of equally sized uint8 buffers, handed out and returned by index.

    Buffers are allocated on first use and reused forever after; `allocations` counts how many
    were ever allocated, so tests (and callers) can check that pushes do not grow memory.
    """

    def __init__(self, nbytes: int, count: int = 2, device: torch.device | str = "cpu") -> None:
        self.nbytes = nbytes
        self.device = torch.device(device)
        self.buffers: list[torch.Tensor | None] = [None] * count
        self.allocations = 0
        self._free: queue.Queue[int] = queue.Queue()
        for slot in range(count):
            self._free.put(slot)

    def acquire(self, abort: threading.Event | None = None) -> tuple[int, torch.Tensor]:
        """Wait for a free buffer; give up with WeightSyncError once `abort` is set."""
        while True:
            try:
                slot = self._free.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if abort is not None and abort.is_set():
                    raise WeightSyncError("Weight push aborted while waiting for a free bucket buffer.") from None
        buffer = self.buffers[slot]
        if buffer is None:
            buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
            self.buffers[slot] = buffer
            self.allocations += 1
        return slot, buffer

    def release(self, slot: int) -> None:
        self._free.put(slot)


def _put(q: queue.Queue[_Item], item: _Item, abort: threading.Event) -> None:
    while True:
        try:
            q.put(item, timeout=_POLL_S)
            return
        except queue.Full:
            if abort.is_set():
                raise WeightSyncError("Weight push aborted: the other side stopped.") from None


class WeightStream(Iterator[tuple[str, torch.Tensor]]):
    """The receiving end of one push: iterate it for `(name, tensor)`; `version` is known up front.

    `num_buckets` is set once the stream is exhausted. A corrupted bucket raises ChecksumError
    when the iteration reaches it, before any of its tensors is yielded; the rest of the push is
    still drained so that the sender and any other receivers stay in step. `stats` counts the
    buckets and bytes received and the checksums verified so far.
    """

    def __init__(self, items: queue.Queue[StreamItem], worker: threading.Thread | None, *, copy: bool,
                 verify: bool = True, stats: TransferStats | None = None) -> None:
        self._items = items
        self._worker = worker
        self._copy = copy
        self._verify = verify
        self.stats = stats if stats is not None else TransferStats()
        start = time.perf_counter()
        self._first = items.get()
        self.stats.receive_seconds += time.perf_counter() - start
        first = self._first
        self.version: int | None = (
            first.version if isinstance(first, PushEnd)
            else first.meta.version if isinstance(first, Bucket) else None
        )
        self.num_buckets: int | None = None
        self._started = False
        self._gen = self._run()

    def __next__(self) -> tuple[str, torch.Tensor]:
        self._started = True
        return next(self._gen)

    def close(self) -> None:
        """Stop early (or never start): the rest of the push is received and discarded.

        Every stream must be exhausted or closed; a stream left half-read keeps the sender (and,
        with broadcast, the whole group) waiting for it.
        """
        if self._started:
            self._gen.close()
        else:
            self._started = True
            self._gen.close()
            self._drain(self._first)

    def __enter__(self) -> WeightStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> Generator[tuple[str, torch.Tensor], None, None]:
        item = self._first
        held: Bucket | None = None
        try:
            while True:
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, PushEnd):
                    if item.error is not None:
                        raise WeightSyncError(
                            f"The sender aborted weight push {item.version} after {item.num_buckets} "
                            f"bucket(s): {item.error}"
                        )
                    self.num_buckets = item.num_buckets
                    return
                held = item
                meta = item.meta
                start = time.perf_counter()
                if self._verify:
                    verify_bucket(meta, item.data, item.received_checksum)
                stats = self.stats
                stats.receive_seconds += time.perf_counter() - start
                stats.buckets += 1
                stats.bytes += meta.nbytes
                if self._verify and meta.checksum is not None and meta.checksum_kind is not None:
                    stats.verified += 1
                    stats.checksum = meta.checksum_kind
                else:
                    stats.unverified += 1
                for name, tensor in unpack_bucket(meta, item.data, verify=False):
                    yield name, (tensor.clone() if self._copy else tensor)
                # The caller asked past this bucket's last tensor: its buffer may be refilled now.
                held = None
                item.release()
                start = time.perf_counter()
                item = self._items.get()
                stats.receive_seconds += time.perf_counter() - start
        finally:
            if held is not None:
                held.release()
            self._drain(item)

    def _drain(self, item: StreamItem) -> None:
        while not isinstance(item, (PushEnd, BaseException)):
            item.release()
            item = self._items.get()
        if self._worker is not None:
            self._worker.join()


class CheckpointEngine(ABC):
    """Bucketed, double-buffered weight push; subclasses provide the transport.

    A subclass implements `_transmit(bucket)` and `_end_push(end)` for the sending side (they run
    on a transport thread, in bucket order) and `_incoming()` for the receiving side (a generator
    of `Bucket`s ending with a `PushEnd`, run on a fetch thread).
    """

    name: str = "base"
    # True when the transport hands the sender's buffer to the receiver, who releases it.
    _transmit_keeps_buffer = False

    def __init__(self, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, checksum: str | None = "sum64",
                 device: torch.device | str = "cpu", num_buffers: int = 2) -> None:
        if bucket_bytes <= 0:
            raise WeightSyncError(f"bucket_bytes must be positive, got {bucket_bytes}.")
        if checksum is not None and checksum not in CHECKSUMS:
            raise WeightSyncError(f"Unknown checksum '{checksum}'; choose one of {', '.join(CHECKSUMS)} or None.")
        if num_buffers < 1:
            raise WeightSyncError(f"num_buffers must be at least 1, got {num_buffers}.")
        self.bucket_bytes = bucket_bytes
        self.checksum = checksum
        self.device = torch.device(device)
        self.send_buffers = BufferPool(bucket_bytes, num_buffers, self.device)
        self.recv_buffers = BufferPool(bucket_bytes, num_buffers, self.device)
        self._sending = threading.Lock()
        self._recv_stats = TransferStats()

    # ---------------------------------------------------------------- sending
    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Push one version of the weights; returns once the transport has taken every bucket."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise WeightSyncError(f"version must be a non-negative int, got {version!r}.")
        if not self._sending.acquire(blocking=False):
            raise WeightSyncError(f"A weight push is already in progress on this {self.name} engine; "
                                  "pushes on one engine run one at a time.")
        try:
            self._send(named_tensors, version)
        finally:
            self._sending.release()

    def _send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        self._begin_push(version)
        handoff: queue.Queue[Bucket | PushEnd] = queue.Queue(maxsize=1)
        abort = threading.Event()
        errors: list[BaseException] = []
        worker = threading.Thread(target=self._transport_loop, args=(handoff, abort, errors),
                                  name=f"agentrl-weights-send-{self.name}", daemon=True)
        worker.start()
        count = 0
        failure: BaseException | None = None
        try:
            for group in plan_buckets(named_tensors, self.bucket_bytes):
                if abort.is_set():
                    break
                bucket = self._pack(group, count, version, abort)
                _put(handoff, bucket, abort)
                count += 1
        except BaseException as exc:
            failure = exc
        end = PushEnd(version, count, None if failure is None else f"{type(failure).__name__}: {failure}")
        handoff.put(end)
        worker.join()
        if errors:
            raise errors[0]
        if failure is not None:
            raise failure

    def _pack(self, group: list[tuple[str, torch.Tensor]], index: int, version: int,
              abort: threading.Event) -> Bucket:
        if len(group) == 1 and group[0][1].numel() * group[0][1].element_size() > self.bucket_bytes:
            return pack_bucket(group, None, index=index, version=version, checksum=self.checksum,
                               device=self.device)
        slot, buffer = self.send_buffers.acquire(abort)
        try:
            bucket = pack_bucket(group, buffer, index=index, version=version, checksum=self.checksum)
        except BaseException:
            self.send_buffers.release(slot)
            raise
        bucket.release = _Once(lambda: self.send_buffers.release(slot))
        return bucket

    def _transport_loop(self, handoff: queue.Queue[Bucket | PushEnd], abort: threading.Event,
                        errors: list[BaseException]) -> None:
        while True:
            item = handoff.get()
            if isinstance(item, PushEnd):
                if not errors:
                    try:
                        self._end_push(item)
                    except BaseException as exc:
                        errors.append(exc)
                return
            if errors:
                item.release()
                continue
            try:
                self._transmit(item)
            except BaseException as exc:
                errors.append(exc)
                abort.set()
                item.release()
                continue
            if not self._transmit_keeps_buffer:
                item.release()

    def _begin_push(self, version: int) -> None:  # noqa: B027 - optional hook
        """Prepare a push (runs on the caller's thread before the first bucket)."""

    @abstractmethod
    def _transmit(self, bucket: Bucket) -> None:
        """Move one bucket to the receivers (transport thread)."""

    @abstractmethod
    def _end_push(self, end: PushEnd) -> None:
        """Finish (or, with `end.error`, abort) a push after its last bucket (transport thread)."""

    # ---------------------------------------------------------------- receiving
    def receive(self, *, copy: bool = False) -> WeightStream:
        """Wait for the next push and return its stream; `copy=True` yields tensors the caller owns."""
        items: queue.Queue[StreamItem] = queue.Queue(maxsize=1)
        self._recv_stats = TransferStats()  # transports that retry count into it (fetch thread)
        worker = threading.Thread(target=self._fetch_loop, args=(items,),
                                  name=f"agentrl-weights-recv-{self.name}", daemon=True)
        worker.start()
        return WeightStream(items, worker, copy=copy, stats=self._recv_stats)

    def _fetch_loop(self, items: queue.Queue[StreamItem]) -> None:
        try:
            for item in self._incoming():
                items.put(item)
                if isinstance(item, PushEnd):
                    return
        except BaseException as exc:
            items.put(exc)

    @abstractmethod
    def _incoming(self) -> Iterator[Bucket | PushEnd]:
        """Yield the buckets of the next push, then its PushEnd (fetch thread)."""


class _Once:
    """Wrap a release callback so that calling it twice frees the buffer once."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self._fn = fn
        self._done = False

    def __call__(self) -> None:
        if not self._done:
            self._done = True
            self._fn()


def make_checkpoint_engine(backend: str, **kwargs: Any) -> CheckpointEngine:
    """Build a checkpoint engine by backend name: "inprocess", "broadcast", "files" or "http".

    Keyword arguments go to the backend's constructor (all take `bucket_bytes`, `checksum`,
    `device`); an unknown name raises UnknownNameError with the closest names.
    """
    target = BACKENDS.get(backend)
    if target is None:
        close = closest_names(backend, list(BACKENDS))
        hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise UnknownNameError(
            f"Unknown checkpoint engine backend '{backend}'.{hint} Choose one of: {', '.join(sorted(BACKENDS))}.",
            suggestions=close,
        )
    from agentrl.registry import import_object

    cls: type[CheckpointEngine] = import_object(target)
    return cls(**kwargs)
