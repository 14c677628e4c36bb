"""The receiving side as servers use it: one call turns a weight *source* into a verified stream.

A source is what the trainer tells a server to load, as a string: a checkpoint directory on the
server's filesystem (the files engine's `weights/version-N`, or any Hugging Face model directory)
or the `http(s)://` URL of a trainer's weight endpoint (the http engine), plus the version and,
for an endpoint, its bearer token. `receive_weights(source, version=..., token=...)` returns the
`WeightStream`: tensors come out only after their bucket's checksum matched the sender's (a
foreign directory without agentrl's checksums counts its buckets as unverified), and
`stream.stats` says how many buckets were verified.

`write_probe` / `probe_source` are the start-of-run check that a server can reach a source at
all: the trainer writes a nonce into its weights directory (files) or serves one (http), and each
server reads it back through the same path a push will take. A server that cannot read it does
not share the trainer's filesystem, or cannot reach its address.

This module applies nothing to a model: `loading.load_into_module` (the hf server) and vLLM's
`load_weights` (the vLLM worker) do.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from agentrl.errors import WeightSyncError
from agentrl.weights.engine import WeightStream
from agentrl.weights.files import index_of, read_checkpoint_dir
from agentrl.weights.http import HTTPCheckpointEngine

__all__ = ["PROBE_NAME", "is_endpoint", "probe_source", "receive_weights", "write_probe"]

PROBE_NAME = ".agentrl-probe"
"""The file in a files-engine weights directory that `probe_source` reads back."""


def is_endpoint(source: str) -> bool:
    """Whether `source` names a trainer's weight endpoint (http engine) rather than a directory."""
    return source.startswith(("http://", "https://"))


def receive_weights(source: str, *, version: int | None = None, token: str | None = None,
                    owned: bool = True, retries: int = 2, timeout_s: float = 120.0) -> WeightStream:
    """The verified stream of the weights at `source` (see the module docstring).

    `version` picks the version of an endpoint (None: its newest) and is checked against what a
    files-engine directory records. With `owned` (the default) every bucket lands in memory of its
    own, so the tensors may be kept without copying (vLLM's loader holds a layer's tensors until
    the layer is complete); `owned=False` reuses two buffers (the tensors are then views, valid
    until the stream moves past their bucket).
    """
    if is_endpoint(source):
        engine = HTTPCheckpointEngine(url=source, token=token, retries=retries, timeout_s=timeout_s)
        return engine.receive(version, owned=owned)
    path = Path(source)
    if not path.is_dir():
        raise WeightSyncError(
            f"Weight directory {source} does not exist on this server's machine. The files engine needs a "
            "directory that the trainer and every server share; otherwise use weights.backend=http."
        )
    recorded = (index_of(path) or {}).get("version")
    if version is not None and recorded is not None and int(recorded) != version:
        raise WeightSyncError(f"{source} holds weight version {recorded}, but version {version} was asked for.")
    return read_checkpoint_dir(path)


def write_probe(directory: str | os.PathLike[str]) -> str:
    """Write a fresh nonce into `directory` for servers to read back (`probe_source`); return it."""
    nonce = secrets.token_hex(8)
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / f"{PROBE_NAME}.tmp"
    tmp.write_text(nonce)
    tmp.replace(path / PROBE_NAME)
    return nonce


def probe_source(source: str, *, token: str | None = None, timeout_s: float = 10.0) -> str:
    """The nonce a weight source holds: read from `<directory>/.agentrl-probe`, or asked of an endpoint."""
    if is_endpoint(source):
        return HTTPCheckpointEngine(url=source, token=token, timeout_s=timeout_s).probe()
    path = Path(source) / PROBE_NAME
    try:
        return path.read_text().strip()
    except OSError as exc:
        raise WeightSyncError(
            f"Cannot read {path} on this server's machine ({exc.strerror or exc}): the trainer's weights "
            "directory is not shared with this server. Use weights.backend=http, or put the run directory "
            "on a filesystem every node mounts."
        ) from exc
