"""Fetcher: verified shard bytes into caller-given buffers, falling back tier by tier."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from tiers import keys
from tiers.checksum import checksum_bytes
from tiers.errors import ChecksumMismatchError, TierError

from .planner import RestorePlan

__all__ = ["ShardReport", "fetch_shard", "ShardUnavailableError"]

log = logging.getLogger("tierckpt.recovery")


class ShardUnavailableError(ChecksumMismatchError):
    """Every tier that holds the shard failed or returned bytes with a wrong checksum."""


@dataclass
class ShardReport:
    """How one shard was restored: which tier served it, bytes, seconds, and what failed first."""

    rank: int
    tier: str
    nbytes: int
    seconds: float
    failures: list[str] = field(default_factory=list)

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def fetch_shard(plan: RestorePlan, rank: int, buf: memoryview, *, verify: bool = True) -> ShardReport:
    """Fill ``buf`` (exactly the shard's size) with rank's shard; try each source in order.

    Raises ShardUnavailableError (a ValueError and OSError) naming every
    failure when no source gives bytes with the manifest's checksum.
    """
    info = plan.manifest.shard(rank)
    buf = memoryview(buf).cast("B")
    if len(buf) != info.size:
        raise ValueError(f"buffer of {len(buf)} bytes for a shard of {info.size} bytes")
    key = keys.shard_key(plan.job, plan.step, rank)
    failures: list[str] = []
    for tier in plan.sources.get(rank, []):
        t0 = time.perf_counter()
        try:
            if info.size:
                tier.read_into(key, buf, 0)
            if verify:
                got = checksum_bytes(buf)
                if got != info.checksum:
                    raise ChecksumMismatchError(
                        f"{key} in the {tier.name} tier has checksum {got}, manifest says {info.checksum}"
                    )
        except (TierError, OSError) as e:
            log.warning("restore of %s from %s failed, trying the next tier: %s", key, tier.name, e)
            failures.append(f"{tier.name}: {e}")
            continue
        return ShardReport(rank, tier.name, info.size, time.perf_counter() - t0, failures)
    raise ShardUnavailableError(
        f"shard {rank} of {plan.job!r} step {plan.step} could not be read intact from any tier "
        f"({'; '.join(failures) or 'no tier holds it'}); restore an older step with --step"
    )
