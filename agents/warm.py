"""Warm restore: an agent that starts with peers pulls its ranks' shards of each job's newest step.

A replacement node's agent starts with empty memory while its peers still hold,
as replicas, the shards that the node's ranks saved. Call order::

    WarmRestore(peers, …)   the replicator's client tiers, threads and pull (agents.replicator)
    start()                 run once, in the background, unless ``prefetch`` is off
    wait(timeout)           the ``prefetch`` op: the report, waiting up to ``timeout`` s for the end
    stop()                  cancel it (the agent is stopping)

The report (``status`` shows it too): state idle|running|done, the step pulled
per job, shards, bytes, seconds, errors. Every shard pulled is verified against
the manifest's checksum and the manifest is written last, as in any tier, so a
rank's restore (recovery/) sees the step in local memory only once it is whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time

from recovery import step_index
from tiers import keys
from tiers.errors import ManifestError, TierError
from tiers.layout import Layout
from tiers.manifest import Manifest, ShardInfo
from tiers.memory import MemoryTier

from .config import Settings
from .drain import ByteBudget
from .layouts import LayoutBook
from .replicator import Replicator

__all__ = ["WarmRestore", "idle_report"]

log = logging.getLogger("tierckpt.agent")


def idle_report() -> dict:
    """The report of a warm restore that has not run."""
    return {"state": "idle", "steps": {}, "shards": 0, "bytes": 0, "seconds": 0.0, "errors": []}


class WarmRestore:
    """The warm restore run at start; ``report`` says how it went."""

    def __init__(self, settings: Settings, memory: MemoryTier, peers: Replicator, layouts: LayoutBook,
                 budget: ByteBudget) -> None:
        self.settings = settings
        self.me = settings.node_rank
        self.memory = memory
        self.peers = peers
        self.layouts = layouts
        self.budget = budget
        #: the warm restore run at start (state idle|running|done, steps, shards, bytes, seconds, errors)
        self.report: dict = idle_report()
        self._done = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self.settings.prefetch:
            self.report["state"] = "running"
            self._task = asyncio.create_task(self._run(), name="prefetch")
        else:
            self._done.set()

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def wait(self, timeout: float) -> dict:
        """The report; with ``timeout`` > 0 (seconds), once the restore is done or the time is up."""
        if timeout > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._done.wait(), timeout)
        return dict(self.report)

    async def _run(self) -> None:
        """Warm restore: pull from the peers, before this node's ranks ask, their shards of each job's newest step.

        A replacement node's agent starts with empty memory while its peers still hold the shards that
        the node's ranks saved (as replicas). For every job a peer holds, the newest step with a manifest
        is the one a restarted job restores; the shards taken by this node (``ShardInfo.node``) are pulled
        into local memory, verified against the manifest's checksums, and the manifest is written last,
        so the ranks' restore reads local memory. Runs once, at start; ``status`` and the ``prefetch`` op
        report it.
        """
        st = self.report
        t0 = time.monotonic()
        try:
            listings: dict[int, set[str]] = {}

            async def listing(r: int) -> None:
                try:
                    listings[r] = set(await self.peers.out(self.peers.peer_tiers[r].list, ""))
                except (TierError, OSError) as e:
                    st["errors"].append(f"node {r}: {e}")

            # the nodes placement puts this node's copies on; only if they hold nothing, the few nodes after
            # them in placement order, where re-replication puts copies when the partners die. Never every
            # peer: a job start would cost N listings per node
            members = self.peers.members
            nodes = set(members.desired(self.me, {n.rank for n in members.nodes})) - {self.me}
            await asyncio.gather(*(listing(r) for r in sorted(nodes)))
            if not any(keys.parse_key(k) is not None for held in listings.values() for k in held):
                more = members.fallbacks(self.me, 2 * self.settings.replicas)
                await asyncio.gather(*(listing(r) for r in more))
            steps: dict[str, dict[int, int]] = {}  # job -> step -> a node that holds its manifest
            for r, held in sorted(listings.items(), reverse=True):
                for key in held:
                    info = keys.parse_key(key)
                    if info is not None and info.is_manifest:
                        steps.setdefault(info.job, {})[info.step] = r
            for job, where in sorted(steps.items()):
                # the newest step whose shards of this node the peers hold in full (a node lost during a
                # replication leaves the newest step short of some)
                for step in sorted(where, reverse=True)[:self.settings.keep_memory + 1]:
                    if await self._step(job, step, where[step], listings):
                        break
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the agent must outlive a failed warm restore: restores read the peers instead
            log.exception("warm restore failed")
            st["errors"].append(f"{type(e).__name__}: {e}")
        finally:
            st["state"] = "done"
            st["seconds"] = round(time.monotonic() - t0, 3)
            self._done.set()
        if st["shards"]:
            log.info("warm restore: %d shards (%d bytes) of %s pulled from peers in %.3f s", st["shards"],
                     st["bytes"], ", ".join(f"{j} step {s}" for j, s in sorted(st["steps"].items())), st["seconds"])

    async def _step(self, job: str, step: int, holder: int, listings: dict[int, set[str]]) -> bool:
        """Pull this node's shards of one step, then its manifest; True when the step is here (or not ours)."""
        st = self.report
        mkey = keys.manifest_key(job, step)
        if await asyncio.to_thread(os.path.exists, self.memory.path(mkey)):
            return True
        try:
            data = await self.peers.out(self.peers.peer_tiers[holder].get, mkey)
            m = Manifest.from_bytes(data, job=job, step=step)
        except (TierError, OSError, ValueError) as e:
            st["errors"].append(f"{mkey} from node {holder}: {e}")
            return False
        mine = [sh for sh in m.shards if sh.node == self.me]
        if not mine:
            return True
        if any(not any(keys.shard_key(job, step, sh.rank) in held for held in listings.values()) for sh in mine):
            return False

        async def one(sh: ShardInfo) -> bool:
            key = keys.shard_key(job, step, sh.rank)
            with contextlib.suppress(OSError):
                if os.stat(self.memory.path(key)).st_size == sh.size:
                    return True
            for r in [q for q in sorted(listings) if key in listings[q]]:
                held = await self.budget.acquire(sh.size)
                try:
                    await self.peers.pulling(self.peers.pull, r, key, sh.size, sh.checksum)
                    st["shards"] += 1
                    st["bytes"] += sh.size
                    return True
                except (TierError, OSError) as e:
                    st["errors"].append(f"{key} from node {r}: {e}")
                finally:
                    await self.budget.release(held)
            return False

        if not all(await asyncio.gather(*(one(sh) for sh in mine))):
            return False
        for digest in sorted({sh.layout for sh in mine if sh.layout}):
            if not await self._pull_layout(job, digest, [holder] + sorted(listings)):
                return False
        await asyncio.to_thread(self.memory.put, mkey, data)
        await asyncio.to_thread(step_index.note_commit, self.memory, m)
        st["steps"][job] = step
        return True

    async def _pull_layout(self, job: str, digest: str, nodes: list[int]) -> bool:
        """Copy the layout object ``digest`` into local memory from the first of ``nodes`` that has it intact."""
        lkey = keys.layout_key(job, digest)
        if await asyncio.to_thread(os.path.exists, self.memory.path(lkey)):
            return True
        for r in dict.fromkeys(nodes):
            try:
                data = await self.peers.out(self.peers.peer_tiers[r].get, lkey)
                Layout.from_bytes(data, digest)
            except (TierError, OSError, ManifestError) as e:
                self.report["errors"].append(f"{lkey} from node {r}: {e}")
                continue
            await asyncio.to_thread(self.memory.put, lkey, data)
            self.layouts.mark("memory", job, digest)
            return True
        return False
