"""The peer server: this node's memory tier over HTTP/1.1, for the agents of other nodes.

Routes (``<key>`` is a shard, manifest or layout key of :mod:`tiers.keys`; any other key is a 400)::

    GET    /v1/health            {"node", "version", "time", "bytes_held", "objects", "peers"} (heartbeats;
                                 "peers": the agent's digest of its peers file, where it has one)
    GET    /v1/list?prefix=P[&after=K]
                                 [[key, size], ...] sorted, at most MAX_LIST_KEYS; the answer
                                 carries ``X-Tierckpt-More: 1`` when more keys follow
    HEAD   /v1/o/<key>           Content-Length and X-Tierckpt-Mtime; 404 if absent
    GET    /v1/o/<key>           the bytes (``Range: bytes=a-b`` → 206), sent with sendfile
    PUT    /v1/o/<key>           Content-Length required (≤ max_body), X-Tierckpt-Checksum
                                 required for shards; 201 once verified and published,
                                 422 on a checksum mismatch (nothing published)
    DELETE /v1/o/<key>           204, present or not
    GET    /metrics              Prometheus text; never needs a signature
    GET    /v1/disk/list?prefix=P[&after=K]
                                 the node's disk tier listed as /v1/list lists memory (empty when
                                 the node has no disk folder)
    HEAD   /v1/disk/o/<key>      as /v1/o/<key>, of the disk tier (read-only: no PUT, no DELETE)
    GET    /v1/disk/o/<key>      the bytes, ranged as /v1/o/<key>; an LZ4-compressed object is
                                 sent decompressed, streamed

A layout PUT is stored only when its content matches the digest its key names (else 422).

The node agent adds its own routes, all signed, with small JSON bodies: ``POST /v1/up`` and
``POST /v1/down`` (the commit tree, :mod:`agents.dissemination`), ``POST /v1/fetch`` and
``POST /v1/publish`` (replication). Their contract is documented beside their handlers, in
:mod:`agents.replicator`.

With a secret, every other request must carry a valid signature
(:mod:`tiers.wire`) or is answered 401 with a one-line reason; the refusal is
logged (logger ``tierckpt.peer``) and the server carries on. Without a secret
the server accepts unsigned requests and so listens on loopback only; that is
for tests and debugging by hand: an agent with peers always has a secret
(:class:`agents.config.Settings` refuses peers without one), since any local
user can reach a loopback port.

An upload is written to a dot-named temp file beside its key (``.tmp-peer-…``,
never listed, swept by the agent at start), checked against its checksum as it
arrives, and renamed into place only when whole and correct. An upload sent
with ``Expect: 100-continue`` is authenticated and size-checked before its body
is asked for, so a refused upload costs no transfer.

Connections: a connection counts as a source's (its address's) only once a request on it authenticated;
each source may hold ``max_connections`` of them, and a request past that is answered 503 (busy, which
clients retry) and its connection closed. Until then a connection is pending: it must deliver a complete
request head within ``auth_timeout`` seconds, and when more than ``max_pending`` are pending the oldest of
the source holding the most is closed. So a flood of half-sent requests, from any number of connections,
can never keep a signed client out. Requests refused for their signature close their connection.
Malformed requests and refusals are counted in ``/metrics`` and logged one line at a time, at most one
per ``_LOG_WINDOW`` seconds (then a count of the others), never with a traceback.

Limits: request line and each header ≤ MAX_HEADER_SIZE bytes, ≤ MAX_HEADERS
headers, keys ≤ MAX_KEY_LEN bytes, bodies other than uploads ≤
MAX_SMALL_BODY, an upload body may pause at most ``read_timeout`` seconds,
other requests finish within ``handler_timeout`` seconds.

Run one by hand (debugging, curl)::

    python -m agents.peer_server --root /dev/shm/x --port 8765 [--host H --secret-file F]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import contextlib
import errno
import inspect
import ipaddress
import logging
import math
import os
import re
import signal
import socket
import ssl
import stat
import time
import uuid
from typing import Any, Awaitable, Callable, Iterable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from recovery import step_index
from tiers import keys
from tiers.checksum import Hasher
from tiers.disk import DiskTier
from tiers.errors import KeyNotFoundError, ManifestError, TierError
from tiers.memory import MemoryTier
from tiers.wire import (
    CHECKSUM_RE,
    DEFAULT_MAX_BODY,
    H_CHECKSUM,
    H_MORE,
    H_MTIME,
    H_VERSION,
    HANDLER_TIMEOUT,
    MAX_HEADER_SIZE,
    MAX_HEADERS,
    MAX_KEY_LEN,
    MAX_LIST_KEYS,
    MAX_SKEW,
    MAX_SMALL_BODY,
    READ_IDLE_TIMEOUT,
    WIRE_VERSION,
    AuthError,
    SecretError,
    Verifier,
    load_secret,
)

__all__ = ["PeerServer", "PeerServerError", "Handler", "MAX_CONNECTIONS", "MAX_PENDING", "AUTH_TIMEOUT",
           "KEEPALIVE_TIMEOUT"]

log = logging.getLogger("tierckpt.peer")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

#: bytes the server buffers per connection before it stops reading the socket
_READ_BUFSIZE = 4 << 20
#: seconds ``stop`` waits for requests in flight
_SHUTDOWN_TIMEOUT = 5.0
#: authenticated connections one source address may hold (every peer keeps a few: one per thread that talks
#: to it; agents on one host share its address)
MAX_CONNECTIONS = 512
#: connections whose first request has not authenticated yet, from every source together
MAX_PENDING = 1024
#: seconds a new connection has to deliver its first complete request head
AUTH_TIMEOUT = 10.0
#: seconds a connection may stay open without completing a request (idle, or dribbling its headers)
KEEPALIVE_TIMEOUT = 75.0
#: refusals logged per window before they are only counted
_LOG_BURST, _LOG_WINDOW = 1, 10.0
_KNOWN_METHODS = frozenset({"GET", "HEAD", "PUT", "POST", "DELETE", "OPTIONS", "PATCH"})
_METRIC_NAME_RE = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
#: where a request keeps the sender's node rank once authenticated (None when unsigned)
_AUTHED: Any = web.RequestKey("tierckpt_node", object) if hasattr(web, "RequestKey") else "tierckpt_node"


class _Gate(asyncio.Protocol):
    """One connection: the aiohttp handler it wraps, and where the server counts it (pending, then authenticated).

    Every transport callback goes straight to the handler; the gate only tells the server when the connection
    opens and closes, and from which source address.
    """

    __slots__ = ("inner", "server", "source", "transport", "authed", "closed", "timer")

    def __init__(self, server: "PeerServer", inner: asyncio.Protocol) -> None:
        self.server = server
        self.inner = inner
        self.source = "?"
        self.transport: asyncio.BaseTransport | None = None
        self.authed = False
        self.closed = False
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.source = str(peer[0]) if isinstance(peer, (tuple, list)) and peer else "?"
        self.server._arrive(self)
        self.inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server._leave(self)
        self.inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


class _HttpLog:
    """The logger aiohttp's connection handlers report to: a malformed request is counted and logged as one
    rate-limited line without its traceback; anything else goes to the peer log as it came."""

    def __init__(self, server: "PeerServer") -> None:
        self.server = server

    def _bad(self, args: tuple, kw: dict) -> bool:
        exc = kw.get("exc_info")
        if not isinstance(exc, HttpProcessingError):
            return False
        remote = args[1] if len(args) > 1 else "?"
        self.server._bad_requests += 1
        self.server._log_limited(f"malformed request from {remote}: {str(exc)[:200]}")
        return True

    def debug(self, *args: Any, **kw: Any) -> None:
        if not self._bad(args, kw):
            log.debug(*args, **kw)

    def exception(self, *args: Any, **kw: Any) -> None:
        if not self._bad(args, kw):
            log.exception(*args, **kw)

    def warning(self, *args: Any, **kw: Any) -> None:
        log.warning(*args, **kw)

    def error(self, *args: Any, **kw: Any) -> None:
        log.error(*args, **kw)

    def info(self, *args: Any, **kw: Any) -> None:
        log.info(*args, **kw)

    def isEnabledFor(self, level: int) -> bool:
        return log.isEnabledFor(level)


class PeerServerError(ValueError):
    """The peer server cannot be set up as asked (e.g. an unauthenticated public address)."""


def _layout_problem(path: str, digest: str) -> str:
    """Why the layout object in ``path`` is not the layout ``digest`` names ("" when it is)."""
    from tiers.layout import Layout

    try:
        with open(path, "rb") as f:
            Layout.from_bytes(f.read(), digest)
    except ManifestError as e:
        return str(e)
    return ""


def _is_loopback(host: str) -> bool:
    """True when every address ``host`` names is a loopback address."""
    host = (host or "").strip("[]")
    if not host:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    addrs = {info[4][0] for info in infos}
    return bool(addrs) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)


def _text(status: int, reason: str, **kw: Any) -> web.Response:
    return web.Response(status=status, text=reason.rstrip("\n") + "\n", **kw)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(int(v)) if float(v).is_integer() and abs(v) < 2**53 else repr(float(v))


class _Refused(Exception):
    """A request the server answers with an error status; ``response`` is that answer."""

    def __init__(self, response: web.Response) -> None:
        self.response = response


class PeerServer:
    """Serves a :class:`~tiers.memory.MemoryTier` to other nodes over HTTP/1.1 (see the module docstring).

    ``host``/``port``: where to listen (port 0 picks a free port; ``.port`` says
    which once started). ``secret``: the per-job secret; None is allowed only
    on a loopback address. ``node``: this node's rank, reported by health.
    ``ssl_context``: a server-side TLS context, or None for plain TCP.
    ``max_body``: largest accepted upload, bytes. ``on_put(key, size)``: called
    (and awaited if it returns an awaitable) after each published upload.
    ``extra_routes``: ``(method, path, handler)`` triples added to the
    application, behind the same authentication. ``metrics_cb()``: extra gauges
    ``{name: value}`` for ``/metrics``. ``max_skew``: seconds a signed
    timestamp may be off. ``read_timeout``: seconds an upload body may stall.
    ``handler_timeout``: seconds any other request may take, except those on
    ``long_paths``, which bound their own time. ``max_connections``:
    authenticated connections one source address may hold; a request past it
    is answered 503 (busy, which clients retry) and its connection closed.
    ``max_pending``: connections not yet authenticated, all sources together
    (past it the oldest of the source holding the most is closed);
    ``auth_timeout``: seconds a connection has to deliver its first request
    head. ``disk``: this node's disk tier, served read-only to the peers
    (None: its listing is empty). A client that dribbles its request is cut by the keep-alive timer
    (``keepalive_timeout`` seconds without a completed request).

    Call order: ``await start()`` once, then ``await stop()`` once. Raises
    :class:`PeerServerError` at construction when asked to listen on a
    non-loopback address without a secret.
    """

    def __init__(
        self,
        memory: MemoryTier,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        secret: bytes | None = None,
        node: int = 0,
        ssl_context: ssl.SSLContext | None = None,
        max_body: int = DEFAULT_MAX_BODY,
        on_put: Callable[[str, int], Any] | None = None,
        extra_routes: Iterable[tuple[str, str, Handler]] | None = None,
        metrics_cb: Callable[[], dict[str, float]] | None = None,
        health_extra: dict[str, Any] | None = None,
        max_skew: float = MAX_SKEW,
        read_timeout: float = READ_IDLE_TIMEOUT,
        handler_timeout: float = HANDLER_TIMEOUT,
        long_paths: Iterable[str] = (),
        max_connections: int = MAX_CONNECTIONS,
        keepalive_timeout: float = KEEPALIVE_TIMEOUT,
        max_pending: int = MAX_PENDING,
        auth_timeout: float = AUTH_TIMEOUT,
        disk: DiskTier | None = None,
    ) -> None:
        if not secret and not _is_loopback(host):
            raise PeerServerError(
                f"refusing to serve the memory tier on {host or 'every address'!s} without a secret: "
                "pass --secret-file (the same file on every node), or listen on 127.0.0.1"
            )
        if not 0 <= int(port) <= 65535:
            raise PeerServerError(f"port {port} is not in 0..65535")
        if max_body < 0:
            raise PeerServerError("max_body must be >= 0 bytes")
        if max_connections < 1 or max_pending < 1:
            raise PeerServerError("max_connections and max_pending must be >= 1")
        if not auth_timeout > 0:
            raise PeerServerError("auth_timeout must be > 0 seconds")
        self.max_connections = int(max_connections)
        self.max_pending = int(max_pending)
        self.auth_timeout = float(auth_timeout)
        #: connections not yet authenticated, by source address, oldest first
        self._pending: dict[str, dict[_Gate, None]] = {}
        self._pending_total = 0
        #: authenticated connections by source address
        self._authed: collections.Counter[str] = collections.Counter()
        #: the gate of each open connection, by its aiohttp handler (``request.protocol``)
        self._gates: dict[Any, _Gate] = {}
        self._evicted = 0
        self._bad_requests = 0
        self.keepalive_timeout = float(keepalive_timeout)
        self._listener: asyncio.AbstractServer | None = None
        self.memory = memory
        self.disk = disk
        self.host = host
        self.port = int(port)
        self.node = int(node)
        self.ssl_context = ssl_context
        self.max_body = int(max_body)
        self.on_put = on_put
        self.metrics_cb = metrics_cb
        #: more fields of the health answer (the agent's digest of its peers file)
        self.health_extra = dict(health_extra or {})
        self.read_timeout = float(read_timeout)
        self.handler_timeout = float(handler_timeout)
        #: extra routes that bound their own time (e.g. a replica pull) instead of ``handler_timeout``
        self.long_paths = frozenset(long_paths)
        self._verifier = Verifier(secret, max_skew=max_skew) if secret else None
        self._extra = list(extra_routes or ())
        self._runner: web.AppRunner | None = None
        # the server's own threads (folder walks, deletes, uploads' allocation): never shared with the
        # agent's outgoing calls, so serving cannot wait behind them
        self._pool = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="tierckpt-serve")
        self._held_cache: tuple[int, int] = (0, 0)
        self._held_at = -1e9
        # counters for /metrics; touched only on the event loop's thread
        self._requests: collections.Counter[tuple[str, str, int]] = collections.Counter()
        #: request body bytes (Content-Length) by route and method
        self._request_bytes: collections.Counter[tuple[str, str]] = collections.Counter()
        #: requests and their body bytes by signed sender node and route (which node sent what); one series
        #: per peer and route, so /metrics grows with the job's node count
        self._from_requests: collections.Counter[tuple[int, str]] = collections.Counter()
        self._from_bytes: collections.Counter[tuple[int, str]] = collections.Counter()
        self._refused_connections = 0
        self._auth_failures: collections.Counter[str] = collections.Counter()
        self._bytes_in = 0
        self._bytes_out = 0
        self._checksum_mismatches = 0
        self._aborted_uploads = 0
        self._errors = 0
        self._log_window = (0.0, 0, 0)  # window start, lines logged, lines suppressed
        self._app = self._build_app()

    @property
    def address(self) -> str:
        """``host:port`` as clients should dial it (the real port once started)."""
        host = self.host if ":" not in self.host else f"[{self.host}]"
        return f"{host}:{self.port}"

    def describe(self) -> str:
        scheme = "https" if self.ssl_context else "http"
        auth = "signed" if self._verifier else "unsigned, loopback only"
        return f"peer server {scheme}://{self.address} ({auth}) for {self.memory.root}"

    # -- lifecycle -------------------------------------------------------------------------
    def _build_app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware], client_max_size=MAX_SMALL_BODY)
        r = app.router
        r.add_route("GET", "/v1/health", self._health, name="health")
        r.add_route("GET", "/v1/list", self._list, name="list")
        obj = r.add_resource("/v1/o/{key:.+}", name="object")
        obj.add_route("GET", self._get)
        obj.add_route("HEAD", self._get)
        obj.add_route("PUT", self._put, expect_handler=self._expect_put)
        obj.add_route("DELETE", self._delete)
        self._object = obj
        r.add_route("GET", "/v1/disk/list", self._disk_list, name="disk-list")
        disk = r.add_resource("/v1/disk/o/{key:.+}", name="disk-object")
        disk.add_route("GET", self._disk_get)
        disk.add_route("HEAD", self._disk_get)
        self._disk_object = disk
        r.add_route("GET", "/metrics", self._metrics, name="metrics")
        for method, path, handler in self._extra:
            r.add_route(method, path, handler)
        app.on_response_prepare.append(self._count_response)
        return app

    async def start(self) -> None:
        """Bind and start serving; afterwards ``.port`` is the port really listened on."""
        if self._runner is not None:
            raise RuntimeError("PeerServer.start called twice")
        infos = socket.getaddrinfo(self.host or None, self.port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
        family, kind, proto, _, sockaddr = infos[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(sockaddr)
        except OSError as e:
            sock.close()
            raise OSError(e.errno, f"peer server cannot listen on {self.address}: {e.strerror}") from e
        self.port = sock.getsockname()[1]
        runner = web.AppRunner(
            self._app, handle_signals=False, access_log=None, shutdown_timeout=_SHUTDOWN_TIMEOUT,
            max_line_size=MAX_HEADER_SIZE, max_field_size=MAX_HEADER_SIZE, max_headers=MAX_HEADERS,
            read_bufsize=_READ_BUFSIZE, keepalive_timeout=self.keepalive_timeout, lingering_time=2.0,
            logger=_HttpLog(self),
        )
        await runner.setup()
        server = runner.server

        def protocol() -> asyncio.BaseProtocol:
            return _Gate(self, server())

        try:
            self._listener = await asyncio.get_running_loop().create_server(
                protocol, sock=sock, ssl=self.ssl_context, backlog=256)
        except BaseException:
            await runner.cleanup()
            sock.close()
            raise
        self._runner = runner
        log.info("%s: listening", self.describe())

    async def stop(self) -> None:
        """Stop listening and close connections (waiting briefly for requests in flight)."""
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def __aenter__(self) -> "PeerServer":
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    # -- connections: pending until a request on them authenticates -----------------------------------
    def _arrive(self, gate: _Gate) -> None:
        """A connection opened: it is pending; make room among the pending ones if there are too many."""
        self._gates[gate.inner] = gate
        self._pending.setdefault(gate.source, {})[gate] = None
        self._pending_total += 1
        gate.timer = asyncio.get_running_loop().call_later(self.auth_timeout, self._expire, gate)
        while self._pending_total > self.max_pending:
            # the oldest connection of the source holding the most: a flood only ever evicts its own
            order = sorted(self._pending, key=lambda src: len(self._pending[src]), reverse=True)
            victim = next((g for src in order for g in self._pending[src] if g is not gate), None)
            if victim is None:
                break
            self._drop(victim, f"{self._pending_total - 1} other connections were waiting to authenticate")

    def _expire(self, gate: _Gate) -> None:
        if not gate.authed and not gate.closed:
            self._drop(gate, f"no request authenticated within {self.auth_timeout:g} s")

    def _drop(self, gate: _Gate, why: str) -> None:
        """Close a pending connection now."""
        self._unpend(gate)
        gate.closed = True
        self._evicted += 1
        self._log_limited(f"closed a connection from {gate.source} before it authenticated: {why}")
        if gate.transport is not None:
            gate.transport.abort()

    def _unpend(self, gate: _Gate) -> None:
        queue = self._pending.get(gate.source)
        if queue is not None and queue.pop(gate, False) is None:
            self._pending_total -= 1
            if not queue:
                del self._pending[gate.source]
        if gate.timer is not None:
            gate.timer.cancel()
            gate.timer = None

    def _leave(self, gate: _Gate) -> None:
        """A connection closed (by either side)."""
        self._gates.pop(gate.inner, None)
        self._unpend(gate)
        gate.closed = True
        if gate.authed:
            gate.authed = False
            self._authed[gate.source] -= 1
            if self._authed[gate.source] <= 0:
                del self._authed[gate.source]

    def _admit(self, request: web.Request) -> web.Response | None:
        """The request authenticated: count its connection as its source's (None), or refuse it as busy."""
        gate = self._gates.get(request.protocol)
        if gate is None or gate.authed or gate.closed:
            return None
        self._unpend(gate)
        if self._authed[gate.source] >= self.max_connections:
            self._refused_connections += 1
            self._log_limited(f"{gate.source} holds {self.max_connections} connections: refused one more")
            refused = _text(503, "too many connections to this peer; retry shortly")
            refused.force_close()
            return refused
        gate.authed = True
        self._authed[gate.source] += 1
        return None

    # -- authentication, timeouts, errors ----------------------------------------------------
    def _authenticate(self, request: web.Request) -> web.Response | None:
        """None if the request may proceed, else the answer refusing it (its connection is then closed)."""
        if _AUTHED in request:
            return None
        if self._verifier is None:
            version = request.headers.get(H_VERSION)
            if version is not None and version != str(WIRE_VERSION):
                return _text(400, f"wire version {version[:16]!r} not supported (this node speaks {WIRE_VERSION})")
            request[_AUTHED] = None
            return self._admit(request)
        try:
            request[_AUTHED] = self._verifier.verify(request.method, request.path, request.query,
                                                     request.headers)
        except AuthError as e:
            self._auth_failures[e.reason] += 1
            self._log_refusal(request, str(e))
            refused = _text(401, str(e), headers={"WWW-Authenticate": "Tierckpt"})
            refused.force_close()
            return refused
        return self._admit(request)

    def _log_refusal(self, request: web.Request, reason: str) -> None:
        peer = request.remote or "?"
        self._log_limited(f"refused {request.method} {request.path[:200]} from {peer}: {reason}")

    def _log_limited(self, line: str) -> None:
        """Log ``line`` unless ``_LOG_BURST`` lines were logged in this window; count it then, and say how many."""
        now = time.monotonic()
        start, logged, suppressed = self._log_window
        if now - start > _LOG_WINDOW:
            if suppressed:
                log.warning("%d more refused or malformed requests and connections in the last %.0f s",
                            suppressed, _LOG_WINDOW)
            start, logged, suppressed = now, 0, 0
        if logged < _LOG_BURST:
            log.warning("%s", line)
            logged += 1
        else:
            suppressed += 1
        self._log_window = (start, logged, suppressed)

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path != "/metrics":
            refused = self._authenticate(request)
            if refused is not None:
                return refused
        elif not getattr(self._gates.get(request.protocol), "authed", True):
            # an unauthenticated scrape leaves nothing open behind it
            response = await handler(request)
            response.force_close()
            return response
        try:
            resource = request.match_info.route.resource
            if (request.method == "PUT" and resource is self._object) or resource is self._disk_object \
                    or request.path in self.long_paths:
                # an upload bounds its own reads (idle timeout per piece), not its total time; a compressed
                # object from disk is streamed by the handler, paced by the reader
                return await handler(request)
            return await asyncio.wait_for(handler(request), self.handler_timeout)
        except _Refused as e:
            return e.response
        except web.HTTPException:
            raise
        except asyncio.TimeoutError:
            self._errors += 1
            log.warning("%s %s took longer than %.0f s: answered 503", request.method, request.path[:200],
                        self.handler_timeout)
            return _text(503, f"request took longer than {self.handler_timeout:.0f} s")
        except Exception:
            self._errors += 1
            log.exception("peer server failed on %s %s", request.method, request.path[:200])
            return _text(500, "internal error (see the peer's log)")

    async def _count_response(self, request: web.Request, response: web.StreamResponse) -> None:
        try:
            resource = request.match_info.route.resource
        except (AttributeError, RuntimeError):
            resource = None
        route = (resource.name or resource.canonical) if resource is not None else "none"
        method = request.method if request.method in _KNOWN_METHODS else "other"
        self._requests[(route, method, response.status)] += 1
        if request.method != "HEAD" and response.content_length:
            self._bytes_out += response.content_length
        body = request.content_length or 0
        self._request_bytes[(route, method)] += body
        sender = request.get(_AUTHED)
        if sender is not None:
            self._from_requests[(sender, route)] += 1
            self._from_bytes[(sender, route)] += body

    # -- keys ------------------------------------------------------------------------------
    def _key(self, request: web.Request, *, index: bool = False) -> str:
        """The request's key: a shard, manifest or layout key, or (``index``, reads only) a job's step index."""
        key = request.match_info["key"]
        if index and keys.parse_index_key(key) is not None:
            return key
        try:
            ok = len(key) <= MAX_KEY_LEN and (keys.parse_key(key) is not None or keys.parse_layout_key(key) is not None) \
                and bool(self.memory.path(key))
        except KeyNotFoundError:
            ok = False  # a name the memory folder refuses (dot-files are private to it)
        if not ok:
            raise _Refused(_text(400, f"invalid key {key[:MAX_KEY_LEN]!r}: expected <job>/step-<N>/rank-<R>.shard, "
                                      "<job>/step-<N>/manifest.json or <job>/layouts/<digest>.layout"))
        return key

    # -- routes ----------------------------------------------------------------------------
    def _held(self) -> tuple[int, int]:
        total = count = 0
        for key in self.memory.list():
            with contextlib.suppress(OSError):
                total += os.stat(self.memory.path(key)).st_size
                count += 1
        return total, count

    async def held_bytes(self, fresh: bool = False) -> tuple[int, int]:
        """Bytes and objects this node's memory holds, from a walk of its folder at most a second old (now,
        with ``fresh``)."""
        # heartbeats come every second from several peers: the walk of the memory folder is shared for a second
        now = time.monotonic()
        if fresh or now - self._held_at > 1.0:
            self._held_cache = await asyncio.get_running_loop().run_in_executor(self._pool, self._held)
            self._held_at = now
        return self._held_cache

    async def _health(self, request: web.Request) -> web.Response:
        held, count = await self.held_bytes()
        return web.json_response({"node": self.node, "version": WIRE_VERSION, "time": time.time(),
                                  "bytes_held": held, "objects": count, **self.health_extra})

    @staticmethod
    def _page(listed: Iterable[str], size_of: Callable[[str], int], after: str) -> tuple[list[list[Any]], bool]:
        """Up to MAX_LIST_KEYS ``[key, size]`` of the shard and layout keys in ``listed`` after ``after``, and
        whether more follow."""
        entries: list[list[Any]] = []
        for key in listed:
            if key <= after or (keys.parse_key(key) is None and keys.parse_layout_key(key) is None):
                continue
            try:
                size = size_of(key)
            except (OSError, TierError):
                continue  # deleted (or unreadable) since it was listed
            if len(entries) == MAX_LIST_KEYS:
                return entries, True
            entries.append([key, size])
        return entries, False

    def _scan(self, prefix: str, after: str) -> tuple[list[list[Any]], bool]:
        return self._page(self.memory.list(prefix), lambda key: os.stat(self.memory.path(key)).st_size, after)

    async def _list(self, request: web.Request) -> web.Response:
        return await self._listing(request, self._scan)

    async def _listing(self, request: web.Request, scan: Any) -> web.Response:
        """One page of ``scan(prefix, after)``'s keys and sizes (none when ``scan`` is None), run off the loop."""
        prefix = request.query.get("prefix", "")
        after = request.query.get("after", "")
        for name, value in (("prefix", prefix), ("after", after)):
            if len(value) > MAX_KEY_LEN or "\0" in value:
                return _text(400, f"invalid {name} {value[:64]!r}")
        if scan is None:
            return web.json_response([], headers={H_MORE: "0"})
        entries, more = await asyncio.get_running_loop().run_in_executor(self._pool, scan, prefix, after)
        return web.json_response(entries, headers={H_MORE: "1" if more else "0"})

    async def _get(self, request: web.Request) -> web.StreamResponse:
        key = self._key(request, index=True)
        resp = self._file_response(request, key, self.memory.path(key))
        return resp if resp is not None else _text(404, f"{key} is not held by node {self.node}")

    def _file_response(self, request: web.Request, key: str, path: str) -> web.StreamResponse | None:
        """The file ``path`` as ``key``'s answer (ranged, or 416 for a Range it cannot serve); None when there is
        no such regular file."""
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        if not stat.S_ISREG(st.st_mode):
            return None
        refused = self._range_problem(request, key, st.st_size)
        if refused is not None:
            return refused
        # the file is opened once by FileResponse, so an overwrite racing the send cannot tear it
        return web.FileResponse(path, headers={H_MTIME: repr(st.st_mtime)})

    @staticmethod
    def _range_problem(request: web.Request, key: str, size: int) -> web.Response | None:
        """The 416 answer, with its reason, for a Range the object cannot serve (None when it can, or when
        there is none). The same judgement as the file response's, which would refuse with an empty body."""
        if "Range" not in request.headers or request.if_range is not None:
            return None
        unsatisfied = {"Content-Range": f"bytes */{size}"}
        try:
            rng = request.http_range
        except ValueError as e:
            return _text(416, f"unusable Range {request.headers['Range'][:80]!r} ({e}): send bytes=FIRST-LAST",
                         headers=unsatisfied)
        if rng.start is not None and rng.start >= 0 and rng.start >= size:
            return _text(416, f"Range starts at byte {rng.start}, past the end of {key} ({size} bytes)",
                         headers=unsatisfied)
        return None

    # -- the disk tier, read-only ---------------------------------------------------------
    def _disk_key(self, request: web.Request) -> str:
        """The request's key, a shard, manifest, layout or step-index key the disk folder can hold."""
        key = request.match_info["key"]
        ok = len(key) <= MAX_KEY_LEN and (keys.parse_key(key) is not None or keys.parse_layout_key(key) is not None
                                         or keys.parse_index_key(key) is not None)
        if ok and self.disk is not None:
            try:
                self.disk.path(key)
            except KeyNotFoundError:
                ok = False
        if not ok:
            raise _Refused(_text(400, f"invalid key {key[:MAX_KEY_LEN]!r}: expected <job>/step-<N>/rank-<R>.shard, "
                                      "<job>/step-<N>/manifest.json or <job>/layouts/<digest>.layout"))
        return key

    def _disk_scan(self, prefix: str, after: str) -> tuple[list[list[Any]], bool]:
        disk = self.disk
        assert disk is not None
        return self._page(disk.list(prefix), lambda key: disk.stat(key).size, after)

    async def _disk_list(self, request: web.Request) -> web.Response:
        return await self._listing(request, self._disk_scan if self.disk is not None else None)

    async def _disk_get(self, request: web.Request) -> web.StreamResponse:
        key = self._disk_key(request)
        loop = asyncio.get_running_loop()
        if self.disk is None:
            return _text(404, f"{key}: node {self.node} has no disk tier")
        plain = await loop.run_in_executor(self._pool, self.disk.local_file, key)
        resp = None if plain is None else self._file_response(request, key, plain)
        if resp is not None:
            return resp
        try:
            info = await loop.run_in_executor(self._pool, self.disk.stat, key)
        except KeyNotFoundError:
            return _text(404, f"{key} is not on node {self.node}'s disk")
        return await self._disk_stream(request, key, info.size, info.mtime)

    async def _disk_stream(self, request: web.Request, key: str, size: int, mtime: float) -> web.StreamResponse:
        """A compressed disk object, decompressed piece by piece (a Range is honoured as a file's is)."""
        assert self.disk is not None
        refused = self._range_problem(request, key, size)
        if refused is not None:
            return refused
        start, stop = 0, size
        if "Range" in request.headers and request.if_range is None:
            rng = request.http_range
            if rng.start is not None and rng.start < 0:
                start = max(0, size + rng.start)
            else:
                start = rng.start or 0
                stop = size if rng.stop is None else min(size, rng.stop)
        partial = (start, stop) != (0, size)
        headers = {H_MTIME: repr(mtime), "Content-Length": str(stop - start), "Accept-Ranges": "bytes"}
        if partial:
            headers["Content-Range"] = f"bytes {start}-{stop - 1}/{size}"
        resp = web.StreamResponse(status=206 if partial else 200, headers=headers)
        await resp.prepare(request)
        if request.method == "HEAD":
            return resp
        loop = asyncio.get_running_loop()
        f = await loop.run_in_executor(self._pool, self.disk.reader, key, start)
        try:
            left = stop - start
            while left:
                data = await loop.run_in_executor(self._pool, f.read, min(8 << 20, left))
                if not data:
                    # shorter than its size said (replaced meanwhile): the client sees a short body
                    raise ConnectionResetError(f"{key} changed while it was sent")
                await resp.write(data)
                left -= len(data)
        finally:
            f.close()
        await resp.write_eof()
        return resp

    async def _delete(self, request: web.Request) -> web.Response:
        key = self._key(request)
        await asyncio.get_running_loop().run_in_executor(self._pool, self._delete_key, key)
        return web.Response(status=204)

    def _delete_key(self, key: str) -> None:
        info = keys.parse_key(key)
        if info is not None and info.is_manifest:  # the step index never names a step whose manifest is gone
            step_index.note_delete(self.memory, info.job, info.step)
        self.memory.delete(key)
        if info is not None and info.is_manifest:
            step_index.note_delete(self.memory, info.job, info.step)

    def _check_upload(self, request: web.Request, key: str) -> tuple[int, str | None]:
        """The upload's size and expected checksum, or raise _Refused before any body is read."""
        if request.headers.get("Transfer-Encoding"):
            raise _Refused(_text(411, "send a Content-Length, not a chunked body"))
        size = request.content_length
        if size is None:
            raise _Refused(_text(411, "Content-Length required"))
        if size > self.max_body:
            raise _Refused(_text(413, f"{key}: {size} bytes is more than this node accepts ({self.max_body})"))
        checksum = request.headers.get(H_CHECKSUM)
        info = keys.parse_key(key)
        if checksum is None and info is not None and not info.is_manifest:
            raise _Refused(_text(400, f"{H_CHECKSUM} required for shard uploads"))
        if checksum is not None and not CHECKSUM_RE.match(checksum):
            raise _Refused(_text(400, f"malformed {H_CHECKSUM} {checksum[:80]!r}"))
        try:
            vfs = os.statvfs(self.memory.root)
        except OSError:
            vfs = None
        if vfs is not None and size > vfs.f_bavail * vfs.f_frsize:
            raise _Refused(_text(507, f"no room for {size} bytes in {self.memory.root} on node {self.node}"))
        return size, checksum

    async def _expect_put(self, request: web.Request) -> web.StreamResponse | None:
        """Answer ``Expect: 100-continue``: refuse now, or ask for the body."""
        if request.headers.get("Expect", "").lower() != "100-continue":
            return _text(417, "only 'Expect: 100-continue' is understood")
        try:
            refused = self._authenticate(request)
            if refused is None:
                self._check_upload(request, self._key(request))
        except _Refused as e:
            refused = e.response
        if refused is not None:
            # the client will not send the body it announced, so this connection is spent
            refused.force_close()
            return refused
        if request.version >= (1, 1):
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        return None

    async def _put(self, request: web.Request) -> web.Response:
        key = self._key(request)
        size, expected = self._check_upload(request, key)
        loop = asyncio.get_running_loop()
        path = self.memory.path(key)
        folder = os.path.dirname(path)
        tmp: str | None = os.path.join(folder, f".tmp-peer-{uuid.uuid4().hex}")
        fd: int | None = None
        try:
            os.makedirs(folder, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            if size:
                # claim the memory up front: a full tmpfs fails here, not after the transfer
                await loop.run_in_executor(self._pool, os.posix_fallocate, fd, 0, size)
            hasher = Hasher()
            done = 0
            while done < size:
                try:
                    # one buffered piece at a time: readany() would first join them into a copy
                    chunk, _ = await asyncio.wait_for(request.content.readchunk(), self.read_timeout)
                except asyncio.TimeoutError:
                    self._aborted_uploads += 1
                    return _text(408, f"{key}: body stalled for {self.read_timeout:.0f} s after {done} of {size} bytes")
                except Exception as e:  # the connection broke; the client sees nothing either way
                    self._aborted_uploads += 1
                    log.info("upload of %s from %s broke after %d of %d bytes: %s",
                             key, request.remote, done, size, e)
                    return _text(400, f"{key}: body ended after {done} of {size} bytes")
                if not chunk:
                    self._aborted_uploads += 1
                    log.info("upload of %s from %s ended after %d of %d bytes", key, request.remote, done, size)
                    return _text(400, f"{key}: body ended after {done} of {size} bytes")
                hasher.update(chunk)
                view = memoryview(chunk)
                while view:
                    n = os.pwrite(fd, view, done)
                    view = view[n:]
                    done += n
            got = hasher.hexdigest()
            if expected is not None and got != expected:
                self._checksum_mismatches += 1
                log.warning("upload of %s from %s: checksum %s, header said %s; not stored",
                            key, request.remote, got, expected)
                return _text(422, f"{key}: body checksum {got} does not match {H_CHECKSUM} {expected}")
            os.close(fd)
            fd = None
            lay = keys.parse_layout_key(key)
            if lay is not None:
                # a layout names itself: one that does not match its digest is never stored
                problem = await loop.run_in_executor(self._pool, _layout_problem, tmp, lay[1])
                if problem:
                    self._checksum_mismatches += 1
                    return _text(422, f"{key}: {problem}")
            os.rename(tmp, path)
            tmp = None
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.ENOMEM):
                return _text(507, f"no room for {size} bytes in {self.memory.root} on node {self.node}")
            raise
        finally:
            if fd is not None:
                os.close(fd)
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
        self._bytes_in += size
        if self.on_put is not None:
            try:
                result = self.on_put(key, size)
                if inspect.isawaitable(result):
                    await result
            except Exception:
                log.exception("on_put callback failed for %s (the object is stored)", key)
        return web.json_response({"key": key, "size": size, "checksum": got}, status=201)

    async def _metrics(self, request: web.Request) -> web.Response:
        lines = [
            "# HELP tierckpt_peer_requests_total Requests answered, by route, method and status.",
            "# TYPE tierckpt_peer_requests_total counter",
        ]
        for (route, method, status), n in sorted(self._requests.items()):
            lines.append(f'tierckpt_peer_requests_total{{route="{_label(route)}",method="{method}",'
                         f'status="{status}"}} {n}')
        lines += [
            "# HELP tierckpt_peer_request_bytes_total Request body bytes (Content-Length) of requests answered, "
            "by route and method.",
            "# TYPE tierckpt_peer_request_bytes_total counter",
        ]
        for (route, method), n in sorted(self._request_bytes.items()):
            lines.append(f'tierckpt_peer_request_bytes_total{{route="{_label(route)}",method="{method}"}} {n}')
        lines += [
            "# HELP tierckpt_peer_sender_requests_total Signed requests answered, by sender node and route.",
            "# TYPE tierckpt_peer_sender_requests_total counter",
        ]
        for (node, route), n in sorted(self._from_requests.items()):
            lines.append(f'tierckpt_peer_sender_requests_total{{node="{node}",route="{_label(route)}"}} {n}')
        lines += [
            "# HELP tierckpt_peer_sender_bytes_total Request body bytes of signed requests answered, by sender "
            "node and route.",
            "# TYPE tierckpt_peer_sender_bytes_total counter",
        ]
        for (node, route), n in sorted(self._from_bytes.items()):
            lines.append(f'tierckpt_peer_sender_bytes_total{{node="{node}",route="{_label(route)}"}} {n}')
        lines += [
            "# HELP tierckpt_peer_auth_failures_total Requests refused for failed authentication, by reason.",
            "# TYPE tierckpt_peer_auth_failures_total counter",
        ]
        for reason in ("missing", "version", "malformed", "skew", "signature", "replay", "busy"):
            lines.append(f'tierckpt_peer_auth_failures_total{{reason="{reason}"}} {self._auth_failures[reason]}')
        lines += [
            "# HELP tierckpt_peer_connections Open connections: authenticated, or pending (no request on them "
            "authenticated yet).",
            "# TYPE tierckpt_peer_connections gauge",
            f'tierckpt_peer_connections{{state="authenticated"}} {sum(self._authed.values())}',
            f'tierckpt_peer_connections{{state="pending"}} {self._pending_total}',
        ]
        for name, help_, value in (
            ("tierckpt_peer_bytes_in_total", "Bytes of uploads received and published.", self._bytes_in),
            ("tierckpt_peer_bytes_out_total", "Bytes of response bodies sent.", self._bytes_out),
            ("tierckpt_peer_checksum_mismatches_total", "Uploads refused because the body did not match "
                                                        "its checksum.", self._checksum_mismatches),
            ("tierckpt_peer_aborted_uploads_total", "Uploads whose body stalled or ended early.",
             self._aborted_uploads),
            ("tierckpt_peer_errors_total", "Requests that failed inside the server (500/503).", self._errors),
            ("tierckpt_peer_connections_refused_total", "Requests whose source already held max_connections "
                                                        "authenticated connections, answered 503 and closed.",
             self._refused_connections),
            ("tierckpt_peer_connections_evicted_total", "Connections closed before a request on them "
                                                        "authenticated: past auth_timeout, or over max_pending.",
             self._evicted),
            ("tierckpt_peer_bad_requests_total", "Malformed requests (not HTTP, or breaking its limits), "
                                                 "answered 400 by the HTTP layer.", self._bad_requests),
        ):
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} counter", f"{name} {value}"]
        if self.metrics_cb is not None:
            try:
                extra = dict(self.metrics_cb())
            except Exception:
                log.exception("metrics callback failed")
                extra = {}
            for name, value in sorted(extra.items()):
                try:
                    number = float(value)
                except (TypeError, ValueError):
                    continue
                if isinstance(name, str) and _METRIC_NAME_RE.match(name):
                    lines += [f"# TYPE {name} gauge", f"{name} {_number(number)}"]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain",
                            headers={"X-Content-Type-Options": "nosniff"}, charset="utf-8")


# -- by hand -----------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """Serve a memory folder until SIGINT/SIGTERM; prints ``listening on HOST:PORT`` once ready."""
    p = argparse.ArgumentParser(prog="python -m agents.peer_server", description=main.__doc__)
    p.add_argument("--root", required=True, help="memory tier folder to serve")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port")
    p.add_argument("--node", type=int, default=0, help="this node's rank")
    p.add_argument("--secret-file", default=os.environ.get("CKPT_SECRET_FILE") or None)
    p.add_argument("--max-body", type=int, default=DEFAULT_MAX_BODY, help="largest upload, bytes")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        secret = load_secret(args.secret_file) if args.secret_file else None
    except SecretError as e:
        print(f"error: {e}", flush=True)
        return 2

    async def serve() -> None:
        server = PeerServer(MemoryTier(args.root), host=args.host, port=args.port, secret=secret,
                            node=args.node, max_body=args.max_body)
        await server.start()
        print(f"listening on {server.address}", flush=True)
        done = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, done.set)
        try:
            await done.wait()
        finally:
            await server.stop()

    try:
        asyncio.run(serve())
    except PeerServerError as e:
        print(f"error: {e}", flush=True)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
