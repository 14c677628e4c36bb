"""Bucketing: packing and unpacking named tensors, sizes, zero-copy views and checksums."""

from __future__ import annotations

import pytest
import torch

from agentrl.errors import ChecksumError, WeightSyncError
from agentrl.weights import compute_checksum, pack_bucket, plan_buckets, unpack_bucket
from agentrl.weights.buckets import BucketMeta, bucket_checksum, combine_checksums, verify_bucket

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64]


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(-(2**40), 2**40, shape, generator=gen, dtype=dtype)


def _mixed() -> list[tuple[str, torch.Tensor]]:
    # Odd sizes on purpose: 2-byte tensors first in the stream must not misalign the 8-byte ones.
    return [
        ("h", _tensor(torch.float16, (3,), 1)),
        ("b", _tensor(torch.bfloat16, (5, 3), 2)),
        ("i", _tensor(torch.int64, (7,), 3)),
        ("f", _tensor(torch.float32, (2, 3, 5), 4)),
        ("scalar", torch.tensor(1.5)),
        ("empty", torch.empty(0, 4)),
        ("mask", torch.tensor([True, False, True])),
    ]


@pytest.mark.parametrize("checksum", ["crc32", "sum64", None])
def test_pack_unpack_round_trip_is_exact_and_zero_copy(checksum: str | None) -> None:
    tensors = _mixed()
    buffer = torch.empty(4096, dtype=torch.uint8)
    bucket = pack_bucket(tensors, buffer, index=0, version=3, checksum=checksum)
    assert bucket.meta.nbytes == sum(t.numel() * t.element_size() for _, t in tensors)
    out = dict(unpack_bucket(bucket.meta, bucket.data))
    assert list(out) != [], "unpack returned nothing"
    for name, tensor in tensors:
        assert out[name].dtype == tensor.dtype and out[name].shape == tensor.shape
        assert torch.equal(out[name], tensor), name
        if tensor.numel():  # a view into the bucket buffer, not a copy
            start = out[name].data_ptr() - buffer.data_ptr()
            assert 0 <= start < buffer.numel()
            assert start % tensor.element_size() == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_each_dtype_round_trips(dtype: torch.dtype) -> None:
    tensor = _tensor(dtype, (17, 3))
    bucket = pack_bucket([("w", tensor)], torch.empty(1024, dtype=torch.uint8), index=0, version=0)
    ((name, out),) = unpack_bucket(bucket.meta, bucket.data)
    assert name == "w" and out.dtype == dtype and torch.equal(out, tensor)


def test_non_contiguous_tensor_round_trips() -> None:
    tensor = torch.arange(12.0).reshape(3, 4).t()
    assert not tensor.is_contiguous()
    bucket = pack_bucket([("t", tensor)], torch.empty(64, dtype=torch.uint8), index=0, version=0)
    ((_, out),) = unpack_bucket(bucket.meta, bucket.data)
    assert torch.equal(out, tensor)


def test_plan_buckets_respects_size_and_isolates_oversized_tensors() -> None:
    stream = [("a", torch.zeros(10)), ("b", torch.zeros(10)), ("big", torch.zeros(100)), ("c", torch.zeros(5))]
    plans = [[name for name, _ in group] for group in plan_buckets(iter(stream), bucket_bytes=80)]
    assert plans == [["a", "b"], ["big"], ["c"]]


def test_plan_buckets_consumes_the_stream_lazily() -> None:
    pulled: list[int] = []

    def stream():
        for i in range(1000):
            pulled.append(i)
            yield f"t{i}", torch.zeros(4)  # 16 bytes each, 4 per 64-byte bucket

    first = next(plan_buckets(stream(), bucket_bytes=64))
    assert len(first) == 4
    assert len(pulled) == 5  # the fifth tensor told the planner the bucket was full; no more


def test_oversized_tensor_gets_its_own_bucket_without_copy() -> None:
    big = torch.randn(64)
    bucket = pack_bucket([("big", big)], torch.empty(32, dtype=torch.uint8), index=4, version=1)
    assert bucket.meta.oversized and bucket.data.data_ptr() == big.data_ptr()
    ((_, out),) = unpack_bucket(bucket.meta, bucket.data)
    assert torch.equal(out, big)


@pytest.mark.parametrize("checksum", ["crc32", "sum64"])
def test_corrupted_byte_raises_checksum_error_naming_the_bucket(checksum: str) -> None:
    bucket = pack_bucket(_mixed(), torch.empty(4096, dtype=torch.uint8), index=7, version=12, checksum=checksum)
    for position in (0, bucket.meta.nbytes // 2, bucket.meta.nbytes - 1):
        data = bucket.data.clone()
        data[position] ^= 0x10
        with pytest.raises(ChecksumError, match=r"Bucket 7 of weight version 12 \(.*\) failed its"):
            unpack_bucket(bucket.meta, data)


def test_truncated_bucket_raises_checksum_error() -> None:
    bucket = pack_bucket(_mixed(), torch.empty(4096, dtype=torch.uint8), index=2, version=0)
    with pytest.raises(ChecksumError, match="Bucket 2 .* truncated"):
        unpack_bucket(bucket.meta, bucket.data[:-1])


def test_sum64_sees_every_single_bit_swapped_words_and_truncation() -> None:
    data = torch.randint(0, 256, (3 * 4096 + 5,), dtype=torch.uint8)
    reference = compute_checksum(data, "sum64")
    for position in range(0, data.numel(), 97):
        flipped = data.clone()
        flipped[position] ^= 1 << (position % 8)
        assert compute_checksum(flipped, "sum64") != reference, position
    swapped = data.clone()
    swapped[:8], swapped[8:16] = data[8:16], data[:8]
    assert compute_checksum(swapped, "sum64") != reference
    assert compute_checksum(data[:-1], "sum64") != reference
    zeros = torch.zeros(4096, dtype=torch.uint8)
    assert compute_checksum(zeros, "sum64") != compute_checksum(zeros[:-8], "sum64")


def test_sum64_blind_spot_is_documented_block_swaps() -> None:
    # What the module docstring promises it misses: 4 KiB-aligned 4 KiB blocks swapped. crc32 sees it.
    data = torch.randint(0, 256, (2 * 4096,), dtype=torch.uint8)
    swapped = torch.cat([data[4096:], data[:4096]])
    assert compute_checksum(swapped, "sum64") == compute_checksum(data, "sum64")
    assert compute_checksum(swapped, "crc32") != compute_checksum(data, "crc32")


def test_bad_input_raises_weight_sync_error() -> None:
    with pytest.raises(WeightSyncError, match="appears twice"):
        list(plan_buckets([("a", torch.zeros(1)), ("a", torch.zeros(1))], 64))
    with pytest.raises(WeightSyncError, match="cannot carry"):
        list(plan_buckets([("z", torch.zeros(2, dtype=torch.complex64))], 64))
    with pytest.raises(WeightSyncError, match="not a torch.Tensor"):
        list(plan_buckets([("n", [1.0])], 64))  # type: ignore[list-item]
    with pytest.raises(WeightSyncError, match="Unknown checksum 'md5'"):
        compute_checksum(torch.zeros(4, dtype=torch.uint8), "md5")


@pytest.mark.parametrize("checksum", ["sum64", "crc32"])
def test_checksum_over_pieces_catches_damage_in_any_piece(checksum: str) -> None:
    data = torch.arange(3000, dtype=torch.int64).view(torch.uint8).clone()
    pieces = ((0, 8000), (8000, 16000), (24000, 0))
    value = bucket_checksum(data, checksum, pieces)
    assert value == combine_checksums(
        [(o, n, compute_checksum(data[o : o + n], checksum)) for o, n in pieces]
    )
    assert value != bucket_checksum(data, checksum, ((0, 16000), (16000, 8000)))  # the spans count too
    meta = BucketMeta(0, 1, (), data.numel(), value, checksum, pieces=pieces)
    verify_bucket(meta, data)
    for at in (0, 7999, 8000, 23999):
        bad = data.clone()
        bad[at] ^= 1
        with pytest.raises(ChecksumError, match="Bucket 0 of weight version 1"):
            verify_bucket(meta, bad)
