"""A new run of a job that did not restore takes over the job's step numbers from its first save on.

Each committed step names the run that wrote it (``RUN_KEY`` in its manifest's metadata). When a run
that started fresh (no restore) saves its first step ``S``, every agent of the job drops, from ``S`` on,
the steps of other runs: from its memory and its disk, and (the agent of rank 0 only, ``shared``) from
S3. Without this the new run's saves were refused as already committed, and a later restore could pick a
step of the earlier run that is newer than anything the new run saved.

Steps before ``S`` stay: they are still valid checkpoints of the earlier run (``ckpt list`` shows them).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from recovery.inventory import TierInventory, scan_tier
from tiers.base import Tier

from .drain import delete_step
from .stepbook import StepBook

__all__ = ["RUN_KEY", "take_over", "other_runs_steps"]

log = logging.getLogger("tierckpt.agent")

#: the manifest metadata key naming the run that wrote a step
RUN_KEY = "tierckpt_run"


def other_runs_steps(inv: TierInventory, job: str, first: int, run: str, book: StepBook | None = None) -> list[int]:
    """The steps of ``job`` in ``inv`` from ``first`` on that ``run`` did not write: committed by another
    run (or by one that named none), or never committed and not being committed now by ``run``."""
    out = []
    for s, st in inv.job(job).items():
        if s < first:
            continue
        if st.manifest is not None:
            if st.manifest.metadata.get(RUN_KEY) != run:
                out.append(s)
            continue
        pend = book.pending.get((job, s)) if book is not None else None
        if pend is None or pend.metadata.get(RUN_KEY) != run:
            out.append(s)
    return sorted(out)


async def take_over(job: str, first: int, run: str, *, memory: Tier, book: StepBook, lower: list[Tier],
                    grace: float, copies=None) -> dict[str, list[int]]:
    """Drop ``job``'s steps from ``first`` on that other runs wrote, from ``memory`` and each of ``lower``;
    answers the steps dropped per tier. Holds the job's commit lock; waits (up to ``grace`` s) for the
    writes of the steps it drops from memory, so no drain writes a dropped step afterwards."""
    dropped: dict[str, list[int]] = {}
    async with book.lock(job):
        inv = await asyncio.to_thread(scan_tier, memory, job)
        mine = set(other_runs_steps(inv, job, first, run, book))
        # steps of another run still being committed (a trainer of it that has gone) or already settled
        mine |= {s for (j, s), p in list(book.pending.items())
                 if j == job and s >= first and p.metadata.get(RUN_KEY) != run}
        mine |= {s for (j, s) in list(book.settled) if j == job and s >= first and (j, s) not in book.pending
                 and s not in inv.job(job)}
        waits = [book.settled[(job, s)].wait() for s in mine if (job, s) in book.draining]
        waits += copies(job, mine) if copies is not None else []
        if waits:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.gather(*waits, return_exceptions=True), grace)
        for s in sorted(mine):
            book.forget(job, s)
            if s in inv.job(job):
                await asyncio.to_thread(delete_step, memory, job, s)
        held = sorted(s for s in mine if s in inv.job(job))
        if held:
            dropped[memory.name] = held
        for t in lower:
            low = await asyncio.to_thread(scan_tier, t, job)
            if low.error is not None:
                log.warning("%s: could not list the %s tier to take over its steps from %d: %s",
                            job, t.name, first, low.error)
                continue
            gone = other_runs_steps(low, job, first, run)
            for s in gone:
                await asyncio.to_thread(delete_step, t, job, s)
            if gone:
                dropped[t.name] = gone
    if dropped:
        log.warning("%s: a new run (%s) that did not restore saves from step %d on: dropped the earlier run's "
                    "steps %s", job, run, first,
                    "; ".join(f"{steps} from {name}" for name, steps in dropped.items()))
    return dropped
