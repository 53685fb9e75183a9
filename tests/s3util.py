"""Test helpers for S3: a real moto S3 server process and a TCP proxy that can fail on demand.

    proc, url = start_moto_server()          # http://127.0.0.1:<port>
    with FaultProxy(url) as proxy:           # proxy.url forwards to the server
        proxy.down()                         # refuse new connections, cut open ones
        proxy.up()
        proxy.fail_next(3, 503, "SlowDown")  # next 3 connections answer one S3 error each
    stop_moto_server(proc)
"""

from __future__ import annotations

import os
import random
import re
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit

__all__ = ["FAKE_AWS_ENV", "free_port", "start_moto_server", "stop_moto_server", "FaultProxy", "server_log_size",
           "server_requests"]

#: credentials and region for a fake endpoint; nothing here can reach real AWS
FAKE_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


_handed_out: set[int] = set()
_ports = random.Random(os.getpid() ^ time.monotonic_ns())


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, for a server a test starts later.

    A port the kernel picks for ``bind(0)`` lies in the ephemeral range, where any outgoing connection (a boto3
    client to moto, one agent to another) may take it as its source port before the server binds it: the server
    then fails with "address in use". So the port is drawn below the ephemeral range, where only listeners go,
    and never handed out twice by this process.
    """
    lo, _ = _ephemeral_range()
    if lo > 11000:
        for _ in range(200):
            port = _ports.randrange(10000, lo)
            if port in _handed_out:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _handed_out.add(port)
            return port
    with socket.socket() as s:  # no room below the ephemeral range: the kernel's pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers_http(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1):
            return True
    except urllib.error.HTTPError:
        return True  # any HTTP answer means the server is up
    except OSError:
        return False


def start_moto_server(timeout: float = 30.0) -> tuple[subprocess.Popen, str]:
    """Start ``python -m moto.server`` on a free local port; return the process and its URL.

    Raises RuntimeError (with the server's log) if it does not answer within ``timeout`` seconds.
    """
    for _ in range(3):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log = tempfile.TemporaryFile()
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
        proc.log = log  # type: ignore[attr-defined]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            if _answers_http(url):
                return proc, url
            time.sleep(0.05)
        stop_moto_server(proc)
        log.seek(0)
        output = log.read().decode(errors="replace")[-2000:]
        log.close()
        if "Address already in use" not in output:
            raise RuntimeError(f"moto server on port {port} did not start:\n{output}")
    raise RuntimeError("moto server could not find a free port")


def stop_moto_server(proc: subprocess.Popen) -> None:
    """Terminate the server started by :func:`start_moto_server` and wait for it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    log = getattr(proc, "log", None)
    if log is not None and not log.closed:
        log.close()


def server_log_size(proc: subprocess.Popen) -> int:
    """Where the request log of a server from :func:`start_moto_server` ends now (for :func:`server_requests`)."""
    return os.fstat(proc.log.fileno()).st_size


def server_requests(proc: subprocess.Popen, since: int, settle: float = 0.3) -> dict[str, int]:
    """Requests the server logged after byte ``since`` of its log, by kind: GET, HEAD, PUT, DELETE, POST, or
    LIST (a bucket listing), after ``settle`` seconds for the log to catch up."""
    time.sleep(settle)
    proc.log.seek(since)
    out: dict[str, int] = {}
    for line in proc.log.read().decode(errors="replace").splitlines():
        line = re.sub(r"\x1b\[[0-9;]*m", "", line)  # the server colours some status lines
        m = re.search(r'"(GET|HEAD|PUT|DELETE|POST) /[^ ]*?(\?list-type=2[^ ]*)? HTTP', line)
        if m:
            kind = "LIST" if m.group(2) else m.group(1)
            out[kind] = out.get(kind, 0) + 1
    proc.log.seek(0, os.SEEK_END)
    return out


def _reset(sock: socket.socket) -> None:
    """Close ``sock`` with a TCP RST rather than a FIN."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    try:
        sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv on it
    except OSError:
        pass
    sock.close()


class FaultProxy:
    """A TCP proxy on 127.0.0.1 in front of ``target_url`` that can be taken down and up.

    ``down()``: new connections are accepted and reset at once, open ones are cut.
    ``up()``: connections are forwarded again.
    ``fail_next(n, status, code)``: the next ``n`` connections each read one
    request and answer it with an S3 error (``Connection: close``).
    ``connections``: how many connections were accepted so far.
    ``rate``: bytes/s each connection is paced to in each direction (None: as fast as it goes).
    """

    def __init__(self, target_url: str, rate: float | None = None) -> None:
        self.rate = rate
        t = urlsplit(target_url)
        self._target = (t.hostname or "127.0.0.1", t.port or 80)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._down = False
        self._failures: list[tuple[int, str]] = []
        self._stop = threading.Event()
        self.connections = 0
        self._thread = threading.Thread(target=self._serve, name="fault-proxy", daemon=True)
        self._thread.start()

    # -- control ------------------------------------------------------------------
    def down(self) -> None:
        with self._lock:
            self._down = True
            victims, self._open = self._open, set()
        for s in victims:
            _reset(s)

    def up(self) -> None:
        with self._lock:
            self._down = False

    def fail_next(self, n: int, status: int = 503, code: str = "SlowDown") -> None:
        with self._lock:
            self._failures.extend([(status, code)] * n)
            victims, self._open = self._open, set()
        # kept-alive connections would bypass the failures: make clients open new ones
        for s in victims:
            _reset(s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._listener.close()
        self.down()

    def __enter__(self) -> "FaultProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- forwarding -----------------------------------------------------------------
    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except (socket.timeout, TimeoutError):
                continue
            except OSError:
                return
            with self._lock:
                self.connections += 1
                down = self._down
                failure = self._failures.pop(0) if self._failures and not down else None
            if down:
                _reset(client)
            elif failure:
                threading.Thread(target=self._answer_error, args=(client, *failure), daemon=True).start()
            else:
                threading.Thread(target=self._connect, args=(client,), daemon=True).start()

    def _connect(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self._target, timeout=5)
            upstream.settimeout(None)
        except OSError:
            _reset(client)
            return
        with self._lock:
            if self._down:
                _reset(client)
                upstream.close()
                return
            self._open.update((client, upstream))
        threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()
        self._pump(upstream, client)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(64 * 1024 if self.rate else 256 * 1024)
                if not data:
                    break
                dst.sendall(data)
                if self.rate:
                    time.sleep(len(data) / self.rate)
        except OSError:
            pass
        with self._lock:
            mine = src in self._open or dst in self._open
            self._open.discard(src)
            self._open.discard(dst)
        if mine:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    @staticmethod
    def _answer_error(client: socket.socket, status: int, code: str) -> None:
        try:
            client.settimeout(5)
            head = b""
            while b"\r\n\r\n" not in head:
                data = client.recv(65536)
                if not data:
                    return
                head += data
            header, _, rest = head.partition(b"\r\n\r\n")
            length, expect = 0, False
            for line in header.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"content-length":
                    length = int(value.strip())
                elif name == b"expect" and value.strip().lower() == b"100-continue":
                    expect = True
            # drain the body so the client reads our answer rather than a reset; a client
            # waiting for "100 Continue" sends none and takes the answer instead
            remaining = 0 if expect else length - len(rest)
            while remaining > 0:
                data = client.recv(min(remaining, 1 << 20))
                if not data:
                    return
                remaining -= len(data)
            body = (
                f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
                f"<Message>injected {code}</Message><RequestId>fault</RequestId></Error>"
            ).encode()
            client.sendall(
                f"HTTP/1.1 {status} {code}\r\nContent-Type: application/xml\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body
            )
        except OSError:
            pass
        finally:
            client.close()
