"""The commit tree: rows up to the root, manifests down, failover and catch-up.

Unit tests wire several :class:`Disseminator` objects in one event loop through a fake network (a dict of
nodes, some of which can be made unreachable); the end-to-end tests run real agents on loopback.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import pytest

from agents.dissemination import Disseminator, View, tree_children, tree_parent, tree_root


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
        self.alive_view = {i: set(range(n)) for i in range(n)}
        self.committed: dict[int, dict[tuple[str, int], bytes]] = {i: {} for i in range(n)}
        self.rows: dict[int, dict[tuple[str, int], dict[int, dict]]] = {i: {} for i in range(n)}
        self.posts: dict[int, int] = {i: 0 for i in range(n)}
        self.resend_after = resend_after
        self.nodes = {i: self._make(i, fanout) for i in range(n)}

    def _make(self, i: int, fanout: int) -> Disseminator:
        async def post(r: int, path: str, body: dict) -> dict:
            self.posts[i] += 1
            self.ups[i] += path == "/v1/up"
            if r in self.down or i in self.down or (path == "/v1/down" and (i, r) in self.lost_down):
                raise ConnectionError(f"node {r} unreachable")
            body = json.loads(json.dumps(body))  # as over the wire
            d = self.nodes[r]
            return await (d.handle_up(body) if path == "/v1/up" else d.handle_down(body))

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
                            dead=lambda: set(range(self.n)) - self.alive_view[i], fanout=fanout,
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
    from test_e2e_faults import _stage_raw

    errors = []

    def one(rank: int, node: int) -> None:
        try:
            _stage_raw(c.shm(node), "tree", step, 1 << 20, rank=rank, world=world)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(r, n)) for r, n in homes.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


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
