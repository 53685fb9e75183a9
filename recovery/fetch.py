"""Fetcher: verified shard bytes into caller-given buffers, falling back tier by tier."""

from __future__ import annotations

import logging
import mmap
import os
import time
from typing import Callable
from dataclasses import dataclass, field

from tiers import keys
from tiers.checksum import checksum_bytes
from tiers.errors import ChecksumMismatchError, TierError

from .planner import RestorePlan

__all__ = ["ShardReport", "fetch_shard", "open_shard", "OpenShard", "ShardUnavailableError"]

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


@dataclass
class OpenShard:
    """A verified shard's bytes: ``view`` (exactly the shard's size) and how it was read. ``close`` when done."""

    view: memoryview
    report: ShardReport
    _mm: mmap.mmap | None = None

    def close(self) -> None:
        try:
            self.view.release()
            if self._mm is not None:
                self._mm.close()
                self._mm = None
        except BufferError:
            pass  # a caller still holds a view of the bytes: the mapping goes when the last view does


def _map_file(path: str, size: int) -> mmap.mmap:
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size != size:
            raise TierError(f"{path} is {os.fstat(f.fileno()).st_size} bytes, the manifest says {size}")
        flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0)
        return mmap.mmap(f.fileno(), size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def open_shard(plan: RestorePlan, rank: int, alloc: Callable[[int], memoryview], *,
               verify: bool = True) -> OpenShard:
    """Rank's shard, verified, from the first source that gives it intact.

    A tier whose object is a plain local file (memory, uncompressed disk) is
    mapped copy-on-write instead of copied, so a restore from memory reads the
    bytes once (the checksum) before they are copied into the tensors. Other
    tiers read into ``alloc(size)``. Raises ShardUnavailableError when no
    source gives intact bytes.
    """
    info = plan.manifest.shard(rank)
    key = keys.shard_key(plan.job, plan.step, rank)
    failures: list[str] = []
    for i, tier in enumerate(plan.sources.get(rank, [])):
        local = getattr(tier, "local_file", None)
        path = local(key) if local is not None and info.size else None
        if path is None:
            sub = RestorePlan(plan.job, plan.step, plan.manifest, plan.manifest_tier, {rank: [tier]})
            buf = alloc(info.size)
            try:
                rep = fetch_shard(sub, rank, buf, verify=verify)
            except ShardUnavailableError as e:
                failures.append(str(e))
                continue
            rep.failures = failures + rep.failures
            return OpenShard(memoryview(buf).cast("B"), rep)
        t0 = time.perf_counter()
        try:
            mm = _map_file(path, info.size)
        except (OSError, ValueError) as e:
            failures.append(f"{tier.name}: {e}")
            continue
        view = memoryview(mm)
        if verify:
            got = checksum_bytes(view)
            if got != info.checksum:
                view.release()
                mm.close()
                log.warning("restore of %s from %s: checksum mismatch, trying the next tier", key, tier.name)
                failures.append(f"{tier.name}: {key} has checksum {got}, manifest says {info.checksum}")
                continue
        return OpenShard(view, ShardReport(rank, tier.name, info.size, time.perf_counter() - t0, failures), mm)
    raise ShardUnavailableError(
        f"shard {rank} of {plan.job!r} step {plan.step} could not be read intact from any tier "
        f"({'; '.join(failures) or 'no tier holds it'}); restore an older step with --step"
    )
