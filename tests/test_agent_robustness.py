"""The agent under hostile timing and hostile input: replication over budget, rewind racing a commit,
fuzzed signed requests to every peer-server route, and the CLI's error paths (real agents as subprocesses)."""

from __future__ import annotations

import http.client
import json
import mmap
import os
import re
import subprocess
import sys
import time
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from procs import ckpt_cmd, env, start_agent
from s3util import free_port
from test_e2e_peers import Cluster
from agents.config import socket_path_for
from agents.protocol import AgentClient
from recovery.inventory import scan_tier
from tiers import keys
from tiers.memory import MemoryTier
from tiers.wire import load_secret, sign

pytestmark = pytest.mark.e2e

MiB = 1 << 20


def _stage(client: AgentClient, job: str, step: int, nbytes: int, rank: int = 0, world: int = 1) -> None:
    """Hand the agent one rank's shard of ``nbytes`` (a multiple of 1 MiB) over ``client``, as a trainer does."""
    slot = client.call("begin", job=job, rank=rank, world=world, nbytes=nbytes)["slot"]
    with open(slot, "r+b") as f, mmap.mmap(f.fileno(), nbytes) as mm:
        mm[:] = os.urandom(MiB) * (nbytes // MiB)
    entries = [{"kind": "tensor", "name": "w", "dtype": "uint8", "global_shape": [world * nbytes],
                "offsets": [rank * nbytes], "shape": [nbytes], "offset": 0, "nbytes": nbytes}]
    errors = client.call("commit", job=job, step=step, rank=rank, world=world, slot=slot, nbytes=nbytes,
                         entries=entries, save_index=step)["errors"]
    assert errors == [], errors


def _wait_until(cond, what: str, timeout: float, logs=()) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    tails = {p: open(p).read()[-2000:] for p in logs}
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; logs: {tails}")


# ---------------------------------------------------------------------- replication budget
def test_two_peers_each_saving_more_than_their_inflight_budget_replicate_without_waiting_for_the_peer_timeout(
        tmp_path, monkeypatch):
    """Each node pushes 3 x 24 MiB to the other against a 32 MiB budget. A push that held its own budget
    while the peer's pull needed the peer's stalled both nodes until the peer timeout (120 s here)."""
    monkeypatch.setenv("CKPT_MAX_INFLIGHT_BYTES", str(32 * MiB))
    monkeypatch.setenv("CKPT_PEER_TIMEOUT", "120")
    c = Cluster(tmp_path, 2)
    try:
        clients = [AgentClient(socket_path_for(c.shm(i))) for i in range(2)]
        try:
            for i in range(2):
                for rank in range(3):
                    _stage(clients[i], f"j{i}", 1, 24 * MiB, rank=rank, world=3)
        finally:
            for cl in clients:
                cl.close()

        def all_copies() -> bool:
            return all(os.path.exists(os.path.join(c.shm(1 - i), f"j{i}", "step-1", f"rank-{r}.shard"))
                       for i in range(2) for r in range(3))

        # generous for a loaded machine, and far below the 120 s a stalled pull waits for
        _wait_until(all_copies, "every shard's replica on the other node", 60,
                    [p.log_path for p in c.procs.values()])
    finally:
        c.close()


# ---------------------------------------------------------------------- rewind racing a commit
def test_rewind_racing_a_just_committed_step_leaves_it_whole_or_gone_and_the_new_run_saves_it(tmp_path):
    """A restore's rewind sent right after a commit, many times over, with sizes that move the race window.
    Each time, the step is either committed with its shard or gone, never a manifest without its shard;
    the new run's save of the same step succeeds with no error handed to it; the agent never fails."""
    shm, disk = str(tmp_path / "shm"), str(tmp_path / "disk")
    agent = start_agent(shm, "--disk", disk, "--keep-memory", "3")
    memory = MemoryTier(shm)
    try:
        with AgentClient(socket_path_for(shm), timeout=120) as trainer, \
                AgentClient(socket_path_for(shm), timeout=120) as restorer:
            for i in range(40):
                step = i + 1
                _stage(trainer, "r", step, (1 + i % 4) * MiB)
                restorer.call("rewind", job="r", step=step - 1)
                # whatever the race did: the step is whole in memory or not there at all
                st = scan_tier(memory, "r").job("r").get(step)
                if st is not None and st.has_manifest:
                    assert st.manifest is not None and st.shards.get(0) == st.manifest.shard(0).size, \
                        f"step {step}: manifest without its shard after the rewind: {st.problem}"
                # the new run saves the same step: taken, written everywhere, no error handed to it
                _stage(trainer, "r", step, MiB)
                done = trainer.call("wait", job="r", step=step, timeout=60)
                assert done["done"] and done["errors"] == [], (step, done)
                st = scan_tier(memory, "r").job("r")[step]
                assert st.manifest is not None and st.shards.get(0) == MiB == st.manifest.shard(0).size
        assert agent.poll() is None, "the agent died"
    finally:
        agent.terminate()
        agent.wait(60)
    log = open(agent.log_path).read()
    assert "KeyError" not in log and "Traceback" not in log, log[-3000:]


# ---------------------------------------------------------------------- fuzzed signed requests
_JOB = "fz"
_SHARD = keys.shard_key(_JOB, 1, 0)

_scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-2, max_value=MiB),
    st.sampled_from([-1, 2**31, 2**63 - 1, 2**63, 10**19, 10**400, -10**19]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from([_SHARD, keys.manifest_key(_JOB, 1), f"{_JOB}/layouts/{'0' * 32}.layout", "../x", "",
                     "xxh3_64:0000000000000000", "dead", "alive"]),
)
_values = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                         st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                       max_leaves=8)
_CHECKSUM = "xxh3_64:0000000000000000"
#: numbers a field may get besides any JSON value: edges of every integer width, the shard's size and around it
_numbers = st.sampled_from([0, 1, -1, MiB - 1, MiB, MiB + 1, 2 * MiB, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64,
                            10**19, 10**400, float("inf"), float("-inf"), float("nan"), 1.5, True, False])


def _valid(path: str, other: int) -> dict:
    """A well-formed body for the route (``other``: the node that is not the receiver)."""
    row = {"job": _JOB, "step": 2, "rank": 0, "world": 1, "nbytes": MiB, "checksum": _CHECKSUM,
           "layout": "0" * 32, "values": [["pos", 1]], "save_index": 2, "metadata": {}, "node": other}
    return {
        "/v1/fetch": {"key": _SHARD, "size": MiB, "from": other, "checksum": _CHECKSUM},
        "/v1/publish": {"token": ".tmp-pull-0", "checksum": _CHECKSUM, "publish": True},
        "/v1/up": {"rows": [row], "reports": [["alive", other]], "epoch": 0},
        "/v1/down": {"manifests": ['{"format":"tierckpt-manifest"}'], "view": {"epoch": 0, "dead": []}},
    }[path]


@st.composite
def _mutated(draw, obj: dict) -> dict:
    """``obj`` with one to three of its fields (or of the first row's, for the commit tree) missing or replaced
    by a value of any type or size."""
    obj = json.loads(json.dumps(obj))
    for _ in range(draw(st.integers(1, 3))):
        target = obj
        if "rows" in obj and isinstance(obj["rows"], list) and obj["rows"] and draw(st.booleans()):
            target = obj["rows"][0]
        if not isinstance(target, dict) or not target:
            break
        name = draw(st.sampled_from(sorted(target)))
        how = draw(st.integers(0, 2))
        if how == 0:
            del target[name]
        else:
            target[name] = draw(_numbers if how == 1 else _values)
    return obj


@st.composite
def _post_body(draw, path: str, other: int):
    """A JSON body for one of the agent's routes: well formed, then fields missing or of any type or size."""
    choice = draw(st.integers(0, 9))
    if choice == 0:
        return draw(st.one_of(_values, st.binary(max_size=40)))
    if choice == 1:
        return _valid(path, other)
    return draw(_mutated(_valid(path, other)))


@st.composite
def _request(draw, route: str):
    """(node, method, path, query, headers, body) for ``route`` of the peer server of either node: one of
    the agent's POST routes, ``object`` (/v1/o/<key>, every method), ``list``, or ``plain`` (health, metrics)."""
    kind = "post" if route.startswith("/") else route
    node = draw(st.integers(0, 1))
    if kind == "post":
        path = route
        body = draw(_post_body(path, 1 - node))
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if draw(st.booleans()) and draw(st.booleans()):
            data, headers = zlib.compress(data), {"Content-Type": "application/x-tierckpt-deflate"}
        return node, "POST", path, None, headers, data
    if kind == "object":
        key = draw(st.one_of(st.sampled_from([_SHARD, keys.manifest_key(_JOB, 1), keys.manifest_key(_JOB, 2),
                                              f"{_JOB}/layouts/{'0' * 32}.layout", f"{_JOB}/index.json"]),
                             st.from_regex(r"[a-z]{1,3}/step-[0-9]{1,25}/rank-[0-9]{1,25}\.shard", fullmatch=True)))
        method = draw(st.sampled_from(["GET", "HEAD", "PUT", "DELETE"]))
        headers: dict = {}
        data = b""
        if method in ("GET", "HEAD") and draw(st.booleans()):
            a, b = draw(st.integers(0, 10**20)), draw(st.integers(0, 10**20))
            headers["Range"] = f"bytes={a}-{b}"
        if method == "PUT":
            data = draw(st.binary(max_size=64))
            if draw(st.booleans()):
                headers["X-Tierckpt-Checksum"] = draw(st.sampled_from(["xxh3_64:0000000000000000", "junk"]))
        return node, method, f"/v1/o/{key}", None, headers, data
    if kind == "list":
        query = {"prefix": draw(st.text(max_size=30)), "after": draw(st.text(max_size=30))}
        return node, "GET", "/v1/list", query, {}, b""
    return node, "GET", draw(st.sampled_from(["/v1/health", "/metrics"])), None, {}, b""


def _send(port: int, secret: bytes, method: str, path: str, query, headers: dict, data: bytes):
    from urllib.parse import quote, urlencode

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        hdrs = dict(headers)
        if method in ("POST", "PUT"):
            hdrs["Content-Length"] = str(len(data))
        hdrs.update(sign(secret, method, path, query, node=0,
                         content_length=len(data) if method in ("POST", "PUT") else None,
                         checksum=hdrs.pop("X-Tierckpt-Checksum", None)))
        url = quote(path) + ("?" + urlencode(query) if query else "")
        conn.request(method, url, body=data if method in ("POST", "PUT") else None, headers=hdrs)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_fuzzed_signed_requests_to_every_peer_server_route_never_get_a_500(tmp_path):
    """Signed requests with bodies of wrong types, huge numbers and missing fields, to every route of a real
    agent of two (each holds the shard the fetches name: node 0's own, node 1's replica), sent to either. Every
    answer is a status the route documents, never 500, and every refusal says why in one line."""
    c = Cluster(tmp_path, 2)
    try:
        with AgentClient(socket_path_for(c.shm(0))) as cl:
            _stage(cl, _JOB, 1, MiB)
        c.wait_for(lambda: c.holds(1, _JOB, 1), "the replica on node 1")
        secret = load_secret(c.secret)
        seen: dict[int, int] = {}

        def check(req):
            node, method, path, query, headers, data = req
            status, body = _send(c.ports[node], secret, method, path, query, headers, data)
            seen[status] = seen.get(status, 0) + 1
            # 502: a pull from the named node failed; 507: no room for it. Both say what failed.
            assert status < 500 or status in (502, 507), (status, body[:300], req)
            if status >= 400 and method != "HEAD":
                text = body.decode()
                assert text.endswith("\n") and "\n" not in text[:-1] and len(text) > 1, (status, text, req)
                assert "internal error" not in text, (status, text, req)

        for route, n in (("/v1/fetch", 300), ("/v1/publish", 100), ("/v1/up", 300), ("/v1/down", 150),
                         ("object", 300), ("list", 100), ("plain", 20)):
            settings(max_examples=n, deadline=None, derandomize=True, database=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])(
                given(_request(route))(check))()
        for i in (0, 1):
            assert c.procs[i].poll() is None, f"node {i}'s agent died"
            log = open(c.procs[i].log_path).read()
            # nor a 500 to a request forwarded up the commit tree (node 1 forwards rows to node 0, the root)
            assert "peer server failed on" not in log and "Traceback" not in log, log[-3000:]
        # the fuzz reached the routes' own checks, not only authentication
        assert 400 in seen and 200 in seen, seen
    finally:
        c.close()


# ---------------------------------------------------------------------- CLI errors
def _one_line_error(p: subprocess.CompletedProcess) -> None:
    assert p.returncode != 0, (p.returncode, p.stdout, p.stderr)
    lines = p.stderr.strip("\n").splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckpt: error: ") and "Traceback" not in p.stderr, p.stderr


def test_agent_refusing_a_public_address_without_a_secret_says_so_in_one_line(tmp_path):
    p = ckpt_cmd("agent", "--shm", str(tmp_path / "shm"), "--node-rank", "0",
                 "--peers", f"0.0.0.0:{free_port()},127.0.0.1:{free_port()}", timeout=60)
    _one_line_error(p)
    assert "secret" in p.stderr


def test_show_of_a_manifest_with_an_absurd_creation_time_is_one_line(tmp_path):
    from steps import commit_steps
    from tiers.disk import DiskTier

    disk = str(tmp_path / "disk")
    commit_steps(DiskTier(disk), "j", [3])
    path = os.path.join(disk, "j", "step-3", "manifest.json")
    text = open(path).read()
    with open(path, "w") as f:
        f.write(re.sub(r'"created":[0-9.e+]+', '"created":1e400', text))
    p = ckpt_cmd("show", "j", "--step", "3", "--disk", disk, "--shm", str(tmp_path / "noshm"))
    _one_line_error(p)


def test_cli_writing_to_a_closed_pipe_exits_quietly_with_141(tmp_path):
    """As ``ckpt placement ... | head -1`` should: no error line, no traceback, the shell's SIGPIPE status."""
    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run([sys.executable, "-m", "ckpt.cli", "placement", "--nodes", "64", "--replicas", "2"],
                           stdout=w, stderr=subprocess.PIPE, text=True, env=env(), timeout=120)
    finally:
        os.close(w)
    assert p.returncode == 141 and p.stderr == "", (p.returncode, p.stderr)


def test_an_unexpected_failure_inside_a_command_is_one_line_not_a_traceback(tmp_path):
    """Whatever a command raises, the user gets one line naming the error and a non-zero exit."""
    code = ("import sys, ckpt.cli as c\n"
            "def boom(a): raise RuntimeError('something unforeseen')\n"
            "c.cmd_list = boom\n"
            "sys.exit(c.main(['list', 'j', '--disk', sys.argv[1]]))\n")
    os.makedirs(tmp_path / "disk")
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "disk")], capture_output=True, text=True,
                       env=env(), timeout=120)
    _one_line_error(p)
    assert "something unforeseen" in p.stderr and "RuntimeError" in p.stderr


def _assert_new_run_committed(c) -> None:
    """Each node's memory holds a manifest of step 2 naming the shard it holds now (the new run's)."""
    from tiers.checksum import checksum_file

    for i in range(2):
        shard = os.path.join(c.shm(i), "rw", "step-2", f"rank-{i}.shard")
        c.wait_for(lambda i=i: c.holds(i, "rw", 2, rank=i), f"step 2 committed on node {i}")
        m = scan_tier(MemoryTier(c.shm(i)), "rw").job("rw")[2].manifest
        assert m is not None and m.shard(i).checksum == checksum_file(shard, MiB), \
            f"node {i} committed a manifest of the rewound run"


def _commit_steps_1_and_2(clients: list) -> None:
    """Both nodes' ranks (rank i on node i, world 2) save steps 1 and 2 of job rw; each is committed on both."""
    for step in (1, 2):
        for i in range(2):
            _stage(clients[i], "rw", step, MiB, rank=i, world=2)
        for i in range(2):
            assert clients[i].call("wait", job="rw", step=step, timeout=60)["done"]


def test_a_step_saved_again_after_a_rewind_commits_the_new_run_manifest_on_every_node(tmp_path):
    """Two nodes, one rank each. Step 2 is committed, both nodes rewind to step 1 (a restore), and the new
    run saves step 2 again with other bytes: every node commits a manifest naming the new bytes. The commit
    tree must not answer the new rows with the manifest of the run that was rewound."""
    c = Cluster(tmp_path, 2)
    try:
        clients = [AgentClient(socket_path_for(c.shm(i)), timeout=120) for i in range(2)]
        try:
            _commit_steps_1_and_2(clients)
            for i in range(2):
                assert clients[i].call("rewind", job="rw", step=1)["dropped"] == [2]
            for i in range(2):
                _stage(clients[i], "rw", 2, MiB, rank=i, world=2)
            for i in range(2):
                done = clients[i].call("wait", job="rw", step=2, timeout=60)
                assert done["done"] and done["errors"] == [], done
        finally:
            for cl in clients:
                cl.close()
        _assert_new_run_committed(c)
    finally:
        c.close()


def test_a_node_that_rewinds_first_refuses_the_manifest_of_the_rewound_run_from_the_commit_tree(tmp_path):
    """Node 1 restores and saves step 2 again before the commit tree's root (node 0) has rewound: the root
    still holds the old step 2 and answers node 1's new row with its manifest. Node 1 must not commit it
    over its new shard; once node 0 rewinds and saves too, both commit the new run's step 2."""
    c = Cluster(tmp_path, 2)
    try:
        clients = [AgentClient(socket_path_for(c.shm(i)), timeout=120) for i in range(2)]
        try:
            _commit_steps_1_and_2(clients)
            assert clients[1].call("rewind", job="rw", step=1)["dropped"] == [2]
            caught_up = clients[1].call("status")["tree"]["stats"]["catch_ups"]
            _stage(clients[1], "rw", 2, MiB, rank=1, world=2)
            # the root answers the new row with the manifest it holds for step 2: the rewound run's
            c.wait_for(lambda: clients[1].call("status")["tree"]["stats"]["catch_ups"] > caught_up,
                       "the root's answer to node 1's new row", timeout=60)
            assert clients[0].call("rewind", job="rw", step=1)["dropped"] == [2]
            _stage(clients[0], "rw", 2, MiB, rank=0, world=2)
            for i in range(2):
                done = clients[i].call("wait", job="rw", step=2, timeout=90)
                assert done["done"] and done["errors"] == [], done
        finally:
            for cl in clients:
                cl.close()
        _assert_new_run_committed(c)
    finally:
        c.close()
