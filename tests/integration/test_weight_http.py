"""The http checkpoint engine for real: a trainer-side endpoint on loopback, pulled over real sockets.

Covers what servers rely on: exact round trips (many buckets, mixed dtypes, an oversized tensor),
snapshot semantics (a published version does not change when the trainer's tensors do), version
selection and eviction, buffer reuse, a bucket corrupted in transit once (re-fetched) and every
time (ChecksumError before any tensor of it is handed out), a dropped connection, a wrong token,
and the start-of-run probe for both the endpoint and a files-engine directory.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from agentrl.errors import ChecksumError, WeightSyncError
from agentrl.weights import (
    FilesCheckpointEngine,
    HTTPCheckpointEngine,
    probe_source,
    receive_weights,
    write_probe,
)

HOST = "127.0.0.1"  # tests run on one machine; a run binds the trainer node's address
BUCKET = 1024


def _weights(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        ("embed", torch.randn(40, 3, generator=gen)),
        ("layer.0.w", torch.randn(10, 10, generator=gen).to(torch.bfloat16)),
        ("layer.0.b", torch.randn(10, generator=gen).to(torch.float16)),
        ("huge", torch.randn(600, generator=gen)),  # 2400 bytes: bigger than a bucket
        ("steps", torch.randint(0, 2**40, (7,), generator=gen)),
        ("scalar", torch.tensor(3.5)),
    ]


@pytest.fixture
def endpoint():
    engine = HTTPCheckpointEngine(host=HOST, bucket_bytes=BUCKET)
    yield engine
    engine.close()


def _pull(engine: HTTPCheckpointEngine, version: int | None = None, **kw):
    stream = receive_weights(engine.url, version=version, token=engine.token, **kw)
    got = {name: tensor.clone() for name, tensor in stream}
    return stream, got


def test_round_trip_is_exact_bucketed_and_verified(endpoint) -> None:
    tensors = _weights()
    endpoint.send(iter(tensors), 7)
    stream, got = _pull(endpoint, 7)
    assert stream.version == 7 and stream.num_buckets is not None and stream.num_buckets > 2
    assert set(got) == {n for n, _ in tensors}
    for name, tensor in tensors:
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    stats = stream.stats
    assert stats.buckets == stats.verified == stream.num_buckets and stats.unverified == 0
    assert stats.checksum == "sum64" and stats.bytes == sum(t.numel() * t.element_size() for _, t in tensors)


def test_a_published_version_is_a_snapshot_and_old_versions_are_evicted(endpoint) -> None:
    tensors = _weights(1)
    expected = {n: t.clone() for n, t in tensors}
    endpoint.send(iter(tensors), 1)
    for _, t in tensors:  # the trainer's next update changes its tensors in place
        t.add_(1)
    endpoint.send(iter(tensors), 2)
    endpoint.send(iter(tensors), 3)  # keep_last=2: version 1 is gone
    assert endpoint.published_versions() == [2, 3]
    with pytest.raises(WeightSyncError, match=r"version 1 is not published here; published: \[2, 3\]"):
        _pull(endpoint, 1)
    newest, got = _pull(endpoint)  # no version: the newest
    assert newest.version == 3
    assert all(torch.equal(got[n], t) for n, t in tensors)
    endpoint.keep_last = 3
    endpoint.send(iter(expected.items()), 4)
    _, got = _pull(endpoint, 4)
    assert all(torch.equal(got[n], expected[n]) for n in expected)


def test_reused_receive_buffers_when_tensors_are_not_kept(endpoint) -> None:
    receiver = HTTPCheckpointEngine(url=endpoint.url, token=endpoint.token)
    for version in range(3):
        tensors = _weights(version)
        endpoint.send(iter(tensors), version)
        got = {n: t.clone() for n, t in receiver.receive(version)}
        assert all(torch.equal(got[n], t) for n, t in tensors)
    assert receiver.recv_buffers.allocations == 2  # two buffers for three pushes of many buckets


class _FlakyLink(HTTPCheckpointEngine):
    """Serves bucket 1 with a flipped byte its first `bad_times` times, as a bad link would."""

    bad_times = 1

    def _bucket_bytes(self, bucket):  # type: ignore[no-untyped-def]
        raw = super()._bucket_bytes(bucket)
        if bucket.meta.index == 1 and self.bad_times > 0:
            self.bad_times -= 1
            damaged = bytearray(raw)
            damaged[len(damaged) // 2] ^= 0x10
            return memoryview(damaged)
        return raw


def test_a_bucket_corrupted_in_transit_is_fetched_again() -> None:
    engine = _FlakyLink(host=HOST, bucket_bytes=BUCKET)
    try:
        tensors = _weights(2)
        engine.send(iter(tensors), 1)
        stream, got = _pull(engine, 1)
        assert all(torch.equal(got[n], t) for n, t in tensors)
        assert stream.stats.retried == 1 and stream.stats.verified == stream.num_buckets
    finally:
        engine.close()


def test_a_bucket_corrupted_every_time_raises_before_any_of_its_tensors_is_used() -> None:
    engine = _FlakyLink(host=HOST, bucket_bytes=BUCKET)
    engine.bad_times = 10
    try:
        tensors = _weights(3)
        engine.send(iter(tensors), 1)
        stream = receive_weights(engine.url, version=1, token=engine.token, retries=2)
        seen: list[str] = []
        with pytest.raises(ChecksumError, match="Bucket 1 of weight version 1 .* failed its sum64 check"):
            for name, _ in stream:
                seen.append(name)
        assert seen and stream.stats.verified == 1 == stream.stats.buckets  # only bucket 0 was handed out
        assert stream.stats.retried == 2
    finally:
        engine.close()


class _DroppingLink(HTTPCheckpointEngine):
    """Closes the connection half-way through bucket 0 once."""

    dropped = False

    def _bucket_bytes(self, bucket):  # type: ignore[no-untyped-def]
        raw = super()._bucket_bytes(bucket)
        if not self.dropped:
            self.dropped = True
            raise ConnectionResetError("simulated drop")
        return raw


def test_a_dropped_connection_is_retried() -> None:
    engine = _DroppingLink(host=HOST, bucket_bytes=BUCKET)
    try:
        tensors = _weights(4)
        engine.send(iter(tensors), 2)
        stream, got = _pull(engine, 2)
        assert all(torch.equal(got[n], t) for n, t in tensors) and stream.stats.retried == 1
    finally:
        engine.close()


def test_a_wrong_token_and_an_unreachable_endpoint_fail_with_the_reason(endpoint) -> None:
    endpoint.send(iter(_weights()), 1)
    with pytest.raises(WeightSyncError, match="HTTP 401 .*token"):
        list(receive_weights(endpoint.url, version=1, token="not-the-token"))
    with pytest.raises(WeightSyncError, match="HTTP 401"):
        probe_source(endpoint.url, token="not-the-token")
    assert probe_source(endpoint.url, token=endpoint.token) == endpoint.nonce
    url = endpoint.url
    endpoint.close()
    with pytest.raises(WeightSyncError, match="Cannot reach the trainer's weight endpoint"):
        list(receive_weights(url, version=1, token="x"))


def test_each_side_needs_its_own_address() -> None:
    with pytest.raises(WeightSyncError, match="exactly one of host="):
        HTTPCheckpointEngine()
    with pytest.raises(WeightSyncError, match="not an http"):
        HTTPCheckpointEngine(url="ftp://x")
    puller = HTTPCheckpointEngine(url="http://trainer.example:80")
    with pytest.raises(WeightSyncError, match="host="):
        puller.send(iter(_weights()), 1)


def test_many_servers_pull_one_version_at_once(endpoint) -> None:
    tensors = _weights(5)
    endpoint.send(iter(tensors), 9)
    results: list[dict[str, torch.Tensor]] = []

    def pull() -> None:
        results.append(_pull(endpoint, 9)[1])

    threads = [threading.Thread(target=pull) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4
    for got in results:
        assert all(torch.equal(got[n], t) for n, t in tensors)


def test_files_sources_probe_and_version_check(tmp_path: Path) -> None:
    engine = FilesCheckpointEngine(directory=tmp_path, bucket_bytes=BUCKET)
    engine.send(iter(_weights()), 3)
    nonce = write_probe(tmp_path)
    assert probe_source(str(tmp_path)) == nonce
    with pytest.raises(WeightSyncError, match="not shared with this server.*weights.backend=http"):
        probe_source(str(tmp_path / "elsewhere"))
    stream = receive_weights(str(engine.path_for(3)), version=3)
    got = {n: t.clone() for n, t in stream}
    assert set(got) == {n for n, _ in _weights()} and stream.stats.verified == stream.num_buckets > 1
    with pytest.raises(WeightSyncError, match="holds weight version 3, but version 4 was asked for"):
        receive_weights(str(engine.path_for(3)), version=4)
    with pytest.raises(WeightSyncError, match="does not exist on this server's machine.*weights.backend=http"):
        receive_weights(str(tmp_path / "version-00000099"), version=99)
