"""The step book: what this agent knows of each step, from the first rank's commit to its last write.

A step's life here::

    admit / record   a rank's commit row arrives — from a trainer on this node (its shard is in the
                     memory folder) or from a peer up the commit tree (only its size and checksum);
                     both take the same path into the step's :class:`Pending` entry
    finish           all ``world`` rows are here (a single node, or the commit tree's root): build the
                     manifest from them
    commit_manifest  write it to memory last (the step is complete in this node's memory), then hand
                     it to ``on_commit`` (the drains it is due, retention)
    draining         the tiers it is being written to (agents.drain); ``settled`` is set once every
                     write finished (or failed, or the step was abandoned)

A node that is not the commit tree's root gets the manifest from its parent
(:meth:`StepBook.receive_manifest`) and commits it the same way. The book also
keeps, per job, the newest step it has any sign of, and the background errors
to hand to the job's trainers, once, in the answer to their next request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from recovery import step_index
from tiers import keys
from tiers.errors import ManifestError
from tiers.manifest import JsonEntry, Manifest, ManifestCache, ShardInfo, decode_group
from tiers.wire import CHECKSUM_RE
from tiers.memory import MemoryTier

from .layouts import parse_values
from .protocol import RequestError

__all__ = ["Pending", "Row", "StepBook"]

log = logging.getLogger("tierckpt.agent")

#: notices a job's trainers have not taken yet, kept per job at most
MAX_NOTICES = 100


@dataclass
class Pending:
    """A step some ranks have committed: per-rank layouts and checksums as they arrive."""

    world: int
    save_index: int
    metadata: dict
    sizes: dict[int, int] = field(default_factory=dict)
    #: each rank's JSON values, parsed and checked once when they arrive
    entries: dict[int, tuple] = field(default_factory=dict)
    #: each rank's layout digest
    layouts: dict[int, str] = field(default_factory=dict)
    checksums: dict[int, asyncio.Future] = field(default_factory=dict)
    #: ranks that hold copies another rank writes to the shared tier: (bytes of the durable part, its
    #: layout's digest, its checksum) -- see ``ShardInfo.durable``
    durables: dict[int, tuple[int, str, asyncio.Future]] = field(default_factory=dict)
    #: ranks that hold chunks other ranks hold copies of: (bytes of the unique part, the holder groups, its
    #: checksum) -- see ``ShardInfo.unique``
    uniques: dict[int, tuple[int, tuple, asyncio.Future]] = field(default_factory=dict)
    nodes: dict[int, int] = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    #: the manifest is being built (all ``world`` rows are here)
    finishing: bool = False


@dataclass(frozen=True)
class Row:
    """One rank's commit row for one step: what the manifest needs of its shard but the checksum."""

    job: str
    step: int
    rank: int
    world: int
    nbytes: int
    #: the digest of the rank's layout
    layout: str
    values: tuple[JsonEntry, ...]
    save_index: int
    metadata: dict
    #: the node whose memory took the shard from its trainer
    node: int
    #: (bytes, layout digest) of the shard's durable part when it holds copies another rank writes
    durable: tuple[int, str] | None = None
    #: (bytes, holder groups) of the shard's unique part when other ranks hold copies of some of its chunks
    unique: tuple[int, tuple[tuple[int, ...], ...]] | None = None

    @classmethod
    def parse(cls, rec: dict) -> tuple["Row", str, str | None, str | None]:
        """A row sent up the commit tree, its checksum and those of its durable and unique parts (None when it
        has none); ValueError, KeyError or TypeError if malformed (a field missing, of the wrong type, out of
        range, or a value no manifest can hold)."""
        if not isinstance(rec, dict):
            raise RequestError("a commit row is a JSON object")
        job = keys.check_job(rec["job"])
        step = keys.check_step(rec["step"])
        rank = keys.check_rank(rec["rank"])
        world, nbytes, node = (_count(rec, "world"), _count(rec, "nbytes"), _count(rec, "node"))
        save_index = _count(rec, "save_index", step)
        if not 0 <= rank < world or not isinstance(rec["checksum"], str) or not CHECKSUM_RE.match(rec["checksum"]):
            raise RequestError("rank, world or checksum out of range")
        digest = keys.check_digest(rec["layout"])
        values = parse_values(rec.get("values"))
        metadata = rec.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise RequestError("metadata must be a JSON object")
        try:
            # what the manifest built from this row will have to write: refused here, not at the commit
            json.dumps([rec.get("values"), metadata], allow_nan=False)
        except (ValueError, TypeError) as e:
            raise RequestError(f"values or metadata cannot go into a manifest: {e}") from e
        durable = rec.get("durable")
        if durable is not None:
            if not (isinstance(durable, list) and len(durable) == 3):
                raise RequestError("durable must be [bytes, checksum, layout digest]")
            n = _count({"durable": durable[0]}, "durable")
            if n >= nbytes or not isinstance(durable[1], str) or not CHECKSUM_RE.match(durable[1]):
                raise RequestError("durable bytes or checksum out of range")
            durable = (n, keys.check_digest(durable[2]), durable[1])
        unique = rec.get("unique")
        if unique is not None:
            if not (isinstance(unique, list) and len(unique) == 3) or not isinstance(unique[1], str) \
                    or not CHECKSUM_RE.match(unique[1]):
                raise RequestError("unique must be [bytes, checksum, [[rank, ...], ...]]")
            n = unique_part(unique[0], unique[2], rank, world, nbytes, durable[0] if durable else None)
            unique = (*n, unique[1])
        row = cls(job, step, rank, world, nbytes, digest, values, save_index, metadata, node,
                  durable[:2] if durable else None, unique[:2] if unique else None)
        return row, rec["checksum"], (durable[2] if durable else None), (unique[2] if unique else None)


def unique_part(n: object, groups: object, rank: int, world: int, nbytes: int, durable: int | None
                ) -> tuple[int, tuple[tuple[int, ...], ...]]:
    """A row's unique part ``(bytes, holder groups)`` checked: bytes within the shard (and its durable part),
    each group two or more distinct ranks of the world, ``rank`` among them. RequestError otherwise."""
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= (nbytes if durable is None else durable):
        raise RequestError(f"unique bytes must be an int from 0 to the shard's durable part, got {str(n)[:40]}")
    if not isinstance(groups, list) or not groups or len(groups) > 4096:
        raise RequestError("unique groups must be a list of 1 to 4096 groups of ranks")
    out = []
    for g in groups:
        try:
            out.append(decode_group(g, rank, world))  # a DDP world's group: checked in constant time
        except ValueError as e:
            raise RequestError(f"unique: {e}") from None
    return n, tuple(out)


def check_groups(uniques: dict[int, tuple[tuple[int, ...], ...]]) -> None:
    """Refuse a step whose ranks disagree on who holds copies of their chunks (``uniques``: per rank that
    named any, its holder groups): every rank of a group one rank names must name the same group, since its
    copy of those chunks is written to the shared tiers by the one owner they all deal alike. Holders taken
    from DTensor placements always agree; a ``replicated=`` description given differently on two ranks (or on
    one rank only) does not, and would leave chunks that no rank writes. ValueError saying who disagrees."""
    # each group object once (rows decoded from one encoding share it), then each distinct group once by value:
    # a DDP world's rows are one object, so this is linear in the world, not in its square
    by_id: dict[int, tuple[tuple[int, ...], set[int]]] = {}
    for rank, groups in uniques.items():
        for g in groups:
            by_id.setdefault(id(g), (g, set()))[1].add(rank)
    named: dict[tuple[int, ...], set[int]] = {}
    for g, ranks in by_id.values():
        named.setdefault(g, set()).update(ranks)
    for g, ranks in named.items():
        if len(ranks) != len(g):  # every rank naming a group is in it (unique_part): some member names another
            q = min(set(g) - ranks)
            theirs = [list(x) for x in uniques.get(q, ())]
            raise ValueError(
                f"ranks disagree on who holds copies of each other's tensors: rank {min(ranks)} names the holders "
                f"{list(g)}, but rank {q} names {theirs or 'none'}; every rank of a group must give the same "
                f"Checkpointer(replicated=...) description (the group of ranks holding its copy), or none")


#: the largest count a commit row may carry (world, bytes, node, save index): what a manifest's JSON holds exactly
_MAX_COUNT = 2**53


def _count(rec: dict, name: str, default: int | None = None) -> int:
    """``rec[name]`` as a non-negative integer (``default`` when absent); RequestError otherwise."""
    v = rec.get(name, default) if default is not None else rec[name]
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= _MAX_COUNT:
        raise RequestError(f"{name} must be an integer from 0 to {_MAX_COUNT}, got {str(v)[:40]}")
    return v


class StepBook:
    """Per-step state of one agent and the one intake for commit rows.

    ``tree`` (the commit tree, set when the node has peers) receives committed manifests and, when set,
    builds manifests only at its root; ``on_commit`` runs after a step is committed in memory.
    """

    def __init__(self, memory: MemoryTier, me: int, stats: dict) -> None:
        self.memory = memory
        self.me = me
        self.stats = stats
        self.tree = None
        self.on_commit: Callable[[Manifest], Awaitable[None]] | None = None
        self.pending: dict[tuple[str, int], Pending] = {}
        self.settled: dict[tuple[str, int], asyncio.Event] = {}
        #: per step, the lower tiers it is being written to
        self.draining: dict[tuple[str, int], set[str]] = {}
        self._errors: dict[str, list[str]] = {}
        self._notices: dict[str, list[str]] = {}
        #: per job, the newest step this agent has any sign of: objects in any tier at start-up, a shard
        #: committed here, a peer's commit record. A step reaches disk or S3 only after it was committed in
        #: some node's memory, and every live node is sent every commit record, so no tier can hold a newer
        #: step of a job this agent has seen (unless it was cut off from its peers meanwhile)
        self._seen_newest: dict[str, int] = {}
        #: every lower tier could be listed at start-up
        self.lower_known = False
        #: manifests parsed here, for every part that reads one again (drains, healing)
        self.manifests = ManifestCache()
        self._locks: dict[str, asyncio.Lock] = {}
        #: per job whose ranks hold copies of each other's chunks: (world, rank → node) of the newest step
        #: committed here, for the replication policy (``Replicator.whole_copies``)
        self.node_maps: dict[str, tuple[int, dict[int, int]]] = {}
        #: steps someone waits to see committed here (or dropped): :meth:`wait_committed`
        self._commit_waits: dict[tuple[str, int], asyncio.Event] = {}

    def lock(self, job: str) -> asyncio.Lock:
        """The job's commit lock: a step's manifest is written and its drains queued under it, and a rewind
        holds it while it drops steps, so a rewind never interleaves with a commit. A step the rewind
        forgot before its commit took the lock is not committed (see :meth:`commit_manifest`)."""
        lk = self._locks.get(job)
        if lk is None:
            lk = self._locks[job] = asyncio.Lock()
        return lk

    # ------------------------------------------------------------------ what is known
    def seen(self, job: str, step: int) -> None:
        if step > self._seen_newest.get(job, -1):
            self._seen_newest[job] = step

    def newest(self, job: str) -> int | None:
        """The newest step of ``job`` this agent has any sign of (None: never saw the job)."""
        return self._seen_newest.get(job)

    def error(self, job: str, msg: str) -> None:
        """Store a background failure for the job's trainers (and log it)."""
        log.error("%s: %s", job, msg)
        self._errors.setdefault(job, []).append(msg)

    def notice(self, job: str, msg: str) -> None:
        """Store something the job's trainers should hear about that lost nothing (a copy a peer refused),
        once per message and at most :data:`MAX_NOTICES` per job until a trainer takes them."""
        got = self._notices.setdefault(job, [])
        if msg not in got and len(got) < MAX_NOTICES:
            got.append(msg)

    def take_notices(self, job: str | None) -> list[str]:
        """The job's stored notices, each handed out once."""
        return self._notices.pop(job, []) if job is not None else []

    def take_errors(self, job: str | None) -> list[str]:
        """The job's stored failures, each handed out once."""
        if job is None:
            return []
        return self._errors.pop(job, [])

    def error_counts(self) -> dict[str, int]:
        return {j: len(e) for j, e in self._errors.items()}

    def busy(self) -> bool:
        """Whether any step is being written to a lower tier."""
        return any(self.draining.values())

    async def wait_committed(self, job: str, step: int) -> None:
        """Return once ``step`` is no longer pending here: committed, or dropped (rewound, abandoned)."""
        if (job, step) not in self.pending:
            return
        ev = self._commit_waits.setdefault((job, step), asyncio.Event())
        await ev.wait()

    def _not_pending(self, job: str, step: int) -> None:
        ev = self._commit_waits.pop((job, step), None)
        if ev is not None:
            ev.set()

    def settle(self, job: str, step: int) -> None:
        ev = self.settled.get((job, step))
        if ev:
            ev.set()

    def abandon(self, job: str, step: int) -> None:
        """Forget a step some ranks committed that will never be complete here (it is being deleted)."""
        pend = self.pending.pop((job, step), None)
        self._not_pending(job, step)
        if pend is not None:
            log.warning("%s step %d abandoned: only ranks %s of %d committed it", job, step,
                        sorted(pend.sizes), pend.world)
            self.settle(job, step)

    def forget(self, job: str, step: int) -> None:
        """Forget a step entirely (the job resumed from an earlier one); whoever waits for it is released.
        The commit tree forgets its manifest too: the new run's rows for the same step are new rows, not
        late ones to answer with the manifest of the run that failed."""
        self.pending.pop((job, step), None)
        self._not_pending(job, step)
        ev = self.settled.pop((job, step), None)
        if ev is not None:
            ev.set()
        if self.tree is not None:
            self.tree.forget(job, {step})

    # ------------------------------------------------------------------ intake
    def admit(self, row: Row, *, local: bool) -> Pending | None:
        """First half of the intake: the step's entry for ``row``, created with the first row.

        A trainer's row (``local``) for a step already committed, or for a rank that already committed it,
        is refused (RequestError). A peer's row is idempotent: one for a step already committed here is
        ignored (None). A row whose world differs from the step's is refused either way.
        """
        key = (row.job, row.step)
        self.seen(row.job, row.step)
        pend = self.pending.get(key)
        if pend is None:
            if local:
                if key in self.settled and self.settled[key].is_set():
                    raise RequestError(f"step {row.step} of {row.job} is already committed")
            elif os.path.exists(self.memory.path(keys.manifest_key(row.job, row.step))):
                return None  # committed here already
            pend = self.pending[key] = Pending(row.world, row.save_index, row.metadata)
            self.settled.setdefault(key, asyncio.Event())
        if pend.world != row.world:
            raise RequestError(f"rank {row.rank} says world {row.world}, an earlier rank said {pend.world}")
        if local and row.rank in pend.sizes:
            raise RequestError(f"rank {row.rank} already committed step {row.step} of {row.job}")
        return pend

    def record(self, pend: Pending, row: Row, checksum: asyncio.Future, *, local: bool,
               durable_checksum: asyncio.Future | None = None, unique_checksum: asyncio.Future | None = None
               ) -> None:
        """Second half: add the row (a rank's first row counts); a step with all ``world`` rows gets its
        manifest built — here, unless this is a trainer's row and the commit tree's root builds it.
        ``durable_checksum`` / ``unique_checksum``: the checksums of the row's durable and unique parts, for
        a row that has them."""
        if row.rank not in pend.sizes:
            pend.sizes[row.rank] = row.nbytes
            pend.entries[row.rank] = row.values
            pend.layouts[row.rank] = row.layout
            pend.nodes[row.rank] = row.node
            pend.checksums[row.rank] = checksum
            if row.durable is not None:
                assert durable_checksum is not None
                pend.durables[row.rank] = (row.durable[0], row.durable[1], durable_checksum)
            if row.unique is not None:
                assert unique_checksum is not None
                pend.uniques[row.rank] = (row.unique[0], row.unique[1], unique_checksum)
        if local and self.tree is not None:
            return  # the rows go up the commit tree; its root builds the manifest
        if len(pend.sizes) == pend.world and not pend.finishing:
            pend.finishing = True
            asyncio.create_task(self.finish(row.job, row.step, pend))

    async def take_rows(self, rows: list[dict]) -> None:
        """The commit tree's root takes commit rows (its own node's and every other's): one intake for all.
        A step whose ``world`` rows are all here gets its manifest built, committed here and sent down."""
        loop = asyncio.get_running_loop()
        for rec in rows:
            try:
                row, checksum, durable_checksum, unique_checksum = Row.parse(rec)
            except (ValueError, KeyError, TypeError) as e:
                log.warning("commit row dropped: %s", e)
                continue
            try:
                pend = self.admit(row, local=False)
            except RequestError as e:
                log.warning("%s step %d: %s: row dropped", row.job, row.step, e)
                continue
            if pend is None:
                continue
            fut = loop.create_future()
            fut.set_result(checksum)
            dfut = ufut = None
            if durable_checksum is not None:
                dfut = loop.create_future()
                dfut.set_result(durable_checksum)
            if unique_checksum is not None:
                ufut = loop.create_future()
                ufut.set_result(unique_checksum)
            self.record(pend, row, fut, local=False, durable_checksum=dfut, unique_checksum=ufut)

    # ------------------------------------------------------------------ commit
    async def finish(self, job: str, step: int, pend: Pending) -> None:
        """All ``world`` rows are here (a single node, or the commit tree's root): build the manifest,
        commit it here, and send it down the tree."""
        key = (job, step)
        try:
            shards = []
            for r in range(pend.world):
                durable = None
                if r in pend.durables:
                    n, digest, dsum = pend.durables[r]
                    durable = (n, await dsum, digest)
                unique = None
                if r in pend.uniques:
                    n, groups, usum = pend.uniques[r]
                    unique = (n, await usum, groups)
                shards.append(ShardInfo(r, pend.sizes[r], await pend.checksums[r], pend.entries[r],
                                        pend.nodes.get(r, self.me), pend.layouts[r], durable, unique))
            check_groups({s.rank: s.unique[2] for s in shards if s.unique is not None})
            meta = dict(pend.metadata)
            meta["save_index"] = pend.save_index
            m = Manifest(job, step, pend.world, tuple(shards), meta, created=pend.created)
            data = m.to_bytes()
            self.manifests.remember(data, m)
        except Exception as e:
            if self.pending.get(key) is not pend:
                # a rewind (or retention) dropped the step and its shards meanwhile: no failure of the job
                log.info("%s step %d not committed: dropped (rewound, or abandoned by retention) while "
                         "it was finishing (%s)", job, step, e)
                return
            self.error(job, f"step {step} could not be committed to memory: {e}")
            self.pending.pop(key, None)
            self._not_pending(job, step)
            self.settled.setdefault(key, asyncio.Event()).set()
            return
        await self.commit_manifest(m, data, broadcast=True, pend=pend)

    async def receive_manifest(self, data: bytes) -> bool:
        """A manifest the commit tree's root built: verify it and commit the step here. True if new here."""
        try:
            m = self.manifests.parse(data)
        except ManifestError as e:
            log.warning("a manifest sent down the commit tree was refused: %s", e)
            return False
        if (m.job, m.step) not in self.pending and os.path.exists(self.memory.path(keys.manifest_key(m.job, m.step))):
            self.tree.committed(m.job, m.step, data)
            return False
        stale = self._other_run(m)
        if stale:
            log.warning("%s step %d: a manifest sent down the commit tree was refused: %s", m.job, m.step, stale)
            return False
        # a step this node's ranks committed is finished here even when its manifest came first another way
        # (a peer's re-replication pushes manifests): its drains are queued and waiting trainers released
        return await self.commit_manifest(m, data)

    def _other_run(self, m: Manifest) -> str:
        """Why ``m`` cannot be this node's commit of its step ("" when it can): a shard this node took from
        a trainer has another checksum (the manifest is of a run a rewind dropped), or is not here."""
        pend = self.pending.get((m.job, m.step))
        if pend is not None:
            # only the ranks this node took: not a pass over the world's shards at every node and step
            for rank, fut in pend.checksums.items():
                sh = m.shards[rank] if rank < m.world else None
                if sh is not None and fut.done() and not fut.cancelled() and fut.exception() is None \
                        and fut.result() != sh.checksum:
                    return (f"rank {rank}'s shard here has checksum {fut.result()}, the manifest says "
                            f"{sh.checksum} (a manifest of a run that was rewound)")
            return ""
        for sh in m.shards:
            if sh.node == self.me:
                try:
                    size = os.path.getsize(self.memory.path(keys.shard_key(m.job, m.step, sh.rank)))
                except OSError:
                    size = None
                if size != sh.size:
                    return f"rank {sh.rank}'s shard, which this node took, is not here with {sh.size} bytes"
        return ""

    async def commit_manifest(self, m: Manifest, data: bytes, broadcast: bool = False,
                              pend: Pending | None = None) -> bool:
        """Commit a step in this node's memory: the manifest written last, then the drains it is due.

        Runs under the job's :meth:`lock`. ``pend``: the entry the manifest was built from; when a rewind
        forgot it meanwhile, nothing is written (the step's shards are gone with it) and False is returned.
        With ``broadcast`` (at the commit tree's root) the manifest goes down the tree as soon as it is
        committed here, before this node's drains are queued and its memory trimmed."""
        job, step = m.job, m.step
        key = (job, step)
        async with self.lock(job):
            if pend is not None and self.pending.get(key) is not pend:
                log.info("%s step %d not committed: dropped (rewound, or abandoned by retention) while "
                         "it was finishing", job, step)
                return False
            settled = self.settled.setdefault(key, asyncio.Event())
            try:
                await asyncio.to_thread(self.memory.put, keys.manifest_key(job, step), data)
            except Exception as e:
                self.error(job, f"step {step} could not be committed to memory: {e}")
                self.pending.pop(key, None)
                self._not_pending(job, step)
                settled.set()
                return False
            self.pending.pop(key, None)
            self.seen(job, step)
            self.stats["saves"] += 1
            if any(sh.unique is not None for sh in m.shards):
                self.node_maps[job] = (m.world, {sh.rank: sh.node for sh in m.shards})
            self._not_pending(job, step)
            if self.tree is not None:
                self.tree.committed(job, step, data)
                if broadcast:
                    self.tree.broadcast(data)
            await self.on_commit(m)
            await asyncio.to_thread(step_index.note_commit, self.memory, m)
        return True
