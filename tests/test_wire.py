"""The peer wire protocol: signing and its refusals, the secret file, limits, bandwidth caps,
and a server that survives whatever arrives on its socket.

Server tests run a real PeerServer on 127.0.0.1 (see ``test_peer_tier.ServerThread``)
and talk to it with ``http.client`` or a raw socket, so every byte on the wire
is the test's choice.
"""

from __future__ import annotations

import http.client
import os
import re
import socket
import stat
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict

import test_peer_tier
from test_peer_tier import SECRET, start_peer_server, temp_files
from tiers import TierError, checksum_bytes, manifest_key, shard_key
from tiers.peer import PeerTier, parse_addr
from tiers.wire import (
    H_CHECKSUM,
    H_NODE,
    H_NONCE,
    H_SIGNATURE,
    H_TIMESTAMP,
    H_VERSION,
    AuthError,
    ReplayGuard,
    SecretError,
    TokenBucket,
    Verifier,
    canonical_query,
    load_secret,
    secret_from_env,
    sign,
)

#: the fixture ``peer_server(secret=None, **PeerServer kwargs) -> (server, addr, memory)``
peer_server = test_peer_tier.peer_server

MiB = 1 << 20
KEY = shard_key("job", 1, 0)
PATH = f"/v1/o/{KEY}"


# -- helpers ---------------------------------------------------------------------------------
def request(addr: str, method: str, url: str, headers: dict | None = None, body: bytes | None = None):
    """One request on a fresh connection: ``(status, headers, body text)``."""
    host, port = parse_addr(addr)
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        conn.putrequest(method, url, skip_accept_encoding=True)
        for name, value in (headers or {}).items():
            conn.putheader(name, value)
        if body is not None:
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read().decode("utf-8", "replace")
    finally:
        conn.close()


def signed(method: str, path: str, query=None, *, secret: bytes = SECRET, body: bytes | None = None, **kw) -> dict:
    checksum = kw.pop("checksum", checksum_bytes(body) if body is not None and method == "PUT" else None)
    return sign(secret, method, path, query, node=0, content_length=None if body is None else len(body),
                checksum=checksum, **kw)


def healthy(addr: str, secret: bytes | None = SECRET) -> bool:
    headers = signed("GET", "/v1/health", secret=secret) if secret else {}
    status, _, text = request(addr, "GET", "/v1/health", headers)
    return status == 200 and '"node"' in text


def metrics(addr: str) -> str:
    status, headers, text = request(addr, "GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    return text


def counter(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$", line)
        if m and m.group(1) == name:
            got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            if all(got.get(k) == v for k, v in labels.items()):
                total += float(m.group(3))
    return total


def wait_until(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


# -- signing (no server) ------------------------------------------------------------------------
def test_a_signed_request_verifies_and_reports_the_sender():
    h = signed("PUT", PATH, {"b": "2", "a": "x y"}, body=b"abc")
    h["Content-Length"] = "3"
    assert Verifier(SECRET).verify("PUT", PATH, {"a": "x y", "b": "2"}, h) == 0


def test_changing_any_signed_field_breaks_the_signature():
    base = signed("PUT", PATH, {"prefix": "job/"}, body=b"abc")
    base["Content-Length"] = "3"
    cases = {
        "method": ("POST", PATH, {"prefix": "job/"}, {}),
        "path": ("PUT", f"/v1/o/{shard_key('job', 1, 1)}", {"prefix": "job/"}, {}),
        "query": ("PUT", PATH, {"prefix": "other/"}, {}),
        "length": ("PUT", PATH, {"prefix": "job/"}, {"Content-Length": "4"}),
        "checksum": ("PUT", PATH, {"prefix": "job/"}, {H_CHECKSUM: checksum_bytes(b"abd")}),
        "node": ("PUT", PATH, {"prefix": "job/"}, {H_NODE: "5"}),
        "timestamp": ("PUT", PATH, {"prefix": "job/"}, {H_TIMESTAMP: f"{time.time() - 1:.3f}"}),
        "nonce": ("PUT", PATH, {"prefix": "job/"}, {H_NONCE: "0" * 32}),
    }
    for field, (method, path, query, change) in cases.items():
        with pytest.raises(AuthError) as info:
            Verifier(SECRET).verify(method, path, query, {**base, **change})
        assert info.value.reason == "signature", field
    with pytest.raises(AuthError, match="bad signature") as info:
        Verifier(b"another-secret-0123456789").verify("PUT", PATH, {"prefix": "job/"}, base)
    assert "\n" not in str(info.value)


def test_each_refusal_has_its_reason():
    now = time.time()
    v = Verifier(SECRET, max_skew=30, clock=lambda: now)
    good = signed("GET", "/v1/health", timestamp=now)
    for name in (H_VERSION, H_NODE, H_TIMESTAMP, H_NONCE, H_SIGNATURE):
        h = {k: val for k, val in good.items() if k != name}
        with pytest.raises(AuthError, match=f"missing header {name}") as info:
            v.verify("GET", "/v1/health", None, h)
        assert info.value.reason == "missing"
    with pytest.raises(AuthError) as info:
        v.verify("GET", "/v1/health", None, {**good, H_VERSION: "2"})
    assert info.value.reason == "version"
    for name, bad in ((H_NONCE, "xyz"), (H_TIMESTAMP, "soon"), (H_NODE, "-1"), (H_SIGNATURE, "00")):
        with pytest.raises(AuthError) as info:
            v.verify("GET", "/v1/health", None, {**good, name: bad})
        assert info.value.reason == "malformed", name
    for offset in (-31, 31):
        with pytest.raises(AuthError, match="synchronise the clocks") as info:
            v.verify("GET", "/v1/health", None, signed("GET", "/v1/health", timestamp=now + offset))
        assert info.value.reason == "skew"
    twice = CIMultiDict(good)
    twice.add(H_NONCE, "1" * 32)
    with pytest.raises(AuthError, match="more than once"):
        v.verify("GET", "/v1/health", None, twice)
    assert v.verify("GET", "/v1/health", None, good) == 0
    with pytest.raises(AuthError) as info:
        v.verify("GET", "/v1/health", None, good)
    assert info.value.reason == "replay"


def test_header_names_are_case_insensitive():
    h = {k.lower(): v for k, v in signed("GET", "/v1/health").items()}
    assert Verifier(SECRET).verify("GET", "/v1/health", None, h) == 0


def test_the_canonical_query_does_not_depend_on_order_or_encoding():
    assert canonical_query({"b": "1", "a": "x y"}) == canonical_query([("a", "x y"), ("b", "1")]) \
        == canonical_query("b=1&a=x%20y") == "a=x%20y&b=1"
    assert canonical_query(None) == canonical_query({}) == ""
    assert "\n" not in canonical_query({"a": "1\n2"})


def _nonce(session: str, seq: int) -> str:
    return f"{session}{seq:016x}"


def test_a_request_delayed_past_the_skew_window_is_taken_if_its_session_is_known():
    """A link down for 40 s delivers requests signed before the outage: taken once, never twice."""
    now = [1000.0]
    v = Verifier(SECRET, max_skew=30, clock=lambda: now[0])
    sess = "ab" * 8
    first = signed("GET", "/v1/health", timestamp=now[0], nonce=_nonce(sess, 1))
    assert v.verify("GET", "/v1/health", None, first) == 0
    held = [signed("GET", "/v1/health", timestamp=now[0], nonce=_nonce(sess, n)) for n in (2, 3)]
    now[0] += 40  # the outage
    assert v.verify("GET", "/v1/health", None, held[1]) == 0  # out of order, too
    assert v.verify("GET", "/v1/health", None, held[0]) == 0
    for h in (first, *held):
        with pytest.raises(AuthError) as info:
            v.verify("GET", "/v1/health", None, h)
        assert info.value.reason == "replay"
    # a session this node has no record of (it restarted) must be fresh
    other = signed("GET", "/v1/health", timestamp=now[0] - 40, nonce=_nonce("cd" * 8, 7))
    with pytest.raises(AuthError, match="no record of") as info:
        v.verify("GET", "/v1/health", None, other)
    assert info.value.reason == "skew"
    # and so must a number at or below the first one taken: it could predate the record
    early = signed("GET", "/v1/health", timestamp=now[0] - 40, nonce=_nonce(sess, 0))
    with pytest.raises(AuthError, match="before the first") as info:
        v.verify("GET", "/v1/health", None, early)
    assert info.value.reason == "skew"


def test_the_replay_guard_refuses_every_number_it_took_and_every_one_below_its_window():
    g = ReplayGuard(window=8, max_sessions=2)
    kw = dict(fresh=True, now=0.0, max_skew=30.0, late_s=0.0)
    sess = "0f" * 8
    order = [5, 3, 4, 9, 6, 2, 20, 14, 13, 30, 31, 29]
    for n in order:
        g.take("0", _nonce(sess, n), **kw)
    for n in order:
        with pytest.raises(AuthError) as info:
            g.take("0", _nonce(sess, n), **kw)
        assert info.value.reason == "replay", n
    for n in (1, 7, 21):  # never taken, but more than 8 below the highest (31): too old
        with pytest.raises(AuthError):
            g.take("0", _nonce(sess, n), **kw)
    g.take("0", _nonce(sess, 24), **kw)  # never taken and inside the window
    # the same numbers from another node or session are other requests
    g.take("1", _nonce(sess, 5), **kw)
    with pytest.raises(AuthError) as info:  # two sessions known and both active: a third is refused
        g.take("0", _nonce("aa" * 8, 1), **kw)
    assert info.value.reason == "busy"
    g.take("0", _nonce("aa" * 8, 1), **{**kw, "now": 31.0})  # once one has idled past max_skew it goes
    assert len(g) <= 2


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=300), min_size=1, max_size=120))
def test_no_number_is_ever_taken_twice(numbers):
    g = ReplayGuard(window=16)
    taken: set[int] = set()
    for n in numbers:
        try:
            g.take("0", _nonce("11" * 8, n), fresh=True, now=0.0, max_skew=30.0, late_s=0.0)
        except AuthError as e:
            assert e.reason == "replay"
            continue
        assert n not in taken
        taken.add(n)


def test_a_process_numbers_its_requests_per_receiver_and_a_forked_child_in_its_own_session():
    a1 = sign(SECRET, "GET", "/v1/health", node=0, to="10.0.0.1:7700")[H_NONCE]
    b1 = sign(SECRET, "GET", "/v1/health", node=0, to="10.0.0.2:7700")[H_NONCE]
    a2 = sign(SECRET, "GET", "/v1/health", node=0, to="10.0.0.1:7700")[H_NONCE]
    assert a1[:16] == b1[:16] == a2[:16] and int(a2[16:], 16) == int(a1[16:], 16) + 1
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(w, sign(SECRET, "GET", "/v1/health", node=0, to="10.0.0.1:7700")[H_NONCE].encode())
        os._exit(0)
    os.waitpid(pid, 0)
    child = os.read(r, 64).decode()
    os.close(r), os.close(w)
    assert child[:16] != a1[:16]


# -- the secret file ---------------------------------------------------------------------------
def test_load_secret_wants_a_private_non_empty_file(tmp_path, monkeypatch):
    path = tmp_path / "secret"
    with pytest.raises(SecretError, match="does not exist"):
        load_secret(path)
    path.write_bytes(b"0123456789abcdef0123\n")
    os.chmod(path, 0o644)
    with pytest.raises(SecretError, match="chmod 600"):
        load_secret(path)
    os.chmod(path, 0o600)
    assert load_secret(path) == b"0123456789abcdef0123"
    path.write_bytes(b"\n")
    with pytest.raises(SecretError, match="empty"):
        load_secret(path)
    path.write_bytes(b"short")
    with pytest.raises(SecretError, match="at least 16"):
        load_secret(path)
    folder = tmp_path / "dir"
    folder.mkdir(mode=0o700)
    with pytest.raises(SecretError):
        load_secret(folder)
    path.write_bytes(SECRET)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert secret_from_env({"CKPT_SECRET_FILE": str(path)}) == SECRET
    assert secret_from_env({}) is None
    monkeypatch.setenv("CKPT_SECRET_FILE", str(path))
    assert secret_from_env() == SECRET


# -- the bandwidth cap -----------------------------------------------------------------------------
def test_the_token_bucket_spends_its_burst_then_paces_at_its_rate():
    now = [0.0]
    slept = []

    def sleep(s):
        slept.append(s)
        now[0] += s

    b = TokenBucket(1000.0, burst=500.0, clock=lambda: now[0], sleep=sleep)
    assert b.take(500) == 0.0
    assert b.take(1000) == pytest.approx(1.0)
    now[0] += 10.0  # idle time refills only up to the burst
    assert b.take(500) == 0.0
    assert b.take(250) == pytest.approx(0.25)
    assert sum(slept) == pytest.approx(1.25)
    with pytest.raises(ValueError):
        TokenBucket(0)


# -- a live server: authentication ---------------------------------------------------------------
def test_a_wrong_secret_is_refused_with_401_and_the_server_keeps_serving(peer_server, caplog):
    _, addr, _ = peer_server(SECRET)
    with PeerTier(addr, secret=b"not-the-secret-0123456789", node=2) as bad:
        with pytest.raises(TierError, match=r"authentication failed \(check --secret-file on both nodes\)"):
            bad.put(KEY, b"data")
        with pytest.raises(TierError, match="authentication failed"):
            bad.health()
    with PeerTier(addr, secret=SECRET, node=2) as good:
        good.put(KEY, b"data")
        assert good.get(KEY) == b"data"
    assert any("refused" in r.getMessage() and "bad signature" in r.getMessage()
               for r in caplog.records if r.name == "tierckpt.peer")
    assert counter(metrics(addr), "tierckpt_peer_auth_failures_total", reason="signature") == 2


def test_a_replayed_request_is_refused(peer_server):
    _, addr, memory = peer_server(SECRET)
    memory.put(KEY, b"x")
    headers = signed("DELETE", PATH)
    assert request(addr, "DELETE", PATH, headers)[0] == 204
    memory.put(KEY, b"x")
    status, _, text = request(addr, "DELETE", PATH, headers)
    assert status == 401 and "replayed" in text
    assert memory.list() == [KEY]


def test_a_stale_or_future_timestamp_is_refused(peer_server):
    _, addr, _ = peer_server(SECRET)
    for offset in (-120, 120):
        headers = signed("GET", "/v1/health", timestamp=time.time() + offset)
        status, _, text = request(addr, "GET", "/v1/health", headers)
        assert status == 401 and "clock" in text
    assert healthy(addr)


def test_a_request_without_signature_headers_is_refused_but_metrics_are_open(peer_server):
    _, addr, _ = peer_server(SECRET)
    for method, url in (("GET", "/v1/health"), ("GET", "/v1/list?prefix="), ("GET", PATH), ("DELETE", PATH),
                        ("GET", "/v1/nowhere")):
        status, headers, text = request(addr, method, url)
        assert status == 401 and "missing header" in text, (method, url)
    assert request(addr, "PUT", PATH, body=b"abc")[0] == 401
    text = metrics(addr)
    assert counter(text, "tierckpt_peer_auth_failures_total", reason="missing") == 6
    assert counter(text, "tierckpt_peer_requests_total", status="401") == 6


def test_an_unsigned_server_takes_plain_requests_but_not_another_wire_version(peer_server):
    _, addr, memory = peer_server(None)
    memory.put(KEY, b"hello")
    status, _, text = request(addr, "GET", PATH)
    assert (status, text) == (200, "hello")
    status, _, text = request(addr, "GET", PATH, {H_VERSION: "9"})
    assert status == 400 and "wire version" in text
    # a signed client may talk to it all the same
    with PeerTier(addr, secret=SECRET, node=0) as t:
        assert t.get(KEY) == b"hello"


def test_extra_routes_sit_behind_the_same_authentication(peer_server):
    from aiohttp import web

    async def commit(request):
        return web.json_response({"ok": True, "body": await request.json()})

    _, addr, _ = peer_server(SECRET, extra_routes=[("POST", "/v1/commit", commit)])
    body = b'{"step": 3}'
    assert request(addr, "POST", "/v1/commit", {"Content-Type": "application/json"}, body)[0] == 401
    status, _, text = request(addr, "POST", "/v1/commit", {**signed("POST", "/v1/commit", body=body),
                                                            "Content-Type": "application/json"}, body)
    assert status == 200 and '"step": 3' in text


# -- a live server: limits and broken uploads -------------------------------------------------------
def _raw_upload_head(size: int, key: str = KEY, checksum: str = "xxh3_64:0123456789abcdef") -> bytes:
    headers = sign(SECRET, "PUT", f"/v1/o/{key}", None, node=0, content_length=size, checksum=checksum)
    lines = [f"PUT /v1/o/{key} HTTP/1.1", "Host: peer", f"Content-Length: {size}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def test_a_truncated_upload_publishes_nothing_and_leaves_no_temp_file(peer_server):
    _, addr, memory = peer_server(SECRET)
    with socket.create_connection(parse_addr(addr), timeout=10) as s:
        s.sendall(_raw_upload_head(MiB))
        s.sendall(os.urandom(MiB // 2))
        assert wait_until(lambda: temp_files(memory) != [], 5), "the upload should have begun"
    assert wait_until(lambda: temp_files(memory) == [], 5), temp_files(memory)
    assert memory.list() == []
    assert counter(metrics(addr), "tierckpt_peer_aborted_uploads_total") == 1
    assert healthy(addr)


def test_a_stalled_upload_times_out_with_408_and_leaves_no_temp_file(peer_server):
    _, addr, memory = peer_server(SECRET, read_timeout=0.5)
    with socket.create_connection(parse_addr(addr), timeout=10) as s:
        s.sendall(_raw_upload_head(MiB))
        s.sendall(b"\0" * 1000)
        answer = s.recv(1000)
    assert answer.startswith(b"HTTP/1.1 408")
    assert memory.list() == [] and temp_files(memory) == []
    assert healthy(addr)


def test_an_oversized_upload_is_refused_with_413_before_its_body_is_sent(peer_server):
    _, addr, memory = peer_server(SECRET, max_body=MiB)
    body = b"\0" * (MiB + 1)
    status, _, text = request(addr, "PUT", PATH, signed("PUT", PATH, body=body), body)
    assert status == 413 and "more than this node accepts" in text
    with PeerTier(addr, secret=SECRET, node=0) as t:
        start = time.monotonic()
        with pytest.raises(TierError, match="too large"):
            t.put(KEY, memoryview(bytearray(512 * MiB)))  # refused at its headers: no 512 MiB transfer
        assert time.monotonic() - start < 2
        t.put(KEY, b"\1" * MiB)
    assert memory.list() == [KEY] and temp_files(memory) == []
    assert counter(metrics(addr), "tierckpt_peer_bytes_in_total") == MiB


def test_an_upload_needs_a_length_and_a_shard_needs_a_checksum(peer_server):
    _, addr, memory = peer_server(SECRET)
    body = b"abc"
    no_sum = signed("PUT", PATH, body=body, checksum=None)
    status, _, text = request(addr, "PUT", PATH, no_sum, body)
    assert status == 400 and H_CHECKSUM in text
    bad_sum = signed("PUT", PATH, body=body, checksum="md5:abc")
    assert request(addr, "PUT", PATH, bad_sum, body)[0] == 400
    host, port = parse_addr(addr)
    conn = http.client.HTTPConnection(host, port, timeout=10)
    conn.putrequest("PUT", PATH)
    for k, v in signed("PUT", PATH, checksum=checksum_bytes(body)).items():
        conn.putheader(k, v)
    conn.putheader("Transfer-Encoding", "chunked")
    conn.endheaders(b"3\r\nabc\r\n0\r\n\r\n")
    assert conn.getresponse().status == 411
    conn.close()
    # a manifest may go without a checksum
    mkey = manifest_key("job", 1)
    headers = signed("PUT", f"/v1/o/{mkey}", body=b"{}", checksum=None)
    status, _, _ = request(addr, "PUT", f"/v1/o/{mkey}", headers, b"{}")
    assert status == 201
    assert memory.list() == [mkey]


def test_invalid_keys_are_refused_with_400(peer_server):
    _, addr, memory = peer_server(None)
    for key in ("a/b", ".hidden/step-1/rank-0.shard", "job/step-01/rank-0.shard", "job/step-1/x",
                "j%2F..%2F..%2Fetc/step-1/rank-0.shard", "job/step-1/rank-0.shard/more"):
        status, _, _ = request(addr, "GET", f"/v1/o/{key}")
        assert status in (400, 404), key
        status, _, _ = request(addr, "PUT", f"/v1/o/{key}", {H_CHECKSUM: checksum_bytes(b"x")}, b"x")
        assert status in (400, 404), key
    assert memory.list() == [] and not os.listdir(memory.root)


# -- a live server: metrics ------------------------------------------------------------------------
def test_metrics_are_prometheus_text_with_counters_and_callback_gauges(peer_server):
    _, addr, _ = peer_server(SECRET, metrics_cb=lambda: {"tierckpt_agent_replicas": 3, "bad name": 1.0})
    with PeerTier(addr, secret=SECRET, node=0) as t:
        t.put(KEY, b"x" * 100)
        t.get(KEY)
    request(addr, "GET", "/v1/health")  # unsigned: refused
    text = metrics(addr)
    sample = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_][a-zA-Z0-9_]*="[^"]*",?)*\})? [-+0-9.eEInfNa]+$')
    for line in text.splitlines():
        assert line.startswith("# HELP ") or line.startswith("# TYPE ") or sample.match(line), line
    assert counter(text, "tierckpt_peer_requests_total", route="object", method="PUT", status="201") == 1
    assert counter(text, "tierckpt_peer_auth_failures_total") == 1
    assert counter(text, "tierckpt_peer_bytes_in_total") == 100
    assert counter(text, "tierckpt_peer_bytes_out_total") >= 100
    assert counter(text, "tierckpt_agent_replicas") == 3
    assert "bad name" not in text


def test_metrics_count_request_body_bytes_by_route_and_by_signed_sender(peer_server):
    _, addr, _ = peer_server(SECRET)
    with PeerTier(addr, secret=SECRET, node=3) as t:
        t.put(KEY, b"x" * 100)
        t.put(manifest_key("job", 1), b"{}")
        t.health()
    with PeerTier(addr, secret=SECRET, node=7) as t:
        t.get(KEY)
    request(addr, "PUT", PATH, body=b"y" * 50)  # unsigned: refused, so no sender to count it under
    text = metrics(addr)
    assert counter(text, "tierckpt_peer_request_bytes_total", route="object", method="PUT") == 152
    assert counter(text, "tierckpt_peer_request_bytes_total", route="health", method="GET") == 0
    assert counter(text, "tierckpt_peer_sender_requests_total", node="3", route="object") == 2
    assert counter(text, "tierckpt_peer_sender_requests_total", node="3", route="health") == 1
    assert counter(text, "tierckpt_peer_sender_bytes_total", node="3") == 102
    assert counter(text, "tierckpt_peer_sender_requests_total", node="7") == 1
    assert counter(text, "tierckpt_peer_sender_bytes_total", node="7") == 0
    assert counter(text, "tierckpt_peer_sender_requests_total") == 4


def _read_to_close(s: socket.socket, deadline: float = 30.0) -> bool:
    """Read until the server closes ``s``; False if it is still open after ``deadline`` seconds."""
    s.settimeout(deadline)
    try:
        while s.recv(4096):
            pass
    except socket.timeout:
        return False
    except OSError:
        pass
    return True


def test_connections_refused_over_the_cap_are_counted(peer_server):
    _, addr, _ = peer_server(max_connections=1)
    host, port = parse_addr(addr)
    held = socket.create_connection((host, port))
    held.sendall(b"GET /v1/health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert held.recv(64).startswith(b"HTTP/1.1 200")
    for _ in range(2):  # the cap counts a connection once its request authenticated: the request is answered busy
        with socket.create_connection((host, port)) as s:
            s.sendall(b"GET /v1/health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(64).startswith(b"HTTP/1.1 503")
            assert _read_to_close(s), "a connection refused as busy was left open"
    held.close()
    text = None
    for _ in range(100):  # the server counts the held connection out once its loop sees the close
        try:
            text = metrics(addr)
            break
        except AssertionError:
            time.sleep(0.05)
    assert text is not None and counter(text, "tierckpt_peer_connections_refused_total") == 2
    assert counter(text, "tierckpt_peer_errors_total") == 0  # busy is not a failure of the server


# -- a live server: garbage ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fuzz_servers(tmp_path_factory):
    """An unsigned server (requests reach the handlers) and a signed one (requests meet the verifier)."""
    threads = [start_peer_server(tmp_path_factory.mktemp(name) / "shm", secret, read_timeout=1.0)
               for name, secret in (("open", None), ("signed", SECRET))]
    yield [addr for _, addr, _ in threads]
    for thread, _, _ in threads:
        thread.stop()


def _exchange_raw(addr: str, data: bytes) -> bytes:
    with socket.create_connection(parse_addr(addr), timeout=5) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            s.settimeout(3)
            out = b""
            while len(out) < 1 << 16:
                got = s.recv(1 << 16)
                if not got:
                    break
                out += got
            return out
        except (ConnectionError, socket.timeout):
            return b""


def _still_serves(addrs) -> None:
    assert healthy(addrs[0], None)
    assert healthy(addrs[1], SECRET)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(min_size=0, max_size=2048))
def test_random_bytes_on_the_socket_never_break_the_server(fuzz_servers, data):
    for addr in fuzz_servers:
        _exchange_raw(addr, data)
    _still_serves(fuzz_servers)


_methods = st.sampled_from(["GET", "HEAD", "PUT", "DELETE", "POST", "PATCH", "OPTIONS", "TRACE", "BREW", "G\tET"])
_paths = st.one_of(
    st.sampled_from(["/v1/health", "/v1/list", PATH, "/v1/o/", "/v1/o/../../etc/passwd", "/metrics", "*", "/"]),
    st.builds(lambda k: "/v1/o/" + k, st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=80)),
    st.builds(lambda q: "/v1/list?" + q, st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=80)),
)
_header_names = st.one_of(
    st.sampled_from(["Content-Length", "Range", "Transfer-Encoding", "Expect", H_CHECKSUM, H_VERSION, H_NODE,
                     H_TIMESTAMP, H_NONCE, H_SIGNATURE, "Content-Type", "If-None-Match", "Accept-Encoding"]),
    st.text(st.characters(min_codepoint=33, max_codepoint=126, blacklist_characters=":"), min_size=1, max_size=20),
)
_header_values = st.one_of(
    st.sampled_from(["0", "-1", "99999999999999999999", "bytes=0-0", "bytes=5-1", "bytes=-", "chunked",
                     "100-continue", "xxh3_64:0123456789abcdef", "1", "gzip, br"]),
    st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=60),
)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(method=_methods, path=_paths, headers=st.dictionaries(_header_names, _header_values, max_size=6),
       body=st.binary(max_size=64))
def test_random_requests_never_break_the_server(fuzz_servers, method, path, headers, body):
    lines = [f"{method} {path} HTTP/1.1", "Host: peer"] + [f"{k}: {v}" for k, v in headers.items()]
    data = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
    for addr in fuzz_servers:
        answer = _exchange_raw(addr, data)
        if answer:
            assert answer.startswith(b"HTTP/1."), answer[:80]
            assert not answer.startswith(b"HTTP/1.1 500"), (data, answer[:300])
    _still_serves(fuzz_servers)
