"""Fetcher: verified shard bytes into caller-given buffers, falling back tier by tier.

:func:`fetch_shard` reads one shard; :func:`fetch_shards` reads several in
parallel under a memory bound and hands each to the caller as it completes;
:func:`open_shard` maps a shard that is a plain local file instead of copying it.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import mmap
import os
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from tiers import keys
from tiers.base import Tier
from tiers.checksum import checksum_bytes
from tiers.errors import ChecksumMismatchError, TierError

from .costs import CostModel, source_name
from .planner import RestorePlan

__all__ = ["OpenShard", "ShardReport", "ShardUnavailableError", "fetch_shard", "fetch_shards", "open_shard"]

log = logging.getLogger("tierckpt.recovery")


class ShardUnavailableError(ChecksumMismatchError):
    """Every tier that holds the shard failed or returned bytes with a wrong checksum."""


@dataclass
class ShardReport:
    """How one shard was restored: which tier served it, bytes, seconds, and what failed first.

    ``tier`` is the serving tier's kind (``memory``, ``peer``, …) and ``source``
    the place itself (its ``describe()``: a folder, a peer's address, an S3
    URL); ``seconds`` covers the read and checksum from that source only.
    """

    rank: int
    tier: str
    nbytes: int
    seconds: float
    failures: list[str] = field(default_factory=list)
    source: str = ""

    def __post_init__(self) -> None:
        if not self.source:
            self.source = self.tier

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def _where(tier: Tier) -> str:
    """A tier for messages: its kind and its place (``disk /nvme/ckpt``, ``peer 10.0.0.2:4000``)."""
    src = source_name(tier)
    return src if src.startswith(tier.name) else f"{tier.name} {src}"


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
                        f"{key} has checksum {got}, manifest says {info.checksum}"
                    )
        except (TierError, OSError) as e:
            log.warning("restore of %s from %s failed, trying the next tier: %s", key, _where(tier), e)
            failures.append(f"{_where(tier)}: {e}")
            continue
        return ShardReport(rank, tier.name, info.size, time.perf_counter() - t0, failures, source_name(tier))
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
            sub = dataclasses.replace(plan, sources={rank: [tier]})
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
            failures.append(f"{_where(tier)}: {e}")
            continue
        view = memoryview(mm)
        if verify:
            got = checksum_bytes(view)
            if got != info.checksum:
                view.release()
                mm.close()
                log.warning("restore of %s from %s: checksum mismatch, trying the next tier", key, _where(tier))
                failures.append(f"{_where(tier)}: {key} has checksum {got}, manifest says {info.checksum}")
                continue
        return OpenShard(view, ShardReport(rank, tier.name, info.size, time.perf_counter() - t0, failures,
                                           source_name(tier)), mm)
    raise ShardUnavailableError(
        f"shard {rank} of {plan.job!r} step {plan.step} could not be read intact from any tier "
        f"({'; '.join(failures) or 'no tier holds it'}); restore an older step with --step"
    )


def fetch_shards(plan: RestorePlan, ranks: Iterable[int], alloc: Callable[[int], memoryview],
                 on_shard: Callable[[int, memoryview, ShardReport], None], *, max_bytes: int,
                 workers: int = 4, verify: bool = True, costs: CostModel | None = None) -> list[ShardReport]:
    """Fetch the shards of ``ranks`` in parallel, each verified, each into ``alloc(size)``.

    Up to ``workers`` shards are read at once (each by :func:`fetch_shard`, so
    every source is tried in the plan's order), and the buffers handed out and
    not yet consumed never add up to more than ``max_bytes`` bytes; a shard
    larger than ``max_bytes`` is read alone. ``alloc(size)`` is called in the
    calling thread and must return a writable buffer of ``size`` bytes. As each
    shard completes, ``on_shard(rank, view, report)`` runs in the calling
    thread; the bytes are the caller's only until it returns, after which the
    buffer is dropped (a caller that keeps them copies them or keeps its own
    reference). Each report is also given to ``costs.observe`` when ``costs``
    is set. Shards start in the order of ``ranks``.

    Returns the reports in the order of ``ranks``. Raises the first
    ShardUnavailableError (or any error of ``alloc``/``on_shard``) once the
    fetches already running have stopped; no ``on_shard`` call follows it.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, not {max_bytes}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, not {workers}")
    todo = deque(dict.fromkeys(ranks))  # once each, in the given order
    sizes = {r: plan.manifest.shard(r).size for r in todo}
    reports: dict[int, ShardReport] = {}
    # Only this thread hands out and takes back buffers, so the byte budget is a
    # plain counter checked before each alloc: the semaphore that bounds what is
    # in flight, without a lock.
    held = 0
    running: dict[cf.Future, tuple[int, memoryview]] = {}
    pool = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tierckpt-fetch")
    try:
        while todo or running:
            while todo and len(running) < workers and (not running or held + sizes[todo[0]] <= max_bytes):
                rank = todo.popleft()
                buf = memoryview(alloc(sizes[rank])).cast("B")
                held += sizes[rank]
                running[pool.submit(fetch_shard, plan, rank, buf, verify=verify)] = (rank, buf)
            done, _ = cf.wait(running, return_when=cf.FIRST_COMPLETED)
            for fut in sorted(done, key=lambda f: running[f][0]):
                rank, buf = running.pop(fut)
                try:
                    rep = fut.result()
                    if costs is not None:
                        costs.observe(rep.source, rep.nbytes, rep.seconds, kind=rep.tier)
                    reports[rank] = rep
                    on_shard(rank, buf, rep)
                finally:
                    held -= sizes[rank]
                    _release(buf)
    finally:
        # on an error: start nothing new, let the reads already running finish
        # (a read into a buffer cannot be cut short safely), then raise
        pool.shutdown(wait=True, cancel_futures=True)
        for fut, (rank, buf) in running.items():
            if not fut.cancelled() and fut.exception() is not None:
                log.warning("shard %d of %r step %d also failed: %s", rank, plan.job, plan.step, fut.exception())
            _release(buf)
    return [reports[r] for r in sizes]


def _release(view: memoryview) -> None:
    try:
        view.release()
    except BufferError:
        pass  # the caller still exports the bytes (a tensor over them): they go when it does
