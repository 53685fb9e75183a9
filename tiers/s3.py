"""The S3 tier: objects below ``s3://<bucket>/<prefix>/`` on AWS or any S3-compatible endpoint.

* ``put`` uploads with s3transfer: one PUT below ``multipart_threshold`` bytes,
  else a multipart upload of ``multipart_chunksize`` parts, ``max_concurrency``
  at a time. Either way S3 publishes the object whole or not at all.
* ``read_into`` / ``get`` issue ranged GETs of ``multipart_chunksize`` bytes in
  parallel on a bounded pool, each streaming straight into its slice of the
  destination buffer. Every range after the first carries ``If-Match`` of the
  first one's ETag, so an overwrite racing the read restarts it instead of
  mixing two versions.
* Transient failures (throttling, 5xx, refused or cut connections, timeouts)
  are retried with exponential backoff and jitter until ``max_attempts`` tries
  are spent or the next wait would pass ``retry_deadline`` seconds after the
  first try; then :class:`TierUnavailableError`
  says which endpoint and bucket could not be reached. botocore's own retries
  are off so that one policy, this one, applies.

Besides the ``Tier`` methods, two that only the step index uses (:mod:`tiers.index`):
``get_tagged`` (an object and its ETag) and ``put_if`` (a PUT with ``If-Match`` of
that ETag, or ``If-None-Match: *`` to create), so several nodes can update one
shared object without losing each other's changes. A store that ignores those
headers instead of refusing them cannot be told apart here.

A multipart upload cut short by an outage may leave its parts behind in the
bucket (S3 bills them until aborted): give the bucket a lifecycle rule that
aborts incomplete multipart uploads after a day.
"""

from __future__ import annotations

import errno
import io
import os
import threading
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any, Callable
from urllib.parse import urlsplit

import boto3
import urllib3.exceptions
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    HTTPClientError,
    IncompleteReadError,
    NoCredentialsError,
    PartialCredentialsError,
)
from botocore.exceptions import ConnectionError as BotoConnectionError
from s3transfer.manager import TransferManager
from s3transfer.subscribers import BaseSubscriber
from tenacity import (
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_before_delay,
    wait_exponential,
    wait_random_exponential,
)

from .base import ObjectInfo, Source, TierBase
from .errors import (
    ConditionalWriteUnsupportedError,
    ConditionFailedError,
    KeyNotFoundError,
    TierError,
    TierUnavailableError,
)

__all__ = ["S3Tier"]

MiB = 1 << 20

#: error codes S3 (and S3-compatible stores) answer when a retry may succeed
_TRANSIENT_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottled",
    "RequestThrottledException", "TooManyRequestsException", "RequestLimitExceeded",
    "BandwidthLimitExceeded", "ProvisionedThroughputExceededException", "RequestTimeout",
    "RequestTimeoutException", "PriorRequestNotComplete", "InternalError", "ServiceUnavailable",
    "OperationAborted",
})
_MISSING_CODES = frozenset({"NoSuchKey", "NotFound", "404"})
#: a conditional write that lost to another writer (409: a concurrent one still in flight)
_CONDITION_CODES = frozenset({"PreconditionFailed", "ConditionalRequestConflict"})
_DENIED_CODES = frozenset({
    "AccessDenied", "403", "Forbidden", "InvalidAccessKeyId", "SignatureDoesNotMatch",
    "ExpiredToken", "InvalidToken", "AllAccessDisabled", "AccountProblem",
})
_TRANSIENT_TYPES = (
    HTTPClientError,            # ConnectionClosedError, ReadTimeoutError, ResponseStreamingError
    BotoConnectionError,        # EndpointConnectionError, ConnectTimeoutError
    IncompleteReadError,
    urllib3.exceptions.HTTPError,
    ConnectionError,            # reset, refused, broken pipe
    TimeoutError,
)

#: backoff before retry n (1-based) is between BASE·2^(n-1) and twice that, capped at MAX (seconds)
_BACKOFF_BASE = 0.2
_BACKOFF_MAX = 5.0
#: how often a read restarts because the object was replaced under it
_READ_RESTARTS = 5
#: bytes per readinto call while streaming a body (bounds urllib3's staging copy)
_READ_SLICE = 1 * MiB
#: the smallest ranged GET a read of known length is split into
_MIN_RANGE = 8 * MiB


def _code_status(e: BaseException) -> tuple[str, int]:
    resp = getattr(e, "response", None) or {}
    code = str((resp.get("Error") or {}).get("Code") or "")
    status = int((resp.get("ResponseMetadata") or {}).get("HTTPStatusCode") or 0)
    return code, status


def _is_transient(e: BaseException) -> bool:
    if isinstance(e, TierError):
        return False
    if isinstance(e, ClientError):
        code, status = _code_status(e)
        return code in _TRANSIENT_CODES or status == 429 or status >= 500
    return isinstance(e, _TRANSIENT_TYPES)


class _Changed(TierError):
    """The object was replaced between two ranges of one read."""


class _Cancelled(TierError):
    """A range was abandoned because another range of the same read failed."""


class _Unsatisfiable(TierError):
    """S3 refused a range (416): the object ends at or before its start."""


class _MemoryReader(io.RawIOBase):
    """A seekable read-only file over a memoryview, so uploads never copy the whole buffer."""

    def __init__(self, mv: memoryview) -> None:
        super().__init__()
        self._mv = mv
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._mv)}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def read(self, size: int = -1) -> bytes:
        end = len(self._mv) if size is None or size < 0 else min(len(self._mv), self._pos + size)
        data = bytes(self._mv[self._pos : end]) if end > self._pos else b""
        self._pos = max(self._pos, end)
        return data

    def readinto(self, b) -> int:
        data = self._mv[self._pos : self._pos + len(b)]
        n = len(data)
        memoryview(b).cast("B")[:n] = data
        self._pos += n
        return n


class _Progress(BaseSubscriber):
    def __init__(self, fn: Callable[[int], None]) -> None:
        self._fn = fn

    def on_progress(self, future, bytes_transferred, **kwargs) -> None:
        self._fn(bytes_transferred)


def _check_key(key: str) -> str:
    parts = key.split("/") if isinstance(key, str) else [""]
    if not key or "\0" in key or any(p in ("", ".", "..") or p.startswith(".") for p in parts):
        raise KeyNotFoundError(errno.ENOENT, f"invalid key {key!r}")
    return key


def _normalise_prefix(prefix: str) -> str:
    parts = [p for p in (prefix or "").split("/") if p]
    if any(p in (".", "..") for p in parts) or "\0" in (prefix or ""):
        raise ValueError(f"invalid S3 prefix {prefix!r}: no '.' or '..' components")
    return "/".join(parts)


class S3Tier(TierBase):
    """Shards and manifests in an S3 bucket; see :mod:`tiers.base` for the contract.

    ``bucket``/``prefix``: objects are named ``<prefix>/<key>``.
    ``endpoint_url``: an S3-compatible endpoint (MinIO, moto, a VPC endpoint);
    if None boto3 reads ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` or uses AWS.
    A custom endpoint is addressed path-style (``<endpoint>/<bucket>/<name>``).
    ``region``: else ``AWS_REGION``, the boto3 default, or ``us-east-1``.
    ``retry_deadline`` (seconds) and ``max_attempts`` bound the retries of one
    request. ``multipart_threshold`` / ``multipart_chunksize`` (bytes) set when
    uploads go multipart and the size of upload parts and download ranges;
    ``max_concurrency`` bounds the requests one tier has in flight per
    direction. ``connect_timeout`` / ``read_timeout`` are seconds per socket
    operation. ``client``: a ready boto3 S3 client to use instead (its own
    configuration then applies). Credentials come from boto3's usual chain.

    Raises :class:`KeyNotFoundError` for missing or invalid keys,
    :class:`TierUnavailableError` when the endpoint stays unreachable and
    :class:`TierError` for a missing bucket, refused access or past-end reads.
    """

    name = "s3"

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        retry_deadline: float = 60.0,
        max_attempts: int = 8,
        multipart_threshold: int = 64 * MiB,
        multipart_chunksize: int = 64 * MiB,
        max_concurrency: int = 8,
        connect_timeout: float = 5,
        read_timeout: float = 60,
        client: Any = None,
    ) -> None:
        if not bucket or "/" in bucket:
            raise ValueError(f"invalid S3 bucket name {bucket!r}")
        if max_attempts < 1 or max_concurrency < 1 or multipart_chunksize < 1:
            raise ValueError("max_attempts, max_concurrency and multipart_chunksize must be >= 1")
        self.bucket = bucket
        self.prefix = _normalise_prefix(prefix)
        self.retry_deadline = float(retry_deadline)
        self.max_attempts = int(max_attempts)
        self.part_size = int(multipart_chunksize)
        self.max_concurrency = int(max_concurrency)
        self._own_client = client is None
        if client is None:
            session = boto3.session.Session()
            region = region or os.environ.get("AWS_REGION") or session.region_name or "us-east-1"
            custom = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
            config = Config(
                region_name=region,
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
                retries={"max_attempts": 1, "mode": "standard"},
                max_pool_connections=2 * max_concurrency + 8,
                s3={"addressing_style": "path"} if custom else None,
            )
            client = session.client("s3", endpoint_url=endpoint_url, config=config)
        self._client = client
        self.endpoint = client.meta.endpoint_url
        self._transfer = TransferManager(
            client,
            TransferConfig(
                multipart_threshold=multipart_threshold,
                multipart_chunksize=multipart_chunksize,
                max_concurrency=max_concurrency,
            ),
        )
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="s3-range")
        self._closed = False

    @classmethod
    def from_url(cls, url: str, **kw: Any) -> "S3Tier":
        """Open ``s3://bucket/prefix``; ``kw`` are the constructor's keyword arguments."""
        parts = urlsplit(url)
        if parts.scheme != "s3" or not parts.netloc or parts.query or parts.fragment:
            raise ValueError(f"not an S3 URL: {url!r} (expected s3://bucket/prefix)")
        return cls(parts.netloc, parts.path, **kw)

    def describe(self) -> str:
        where = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        return f"{where} at {self.endpoint}"

    def _name(self, key: str) -> str:
        _check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    # -- retries and errors --------------------------------------------------------
    def _call(self, what: str, fn: Callable[[], Any], key: str | None = None,
              cancel: threading.Event | None = None) -> Any:
        """Run ``fn`` under the retry policy; translate what escapes into tier errors."""
        retrying = Retrying(
            stop=stop_after_attempt(self.max_attempts) | stop_before_delay(self.retry_deadline),
            wait=wait_exponential(multiplier=_BACKOFF_BASE, max=_BACKOFF_MAX)
            + wait_random_exponential(multiplier=_BACKOFF_BASE, max=_BACKOFF_MAX),
            retry=retry_if_exception(lambda e: _is_transient(e) and not (cancel and cancel.is_set())),
            reraise=True,
        )
        try:
            return retrying(fn)
        except TierError:
            raise
        except (ClientError, BotoCoreError, *_TRANSIENT_TYPES) as e:
            stats = retrying.statistics
            raise self._translate(e, what, key, stats.get("attempt_number", 1),
                                  stats.get("delay_since_first_attempt", 0.0)) from e

    def _translate(self, e: BaseException, what: str, key: str | None, attempts: int, spent: float) -> TierError:
        if _is_transient(e):
            state = "keeps failing requests" if isinstance(e, ClientError) else "is unreachable"
            return TierUnavailableError(
                f"S3 endpoint {self.endpoint} (bucket {self.bucket}) {state}: {what} failed "
                f"{attempts} times in {spent:.1f} s ({_describe_error(e)}); check the endpoint URL, "
                "the network and the credentials, or raise the retry deadline"
            )
        if isinstance(e, (NoCredentialsError, PartialCredentialsError)):
            return TierError(
                f"no usable AWS credentials for {self.describe()}: set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, a profile (AWS_PROFILE) or an instance role"
            )
        code, status = _code_status(e)
        if code == "NoSuchBucket":
            return TierError(f"bucket {self.bucket} does not exist at {self.endpoint}: create it or fix --s3")
        if code in _MISSING_CODES or status == 404:
            return KeyNotFoundError(errno.ENOENT, f"{key} is not in the s3 tier at {self.describe()}")
        if code in _DENIED_CODES or status == 403:
            return TierError(
                f"access denied to {self.describe()} ({code or status}): check the credentials "
                "and the bucket policy (needs s3:GetObject, PutObject, DeleteObject, ListBucket)"
            )
        if code == "InvalidRange" or status == 416:
            return _Unsatisfiable(errno.EINVAL, f"{key}: range not satisfiable")
        if code == "PreconditionFailed" or status == 412:
            return _Changed(errno.EAGAIN, f"{key} changed while being read")
        return TierError(f"S3 {what} on {self.describe()} failed: {_describe_error(e)}")

    # -- Tier ------------------------------------------------------------------------
    def put(self, key: str, src: Source, on_progress: Callable[[int], None] | None = None) -> int:
        """Upload ``src`` (bytes-like, or a local file's path) as ``key``; return its size in bytes.

        ``on_progress(n)`` is called as each further ``n`` bytes are sent (a
        retried attempt reports its bytes again).
        """
        name = self._name(key)
        subscribers = [_Progress(on_progress)] if on_progress else None
        path: str | None = None
        mv: memoryview | None = None
        if isinstance(src, (str, os.PathLike)):
            path = os.fspath(src)
            size = os.stat(path).st_size
        else:
            mv = memoryview(src).cast("B")
            size = mv.nbytes

        def attempt() -> None:
            # a file is re-read by name on every attempt; a buffer through a fresh reader
            fileobj = path if mv is None else _MemoryReader(mv)
            future = self._transfer.upload(fileobj, self.bucket, name, subscribers=subscribers)
            try:
                future.result()
            except BaseException:
                future.cancel()
                raise

        self._call(f"put {key}", attempt, key)
        return size

    def read_into(self, key: str, buf: memoryview, offset: int = 0) -> int:
        mv = memoryview(buf).cast("B")
        self._fetch(key, offset, mv)
        return len(mv)

    def get(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        # without a length the size comes from the first range itself, not a separate
        # HEAD, so an overwrite between the two cannot tear the result
        if length is not None:
            return super().get(key, offset, length)
        return bytes(self._fetch(key, offset, None))

    def _fetch(self, key: str, offset: int, buf: memoryview | None) -> memoryview:
        """Fill ``buf`` from ``offset`` (or a new buffer running to the object's end)."""
        name = self._name(key)
        if offset < 0:
            raise ValueError(f"negative offset {offset}")
        if buf is not None and len(buf) == 0:
            self._check_end(key, offset, 0)
            return buf
        for _ in range(_READ_RESTARTS):
            try:
                return self._fetch_once(key, name, offset, buf)
            except _Changed:
                continue
            except _Unsatisfiable:
                # S3 refuses any range of an empty object and any range from its end on
                size = self.stat(key).size
                if buf is None and offset == size:
                    return memoryview(bytearray(0))
                if buf is None and offset < size:
                    continue
                want = 0 if buf is None else len(buf)
                msg = f"{key}: read of {want} bytes at {offset} past its end ({size})"
                raise TierError(errno.EINVAL, msg) from None
        raise TierError(errno.EAGAIN, f"{key} kept changing while being read from {self.describe()}; retry later")

    def _check_end(self, key: str, offset: int, length: int) -> None:
        size = self.stat(key).size
        if offset + length > size:
            raise TierError(errno.EINVAL, f"{key}: read of {length} bytes at {offset} past its end ({size})")

    def _range_size(self, n: int) -> int:
        """Bytes per ranged GET for a read of ``n`` bytes: enough ranges to keep every connection busy, none
        larger than ``multipart_chunksize`` nor smaller than ``_MIN_RANGE``."""
        per = -(-n // self.max_concurrency)
        return max(1, min(self.part_size, max(_MIN_RANGE, per)))

    def _fetch_once(self, key: str, name: str, offset: int, buf: memoryview | None) -> memoryview:
        if buf is not None:
            return self._fetch_known(key, name, offset, buf)
        # the length is the object's: the first range tells it (and pins the object by its ETag)
        first = self.part_size
        dest: list[memoryview] = []

        def place_first(total: int) -> memoryview:
            end = total
            if end < offset:
                raise TierError(errno.EINVAL, f"{key}: read at {offset} past its end ({total})")
            if not dest or len(dest[0]) != end - offset:
                # first try, or a retry that found the object replaced by one of another size
                dest[:] = [memoryview(bytearray(end - offset))]
            return dest[0][: min(first, end - offset)]

        etag, total = self._get_range(key, name, offset, first, None, place_first)
        out = dest[0]
        if len(out) <= first:
            return out

        def place(rel: int, n: int) -> Callable[[int], memoryview]:
            def view(size: int) -> memoryview:
                if size != total:
                    raise _Changed(errno.EAGAIN, f"{key} changed while being read")
                return out[rel : rel + n]
            return view

        step = self._range_size(len(out) - first)
        self._gather(key, [(self._get_range, key, name, offset + rel, min(step, len(out) - rel), etag,
                            place(rel, min(step, len(out) - rel)))
                           for rel in range(first, len(out), step)])
        return out

    def _fetch_known(self, key: str, name: str, offset: int, buf: memoryview) -> memoryview:
        """Fill ``buf`` from ``offset``: every range is requested at once (no first request alone to learn the
        object's size), and all of them must come from one object (one ETag, one size), else it restarts."""
        end = offset + len(buf)

        def place(rel: int, n: int) -> Callable[[int], memoryview]:
            def view(size: int) -> memoryview:
                if end > size:
                    raise TierError(errno.EINVAL, f"{key}: read of {len(buf)} bytes at {offset} past its end ({size})")
                return buf[rel : rel + n]
            return view

        step = self._range_size(len(buf))
        tags = self._gather(key, [(self._get_range, key, name, offset + rel, min(step, len(buf) - rel), None,
                                   place(rel, min(step, len(buf) - rel)))
                                  for rel in range(0, len(buf), step)])
        if len(set(tags)) > 1:
            raise _Changed(errno.EAGAIN, f"{key} changed while being read")
        return buf

    def _gather(self, key: str, calls: list[tuple]) -> list[tuple[str, int]]:
        """Run ``_get_range`` calls on the range pool; return their ``(etag, size)`` in order, or raise the first
        real failure once none of them still runs (each writes into the caller's buffer)."""
        if len(calls) == 1:
            fn, *args = calls[0]
            return [fn(*args)]
        cancel = threading.Event()
        futures = [self._pool.submit(fn, *args, cancel) for fn, *args in calls]
        done, pending = wait(futures, return_when=FIRST_EXCEPTION)
        if pending:
            cancel.set()
            wait(pending)
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            # a replaced object restarts the read; otherwise the first real failure wins
            errors.sort(key=lambda e: 0 if isinstance(e, _Changed) else 2 if isinstance(e, _Cancelled) else 1)
            raise errors[0]
        return [f.result() for f in futures]

    def _get_range(self, key: str, name: str, start: int, length: int, etag: str | None,
                   place: Callable[[int], memoryview], cancel: threading.Event | None = None) -> tuple[str, int]:
        """GET bytes ``[start, start+length)``; stream them into ``place(object size)``.

        Returns the object's ETag and size.
        """
        if cancel is not None and cancel.is_set():
            raise _Cancelled(errno.ECANCELED, f"{key}: read abandoned")
        args = {"Bucket": self.bucket, "Key": name, "Range": f"bytes={start}-{start + length - 1}"}
        if etag:
            args["IfMatch"] = etag

        def attempt() -> tuple[str, int]:
            resp = self._client.get_object(**args)
            body = resp["Body"]
            try:
                sent = int(resp["ContentLength"])
                if "ContentRange" in resp:
                    total = int(str(resp["ContentRange"]).rsplit("/", 1)[1])
                elif start == 0:
                    total = sent  # an endpoint that ignores Range sends the whole object
                else:
                    raise TierError(errno.EIO, f"{self.endpoint} ignored the Range of a GET for {key}")
                view = place(total)
                if sent != len(view) and "ContentRange" in resp:
                    raise _Changed(errno.EAGAIN, f"{key} changed while being read")
                done = 0
                while done < len(view):
                    n = body.readinto(view[done : done + _READ_SLICE])
                    if not n:
                        raise IncompleteReadError(actual_bytes=done, expected_bytes=len(view))
                    done += n
                if sent > len(view):
                    body.close()
            except BaseException:
                body.close()
                raise
            return resp.get("ETag", ""), total

        return self._call(f"get {key}", attempt, key, cancel)

    def list(self, prefix: str = "") -> list[str]:
        base = f"{self.prefix}/" if self.prefix else ""

        def attempt() -> list[str]:
            keys = []
            pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base + prefix)
            for page in pages:
                for obj in page.get("Contents", ()):
                    key = obj["Key"][len(base):]
                    try:
                        keys.append(_check_key(key))
                    except KeyNotFoundError:
                        continue  # not an object this tier wrote
            return keys

        return sorted(self._call(f"list {prefix or '(all)'}", attempt))

    def delete(self, key: str) -> None:
        name = self._name(key)
        try:
            self._call(f"delete {key}", lambda: self._client.delete_object(Bucket=self.bucket, Key=name), key)
        except KeyNotFoundError:
            pass

    def stat(self, key: str) -> ObjectInfo:
        name = self._name(key)
        resp = self._call(f"stat {key}", lambda: self._client.head_object(Bucket=self.bucket, Key=name), key)
        return ObjectInfo(key, int(resp["ContentLength"]), resp["LastModified"].timestamp())

    # -- conditional writes: not part of the Tier contract; the step index uses them ------------
    def get_tagged(self, key: str, max_bytes: int | None = None) -> tuple[bytes | None, str]:
        """The whole object ``key`` and its ETag, from one GET; the bytes are None when the object is larger
        than ``max_bytes`` (its ETag still lets a ``put_if`` replace it). Raises KeyNotFoundError if absent.
        """
        name = self._name(key)

        def attempt() -> tuple[bytes | None, str]:
            resp = self._client.get_object(Bucket=self.bucket, Key=name)
            body = resp["Body"]
            try:
                size = int(resp["ContentLength"])
                if max_bytes is not None and size > max_bytes:
                    return None, str(resp.get("ETag", ""))
                data = body.read()
                if len(data) != size:
                    raise IncompleteReadError(actual_bytes=len(data), expected_bytes=size)
            finally:
                body.close()
            return data, str(resp.get("ETag", ""))

        return self._call(f"get {key}", attempt, key)

    def put_if(self, key: str, data: bytes, etag: str | None) -> str:
        """Store ``data`` as ``key`` only if the object still has ``etag`` (with None: only if absent).

        One PUT with ``If-Match`` (or ``If-None-Match: *``); returns the new ETag.
        Raises ConditionFailedError when another writer changed or created the
        object first (read it again and retry), ConditionalWriteUnsupportedError
        when the store refuses those headers, and the usual tier errors.
        """
        name = self._name(key)
        cond = {"IfMatch": etag} if etag is not None else {"IfNoneMatch": "*"}

        def attempt() -> str:
            try:
                resp = self._client.put_object(Bucket=self.bucket, Key=name, Body=bytes(data), **cond)
            except ClientError as e:
                code, status = _code_status(e)
                if code in _CONDITION_CODES or status in (409, 412):
                    raise ConditionFailedError(errno.EAGAIN, f"{key} changed since it was read") from e
                if etag is not None and (code in _MISSING_CODES or status == 404):
                    raise ConditionFailedError(errno.EAGAIN, f"{key} was deleted since it was read") from e
                if code == "NotImplemented" or status == 501:
                    raise ConditionalWriteUnsupportedError(
                        errno.ENOTSUP, f"{self.describe()} refuses conditional writes ({_describe_error(e)})") from e
                raise
            return str(resp.get("ETag", ""))

        return self._call(f"put {key}", attempt, key)

    def check(self) -> None:
        """Verify that the bucket exists and is reachable with these credentials.

        Raises TierError (missing bucket, access denied) or TierUnavailableError.
        """
        try:
            self._call("head-bucket", lambda: self._client.head_bucket(Bucket=self.bucket))
        except KeyNotFoundError as e:
            raise TierError(f"bucket {self.bucket} does not exist at {self.endpoint}: create it or fix --s3") from e

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._transfer.shutdown()
        self._pool.shutdown(wait=True)
        if self._own_client:
            self._client.close()


def _describe_error(e: BaseException) -> str:
    code, status = _code_status(e)
    if code or status:
        msg = (getattr(e, "response", None) or {}).get("Error", {}).get("Message", "")
        return f"{code or 'HTTP'} {status}" + (f": {msg}" if msg else "")
    return f"{type(e).__name__}: {e}"
