"""HTTP checkpoint engine: servers pull a trainer's weights over plain HTTP, bucket by bucket.

For servers that do not share a filesystem with the trainer and need no NCCL group: any two
machines that can open a TCP connection will do.

Sending side (the trainer's rank 0), `HTTPCheckpointEngine(host=ADDRESS)`: the engine starts a
small threaded HTTP endpoint on `host` (a free port unless `port` is given; `url` is what servers
connect to). `send(named_tensors, version)` packs the tensors into buckets of `bucket_bytes`, each
with its checksum, in host memory of their own, and publishes the version when its last bucket is
packed. The newest `keep_last` versions stay published (memory: `keep_last` copies of the
weights), so a push never waits for slow servers, a bucket that arrives corrupted can be fetched
again, and a server that restarts can pull the current version at any time. The push pipeline is
the package's usual one: bucket k+1 is packed while bucket k is being published.

Receiving side (a server), `HTTPCheckpointEngine(url=URL, token=TOKEN).receive(version)`: a fetch
thread reads the version's manifest and then its buckets, one GET each on one kept-alive
connection, into a pool of two reused buffers (or, with `owned=True`, into memory of their own so
the tensors may be kept without a copy), while the caller consumes the previous bucket. Each
bucket is checksummed on the fetch thread as it lands; a mismatch or a broken connection is
retried up to `retries` times before the stream raises ChecksumError / WeightSyncError, which it
does before handing out any tensor of that bucket.

Endpoints (all need `Authorization: Bearer <token>`, else 401):

    GET /probe                       {"nonce": ...}: the reachability check a run makes at start
    GET /versions                    {"versions": [...]}: published versions, oldest first
    GET /versions/<v>/manifest       every bucket's metadata (names, dtypes, shapes, offsets, checksum)
    GET /versions/<v>/buckets/<i>    the bucket's bytes

What it is not: the token keeps other jobs and stray clients off the endpoint, but nothing is
encrypted; run it on a network you trust. It does not notify servers: the caller tells them
(`POST /update_weights {source: url, version, token}`). No address is assumed: the sender binds
exactly the `host` it is given (in a run, the trainer node's address).
"""

from __future__ import annotations

import hmac
import http.client
import json
import logging
import secrets
import threading
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from agentrl.errors import WeightSyncError
from agentrl.weights.buckets import (
    Bucket,
    BucketMeta,
    TensorEntry,
    bucket_checksum,
    pack_bucket,
    tensor_nbytes,
)
from agentrl.weights.engine import BufferPool, CheckpointEngine, PushEnd, WeightStream, _Once

__all__ = ["HTTPCheckpointEngine"]

log = logging.getLogger(__name__)


def _meta_to_json(meta: BucketMeta) -> dict[str, Any]:
    return {
        "index": meta.index, "nbytes": meta.nbytes, "checksum": meta.checksum, "checksum_kind": meta.checksum_kind,
        "entries": [[e.name, e.dtype, list(e.shape), e.offset, e.nbytes] for e in meta.entries],
    }  # fmt: skip


def _meta_from_json(raw: dict[str, Any], version: int) -> BucketMeta:
    try:
        entries = tuple(TensorEntry(str(n), str(d), tuple(int(x) for x in s), int(o), int(b))
                        for n, d, s, o, b in raw["entries"])
        return BucketMeta(int(raw["index"]), version, entries, int(raw["nbytes"]), raw.get("checksum"),
                          raw.get("checksum_kind"))
    except (KeyError, TypeError, ValueError) as exc:
        raise WeightSyncError(f"The weight endpoint sent a malformed manifest for version {version}: {exc!r}") from exc


class _Published:
    """One version held for pulling: its buckets (owned bytes) and its manifest, serialised once."""

    def __init__(self, version: int, buckets: list[Bucket]) -> None:
        self.version = version
        self.buckets = buckets
        self.manifest = json.dumps({
            "version": version, "buckets": [_meta_to_json(b.meta) for b in buckets],
        }).encode()  # fmt: skip


class _EndpointServer(ThreadingHTTPServer):
    daemon_threads = True
    engine: HTTPCheckpointEngine


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: one connection carries a whole push
    server: _EndpointServer

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("weight endpoint: " + format, *args)

    def _reply(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, message: str) -> None:
        self._reply(status, json.dumps({"detail": message}).encode())

    def do_GET(self) -> None:
        engine = self.server.engine
        given = self.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {engine.token}".encode()):
            self._error(401, "missing or wrong bearer token for this weight endpoint")
            return
        parts = [p for p in urllib.parse.urlsplit(self.path).path.split("/") if p]
        try:
            if parts == ["probe"]:
                self._reply(200, json.dumps({"nonce": engine.nonce}).encode())
            elif parts == ["versions"]:
                self._reply(200, json.dumps({"versions": engine.published_versions()}).encode())
            elif len(parts) == 3 and parts[0] == "versions" and parts[2] == "manifest":
                self._reply(200, engine._lookup(int(parts[1])).manifest)
            elif len(parts) == 4 and parts[0] == "versions" and parts[2] == "buckets":
                published = engine._lookup(int(parts[1]))
                index = int(parts[3])
                if not 0 <= index < len(published.buckets):
                    raise LookupError(f"version {published.version} has {len(published.buckets)} buckets, not {index + 1}")
                body = engine._bucket_bytes(published.buckets[index])
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            else:
                self._error(404, f"no such weight endpoint path: {self.path}")
        except LookupError as exc:
            self._error(404, str(exc))
        except ValueError:
            self._error(404, f"malformed weight endpoint path: {self.path}")
        except (BrokenPipeError, ConnectionResetError):  # the receiver went away mid-bucket
            self.close_connection = True


class HTTPCheckpointEngine(CheckpointEngine):
    """Publish versions on an HTTP endpoint (`host=`) or pull them from one (`url=`); see the module doc."""

    name = "http"

    def __init__(self, *, host: str | None = None, port: int = 0, url: str | None = None,
                 token: str | None = None, keep_last: int = 2, retries: int = 2, timeout_s: float = 120.0,
                 **kwargs: Any) -> None:
        kwargs.setdefault("device", "cpu")
        super().__init__(**kwargs)
        if self.device.type != "cpu":
            raise WeightSyncError(f"The http checkpoint engine keeps its buckets in host memory, got device={self.device}.")
        if (host is None) == (url is None):
            raise WeightSyncError(
                "HTTPCheckpointEngine needs exactly one of host= (publish on this machine's address) or url= "
                "(pull from a trainer's endpoint)."
            )
        if keep_last < 1:
            raise WeightSyncError(f"keep_last must be at least 1, got {keep_last}.")
        if retries < 0:
            raise WeightSyncError(f"retries must be >= 0, got {retries}.")
        self.keep_last = keep_last
        self.retries = retries
        self.timeout_s = timeout_s
        self.nonce = secrets.token_hex(8)
        self._published: OrderedDict[int, _Published] = OrderedDict()
        self._lock = threading.Lock()
        self._pending: list[Bucket] = []
        self._server: _EndpointServer | None = None
        if host is not None:
            self.token = token or secrets.token_urlsafe(24)
            self._serve(host, port)
        else:
            assert url is not None
            parsed = urllib.parse.urlsplit(url)
            if parsed.scheme not in ("http", "https") or not parsed.hostname:
                raise WeightSyncError(f"'{url}' is not an http(s) URL of a weight endpoint.")
            self.url = url.rstrip("/")
            self.token = token or ""
            self._parsed = parsed

    # ---------------------------------------------------------------- the endpoint (sending side)
    def _serve(self, host: str, port: int) -> None:
        try:
            server = _EndpointServer((host, port), _Handler)
        except OSError as exc:
            raise WeightSyncError(f"Cannot open the weight endpoint on {host}:{port}: {exc}. Give an address "
                                  "of this machine that the servers can reach.") from exc
        server.engine = self
        self._server = server
        bound_host, bound_port = server.server_address[:2]
        name = bound_host.decode() if isinstance(bound_host, bytes) else str(bound_host)
        shown = f"[{name}]" if ":" in name else name
        self.url = f"http://{shown}:{bound_port}"
        thread = threading.Thread(target=server.serve_forever, name="agentrl-weights-endpoint", daemon=True)
        thread.start()
        log.info("weight endpoint listening on %s", self.url)

    def close(self) -> None:
        """Stop the endpoint (sending side) and drop the published versions."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        with self._lock:
            self._published.clear()

    def published_versions(self) -> list[int]:
        with self._lock:
            return sorted(self._published)

    def _lookup(self, version: int) -> _Published:
        with self._lock:
            published = self._published.get(version)
            if published is None:
                raise LookupError(f"weight version {version} is not published here; published: "
                                  f"{sorted(self._published) or 'none'}")
            return published

    def _bucket_bytes(self, bucket: Bucket) -> memoryview:
        """The bytes served for one bucket (a hook: tests corrupt them to play a bad link)."""
        return bucket.data.numpy().data

    # ---------------------------------------------------------------- sending
    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        if self._server is None:
            raise WeightSyncError("send() needs the publishing side: build the engine with host=, not url=.")
        super().send(named_tensors, version)

    def _begin_push(self, version: int) -> None:
        self._pending = []

    def _pack(self, group: list[tuple[str, torch.Tensor]], index: int, version: int,
              abort: threading.Event) -> Bucket:
        # Published bytes must outlive the trainer's next update: each bucket owns its memory.
        # A version that falls out of `keep_last` is freed once no request is still reading it.
        total = sum(tensor_nbytes(t) for _, t in group)
        buffer = torch.empty(total, dtype=torch.uint8)
        return pack_bucket(group, buffer, index=index, version=version, checksum=self.checksum)

    def _transmit(self, bucket: Bucket) -> None:
        self._pending.append(bucket)

    def _end_push(self, end: PushEnd) -> None:
        pending, self._pending = self._pending, []
        if end.error is not None:
            return
        published = _Published(end.version, pending)
        with self._lock:
            self._published.pop(end.version, None)
            self._published[end.version] = published
            while len(self._published) > self.keep_last:
                self._published.popitem(last=False)

    # ---------------------------------------------------------------- receiving
    def receive(self, version: int | None = None, *, copy: bool = False, owned: bool = False) -> WeightStream:
        """Pull `version` (the newest published one when None) from the endpoint at `url`.

        `owned=True` receives each bucket into memory of its own, so the yielded tensors stay valid
        after the stream moves on (for loaders that hold on to them); otherwise they are views into
        two reused buffers (see `WeightStream`).
        """
        if self._server is not None:
            raise WeightSyncError("receive() pulls from another endpoint: build the engine with url=.")
        self._want_version = version
        self._owned = owned
        return super().receive(copy=copy)

    def _connect(self) -> http.client.HTTPConnection:
        parsed = self._parsed
        cls = http.client.HTTPSConnection if parsed.scheme == "https" else http.client.HTTPConnection
        return cls(parsed.hostname or "", parsed.port, timeout=self.timeout_s)

    def _request(self, conn: http.client.HTTPConnection, path: str) -> http.client.HTTPResponse:
        base = self._parsed.path.rstrip("/")
        conn.request("GET", base + path, headers={"Authorization": f"Bearer {self.token}"})
        resp = conn.getresponse()
        if resp.status != 200:
            body = resp.read()[:500].decode(errors="replace")
            hint = " (the token does not match the trainer's)" if resp.status == 401 else ""
            raise WeightSyncError(f"GET {self.url}{path} answered HTTP {resp.status}{hint}: {body}")
        return resp

    def _get_json(self, conn: http.client.HTTPConnection, path: str) -> Any:
        return json.loads(self._request(conn, path).read())

    def probe(self) -> str:
        """The endpoint's nonce: proves it is reachable with this token (a run checks it at start)."""
        conn = self._connect()
        try:
            return str(self._get_json(conn, "/probe")["nonce"])
        except (OSError, http.client.HTTPException) as exc:
            raise WeightSyncError(f"Cannot reach the trainer's weight endpoint at {self.url}: {exc}") from exc
        finally:
            conn.close()

    def _fetch_into(self, conn: http.client.HTTPConnection, path: str, data: torch.Tensor) -> None:
        resp = self._request(conn, path)
        length = int(resp.getheader("Content-Length") or -1)
        if length != data.numel():
            resp.read()
            raise WeightSyncError(f"GET {self.url}{path} sent {length} bytes, the manifest says {data.numel()}.")
        view = data.numpy().data
        got = 0
        while got < length:
            n = resp.readinto(view[got:])
            if not n:
                raise http.client.IncompleteRead(b"", length - got)
            got += n

    def _buffer_for(self, nbytes: int) -> tuple[torch.Tensor, Callable[[], None]]:
        if self._owned or nbytes > self.recv_buffers.nbytes:
            return torch.empty(nbytes, dtype=torch.uint8), _Once(lambda: None)
        slot, buffer = self.recv_buffers.acquire()
        return buffer[:nbytes], _Once(lambda: self.recv_buffers.release(slot))

    def _incoming(self) -> Iterator[Bucket | PushEnd]:
        stats = self._recv_stats
        conn = self._connect()
        try:
            try:
                version = self._want_version
                if version is None:
                    versions = self._get_json(conn, "/versions")["versions"]
                    if not versions:
                        raise WeightSyncError(f"The weight endpoint at {self.url} has published no version yet.")
                    version = int(versions[-1])
                manifest = self._get_json(conn, f"/versions/{version}/manifest")
            except (OSError, http.client.HTTPException) as exc:
                raise WeightSyncError(f"Cannot reach the trainer's weight endpoint at {self.url}: {exc}") from exc
            metas = [_meta_from_json(raw, version) for raw in manifest["buckets"]]
            largest = max((m.nbytes for m in metas), default=0)
            pool = self.recv_buffers
            if not self._owned and (largest > pool.nbytes or (pool.allocations == 0 and largest < pool.nbytes)):
                self.recv_buffers = BufferPool(largest, len(self.recv_buffers.buffers), self.device)
            for meta in metas:
                data, release = self._buffer_for(meta.nbytes)
                path = f"/versions/{version}/buckets/{meta.index}"
                actual: int | None = None
                for attempt in range(self.retries + 1):
                    try:
                        self._fetch_into(conn, path, data)
                    except (OSError, http.client.HTTPException) as exc:
                        conn.close()
                        conn = self._connect()
                        if attempt == self.retries:
                            release()
                            raise WeightSyncError(
                                f"Lost the trainer's weight endpoint at {self.url} while receiving bucket "
                                f"{meta.index} of version {version} ({self.retries + 1} attempts): {exc}"
                            ) from exc
                        stats.retried += 1
                        time.sleep(0.1 * (attempt + 1))
                        continue
                    if meta.checksum is None or meta.checksum_kind is None:
                        break
                    actual = bucket_checksum(data, meta.checksum_kind, meta.pieces)
                    if actual == meta.checksum or attempt == self.retries:
                        break  # a mismatch left after the last attempt raises in the consumer
                    stats.retried += 1
                    log.warning("bucket %d of weight version %d from %s failed its %s check; fetching it again",
                                meta.index, version, self.url, meta.checksum_kind)
                yield Bucket(meta, data, release, actual)
            yield PushEnd(version, len(metas))
        finally:
            conn.close()
