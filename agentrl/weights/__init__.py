"""agentrl.weights: the checkpoint engine that carries a trainer's weights to inference engines.

Bucketing and checksums live in `buckets`, the double-buffered send/receive pipeline and the
`make_checkpoint_engine` factory in `engine`, the transports in `inprocess`, `broadcast`, `files`
and `http`, what a server calls to receive (`receive_weights(source, ...)`, a verified
`WeightStream`) in `sources`, and `load_into_module` (apply received weights to a torch module) in
`loading`. This package imports torch; of the layers below L4 only the server processes import it.

Layer L0' (DESIGN.md §2), below inference: the trainer sends through it and the servers receive
through it, so both ends verify the same checksums. It imports only the core modules of L0.
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
    TransferStats,
    WeightStream,
    make_checkpoint_engine,
)
from agentrl.weights.files import FilesCheckpointEngine, read_checkpoint_dir
from agentrl.weights.http import HTTPCheckpointEngine
from agentrl.weights.inprocess import InProcessCheckpointEngine
from agentrl.weights.loading import LoadReport, load_into_module
from agentrl.weights.sources import is_endpoint, probe_source, receive_weights, write_probe

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
    "HTTPCheckpointEngine",
    "InProcessCheckpointEngine",
    "LoadReport",
    "PushEnd",
    "TensorEntry",
    "TransferStats",
    "WeightStream",
    "bucket_checksum",
    "compute_checksum",
    "is_endpoint",
    "load_into_module",
    "make_checkpoint_engine",
    "pack_bucket",
    "plan_buckets",
    "probe_source",
    "read_checkpoint_dir",
    "receive_weights",
    "unpack_bucket",
    "verify_bucket",
    "write_probe",
]
