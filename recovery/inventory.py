"""Inventory: what each tier holds, by job and step, and what "complete" means in each place.

Complete, per place. The manifest is written last in every place, so its
presence there is the step's commit point in that place. What else a place
must hold depends on whose shards it takes:

* **committed** (:attr:`StepInTier.committed`): the place holds the step's
  manifest. Said of any place; a step committed in a place is never garbage
  there, whatever shards the place lacks.
* **node-complete** (:meth:`StepInTier.node_complete`), what a node's memory
  and disk folders promise: a valid manifest and every shard of the ranks that
  node took from its trainers (``ShardInfo.node == node``) at the manifest's
  size. Other nodes' shards found there are replicas (a peer's memory) and are
  not required. :attr:`StepInTier.nodes_complete` names the nodes a place is
  node-complete for, for readers that do not know whose folder they read.
* **job-complete** (:attr:`StepInTier.complete`), what the shared S3 prefix
  promises (the last node to finish writes the manifest there): a valid
  manifest and all ``world`` shards. A single node's place is job-complete
  too when it holds every rank (one node, or replicas of every other node).
* **restorable**, across places (:func:`recovery.planner.complete_steps`): a
  valid manifest somewhere and every shard somewhere at its size.

A step that has **no** manifest in a place and is older than the newest step
committed there is *stale* there (:func:`stale_steps`): a save cut short, or
one a newer committed step has superseded while it was still being written.
Stale steps are what retention and ``ckpt gc`` remove on their own, ``gc``
only when the step is not restorable either. A step newer than the newest
committed one may still be in flight and is left alone.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Mapping

from tiers import keys
from tiers.base import Tier
from tiers.errors import KeyNotFoundError, ManifestError, TierError
from tiers.index import StepRow
from tiers.manifest import Manifest, ManifestCache

from .costs import source_name

__all__ = ["SHARED_TIERS", "StepInTier", "TierInventory", "in_parallel", "read_manifest", "scan_tier", "scan_tiers",
           "stale_steps"]

#: tiers every node of a job writes to: a step committed there must be job-complete
SHARED_TIERS = frozenset({"s3"})


@dataclass
class StepInTier:
    """One step as one tier holds it. ``shards`` maps rank → stored size in bytes."""

    job: str
    step: int
    has_manifest: bool = False
    shards: dict[int, int] = field(default_factory=dict)
    mtime: float = 0.0
    manifest: Manifest | None = None
    problem: str | None = None
    #: the manifest is present but was not read (a scan that only lists: see :func:`scan_tier`)
    unread: bool = False
    #: rank → stored size of the copies of shards' heads here (``keys.head_key``: a peer holds a shard's
    #: ``ShardInfo.unique`` bytes only when the job's own replicas hold the rest)
    heads: dict[int, int] = field(default_factory=dict)

    @property
    def committed(self) -> bool:
        """The manifest is present here: the step was committed in this place.

        A manifest that is present but could not be parsed or read (``problem``
        says why) still counts: it may come from a newer library version or be
        unreadable only for a moment, and is never taken for garbage.
        """
        return self.has_manifest

    @property
    def row(self) -> StepRow | None:
        """What this place holds of the step, as a step index row (the one place the rules below are computed);
        None without a valid manifest."""
        m = self.manifest
        if m is None:
            return None
        return StepRow.of(m, [s.rank for s in m.shards if self.shards.get(s.rank) == s.size],
                          [s.rank for s in m.shards if s.rank in self.shards])

    @property
    def complete(self) -> bool:
        """Job-complete: manifest present and valid, and all ``world`` shards present at the sizes it names.

        What the shared S3 prefix must hold; a node's own memory or disk folder
        need only be :meth:`node_complete`.
        """
        row = self.row
        return row is not None and row.complete

    def node_complete(self, node: int) -> bool:
        """Node-complete for ``node``: manifest valid, and every shard that node took present at its size.

        What node ``node``'s memory and disk folders must hold. False for a
        node that took no shard of the step (its folders commit nothing of it).
        """
        return node in self.nodes_complete

    @property
    def nodes_complete(self) -> set[int]:
        """The nodes whose every shard (by ``ShardInfo.node``) is here at its size; empty without a valid manifest."""
        row = self.row
        return set() if row is None else row.nodes_complete

    def expected_ranks(self, shared: bool, node: int | None = None) -> list[int]:
        """Ranks whose shards this place should hold for the step, by its manifest (empty without one).

        A shared place (:data:`SHARED_TIERS`) should hold every rank. A node's
        place holds all the shards of a node or none (its own node's, and those
        of the nodes it keeps replicas for), so it should hold every rank of
        ``node`` (the node the place belongs to, when the caller knows it) and
        of each node of which it holds any shard; another node's shards are
        not missing here.
        """
        row = self.row
        return [] if row is None else row.expected_ranks(shared, node)

    def missing_ranks(self, shared: bool, node: int | None = None) -> list[int]:
        """Of :meth:`expected_ranks`, those not here at the size the manifest names."""
        row = self.row
        return [] if row is None else row.missing_ranks(shared, node)

    @property
    def nbytes(self) -> int:
        return sum(self.shards.values()) + sum(max(n, 0) for n in self.heads.values())


@dataclass
class TierInventory:
    """A tier's view: ``steps[job][step]``, or ``error`` if the tier could not be listed.

    ``latency``: median seconds of the tier's manifest reads during the scan
    (small reads, so near the tier's latency: a sample for the cost model), or
    None when no manifest was read.
    """

    tier: Tier
    steps: dict[str, dict[int, StepInTier]] = field(default_factory=dict)
    error: BaseException | None = None
    latency: float | None = None
    #: per job, the digests of the layout objects the tier holds
    layouts: dict[str, set[str]] = field(default_factory=dict)
    #: the jobs that have a step index in the tier
    indexed: set[str] = field(default_factory=set)

    @property
    def name(self) -> str:
        return self.tier.name

    def job(self, job: str) -> dict[int, StepInTier]:
        return self.steps.get(job, {})

    @property
    def shared(self) -> bool:
        """True for a place every node writes to (:data:`SHARED_TIERS`), where committed steps are job-complete."""
        return self.tier.name in SHARED_TIERS

    def complete_steps(self, job: str) -> list[int]:
        """Steps job-complete in this tier alone, ascending."""
        return sorted(s for s, st in self.job(job).items() if st.complete)

    def stale_steps(self, job: str) -> set[int]:
        """The job's steps that will never be committed in this tier: see :func:`stale_steps`."""
        return stale_steps(self.job(job))


def stale_steps(steps: Mapping[int, StepInTier]) -> set[int]:
    """Steps of one place that will never be committed there.

    Those with no manifest in the place (not even an unreadable one) that are
    older than the newest step whose valid manifest is there (or whose
    manifest a listing-only scan saw, unread). A step newer than that one may
    still be in flight and is never named; nor is a step with a manifest,
    whatever else it lacks.
    """
    valid = [s for s, st in steps.items() if st.manifest is not None or st.unread]
    if not valid:
        return set()
    newest = max(valid)
    return {s for s, st in steps.items() if s < newest and not st.committed}


def read_manifest(tier: Tier, job: str, step: int) -> Manifest:
    """Read and validate one manifest; KeyNotFoundError if absent, ManifestError if malformed."""
    data = tier.get(keys.manifest_key(job, step))
    return Manifest.from_bytes(data, job=job, step=step)


def scan_tier(tier: Tier, job: str | None = None, *, with_sizes: bool = True,
              manifests: bool = True, cache: ManifestCache | None = None) -> TierInventory:
    """List a tier (one job or all) and parse every manifest found.

    A tier that cannot be listed yields an inventory with ``error`` set rather
    than raising, so one dead tier never hides the others. With ``manifests``
    False the manifests are not read (``unread`` marks them): enough for
    retention, which needs to know only which steps are committed, and a parse
    costs O(world) (0.1 s at 16,384 ranks). With a ``cache``, a manifest whose bytes were parsed
    before is not parsed again.
    """
    inv = TierInventory(tier)
    try:
        listed = tier.list(keys.job_prefix(job) if job else "")
    except (TierError, OSError) as e:
        inv.error = e
        return inv
    for key in listed:
        info = keys.parse_key(key)
        if info is None:
            lay = keys.parse_layout_key(key)
            if lay is not None:
                inv.layouts.setdefault(lay[0], set()).add(lay[1])
            elif keys.parse_index_key(key) is not None:
                inv.indexed.add(keys.parse_index_key(key))
            continue
        st = inv.steps.setdefault(info.job, {}).setdefault(info.step, StepInTier(info.job, info.step))
        if info.is_manifest:
            st.has_manifest = True
            st.unread = not manifests
        elif info.head:
            st.heads[info.rank] = -1
        else:
            st.shards[info.rank] = -1
    took: list[float] = []
    parse = cache.parse if cache is not None else Manifest.from_bytes
    for job_steps in inv.steps.values():
        for st in job_steps.values():
            _fill(tier, st, with_sizes, took, parse)
    inv.latency = statistics.median(took) if took else None
    return inv


def _fill(tier: Tier, st: StepInTier, with_sizes: bool, took: list[float], parse) -> None:
    if st.has_manifest and not st.unread:
        try:
            t0 = time.perf_counter()
            data = tier.get(keys.manifest_key(st.job, st.step))
            took.append(time.perf_counter() - t0)
            st.manifest = parse(data, job=st.job, step=st.step)
            st.mtime = st.manifest.created
        except ManifestError as e:
            st.problem = str(e)
        except KeyNotFoundError:
            st.has_manifest = False
        except (TierError, OSError) as e:
            st.problem = f"manifest unreadable: {e}"
    for rank in list(st.shards):
        try:
            st.shards[rank] = tier.stat(keys.shard_key(st.job, st.step, rank)).size if with_sizes else 0
        except KeyNotFoundError:
            del st.shards[rank]
        except (TierError, OSError) as e:
            st.problem = f"shard {rank} unreadable: {e}"
            del st.shards[rank]
    for rank in list(st.heads):
        try:
            st.heads[rank] = tier.stat(keys.head_key(st.job, st.step, rank)).size if with_sizes else 0
        except (TierError, OSError):
            del st.heads[rank]  # a head is only ever a spare copy: one that cannot be read is not counted


def scan_tiers(tiers: list[Tier], job: str | None = None, timeout: float = 30.0) -> list[TierInventory]:
    """Scan several tiers in parallel, one inventory per tier in the given order.

    A tier whose scan has not finished ``timeout`` seconds after the call began
    is marked failed (``error`` is a TimeoutError) and left behind: the call
    returns after at most about ``timeout`` seconds however many tiers hang.
    An error other than a tier's own (a bug) is raised here.
    """
    return in_parallel(tiers, lambda t: scan_tier(t, job), _timed_out, timeout)


def _timed_out(t: Tier, e: TimeoutError) -> TierInventory:
    return TierInventory(t, error=e)


def in_parallel(tiers: list[Tier], fn, timed_out, timeout: float) -> list:
    """``fn(tier)`` for every tier at once, in the given order; ``timed_out(tier, TimeoutError)`` stands for
    each call still running ``timeout`` seconds after the start (left behind, never joined). An exception
    ``fn`` raises is raised here. A tier in host memory (``in_host_memory``) runs on the calling thread: it
    cannot hang, and starting a thread for a listing that takes microseconds costs more than the listing
    when the cores are busy (a restart's other work)."""
    results: list = [None] * len(tiers)
    done = [False] * len(tiers)

    def run(i: int, t: Tier) -> None:
        try:
            results[i] = fn(t)
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread below
            results[i] = e
        done[i] = True

    # Daemon threads rather than an executor: an executor's workers are joined
    # when the interpreter exits, so a hung tier would still hold the process.
    inline = [getattr(t, "in_host_memory", False) for t in tiers]
    threads = [threading.Thread(target=run, args=(i, t), name=f"tierckpt-scan-{t.name}", daemon=True)
               for i, t in enumerate(tiers) if not inline[i]]
    deadline = time.monotonic() + timeout
    for th in threads:
        th.start()
    for i, t in enumerate(tiers):
        if inline[i]:
            run(i, t)
    for th in threads:
        th.join(max(0.0, deadline - time.monotonic()))
    out = []
    for i, (t, r) in enumerate(zip(tiers, list(results))):
        if not done[i]:  # still running: left behind
            r = timed_out(t, TimeoutError(f"the {t.name} tier ({source_name(t)}) did not answer within {timeout:g} s"))
        elif isinstance(r, BaseException):
            raise r
        out.append(r)
    return out
