"""Each place's step index kept in step with its manifests, and read in their stead for listings.

Writers of a place call, in this order around the commit point (the manifest):

* :func:`note_commit` after writing a step's manifest there: adds the step's
  row, then checks the manifest is still there (another writer may have
  deleted the step meanwhile) and takes the row out again if not. Where the
  place has no index yet, it makes one from a scan of the place.
* :func:`note_delete` before deleting a step's manifest, and again after: the
  row never outlives the manifest, whatever another writer does in between.
* :func:`rebuild` with a fresh scan of the place (an agent at start, ``ckpt
  gc``): makes the index say what the scan found.

None of them raises: an index that cannot be kept is deleted (and the log
says so), so readers read the manifests until it is rebuilt, and never trust
an index that may claim a step the place no longer holds.

Readers: :func:`list_places` reads each place's index (one object) and falls
back to a scan of the place where the index is absent, damaged or unreadable,
saying why.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Mapping

from tiers import keys
from tiers.base import Tier
from tiers.errors import ConditionalWriteUnsupportedError, KeyNotFoundError, StepIndexError, TierError
from tiers.index import KEEP, IndexStore, StepIndex, StepRow, index_store, rank_ranges, read_index
from tiers.manifest import Manifest

from .inventory import SHARED_TIERS, StepInTier, TierInventory, in_parallel, scan_tier

__all__ = ["PlaceStep", "PlaceSteps", "index_disagreements", "keeps_index", "list_places", "note_commit", "note_delete", "rebuild",
           "manifest_intact", "rebuild_places", "restorable_steps", "rows_of"]

log = logging.getLogger("tierckpt.index")

#: places (by description) that refused a conditional write: no index is kept there by this process
_refused: set[str] = set()


def _store(tier: Tier) -> IndexStore | None:
    return None if tier.describe() in _refused else index_store(tier)


def keeps_index(tier: Tier) -> bool:
    """True for a tier whose step indexes this process writes (a folder, S3 with conditional writes)."""
    return _store(tier) is not None


def rows_of(steps: Mapping[int, StepInTier]) -> dict[int, StepRow]:
    """The index rows of a scan of one place: one per step with a valid manifest there."""
    return {s: st.row for s, st in steps.items() if st.manifest is not None}


def _held(tier: Tier, m: Manifest) -> tuple[list[int], list[int]]:
    """Ranks the place holds of a step just committed there, at the manifest's size and at another size."""
    if tier.name in SHARED_TIERS:
        # the shared prefix is committed by the last node to finish, once every shard is there
        return [s.rank for s in m.shards], []
    held, stray = [], []
    # the step's objects here, listed: a node holds a few ranks of a step, and a stat per rank of the world
    # at every commit costs O(world) (16,384 stats at 16,384 ranks)
    here = {info.rank for info in map(keys.parse_key, tier.list(keys.step_prefix(m.job, m.step)))
            if info is not None and not info.is_manifest and not info.head}
    for rank in sorted(r for r in here if r < m.world):
        s = m.shards[rank]
        try:
            size = tier.stat(keys.shard_key(m.job, m.step, rank)).size
        except KeyNotFoundError:
            continue
        (held if size == s.size else stray).append(s.rank)
    return held, stray


def _with(cur: StepIndex, rows: Mapping[int, StepRow]):
    if all(cur.rows.get(s) == r for s, r in rows.items()):
        return KEEP
    return StepIndex(cur.job, {**cur.rows, **rows})


def _without(cur: StepIndex | None, step: int, manifest: str | None = None):
    row = None if cur is None else cur.rows.get(step)
    if row is None or (manifest is not None and row.manifest != manifest):
        return KEEP
    return StepIndex(cur.job, {s: r for s, r in cur.rows.items() if s != step})


def _confirm(tier: Tier, store: IndexStore, job: str, rows: list[StepRow]) -> None:
    """Take out each of ``rows`` whose manifest is not in the place now (deleted while the row went in)."""
    for row in rows:
        try:
            tier.stat(keys.manifest_key(job, row.step))
        except KeyNotFoundError:
            store.update(job, lambda cur, r=row: _without(cur, r.step, r.manifest))


def _give_up(store: IndexStore, tier: Tier, job: str, what: str, e: BaseException) -> None:
    if isinstance(e, ConditionalWriteUnsupportedError):
        _refused.add(tier.describe())
        log.warning("%s refuses conditional writes: no step index is kept there, and `ckpt list` reads every "
                    "manifest there instead (%s)", tier.describe(), e)
    else:
        log.warning("the step index of %s in the %s tier could not be kept (%s: %s): deleting it, so listings "
                    "read the manifests until an agent start or `ckpt gc %s` rebuilds it", job, tier.name, what, e,
                    job)
    try:
        store.discard(job)
    except (TierError, OSError) as e2:
        log.error("the step index of %s in %s could not be deleted either (%s): `ckpt list` may show steps "
                  "that are gone; `ckpt list --scan` reads the manifests", job, tier.describe(), e2)


def note_commit(tier: Tier, manifest: Manifest) -> None:
    """Add the row of a step whose manifest was just written to ``tier``. Never raises (see the module docstring)."""
    store = _store(tier)
    if store is None:
        return
    job = manifest.job
    try:
        row = StepRow.of(manifest, *_held(tier, manifest))
        cur = store.update(job, lambda cur: KEEP if cur is None else _with(cur, {row.step: row}))
        added = [row]
        if cur is None:
            # no index yet: made from a scan, so it names every step committed here, not only this one
            inv = scan_tier(tier, job)
            if inv.error is not None:
                raise inv.error
            rows = {**rows_of(inv.job(job)), row.step: row}
            store.update(job, lambda cur: StepIndex(job, rows) if cur is None else _with(cur, {row.step: row}))
            added = list(rows.values())
        _confirm(tier, store, job, added)
    except (TierError, OSError, StepIndexError) as e:
        _give_up(store, tier, job, f"step {manifest.step} not added", e)


def note_delete(tier: Tier, job: str, step: int) -> None:
    """Take out the row of ``step``: call before deleting its manifest from ``tier`` and again after.
    Never raises (see the module docstring)."""
    store = _store(tier)
    if store is None:
        return
    try:
        store.update(job, lambda cur: _without(cur, step))
    except (TierError, OSError, StepIndexError) as e:
        _give_up(store, tier, job, f"step {step} not taken out", e)


def rebuild(tier: Tier, job: str, steps: Mapping[int, StepInTier]) -> None:
    """Make ``tier``'s index of ``job`` say what a scan of it found (``steps``, with sizes); write only if it
    differs. A row the scan did not see is kept while its manifest is there (committed after the scan).
    Never raises (see the module docstring)."""
    store = _store(tier)
    if store is None:
        return
    found = rows_of(steps)
    unreadable = {s for s, st in steps.items() if st.committed and st.manifest is None}
    try:
        try:
            before = read_index(tier, job)
        except StepIndexError:
            before = None
        gone = set(unreadable)
        for s in set(before.rows if before else ()) - set(found) - gone:
            try:
                tier.stat(keys.manifest_key(job, s))
            except KeyNotFoundError:
                gone.add(s)
        changed: list[StepRow] = []

        def update(cur: StepIndex | None):
            rows = {s: r for s, r in (cur.rows if cur else {}).items() if s not in found and s not in gone}
            rows.update(found)
            if cur is not None and rows == cur.rows:
                return KEEP
            changed[:] = [r for s, r in rows.items() if cur is None or cur.rows.get(s) != r]
            return StepIndex(job, rows)

        store.update(job, update)
        _confirm(tier, store, job, changed)
    except (TierError, OSError, StepIndexError) as e:
        _give_up(store, tier, job, "not rebuilt", e)


def rebuild_places(invs: list[TierInventory]) -> None:
    """:func:`rebuild` every job of each scan (with sizes) of a whole place, and each job that has only an
    index there. A place that could not be listed is left alone. Never raises."""
    for inv in invs:
        if inv.error is None:
            for job in sorted(set(inv.steps) | inv.indexed):
                rebuild(inv.tier, job, inv.job(job))


def index_disagreements(tier: Tier, job: str, steps: Mapping[int, StepInTier]) -> tuple[str | None, dict[int, str]]:
    """How ``tier``'s index of ``job`` differs from a scan of it (``steps``, with sizes).

    Returns ``(problem with the index as a whole, or None; {step: how its row differs})``; a place with no
    index yields ``("no step index", {})``.
    """
    try:
        idx = read_index(tier, job)
    except (StepIndexError, TierError, OSError) as e:
        return f"step index unusable: {e}", {}
    if idx is None:
        return "no step index", {}
    out: dict[int, str] = {}
    found = rows_of(steps)
    for s in sorted(set(found) | set(idx.rows)):
        mine, theirs = idx.rows.get(s), found.get(s)
        if theirs is None:
            out[s] = "the step index lists it, but no valid manifest is here"
        elif mine is None:
            out[s] = "committed here, but not in the step index"
        elif mine.manifest != theirs.manifest:
            out[s] = "the step index names another manifest"
        elif mine != theirs:
            out[s] = (f"the step index says ranks {_fmt(mine.held)} are here, the objects say {_fmt(theirs.held)}"
                      if mine.held != theirs.held else "the step index's row differs from the manifest")
    return None, out


def _fmt(ranks: frozenset[int]) -> str:
    return ",".join(f"{a}" if b == a + 1 else f"{a}-{b - 1}" for a, b in rank_ranges(ranks)) or "none"


# ---------------------------------------------------------------------- reading, for listings
@dataclass(frozen=True)
class PlaceStep:
    """One step in one place for a listing: its row (None without a valid manifest there); ``committed``:
    the manifest is there, even if unreadable (``problem`` says why)."""

    step: int
    row: StepRow | None
    committed: bool = True
    problem: str | None = None


@dataclass
class PlaceSteps:
    """What one place holds of a job: ``steps``, read from its index (``source == "index"``) or a scan
    (``"scan"``; ``note`` says why), or ``error`` when neither could be read."""

    tier: Tier
    steps: dict[int, PlaceStep] = field(default_factory=dict)
    source: str = "index"
    note: str | None = None
    error: BaseException | None = None
    #: the job listed
    tier_job: str = ""

    @property
    def name(self) -> str:
        return self.tier.name

    @property
    def shared(self) -> bool:
        return self.tier.name in SHARED_TIERS


def _from_scan(tier: Tier, job: str, note: str | None) -> PlaceSteps:
    inv: TierInventory = scan_tier(tier, job)
    if inv.error is not None:
        return PlaceSteps(tier, source="scan", note=note, error=inv.error, tier_job=job)
    steps = {s: PlaceStep(s, st.row, st.committed, st.problem) for s, st in inv.job(job).items()}
    return PlaceSteps(tier, steps, "scan", note, tier_job=job)


def _place(tier: Tier, job: str, scan: bool) -> PlaceSteps:
    if scan:
        return _from_scan(tier, job, None)
    try:
        idx = read_index(tier, job)
    except StepIndexError as e:
        return _from_scan(tier, job, f"its step index is damaged ({e})")
    except (TierError, OSError) as e:
        return _from_scan(tier, job, f"its step index could not be read ({e})")
    if idx is None:
        return _from_scan(tier, job, "it has no step index")
    return PlaceSteps(tier, {s: PlaceStep(s, r) for s, r in idx.rows.items()}, tier_job=job)


def list_places(tiers: list[Tier], job: str, *, scan: bool = False, timeout: float = 30.0) -> list[PlaceSteps]:
    """What each tier holds of ``job``, in parallel and in the given order: from each tier's step index (one
    object), or from a scan of every manifest there when ``scan`` is set or the index is absent, damaged or
    unreadable. A tier that does not answer within ``timeout`` seconds gets ``error`` set."""
    keys.check_job(job)
    return in_parallel(tiers, lambda t: _place(t, job, scan), lambda t, e: PlaceSteps(t, error=e, tier_job=job),
                       timeout)


def manifest_intact(tier: Tier, job: str, step: int, claimed: str) -> bool:
    """Whether the manifest of ``step`` in ``tier`` is the one an index row names (``claimed``: its checksum),
    whole: its bytes end in the seal over them (a version-2 manifest as written), or hash to ``claimed`` (one
    without a seal of its own). One read and one hash over its bytes, no parse. A manifest that cannot be
    read is not intact."""
    from tiers import _sealed

    try:
        raw = bytes(tier.get(keys.manifest_key(job, step)))
    except (TierError, OSError):
        return False
    tail = b',"checksum":"' + claimed.encode() + b'"}'
    if raw.endswith(tail) and _sealed.checksum_of(raw[: -len(tail)] + b"}") == claimed:
        return True
    if _sealed.checksum_of(raw) == claimed:
        return True
    try:  # sealed, but not as its writer serialised it (a tool rewrote it): the parse decides
        return Manifest.from_bytes(raw, job=job, step=step).checksum == claimed
    except ValueError:
        return False


def restorable_steps(places: list[PlaceSteps], *, check_newest: bool = False) -> set[int]:
    """Steps whose every shard is held, at the manifest's size, by a place that committed the same manifest as
    the first place (in the given order) holding the step.

    ``check_newest``: the rows come from step indexes, which say a manifest was committed, not that its bytes
    are still whole. The newest step found restorable has each of its places' manifests read and its checksum
    checked (:func:`manifest_intact`); a place whose manifest is damaged no longer counts (its row is marked
    so: ``PlaceStep.problem``), and the next newest step is checked the same way until one holds. Older steps
    are taken from the indexes as they are: the check costs one step's manifests, not the job's history."""
    out: set[int] = set()
    checking = check_newest
    for step in sorted({s for p in places for s in p.steps}, reverse=True):
        while True:
            held = [(p, p.steps[step]) for p in places if step in p.steps and p.steps[step].row is not None]
            if not held:
                break
            first = held[0][1].row
            same = [(p, st) for p, st in held if st.row.manifest == first.manifest and st.row.world == first.world]
            if len(set().union(*(st.row.held for _, st in same))) != first.world:
                break
            if not checking:
                out.add(step)
                break
            # a scan parsed (and so checked) every manifest it lists already
            bad = [(p, st) for p, st in same if p.source != "scan"
                   and not manifest_intact(p.tier, p.tier_job, step, st.row.manifest)]
            if not bad:
                out.add(step)
                checking = False
                break
            for p, st in bad:
                p.steps[step] = PlaceStep(step, None, True, "the manifest is damaged (its checksum does not match)")
    return out
