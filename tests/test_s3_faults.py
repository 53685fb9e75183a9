"""The S3 tier under outages, throttling and refusals, through a real TCP proxy to a moto server."""

from __future__ import annotations

import random
import threading
import time

import boto3
import pytest

from tiers import KeyNotFoundError, TierError, TierUnavailableError, manifest_key, shard_key
from tiers.s3 import S3Tier

PART = 5 * 1024 * 1024


def payload(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


@pytest.fixture
def make_tier(s3_bucket, s3_proxy):
    """``make_tier(**kw)``: an S3Tier on the test's bucket, reached through the fault proxy."""
    _, bucket = s3_bucket
    made = []

    def make(**kw) -> S3Tier:
        kw.setdefault("multipart_threshold", PART)
        kw.setdefault("multipart_chunksize", PART)
        kw.setdefault("max_concurrency", 4)
        kw.setdefault("connect_timeout", 2)
        kw.setdefault("read_timeout", 5)
        t = S3Tier(kw.pop("bucket", bucket), kw.pop("prefix", "ckpt"), endpoint_url=s3_proxy.url, **kw)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()


def in_thread(fn):
    """Start ``fn`` in a thread; return a function that joins it and returns its result or raises."""
    out: dict = {}

    def body() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # re-raised in the caller's thread
            out["error"] = e

    t = threading.Thread(target=body)
    t.start()

    def join(timeout: float = 60):
        t.join(timeout)
        assert not t.is_alive(), "the call never returned"
        if "error" in out:
            raise out["error"]
        return out.get("value")

    return join


# -- outages ----------------------------------------------------------------------------------
def test_put_during_a_short_outage_is_retried_and_lands_whole(make_tier, s3_proxy):
    tier = make_tier(max_attempts=30, retry_deadline=30)
    data = payload(PART + 1234567, seed=1)  # multipart
    key = shard_key("job", 1, 0)
    s3_proxy.down()
    start = time.monotonic()
    join = in_thread(lambda: tier.put(key, data))
    time.sleep(2)
    s3_proxy.up()
    assert join() == len(data)
    assert time.monotonic() - start >= 2
    assert s3_proxy.connections >= 2, "the put was never retried"
    assert tier.get(key) == data


def test_get_during_a_short_outage_is_retried(make_tier, s3_proxy):
    tier = make_tier(max_attempts=30, retry_deadline=30)
    data = payload(2 * PART + 99, seed=2)
    key = shard_key("job", 2, 0)
    tier.put(key, data)
    s3_proxy.down()
    join = in_thread(lambda: tier.get(key))
    time.sleep(1.5)
    s3_proxy.up()
    assert join() == data


def test_lasting_outage_raises_tier_unavailable_within_the_deadline(make_tier, s3_proxy):
    s3_proxy.down()
    slow = make_tier(retry_deadline=3, max_attempts=100)
    fast = make_tier(retry_deadline=1, max_attempts=100)
    for deadline, tier, call in [
        (3, slow, lambda: slow.put(manifest_key("job", 3), b"{}")),
        (1, fast, lambda: fast.get(shard_key("job", 3, 0))),
        (1, fast, lambda: fast.list("job/")),
        (1, fast, lambda: fast.stat(manifest_key("job", 3))),
    ]:
        start = time.monotonic()
        with pytest.raises(TierUnavailableError) as info:
            call()
        elapsed = time.monotonic() - start
        # 100 attempts with backoff would take minutes: giving up within the deadline plus slack for a
        # loaded machine shows the deadline stopped the retries
        assert 0.15 < elapsed < deadline + 15, f"gave up after {elapsed:.1f} s"
        err = info.value
        assert isinstance(err, ConnectionError)
        assert s3_proxy.url in str(err) and tier.bucket in str(err)
        assert "\n" not in str(err)
        assert err.__cause__ is not None


def test_unreachable_endpoint_names_itself(s3_bucket):
    _, bucket = s3_bucket
    from s3util import free_port

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens here
    with S3Tier(bucket, endpoint_url=url, retry_deadline=1, connect_timeout=1) as tier:
        with pytest.raises(TierUnavailableError, match="127.0.0.1"):
            tier.get(shard_key("job", 1, 0))


# -- throttling and refusals -------------------------------------------------------------------
@pytest.mark.parametrize("status,code", [(503, "SlowDown"), (429, "TooManyRequests"), (500, "InternalError")])
def test_throttled_and_failed_requests_are_retried(make_tier, s3_proxy, status, code):
    tier = make_tier(max_attempts=10)
    key = shard_key("job", 4, 0)
    s3_proxy.fail_next(2, status, code)
    tier.put(key, b"shard bytes")
    s3_proxy.fail_next(1, status, code)
    assert tier.get(key) == b"shard bytes"
    s3_proxy.fail_next(1, status, code)
    assert tier.list() == [key]
    assert s3_proxy.connections >= 4 + 3


def test_lasting_throttling_raises_tier_unavailable(make_tier, s3_proxy):
    tier = make_tier(retry_deadline=2, max_attempts=100)
    s3_proxy.fail_next(1000, 503, "SlowDown")
    with pytest.raises(TierUnavailableError, match="SlowDown"):
        tier.put(manifest_key("job", 5), b"{}")


def test_access_denied_is_a_clear_error_and_not_retried(make_tier, s3_proxy):
    tier = make_tier()
    s3_proxy.fail_next(1, 403, "AccessDenied")
    before = s3_proxy.connections
    with pytest.raises(TierError, match="access denied") as info:
        tier.put(manifest_key("job", 6), b"{}")
    assert not isinstance(info.value, TierUnavailableError)
    assert s3_proxy.connections == before + 1


def test_unknown_bucket_is_a_clear_error(make_tier, s3_proxy):
    tier = make_tier(bucket="no-such-bucket-here")
    calls = [lambda: tier.put(shard_key("job", 1, 0), b"x"), lambda: tier.get(shard_key("job", 1, 0)),
             lambda: tier.list(), tier.check]
    for call in calls:
        start = time.monotonic()
        with pytest.raises(TierError) as info:
            call()
        assert time.monotonic() - start < 1, "a missing bucket was retried"
        assert not isinstance(info.value, (TierUnavailableError, KeyNotFoundError))
        assert "no-such-bucket-here does not exist" in str(info.value)
        assert "create it" in str(info.value)


# -- parallel ranged download ----------------------------------------------------------------------
def test_parallel_ranged_download_matches_the_original(make_tier, s3_proxy):
    tier = make_tier(max_concurrency=3)
    data = payload(3 * PART + 12345, seed=7)
    key = shard_key("job", 7, 3)
    tier.put(key, data)
    buf = bytearray(len(data))
    assert tier.read_into(key, memoryview(buf)) == len(data)
    assert buf == data
    window = memoryview(buf)[100 : 100 + 2 * PART]
    assert tier.read_into(key, window, PART - 7) == 2 * PART
    assert bytes(window) == data[PART - 7 : 3 * PART - 7]


class _Replacing(S3Tier):
    """An S3Tier whose first GET of a range past the start replaces the object (same size, other bytes)
    before it is sent, as another writer would between two ranges of one read."""

    def __init__(self, *a, new: bytes, **kw) -> None:
        super().__init__(*a, **kw)
        self.new, self.replaced = new, threading.Event()
        self._once = threading.Lock()

    def _get_range(self, key, name, start, length, etag, place, cancel=None):
        if start and not self.replaced.is_set():
            with self._once:
                if not self.replaced.is_set():
                    S3Tier.put(self, key, self.new)
                    self.replaced.set()
        return super()._get_range(key, name, start, length, etag, place, cancel)


@pytest.mark.parametrize("known_length", [True, False])
def test_an_object_replaced_during_a_read_is_read_again_whole(s3_bucket, known_length):
    endpoint, bucket = s3_bucket
    old, new = payload(3 * PART + 99, seed=11), payload(3 * PART + 99, seed=12)
    with _Replacing(bucket, "swap", endpoint_url=endpoint, multipart_threshold=PART, multipart_chunksize=PART,
                    max_concurrency=3, new=new) as tier:
        key = shard_key("job", 11, 0)
        S3Tier.put(tier, key, old)
        if known_length:
            buf = bytearray(len(old))
            tier.read_into(key, memoryview(buf))
        else:
            buf = tier.get(key)
        assert tier.replaced.is_set()
        # never a mix of the two objects: the range that saw the new one makes the whole read start over
        assert bytes(buf) == new


def test_put_reports_progress_up_to_the_object_size(make_tier, tmp_path):
    tier = make_tier()
    data = payload(PART + 4321, seed=8)
    for source in (data, tmp_path / "shard"):
        if not isinstance(source, bytes):
            source.write_bytes(data)
        sent: list[int] = []
        tier.put(shard_key("job", 8, 0), source, on_progress=sent.append)
        assert sum(sent) == len(data) and len(sent) >= 2


def test_url_names_bucket_and_prefix(s3_bucket):
    endpoint, bucket = s3_bucket
    with S3Tier.from_url(f"s3://{bucket}//runs/exp-1/", endpoint_url=endpoint) as tier:
        assert tier.prefix == "runs/exp-1"
        assert bucket in tier.describe() and endpoint in tier.describe()
        tier.put(manifest_key("job", 1), b"{}")
        names = [o["Key"] for o in boto3.client("s3", endpoint_url=endpoint)
                 .list_objects_v2(Bucket=bucket).get("Contents", [])]
        assert names == ["runs/exp-1/job/step-1/manifest.json"]
    for bad in ("http://bucket/x", "s3:///x", "s3://bucket/../x"):
        with pytest.raises(ValueError):
            S3Tier.from_url(bad)
