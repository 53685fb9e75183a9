"""Agents on separate hosts: one network namespace per node, each agent bound to its own address, and links
taken down, partitions made and healed under them (see ``tests/netns.py``).

What must hold under every fault: no healthy node declared dead by another healthy one, at most one commit
root per epoch, no step committed without every rank's row, one manifest per step on every node that holds
it, and checkpointing back on every node once the network is.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import time

import pytest

from netns import Hosts, unavailable
from procs import AgentGroup, agent_call, closing_all, ckpt_cmd, kill9, start_agent, write_secret
from test_e2e_faults import _stage_ranks
from test_e2e_multinode import reference  # noqa: F401 - the uninterrupted run's losses (a fixture)

pytestmark = pytest.mark.e2e

_WHY = unavailable()
if _WHY is not None:
    print(f"test_e2e_netns: skipped: {_WHY}")
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(_WHY is not None, reason=_WHY or "")]

PORT = 7700
DEAD_AFTER = 2.0
# every agent here starts within seconds of the others: a short start-up grace
ARGS = ["--heartbeat", "0.2", "--dead-after", str(DEAD_AFTER), "--startup-grace", "5", "--replicas", "2"]


class NetCluster(AgentGroup):
    """``n`` agents, node ``i`` in namespace ``i`` at its own address, one rank per training node; the last
    ``memory`` nodes are memory-only (they train nothing and take the others' copies)."""

    def __init__(self, root, n: int, memory: int = 0) -> None:
        self.root = root
        self.hosts = Hosts(n)
        self.n = n
        self.memory = memory
        self.peers = str(root / "peers.txt")
        self.moved = {}
        self.write_peers()
        self.secret = write_secret(str(root / "secret"))
        self.procs: dict[int, object] = {}
        try:
            for i in range(n):
                self.start(i)
        except BaseException:
            self.close()
            raise

    def shm(self, i: int) -> str:
        return str(self.root / f"node{i}" / "shm") if i not in self.moved else str(self.root / f"node{i}-new" / "shm")

    def host(self, i: int) -> int:
        """The namespace node ``i`` runs in (another one once it was replaced)."""
        return self.moved.get(i, i)

    def write_peers(self) -> None:
        tmp = self.peers + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(f"{self.hosts.addr(self.host(i))}:{PORT}{' role=memory' if self.is_memory(i) else ''}\n"
                         for i in range(self.n))
        os.replace(tmp, self.peers)  # each agent reads a whole file, old or new

    def is_memory(self, i: int) -> bool:
        return i >= self.n - self.memory

    def start(self, i: int) -> None:
        os.makedirs(os.path.dirname(self.shm(i)), exist_ok=True)
        # every node runs the same command: its rank is the line of the peers file with its own address
        self.procs[i] = start_agent(self.shm(i), "--node-rank", "auto", "--peers", self.peers, "--secret-file",
                                    self.secret, *ARGS, *(["--memory-only"] if self.is_memory(i) else []),
                                    prefix=self.hosts.prefix(self.host(i)))

    def replace(self, i: int) -> None:
        """Node ``i``'s machine is lost (agent killed, memory gone); a new machine at a new address takes
        its line in the peers file, and its agent starts there. The other agents keep running."""
        kill9(self.procs.pop(i))
        shutil.rmtree(self.shm(i))
        self.moved = {**self.moved, i: self.hosts.add()}
        self.write_peers()
        self.start(i)

    def manifest(self, i: int, job: str, step: int) -> bytes | None:
        try:
            with open(os.path.join(self.shm(i), job, f"step-{step}", "manifest.json"), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def stage(self, job: str, step: int, nodes=None) -> None:
        """Rank ``i`` of the training nodes' world hands its shard of ``step`` to node ``i``'s agent, all at once."""
        world = self.n - self.memory
        _stage_ranks({i: self.shm(i) for i in (range(world) if nodes is None else nodes)}, job, step, 1 << 20, world)

    def committed_everywhere(self, job: str, step: int) -> bool:
        return all(self.manifest(i, job, step) is not None for i in range(self.n))

    def check_invariants(self, job: str, steps) -> None:
        """One manifest per step on every node that holds it; at most one root per epoch."""
        for s in steps:
            got = {self.manifest(i, job, s) for i in range(self.n)} - {None}
            assert len(got) <= 1, f"step {s} has {len(got)} different manifests"
        roots: dict[int, set[int]] = {}
        for i in range(self.n):
            for e in self.status(i)["tree"]["won_epochs"]:
                roots.setdefault(e, set()).add(i)
        assert all(len(r) == 1 for r in roots.values()), f"two roots in one epoch: {roots}"

    def false_deaths(self, healthy: set[int]) -> list[str]:
        """Lines where a healthy node declared another healthy node dead."""
        out = []
        for i in healthy:
            for m in re.finditer(r"node (\d+) \(\S+\) declared dead", self.log(i)):
                if int(m.group(1)) in healthy:
                    out.append(f"node {i}: {m.group(0)}")
        return out

    def close(self) -> None:
        self.stop_agents()
        self.hosts.close()


@pytest.fixture
def net(tmp_path):
    with closing_all(lambda *a, **kw: NetCluster(tmp_path, *a, **kw)) as make:
        yield make


def test_agents_on_their_own_addresses_commit_every_step_on_every_node(net):
    c = net(4)
    for step in (1, 2):
        c.stage("base", step)
        c.wait_for(lambda s=step: c.committed_everywhere("base", s), f"step {step} on every node")
    st = [c.status(i)["tree"] for i in range(4)]
    assert {t["root"] for t in st} == {0} and [t["is_root"] for t in st] == [True, False, False, False]
    assert all(t["blocked"] is None for t in st)
    c.check_invariants("base", (1, 2))


def test_a_link_down_longer_than_dead_after_loses_nothing_and_checkpointing_resumes_everywhere(net):
    """Node 3's link goes down for 3x dead_after while every rank saves: the other three keep each other
    alive, node 3 holds its step and says why, and once the link is back the step commits on all four."""
    c = net(4)
    c.stage("blip", 1)
    c.wait_for(lambda: c.committed_everywhere("blip", 1), "step 1 on every node")
    c.hosts.link(3, up=False)
    down_at = time.monotonic()
    c.stage("blip", 2)
    c.wait_for(lambda: "1 of 4 nodes alive" in (c.status(3)["tree"]["blocked"] or ""), "node 3 says it is cut off")
    out = ckpt_cmd("status", "--shm", c.shm(3)).stdout
    assert "CANNOT COMMIT: this node sees 1 of 4 nodes alive" in out, out
    # a trainer on node 3 waiting for its step is told why, well before its timeout
    t0 = time.monotonic()
    got = agent_call(c.shm(3), "wait", job="blip", step=2, timeout=600)
    assert not got["done"] and any("cannot commit" in e and "1 of 4 nodes" in e for e in got["errors"]), got
    assert time.monotonic() - t0 < 120
    for i in range(3):
        assert c.manifest(i, "blip", 2) is None  # rank 3's row never reached a root: nothing committed
    while time.monotonic() - down_at < 3 * DEAD_AFTER:
        time.sleep(0.1)
    c.hosts.link(3, up=True)
    healed = c.wait_for(lambda: c.committed_everywhere("blip", 2), "step 2 on every node after the link is back")
    c.stage("blip", 3)
    c.wait_for(lambda: c.committed_everywhere("blip", 3), "step 3 on every node")
    assert c.false_deaths({0, 1, 2}) == []
    c.check_invariants("blip", (1, 2, 3))
    print(f"link blip: step 2 committed on every node {healed:.1f} s after the link came back")


def test_a_two_two_partition_commits_nothing_on_either_side_and_heals_into_one_history(net):
    c = net(4)
    c.stage("split", 1)
    c.wait_for(lambda: c.committed_everywhere("split", 1), "step 1 on every node")
    c.hosts.partition({2, 3})
    c.stage("split", 2)
    for i in range(4):  # each node sees it itself, or hears it from its parent when its rows go up
        c.wait_for(lambda i=i: "2 of 4 nodes alive" in (c.status(i)["tree"]["blocked"] or ""),
                   f"node {i} says it has no quorum")
    time.sleep(2 * DEAD_AFTER)  # time enough for a wrong commit to show; nothing may appear
    assert all(c.manifest(i, "split", 2) is None for i in range(4))
    assert not any(c.status(i)["tree"]["is_root"] for i in range(4))
    c.hosts.heal()
    c.wait_for(lambda: c.committed_everywhere("split", 2), "step 2 on every node after healing")
    c.stage("split", 3)
    c.wait_for(lambda: c.committed_everywhere("split", 3), "step 3 on every node")
    assert c.false_deaths({0, 1}) == [] and c.false_deaths({2, 3}) == []
    assert sum(c.status(i)["tree"]["is_root"] for i in range(4)) == 1
    c.check_invariants("split", (1, 2, 3))


def test_a_node_replaced_at_a_new_address_joins_without_restarting_the_others_and_restores_from_peer_memory(net):
    """Node 3's machine is lost. A new machine at another address takes node 3's line of the peers file; the
    running agents take it in (no restart), its agent pulls rank 3's shard of the newest step from its
    partner's memory at start, and the next step commits on all four, copied to the new machine's partner."""
    c = net(4)  # group placement, 2 copies: node 3's partner is node 2
    for step in (1, 2):
        c.stage("moved", step)
        c.wait_for(lambda s=step: c.committed_everywhere("moved", s), f"step {step} on every node")
    shard = lambda i, s, r: os.path.join(c.shm(i), "moved", f"step-{s}", f"rank-{r}.shard")  # noqa: E731
    want = open(shard(2, 2, 3), "rb").read()
    c.replace(3)
    new_addr = f"{c.hosts.addr(c.host(3))}:{PORT}"
    rep = agent_call(c.shm(3), "prefetch", timeout=120)
    assert rep["state"] == "done" and rep["steps"] == {"moved": 2}, rep
    assert open(shard(3, 2, 3), "rb").read() == want  # from node 2's memory, not from any disk
    c.wait_for(lambda: all(p["addr"] == new_addr and p["alive"] for i in range(3) for p in c.status(i)["peers"]
                           if p["node"] == 3), "every running agent at node 3's new address")
    c.stage("moved", 3)
    c.wait_for(lambda: c.committed_everywhere("moved", 3), "step 3 on every node, the new machine included")
    c.wait_for(lambda: os.path.exists(shard(2, 3, 3)), "the new machine's shard of step 3 copied to node 2")
    assert all("taking in the new machine" in c.log(i) for i in range(3))
    c.check_invariants("moved", (1, 2, 3))


def test_torchrun_across_two_hosts_resumes_bit_exact_from_memory_after_a_rank_is_killed(tmp_path, reference):
    """2 hosts x 2 FSDP2 ranks (gloo), the README's multi-node recipe with its cross-host flags: torchrun's
    c10d rendezvous at host 0's address, each host's agent on its own address, gloo on the host's own
    interface (its host name resolves to 127.0.0.1 here, as on many machines). Rank 1 kill -9s itself after
    step 7; torchrun restarts all four, each restores step 7 from its own host's memory, and the losses
    match an uninterrupted run."""
    import subprocess
    import sys

    from procs import TRAINER, env, losses, read_events
    from test_e2e_multinode import NPROC, STEPS

    hosts = Hosts(2)
    agents, runs = [], []
    try:
        peers = str(tmp_path / "peers.txt")
        with open(peers, "w") as f:
            f.writelines(f"{hosts.addr(i)}:{PORT}\n" for i in range(2))
        secret = write_secret(str(tmp_path / "secret"))
        shm = [str(tmp_path / f"node{i}" / "shm") for i in range(2)]
        for i in range(2):
            os.makedirs(os.path.dirname(shm[i]))
            agents.append(start_agent(shm[i], "--node-rank", str(i), "--peers", peers, "--secret-file", secret,
                                      *ARGS, prefix=hosts.prefix(i)))
        out = str(tmp_path / "ev")
        for i in range(2):
            cmd = [*hosts.prefix(i), sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                   "--nproc-per-node", str(NPROC), "--max-restarts", "1", "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", f"{hosts.addr(0)}:29400", "--rdzv-id", "hosts",
                   "--rdzv-conf", f"is_host={1 if i == 0 else 0}", "--local-addr", hosts.addr(i),
                   TRAINER, "--fsdp", "--gpt", "--steps", str(STEPS), "--out", out, "--job", "hosts",
                   "--shm", shm[i], "--no-spawn", "--kill-rank", "1", "--kill-at", "7"]
            runs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                         start_new_session=True, env=env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                                                 GLOO_SOCKET_IFNAME=hosts.ifname(i))))
        for r in runs:
            _, err = r.communicate(timeout=600)
            assert r.returncode == 0, err[-6000:]
    finally:
        for p in runs + agents:
            if p.poll() is None:
                kill9(p)
        hosts.close()
    for rank in range(2 * NPROC):
        events = read_events(f"{out}.{rank}")
        restored = [e for e in events if "restored" in e]
        assert restored == [{"restored": 7, "tiers": ["memory"]}], (rank, restored)
        after = events[events.index(restored[0]) + 1:]
        assert {e["step"]: e["loss"] for e in after} == {s: reference[rank][s] for s in range(8, STEPS)}
        assert losses(events[:events.index(restored[0])]) == {s: reference[rank][s] for s in range(8)}


def test_a_link_cut_in_the_middle_of_a_restore_falls_back_to_the_other_copy_and_never_gives_wrong_bytes(net):
    """A restore of rank 3's shard reads node 3's copy first, slowly (through a pacing proxy, 8 MB/s), with node
    2's copy as the next source. Node 3's link goes down in the middle of the read: the restore finishes
    from node 2, and its bytes are the shard's, checksum-verified."""
    from recovery import fetch_shard, plan_restore, scan_tiers
    from s3util import FaultProxy
    from tiers.peer import PeerTier
    from tiers.wire import load_secret

    c = net(4)
    c.hosts.gateway()
    # 32 MiB shards: at 8 MB/s a read from node 3 takes about 4 s
    data = _stage_ranks({i: c.shm(i) for i in range(4)}, "cut", 1, 32 << 20, world=4)
    c.wait_for(lambda: c.committed_everywhere("cut", 1), "step 1 on every node")
    c.wait_for(lambda: os.path.exists(os.path.join(c.shm(2), "cut", "step-1", "rank-3.shard")), "node 2's copy")
    secret = load_secret(c.secret)
    with FaultProxy(f"http://{c.hosts.addr(3)}:{PORT}", rate=8e6) as slow:
        first = PeerTier(slow.url.removeprefix("http://"), secret=secret, node=90, timeout=3, retries=0)
        second = PeerTier(f"{c.hosts.addr(2)}:{PORT}", secret=secret, node=90, timeout=10)
        plan = plan_restore(scan_tiers([first, second], "cut"), "cut", step=1, ranks=[3])
        plan.sources[3] = [first, second]  # node 3's copy first, as a restore on a node near it would
        cut = threading.Timer(1.0, c.hosts.link, args=(3,), kwargs={"up": False})  # well inside the ~4 s read
        buf = bytearray(plan.manifest.shard(3).size)
        cut.start()
        try:
            t0 = time.monotonic()
            report = fetch_shard(plan, 3, memoryview(buf))
        finally:
            cut.join()
            c.hosts.link(3, up=True)
    assert time.monotonic() - t0 > 1.0  # the cut came while node 3's copy was being read
    assert report.source.endswith(f"{c.hosts.addr(2)}:{PORT}"), report
    assert len(report.failures) == 1 and slow.url.removeprefix("http://") in report.failures[0], report.failures
    assert bytes(buf) == data[3]
