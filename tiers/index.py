"""The step index: one object per job and place naming the steps committed there, so a listing reads one object.

Key ``<job>/index.json`` (:func:`tiers.keys.index_key`), in every place that
keeps one (a node's memory and disk folders, the shared S3 prefix). Format,
version 1: canonical JSON (no spaces, keys in the order below), ending in a
checksum of its own bytes like a version-2 manifest::

    {"format": "tierckpt-index", "version": 1, "job": J,
     "rows": [{"step": N, "world": W, "bytes": B, "created": T, "manifest": "xxh3_64:…",
               "nodes": [[first, end, node], ...], "held": [[first, end], ...],
               "stray": [[first, end], ...]}, ...],
     "checksum": "xxh3_64:…"}

One row per step whose manifest is in the place, ascending by step: its world
size, total shard bytes, creation time (unix seconds) and the manifest's own
checksum (:attr:`tiers.manifest.Manifest.checksum`); which node took each rank
(``nodes``: runs of ranks ``[first, end)``, usually one run per node); the ranks
whose shards the place held at the manifest's size when the row was written
(``held``, ranges) and those it held at another size (``stray``, omitted when
empty). What those facts make of the step in the place (complete,
node-complete, missing shards) is :class:`StepRow`'s to say, by the rules of
:mod:`recovery.inventory`.

Rules the writers keep (:mod:`recovery.step_index` keeps them): the manifest
stays the commit point. A row is added after its manifest is written and
checked against it afterwards (removed if the manifest is gone by then); a row
is removed before a step's manifest is deleted and again after. A new index is
made only from a scan of the place. Updates are atomic against other writers:
under a file lock in a folder (memory, disk), by compare-and-swap on the ETag
in S3 (:meth:`tiers.s3.S3Tier.put_if`). A reader that finds the index absent
or damaged reads the manifests instead: parsing is strict and any doubt
raises :class:`StepIndexError`.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

from . import _sealed
from ._folder import FolderTier
from .base import Tier
from .errors import ConditionFailedError, KeyNotFoundError, StepIndexError, TierError
from .keys import check_job, check_step, index_key

__all__ = [
    "INDEX_FORMAT",
    "INDEX_VERSION",
    "MAX_INDEX_BYTES",
    "StepRow",
    "StepIndex",
    "IndexStore",
    "index_store",
    "rank_ranges",
    "read_index",
]

INDEX_FORMAT = "tierckpt-index"
INDEX_VERSION = 1
#: the largest index read or written, in bytes (about 400,000 rows of a job of a few nodes)
MAX_INDEX_BYTES = 64 << 20
_CHECKSUM_PREFIX = "xxh3_64:"
#: compare-and-swap tries of one update before it gives up (each waits a little longer)
_CAS_ATTEMPTS = 40


def rank_ranges(ranks: Iterable[int]) -> list[list[int]]:
    """``[[first, end), ...]`` covering ``ranks``, ascending."""
    out: list[list[int]] = []
    for r in sorted(set(ranks)):
        if out and out[-1][1] == r:
            out[-1][1] = r + 1
        else:
            out.append([r, r + 1])
    return out


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _expand(obj: Any, world: int, width: int, where: str) -> Iterator[list[int]]:
    """Check a list of ascending, disjoint ``[first, end, ...]`` ranges inside ``[0, world)``; yield each."""
    if not isinstance(obj, list):
        raise StepIndexError(f"damaged step index: {where} must be a list")
    prev_end = 0
    for item in obj:
        if not (isinstance(item, list) and len(item) == width and all(_is_int(v) for v in item)):
            raise StepIndexError(f"damaged step index: {where} must hold [first, end{', node' * (width == 3)}]")
        first, end = item[0], item[1]
        if not prev_end <= first < end <= world:
            raise StepIndexError(f"damaged step index: {where} has a range out of order or outside 0..{world}")
        prev_end = end
        yield item


@dataclass(frozen=True)
class StepRow:
    """One step as one place holds it, from that place's index or a scan of it.

    ``nodes[r]`` is the node that took rank ``r`` (``ShardInfo.node``);
    ``held``: the ranks whose shards the place holds at the manifest's size;
    ``stray``: ranks it holds at another size. ``bytes``: the sum of the
    manifest's shard sizes; ``created``: unix seconds; ``manifest``: the
    manifest's checksum (:attr:`tiers.manifest.Manifest.checksum`).
    """

    step: int
    world: int
    bytes: int
    created: float
    manifest: str
    nodes: tuple[int, ...]
    held: frozenset[int]
    stray: frozenset[int] = frozenset()

    @classmethod
    def of(cls, manifest: Any, held: Iterable[int], stray: Iterable[int] = ()) -> "StepRow":
        """The row of a parsed manifest (:class:`tiers.manifest.Manifest`) for a place holding ``held``."""
        if not manifest.checksum:
            manifest.to_bytes()  # a manifest built here learns its checksum by being serialised
        return cls(manifest.step, manifest.world, manifest.total_bytes, manifest.created, manifest.checksum,
                   tuple(s.node for s in manifest.shards), frozenset(held), frozenset(stray) - frozenset(held))

    # -- what the place holds of the step (the rules are in recovery.inventory) ---------------
    @property
    def complete(self) -> bool:
        """Job-complete: every one of the ``world`` shards is here at its size."""
        return len(self.held) == self.world

    @property
    def nodes_complete(self) -> set[int]:
        """The nodes all of whose shards are here at their size."""
        out: set[int] = set()
        missing: set[int] = set()
        for rank, node in enumerate(self.nodes):
            (out if rank in self.held else missing).add(node)
        return out - missing

    def expected_ranks(self, shared: bool, node: int | None = None) -> list[int]:
        """Ranks whose shards the place should hold: all in a shared place; in a node's place, every rank of
        ``node`` (when known) and of each node of which it holds any shard."""
        if shared:
            return list(range(self.world))
        whose = {self.nodes[r] for r in self.held | self.stray} | ({node} if node is not None else set())
        return [r for r, n in enumerate(self.nodes) if n in whose]

    def missing_ranks(self, shared: bool, node: int | None = None) -> list[int]:
        """Of :meth:`expected_ranks`, those not here at the manifest's size."""
        return [r for r in self.expected_ranks(shared, node) if r not in self.held]

    # -- JSON ------------------------------------------------------------------------------
    def to_json(self) -> dict:
        runs: list[list[int]] = []
        for rank, node in enumerate(self.nodes):
            if runs and runs[-1][2] == node:
                runs[-1][1] = rank + 1
            else:
                runs.append([rank, rank + 1, node])
        out = {"step": self.step, "world": self.world, "bytes": self.bytes, "created": self.created,
               "manifest": self.manifest, "nodes": runs, "held": rank_ranges(self.held)}
        if self.stray:
            out["stray"] = rank_ranges(self.stray)
        return out

    @classmethod
    def from_json(cls, obj: Any, where: str) -> "StepRow":
        if not isinstance(obj, dict) or not set(obj) <= {"step", "world", "bytes", "created", "manifest", "nodes",
                                                         "held", "stray"}:
            raise StepIndexError(f"damaged step index: {where} is not a row")
        step, world, nbytes, created, manifest = (obj.get(k) for k in ("step", "world", "bytes", "created",
                                                                       "manifest"))
        if not (_is_int(step) and _is_int(world) and _is_int(nbytes)) or world < 1 or nbytes < 0:
            raise StepIndexError(f"damaged step index: {where} needs integer step, world >= 1 and bytes >= 0")
        try:
            check_step(step)
        except ValueError as e:
            raise StepIndexError(f"damaged step index: {where}: {e}") from e
        if not isinstance(created, (int, float)) or isinstance(created, bool) or not math.isfinite(created) \
                or not 0 <= created < 1e11:
            raise StepIndexError(f"damaged step index: {where}.created must be a time in seconds since 1970")
        if not (isinstance(manifest, str) and manifest.startswith(_CHECKSUM_PREFIX) and len(manifest) < 100):
            raise StepIndexError(f"damaged step index: {where}.manifest must be a manifest checksum")
        nodes: list[int] = []
        for first, end, node in _expand(obj.get("nodes"), world, 3, f"{where}.nodes"):
            if node < 0 or first != len(nodes):
                raise StepIndexError(f"damaged step index: {where}.nodes must name a node >= 0 for every rank")
            nodes += [node] * (end - first)
        if len(nodes) != world:
            raise StepIndexError(f"damaged step index: {where}.nodes must name a node for every rank")
        held = {r for first, end in _expand(obj.get("held"), world, 2, f"{where}.held") for r in range(first, end)}
        stray = {r for first, end in _expand(obj.get("stray", []), world, 2, f"{where}.stray")
                 for r in range(first, end)}
        if held & stray:
            raise StepIndexError(f"damaged step index: {where} holds a rank both at and off its size")
        return cls(step, world, nbytes, float(created), manifest, tuple(nodes), frozenset(held), frozenset(stray))


@dataclass
class StepIndex:
    """A job's step index in one place: ``rows`` by step. See the module docstring."""

    job: str
    rows: dict[int, StepRow]

    def to_bytes(self) -> bytes:
        """Canonical JSON ending in its own checksum. Raises StepIndexError when over MAX_INDEX_BYTES."""
        data, _ = _sealed.seal(_sealed.dumps({"format": INDEX_FORMAT, "version": INDEX_VERSION, "job": self.job,
                                              "rows": [self.rows[s].to_json() for s in sorted(self.rows)]}))
        if len(data) > MAX_INDEX_BYTES:
            raise StepIndexError(f"the step index of {self.job} would be {len(data)} bytes, over the "
                                 f"{MAX_INDEX_BYTES} limit: lower the retention, or list with --scan")
        return data

    @classmethod
    def from_bytes(cls, data: bytes | memoryview, job: str) -> "StepIndex":
        """Parse and check an index of ``job``. Raises StepIndexError for anything damaged or unexpected."""
        obj = _sealed.loads(data, MAX_INDEX_BYTES, StepIndexError, "damaged step index")
        if not isinstance(obj, dict) or obj.get("format") != INDEX_FORMAT:
            raise StepIndexError("damaged step index: not a tierckpt step index")
        claimed = obj.pop("checksum", None)
        if not isinstance(claimed, str) or not _sealed.verify(data, obj, claimed, StepIndexError, "damaged step index"):
            raise StepIndexError("step index checksum mismatch: damaged or edited after it was written")
        if obj.get("version") != INDEX_VERSION:
            raise StepIndexError(f"step index version {obj.get('version')!r} is not read by this library "
                                 f"(reads {INDEX_VERSION})")
        if list(obj) != ["format", "version", "job", "rows"]:
            raise StepIndexError("damaged step index: fields missing, extra or out of order")
        if obj["job"] != job:
            raise StepIndexError(f"step index names job {obj['job']!r} but was stored under {job!r}")
        if not isinstance(obj["rows"], list):
            raise StepIndexError("damaged step index: rows must be a list")
        rows: dict[int, StepRow] = {}
        for i, r in enumerate(obj["rows"]):
            row = StepRow.from_json(r, f"rows[{i}]")
            if rows and row.step <= max(rows):
                raise StepIndexError(f"damaged step index: rows[{i}] is out of order or repeats step {row.step}")
            rows[row.step] = row
        return cls(job, rows)


def read_index(tier: Tier, job: str) -> StepIndex | None:
    """The job's index in ``tier``; None when it has none.

    Raises StepIndexError when it is damaged, TierError when it cannot be read.
    """
    key = index_key(check_job(job))
    try:
        if tier.stat(key).size > MAX_INDEX_BYTES:
            raise StepIndexError(f"damaged step index: over the {MAX_INDEX_BYTES}-byte limit")
        data = tier.get(key)
    except KeyNotFoundError:
        return None
    return StepIndex.from_bytes(data, job)


#: what an update function answers to leave the index as it is
KEEP = object()

Update = Callable[["StepIndex | None"], Any]


class IndexStore:
    """Replaces one place's index atomically against that place's other writers.

    ``update(job, fn)`` reads the index (None when absent or damaged), calls
    ``fn`` with it, and stores what ``fn`` returns (a StepIndex), unless it
    returns :data:`KEEP`; ``fn`` may be called again when another writer got
    there first, so it must only compute. Returns the index as left. Raises
    TierError when the place cannot be read or written, StepIndexError when
    the result is too large.
    """

    def __init__(self, tier: Tier) -> None:
        self.tier = tier

    def update(self, job: str, fn: Update) -> StepIndex | None:
        raise NotImplementedError

    def discard(self, job: str) -> None:
        """Delete the index, so readers read the manifests until it is rebuilt."""
        self.tier.delete(index_key(job))


def _parse_or_none(data: bytes | None, job: str) -> StepIndex | None:
    if data is None:
        return None
    try:
        return StepIndex.from_bytes(data, job)
    except StepIndexError:
        return None  # rebuilt by the caller's update: a damaged index is replaced, never merged into


class _FolderStore(IndexStore):
    """A memory or disk folder: writers (an agent, its peer server, ``ckpt gc``) take a file lock in turn."""

    tier: FolderTier

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(os.path.join(self.tier.root, ".index.lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def update(self, job: str, fn: Update) -> StepIndex | None:
        key = index_key(check_job(job))
        with self._locked():
            try:
                data = self.tier.get(key)
            except KeyNotFoundError:
                data = None
            cur = _parse_or_none(data, job)
            new = fn(cur)
            if new is KEEP:
                return cur
            self.tier.put(key, new.to_bytes())
            return new


class _S3Store(IndexStore):
    """The shared S3 prefix: compare-and-swap on the ETag, retried when another node's update got in first."""

    def update(self, job: str, fn: Update) -> StepIndex | None:
        key = index_key(check_job(job))
        for attempt in range(_CAS_ATTEMPTS):
            try:
                data, etag = self.tier.get_tagged(key, MAX_INDEX_BYTES)
            except KeyNotFoundError:
                data, etag = None, None
            # over the limit (data None, ETag given): replaced like a damaged one
            cur = _parse_or_none(data, job)
            new = fn(cur)
            if new is KEEP:
                return cur
            try:
                self.tier.put_if(key, new.to_bytes(), etag)
                return new
            except ConditionFailedError:
                time.sleep(random.uniform(0, min(1.0, 0.01 * 2 ** attempt)))
        raise TierError(f"the step index of {job} in {self.tier.describe()} kept changing under "
                        f"{_CAS_ATTEMPTS} updates in a row")


def index_store(tier: Tier) -> IndexStore | None:
    """How ``tier`` keeps step indexes: a folder tier or S3; None for a tier whose index is not ours to write
    (a peer's memory: its own agent keeps it)."""
    if isinstance(tier, FolderTier):
        return _FolderStore(tier)
    if callable(getattr(tier, "put_if", None)) and callable(getattr(tier, "get_tagged", None)):
        return _S3Store(tier)
    return None
