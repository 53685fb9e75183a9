"""The contract of :mod:`tiers.base`, checked against every tier.

Memory and disk tiers run in a temporary folder; the S3 tier runs against a
real moto S3 server over HTTP, with 5 MiB parts so that multipart uploads and
parallel ranged downloads happen at test sizes.
"""

from __future__ import annotations

import os
import random
import threading
import time
import uuid

import boto3
import pytest

from tiers import DiskTier, KeyNotFoundError, MemoryTier, TierError, manifest_key, shard_key
from tiers.s3 import S3Tier

PART = 5 * 1024 * 1024  # S3's smallest multipart part
BIG = 12 * 1024 * 1024 + 3  # three parts, the last one odd

TIERS = ["memory", "disk", "disk-lz4", "s3", "s3-root"]


@pytest.fixture(params=TIERS)
def tier(request, tmp_path):
    kind = request.param
    if kind.startswith("s3"):
        endpoint, bucket = request.getfixturevalue("s3_bucket")
        t = S3Tier(
            bucket, "" if kind == "s3-root" else "ckpt/run-1", endpoint_url=endpoint,
            multipart_threshold=PART, multipart_chunksize=PART, max_concurrency=4, retry_deadline=10,
        )
    elif kind == "memory":
        t = MemoryTier(tmp_path / "shm")
    else:
        t = DiskTier(tmp_path / "disk", compress=kind == "disk-lz4")
    yield t
    t.close()


def payload(size: int, seed: int = 0) -> bytes:
    """``size`` pseudo-random bytes, the same for the same seed."""
    return random.Random(seed).randbytes(size)


def stored_names(tier) -> list[str]:
    """Every name in the tier's backing store (files below its folder's parent, or the whole bucket)."""
    if isinstance(tier, S3Tier):
        client = boto3.client("s3", endpoint_url=tier.endpoint)
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=tier.bucket)
        return sorted(o["Key"] for p in pages for o in p.get("Contents", ()))
    top = os.path.dirname(tier.root)
    names = []
    for folder, _, files in os.walk(top):
        names += [os.path.join(folder, f) for f in files]
    return sorted(names)


def plant_temp(tier, folder: str) -> None:
    """Leave an unfinished upload's leftovers (a dot-name) below ``folder`` (a key prefix)."""
    if isinstance(tier, S3Tier):
        base = f"{tier.prefix}/" if tier.prefix else ""
        boto3.client("s3", endpoint_url=tier.endpoint).put_object(
            Bucket=tier.bucket, Key=f"{base}{folder}.tmp-{uuid.uuid4().hex}", Body=b"partial")
    else:
        d = os.path.join(tier.root, *folder.strip("/").split("/"))
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f".tmp-{uuid.uuid4().hex}"), "wb") as f:
            f.write(b"partial")


def as_source(kind: str, data: bytes, tmp_path):
    if kind == "bytes":
        return data
    if kind == "bytearray":
        return bytearray(data)
    if kind == "memoryview":
        # a view into the middle of a larger buffer: only the view's bytes may be stored
        return memoryview(b"\xee" * 3 + data + b"\xee" * 5)[3 : 3 + len(data)]
    path = tmp_path / f"src-{uuid.uuid4().hex}"
    path.write_bytes(data)
    return str(path) if kind == "path" else path


# -- put / get ------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [0, 1, 4097, 65537])
def test_put_then_get_returns_the_same_bytes(tier, tmp_path, size):
    for rank, source in enumerate(["bytes", "bytearray", "memoryview", "path", "pathlike"]):
        data = payload(size, seed=rank)
        key = shard_key("job", 3, rank)
        assert tier.put(key, as_source(source, data, tmp_path)) == size, source
        assert tier.get(key) == data, source
        assert tier.stat(key).size == size, source
        buf = bytearray(size)
        assert tier.read_into(key, memoryview(buf)) == size, source
        assert buf == data, source


@pytest.mark.parametrize("source", ["memoryview", "path"])
def test_large_object_round_trips_bit_exact(tier, tmp_path, source):
    data = payload(BIG, seed=1)
    key = shard_key("big", 10, 0)
    assert tier.put(key, as_source(source, data, tmp_path)) == BIG
    assert tier.stat(key).size == BIG
    assert tier.get(key) == data
    buf = bytearray(BIG)
    assert tier.read_into(key, memoryview(buf)) == BIG
    assert buf == data
    if isinstance(tier, S3Tier):
        head = boto3.client("s3", endpoint_url=tier.endpoint).head_object(
            Bucket=tier.bucket, Key=f"{tier.prefix}/{key}" if tier.prefix else key)
        assert head["ETag"].strip('"').endswith("-3"), "a 12 MiB object should be a 3-part upload"


def test_read_into_and_ranged_get_at_offsets(tier):
    size = 2 * PART + 1234567
    data = payload(size, seed=2)
    key = shard_key("job", 1, 0)
    tier.put(key, data)
    windows = [(0, 1), (1, 100), (PART - 1, 2), (PART - 10, PART + 20), (3, size - 3), (size - 1, 1), (size, 0)]
    for offset, length in windows:
        assert tier.get(key, offset, length) == data[offset : offset + length]
        # the window sits inside a larger buffer whose guard bytes must stay untouched
        out = bytearray(b"\xaa" * (length + 16))
        assert tier.read_into(key, memoryview(out)[8 : 8 + length], offset) == length
        assert out[8 : 8 + length] == data[offset : offset + length]
        assert out[:8] == out[-8:] == b"\xaa" * 8
    assert tier.get(key, PART + 5) == data[PART + 5 :]
    assert tier.get(key, size) == b""


def test_reads_past_the_end_raise(tier):
    key = shard_key("job", 1, 0)
    tier.put(key, b"0123456789")
    for offset, length in [(5, 6), (10, 1), (11, 0), (100, 5)]:
        with pytest.raises(TierError) as info:
            tier.read_into(key, memoryview(bytearray(length)), offset)
        assert not isinstance(info.value, KeyNotFoundError)
        with pytest.raises(TierError):
            tier.get(key, offset, length)
    with pytest.raises(TierError):
        tier.get(key, 11)
    empty = manifest_key("job", 2)
    tier.put(empty, b"")
    assert tier.get(empty) == b""
    with pytest.raises(TierError):
        tier.get(empty, 0, 1)


def test_stat_reports_size_and_mtime(tier):
    key = manifest_key("job", 7)
    before = time.time()
    tier.put(key, b"x" * 321)
    info = tier.stat(key)
    assert (info.key, info.size) == (key, 321)
    # S3 keeps whole seconds
    assert before - 2 <= info.mtime <= time.time() + 2


# -- list ---------------------------------------------------------------------------------
def test_list_returns_sorted_keys_under_a_prefix(tier):
    keys = [shard_key(job, step, rank) for job in ("a", "ab") for step in (1, 2, 10) for rank in (0, 1)]
    keys += [manifest_key(job, step) for job in ("a", "ab") for step in (1, 2, 10)]
    for k in reversed(keys):
        tier.put(k, k.encode())
    assert tier.list() == sorted(keys)
    assert tier.list("") == sorted(keys)
    assert tier.list("a/") == sorted(k for k in keys if k.startswith("a/"))
    assert tier.list("a/step-1/") == [manifest_key("a", 1), shard_key("a", 1, 0), shard_key("a", 1, 1)]
    assert tier.list("a/step-1") == sorted(k for k in keys if k.startswith("a/step-1"))  # step-1 and step-10
    assert tier.list("zzz/") == []


def test_list_never_shows_temp_files(tier):
    key = shard_key("job", 4, 0)
    tier.put(key, b"done")
    plant_temp(tier, "job/step-4/")
    plant_temp(tier, "job/step-5/")
    assert tier.list() == [key]
    assert tier.list("job/step-4/") == [key]


# -- overwrite, delete, missing keys ------------------------------------------------------
def test_overwrite_replaces_the_whole_object(tier):
    key = manifest_key("job", 9)
    for data in (b"a" * 1000, b"short", payload(PART + 17, seed=3), b""):
        tier.put(key, data)
        assert tier.get(key) == data
        assert tier.stat(key).size == len(data)
    assert tier.list() == [key]


def test_delete_is_idempotent(tier):
    key = shard_key("job", 5, 2)
    tier.put(key, b"bytes")
    tier.delete(key)
    tier.delete(key)
    tier.delete(shard_key("never", 1, 1))
    assert tier.list() == []
    with pytest.raises(KeyNotFoundError):
        tier.get(key)


def test_missing_key_raises_key_not_found(tier):
    key = shard_key("job", 6, 0)
    tier.put(shard_key("job", 6, 1), b"other rank")
    for call in (lambda: tier.get(key), lambda: tier.stat(key), lambda: tier.get(key, 0, 0),
                 lambda: tier.read_into(key, memoryview(bytearray(4)))):
        with pytest.raises(KeyNotFoundError) as info:
            call()
        assert isinstance(info.value, FileNotFoundError)


BAD_KEYS = [
    "", "../x", "../../etc/passwd", "/abs/path", "/", "job/../../x", "job/step-1/../../../x",
    "./job/step-1/manifest.json", "job/./step-1/manifest.json", ".hidden/step-1/rank-0.shard",
    "job/step-1/.tmp-123", "job//step-1/manifest.json", "job/step-1/", "job/step-1/rank-0.shard\0",
    "..", ".",
]


def test_keys_that_could_escape_are_refused(tier, tmp_path):
    for key in BAD_KEYS:
        calls = [lambda k=key: tier.put(k, b"evil"), lambda k=key: tier.get(k), lambda k=key: tier.stat(k),
                 lambda k=key: tier.read_into(k, memoryview(bytearray(1))), lambda k=key: tier.delete(k)]
        for call in calls:
            with pytest.raises(KeyNotFoundError):
                call()
    assert stored_names(tier) == []
    assert sorted(os.listdir(tmp_path)) in ([], ["disk"], ["shm"])


# -- threads ------------------------------------------------------------------------------
def run_threads(n: int, fn) -> None:
    errors: list[BaseException] = []

    def body(i: int) -> None:
        try:
            fn(i)
        except BaseException as e:  # handed to the main thread below
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a worker thread hung"
    if errors:
        raise errors[0]


def test_concurrent_puts_and_gets_from_threads(tier):
    def worker(rank: int) -> None:
        for step in range(4):
            key = shard_key("job", step, rank)
            data = payload(1000 + 97 * rank + step, seed=1)
            tier.put(key, data)
            assert tier.get(key) == data
            assert tier.stat(key).size == len(data)

    run_threads(8, worker)
    assert len(tier.list("job/")) == 32


def test_readers_never_see_a_torn_overwrite(tier):
    key = shard_key("job", 8, 0)
    versions = [payload(PART + 4096, seed=s) for s in (1, 2)]
    tier.put(key, versions[0])
    done = threading.Event()

    def worker(i: int) -> None:
        if i == 0:
            try:
                for n in range(6):
                    tier.put(key, versions[n % 2 ^ 1])
            finally:
                done.set()
            return
        reads = 0
        while not done.is_set() or reads == 0:
            got = tier.get(key)
            assert got == versions[0] or got == versions[1], "read mixed two versions"
            reads += 1

    run_threads(3, worker)
