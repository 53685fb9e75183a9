"""Planner: the newest step complete across the surviving tiers, and where to read each shard.

Tiers are given in cost order (cheapest first: memory, peer, disk, s3). For
each shard the plan lists every tier that holds it at the right size, cheapest
first; the fetcher tries them in that order. Given a :class:`~recovery.costs.CostModel`,
each shard's sources are ordered by its estimate for that shard's size instead
(ties keep the given order).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tiers import keys
from tiers.base import Tier
from tiers.errors import ManifestError, TierError
from tiers.layout import Layout
from tiers.manifest import Entry, Manifest, ShardInfo

from .costs import CostModel, source_name
from .inventory import TierInventory

__all__ = ["JobNotFoundError", "LayoutUnavailableError", "ReplicaRoute", "RestoreError", "RestorePlan",
           "StepNotFoundError",
           "committed_steps", "complete_steps", "describe_step", "load_layouts", "manifest_for", "plan_restore",
           "replica_nodes", "unreachable", "view_ranks"]


class JobNotFoundError(FileNotFoundError):
    """No tier holds anything of the job."""


class StepNotFoundError(FileNotFoundError):
    """The asked-for step is not complete in any reachable tier."""


class RestoreError(StepNotFoundError):
    """A committed step could not be restored intact from any tier, or a tier that may hold one could not be
    reached; the message names the step, what each tier answered and what to do."""


def unreachable(invs: list[TierInventory]) -> list[str]:
    """The tiers that could not be listed, each as ``<tier> (<place>): <why>``."""
    return [f"{inv.name} ({source_name(inv.tier)}): {inv.error}" for inv in invs if inv.error is not None]


def committed_steps(invs: list[TierInventory], job: str) -> set[int]:
    """Steps whose manifest is present in some tier, valid or not: steps that were committed somewhere."""
    return {s for inv in invs for s, st in inv.job(job).items() if st.has_manifest}


def describe_step(invs: list[TierInventory], job: str, step: int) -> str:
    """What each tier holds of ``step``, for an error message: ``memory: manifest damaged (...); s3: ...``."""
    out = []
    for inv in invs:
        if inv.error is not None:
            out.append(f"{inv.name}: unreachable ({inv.error})")
            continue
        st = inv.job(job).get(step)
        if st is None:
            out.append(f"{inv.name}: nothing")
        elif st.problem and st.manifest is None:
            out.append(f"{inv.name}: {st.problem}")
        elif st.manifest is None:
            out.append(f"{inv.name}: shards without a manifest (not committed there)")
        else:
            have = sum(1 for sh in st.manifest.shards if st.shards.get(sh.rank) == sh.size)
            out.append(f"{inv.name}: manifest and {have} of {st.manifest.world} shards"
                       + (f" ({st.problem})" if st.problem else ""))
    return "; ".join(out)


#: the places a node keeps in memory: a restore from them reads no disk and no S3
_MEMORY_TIERS = frozenset({"memory", "peer"})


@dataclass
class ReplicaRoute:
    """How a rank whose own shard no planned place holds (or only disk or S3 does) is restored from the job's
    own replicas (``ShardInfo.unique``): its unique part from ``heads`` (tiers holding ``keys.head_key``,
    in order; none needed when the part is empty), every other chunk from the shard of one rank of each
    holder group, ``holders`` (read like any planned shard: ``RestorePlan.sources`` lists their tiers)."""

    heads: list[Tier]
    holders: list[int]


@dataclass
class RestorePlan:
    """What to restore: ``manifest`` of ``step`` and, per rank, the tiers to read it from in order.

    ``estimates`` maps rank → the cost model's seconds for reading the shard
    from its first source; empty when the plan was made without a cost model.
    """

    job: str
    step: int
    manifest: Manifest
    manifest_tier: Tier
    sources: dict[int, list[Tier]] = field(default_factory=dict)
    estimates: dict[int, float] = field(default_factory=dict)
    #: the layouts of the planned ranks, by digest (read and verified while planning)
    layouts: dict[str, Layout] = field(default_factory=dict)
    #: ranks restored from the job's own replicas instead of their own shard (:class:`ReplicaRoute`)
    replicas: dict[int, ReplicaRoute] = field(default_factory=dict)

    def entries(self, rank: int) -> tuple[Entry, ...]:
        """What ``rank`` saved: its tensor chunks (from its layout) and its JSON values."""
        sh = self.manifest.shard(rank)
        if not sh.layout:
            return sh.entries
        return self.layouts[sh.layout].chunks + sh.entries


def _candidates(invs: list[TierInventory], job: str, skip: set[str] | frozenset[str] = frozenset()
                ) -> dict[int, list[tuple[Manifest, Tier]]]:
    """step → its distinct valid manifests, each with the cheapest tier it came from, in tier order; manifests
    whose checksum is in ``skip`` are passed over (a copy that failed: another tier's may differ). A step has
    two when the shared tier holds it with each chunk once (``tiers.manifest.durable_view``)."""
    out: dict[int, list[tuple[Manifest, Tier]]] = {}
    for inv in invs:
        for step, st in inv.job(job).items():
            m = st.manifest
            if m is not None and m.checksum not in skip:
                got = out.setdefault(step, [])
                if all(m.checksum != other.checksum for other, _ in got):
                    got.append((m, inv.tier))
    return out


def manifest_for(invs: list[TierInventory], job: str, step: int,
                 skip: set[str] | frozenset[str] = frozenset()) -> Manifest | None:
    """The manifest :func:`plan_restore` plans ``step`` by given ``skip``: the cheapest tier's valid one whose
    checksum is not in ``skip``; None when there is none."""
    got = _candidates(invs, job, skip).get(step)
    return got[0][0] if got else None


def _sources(invs: list[TierInventory], job: str, step: int, m: Manifest,
             ranks: list[int] | None = None, costs: CostModel | None = None,
             routes: dict[int, ReplicaRoute] | None = None) -> dict[int, list[Tier]] | None:
    """Per wanted rank, the tiers holding its shard in full, cheapest first; None when some rank's shard is
    nowhere. With ``routes`` (filled in), a rank whose shard is nowhere, or only in disk or S3, is restored
    from its replicas when they and its unique part are reachable (in memory, for the second case): its
    holders' tiers are added to the result instead of its own."""
    sources: dict[int, list[Tier]] = {}
    for shard in m.shards:
        if ranks is not None and shard.rank not in ranks:
            continue
        where = _holding(invs, job, step, shard.rank, shard.size)
        if where and costs is not None:
            where = costs.order(where, shard.size)
        if routes is not None and shard.unique is not None and (not where or where[0].name not in _MEMORY_TIERS):
            route = _replica_route(invs, job, step, m, shard, costs, in_memory=bool(where))
            if route is not None:
                routes[shard.rank] = route[0]
                for q, tiers in route[1].items():
                    sources.setdefault(q, tiers)
                continue
        if not where:
            return None
        sources[shard.rank] = where
    return sources


def view_ranks(m: Manifest, rank: int) -> list[int]:
    """The ranks whose shards hold every chunk of ``rank``'s shard in ``m``, a shared tier's view
    (``tiers.manifest.durable_view``) of a step saved at the world size restoring it: the rank itself (its
    unique part and the replicated chunks it wrote) and the ranks of its holder groups (``ShardInfo.unique``),
    one of which wrote each of its other chunks."""
    u = m.shard(rank).unique
    out = {rank}
    if u is not None:
        out.update(q for g in u[2] for q in g if q < m.world)
    return sorted(out)


def _holding(invs: list[TierInventory], job: str, step: int, rank: int, size: int) -> list[Tier]:
    out = []
    for inv in invs:
        st = inv.job(job).get(step)
        if st is not None and st.shards.get(rank) == size:
            out.append(inv.tier)
    return out


def _replica_route(invs: list[TierInventory], job: str, step: int, m: Manifest, shard: ShardInfo,
                   costs: CostModel | None, in_memory: bool) -> tuple[ReplicaRoute, dict[int, list[Tier]]] | None:
    """Where ``shard``'s unique part and one holder of each of its holder groups are (cheapest holder,
    cheapest place first), or None when one is nowhere (with ``in_memory``: in no memory tier)."""
    assert shard.unique is not None
    n, _, groups = shard.unique
    heads = []
    if n:
        for inv in invs:
            st = inv.job(job).get(step)
            if st is not None and st.heads.get(shard.rank) == n:
                heads.append(inv.tier)
        if in_memory:
            heads = [t for t in heads if t.name in _MEMORY_TIERS]
        if not heads:
            return None
    holders: dict[int, list[Tier]] = {}
    for g in groups:
        best = None
        for q in g:
            if q == shard.rank or q >= m.world:
                continue
            size = m.shard(q).size
            where = _holding(invs, job, step, q, size)
            if in_memory:
                where = [t for t in where if t.name in _MEMORY_TIERS]
            if not where:
                continue
            if costs is not None:
                where = costs.order(where, size)
            cost = costs.estimate(where[0], size) if costs is not None else 0.0
            if best is None or cost < best[0]:
                best = (cost, q, where)
        if best is None:
            return None
        holders.setdefault(best[1], best[2])
    return ReplicaRoute(heads, sorted(holders)), holders


def replica_nodes(invs: list[TierInventory], job: str, rank: int) -> set[int]:
    """The nodes whose memory a restore of ``rank`` may need besides the places listed: those of the ranks
    holding its replicated chunks (``ShardInfo.unique``, by ``ShardInfo.node``), for the steps newer than
    the newest whose shard of ``rank`` a memory place listed holds. Empty when the newest step's shard is in
    memory, or the rank holds no chunk another rank holds.

    A node's placement partners hold its ranks' unique parts; the data-parallel replicas that hold the rest
    may run on any node, so a rank whose node lost its memory looks in their memory too, and only there: a
    few nodes (its replicate degree), not the whole job.
    """
    cands = _candidates(invs, job)
    in_memory = [s for s, got in cands.items() for m, _ in got if rank < m.world and any(
        t.name in _MEMORY_TIERS for t in _holding(invs, job, s, rank, m.shard(rank).size))]
    newest = max(in_memory, default=-1)
    out: set[int] = set()
    for step, got in cands.items():
        if step <= newest:
            continue
        for m, _ in got:
            if rank >= m.world or m.shard(rank).unique is None:
                continue
            for g in m.shard(rank).unique[2]:
                out.update(m.shard(q).node for q in g if q != rank and q < m.world)
    return out


def complete_steps(invs: list[TierInventory], job: str, ranks: list[int] | None = None,
                   replicas: bool = False) -> list[int]:
    """Steps whose manifest and every shard (of ``ranks``, all if None) can be read somewhere, ascending; with
    ``replicas``, a shard counts as readable when its rank can be restored from the job's own replicas
    (:class:`ReplicaRoute`)."""
    return sorted(s for s, got in _candidates(invs, job).items()
                  if any(_sources(invs, job, s, m, ranks, routes={} if replicas else None) is not None
                         for m, _ in got))


def load_layouts(invs: list[TierInventory], job: str, m: Manifest,
                 sources: dict[int, list[Tier]]) -> dict[str, Layout]:
    """Read and verify the layouts of the ranks in ``sources``, each from the first tier that has it intact.

    A rank's layout is looked for in the tiers that hold its shard (in plan
    order), then in every other tier listed. Raises LayoutUnavailableError
    naming what each tier answered when a layout cannot be read intact anywhere.
    """
    out: dict[str, Layout] = {}
    for rank in sorted(sources):
        sh = m.shard(rank)
        if not sh.layout or sh.layout in out:
            continue
        order = list(sources[rank]) + [inv.tier for inv in invs if inv.tier not in sources[rank]]
        tried = []
        for tier in order:
            inv = next((i for i in invs if i.tier is tier), None)
            if inv is None or sh.layout not in inv.layouts.get(job, ()):
                continue
            try:
                layout = Layout.from_bytes(tier.get(keys.layout_key(job, sh.layout)), sh.layout)
                layout.check_fits(sh.size, f"rank {rank}")
            except (ManifestError, TierError, OSError) as e:
                tried.append(f"{tier.name}: {e}")
                continue
            out[sh.layout] = layout
            break
        else:
            where = "; ".join(tried) or "no tier holds it"
            raise LayoutUnavailableError(
                f"step {m.step} of job {job!r}: the layout {sh.layout} of rank {rank} cannot be read intact "
                f"({where}); `ckpt verify {job} --step {m.step}` shows what is damaged")
    return out


class LayoutUnavailableError(StepNotFoundError):
    """A step's manifest names a layout that no reachable tier holds intact."""


def plan_restore(invs: list[TierInventory], job: str, step: int | None = None,
                 ranks: list[int] | None = None, costs: CostModel | None = None,
                 skip: set[str] | frozenset[str] = frozenset(), replicas: bool = False) -> RestorePlan:
    """Plan the restore of ``step`` (the newest complete one if None) for ``ranks`` (all if None).

    A rank of a job restarted with the same world size reads only its own
    shard, so it passes ``ranks=[rank]`` and needs only that shard reachable.
    With ``costs`` each shard's sources are ordered by ``costs.order`` for the
    shard's size and ``RestorePlan.estimates`` is filled; without, they keep
    the order of ``invs``. Manifests whose checksum is in ``skip`` (copies a restore already failed with)
    are passed over for another tier's different manifest of the same step. With ``replicas``, a rank
    whose shard is nowhere, or only in disk or S3, may be planned from the job's own replicas in memory
    (``RestorePlan.replicas``): for a caller that loads such a plan (:meth:`ckpt._load.ShardLoader.load`).

    Raises JobNotFoundError when no tier knows the job, StepNotFoundError when
    the step is not complete anywhere (the message lists the steps that are).
    """
    if not any(inv.job(job) for inv in invs):
        failed = [f"{inv.name}: {inv.error}" for inv in invs if inv.error]
        hint = f" (unreachable: {'; '.join(failed)})" if failed else ""
        raise JobNotFoundError(f"no checkpoint of job {job!r} in any tier{hint}: check the job name and --shm/--disk/--s3")
    cands = _candidates(invs, job, skip)
    steps = sorted(cands, reverse=True) if step is None else [step]
    for s in steps:
        if s not in cands:
            break
        for m, mt in cands[s]:
            routes: dict[int, ReplicaRoute] | None = {} if replicas else None
            src = _sources(invs, job, s, m, ranks, costs, routes)
            if src is not None:
                est = {} if costs is None else \
                    {r: costs.estimate(where[0], m.shard(r).size) for r, where in src.items()}
                routes = routes or {}
                return RestorePlan(job, s, m, mt, src, est,
                                   load_layouts(invs, job, m, {**src, **{r: [] for r in routes}}), routes)
    done = complete_steps(invs, job, ranks, replicas)
    if step is None:
        raise StepNotFoundError(f"job {job!r} has no complete step in any tier (a save may have been cut short)")
    raise StepNotFoundError(
        f"step {step} of job {job!r} is not complete in any tier; complete steps: {done[-10:] or 'none'}"
    )

