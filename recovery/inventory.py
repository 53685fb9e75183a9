"""Inventory: what each tier holds, by job and step, and whether each step is complete there."""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field

from tiers import keys
from tiers.base import Tier
from tiers.errors import KeyNotFoundError, ManifestError, TierError
from tiers.manifest import Manifest

from .costs import source_name

__all__ = ["StepInTier", "TierInventory", "read_manifest", "scan_tier", "scan_tiers"]


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

    @property
    def complete(self) -> bool:
        """Manifest present and valid, and every shard present at the size it names."""
        m = self.manifest
        if m is None:
            return False
        return all(self.shards.get(s.rank) == s.size for s in m.shards)

    @property
    def nbytes(self) -> int:
        return sum(self.shards.values())


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

    @property
    def name(self) -> str:
        return self.tier.name

    def job(self, job: str) -> dict[int, StepInTier]:
        return self.steps.get(job, {})

    def complete_steps(self, job: str) -> list[int]:
        return sorted(s for s, st in self.job(job).items() if st.complete)


def read_manifest(tier: Tier, job: str, step: int) -> Manifest:
    """Read and validate one manifest; KeyNotFoundError if absent, ManifestError if malformed."""
    data = tier.get(keys.manifest_key(job, step))
    return Manifest.from_bytes(data, job=job, step=step)


def scan_tier(tier: Tier, job: str | None = None, *, with_sizes: bool = True) -> TierInventory:
    """List a tier (one job or all) and parse every manifest found.

    A tier that cannot be listed yields an inventory with ``error`` set rather
    than raising, so one dead tier never hides the others.
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
            continue
        st = inv.steps.setdefault(info.job, {}).setdefault(info.step, StepInTier(info.job, info.step))
        if info.is_manifest:
            st.has_manifest = True
        else:
            st.shards[info.rank] = -1
    took: list[float] = []
    for job_steps in inv.steps.values():
        for st in job_steps.values():
            _fill(tier, st, with_sizes, took)
    inv.latency = statistics.median(took) if took else None
    return inv


def _fill(tier: Tier, st: StepInTier, with_sizes: bool, took: list[float]) -> None:
    if st.has_manifest:
        try:
            t0 = time.perf_counter()
            data = tier.get(keys.manifest_key(st.job, st.step))
            took.append(time.perf_counter() - t0)
            st.manifest = Manifest.from_bytes(data, job=st.job, step=st.step)
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


def scan_tiers(tiers: list[Tier], job: str | None = None, timeout: float = 30.0) -> list[TierInventory]:
    """Scan several tiers in parallel, one inventory per tier in the given order.

    A tier whose scan has not finished ``timeout`` seconds after the call began
    is marked failed (``error`` is a TimeoutError) and left behind: the call
    returns after at most about ``timeout`` seconds however many tiers hang.
    An error other than a tier's own (a bug) is raised here.
    """
    results: list[TierInventory | BaseException | None] = [None] * len(tiers)

    def scan(i: int, t: Tier) -> None:
        try:
            results[i] = scan_tier(t, job)
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread below
            results[i] = e

    # Daemon threads rather than an executor: an executor's workers are joined
    # when the interpreter exits, so a hung tier would still hold the process.
    threads = [threading.Thread(target=scan, args=(i, t), name=f"tierckpt-scan-{t.name}", daemon=True)
               for i, t in enumerate(tiers)]
    deadline = time.monotonic() + timeout
    for th in threads:
        th.start()
    for th in threads:
        th.join(max(0.0, deadline - time.monotonic()))
    out = []
    for t, r in zip(tiers, list(results)):
        if isinstance(r, BaseException):
            raise r
        if r is None:  # still scanning: left behind
            r = TierInventory(t)
            r.error = TimeoutError(f"the {t.name} tier ({source_name(t)}) did not answer within {timeout:g} s")
        out.append(r)
    return out
