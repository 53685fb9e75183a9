"""The peer tier against a real PeerServer on 127.0.0.1.

The server runs on its own event loop in a background thread of the test
process (``ServerThread``), serving a MemoryTier in the test's temp folder.
The tier conformance suite runs here unchanged against a PeerTier that points
at it; the rest pins down what only the peer tier does: sendfile uploads,
bandwidth caps, checksum refusals, health, paging, TLS.
"""

from __future__ import annotations

import asyncio
import datetime
import http.client
import ipaddress
import os
import random
import socket
import ssl
import threading
import time

import pytest

import tiers.peer
from agents import peer_server as peer_server_module
from agents.peer_server import PeerServer, PeerServerError
from tiers import (
    ChecksumMismatchError,
    KeyNotFoundError,
    MemoryTier,
    TierError,
    TierUnavailableError,
    manifest_key,
    shard_key,
)
from tiers.peer import PeerTier, parse_addr
from tiers.wire import TokenBucket

# The conformance suite, collected here against the ``tier`` fixture below.
from test_tier_conformance import (  # noqa: F401
    test_concurrent_puts_and_gets_from_threads,
    test_delete_is_idempotent,
    test_keys_that_could_escape_are_refused,
    test_large_object_round_trips_bit_exact,
    test_list_never_shows_temp_files,
    test_list_returns_sorted_keys_under_a_prefix,
    test_missing_key_raises_key_not_found,
    test_overwrite_replaces_the_whole_object,
    test_put_then_get_returns_the_same_bytes,
    test_read_into_and_ranged_get_at_offsets,
    test_readers_never_see_a_torn_overwrite,
    test_reads_past_the_end_raise,
    test_stat_reports_size_and_mtime,
)

SECRET = b"test-secret-0123456789abcdef"
MiB = 1 << 20


class ServerThread:
    """A PeerServer running on its own event loop in a daemon thread."""

    def __init__(self, server: PeerServer) -> None:
        self.server = server
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="peer-server", daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self.server.start())
        except BaseException as e:  # handed to start() below
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self.server.stop())
        self.loop.close()

    def start(self) -> "ServerThread":
        self._thread.start()
        assert self._ready.wait(15), "peer server did not start"
        if self._error is not None:
            raise self._error
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(15)

    def alive(self) -> bool:
        return self._thread.is_alive()


def start_peer_server(root, secret: bytes | None = None, **kw):
    """Start a server for a MemoryTier at ``root``; return ``(ServerThread, addr, memory)``."""
    memory = MemoryTier(root)
    server = PeerServer(memory, host=kw.pop("host", "127.0.0.1"), port=0, secret=secret,
                        node=kw.pop("node", 1), **kw)
    thread = ServerThread(server).start()
    return thread, server.address, memory


@pytest.fixture
def peer_server(tmp_path):
    """``start(secret=None, root=tmp_path/'shm', **PeerServer kwargs) -> (server, addr, memory)``."""
    threads: list[ServerThread] = []

    def start(secret: bytes | None = None, root=None, **kw):
        thread, addr, memory = start_peer_server(root or tmp_path / "shm", secret, **kw)
        threads.append(thread)
        return thread.server, addr, memory

    yield start
    for t in reversed(threads):
        t.stop()


@pytest.fixture(params=["signed", "unsigned"])
def tier(request, peer_server):
    secret = SECRET if request.param == "signed" else None
    server, addr, memory = peer_server(secret)
    t = PeerTier(addr, secret=secret, node=0, timeout=10)
    # the conformance helpers look for stored files below ``tier.root``: the server's memory folder
    t.root = memory.root
    yield t
    t.close()


def payload(size: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)


def temp_files(memory: MemoryTier) -> list[str]:
    found = []
    for folder, _, files in os.walk(memory.root):
        found += [os.path.join(folder, f) for f in files if f.startswith(".tmp-")]
    return found


# -- what only the peer tier does ------------------------------------------------------------
def test_a_ranged_get_is_answered_206_with_its_content_range(peer_server):
    _, addr, memory = peer_server()
    key = shard_key("job", 1, 0)
    data = payload(100_000, seed=4)
    memory.put(key, data)
    host, port = parse_addr(addr)
    conn = http.client.HTTPConnection(host, port, timeout=10)
    conn.request("GET", f"/v1/o/{key}", headers={"Range": "bytes=10-19"})
    resp = conn.getresponse()
    assert resp.status == 206
    assert resp.getheader("Content-Range") == f"bytes 10-19/{len(data)}"
    assert resp.read() == data[10:20]
    conn.request("GET", f"/v1/o/{key}")
    resp = conn.getresponse()
    assert (resp.status, resp.read()) == (200, data)
    conn.close()


def test_read_ranges_fills_contiguous_pieces_with_one_request_and_refuses_gaps(peer_server):
    _, addr, memory = peer_server(SECRET)
    key = shard_key("job", 2, 0)
    data = payload(3_000_000, seed=5)
    memory.put(key, data)
    t = PeerTier(addr, secret=SECRET, node=0, timeout=10)
    sizes = [1, 7, 0, 1 << 20, 123_457, 2]
    bufs = [bytearray(n) for n in sizes]
    pieces, at = [], 1000
    for b in bufs:
        pieces.append((at, memoryview(b)))
        at += len(b)
    assert t.read_ranges(key, pieces) == at - 1000
    assert b"".join(bufs) == data[1000:at]
    with pytest.raises(ValueError, match="not contiguous"):
        t.read_ranges(key, [(0, memoryview(bytearray(4))), (5, memoryview(bytearray(4)))])
    with pytest.raises(TierError):
        t.read_ranges(key, [(len(data) - 2, memoryview(bytearray(4)))])  # past the end
    t.close()


def test_a_64_mib_put_from_a_file_goes_by_sendfile_and_reads_back_bit_exact(peer_server, tmp_path, monkeypatch):
    _, addr, memory = peer_server(SECRET)
    data = os.urandom(64 * MiB)
    src = tmp_path / "slot-0"
    src.write_bytes(data)
    sent = []
    real = socket.socket.sendfile

    def spy(self, file, offset=0, count=None):
        n = real(self, file, offset, count)
        sent.append(n)
        return n

    monkeypatch.setattr(socket.socket, "sendfile", spy)
    key = shard_key("big", 2, 3)
    with PeerTier(addr, secret=SECRET, node=0) as t:
        assert t.put(key, str(src)) == len(data)
        assert sum(sent) == len(data), "the body should go out through socket.sendfile"
        assert memory.get(key) == data
        buf = bytearray(len(data))
        assert t.read_into(key, memoryview(buf)) == len(data)
        assert buf == data
        part = bytearray(MiB)
        t.read_into(key, memoryview(part), 33 * MiB + 7)
        assert part == data[33 * MiB + 7 : 34 * MiB + 7]


def test_a_bandwidth_cap_holds_within_ten_percent(peer_server, tmp_path):
    _, addr, memory = peer_server(SECRET)
    rate, size = 20e6, 60_000_000
    src = tmp_path / "src"
    src.write_bytes(os.urandom(size))
    with PeerTier(addr, secret=SECRET, node=0, rate_limit=rate) as t:
        t.health()  # connect outside the timed part
        start = time.monotonic()
        t.put(shard_key("job", 1, 0), str(src))
        took = time.monotonic() - start
    # the cap's promise is the lower bound (never faster); the upper one only catches a bucket that throttles
    # far below its rate, and is loose so that a loaded machine cannot fail it
    assert 0.9 * size / rate <= took <= 3 * size / rate + 5, f"{size} bytes at {rate:.0f} B/s took {took:.2f} s"
    assert memory.stat(shard_key("job", 1, 0)).size == size


def test_peers_sharing_one_bucket_share_one_cap(peer_server, tmp_path):
    _, addr_a, _ = peer_server(SECRET, root=tmp_path / "a")
    _, addr_b, _ = peer_server(SECRET, root=tmp_path / "b")
    bucket = TokenBucket(20e6, burst=256 * 1024)
    data = os.urandom(25_000_000)
    tiers_ = [PeerTier(addr_a, secret=SECRET, node=0, rate_limit=bucket),
              PeerTier(addr_b, secret=SECRET, node=0, bucket=bucket)]
    for t in tiers_:
        t.health()
    start = time.monotonic()
    threads = [threading.Thread(target=t.put, args=(shard_key("job", 1, 0), data)) for t in tiers_]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    took = time.monotonic() - start
    for t in tiers_:
        assert t.stat(shard_key("job", 1, 0)).size == len(data)
        t.close()
    # with a bucket each, the two puts would take 1.25 s; sharing one, at least 2.5 s (less the burst)
    assert 0.9 * 2.5 <= took <= 3 * 2.5 + 5, f"two 25 MB puts under one 20 MB/s cap took {took:.2f} s"


@pytest.mark.parametrize("source", ["bytes", "path"])
def test_a_body_that_does_not_match_its_checksum_is_refused_and_not_published(
        peer_server, tmp_path, monkeypatch, source):
    server, addr, memory = peer_server(SECRET)
    key = shard_key("job", 5, 1)
    data = payload(2 * MiB + 5, seed=5)  # large enough to go through Expect: 100-continue
    src = data
    if source == "path":
        src = str(tmp_path / "src")
        with open(src, "wb") as f:
            f.write(data)
    monkeypatch.setattr(tiers.peer, "checksum_bytes", lambda _data: "xxh3_64:0123456789abcdef")
    with PeerTier(addr, secret=SECRET, node=0) as t:
        with pytest.raises(ChecksumMismatchError):
            t.put(key, src)
        assert t.list() == []
        with pytest.raises(KeyNotFoundError):
            t.stat(key)
        assert t.health()["objects"] == 0
    assert memory.list() == [] and temp_files(memory) == []


def test_a_server_without_a_secret_refuses_a_non_loopback_address(tmp_path):
    memory = MemoryTier(tmp_path / "shm")
    for host in ("0.0.0.0", "::", "", "192.0.2.10"):
        with pytest.raises(PeerServerError, match="--secret-file"):
            PeerServer(memory, host=host, port=0, secret=None, node=0)
    PeerServer(memory, host="localhost", port=0, secret=None, node=0)
    PeerServer(memory, host="0.0.0.0", port=0, secret=SECRET, node=0)


def test_health_reports_the_node_and_the_bytes_it_holds(peer_server):
    _, addr, memory = peer_server(SECRET, node=7)
    memory.put(shard_key("job", 1, 0), b"x" * 1000)
    memory.put(manifest_key("job", 1), b"{}")
    with PeerTier(addr, secret=SECRET, node=0) as t:
        h = t.health()
    assert h["node"] == 7 and h["version"] == 1 and h["bytes_held"] == 1002 and h["objects"] == 2
    assert abs(h["time"] - time.time()) < 5


def test_on_put_learns_of_each_published_replica(peer_server):
    seen = []

    async def on_put(key, size):
        seen.append((key, size))

    _, addr, _ = peer_server(SECRET, on_put=on_put)
    with PeerTier(addr, secret=SECRET, node=0) as t:
        t.put(shard_key("job", 1, 0), b"abc")
        t.put(manifest_key("job", 1), b"{}")
    assert seen == [(shard_key("job", 1, 0), 3), (manifest_key("job", 1), 2)]


def test_list_pages_through_answers_longer_than_the_limit(peer_server, monkeypatch):
    monkeypatch.setattr(peer_server_module, "MAX_LIST_KEYS", 3)
    _, addr, memory = peer_server(SECRET)
    keys = sorted(shard_key("job", s, r) for s in range(3) for r in range(4))
    for k in keys:
        memory.put(k, k.encode())
    with PeerTier(addr, secret=SECRET, node=0) as t:
        assert t.list() == keys
        assert t.list_sizes("job/step-1/") == [(k, len(k)) for k in keys if k.startswith("job/step-1/")]


def test_an_unreachable_peer_raises_tier_unavailable_with_a_hint():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with PeerTier(f"127.0.0.1:{port}", secret=SECRET, node=0, retries=1, timeout=2) as t:
        with pytest.raises(TierUnavailableError, match="is its agent running"):
            t.stat(shard_key("job", 1, 0))
        with pytest.raises(TierUnavailableError):
            t.put(shard_key("job", 1, 0), b"abc")


def test_a_peer_that_restarts_is_reached_again_on_the_next_call(tmp_path):
    key = shard_key("job", 1, 0)
    first, addr, _ = start_peer_server(tmp_path / "shm", SECRET)
    try:
        with PeerTier(addr, secret=SECRET, node=0, retries=0) as t:
            t.put(key, b"first")
            first.stop()
            # the idle keep-alive connection died with the first server; the next call reopens it
            again = PeerServer(MemoryTier(tmp_path / "shm"), host="127.0.0.1", port=first.server.port,
                               secret=SECRET, node=1)
            second = ServerThread(again).start()
            try:
                assert t.get(key) == b"first"
            finally:
                second.stop()
    finally:
        first.stop()


def test_parse_addr_accepts_host_port_and_bracketed_v6():
    assert parse_addr("10.0.0.2:8765") == ("10.0.0.2", 8765)
    assert parse_addr("node-3.cluster:1") == ("node-3.cluster", 1)
    assert parse_addr("[::1]:9") == ("::1", 9)
    for bad in ("nohost", ":80", "h:0", "h:70000", "h:x"):
        with pytest.raises(ValueError):
            parse_addr(bad)


# -- TLS -----------------------------------------------------------------------------------
def _make_ca_and_server_cert(folder):
    """A private CA and a server certificate for 127.0.0.1/localhost signed by it (PEM paths)."""
    x509 = pytest.importorskip("cryptography.x509", reason="TLS test needs the cryptography package")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tierckpt test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                       crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                        x509.DNSName("localhost")]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = {name: os.path.join(folder, name) for name in ("ca.pem", "cert.pem", "key.pem")}
    with open(paths["ca.pem"], "wb") as f:
        f.write(ca.public_bytes(serialization.Encoding.PEM))
    with open(paths["cert.pem"], "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(paths["key.pem"], "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    return paths


def test_tls_with_a_private_ca_round_trips_and_an_unknown_ca_is_refused(peer_server, tmp_path):
    certs = _make_ca_and_server_cert(tmp_path)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(certs["cert.pem"], certs["key.pem"])
    _, addr, memory = peer_server(SECRET, ssl_context=server_ctx)
    client_ctx = ssl.create_default_context(cafile=certs["ca.pem"])
    key = shard_key("tls", 1, 0)
    data = payload(3 * MiB + 1, seed=6)
    src = tmp_path / "src"
    src.write_bytes(data)
    with PeerTier(addr, secret=SECRET, node=0, ssl_context=client_ctx) as t:
        assert t.put(key, str(src)) == len(data)
        assert t.get(key) == data
        buf = bytearray(1000)
        t.read_into(key, memoryview(buf), MiB)
        assert buf == data[MiB : MiB + 1000]
        assert t.list() == [key] and t.stat(key).size == len(data)
    assert memory.get(key) == data
    with PeerTier(addr, secret=SECRET, node=0, ssl_context=ssl.create_default_context(), retries=0) as t:
        with pytest.raises(TierError, match="TLS") as info:
            t.stat(key)
        assert not isinstance(info.value, TierUnavailableError)


def test_connections_over_the_cap_are_answered_busy_and_served_again_once_one_closes(peer_server):
    _, addr, memory = peer_server(max_connections=2)
    memory.put(shard_key("job", 1, 0), b"x" * 10)
    host, port = parse_addr(addr)
    idle = []
    for _ in range(2):  # two kept-alive connections, each known to be served (it answered a request)
        s = socket.create_connection((host, port))
        s.sendall(b"GET /v1/health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(64).startswith(b"HTTP/1.1 200")
        idle.append(s)
    t = PeerTier(addr, secret=None, node=0, timeout=5, retries=1)
    with pytest.raises(TierUnavailableError, match="busy"):
        t.get(shard_key("job", 1, 0))
    idle.pop().close()
    deadline = time.monotonic() + 10
    while True:  # the server counts the closed connection out as soon as its loop sees the close
        try:
            assert t.get(shard_key("job", 1, 0)) == b"x" * 10
            break
        except TierUnavailableError:
            assert time.monotonic() < deadline, "a freed connection slot was never reused"
            time.sleep(0.05)
    t.close()
    for s in idle:
        s.close()


def test_a_client_dribbling_its_headers_is_cut_by_the_keepalive_timer(peer_server):
    _, addr, _ = peer_server(keepalive_timeout=1.0)
    s = socket.create_connection(parse_addr(addr))
    s.sendall(b"GET /v1/health HTTP/1.1\r\n")
    t0 = time.monotonic()
    closed = False
    for _ in range(20):  # a header line every half second: never a complete request
        time.sleep(0.5)
        try:
            s.sendall(b"X-Slow: 1\r\n")
            if s.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) == b"":
                closed = True
                break
        except BlockingIOError:
            continue  # still open, nothing to read
        except OSError:
            closed = True
            break
    assert closed, "the server kept a connection that never completed a request for 10 s"
    assert time.monotonic() - t0 < 5
    s.close()


# ---------------------------------------------------------------- a node's disk, read-only through its server
@pytest.mark.parametrize("compress", [False, True], ids=["plain", "lz4"])
def test_a_peer_disk_tier_reads_the_nodes_disk_bit_exact_and_never_writes_it(peer_server, tmp_path, compress,
                                                                              monkeypatch):
    from tiers.disk import DiskTier
    from tiers.peer import PeerDiskTier

    monkeypatch.setattr(peer_server_module, "MAX_LIST_KEYS", 2)  # the listing pages as memory's does
    disk = DiskTier(tmp_path / "disk", compress=compress)
    _, addr, memory = peer_server(SECRET, disk=disk)
    data = {shard_key("job", 3, r): payload(300_000 + r, seed=r) for r in range(3)}
    data[manifest_key("job", 3)] = b'{"not": "parsed here"}'
    for k, v in data.items():
        disk.put(k, v)
    memory.put(shard_key("job", 9, 0), b"memory, not disk")
    with PeerDiskTier(addr, secret=SECRET, node=0) as t:
        assert t.name == "peer-disk" and t.describe().startswith("peer-disk ")
        assert t.list_sizes("job/") == sorted((k, len(v)) for k, v in data.items())  # disk's only, decompressed
        for k, v in data.items():
            assert t.get(k) == v and t.stat(k).size == len(v)
        k = shard_key("job", 3, 1)
        buf = bytearray(1000)
        assert t.read_into(k, memoryview(buf), 123_456) == 1000 and bytes(buf) == data[k][123_456:124_456]
        assert t.get(k, 299_990) == data[k][299_990:]
        parts = [(0, memoryview(bytearray(10))), (10, memoryview(bytearray(5)))]
        t.read_ranges(k, parts)
        assert b"".join(bytes(v) for _, v in parts) == data[k][:15]
        with pytest.raises(TierError):
            t.read_into(k, memoryview(bytearray(10)), len(data[k]))  # past the end
        with pytest.raises(KeyNotFoundError):
            t.get(shard_key("job", 9, 0))  # in memory, not on disk
        with pytest.raises(TierError, match="read-only"):
            t.put(shard_key("job", 4, 0), b"x")
        with pytest.raises(TierError, match="read-only"):
            t.delete(k)
    assert disk.get(k) == data[k] and disk.list("job/step-4/") == []
    with PeerDiskTier(addr, secret=b"another-secret-0123456789", node=0, retries=0) as t:
        with pytest.raises(TierError):
            t.get(k)  # signed like every route
    # the routes themselves take no write, and no key that could leave the folder
    host, port = parse_addr(addr)
    _, addr2, _ = peer_server(None, root=tmp_path / "shm2", disk=disk)
    host2, port2 = parse_addr(addr2)
    conn = http.client.HTTPConnection(host2, port2, timeout=10)
    for method, path in (("PUT", f"/v1/disk/o/{k}"), ("DELETE", f"/v1/disk/o/{k}")):
        conn.request(method, path, body=b"x" if method == "PUT" else None)
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 405, (method, resp.status)
    for bad in ("job/step-3/../../etc", "job/.hidden/rank-0.shard", "a" * 2000):
        conn.request("GET", f"/v1/disk/o/{bad}")
        resp = conn.getresponse()
        resp.read()
        assert resp.status in (400, 404), (bad, resp.status)
    conn.close()
    assert sorted(disk.list()) == sorted(data)


def test_a_node_without_a_disk_lists_an_empty_disk_and_answers_404(peer_server):
    from tiers.peer import PeerDiskTier

    _, addr, memory = peer_server(SECRET)
    memory.put(shard_key("job", 1, 0), b"in memory")
    with PeerDiskTier(addr, secret=SECRET, node=0) as t:
        assert t.list() == []
        with pytest.raises(KeyNotFoundError):
            t.get(shard_key("job", 1, 0))
