"""The peer tier: another node's memory tier, reached over HTTP/1.1 through its agent's peer server.

The server side is ``agents/peer_server.py``; signing, limits and the bandwidth
cap are in :mod:`tiers.wire`. This client keeps one keep-alive connection per
thread (``http.client``), so a tier object is safe to share between threads.

* ``read_into`` sends one ``Range`` request and reads the body straight into
  the caller's buffer (``HTTPResponse.readinto`` on slices of it): no copy in
  between, so a loopback read runs at memory speed.
* ``put`` of a file path sends the headers, then the body with
  ``socket.sendfile`` (zero-copy from a ``/dev/shm`` file); a bytes-like
  source is sent from its own memory. The ``X-Tierckpt-Checksum`` header (xxh3
  of the bytes, computed first) lets the peer verify the body before it
  publishes it. Bodies of ``expect_continue`` bytes or more ask
  ``Expect: 100-continue`` first, so an upload the peer refuses (wrong
  secret, too large, no room) costs no transfer.
* With ``rate_limit`` the body is sent in pieces, each waiting for a
  :class:`~tiers.wire.TokenBucket`; pass one bucket to every PeerTier of a
  node to cap the node's total replication bandwidth.
* Requests that fail on the network (refused, reset, timed out) or that the
  peer answers 503 are retried up to ``retries`` more times with exponential
  backoff; a keep-alive connection the peer closed while idle is reopened
  without counting as a try. Every try is signed afresh.

Errors: a missing key is :class:`KeyNotFoundError`; a peer that stays
unreachable :class:`TierUnavailableError`; a refused signature, an oversize
object or a bad range :class:`TierError`; a body the peer found corrupt
:class:`ChecksumMismatchError`; a peer out of memory :class:`TierFullError`.
"""

from __future__ import annotations

import errno
import http.client
import json
import mmap
import os
import select
import socket
import ssl
import threading
import time
from typing import Any, Callable

from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential

from .base import ObjectInfo, Source, TierBase
from .checksum import checksum_bytes
from .errors import ChecksumMismatchError, KeyNotFoundError, TierError, TierFullError, TierUnavailableError
from .keys import parse_index_key, parse_key, parse_layout_key
from .wire import (
    H_CHECKSUM,
    H_MORE,
    H_MTIME,
    H_NODE,
    H_VERSION,
    MAX_KEY_LEN,
    MAX_LIST_BYTES,
    WIRE_VERSION,
    TokenBucket,
    canonical_path,
    canonical_query,
    sign,
)

__all__ = ["PeerDiskTier", "PeerTier", "TokenBucket", "parse_addr", "EXPECT_THRESHOLD"]

#: uploads this large or larger ask ``Expect: 100-continue`` before sending the body, bytes
EXPECT_THRESHOLD = 1 << 20
#: backoff before retry n is 0.05·2^(n-1) s, at most this many seconds
_BACKOFF_MAX = 1.0
#: most bytes of an error answer read for its reason
_REASON_BYTES = 4096


def parse_addr(addr: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` → ``(host, port)``; ValueError if malformed."""
    host, sep, port = str(addr).rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"invalid peer address {addr!r}: expected host:port")
    return host, int(port)


def _known(key: str) -> bool:
    """A shard, manifest, layout or step index key (a peer answers only reads of the last)."""
    return parse_key(key) is not None or parse_layout_key(key) is not None or parse_index_key(key) is not None


def _check_key(key: str) -> str:
    """``key`` if it is a shard or manifest key a peer's memory folder can hold, else KeyNotFoundError."""
    if (not isinstance(key, str) or len(key) > MAX_KEY_LEN or not _known(key)
            or any(part.startswith(".") for part in key.split("/"))):
        raise KeyNotFoundError(errno.ENOENT, f"invalid key {key!r}")
    return key


class _Busy(TierUnavailableError):
    """The peer answered 503: overloaded or shutting down. Retried."""


class _Body:
    """An upload body: its size, checksum and how to put it on a socket."""

    size: int
    checksum: str

    def send(self, sock: socket.socket, bucket: TokenBucket | None) -> None:
        raise NotImplementedError


class _BufferBody(_Body):
    def __init__(self, src: Any) -> None:
        self.mv = memoryview(src).cast("B")
        self.size = len(self.mv)
        self.checksum = checksum_bytes(self.mv)

    def send(self, sock: socket.socket, bucket: TokenBucket | None) -> None:
        if bucket is None:
            sock.sendall(self.mv)
            return
        step = bucket.chunk()
        for i in range(0, self.size, step):
            piece = self.mv[i : i + step]
            bucket.take(len(piece))
            sock.sendall(piece)


class _FileBody(_Body):
    def __init__(self, path: str) -> None:
        self.path = path
        self.file = open(path, "rb")
        try:
            self.size = os.fstat(self.file.fileno()).st_size
            if self.size:
                # checksum the very file that is sent, mapped rather than read
                with mmap.mmap(self.file.fileno(), self.size, prot=mmap.PROT_READ) as mm:
                    self.checksum = checksum_bytes(mm)
            else:
                self.checksum = checksum_bytes(b"")
        except BaseException:
            self.file.close()
            raise

    def send(self, sock: socket.socket, bucket: TokenBucket | None) -> None:
        step = self.size if bucket is None else bucket.chunk()
        done = 0
        while done < self.size:
            n = min(step, self.size - done)
            if bucket is not None:
                bucket.take(n)
            sent = sock.sendfile(self.file, done, n)
            if not sent:
                raise TierError(errno.EIO, f"{self.path} shrank to {done} bytes while being sent")
            done += sent

    def close(self) -> None:
        self.file.close()


def _is_transient(e: BaseException) -> bool:
    if isinstance(e, _Busy):
        return True
    if isinstance(e, TierError):
        return False
    if isinstance(e, ssl.SSLError):
        return isinstance(e, (ssl.SSLEOFError, ssl.SSLZeroReturnError))
    return isinstance(e, (OSError, http.client.HTTPException))


def _describe(e: BaseException) -> str:
    if isinstance(e, http.client.IncompleteRead):
        return f"connection cut after {e.partial if isinstance(e.partial, int) else len(e.partial)} bytes"
    text = str(e) or type(e).__name__
    return text if type(e).__name__ in text else f"{type(e).__name__}: {text}"


class PeerTier(TierBase):
    """Another node's memory tier, over HTTP/1.1; see the module docstring.

    ``addr``: ``host:port`` of the peer's server. ``secret``: the per-job
    secret (None only for a server that accepts unsigned requests, on
    loopback). ``node``: this node's rank, sent with every request.
    ``timeout``: seconds any one socket operation may take. ``ssl_context``:
    a client TLS context (with the CA that signed the peer's certificate), or
    None for plain TCP. ``retries``: further tries of a request that failed on
    the network. ``rate_limit``: a bandwidth cap for uploads in bytes/s, or a
    shared :class:`TokenBucket`; ``bucket``: the same as a keyword of its own
    (None: uncapped). ``expect_continue``: smallest upload (bytes)
    that waits for the peer's go-ahead before sending its body (None: never;
    never over TLS).
    """

    name = "peer"
    #: idle keep-alive connections kept for reuse
    KEEP_IDLE = 4
    #: where the peer serves the objects of this tier, and their listing
    _OBJECTS = "/v1/o/"
    _LIST = "/v1/list"

    def __init__(
        self,
        addr: str,
        *,
        secret: bytes | None,
        node: int,
        timeout: float = 10.0,
        ssl_context: ssl.SSLContext | None = None,
        retries: int = 2,
        rate_limit: float | TokenBucket | None = None,
        bucket: TokenBucket | None = None,
        expect_continue: int | None = EXPECT_THRESHOLD,
    ) -> None:
        self.host, self.port = parse_addr(addr)
        self.addr = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
        if secret is not None and not (isinstance(secret, (bytes, bytearray)) and secret):
            raise ValueError("secret must be non-empty bytes or None")
        if isinstance(node, bool) or not isinstance(node, int) or node < 0:
            raise ValueError(f"node must be a rank >= 0, got {node!r}")
        if not timeout > 0:
            raise ValueError("timeout must be > 0 seconds")
        if retries < 0:
            raise ValueError("retries must be >= 0")
        self.secret = bytes(secret) if secret is not None else None
        self.node = node
        self.timeout = float(timeout)
        self.ssl_context = ssl_context
        self.retries = int(retries)
        if rate_limit is not None and bucket is not None:
            raise ValueError("give rate_limit or bucket, not both")
        if isinstance(rate_limit, (int, float)) and not isinstance(rate_limit, bool):
            bucket = TokenBucket(rate_limit)
        elif rate_limit is not None:
            bucket = rate_limit
        self.bucket: TokenBucket | None = bucket
        self.expect_continue = None if ssl_context is not None else expect_continue
        #: keep-alive connections not in use; any thread takes one, so a client holds at most as many as
        #: it has requests under way at once (and keeps at most ``KEEP_IDLE`` of them afterwards), not one
        #: per thread that ever called it
        self._idle: list[http.client.HTTPConnection] = []
        #: the connection of the attempt the calling thread is running (what ``_drop()`` drops)
        self._local = threading.local()
        self._conns: set[http.client.HTTPConnection] = set()
        self._lock = threading.Lock()
        self._closed = False

    def describe(self) -> str:
        return f"{self.name} {self.addr}"

    # -- connections -----------------------------------------------------------------------
    def _take(self) -> http.client.HTTPConnection:
        """An idle keep-alive connection, or a new one."""
        if self._closed:
            raise TierError(errno.EBADF, f"{self.describe()} is closed")
        with self._lock:
            if self._idle:
                conn = self._local.conn = self._idle.pop()
                return conn
        if self.ssl_context is not None:
            conn = http.client.HTTPSConnection(self.host, self.port, timeout=self.timeout, context=self.ssl_context)
        else:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        with self._lock:
            self._conns.add(conn)
        self._local.conn = conn
        return conn

    def _give(self, conn: http.client.HTTPConnection) -> None:
        """Return a connection after its attempt; kept for reuse unless it was dropped or enough are idle."""
        self._local.conn = None
        with self._lock:
            if conn in self._conns and not self._closed and len(self._idle) < self.KEEP_IDLE:
                self._idle.append(conn)
                return
            self._conns.discard(conn)
        conn.close()

    def _drop(self, conn: http.client.HTTPConnection | None = None) -> None:
        """Close a connection whose state is unknown (by default the one the calling thread's attempt
        uses); the next request opens another."""
        conn = conn if conn is not None else getattr(self._local, "conn", None)
        if conn is None:
            return
        with self._lock:
            self._conns.discard(conn)
        conn.close()

    def close(self) -> None:
        self._closed = True
        with self._lock:
            conns, self._conns, self._idle = list(self._conns), set(), []
        for conn in conns:
            conn.close()

    # -- one exchange ------------------------------------------------------------------------
    def _headers(self, method: str, path: str, query: dict | None, body: _Body | None) -> dict[str, str]:
        size = None if body is None else body.size
        checksum = None if body is None else body.checksum
        if self.secret is not None:
            return sign(self.secret, method, path, query, node=self.node, content_length=size, checksum=checksum,
                        to=self.addr)
        headers = {H_VERSION: str(WIRE_VERSION), H_NODE: str(self.node)}
        if checksum:
            headers[H_CHECKSUM] = checksum
        return headers

    def _exchange(self, conn: http.client.HTTPConnection, method: str, path: str, query: dict | None = None,
                  *, headers: dict[str, str] | None = None, body: _Body | None = None) -> http.client.HTTPResponse:
        """Send one signed request and return the answer with its headers read (body unread)."""
        url = canonical_path(path) + (f"?{canonical_query(query)}" if query else "")
        conn.putrequest(method, url, skip_accept_encoding=True)
        for name, value in {**self._headers(method, path, query, body), **(headers or {})}.items():
            conn.putheader(name, value)
        if body is not None:
            conn.putheader("Content-Length", str(body.size))
        expect = body is not None and self.expect_continue is not None and body.size >= self.expect_continue
        if expect:
            conn.putheader("Expect", "100-continue")
        conn.endheaders()
        if body is not None and body.size:
            if expect:
                early = self._await_continue(conn)
                if early is not None:
                    return early
            try:
                body.send(conn.sock, self.bucket)
            except (BrokenPipeError, ConnectionResetError) as e:
                # the peer may have answered (and closed) before taking the whole body
                try:
                    return conn.getresponse()
                except Exception:
                    raise e from None
            except BaseException:
                self._drop()  # a request cut short in its body leaves the connection unusable
                raise
        return conn.getresponse()

    def _await_continue(self, conn: http.client.HTTPConnection) -> http.client.HTTPResponse | None:
        """Wait for ``100 Continue`` (None: send the body) or an early final answer (returned)."""
        sock = conn.sock
        poller = select.poll()  # not select(): descriptors above 1023 are common in a busy agent
        poller.register(sock, select.POLLIN)
        deadline = time.monotonic() + self.timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(max(1, int(left * 1000))):
                return None  # no interim answer in time: send the body anyway (RFC 9110 §10.1.1)
            head = sock.recv(1024, socket.MSG_PEEK)
            if not head:
                raise ConnectionResetError("peer closed the connection before answering")
            if len(head) >= 12 and head[9:12] != b"100":
                return conn.getresponse()
            end = head.find(b"\r\n\r\n")
            if len(head) >= 12 and end >= 0:
                want = end + 4
                while want:
                    got = sock.recv(want)
                    if not got:
                        raise ConnectionResetError("peer closed the connection after 100 Continue")
                    want -= len(got)
                return None
            if len(head) >= 1024:
                raise http.client.HTTPException("malformed interim answer from the peer")
            time.sleep(0.001)  # the rest of the interim answer is on its way

    # -- answers -----------------------------------------------------------------------------
    def _discard(self, resp: http.client.HTTPResponse, limit: int = 1 << 20) -> None:
        """Finish an answer whose body is not wanted: read a small one, else drop the connection."""
        if resp.length is not None and resp.length <= limit:
            resp.read()
        if not resp.isclosed():
            self._drop()

    def _reason(self, resp: http.client.HTTPResponse) -> str:
        if resp.length is not None and resp.length <= _REASON_BYTES:
            text = resp.read().decode("utf-8", "replace")
        else:
            text = resp.reason or ""
        if not resp.isclosed():
            self._drop()
        return text.strip().splitlines()[0][:300] if text.strip() else (resp.reason or "")

    def _fail(self, resp: http.client.HTTPResponse, what: str, key: str | None = None) -> TierError:
        """The error for an answer that is not a success (its body is consumed here)."""
        status = resp.status
        reason = self._reason(resp)
        where = self.describe()
        if status == 404 and key is not None:
            return KeyNotFoundError(errno.ENOENT, f"{key} is not in the {where}")
        if status == 401:
            return TierError(f"{where} refused {what}: authentication failed "
                                           f"(check --secret-file on both nodes): {reason}")
        if status == 422:
            return ChecksumMismatchError(errno.EIO, f"{where} refused {what}: {reason}")
        if status == 507:
            return TierFullError(errno.ENOSPC, f"{where} has no room for {what}: {reason}")
        if status == 413:
            return TierError(f"{where} refused {what} as too large: {reason}")
        if status == 503:
            return _Busy(f"{where} is busy: {what} answered 503 ({reason})")
        return TierError(f"{where}: {what} answered {status} {resp.reason}: {reason}")

    def _json(self, resp: http.client.HTTPResponse, what: str) -> Any:
        if resp.length is None or resp.length > MAX_LIST_BYTES:
            self._drop()
            raise TierError(errno.EMSGSIZE, f"{self.describe()}: {what} answer has no length or is larger "
                                            f"than {MAX_LIST_BYTES} bytes")
        try:
            return json.loads(resp.read())
        except ValueError as e:
            raise TierError(errno.EPROTO, f"{self.describe()}: {what} answer is not JSON") from e

    def _past_end(self, key: str, offset: int, length: int, total: int | None) -> TierError:
        size = "?" if total is None else str(total)
        return TierError(errno.EINVAL, f"{key}: read of {length} bytes at {offset} past its end ({size})")

    @staticmethod
    def _total(resp: http.client.HTTPResponse) -> int | None:
        """The object's size from a Content-Range header (``bytes a-b/N`` or ``bytes */N``)."""
        value = resp.getheader("Content-Range") or ""
        total = value.rpartition("/")[2]
        return int(total) if total.isdigit() else None

    # -- retries -------------------------------------------------------------------------------
    def _call(self, what: str, fn: Callable[[http.client.HTTPConnection], Any]) -> Any:
        """Run ``fn(connection)`` under the retry policy; translate what escapes into tier errors."""
        retrying = Retrying(
            stop=stop_after_attempt(self.retries + 1),
            wait=wait_exponential(multiplier=0.05, max=_BACKOFF_MAX),
            retry=retry_if_exception(_is_transient),
            reraise=True,
        )
        try:
            return retrying(self._attempt, fn)
        except _Busy as e:
            raise TierUnavailableError(f"{e}; tried {retrying.statistics.get('attempt_number', 1)} times") from e
        except TierError:
            raise
        except ssl.SSLError as e:
            raise TierError(f"TLS with {self.describe()} failed during {what}: {e}; check the CA given to "
                            "this node and the peer's certificate") from e
        except (OSError, http.client.HTTPException) as e:
            tries = retrying.statistics.get("attempt_number", 1)
            raise TierUnavailableError(f"{self.describe()} unreachable: {what} failed {tries} times "
                                       f"({_describe(e)}); is its agent running?") from e

    def _attempt(self, fn: Callable[[http.client.HTTPConnection], Any]) -> Any:
        conn = self._take()
        reused = conn.sock is not None
        try:
            out = fn(conn)
        except TierError:
            self._give(conn)  # raised after the answer was consumed: the connection is fine
            raise
        except BaseException as e:
            self._drop(conn)
            # a keep-alive connection the peer closed while idle: reopen it, once, for free
            if not (reused and isinstance(e, (http.client.RemoteDisconnected, BrokenPipeError,
                                              ConnectionResetError))):
                raise
        else:
            self._give(conn)
            return out
        conn = self._take()
        try:
            out = fn(conn)
        except TierError:
            self._give(conn)
            raise
        except BaseException:
            self._drop(conn)
            raise
        self._give(conn)
        return out

    # -- Tier ----------------------------------------------------------------------------------
    def put(self, key: str, src: Source) -> int:
        """Send ``src`` (bytes-like, or a local file's path) as ``key``; return its size in bytes."""
        _check_key(key)
        path = self._OBJECTS + key
        if isinstance(src, (str, os.PathLike)):
            body: _Body = _FileBody(os.fspath(src))
        else:
            body = _BufferBody(src)

        def attempt(conn: http.client.HTTPConnection) -> int:
            resp = self._exchange(conn, "PUT", path, body=body)
            if resp.status not in (200, 201, 204):
                err = self._fail(resp, f"put {key}", key)
                # the peer may have stopped reading the body: this connection is spent
                self._drop()
                raise err
            self._discard(resp)
            return body.size

        try:
            return self._call(f"put {key}", attempt)
        finally:
            if isinstance(body, _FileBody):
                body.close()

    def read_into(self, key: str, buf: memoryview, offset: int = 0) -> int:
        _check_key(key)
        mv = memoryview(buf).cast("B")
        n = len(mv)
        if offset < 0:
            raise ValueError(f"negative offset {offset}")
        if n == 0:
            size = self.stat(key).size
            if offset > size:
                raise self._past_end(key, offset, 0, size)
            return 0

        return self._read_views(key, offset, [mv])

    def read_ranges(self, key: str, pieces: list[tuple[int, memoryview]]) -> int:
        """Fill contiguous pieces ``[(offset, view), ...]`` of ``key``, in ascending order, with one request.

        The restore's fast path: the views are the destination tensors' own memory, so the bytes cross
        the socket straight into them. Returns the bytes read; raises as :meth:`read_into`.
        """
        _check_key(key)
        views = [memoryview(v).cast("B") for _, v in pieces]
        if not views:
            return 0
        at = pieces[0][0]
        if at < 0:
            raise ValueError(f"negative offset {at}")
        for (off, _), v in zip(pieces, views):
            if off != at:
                raise ValueError(f"pieces of {key} are not contiguous and ascending at offset {off}")
            at += len(v)
        if at == pieces[0][0]:
            return self.read_into(key, memoryview(b""), pieces[0][0])
        return self._read_views(key, pieces[0][0], views)

    def _read_views(self, key: str, offset: int, views: list[memoryview]) -> int:
        n = sum(len(v) for v in views)

        def attempt(conn: http.client.HTTPConnection) -> int:
            resp = self._exchange(conn, "GET", self._OBJECTS + key,
                                  headers={"Range": f"bytes={offset}-{offset + n - 1}"})
            if resp.status == 416:
                total = self._total(resp)
                self._discard(resp)
                raise self._past_end(key, offset, n, total)
            if resp.status not in (200, 206):
                raise self._fail(resp, f"read of {key}", key)
            if resp.status == 200 and offset:
                self._discard(resp, 0)
                raise TierError(errno.EPROTO, f"{self.describe()} ignored the Range of a read of {key}")
            if resp.length != n:
                # the range ran past the end, and the peer sent what there was
                total = self._total(resp) if resp.status == 206 else resp.length
                self._discard(resp)
                raise self._past_end(key, offset, n, total)
            done = 0
            for mv in views:
                filled = 0
                while filled < len(mv):
                    got = resp.readinto(mv[filled:])
                    if not got:
                        raise http.client.IncompleteRead(done + filled, n - done - filled)
                    filled += got
                done += filled
            return n

        return self._call(f"read of {key}", attempt)

    def get(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        if length is not None:
            return super().get(key, offset, length)
        _check_key(key)
        if offset < 0:
            raise ValueError(f"negative offset {offset}")

        # one request for size and bytes, so an overwrite between the two cannot tear the result
        def attempt(conn: http.client.HTTPConnection) -> bytes:
            headers = {"Range": f"bytes={offset}-"} if offset else None
            resp = self._exchange(conn, "GET", self._OBJECTS + key, headers=headers)
            if resp.status == 416:
                total = self._total(resp)
                self._discard(resp)
                if total == offset:
                    return b""
                raise self._past_end(key, offset, 0, total)
            if resp.status not in (200, 206) or (resp.status == 200 and offset):
                raise self._fail(resp, f"read of {key}", key)
            if resp.length is None:
                self._drop()
                raise TierError(errno.EPROTO, f"{self.describe()} sent {key} without a length")
            want = resp.length
            data = resp.read()
            if len(data) != want:
                raise http.client.IncompleteRead(len(data), want - len(data))
            return data

        return self._call(f"read of {key}", attempt)

    def stat(self, key: str) -> ObjectInfo:
        _check_key(key)

        def attempt(conn: http.client.HTTPConnection) -> ObjectInfo:
            resp = self._exchange(conn, "HEAD", self._OBJECTS + key)
            if resp.status != 200:
                raise self._fail(resp, f"stat of {key}", key)
            resp.read()
            size = resp.getheader("Content-Length", "")
            if not size.isdigit():
                raise TierError(errno.EPROTO, f"{self.describe()} gave no size for {key}")
            try:
                mtime = float(resp.getheader(H_MTIME, "") or "nan")
            except ValueError:
                mtime = float("nan")
            if mtime != mtime:
                mtime = time.time()
            return ObjectInfo(key, int(size), mtime)

        return self._call(f"stat of {key}", attempt)

    def list_sizes(self, prefix: str = "") -> list[tuple[str, int]]:
        """``(key, size in bytes)`` of every key that starts with ``prefix``, sorted by key."""
        if not isinstance(prefix, str) or len(prefix) > MAX_KEY_LEN or "\0" in prefix:
            raise ValueError(f"invalid prefix {prefix!r}")
        out: list[tuple[str, int]] = []
        after = ""
        while True:
            query = {"prefix": prefix, "after": after} if after else {"prefix": prefix}

            def attempt(conn: http.client.HTTPConnection, query: dict = query) -> tuple[list, bool]:
                resp = self._exchange(conn, "GET", self._LIST, query)
                if resp.status != 200:
                    raise self._fail(resp, f"list of {prefix!r}")
                more = resp.getheader(H_MORE, "0") == "1"
                return self._json(resp, "list"), more

            entries, more = self._call(f"list of {prefix!r}", attempt)
            if not isinstance(entries, list):
                raise TierError(errno.EPROTO, f"{self.describe()}: list answer is not a list")
            for entry in entries:
                if (not isinstance(entry, list) or len(entry) != 2 or not isinstance(entry[0], str)
                        or not isinstance(entry[1], int) or entry[1] < 0):
                    raise TierError(errno.EPROTO, f"{self.describe()}: malformed list entry {entry!r:.100}")
                if entry[0].startswith(prefix) and entry[0] > after and _known(entry[0]):
                    out.append((entry[0], entry[1]))
            if not more or not entries:
                break
            after = entries[-1][0]
        return sorted(out)

    def list(self, prefix: str = "") -> list[str]:
        return [key for key, _ in self.list_sizes(prefix)]

    def delete(self, key: str) -> None:
        _check_key(key)

        def attempt(conn: http.client.HTTPConnection) -> None:
            resp = self._exchange(conn, "DELETE", self._OBJECTS + key)
            if resp.status not in (200, 204, 404):
                raise self._fail(resp, f"delete of {key}", key)
            self._discard(resp)

        self._call(f"delete of {key}", attempt)

    def health(self) -> dict:
        """The peer's ``/v1/health`` answer: node, version, time, bytes_held, objects."""

        def attempt(conn: http.client.HTTPConnection) -> dict:
            resp = self._exchange(conn, "GET", "/v1/health")
            if resp.status != 200:
                raise self._fail(resp, "health check")
            data = self._json(resp, "health")
            if not isinstance(data, dict):
                raise TierError(errno.EPROTO, f"{self.describe()}: health answer is not an object")
            return data

        return self._call("health check", attempt)


class PeerDiskTier(PeerTier):
    """Another node's disk tier, read-only, through the same peer server (``/v1/disk/...``): the objects of a
    step its node drained to disk, read like its memory (ranged reads straight into the caller's buffer). A
    node without a disk folder lists nothing. ``put`` and ``delete`` raise TierError: a node's disk is
    written and trimmed by its own agent only."""

    name = "peer-disk"
    _OBJECTS = "/v1/disk/o/"
    _LIST = "/v1/disk/list"

    def put(self, key: str, src: Source) -> int:
        raise TierError(errno.EROFS, f"{self.describe()} is read-only: only its own agent writes a node's disk")

    def delete(self, key: str) -> None:
        raise TierError(errno.EROFS, f"{self.describe()} is read-only: only its own agent trims a node's disk")
