"""Membership from a real etcd (started here, one member and three): agents register with a lease and watch;
a node replaced at a new address is taken in by every agent with no file edited, a node whose lease expires
is dead at once, and an etcd outage changes nothing for the running agents."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from etcd_server import Etcd, etcd_missing
from procs import AgentGroup, agent_call, closing_all, kill9, start_agent, write_secret
from s3util import free_port
from test_e2e_faults import _stage_ranks

_WHY = etcd_missing()
if _WHY is not None:
    print(f"test_e2e_etcd: skipped: {_WHY}")
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(_WHY is not None, reason=_WHY or "")]


class EtcdCluster(AgentGroup):
    def __init__(self, root, n: int, members: int = 1, extra: tuple = (), auto: bool = False) -> None:
        self.extra = list(extra)
        self.auto = auto  # --node-rank auto: machine i claims a rank in etcd (not necessarily i)
        self.root = root
        self.n = n
        self.etcd = Etcd(str(root), members)
        self.secret = write_secret(str(root / "secret"))
        self.ports = [free_port() for _ in range(n)]
        self.gen = {i: 0 for i in range(n)}
        self.procs: dict[int, object] = {}
        if auto:  # every machine at once: the ranks they claim are raced for
            with ThreadPoolExecutor(n) as pool:
                list(pool.map(self.start, range(n)))
        else:
            for i in range(n):
                self.start(i)

    def args(self, i: int) -> list[str]:
        return ["--etcd", self.etcd.endpoints, "--cluster", "c1", "--nodes", str(max(self.n, i + 1)),
                "--node-rank", "auto" if self.auto else str(i), "--advertise", f"127.0.0.1:{self.ports[i]}",
                "--secret-file", self.secret, "--heartbeat", "0.2", "--dead-after", "3", "--startup-grace", "20",
                *self.extra]

    def shm(self, i: int) -> str:
        return str(self.root / f"node{i}-{self.gen[i]}" / "shm")

    def start(self, i: int) -> None:
        if i not in self.gen:  # a node added to the running cluster
            self.gen[i] = 0
            self.ports.append(free_port())
        os.makedirs(os.path.dirname(self.shm(i)), exist_ok=True)
        self.procs[i] = start_agent(self.shm(i), *self.args(i))

    def replace(self, i: int) -> None:
        """Node ``i``'s machine is lost; a new one, at a new address, starts its agent with the same rank."""
        kill9(self.procs.pop(i))
        shutil.rmtree(os.path.dirname(self.shm(i)))
        self.gen[i] += 1
        self.ports[i] = free_port()
        self.start(i)

    def manifest(self, i: int, job: str, step: int) -> bool:
        return os.path.exists(os.path.join(self.shm(i), job, f"step-{step}", "manifest.json"))

    def stage(self, job: str, step: int, nodes) -> None:
        """Rank ``r`` hands its shard of ``step`` to the agent of node ``nodes[r]``, all at once."""
        _stage_ranks({r: self.shm(n) for r, n in enumerate(nodes)}, job, step, 1 << 20, len(nodes))

    def close(self) -> None:
        self.stop_agents()
        self.etcd.close()


@pytest.fixture
def etcd_cluster(tmp_path):
    with closing_all(lambda *a, **kw: EtcdCluster(tmp_path, *a, **kw)) as make:
        yield make


def test_a_node_replaced_at_a_new_address_is_taken_in_through_etcd_and_restores_from_peer_memory(etcd_cluster):
    c = etcd_cluster(4)  # group placement, 2 copies: node 3's partner is node 2
    c.stage("e", 1, [0, 1, 2, 3])
    c.wait_for(lambda: all(c.manifest(i, "e", 1) for i in range(4)), "step 1 on every node")
    c.wait_for(lambda: c.status(0)["etcd"]["registered"] == [0, 1, 2, 3], "every node registered")
    copy = os.path.join(c.shm(2), "e", "step-1", "rank-3.shard")
    c.wait_for(lambda: os.path.exists(copy), "rank 3's copy on node 2")
    partner_copy = open(copy, "rb").read()
    c.replace(3)  # no file edited anywhere: the new agent registers its new address
    new = f"127.0.0.1:{c.ports[3]}"
    rep = agent_call(c.shm(3), "prefetch", timeout=120)
    assert rep["steps"] == {"e": 1}, rep
    assert open(os.path.join(c.shm(3), "e", "step-1", "rank-3.shard"), "rb").read() == partner_copy
    c.wait_for(lambda: all(p["addr"] == new and p["alive"] for i in range(3) for p in c.status(i)["peers"]
                           if p["node"] == 3), "nodes 0 to 2 at node 3's new address")
    c.stage("e", 2, [0, 1, 2, 3])
    c.wait_for(lambda: all(c.manifest(i, "e", 2) for i in range(4)), "step 2 on every node, the new one included")


def test_a_node_registered_past_the_clusters_size_joins_it(etcd_cluster):
    """Three agents started with --nodes 3; a fourth registers as node 3 (--nodes 4). Every agent takes it in
    without a restart (its peers file grows to 4 lines, the quorum becomes 3 of 4), and a step saved by ranks
    on all four nodes commits everywhere."""
    c = etcd_cluster(3)
    c.start(3)
    c.wait_for(lambda: all(c.status(i)["tree"]["nodes"] == 4 for i in range(4)), "every agent counting 4 nodes")
    assert all(c.status(i)["tree"]["quorum"] == 3 for i in range(4))
    for i in range(3):
        lines = open(os.path.join(c.shm(i), ".peers.txt")).read().splitlines()
        assert len(lines) == 4 and lines[3].startswith(f"127.0.0.1:{c.ports[3]}"), lines
    c.wait_for(lambda: c.status(0)["etcd"]["registered"] == [0, 1, 2, 3], "node 3 registered")
    c.stage("g", 1, [0, 1, 2, 3])
    c.wait_for(lambda: all(c.manifest(i, "g", 1) for i in range(4)), "step 1 on every node, the new one included")


def test_an_expired_lease_is_a_death_and_an_etcd_outage_is_not(etcd_cluster):
    # heartbeats take 10 s to find a death here, the etcd lease 2 s: the lease is what tells
    c = etcd_cluster(3, members=3, extra=("--dead-after", "10", "--etcd-lease", "2"))
    c.stage("o", 1, [0, 1, 2])
    c.wait_for(lambda: all(c.manifest(i, "o", 1) for i in range(3)), "step 1 on every node")
    # one etcd member down: the others serve, and nothing changes for the agents
    c.etcd.stop(0)
    c.stage("o", 2, [0, 1, 2])
    c.wait_for(lambda: all(c.manifest(i, "o", 2) for i in range(3)), "step 2 with one etcd member down")
    c.etcd.start(0)
    # all of etcd down for longer than the leases: no node is declared dead for it, and saves commit
    for i in range(3):
        c.etcd.stop(i)
    t0 = time.monotonic()
    step = 3
    while time.monotonic() - t0 < 10:
        c.stage("o", step, [0, 1, 2])
        c.wait_for(lambda s=step: all(c.manifest(i, "o", s) for i in range(3)), f"step {step} with etcd down")
        step += 1
        time.sleep(1.0)
    assert all(c.status(i)["etcd"]["outage_s"] is not None for i in range(3))
    for i in range(3):
        assert not re.search(r"node \d+ \(\S+\) declared dead", c.log(i)), c.log(i)[-2000:]
    for i in range(3):
        c.etcd.start(i, wait=False)
    for i in range(3):
        c.etcd.wait_ready(i)
    c.wait_for(lambda: all(c.status(i)["etcd"]["outage_s"] is None for i in range(3)), "every agent back on etcd")
    c.wait_for(lambda: c.status(0)["etcd"]["registered"] == [0, 1, 2], "every node registered again")
    for i in range(3):  # etcd back: leases it held through the outage are not taken for deaths either
        assert not re.search(r"node \d+ \(\S+\) declared dead", c.log(i)), c.log(i)[-2000:]
    # node 1 killed: its lease expires and the others declare it dead for that
    kill9(c.procs.pop(1))
    killed = time.monotonic()
    c.wait_for(lambda: all("node 1 (127.0.0.1" in c.log(i) and "declared dead: its etcd lease expired and it does not answer" in c.log(i)
                           for i in (0, 2)), "node 1 dead on nodes 0 and 2, by its lease")
    assert time.monotonic() - killed < 10  # before any heartbeat could have said so
    c.wait_for(lambda: all(not p["alive"] for i in (0, 2) for p in c.status(i)["peers"] if p["node"] == 1),
               "node 1 dead in every view")


def _etcd_get(c: EtcdCluster, key: str) -> dict | None:
    import base64
    import json
    import urllib.request

    req = urllib.request.Request(c.etcd.endpoints.split(",")[0] + "/v3/kv/range", method="POST",
                                 data=json.dumps({"key": base64.b64encode(key.encode()).decode()}).encode())
    with urllib.request.urlopen(req, timeout=10) as r:
        kvs = json.loads(r.read()).get("kvs", [])
    return json.loads(base64.b64decode(kvs[0]["value"])) if kvs else None


def _etcd_put(c: EtcdCluster, key: str, value: dict) -> None:
    import base64
    import json
    import urllib.request

    body = {"key": base64.b64encode(key.encode()).decode(), "value": base64.b64encode(json.dumps(value).encode()).decode()}
    req = urllib.request.Request(c.etcd.endpoints.split(",")[0] + "/v3/kv/put", method="POST",
                                 data=json.dumps(body).encode())
    urllib.request.urlopen(req, timeout=10).read()


def _etcd_fence(c: EtcdCluster, key: str, raise_by: int) -> tuple[dict, int]:
    """Write an epoch ``raise_by`` above the one recorded at ``key``, in a transaction that holds only if the
    key is unchanged since it was read (a root elected meanwhile reads again): returns (the record it
    replaced, the epoch written)."""
    import base64
    import json
    import urllib.request

    url = c.etcd.endpoints.split(",")[0]
    b64 = base64.b64encode(key.encode()).decode()
    while True:
        req = urllib.request.Request(url + "/v3/kv/range", method="POST", data=json.dumps({"key": b64}).encode())
        with urllib.request.urlopen(req, timeout=10) as r:
            kv = json.loads(r.read())["kvs"][0]
        held = json.loads(base64.b64decode(kv["value"]))
        value = {"epoch": held["epoch"] + raise_by, "node": (held["node"] + 1) % c.n, "addr": "elsewhere:1"}
        txn = {"compare": [{"key": b64, "target": "MOD", "result": "EQUAL", "mod_revision": kv["mod_revision"]}],
               "success": [{"request_put": {"key": b64, "value": base64.b64encode(json.dumps(value).encode())
                                            .decode()}}]}
        req = urllib.request.Request(url + "/v3/kv/txn", method="POST", data=json.dumps(txn).encode())
        with urllib.request.urlopen(req, timeout=10) as r:
            if json.loads(r.read()).get("succeeded"):
                return held, value["epoch"]


def _agent_elsewhere(c: EtcdCluster, rank: int, home) -> subprocess.CompletedProcess:
    """An agent on another machine (its own folder and address) asking for ``rank``, run to its end."""
    shm = str(home / "shm")
    os.makedirs(os.path.dirname(shm))
    args = c.args(rank)
    args[args.index("--advertise") + 1] = f"127.0.0.1:{free_port()}"
    return subprocess.run([sys.executable, "-m", "ckpt.cli", "agent", "--shm", shm, *args], capture_output=True,
                          text=True, timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_machines_started_together_with_node_rank_auto_claim_distinct_ranks_and_a_restart_gets_its_own_back(
        etcd_cluster):
    """Three agents started at the same moment with --node-rank auto (as a DaemonSet starts them) each
    claim a different rank in one etcd transaction; a step on all three commits. Machine 1's agent is
    killed and started again at once, while its old lease still lives: it takes its own rank back (kept in
    its memory folder), not a new one, and the cluster commits again with the same three ranks."""
    c = etcd_cluster(3, auto=True)
    ranks = {i: c.status(i)["node"] for i in range(3)}
    assert sorted(ranks.values()) == [0, 1, 2], ranks
    for i, r in ranks.items():
        # awaited, not read at once: with --dead-after 3 a lease can lapse for a moment on a loaded machine, and
        # the agent registers again
        c.wait_for(lambda i=i, r=r: (_etcd_get(c, f"/tierckpt/c1/nodes/{r}") or {}).get("addr")
                   == f"127.0.0.1:{c.ports[i]}", f"rank {r}'s key naming machine {i}")
        assert open(os.path.join(c.shm(i), ".node-rank")).read().strip() == str(r)
    by_rank = {r: i for i, r in ranks.items()}
    c.stage("a", 1, [by_rank[0], by_rank[1], by_rank[2]])
    c.wait_for(lambda: all(c.manifest(i, "a", 1) for i in range(3)), "step 1 on every node")
    kill9(c.procs.pop(1))
    c.start(1)  # the same machine: same memory folder, same address
    assert c.status(1)["node"] == ranks[1]
    assert "claimed in etcd again (this machine's before)" in c.log(1)
    c.wait_for(lambda: c.status(by_rank[0])["etcd"]["registered"] == [0, 1, 2], "the restarted node registered")
    c.stage("a", 2, [by_rank[0], by_rank[1], by_rank[2]])
    c.wait_for(lambda: all(c.manifest(i, "a", 2) for i in range(3)), "step 2 on every node")


def test_a_second_agent_asking_for_a_live_nodes_rank_is_refused_and_takes_nothing(etcd_cluster, tmp_path):
    """An agent started with --node-rank 1 while node 1's agent is alive elsewhere exits with a message
    naming the live agent and what to do; node 1's registration is untouched and the cluster still
    commits. (Before, its registration silently overwrote node 1's.)"""
    c = etcd_cluster(2)
    c.wait_for(lambda: _etcd_get(c, "/tierckpt/c1/nodes/1") is not None, "node 1 registered")
    before = _etcd_get(c, "/tierckpt/c1/nodes/1")
    p = _agent_elsewhere(c, 1, tmp_path / "intruder")
    out = p.stdout + p.stderr
    assert p.returncode == 2, out
    assert f"node rank 1 of cluster 'c1' is registered in etcd by a live agent at 127.0.0.1:{c.ports[1]}" in out
    assert "give this node another --node-rank" in out
    # node 1's agent still runs as node 1 (a key taken from it would have stopped it), and holds its key
    assert c.procs[1].poll() is None
    c.wait_for(lambda: _etcd_get(c, "/tierckpt/c1/nodes/1") == before, "node 1's key as it was")
    c.stage("i", 1, [0, 1])
    c.wait_for(lambda: all(c.manifest(i, "i", 1) for i in range(2)), "step 1 on both nodes")


def test_an_agent_whose_rank_is_taken_over_in_etcd_stops_acting_as_that_node(etcd_cluster):
    """Node 1's key is rewritten by another agent, one that answers at its address (what a replacement does
    once node 1 stopped answering, e.g. while it was cut off): node 1's agent finds it (on its watch, in its
    listing, or when it registers again, whichever comes first), says so, and exits with status 4 instead
    of acting as a second node 1."""
    import socket

    c = etcd_cluster(2)
    with socket.create_server(("127.0.0.1", 0)) as other:  # the replacement: it accepts connections
        addr = f"127.0.0.1:{other.getsockname()[1]}"
        _etcd_put(c, "/tierckpt/c1/nodes/1", {"rank": 1, "addr": addr, "domain": None, "role": "train", "pid": 1})
        assert c.procs[1].wait(timeout=120) == 4
    # one line names the agent that holds the rank now and says this one stops
    assert any(f"agent at {addr}" in ln and "this agent stops (its node was replaced)" in ln
               for ln in c.log(1).splitlines()), c.log(1)[-2000:]


def test_the_commit_roots_epoch_is_recorded_in_etcd_and_a_higher_one_there_unseats_the_root(etcd_cluster):
    """Each won epoch is written to /tierckpt/<cluster>/root before the winner acts. A higher epoch recorded
    there (what a root elected on the other side of a partition writes) makes the sitting root stop at once,
    though it still sees every node; the next election takes an epoch above it, records it, and steps
    commit again."""
    c = etcd_cluster(3)

    def tree(i: int) -> dict:
        return c.status(i)["tree"]

    def root_above(epoch: int):
        """The root every node follows, of an epoch above ``epoch``, or None (which node wins depends on which
        agent was up first: on a loaded machine not always node 0)."""
        trees = [tree(i) for i in range(3)]
        roots = [i for i, t in enumerate(trees) if t["is_root"]]
        if len(roots) != 1 or trees[roots[0]]["epoch"] <= epoch or any(t["epoch"] != trees[roots[0]]["epoch"]
                                                                       for t in trees):
            return None
        return roots[0], trees[roots[0]]["epoch"]

    c.wait_for(lambda: root_above(0), "a root elected")
    root, first = root_above(0)
    c.wait_for(lambda: (_etcd_get(c, "/tierckpt/c1/root") or {}).get("epoch") == first, "the epoch in etcd")
    assert _etcd_get(c, "/tierckpt/c1/root")["node"] == root
    c.stage("r", 1, [0, 1, 2])
    c.wait_for(lambda: all(c.manifest(i, "r", 1) for i in range(3)), "step 1 on every node")
    # every win is recorded before its winner acts, so the record replaced here is the newest win (a loaded
    # machine may have elected again since ``first``)
    held, fenced = _etcd_fence(c, "/tierckpt/c1/root", 10)
    root, last = held["node"], held["epoch"]
    c.wait_for(lambda: tree(root)["promised"] >= fenced, "the root following the epoch etcd records")
    c.wait_for(lambda: root_above(fenced), "a root elected above it")
    root, epoch = root_above(fenced)
    rec = _etcd_get(c, "/tierckpt/c1/root")
    assert rec["epoch"] == epoch and rec["node"] == root, rec
    for i in range(3):  # no epoch at or below the fence was won
        assert not [e for e in tree(i)["won_epochs"] if last < e <= fenced], tree(i)
    c.stage("r", 2, [0, 1, 2])
    c.wait_for(lambda: all(c.manifest(i, "r", 2) for i in range(3)), "step 2 on every node")


def test_a_node_retired_in_etcd_leaves_the_running_cluster_and_its_rank_is_not_claimed_again(etcd_cluster, tmp_path):
    """Three agents commit a step. `ckpt retire 2` is refused while node 2's agent answers (nothing changes);
    with --force node 2's agent stops (status 4, saying it was retired), nodes 0 and 1 count 2 nodes with no
    restart, the heal makes up a second copy of node 2's shard of step 1 on the two left, and a step saved
    by two ranks commits on both. An agent started again with rank 2 is refused; --node-rank auto takes 3."""
    from procs import ckpt_cmd

    c = etcd_cluster(3)
    c.wait_for(lambda: c.status(0)["etcd"]["registered"] == [0, 1, 2], "every node registered")
    c.stage("ret", 1, [0, 1, 2])
    c.wait_for(lambda: all(c.manifest(i, "ret", 1) for i in range(3)), "step 1 on every node")
    shard2 = open(os.path.join(c.shm(2), "ret", "step-1", "rank-2.shard"), "rb").read()
    before = _etcd_get(c, "/tierckpt/c1/nodes/2")

    refused = ckpt_cmd("retire", "--etcd", c.etcd.endpoints, "--cluster", "c1", "2")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert f"node 2 of cluster 'c1' is registered by an agent that answers at 127.0.0.1:{c.ports[2]}" \
        in refused.stderr and "--force" in refused.stderr, refused.stderr
    assert _etcd_get(c, "/tierckpt/c1/nodes/2") == before and c.procs[2].poll() is None

    done = ckpt_cmd("retire", "--etcd", c.etcd.endpoints, "--cluster", "c1", "--force", "2")
    assert done.returncode == 0 and f"node 2: retired (last at 127.0.0.1:{c.ports[2]})" in done.stdout, \
        done.stdout + done.stderr
    assert c.procs[2].wait(timeout=120) == 4
    assert "node rank 2 was retired in etcd" in c.log(2) and "this agent stops (its node was retired)" in c.log(2)
    c.wait_for(lambda: all(c.status(i)["tree"]["nodes"] == 2 for i in (0, 1)), "nodes 0 and 1 counting 2 nodes")
    for i in (0, 1):
        assert {p["node"] for p in c.status(i)["peers"]} == {1 - i}
    copies = [os.path.join(c.shm(i), "ret", "step-1", "rank-2.shard") for i in (0, 1)]
    c.wait_for(lambda: all(os.path.exists(p) for p in copies), "node 2's shard of step 1 on both nodes left")
    assert all(open(p, "rb").read() == shard2 for p in copies)
    c.stage("ret", 2, [0, 1])
    c.wait_for(lambda: all(c.manifest(i, "ret", 2) for i in (0, 1)), "step 2 committed on both nodes left")

    again = _agent_elsewhere(c, 2, tmp_path / "again")
    assert again.returncode == 2 and "node rank 2 of cluster 'c1' is retired in etcd" in again.stderr, again.stderr
    assert _etcd_get(c, "/tierckpt/c1/nodes/2")["role"] == "retired"
    c.auto = True
    c.start(3)
    c.wait_for(lambda: (_etcd_get(c, "/tierckpt/c1/nodes/3") or {}).get("addr") == f"127.0.0.1:{c.ports[3]}",
               "the new machine registered as rank 3")
    c.wait_for(lambda: all(c.status(i)["tree"]["nodes"] == 3 for i in (0, 1, 3)), "three nodes counted again")
