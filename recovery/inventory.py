"""Inventory: what each tier holds, by job and step, and whether each step is complete there."""

from __future__ import annotations

import concurrent.futures as cf
from dataclasses import dataclass, field

from tiers import keys
from tiers.base import Tier
from tiers.errors import KeyNotFoundError, ManifestError, TierError
from tiers.manifest import Manifest

__all__ = ["StepInTier", "TierInventory", "scan_tier", "scan_tiers", "read_manifest"]


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
    """A tier's view: ``steps[job][step]``, or ``error`` if the tier could not be listed."""

    tier: Tier
    steps: dict[str, dict[int, StepInTier]] = field(default_factory=dict)
    error: BaseException | None = None

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
            continue
        st = inv.steps.setdefault(info.job, {}).setdefault(info.step, StepInTier(info.job, info.step))
        if info.is_manifest:
            st.has_manifest = True
        else:
            st.shards[info.rank] = -1
    for job_steps in inv.steps.values():
        for st in job_steps.values():
            _fill(tier, st, with_sizes)
    return inv


def _fill(tier: Tier, st: StepInTier, with_sizes: bool) -> None:
    if st.has_manifest:
        try:
            st.manifest = read_manifest(tier, st.job, st.step)
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
    """Scan several tiers in parallel; a tier that does not answer in ``timeout`` s is marked failed."""
    with cf.ThreadPoolExecutor(max_workers=max(1, len(tiers))) as pool:
        futs = [pool.submit(scan_tier, t, job) for t in tiers]
        out = []
        for t, f in zip(tiers, futs):
            try:
                out.append(f.result(timeout=timeout))
            except cf.TimeoutError:
                inv = TierInventory(t)
                inv.error = TimeoutError(f"{t.name} tier did not answer within {timeout:.0f} s")
                out.append(inv)
        return out
