"""In-process checkpoint engine: trainer and inference engine colocated in one Python process.

Buckets are handed from the sender to the receiver through a one-slot queue; the receiver reads
the tensors straight out of the sender's bucket buffer (no serialisation, no second copy) and
hands the buffer back when it moves on, so at most two buckets are alive at a time. Use it by
calling `send` and `receive` on two threads, or give the engine a `consumer` (for example
`lambda stream: load_into_module(model, stream)`) and call `send` alone: it runs the consumer on
a helper thread for the duration of the push.

This backend does not cross a process boundary; use `broadcast` or `files` for that.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from agentrl.errors import WeightSyncError
from agentrl.weights.buckets import Bucket
from agentrl.weights.engine import CheckpointEngine, PushEnd, StreamItem, WeightStream

__all__ = ["InProcessCheckpointEngine"]


class InProcessCheckpointEngine(CheckpointEngine):
    """Hands buckets over in memory; see the module docstring for the two ways to drive it."""

    name = "inprocess"
    _transmit_keeps_buffer = True

    def __init__(self, *, consumer: Callable[[WeightStream], object] | None = None,
                 timeout_s: float = 600.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.consumer = consumer
        self.timeout_s = timeout_s
        self._channel: queue.Queue[StreamItem] = queue.Queue(maxsize=1)

    def _send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        consumer = self.consumer
        if consumer is None:
            super()._send(named_tensors, version)
            return
        errors: list[BaseException] = []

        def consume() -> None:
            try:
                consumer(self.receive())
            except BaseException as exc:
                errors.append(exc)

        helper = threading.Thread(target=consume, name="agentrl-weights-consumer", daemon=True)
        helper.start()
        try:
            super()._send(named_tensors, version)
        finally:
            helper.join()
        if errors:
            raise errors[0]

    def _hand_over(self, item: Bucket | PushEnd) -> None:
        try:
            self._channel.put(item, timeout=self.timeout_s)
        except queue.Full:
            raise WeightSyncError(
                f"No receiver took weight bucket within {self.timeout_s:.0f} s; call receive() on "
                "another thread, or build the engine with consumer=..."
            ) from None

    def _transmit(self, bucket: Bucket) -> None:
        self._hand_over(bucket)

    def _end_push(self, end: PushEnd) -> None:
        self._hand_over(end)

    def receive(self, *, copy: bool = False) -> WeightStream:
        return WeightStream(self._channel, None, copy=copy, verify=self.checksum is not None)

    def _incoming(self) -> Iterator[Bucket | PushEnd]:  # pragma: no cover - receive() reads the channel
        raise NotImplementedError
