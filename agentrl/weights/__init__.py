"""agentrl.weights: the checkpoint engine that carries a trainer's weights to inference engines.

Bucketing and checksums live in `buckets`, the double-buffered send/receive pipeline and the
`make_checkpoint_engine` factory in `engine`, the transports in `inprocess`, `broadcast` and
`files`, and `load_into_module` (apply received weights to a torch module) in `loading`. This
package imports torch; nothing below L4 imports it.
"""

from __future__ import annotations

from agentrl.weights.broadcast import BroadcastCheckpointEngine
from agentrl.weights.buckets import (
    CHECKSUMS,
    Bucket,
    BucketMeta,
    TensorEntry,
    bucket_checksum,
    compute_checksum,
    pack_bucket,
    plan_buckets,
    unpack_bucket,
    verify_bucket,
)
from agentrl.weights.engine import (
    BACKENDS,
    DEFAULT_BUCKET_BYTES,
    BufferPool,
    CheckpointEngine,
    PushEnd,
    WeightStream,
    make_checkpoint_engine,
)
from agentrl.weights.files import FilesCheckpointEngine, read_checkpoint_dir
from agentrl.weights.inprocess import InProcessCheckpointEngine
from agentrl.weights.loading import LoadReport, load_into_module

__all__ = [
    "BACKENDS",
    "CHECKSUMS",
    "DEFAULT_BUCKET_BYTES",
    "BroadcastCheckpointEngine",
    "Bucket",
    "BucketMeta",
    "BufferPool",
    "CheckpointEngine",
    "FilesCheckpointEngine",
    "InProcessCheckpointEngine",
    "LoadReport",
    "PushEnd",
    "TensorEntry",
    "WeightStream",
    "bucket_checksum",
    "compute_checksum",
    "load_into_module",
    "make_checkpoint_engine",
    "pack_bucket",
    "plan_buckets",
    "read_checkpoint_dir",
    "unpack_bucket",
    "verify_bucket",
]
