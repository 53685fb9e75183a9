"""The agent's parts in one process: staging-slot leases and the rebuild after a restart."""

from __future__ import annotations

import asyncio
import logging

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
