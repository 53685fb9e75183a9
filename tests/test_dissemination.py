"""The commit tree: rows up to the root, manifests down, failover and catch-up.

Unit tests wire several :class:`Disseminator` objects in one event loop through a fake network (a dict of
nodes, some of which can be made unreachable); the end-to-end tests run real agents on loopback.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest

from agents.dissemination import Disseminator, View, pack_rows, tree_children, tree_parent, tree_root, unpack_rows
from agents.replication import encode_body


def test_tree_covers_every_live_node_once_with_bounded_fanout():
    for n in (1, 2, 7, 64, 1000):
        live = list(range(0, 2 * n, 2))  # gaps: dead nodes in between
        for fanout in (2, 8):
            seen = {tree_root(live)}
            frontier = [tree_root(live)]
            while frontier:
                node = frontier.pop()
                kids = tree_children(live, node, fanout)
                assert len(kids) <= fanout
                for k in kids:
                    assert tree_parent(live, k, fanout) == node and k not in seen
                    seen.add(k)
                frontier += kids
            assert seen == set(live)


class Net:
    """``n`` nodes' Disseminators, each node one rank; the root "builds" a manifest naming the rows' checksums."""

    def __init__(self, n: int, fanout: int = 2, resend_after: float = 0.5, linger: float = 0.0,
                 hold: float = 1.0) -> None:
        self.n = n
        self.linger = linger
        self.hold = hold
        self.ups: dict[int, int] = {i: 0 for i in range(n)}
        self.down: set[int] = set()  # unreachable (killed) nodes
        self.lost_down: set[tuple[int, int]] = set()  # (from, to) whose messages down the tree are lost
        self.cut: set[tuple[int, int]] = set()  # pairs of nodes that cannot reach each other (a partition)
        self.alive_view = {i: set(range(n)) for i in range(n)}
        self.committed: dict[int, dict[tuple[str, int], bytes]] = {i: {} for i in range(n)}
        self.rows: dict[int, dict[tuple[str, int], dict[int, dict]]] = {i: {} for i in range(n)}
        self.posts: dict[int, int] = {i: 0 for i in range(n)}
        self.votes: dict[int, int] = {i: 0 for i in range(n)}
        self.up_bytes: dict[int, int] = {i: 0 for i in range(n)}
        self.resend_after = resend_after
        self.nodes = {i: self._make(i, fanout) for i in range(n)}

    def _make(self, i: int, fanout: int) -> Disseminator:
        async def post(r: int, path: str, body: dict) -> dict:
            if path == "/v1/vote":
                self.votes[i] += 1  # the root's election: once, not per step
            else:
                self.posts[i] += 1
            if path == "/v1/up":
                self.up_bytes[r] += len(encode_body(body)[0])  # as the link would send it
            self.ups[i] += path == "/v1/up"
            if r in self.down or i in self.down or (path == "/v1/down" and (i, r) in self.lost_down):
                raise ConnectionError(f"node {r} unreachable")
            if (i, r) in self.cut or (r, i) in self.cut:
                raise ConnectionError(f"node {r} unreachable from node {i}")
            body = json.loads(json.dumps(body))  # as over the wire
            d = self.nodes[r]
            if path == "/v1/vote":
                return await d.handle_vote(body)
            return await (d.handle_up(body) if path == "/v1/up" else d.handle_down(body))

        async def probe(r: int) -> bool:
            return r not in self.down and i not in self.down and (i, r) not in self.cut and (r, i) not in self.cut

        async def on_rows(rows: list[dict]) -> None:
            for row in rows:
                got = self.rows[i].setdefault((row["job"], row["step"]), {})
                got[row["rank"]] = row
                if len(got) == row["world"] and (row["job"], row["step"]) not in self.committed[i]:
                    # begins as a manifest does (what the nodes read its job and step from)
                    data = json.dumps({"format": "tierckpt-manifest", "version": 2, "library": "tierckpt",
                                       "job": row["job"], "step": row["step"],
                                       "sums": [got[r]["checksum"] for r in sorted(got)]},
                                      separators=(",", ":")).encode()
                    self.committed[i][(row["job"], row["step"])] = data
                    d = self.nodes[i]
                    d.committed(row["job"], row["step"], data)
                    d.broadcast(data)

        async def on_manifest(data: bytes) -> bool:
            obj = json.loads(data)
            job, step = obj["job"], obj["step"]
            self.committed[i][(job, step)] = data
            self.nodes[i].committed(job, step, data)
            return True

        def mark(kind: str, node: int) -> bool:
            view = self.alive_view[i]
            before = set(view)
            (view.add if kind == "alive" else view.discard)(node)
            return view != before

        def adopt(view: View) -> None:
            self.alive_view[i] = set(range(self.n)) - set(view.dead)

        return Disseminator(i, alive=lambda: self.alive_view[i], post=post, on_rows=on_rows,
                            on_manifest=on_manifest, on_view=adopt, on_report=mark,
                            dead=lambda: set(range(self.n)) - self.alive_view[i], nodes=self.n, probe=probe,
                            fanout=fanout,
                            resend_after=self.resend_after, retry_after=0.05, linger=self.linger,
                            hold=self.hold)

    def start(self) -> None:
        for d in self.nodes.values():
            d.start()

    async def stop(self) -> None:
        for d in self.nodes.values():
            await d.stop()

    def commit(self, step: int, nodes=None) -> None:
        for i in (range(self.n) if nodes is None else nodes):
            self.nodes[i].submit([{"job": "j", "step": step, "rank": i, "world": self.n,
                                   "checksum": f"c{step}-{i}"}])

    def kill(self, i: int) -> None:
        self.down.add(i)
        for j in range(self.n):
            if j != i and i in self.alive_view[j]:
                self.alive_view[j].discard(i)  # what its watchers' heartbeats conclude
                self.nodes[j].view_changed()

    async def wait(self, cond, what: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            await asyncio.sleep(0.01)


def test_every_node_commits_the_same_manifest_and_sends_a_bounded_number_of_messages():
    async def run() -> None:
        net = Net(13, fanout=3, resend_after=3600)  # nothing is lost here: no resend may inflate the count
        net.start()
        try:
            # the root's election comes first, once: every node follows node 0's epoch, then steps are counted
            await net.wait(lambda: all(d.view.root == 0 for d in net.nodes.values()), "node 0 elected root")
            assert net.nodes[0].is_root() and not any(net.nodes[i].is_root() for i in range(1, 13))
            net.posts = {i: 0 for i in range(net.n)}
            for step in range(4):
                net.commit(step)
                await net.wait(lambda s=step: all((("j", s) in net.committed[i]) for i in range(net.n)),
                               f"step {step} everywhere")
            datas = {net.committed[i][("j", 3)] for i in range(net.n)}
            assert len(datas) == 1 and json.loads(datas.pop())["sums"] == [f"c3-{i}" for i in range(net.n)]
            # per node and step: about one message up and `fanout` down, however many nodes there are
            for i in range(net.n):
                assert net.posts[i] <= 4 * (1 + 3 + 1), (i, net.posts[i])
        finally:
            await net.stop()

    asyncio.run(run())


def test_rows_that_arrive_one_by_one_go_up_as_one_message_per_node():
    async def run() -> None:
        ranks = 8
        net = Net(13, fanout=3, resend_after=3600, linger=5.0)  # generous: a loaded machine may pause the loop
        net.start()
        try:
            for i in range(net.n):
                for r in range(ranks):  # each rank's row on its own, the up loop running in between
                    net.nodes[i].submit([{"job": "j", "step": 0, "rank": i * ranks + r, "world": net.n * ranks,
                                          "checksum": f"c{i}-{r}"}])
                    for _ in range(3):
                        await asyncio.sleep(0)
            await net.wait(lambda: all(("j", 0) in net.committed[i] for i in range(net.n)), "step 0 everywhere")
            # a leaf sends its 8 rows once; an inner node its own and its children's together (2 at most,
            # when a child's rows come in while the node's own send is under way)
            assert net.ups[0] == 0
            assert all(net.ups[i] <= 2 for i in range(1, net.n)), net.ups
        finally:
            await net.stop()

    asyncio.run(run())


def test_a_node_holds_its_rows_until_the_ranks_of_its_previous_step_are_in():
    async def run() -> None:
        ranks, n = 4, 7
        net = Net(n, fanout=2, resend_after=3600, linger=0.0, hold=3600)
        net.start()

        async def trickle(step: int, skip: set[int] = frozenset()) -> None:
            for i in range(n):
                for r in range(ranks):
                    if (i, r) in skip:
                        continue
                    net.nodes[i].submit([{"job": "j", "step": step, "rank": i * ranks + r, "world": n * ranks,
                                          "checksum": f"c{step}-{i}-{r}"}])
                    for _ in range(3):
                        await asyncio.sleep(0)

        try:
            await trickle(0)  # nothing known yet: rows go as they come
            await net.wait(lambda: all(("j", 0) in net.committed[i] for i in range(n)), "step 0 everywhere")
            before = dict(net.ups)
            await trickle(1)
            await net.wait(lambda: all(("j", 1) in net.committed[i] for i in range(n)), "step 1 everywhere")
            leaves = [i for i in range(n) if not net.nodes[i].children()]
            assert leaves and all(net.ups[i] - before[i] == 1 for i in leaves), (net.ups, before)
            # a rank that does not come: the node's other rows wait, then go up when it does
            await trickle(2, skip={(3, 1)})
            for _ in range(50):
                await asyncio.sleep(0)
            assert not any(r // ranks == 3 for r in net.rows[0].get(("j", 2), {})), "held rows went up early"
            net.nodes[3].submit([{"job": "j", "step": 2, "rank": 3 * ranks + 1, "world": n * ranks,
                                  "checksum": "late"}])
            await net.wait(lambda: all(("j", 2) in net.committed[i] for i in range(n)), "step 2 everywhere")
        finally:
            await net.stop()

    asyncio.run(run())


def test_held_rows_go_up_after_the_hold_when_a_rank_never_comes():
    async def run() -> None:
        net = Net(3, fanout=2, resend_after=3600, linger=0.0, hold=0.3)
        net.start()
        try:
            for step in (0, 1):
                for i in range(3):
                    for r in range(2):
                        if step == 1 and (i, r) == (2, 1):
                            continue  # node 2's second rank died before step 1
                        net.nodes[i].submit([{"job": "j", "step": step, "rank": 2 * i + r, "world": 6,
                                              "checksum": f"c{step}-{i}-{r}"}])
                if step == 0:
                    await net.wait(lambda: all(("j", 0) in net.committed[i] for i in range(3)), "step 0")
            await net.wait(lambda: 4 in net.rows[0].get(("j", 1), {}), "node 2's held row at the root")
            assert ("j", 1) not in net.committed[0]
        finally:
            await net.stop()

    asyncio.run(run())


def test_root_killed_mid_commit_loses_no_step_and_the_job_goes_on():
    async def run() -> None:
        net = Net(6, fanout=2)
        net.start()
        try:
            net.commit(1)
            await net.wait(lambda: all(("j", 1) in net.committed[i] for i in range(6)), "step 1")
            # node 0 (the root) dies after some ranks committed step 2 and before the rest did
            net.commit(2, nodes=[1, 2, 3])
            net.kill(0)
            net.commit(2, nodes=[4, 5])
            # without rank 0 step 2 cannot complete: the job restarts; the survivors still hold step 1
            # and a later step whose ranks all commit (a restarted rank 0 runs on another node) completes
            await asyncio.sleep(0)
            assert all(("j", 1) in net.committed[i] for i in range(1, 6))
            for i in range(1, 6):
                net.nodes[i].submit([{"job": "j", "step": 3, "rank": i, "world": 6, "checksum": f"c3-{i}"}])
            net.nodes[1].submit([{"job": "j", "step": 3, "rank": 0, "world": 6, "checksum": "c3-0"}])
            await net.wait(lambda: all(("j", 3) in net.committed[i] for i in range(1, 6)), "step 3 on survivors")
            assert net.nodes[1].is_root()
        finally:
            await net.stop()

    asyncio.run(run())


def test_a_node_that_missed_the_manifest_catches_up_from_its_parent():
    async def run() -> None:
        net = Net(7, fanout=2)  # 0 -> 1, 2; 1 -> 3, 4; 2 -> 5, 6
        net.lost_down.add((1, 3))  # node 1 forwards rows up, but the manifest never reaches node 3
        net.start()
        try:
            net.commit(5)
            await net.wait(lambda: all(("j", 5) in net.committed[i] for i in (0, 1, 2, 4, 5, 6)), "the others")
            # node 3 still holds its row unacked: it sends it up again, and the answer is the manifest itself
            await net.wait(lambda: ("j", 5) in net.committed[3], "catch-up", timeout=30)
            assert net.nodes[3].stats.catch_ups >= 1
            assert net.committed[3][("j", 5)] == net.committed[0][("j", 5)]
        finally:
            await net.stop()

    asyncio.run(run())


@pytest.fixture
def cluster(tmp_path):
    from test_e2e_peers import Cluster

    made = []

    def make(n: int, **kw):
        c = Cluster(tmp_path, n, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        for i in list(c.procs):
            c.kill(i, wipe=False)


def _stage_all(c, step: int, homes: dict[int, int], world: int = 4) -> None:
    """Each rank ``r`` commits ``step`` to the agent of node ``homes[r]``, all at once, as trainers would."""
    from test_e2e_faults import _stage_ranks

    _stage_ranks({r: c.shm(n) for r, n in homes.items()}, "tree", step, 1 << 20, world)


@pytest.mark.e2e
def test_root_agent_killed_mid_commit_the_survivors_keep_committed_steps_and_commit_the_next(cluster):
    """Node 0 is the commit tree's root. It is killed after some ranks committed step 2; the survivors keep
    step 1, and step 3 (rank 0 restarted on node 1) commits on every live node through the new root."""
    from procs import agent_call

    c = cluster(4)
    manifest = lambda i, s: os.path.join(c.shm(i), "tree", f"step-{s}", "manifest.json")  # noqa: E731
    _stage_all(c, 1, {0: 0, 1: 1, 2: 2, 3: 3})
    c.wait_for(lambda: all(os.path.exists(manifest(i, 1)) for i in range(4)), "step 1 on every node")
    _stage_all(c, 2, {1: 1, 2: 2})
    c.kill(0)
    _stage_all(c, 3, {0: 1, 1: 1, 2: 2, 3: 3})
    c.wait_for(lambda: all(os.path.exists(manifest(i, 3)) for i in (1, 2, 3)), "step 3 on every live node",
               timeout=60)
    for i in (1, 2, 3):
        assert os.path.exists(manifest(i, 1))  # nothing committed was lost
        assert not os.path.exists(manifest(i, 2))  # rank 0 never committed step 2: it never completes
    st = agent_call(c.shm(2), "status")
    assert st["tree"]["root"] == 1 and 0 not in st["tree"]["live"], st["tree"]


def _partition(net: Net, side_a: set[int], side_b: set[int]) -> None:
    """Cut every link between the two sides; each node concludes (as its heartbeats would) that the other
    side is dead."""
    net.cut |= {(a, b) for a in side_a for b in side_b}
    for mine, other in ((side_a, side_b), (side_b, side_a)):
        for i in mine:
            net.alive_view[i] -= other
            net.nodes[i].view_changed()


def _heal(net: Net) -> None:
    net.cut.clear()
    for i in range(net.n):
        net.alive_view[i] = set(range(net.n))
        net.nodes[i].view_changed()


def _roots_by_epoch(net: Net) -> dict[int, set[int]]:
    out: dict[int, set[int]] = {}
    for i, d in net.nodes.items():
        for epoch in d.election.won_epochs:
            out.setdefault(epoch, set()).add(i)
    return out


def test_a_partition_leaves_one_root_per_epoch_and_the_minority_says_why_it_cannot_commit():
    async def run() -> None:
        net = Net(5, fanout=2)
        net.start()
        try:
            net.commit(1)
            await net.wait(lambda: all(("j", 1) in net.committed[i] for i in range(5)), "step 1")
            _partition(net, {0, 1}, {2, 3, 4})
            # the majority side elects node 2; node 0 (root until now) stands down, having no quorum
            await net.wait(lambda: net.nodes[2].is_root(), "node 2 elected")
            assert not net.nodes[0].is_root() and not net.nodes[1].is_root()
            for i in (0, 1):
                assert "2 of 5 nodes alive" in (net.nodes[i].blocked() or ""), net.nodes[i].blocked()
            assert net.nodes[3].blocked() is None
            # a job running on the majority side (3 ranks) commits; the minority's rows of a step stay held
            for r, node in enumerate((2, 3, 4)):
                net.nodes[node].submit([{"job": "k", "step": 7, "rank": r, "world": 3, "checksum": f"k7-{r}"}])
            net.nodes[0].submit([{"job": "m", "step": 7, "rank": 0, "world": 2, "checksum": "m7-0"}])
            net.nodes[1].submit([{"job": "m", "step": 7, "rank": 1, "world": 2, "checksum": "m7-1"}])
            await net.wait(lambda: all(("k", 7) in net.committed[i] for i in (2, 3, 4)), "k step 7")
            await asyncio.sleep(0.5)
            assert not any(("m", 7) in net.committed[i] for i in range(5))
            _heal(net)
            # one root again, and the held step commits once the minority's rows reach it
            await net.wait(lambda: all(("m", 7) in net.committed[i] for i in (0, 1)), "m step 7 after healing")
            net.commit(8)
            await net.wait(lambda: all(("j", 8) in net.committed[i] for i in range(5)), "step 8 everywhere")
            assert len({net.committed[i][("j", 8)] for i in range(5)}) == 1
            roots = [i for i in range(5) if net.nodes[i].is_root()]
            assert len(roots) == 1, roots
            by_epoch = _roots_by_epoch(net)
            assert by_epoch and all(len(r) == 1 for r in by_epoch.values()), by_epoch
        finally:
            await net.stop()

    asyncio.run(run())


def test_a_cut_off_node_never_takes_over_while_the_others_reach_the_root():
    """Node 1 loses its link to node 0 only: it sees 0 dead and campaigns, but 2, 3 and 4 still reach 0,
    so they refuse it; the root stays, node 1 says why its rows are held, and once the link is back the
    held step commits."""
    async def run() -> None:
        net = Net(5, fanout=2)
        net.start()
        try:
            await net.wait(lambda: all(d.view.root == 0 for d in net.nodes.values()), "node 0 elected")
            net.cut |= {(1, 0)}
            net.alive_view[1].discard(0)
            net.nodes[1].view_changed()
            net.commit(2)
            await net.wait(lambda: net.nodes[1].election.campaigns >= 2, "node 1 campaigns")
            assert net.nodes[0].is_root() and not net.nodes[1].is_root()
            assert "still reaches node 0" in net.nodes[1].election.last_failure, net.nodes[1].election.last_failure
            assert "no commit root" in (net.nodes[1].blocked() or ""), net.nodes[1].blocked()
            assert _roots_by_epoch(net) == {1: {0}}
            _heal(net)
            await net.wait(lambda: all(("j", 2) in net.committed[i] for i in range(5)), "step 2 everywhere")
            assert _roots_by_epoch(net) == {1: {0}}
        finally:
            await net.stop()

    asyncio.run(run())


def test_the_root_receives_at_most_64_bytes_a_rank_per_step_at_1024_ranks():
    """128 nodes of 8 ranks: every row as the agent makes it (a random checksum and layout digest per rank),
    packed and deflated on the way up. The root's intake per step stays under 64 KB."""
    async def run() -> None:
        net = Net(128, fanout=8, resend_after=3600, linger=0.02)
        net.start()
        try:
            await net.wait(lambda: all(d.view.root == 0 for d in net.nodes.values()), "node 0 elected root")
            net.up_bytes = {i: 0 for i in range(net.n)}
            for node in range(128):
                net.nodes[node].submit([
                    {"job": "big", "step": 40, "rank": 8 * node + k, "world": 1024, "nbytes": 1 << 30,
                     "layout": os.urandom(16).hex(), "values": [["step", 40], ["lr", 3e-4]],
                     "checksum": f"xxh3_64:{os.urandom(8).hex()}", "save_index": 40, "metadata": None,
                     "node": node} for k in range(8)])
            await net.wait(lambda: ("big", 40) in net.committed[0], "step 40 at the root", timeout=120)
            assert len(json.loads(net.committed[0][("big", 40)])["sums"]) == 1024
            print(f"root intake per step at 1024 ranks: {net.up_bytes[0]} bytes")
            assert net.up_bytes[0] <= 64 * 1024, net.up_bytes[0]
        finally:
            await net.stop()

    asyncio.run(run())


def test_packed_rows_come_back_as_they_went():
    rows = [{"job": "j", "step": 3, "rank": r, "world": 4, "checksum": f"c{r}", "node": r // 2} for r in range(4)]
    assert unpack_rows(pack_rows(rows)) == rows
    assert unpack_rows(pack_rows(rows[:1])) == rows[:1]
    assert unpack_rows(pack_rows([])) == []
    for bad in (None, [], {"common": [], "rows": []}, {"common": {}, "rows": [1]}):
        with pytest.raises(ValueError):
            unpack_rows(bad)


def test_an_epoch_won_by_vote_but_below_the_one_recorded_is_not_acted_on():
    """With a record of won epochs (etcd in the agents), a node that wins the votes for an epoch below
    the recorded one does not act as root: it follows the recorded epoch, campaigns above it, and the
    step commits under that epoch. Every node's record call is one compare-and-set on a shared store."""
    async def run() -> None:
        net = Net(3, fanout=2)
        store = {"epoch": 7, "node": 2}  # written by a root on the other side of a partition
        attempts: list[tuple[int, int]] = []

        def recorder(i: int):
            async def record(epoch: int, node: int) -> int | None:
                attempts.append((epoch, node))
                if store["epoch"] > epoch or store["epoch"] == epoch and store["node"] != node:
                    return store["epoch"]
                store.update(epoch=epoch, node=node)
                return None
            return record

        for i, d in net.nodes.items():
            d.election.record = recorder(i)
        net.start()
        try:
            await net.wait(lambda: net.nodes[0].is_root(), "node 0 root")
            assert attempts[0] == (1, 0)  # it won epoch 1 by vote, and was told of epoch 7
            won = net.nodes[0].election.won_epochs
            assert won and all(e > 7 for e in won), won
            assert store == {"epoch": won[-1], "node": 0}
            net.commit(1)
            await net.wait(lambda: all(("j", 1) in net.committed[i] for i in range(3)), "step 1")
            assert all(net.nodes[i].view.epoch == won[-1] for i in range(3))
        finally:
            await net.stop()

    asyncio.run(run())


def test_a_candidate_refused_for_an_epoch_promised_elsewhere_asks_above_it_next():
    """Nodes 1 and 2 promised epoch 1 to a candidate that then failed, so no root exists and their views are
    of epoch 0. Node 0 asks them for epoch 1 and is refused; it must ask for epoch 2 next, and win it, rather
    than ask for epoch 1 again and again."""
    from agents.election import Election

    async def run() -> None:
        voters = {r: Election(r, nodes=3, live=lambda: {0, 1, 2}, post=None, probe=None) for r in (1, 2)}
        for e in voters.values():
            e.note_epoch(1)  # promised to the candidate that failed
        asked: list[int] = []

        async def post(r: int, path: str, body: dict) -> dict:
            asked.append(body["epoch"])
            return await voters[r].handle_vote(body)

        async def probe(r: int) -> bool:
            return True

        for e in voters.values():
            e.probe = probe
        cand = Election(0, nodes=3, live=lambda: {0, 1, 2}, post=post, probe=probe, retry_after=0.0)
        assert await cand.campaign() is False
        assert cand.promised == 1 and set(asked) == {1}
        assert await cand.campaign() is True
        assert cand.won == 2 and max(asked) == 2

    asyncio.run(run())
