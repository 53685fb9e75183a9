"""How each job's runs start and end on this node: a clean end, a crash, a new run taking over.

A job is *run* by trainer processes that share a run id (rank 0 draws it and every rank learns it, see
``ckpt.Checkpointer``). The agent learns the run from each trainer's ``hello`` and tells apart:

- a **clean end**: every rank agreed the job ended (the ``end`` op, ``agreed``): memory may be freed;
- a **crash**: a trainer of the job went away without a clean end (an exception, a kill, a lost peer;
  the ``crashed`` op, or only its connection closing). The job's memory tier is then *kept* for
  ``keep_after_crash`` seconds, so the restart restores from memory; the next run's ``hello`` of the job
  ends the keeping (the run restores from it, or takes over), as does ``ckpt gc``. When the time runs out
  the agent calls ``on_expire(job)`` (write the newest step down, then free memory as at a clean end);
- a **takeover**: a new run that did not restore saves its first step; the steps of other runs from that
  step on are dropped (they would be refused as already committed, and a restore would mix runs).

Two live runs of one job on one node are refused at ``hello``: their saves would overwrite each other.
This module keeps the bookkeeping (no I/O): the agent (:mod:`agents.daemon`) does the deleting.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from .protocol import RequestError

__all__ = ["JobEnds", "Kept", "pid_alive"]

log = logging.getLogger("tierckpt.agent")


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not reaped yet, does not)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # "pid (comm) S ...": the state follows the last ')' (comm may hold any byte)
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


@dataclass
class Kept:
    """A crashed job's memory tier, kept until ``until`` (wall clock) for its restart."""

    job: str
    until: float
    why: str
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)


class JobEnds:
    """Runs, clean ends and crashes of the jobs on this node (see the module docstring)."""

    def __init__(self, keep_s: float, on_expire: Callable[[str], Awaitable[None]]) -> None:
        self.keep_s = float(keep_s)
        self._on_expire = on_expire
        #: pids that ended each job cleanly, and the jobs whose end every rank agreed on
        self._ended: dict[str, set[int]] = {}
        self.kept: dict[str, Kept] = {}
        #: ``(job, run, scope)`` a takeover was done for ("local": memory and disk; "shared": S3 too), or a
        #: rewind (the run resumed: it takes over nothing)
        self._settled_runs: set[tuple[str, str, str]] = set()
        self._expiring: set[asyncio.Task] = set()

    # ------------------------------------------------------------------ runs
    def hello(self, job: str, run: str | None, pid: int, others: Iterable[tuple[int, dict[str, str | None]]]) -> None:
        """A trainer (``pid``) of ``job``'s run ``run`` connected. ``others``: ``(pid, {job: run})`` of every
        other connection. Refuses (RequestError) when another live process runs another run of the job here;
        ends the keeping of a crashed job (its next run is here)."""
        if run is not None:
            for opid, runs in others:
                orun = runs.get(job, "")
                if opid != pid and orun is not None and orun != "" and orun != run and pid_alive(opid):
                    raise RequestError(
                        f"job {job!r} is already running on this node (pid {opid}, run {orun}): two runs of one "
                        f"job would overwrite each other's steps. Stop pid {opid} first (a restart after it "
                        "exits restores or takes over its steps), or give this run another job name")
        self._ended.get(job, set()).discard(pid)
        k = self.kept.pop(job, None)
        if k is not None:
            if k.timer is not None:
                k.timer.cancel()
            log.info("%s: a new run connected (pid %d): its memory tier, kept since a crash, is the run's now",
                     job, pid)

    def ended(self, job: str, pid: int, agreed: bool) -> None:
        """``pid`` ended ``job`` cleanly; ``agreed``: every rank of the job did (a clean end of the job)."""
        self._ended.setdefault(job, set()).add(pid)
        if agreed:
            self.forget_kept(job)

    def ended_by(self, job: str, pid: int) -> bool:
        return pid in self._ended.get(job, ())

    def all_ended(self, job: str, trainers: Iterable[int]) -> bool:
        """Whether every pid in ``trainers`` (the connected trainers of ``job``) ended it. The pids stay
        (their other connections close after the end, which is no crash) until they say hello again."""
        ended = self._ended.get(job, set())
        return all(p in ended for p in trainers)

    # ------------------------------------------------------------------ crashes
    def keep(self, job: str, why: str) -> Kept:
        """Keep ``job``'s memory tier for ``keep_s`` s from now (a crash); again: from now on."""
        k = self.kept.get(job)
        if k is not None and k.timer is not None:
            k.timer.cancel()
        k = self.kept[job] = Kept(job, time.time() + self.keep_s, why)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return k
        k.timer = loop.call_later(self.keep_s, self._expire, job, k)
        return k

    def _expire(self, job: str, k: Kept) -> None:
        if self.kept.get(job) is not k:
            return
        del self.kept[job]
        log.info("%s: the %.0f s its memory tier was kept after a crash ran out", job, self.keep_s)
        task = asyncio.ensure_future(self._on_expire(job))
        self._expiring.add(task)
        task.add_done_callback(self._expiring.discard)

    def forget_kept(self, job: str) -> None:
        k = self.kept.pop(job, None)
        if k is not None and k.timer is not None:
            k.timer.cancel()

    def keeping(self) -> bool:
        """Whether a crashed job's memory is kept (or being written down as its time ran out)."""
        return bool(self.kept or self._expiring)

    def close(self) -> None:
        for k in self.kept.values():
            if k.timer is not None:
                k.timer.cancel()

    # ------------------------------------------------------------------ takeover
    def settled(self, job: str, run: str, scope: str) -> bool:
        """Whether ``run`` of ``job`` already resumed or took over here (for ``scope``); marks it so."""
        key = (job, run, scope)
        if key in self._settled_runs or (job, run, "resumed") in self._settled_runs:
            return True
        self._settled_runs.add(key)
        return False

    def resumed(self, job: str, run: str) -> None:
        """``run`` restored a step (a rewind): it supersedes the later steps itself, nothing to take over."""
        self._settled_runs.add((job, run, "resumed"))
