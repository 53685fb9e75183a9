"""The peer wire protocol: versioned request signing, the shared secret, limits, bandwidth caps.

Peers speak plain HTTP/1.1 (see ``agents/peer_server.py`` for the routes and
``tiers/peer.py`` for the client). With a per-job secret, every request carries
these headers::

    X-Tierckpt-Version    WIRE_VERSION
    X-Tierckpt-Node       the sender's node rank
    X-Tierckpt-Timestamp  unix seconds (decimal), within ``max_skew`` of the receiver's clock
    X-Tierckpt-Nonce      128 random bits as 32 lower-case hex digits, never reused
    X-Tierckpt-Signature  hex HMAC-SHA256(secret, canonical request)

The canonical request is these fields joined by ``\\n``::

    version, METHOD, path, query, timestamp, nonce, node, Content-Length, X-Tierckpt-Checksum

``path`` is the decoded path percent-encoded again (everything but
``A-Z a-z 0-9 _ . - ~ /``), ``query`` the decoded pairs sorted and encoded the
same way (``k=v&k2=v2``); a missing Content-Length or checksum is the empty
string. No field can hold a newline, so the join is unambiguous.

The body is not part of the signature: hashing it with the HMAC would mean
reading every byte in user space and give up ``sendfile``. Its integrity comes
from ``X-Tierckpt-Checksum`` (the shard's xxh3 checksum, see
:mod:`tiers.checksum`), which *is* signed and which the receiver checks against
the bytes before publishing them. Confidentiality needs TLS.

Replays: the receiver remembers every nonce until its timestamp leaves the
``max_skew`` window, so a captured request is refused when sent again.
"""

from __future__ import annotations

import errno
import hashlib
import heapq
import hmac
import math
import os
import re
import secrets
import stat
import threading
import time
from typing import Any, Callable, Iterable, Mapping, Union
from urllib.parse import parse_qsl, quote

from .checksum import ALGO

__all__ = [
    "WIRE_VERSION",
    "H_VERSION",
    "H_NODE",
    "H_TIMESTAMP",
    "H_NONCE",
    "H_SIGNATURE",
    "H_CHECKSUM",
    "H_MTIME",
    "H_MORE",
    "CHECKSUM_RE",
    "MAX_KEY_LEN",
    "MAX_LIST_KEYS",
    "MAX_LIST_BYTES",
    "MAX_HEADER_SIZE",
    "MAX_HEADERS",
    "MAX_SMALL_BODY",
    "DEFAULT_MAX_BODY",
    "MAX_SKEW",
    "READ_IDLE_TIMEOUT",
    "HANDLER_TIMEOUT",
    "MIN_SECRET_LEN",
    "SECRET_ENV",
    "AuthError",
    "SecretError",
    "Query",
    "canonical_path",
    "canonical_query",
    "canonical_request",
    "sign",
    "NonceCache",
    "Verifier",
    "load_secret",
    "secret_from_env",
    "TokenBucket",
]

WIRE_VERSION = 1

H_VERSION = "X-Tierckpt-Version"
H_NODE = "X-Tierckpt-Node"
H_TIMESTAMP = "X-Tierckpt-Timestamp"
H_NONCE = "X-Tierckpt-Nonce"
H_SIGNATURE = "X-Tierckpt-Signature"
#: the body's checksum (``xxh3_64:<16 hex>``), required on shard uploads
H_CHECKSUM = "X-Tierckpt-Checksum"
#: an object's mtime in unix seconds (float), on HEAD and GET answers
H_MTIME = "X-Tierckpt-Mtime"
#: on a list answer: "1" when more keys follow the last one returned (ask again with ``after``)
H_MORE = "X-Tierckpt-More"

# -- limits ------------------------------------------------------------------------------
#: longest key (bytes) either side accepts; real keys are under 180
MAX_KEY_LEN = 512
#: most ``[key, size]`` entries in one list answer (the client pages through the rest)
MAX_LIST_KEYS = 10_000
#: largest list / health / error body a client reads, bytes
MAX_LIST_BYTES = 4 << 20
#: longest request line and longest header field a server reads, bytes
MAX_HEADER_SIZE = 8190
#: most header fields in one request
MAX_HEADERS = 64
#: largest body of any request other than an object upload (JSON of extra routes, e.g. a
#: rank's layout in a commit record), bytes; only read once the request is authenticated
MAX_SMALL_BODY = 64 << 20
#: default cap on one uploaded object (shard), bytes; servers may set their own
DEFAULT_MAX_BODY = 256 << 30
#: how far a request's timestamp may be from the receiver's clock, seconds
MAX_SKEW = 30.0
#: longest pause while a request body arrives before the server gives up, seconds
READ_IDLE_TIMEOUT = 30.0
#: longest a request without a streamed body may take on the server, seconds
HANDLER_TIMEOUT = 30.0
#: shortest accepted secret, bytes
MIN_SECRET_LEN = 16
#: environment variable naming the secret file
SECRET_ENV = "CKPT_SECRET_FILE"

_NONCE_RE = re.compile(r"^[0-9a-f]{32}\Z")
_SIG_RE = re.compile(r"^[0-9a-f]{64}\Z")
_NODE_RE = re.compile(r"^(0|[1-9][0-9]{0,9})\Z")
_TS_RE = re.compile(r"^[0-9]{1,12}(\.[0-9]{1,9})?\Z")
#: the form of an ``X-Tierckpt-Checksum`` value
CHECKSUM_RE = re.compile(r"^" + ALGO + r":[0-9a-f]{16}\Z")
_SAFE = "-._~"

#: a query as a mapping, as (name, value) pairs, or as an encoded string
Query = Union[Mapping[str, Any], Iterable[tuple], str, None]


class AuthError(PermissionError):
    """A request failed authentication. ``reason`` is a short code for metrics.

    Codes: ``missing`` (a header is absent or repeated), ``version`` (another
    wire version), ``malformed`` (a header has the wrong form), ``skew`` (the
    timestamp is too far from now), ``signature`` (wrong secret or a tampered
    request), ``replay`` (the nonce was seen before), ``busy`` (too many
    requests in the replay window to remember them all).
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(errno.EACCES, message)
        self.reason = reason

    def __str__(self) -> str:
        return self.strerror


class SecretError(ValueError):
    """The secret file is missing, empty, too short or readable by others."""


# -- canonical request -------------------------------------------------------------------
def canonical_path(path: str) -> str:
    """The decoded ``path`` percent-encoded the one way both sides agree on."""
    return quote(path, safe="/" + _SAFE)


def _pairs(query: Query) -> list[tuple[str, str]]:
    if query is None:
        return []
    if isinstance(query, str):
        return parse_qsl(query.lstrip("?"), keep_blank_values=True)
    items = query.items() if hasattr(query, "items") else query
    return [(str(k), str(v)) for k, v in items]


def canonical_query(query: Query) -> str:
    """The decoded pairs of ``query``, sorted and percent-encoded, joined by ``&``."""
    return "&".join(f"{quote(k, safe=_SAFE)}={quote(v, safe=_SAFE)}" for k, v in sorted(_pairs(query)))


def canonical_request(method: str, path: str, query: Query, *, timestamp: str, nonce: str, node: str,
                      content_length: str = "", checksum: str = "", version: str = str(WIRE_VERSION)) -> str:
    """The string that is signed; see the module docstring."""
    fields = [version, method.upper(), canonical_path(path), canonical_query(query), timestamp, nonce,
              node, content_length, checksum]
    for f in fields:
        if "\n" in f or "\r" in f:
            raise ValueError("a signed request field holds a line break")
    return "\n".join(fields)


def _mac(secret: bytes, canonical: str) -> str:
    return hmac.new(secret, canonical.encode("utf-8", "surrogateescape"), hashlib.sha256).hexdigest()


def _check_secret(secret: bytes) -> bytes:
    if not isinstance(secret, (bytes, bytearray)) or not secret:
        raise SecretError("the secret must be non-empty bytes (see load_secret)")
    return bytes(secret)


def sign(secret: bytes, method: str, path: str, query: Query = None, *, node: int,
         content_length: int | None = None, checksum: str | None = None,
         timestamp: float | None = None, nonce: str | None = None) -> dict[str, str]:
    """Headers that authenticate one request: version, node, timestamp, nonce, signature.

    ``path`` is the decoded path (``/v1/o/<key>``), ``query`` the decoded query.
    ``content_length`` and ``checksum`` must be sent as given (the checksum
    header is included in the result when given; Content-Length is the
    caller's to send). ``timestamp`` (unix seconds) and ``nonce`` default to
    now and 128 fresh random bits; a nonce must never be reused.
    """
    secret = _check_secret(secret)
    ts = f"{time.time() if timestamp is None else timestamp:.3f}"
    nonce = secrets.token_hex(16) if nonce is None else nonce
    node_s = str(int(node))
    cl = "" if content_length is None else str(int(content_length))
    canonical = canonical_request(method, path, query, timestamp=ts, nonce=nonce, node=node_s,
                                  content_length=cl, checksum=checksum or "")
    headers = {
        H_VERSION: str(WIRE_VERSION),
        H_NODE: node_s,
        H_TIMESTAMP: ts,
        H_NONCE: nonce,
        H_SIGNATURE: _mac(secret, canonical),
    }
    if checksum:
        headers[H_CHECKSUM] = checksum
    return headers


# -- verification ------------------------------------------------------------------------
class NonceCache:
    """The nonces seen in the replay window, each kept until its expiry (unix seconds).

    Holds at most ``max_entries``; when full, new requests are refused
    (``AuthError('busy')``) rather than forgetting a nonce that could then be
    replayed. Thread-safe.
    """

    def __init__(self, max_entries: int = 200_000) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self.max_entries = max_entries
        self._expiry: dict[str, float] = {}
        self._heap: list[tuple[float, str]] = []
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._expiry)

    def add(self, nonce: str, expires: float, now: float) -> bool:
        """Remember ``nonce`` until ``expires``; False if it is already remembered."""
        with self._lock:
            while self._heap and self._heap[0][0] <= now:
                _, old = heapq.heappop(self._heap)
                if self._expiry.get(old, math.inf) <= now:
                    del self._expiry[old]
            if nonce in self._expiry:
                return False
            if len(self._expiry) >= self.max_entries:
                raise AuthError("busy", "too many requests in the replay window to remember them all; "
                                        "retry shortly")
            self._expiry[nonce] = expires
            heapq.heappush(self._heap, (expires, nonce))
            return True


def _all(headers: Mapping[str, str], name: str) -> list[str]:
    getall = getattr(headers, "getall", None)
    if getall is not None:  # a case-insensitive multidict, as servers hand headers over
        return list(getall(name, []))
    return [v for k, v in headers.items() if k.lower() == name.lower()]


def _opt(headers: Mapping[str, str], name: str) -> str:
    values = _all(headers, name)
    if len(values) > 1:
        raise AuthError("missing", f"header {name} given more than once")
    return values[0] if values else ""


def _one(headers: Mapping[str, str], name: str) -> str:
    values = _all(headers, name)
    if not values:
        raise AuthError("missing", f"missing header {name}")
    if len(values) > 1:
        raise AuthError("missing", f"header {name} given more than once")
    return values[0]


class Verifier:
    """Checks the signature headers of incoming requests (see the module docstring).

    ``max_skew``: seconds a timestamp may differ from ``clock()``.
    ``nonce_cache``: where seen nonces are kept (a fresh :class:`NonceCache` if None).
    """

    def __init__(self, secret: bytes, max_skew: float = MAX_SKEW, nonce_cache: NonceCache | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self._secret = _check_secret(secret)
        if not max_skew > 0:
            raise ValueError("max_skew must be > 0 seconds")
        self.max_skew = float(max_skew)
        self.nonces = NonceCache() if nonce_cache is None else nonce_cache
        self._clock = clock

    def verify(self, method: str, path: str, query: Query, headers: Mapping[str, str]) -> int:
        """Return the sender's node rank, or raise :class:`AuthError` with a one-line reason.

        ``path`` and ``query`` are decoded, as the server's framework hands them over.
        """
        version = _one(headers, H_VERSION)
        if version != str(WIRE_VERSION):
            raise AuthError("version", f"wire version {version[:16]!r} not supported (this side speaks "
                                       f"{WIRE_VERSION}): run the same tierckpt release on every node")
        node = _one(headers, H_NODE)
        ts = _one(headers, H_TIMESTAMP)
        nonce = _one(headers, H_NONCE)
        signature = _one(headers, H_SIGNATURE)
        if not _NODE_RE.match(node):
            raise AuthError("malformed", f"malformed {H_NODE} header")
        if not _TS_RE.match(ts):
            raise AuthError("malformed", f"malformed {H_TIMESTAMP} header")
        if not _NONCE_RE.match(nonce):
            raise AuthError("malformed", f"malformed {H_NONCE} header (want 32 lower-case hex digits)")
        if not _SIG_RE.match(signature):
            raise AuthError("malformed", f"malformed {H_SIGNATURE} header (want 64 lower-case hex digits)")
        cl = _opt(headers, "Content-Length")
        checksum = _opt(headers, H_CHECKSUM)
        if "\n" in cl + checksum or "\r" in cl + checksum:
            raise AuthError("malformed", "a signed header holds a line break")
        now = self._clock()
        sent = float(ts)
        if abs(now - sent) > self.max_skew:
            raise AuthError("skew", f"request timestamp is {now - sent:+.1f} s off this node's clock "
                                    f"(at most {self.max_skew:.0f} s allowed): synchronise the clocks (NTP)")
        try:
            canonical = canonical_request(method, path, query, timestamp=ts, nonce=nonce, node=node,
                                          content_length=cl, checksum=checksum, version=version)
        except ValueError as e:
            raise AuthError("malformed", str(e)) from None
        if not hmac.compare_digest(_mac(self._secret, canonical), signature):
            raise AuthError("signature", "bad signature: the nodes do not share the same secret, "
                                         "or the request was altered")
        # only signed requests reach the cache, so strangers cannot fill it
        if not self.nonces.add(nonce, sent + self.max_skew, now):
            raise AuthError("replay", "replayed request (nonce already used)")
        return int(node)


# -- the secret --------------------------------------------------------------------------
def load_secret(path: str | os.PathLike) -> bytes:
    """Read the per-job secret from ``path``; trailing whitespace (a final newline) is dropped.

    Raises :class:`SecretError` when the file is missing, not a regular file,
    readable or writable by group or others, empty, or shorter than
    ``MIN_SECRET_LEN`` bytes.
    """
    path = os.fspath(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise SecretError(f"secret file {path} does not exist: create it on every node, e.g. "
                          f"(umask 077; head -c 32 /dev/urandom | base64 > {path})") from None
    except OSError as e:
        raise SecretError(f"cannot open secret file {path}: {e.strerror}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SecretError(f"secret file {path} is not a regular file")
        if st.st_mode & 0o077:
            raise SecretError(f"secret file {path} is accessible to group or others "
                              f"(mode {stat.S_IMODE(st.st_mode):o}): chmod 600 {path}")
        data = os.read(fd, 1 << 16).rstrip(b" \t\r\n")
    finally:
        os.close(fd)
    if not data:
        raise SecretError(f"secret file {path} is empty: put at least {MIN_SECRET_LEN} random bytes in it")
    if len(data) < MIN_SECRET_LEN:
        raise SecretError(f"secret in {path} is {len(data)} bytes: use at least {MIN_SECRET_LEN} random bytes")
    return data


def secret_from_env(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The secret named by ``CKPT_SECRET_FILE``, or None when the variable is unset or empty."""
    path = (os.environ if environ is None else environ).get(SECRET_ENV, "")
    return load_secret(path) if path else None


# -- bandwidth caps ----------------------------------------------------------------------
class TokenBucket:
    """A bandwidth cap of ``rate`` bytes/s with bursts of up to ``burst`` bytes. Thread-safe.

    ``take(n)`` reserves ``n`` bytes and sleeps until the cap allows them to be
    sent; callers are served in the order they asked. Share one bucket among
    all the senders whose sum is to be capped (e.g. every peer of one node).
    """

    def __init__(self, rate: float, burst: float | None = None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        if not (rate > 0 and math.isfinite(rate)):
            raise ValueError(f"rate must be a positive number of bytes/s, got {rate!r}")
        self.rate = float(rate)
        self.burst = float(burst) if burst is not None else max(64 * 1024.0, self.rate / 10)
        if not self.burst > 0:
            raise ValueError("burst must be > 0 bytes")
        self._clock = clock
        self._sleep = sleep
        self._tokens = self.burst
        self._last = clock()
        self._lock = threading.Lock()

    def chunk(self) -> int:
        """A good piece size for a capped sender, bytes: small enough to keep the rate smooth."""
        return int(min(1 << 20, max(16 * 1024, self.rate / 20)))

    def take(self, n: int) -> float:
        """Wait until ``n`` more bytes may be sent; return the seconds waited."""
        if n <= 0:
            return 0.0
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            # going into debt reserves the bytes now, so later callers queue behind this one
            self._tokens -= n
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            self._sleep(wait)
        return wait
