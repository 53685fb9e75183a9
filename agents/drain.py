"""Write-back and retention: committed steps drain from memory to disk and S3; each tier keeps its newest.

Call order::

    start(lower)          one queue and one worker per lower tier (disk, S3)
    committed(manifest)   a step was committed in memory (agents.stepbook): queue it for the tiers it
                          is due (disk every ``disk_every`` saves, S3 every ``s3_every``), then trim memory
    worker                layouts, then every shard this node took, then the manifest, in each tier;
                          a newer step of the job already queued supersedes an older one
    trim(tier, job)       retention, the one routine for memory, disk and S3: keep the newest
                          ``keep_*`` committed steps, drop stale uncommitted ones, never a step being
                          written; then the layouts no retained step names (memory and disk only)
    stop()                cancel the workers (the agent waits up to ``grace`` s for them first)

Shard bytes in flight on this node are bounded by one :class:`ByteBudget`
(``max_inflight_bytes``): the drains' writes, and the pulls that bring shards
in from peers (replication, warm restore). A push to a peer takes none of it:
the receiver's pull holds the receiver's budget, so no node ever holds its
budget while waiting for another node's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import mmap
import os
import time
from collections.abc import Awaitable, Callable

from recovery import step_index
from recovery.inventory import scan_tier
from tiers import keys
from tiers.base import Tier
from tiers.manifest import Manifest, durable_view
from tiers.memory import MemoryTier

from .config import Settings
from .layouts import LayoutBook
from .stepbook import StepBook

__all__ = ["ByteBudget", "Drainer", "delete_step"]

log = logging.getLogger("tierckpt.agent")


class ByteBudget:
    """Bounds shard bytes in flight on this node at once (a shard larger than the bound runs alone).

    Never held while waiting for a peer that may need its own budget to answer (see the module docstring).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._cond = asyncio.Condition()

    async def acquire(self, n: int) -> int:
        n = min(n, self.limit)
        async with self._cond:
            await self._cond.wait_for(lambda: self.used + n <= self.limit)
            self.used += n
        return n

    async def release(self, n: int) -> None:
        async with self._cond:
            self.used -= n
            self._cond.notify_all()


def _put_head(tier: Tier, key: str, path: str, size: int) -> int:
    """Store the first ``size`` bytes of the file ``path`` as ``key`` (the whole file when that is its size)."""
    if os.path.getsize(path) == size:
        return tier.put(key, path)
    if size == 0:
        return tier.put(key, b"")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mm:
        view = memoryview(mm)
        try:
            return tier.put(key, view)
        finally:
            with contextlib.suppress(BufferError):
                view.release()


def delete_step(tier: Tier, job: str, step: int) -> None:
    """Index row, manifest (un-commit), the row again (in case another writer put it back), then the shards."""
    prefix = keys.step_prefix(job, step)
    step_index.note_delete(tier, job, step)
    tier.delete(keys.manifest_key(job, step))
    step_index.note_delete(tier, job, step)
    for k in tier.list(prefix):
        tier.delete(k)


class Drainer:
    """The drain queues and workers of one agent, and its retention.

    ``slots_freed`` is awaited after memory lost steps, so trainers waiting for a staging slot look again.
    """

    def __init__(self, settings: Settings, me: int, memory: MemoryTier, book: StepBook, layouts: LayoutBook,
                 budget: ByteBudget, stats: dict, slots_freed: Callable[[], Awaitable[None]]) -> None:
        self.settings = settings
        self.me = me
        self.memory = memory
        self.book = book
        self.layouts = layouts
        self.budget = budget
        self.stats = stats
        self.slots_freed = slots_freed
        self.tiers: dict[str, Tier] = {}
        self._queues: dict[str, asyncio.Queue] = {}
        self._workers: list[asyncio.Task] = []
        # disk and S3 calls get threads of their own: an S3 put may retry for a minute in an outage, and
        # parked in the default executor it would starve the trainers' begin and commit and the file opens
        # of the peer server (which use it), so an S3 outage would stall saves and replication
        self._pool = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="tierckpt-drain")

    async def _run(self, tier: Tier, fn: Callable, *args):
        """Run a blocking call on ``tier``: memory's in the default executor, disk's and S3's in the drain threads."""
        if tier is self.memory:
            return await asyncio.to_thread(fn, *args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))

    def start(self, lower: list[Tier]) -> None:
        """One queue and one worker per lower tier."""
        for t in lower:
            self.tiers[t.name] = t
            self._queues[t.name] = asyncio.Queue()
            self._workers.append(asyncio.create_task(self._worker(t), name=f"drain-{t.name}"))

    def stop(self) -> None:
        for w in self._workers:
            w.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def busy(self) -> bool:
        """Whether a step is queued or being written."""
        return self.book.busy() or any(not q.empty() for q in self._queues.values())

    def queued(self) -> dict[str, int]:
        return {n: q.qsize() for n, q in self._queues.items()}

    def targets(self, save_index: int, every_tier: bool = False) -> list[Tier]:
        """The lower tiers the ``save_index``-th save is due in (all of them for a forced save, ``every_tier``)."""
        out = []
        if "disk" in self.tiers and (every_tier or save_index % self.settings.disk_every == 0):
            out.append(self.tiers["disk"])
        if "s3" in self.tiers and (every_tier or save_index % self.settings.s3_every == 0):
            out.append(self.tiers["s3"])
        return out

    def enqueue(self, tier: Tier, job: str, step: int) -> None:
        self.book.draining.setdefault((job, step), set()).add(tier.name)
        self.book.settled.setdefault((job, step), asyncio.Event())
        self._queues[tier.name].put_nowait((job, step))

    async def committed(self, m: Manifest) -> None:
        """A step was committed in memory: queue the writes it is due, then apply memory's retention."""
        job, step = m.job, m.step
        targets = self.targets(int(m.metadata.get("save_index", step)), bool(m.metadata.get("every_tier")))
        for t in targets:
            self.enqueue(t, job, step)
        if not targets:
            self.book.settle(job, step)
        await self.trim(self.memory, job)

    # ------------------------------------------------------------------ drain
    async def _worker(self, tier: Tier) -> None:
        q = self._queues[tier.name]
        while True:
            job, step = await q.get()
            # a newer step of the same job already waiting supersedes this one for this tier
            newer = [s for (j, s) in list(q._queue) if j == job and s > step]  # noqa: SLF001
            if newer:
                log.info("%s step %d not written to %s: step %d supersedes it", job, step, tier.name, max(newer))
                self._drained(tier, job, step)
                continue
            try:
                await self._drain_step(tier, job, step)
                self.stats["drained"][tier.name] += 1
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.book.error(job, f"step {step} could not be written to the {tier.name} tier "
                                     f"({tier.describe()}): {e}")
            finally:
                self._drained(tier, job, step)
            with contextlib.suppress(Exception):
                await self.trim(tier, job)
            await self.trim(self.memory, job, layouts=False)

    def _drained(self, tier: Tier, job: str, step: int) -> None:
        left = self.book.draining.get((job, step))
        if left is not None:
            left.discard(tier.name)
            if not left:
                del self.book.draining[(job, step)]
                self.book.settle(job, step)

    async def _drain_step(self, tier: Tier, job: str, step: int) -> None:
        mkey = keys.manifest_key(job, step)
        manifest_bytes = await asyncio.to_thread(self.memory.get, mkey)
        m = self.book.manifests.parse(manifest_bytes, job=job, step=step)
        t0 = time.perf_counter()
        if tier.name == "s3" or not self.settings.disk_whole:
            # S3 and (unless ``disk_whole``) the job's disks hold every chunk once: a rank holding copies
            # another rank writes puts only its durable part there, under the manifest that says so (the same
            # bytes from every node); a disk restore reads the other ranks' parts from their nodes' disks
            view = durable_view(m)
            if view is not m:
                m, manifest_bytes = view, view.to_bytes()

        async def one(rank: int, size: int) -> None:
            n = await self.budget.acquire(size)
            try:
                src = self.memory.path(keys.shard_key(job, step, rank))
                await self._run(tier, _put_head, tier, keys.shard_key(job, step, rank), src, size)
            finally:
                await self.budget.release(n)

        mine = [s for s in m.shards if s.node == self.me]
        if not mine:
            return  # this node took no shard of the step from a trainer: nothing of it is this node's to write
        # layouts first (once per tier), then shards, then the manifest: what a manifest names is always there
        for digest in sorted({s.layout for s in mine if s.layout}):
            await self.layouts.ensure(tier.name, tier, job, digest, run=functools.partial(self._run, tier))
        await asyncio.gather(*(one(s.rank, s.size) for s in mine))
        nbytes = sum(s.size for s in mine)
        if tier.name == "s3" and len(mine) < len(m.shards):
            # a shared bucket: the manifest goes in once every node's shards are there; the last node to
            # finish sees them all (S3 lists are strongly consistent) and commits the step
            present = set(await self._run(tier, tier.list, keys.step_prefix(job, step)))
            if not all(keys.shard_key(job, step, s.rank) in present for s in m.shards):
                log.info("%s step %d: this node's shards are in %s; the last node to finish commits it",
                         job, step, tier.name)
                return
        await self._run(tier, tier.put, mkey, manifest_bytes)
        await self._run(tier, step_index.note_commit, tier, m)
        dt = time.perf_counter() - t0
        log.info("%s step %d written to %s: %d bytes in %.2f s (%.2f GB/s)", job, step, tier.name,
                 nbytes, dt, nbytes / dt / 1e9 if dt else 0)

    # ------------------------------------------------------------------ retention
    async def trim(self, tier: Tier, job: str, *, layouts: bool = True) -> None:
        """Retention of ``job`` in one tier (memory, disk or S3): keep the newest ``keep_*`` committed
        steps, drop the stale uncommitted ones, never a step being written from or to this tier. In memory,
        a dropped step some ranks committed is abandoned and waiting trainers look for a free slot again.
        With ``layouts``, then drop the layout objects no retained step names (not in the shared S3 prefix:
        another node may be writing a step that names one)."""
        is_memory = tier is self.memory
        keep = {"memory": self.settings.keep_memory, "disk": self.settings.keep_disk,
                "s3": self.settings.keep_s3}[tier.name]
        # which steps are committed is all retention needs: the manifests are not parsed (O(world) each)
        inv = await self._run(tier, functools.partial(scan_tier, tier, job, with_sizes=False, manifests=False))
        steps = inv.job(job)
        # committed = manifest here, whatever shards this place holds (a node's disk holds its own ranks only)
        committed = sorted(s for s, st in steps.items() if st.committed)
        drop = set(committed[:-keep]) if len(committed) > keep else set()
        # steps without a manifest older than the newest committed one will never be committed here
        drop |= inv.stale_steps(job)
        if is_memory:
            drop = {s for s in drop if not self.book.draining.get((job, s))}
        else:
            drop = {s for s in drop if tier.name not in self.book.draining.get((job, s), set())}
        for s in sorted(drop):
            if is_memory:
                self.book.abandon(job, s)
            await self._run(tier, delete_step, tier, job, s)
            if not is_memory:
                log.info("%s step %d removed from %s (retention keeps %d)", job, s, tier.name, keep)
        if is_memory and drop:
            await self.slots_freed()
        if layouts and tier.name != "s3":
            using = {d for (j, _), p in self.book.pending.items() if j == job
                     for d in [*p.layouts.values(), *(v[1] for v in p.durables.values())]}
            await self.layouts.trim(tier, job, using)

    async def trim_all(self) -> None:
        """Memory's retention for every job it holds (at start-up)."""
        for job in {k[0] for k in self.book.draining} | set((await asyncio.to_thread(scan_tier, self.memory)).steps):
            await self.trim(self.memory, job, layouts=False)
