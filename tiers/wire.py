"""The peer wire protocol: versioned request signing, the shared secret, limits, bandwidth caps.

Peers speak plain HTTP/1.1 (see ``agents/peer_server.py`` for the routes and
``tiers/peer.py`` for the client). With a per-job secret, every request carries
these headers::

    X-Tierckpt-Version    WIRE_VERSION
    X-Tierckpt-Node       the sender's node rank
    X-Tierckpt-Timestamp  unix seconds (decimal), within ``max_skew`` of the receiver's clock
    X-Tierckpt-Nonce      32 lower-case hex digits: the sender's session (16, random per process)
                          then its sequence number towards this receiver (16), never reused
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

Replays: the receiver keeps, per sender session, a window of the sequence
numbers it has taken (:class:`ReplayGuard`), so a captured request is refused
when sent again, however late. The timestamp only has to be within
``max_skew`` for a session the receiver has no record of (its first requests,
or the receiver restarted): a request that TCP delivers 40 s late, because a
link was down for 40 s, is taken if its session is known and its number is
new. A session's record is dropped only once it has been idle for longer than
``max_skew``, so no request it took can be replayed with a fresh timestamp.
"""

from __future__ import annotations

import errno
import hashlib
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
    "ReplayGuard",
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
         timestamp: float | None = None, nonce: str | None = None, to: str = "") -> dict[str, str]:
    """Headers that authenticate one request: version, node, timestamp, nonce, signature.

    ``path`` is the decoded path (``/v1/o/<key>``), ``query`` the decoded query.
    ``content_length`` and ``checksum`` must be sent as given (the checksum
    header is included in the result when given; Content-Length is the
    caller's to send). ``timestamp`` (unix seconds) defaults to now, ``nonce``
    to this process's session and its next sequence number towards ``to``
    (the receiver's address: numbers that reach a receiver in order keep its
    replay window small); a nonce must never be reused.
    """
    secret = _check_secret(secret)
    ts = f"{time.time() if timestamp is None else timestamp:.3f}"
    nonce = _next_nonce(to) if nonce is None else nonce
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
class _Session:
    """What a receiver keeps of one sender session: every number up to ``base`` is taken or too old; bit
    ``i`` of ``mask`` says whether ``base + 1 + i`` was taken."""

    __slots__ = ("first", "base", "top", "mask", "used")

    def __init__(self, first: int, window: int, now: float) -> None:
        self.first = first
        self.base = first - 1 - window  # numbers a little below the first may still arrive (parallel links)
        self.top = first - 1
        self.mask = 0
        self.used = now


class ReplayGuard:
    """Sequence windows of the sender sessions this receiver has heard from (see the module docstring).

    A request is taken when its number is above the session's floor and not taken before. The floor
    follows the numbers taken in order, and never lags the highest one by more than ``window`` (a bit mask
    of ``window`` bits per session). A request of an unknown session, or numbered at or below the first
    number the receiver took from it, must be fresh (its timestamp within ``max_skew``): only those could
    have reached this receiver before it started keeping the session. At most ``max_sessions`` sessions;
    when full, those idle for longer than ``max_skew`` are forgotten, and if there are none, new sessions
    are refused (``AuthError('busy')``). Thread-safe.
    """

    def __init__(self, window: int = 4096, max_sessions: int = 65536) -> None:
        if window < 1 or max_sessions < 1:
            raise ValueError("window and max_sessions must be >= 1")
        self.window = window
        self.max_sessions = max_sessions
        self._sessions: dict[tuple[str, str], _Session] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._sessions)

    def take(self, node: str, nonce: str, *, fresh: bool, now: float, max_skew: float, late_s: float) -> None:
        """Take request ``nonce`` of ``node``; raise AuthError (``replay``, ``skew`` or ``busy``) if it may not
        be taken. ``fresh``: its timestamp is within ``max_skew``; ``late_s``: how far off it is."""
        key, seq = (node, nonce[:16]), int(nonce[16:], 16)
        with self._lock:
            st = self._sessions.get(key)
            if st is None:
                if not fresh:
                    raise _stale(late_s, max_skew, known=False)
                if len(self._sessions) >= self.max_sessions:
                    self._evict(now, max_skew)
                st = self._sessions[key] = _Session(seq, self.window, now)
            off = seq - st.base - 1
            if off < 0 or st.mask >> off & 1:
                raise AuthError("replay", "replayed request (its nonce was taken before, or is older than the "
                                          f"last {self.window} this node took from its sender)")
            if seq <= st.first and not fresh:
                raise _stale(late_s, max_skew, known=True)
            st.used = now
            st.mask |= 1 << off
            st.top = max(st.top, seq)
            # the floor moves up over the numbers taken in order, and to at most `window` below the top
            shift = max(st.top - self.window - st.base, (st.mask ^ (st.mask + 1)).bit_length() - 1)
            st.mask >>= shift
            st.base += shift
            ones = (st.mask ^ (st.mask + 1)).bit_length() - 1
            st.mask >>= ones
            st.base += ones

    def _evict(self, now: float, max_skew: float) -> None:
        idle = [k for k, st in self._sessions.items() if now - st.used > max_skew]
        if not idle:
            raise AuthError("busy", "too many sender sessions active at once to remember them all; retry shortly")
        for k in sorted(idle, key=lambda k: self._sessions[k].used)[:max(1, len(idle) // 2)]:
            del self._sessions[k]


def _stale(late_s: float, max_skew: float, *, known: bool) -> AuthError:
    why = ("numbered before the first request this node took from its sender" if known
           else "from a sender this node has no record of (this node restarted, or the sender is new)")
    return AuthError("skew", f"request timestamp is {late_s:+.1f} s off this node's clock (at most {max_skew:.0f} s "
                             f"allowed) and it is {why}: if the request was held up by a network outage it is "
                             f"sent again; otherwise synchronise the clocks (NTP)")


# -- the sender's side of the replay window ----------------------------------------------
_seq_lock = threading.Lock()
_session = secrets.token_hex(8)
_seqs: dict[str, int] = {}


def _new_session() -> None:
    """A process (a forked child too) numbers its requests in a session of its own."""
    global _session, _seq_lock
    _seq_lock = threading.Lock()
    _session = secrets.token_hex(8)
    _seqs.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_session)


def _next_nonce(to: str) -> str:
    with _seq_lock:
        n = _seqs[to] = _seqs.get(to, 0) + 1
        return f"{_session}{n:016x}"


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

    ``max_skew``: seconds a timestamp may differ from ``clock()`` (for requests of a sender session this
    node has no record of; see :class:`ReplayGuard`).
    ``guard``: where sender sessions are kept (a fresh :class:`ReplayGuard` if None).
    """

    def __init__(self, secret: bytes, max_skew: float = MAX_SKEW, guard: ReplayGuard | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self._secret = _check_secret(secret)
        if not max_skew > 0:
            raise ValueError("max_skew must be > 0 seconds")
        self.max_skew = float(max_skew)
        self.guard = ReplayGuard() if guard is None else guard
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
        try:
            canonical = canonical_request(method, path, query, timestamp=ts, nonce=nonce, node=node,
                                          content_length=cl, checksum=checksum, version=version)
        except ValueError as e:
            raise AuthError("malformed", str(e)) from None
        if not hmac.compare_digest(_mac(self._secret, canonical), signature):
            raise AuthError("signature", "bad signature: the nodes do not share the same secret, "
                                         "or the request was altered")
        # only signed requests reach the guard, so strangers cannot fill it
        self.guard.take(node, nonce, fresh=abs(now - sent) <= self.max_skew, now=now, max_skew=self.max_skew,
                        late_s=now - sent)
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
