"""Layouts as the agent keeps them: parsed once, stored once per place, named by digest, trimmed when unused.

A rank's layout (its tensor chunks, :class:`~tiers.layout.Layout`) rarely
changes between saves, so a trainer sends its entries once and names the
layout by digest afterwards. Call order, per commit and per place::

    commit(job, rank, nbytes, req)       a commit's layout and JSON values; a new layout is checked
                                         against the shard and stored in memory (UnknownLayoutError
                                         for a digest never sent)
    ensure(place, tier, job, digest)     before a shard naming it is written to a lower tier
    held(place, job, digest) / mark(…)   the replicator's bookkeeping of layouts sent to peers
    trim(tier, job, using)               retention (agents.drain): drop the layouts no manifest names
    forget_place(place)                  a peer came back empty (declared dead)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time

from tiers import keys
from tiers.base import Tier
from tiers.errors import KeyNotFoundError, ManifestError, TierError
from tiers.layout import Layout
from tiers.manifest import JsonEntry, TensorChunk, validate_layout
from tiers.memory import MemoryTier

from recovery.inventory import scan_tier

from .protocol import RequestError, UnknownLayoutError

__all__ = ["LayoutBook", "parse_values"]

log = logging.getLogger("tierckpt.agent")


def parse_values(raw: object) -> tuple[JsonEntry, ...]:
    """A rank's JSON values sent as ``[[name, value], ...]`` (None is none); RequestError otherwise."""
    raw = raw or []
    if not isinstance(raw, list) or not all(isinstance(v, list) and len(v) == 2 and isinstance(v[0], str)
                                            for v in raw):
        raise RequestError("values must be a list of [name, value]")
    return tuple(JsonEntry(n, v) for n, v in raw)


class LayoutBook:
    """The layouts this agent has parsed and where their objects are known to be stored."""

    def __init__(self, memory: MemoryTier, layout_grace: float) -> None:
        self.memory = memory
        #: seconds an unnamed layout object is kept (it is stored before the manifest that names it)
        self.layout_grace = layout_grace
        #: layouts this agent has parsed, by (job, digest): each is parsed and stored once, then named by digest
        self._parsed: dict[tuple[str, str], Layout] = {}
        #: (job, layout digest, durable bytes) -> the durable part's layout (see :meth:`durable`)
        self._durable: dict[tuple[str, str, int], Layout] = {}
        #: (layout digest, offset) pairs known to fall between chunks (see :meth:`check_boundary`)
        self._boundaries: set[tuple[str, int]] = set()
        #: (place, job, digest) of layout objects known to be stored in a place (a tier name, or a peer node)
        self._at: set[tuple[str, str, str]] = set()
        self._trimmed: dict[tuple[str, str], float] = {}

    def held(self, place: str, job: str, digest: str) -> bool:
        """Whether the layout object is known to be stored in ``place``."""
        return (place, job, digest) in self._at

    def mark(self, place: str, job: str, digest: str) -> None:
        """Note that ``place`` holds the layout object."""
        self._at.add((place, job, digest))

    def forget(self, place: str, job: str, digest: str) -> None:
        """``place`` no longer holds the layout object (it came back empty)."""
        self._at.discard((place, job, digest))

    def forget_place(self, place: str) -> None:
        """``place`` holds none of what it held (a peer declared dead comes back empty)."""
        self._at = {p for p in self._at if p[0] != place}

    async def commit(self, job: str, rank: int, nbytes: int, req: dict) -> tuple[Layout, tuple]:
        """The committing rank's layout and JSON values.

        A trainer sends its layout's entries when the layout is new (or changed) and names it by digest
        (``layout``) otherwise; ``values`` are its JSON values as ``[[name, value], ...]``. Entries that mix
        tensor chunks and JSON values (``{"kind": "json"}``) are read too. A new layout is checked against
        the shard, stored once in the memory tier and named by digest from then on. Raises
        UnknownLayoutError for a digest this agent does not hold, so the trainer sends the entries.
        """
        where = f"rank {rank} layout"
        values: list = []
        entries = req.get("entries")
        digest = req.get("layout")
        if entries is not None:
            parsed = validate_layout(entries, nbytes, where)
            layout = Layout(tuple(e for e in parsed if isinstance(e, TensorChunk)))
            values = [e for e in parsed if isinstance(e, JsonEntry)]
            if digest is not None and digest != layout.digest:
                raise RequestError(f"{where}: the entries sent have digest {layout.digest}, the commit names {digest}")
        else:
            if not isinstance(digest, str):
                raise RequestError("a commit needs its layout: 'entries', or 'layout' (a digest) sent before")
            keys.check_digest(digest)
            layout = self._parsed.get((job, digest))
            if layout is None:
                try:
                    data = await asyncio.to_thread(self.memory.get, keys.layout_key(job, digest))
                    layout = Layout.from_bytes(data, digest)
                except (KeyNotFoundError, ManifestError) as e:
                    raise UnknownLayoutError(f"layout {digest} of {job} is not held by this agent ({e}): "
                                             "send its entries") from e
        values += parse_values(req.get("values"))
        names = [c.name for c in layout.chunks] + [v.name for v in values]
        if len(set(names)) != len(names):
            raise RequestError(f"{where}: a name appears twice among the tensors and values")
        try:
            layout.check_fits(nbytes, f"rank {rank}")
        except ManifestError as e:
            raise RequestError(str(e)) from e
        if (job, layout.digest) not in self._parsed:
            if len(self._parsed) > 4096:  # a job that changes layouts all the time: forget the oldest
                self._parsed.pop(next(iter(self._parsed)))
            self._parsed[(job, layout.digest)] = layout
        await self._keep(job, layout)
        return layout, tuple(values)

    async def _keep(self, job: str, layout: Layout) -> None:
        """Store ``layout`` in the memory tier once (a drain copies it from there to each lower tier)."""
        if not self.held("memory", job, layout.digest):
            lkey = keys.layout_key(job, layout.digest)
            if not await asyncio.to_thread(os.path.exists, self.memory.path(lkey)):
                await asyncio.to_thread(self.memory.put, lkey, layout.to_bytes())
            self.mark("memory", job, layout.digest)

    def check_boundary(self, rank: int, layout: Layout, at: int, what: str) -> None:
        """RequestError when ``at`` falls inside a chunk of ``layout`` (``what`` names the part that ends there);
        remembered per layout, so an unchanged layout is walked once, not at every save."""
        if (layout.digest, at) in self._boundaries:
            return
        cut = next((c for c in layout.chunks if c.nbytes and c.offset < at < c.offset + c.nbytes), None)
        if cut is not None:
            raise RequestError(f"rank {rank}: {what} {at} cuts the chunk {cut.name!r} in two")
        if len(self._boundaries) > 4096:
            self._boundaries.clear()
        self._boundaries.add((layout.digest, at))

    async def durable(self, job: str, rank: int, layout: Layout, durable: int) -> Layout:
        """The layout of the first ``durable`` bytes of a shard laid out by ``layout`` (the chunks the rank writes
        to the shared tier: every chunk with bytes that ends by then, and the empty ones; every other chunk
        starts at or after it), stored like a committed layout. Raises RequestError for a ``durable`` that cuts
        a chunk in two or lies outside the shard."""
        if isinstance(durable, bool) or not isinstance(durable, int) or not 0 <= durable < layout.end:
            raise RequestError(f"rank {rank}: durable must be an int from 0 to below the layout's end "
                               f"{layout.end}, got {str(durable)[:40]}")
        known = self._durable.get((job, layout.digest, durable))
        if known is not None:  # every save of an unchanged layout: computed once
            await self._keep(job, known)  # stored again if retention removed it meanwhile
            return known
        head = []
        for c in layout.chunks:
            if not c.nbytes or c.offset + c.nbytes <= durable:
                head.append(c)
            elif c.offset < durable:
                raise RequestError(f"rank {rank}: durable {durable} cuts the chunk {c.name!r} in two")
        part = Layout(tuple(head))
        if (job, part.digest) not in self._parsed:
            self._parsed[(job, part.digest)] = part
        await self._keep(job, part)
        if len(self._durable) > 4096:
            self._durable.pop(next(iter(self._durable)))
        self._durable[(job, layout.digest, durable)] = part
        return part

    async def ensure(self, place: str, tier: Tier, job: str, digest: str, run=asyncio.to_thread) -> None:
        """Store the layout object ``digest`` in ``tier`` (``place`` names it) unless it is known to be there.

        ``run(fn, *args)`` runs the blocking calls (by default in the default executor)."""
        if self.held(place, job, digest):
            return
        lkey = keys.layout_key(job, digest)
        try:
            await run(tier.stat, lkey)
        except KeyNotFoundError:
            await run(tier.put, lkey, self.memory.path(lkey))
        self.mark(place, job, digest)

    async def trim(self, tier: Tier, job: str, using: set[str]) -> None:
        """Delete the layout objects of ``job`` in a tier only this node writes (its memory or disk) that no
        manifest there names and no step being committed uses (``using``), once older than ``layout_grace``
        seconds (a layout is stored before the manifest that names it). The shared S3 prefix keeps its
        layouts: another node may be writing a step that names one; ``ckpt gc --all`` removes them with the
        job."""
        last = self._trimmed.get((tier.name, job), 0.0)
        if time.monotonic() - last < min(60.0, self.layout_grace):
            return  # at most once a minute: layouts change rarely, and this reads every manifest of the job
        self._trimmed[(tier.name, job)] = time.monotonic()

        def run() -> list[str]:
            listed = tier.list(keys.layouts_prefix(job))
            if not listed:
                return []
            inv = scan_tier(tier, job, with_sizes=False)
            steps = inv.job(job).values()
            if inv.error is not None or any(st.has_manifest and st.manifest is None for st in steps):
                return []  # a manifest that cannot be read may name any of them
            named = using | {d for st in steps if st.manifest is not None for d in st.manifest.layouts}
            now, dropped = time.time(), []
            for key in listed:
                parsed = keys.parse_layout_key(key)
                if parsed is None or parsed[1] in named:
                    continue
                with contextlib.suppress(KeyNotFoundError):
                    if now - tier.stat(key).mtime > self.layout_grace:
                        tier.delete(key)
                        dropped.append(parsed[1])
            return dropped

        try:
            dropped = await asyncio.to_thread(run)
        except (TierError, OSError) as e:
            log.warning("%s: layouts in the %s tier not trimmed: %s", job, tier.name, e)
            return
        place = "memory" if tier is self.memory else tier.name
        for d in dropped:
            self.forget(place, job, d)
            self._parsed.pop((job, d), None)
        if dropped:
            log.info("%s: %d layouts no retained step names removed from %s", job, len(dropped), tier.name)
