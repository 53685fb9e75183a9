"""The agent's parts in one process: staging-slot leases and the rebuild after a restart."""

from __future__ import annotations

import asyncio
import logging

import pytest

from agents.config import Settings
from agents.daemon import Agent, _Conn
from tiers import keys
from tiers.checksum import checksum_bytes
from tiers.disk import DiskTier
from tiers.manifest import Manifest, ShardInfo
from tiers.memory import MemoryTier


def test_two_begins_for_one_rank_at_once_lease_two_different_slots(tmp_path):
    settings = Settings.load({"shm": str(tmp_path / "shm")}, env={})
    agent = Agent(settings)

    async def main():
        await agent.start()
        try:
            req = {"job": "j", "rank": 0, "nbytes": 4096}
            return await asyncio.gather(agent._op_begin(_Conn(pid=1), dict(req)),
                                        agent._op_begin(_Conn(pid=2), dict(req)))
        finally:
            await agent.stop()

    a, b = asyncio.run(main())
    assert a["slot"] != b["slot"]


def test_restart_does_not_requeue_a_multi_node_step_this_node_already_wrote_to_disk(tmp_path, caplog):
    """A node's disk holds only its own ranks' shards: node-complete there is written, not interrupted."""
    settings = Settings.load({"shm": str(tmp_path / "shm"), "disk": str(tmp_path / "disk")}, env={})
    data = b"x" * 64
    m = Manifest("j", 3, 2, (ShardInfo(0, len(data), checksum_bytes(data), (), 0),
                             ShardInfo(1, len(data), checksum_bytes(data), (), 1)), {"save_index": 0})
    for tier in (MemoryTier(settings.shm), DiskTier(settings.disk)):
        tier.put(keys.shard_key("j", 3, 0), data)
        tier.put(keys.manifest_key("j", 3), m.to_bytes())
    agent = Agent(settings)

    async def main():
        await agent.start()
        await agent.stop()

    with caplog.at_level(logging.INFO, logger="tierckpt.agent"):
        asyncio.run(main())
    assert not [r for r in caplog.records if "re-queueing" in r.getMessage()]


class _StuckDisk(DiskTier):
    """A disk whose puts hang (as uploads do while S3 is down and they retry) until ``release`` is set."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        import threading

        self.release = threading.Event()
        self.stuck = 0
        self._lock = threading.Lock()

    def put(self, key, src):
        with self._lock:
            self.stuck += 1
        self.release.wait(300)
        return super().put(key, src)


def test_writes_hanging_in_a_lower_tier_leave_the_default_executor_free(tmp_path):
    """Staging, committing and the peer server's file opens run in the default executor: drains that wait
    on a slow or unreachable tier must not take its threads, or an S3 outage stalls every save."""
    settings = Settings.load({"shm": str(tmp_path / "shm"), "disk": str(tmp_path / "disk")}, env={})
    world, data = 8, b"y" * 4096  # more shards at once than the default executor has threads (6 on 2 cores)
    shards = tuple(ShardInfo(r, len(data), checksum_bytes(data), (), 0) for r in range(world))
    memory = MemoryTier(settings.shm)
    for r in range(world):
        memory.put(keys.shard_key("j", 0, r), data)
    memory.put(keys.manifest_key("j", 0), Manifest("j", 0, world, shards, {"save_index": 0}).to_bytes())
    agent = Agent(settings)
    stuck = _StuckDisk(settings.disk)
    agent.lower = [stuck]

    async def body():
        await agent.start()  # finds step 0 committed in memory and not on disk: drains it
        while stuck.stuck < world:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(lambda: None)

    async def main():
        try:
            # the writes hang for 300 s: with their threads taken from the default executor, neither the
            # start (it scans memory there) nor the call after it would finish within the minute
            await asyncio.wait_for(body(), 60)
        finally:
            stuck.release.set()
            await agent.stop()

    asyncio.run(main())


def test_a_step_whose_manifest_a_peer_pushed_first_is_still_finished_when_the_tree_sends_it(tmp_path):
    """Re-replication can put a step's manifest into this node's memory before the commit tree's message
    comes; the step this node's ranks committed must still settle (its ``wait`` returns, its drains go)."""
    settings = Settings.load({"shm": str(tmp_path / "shm")}, env={})
    agent = Agent(settings)
    data = b"z" * 4096
    entries = [{"kind": "tensor", "name": "w", "dtype": "uint8", "global_shape": [2 * len(data)], "offsets": [0],
                "shape": [len(data)], "offset": 0, "nbytes": len(data)}]

    async def main():
        await agent.start()
        try:
            conn = _Conn(pid=1)
            slot = (await agent._op_begin(conn, {"job": "j", "rank": 0, "nbytes": len(data)}))["slot"]
            with open(slot, "r+b") as f:
                f.write(data)
            await agent._op_commit(conn, {"job": "j", "step": 4, "rank": 0, "world": 2, "slot": slot,
                                          "nbytes": len(data), "entries": entries, "save_index": 4})
            assert ("j", 4) in agent.book.pending
            digest = agent.book.pending[("j", 4)].layouts[0]
            m = Manifest("j", 4, 2, (ShardInfo(0, len(data), checksum_bytes(data), (), 0, digest),
                                     ShardInfo(1, len(data), checksum_bytes(data), (), 1, digest)),
                         {"save_index": 4})
            agent.memory.put(keys.manifest_key("j", 4), m.to_bytes())  # what a peer's re-replication does
            agent.book.tree = _Tree()
            await agent.book.receive_manifest(m.to_bytes())
            assert ("j", 4) not in agent.book.pending
            got = await agent._op_wait(conn, {"job": "j", "step": 4, "timeout": 30})
            assert got["done"] is True
        finally:
            await agent.stop()

    asyncio.run(main())


class _Tree:
    """What the step book tells the commit tree (nothing to send in one process)."""

    def committed(self, job, step, data) -> None:
        pass

    def broadcast(self, data) -> None:
        pass


def test_node_rank_auto_finds_the_one_line_with_an_address_of_this_machine():
    from agents.placement import PeerListError, parse_peers
    from agents.replication import find_own_rank

    # 198.51.100.0/24 is reserved for documentation (a test machine may well have 192.0.2.x)
    assert find_own_rank(parse_peers("198.51.100.1:7700\n127.0.0.1:7700\n198.51.100.3:7700")) == 1
    with pytest.raises(PeerListError, match="no line of the peers file"):
        find_own_rank(parse_peers("198.51.100.1:7700\n198.51.100.2:7700"))
    with pytest.raises(PeerListError, match="2 lines of the peers file.*give --node-rank"):
        find_own_rank(parse_peers("127.0.0.1:7700\n127.0.0.1:7701"))


def test_a_rank_retired_in_etcd_is_written_retired_and_is_not_counted_registered(tmp_path):
    """What the etcd watch turns into the peers file: a retired rank's line says role=retired (so every
    part drops it), at an address of its own that nothing answers, and the rank is not registered; a
    rank never seen is listed unregistered."""
    import json
    import types

    from agents.directory import EtcdDirectory
    from agents.replication import load_peer_list

    (tmp_path / "shm").mkdir()
    s = types.SimpleNamespace(shm=str(tmp_path / "shm"), etcd="http://127.0.0.1:1", cluster="c", nodes=4, node_rank=0,
                              advertise="127.0.0.1:7000", peer_timeout=5.0, etcd_lease=None, dead_after=5.0)
    d = EtcdDirectory(s)
    d._take("/tierckpt/c/nodes/0", json.dumps({"rank": 0, "addr": "127.0.0.1:7000", "role": "train"}).encode())
    d._take("/tierckpt/c/nodes/1", json.dumps({"rank": 1, "addr": "127.0.0.1:7001", "role": "memory"}).encode())
    d._take("/tierckpt/c/nodes/2", json.dumps({"rank": 2, "addr": "retired-2.invalid:1", "role": "retired",
                                              "last_addr": "127.0.0.1:7002"}).encode())
    d._write()
    nodes = load_peer_list(d.path)
    assert [(n.rank, n.role) for n in nodes] == [(0, "train"), (1, "memory"), (2, "retired"), (3, "train")]
    assert nodes[3].addr.startswith("unregistered-3.invalid")
    assert d.registered == {0, 1}
