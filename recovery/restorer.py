"""The restore engine: which step a rank restores, where each of its shards is read from, and what happens when
a read fails.

Call order, per rank (with ``world > 1`` every rank calls :meth:`Restorer.restore` at the same point: the
caller's ``agree`` is a collective, and every rank takes the same number of them)::

    r = Restorer(job, rank, world, near=..., far=..., agree=..., ...)
    done = r.restore(loader, step)     # Restored, applied by then; None on a fresh start; or raises

1. Places: the near tiers (memory, peers, disk) are listed first; the far one (S3) only when the asked-for
   step is not near, the caller knows of a sign of a newer step there (``far_may_be_newer``), or what is
   near cannot be restored.
2. Step: every rank proposes the newest step it can reach (or ``step``); the ranks agree on the smallest.
3. Plan: :func:`~recovery.planner.plan_restore`, sources ordered by the node's learned costs.
4. Read: ``loader`` prepares the step (read and verified, not applied). On a failure, in this order: another
   manifest of the same step (another save of it in another tier), then S3, then waiting while another rank
   looks elsewhere, then an older step. The step is applied (``Prepared.finish``) only once every rank has
   it prepared, so a step one rank cannot restore changes nothing on the others.
5. Learn: each transfer is fed to the cost model, saved for the next restore.
6. Report: :class:`Restored`, with the newer steps passed over and the tiers that could not be listed.

Torch-free: the caller's loader puts bytes into tensors, its ``agree`` does the all-reduce.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Protocol

from tiers import keys
from tiers.base import Tier
from tiers.errors import ManifestError, TierError
from tiers.manifest import Manifest

from .costs import CostModel
from .fetch import ShardReport, ShardUnavailableError
from .inventory import TierInventory, scan_tiers
from .planner import (RestoreError, RestorePlan, StepNotFoundError, committed_steps, complete_steps,
                      describe_step, manifest_for, plan_restore, unreachable, view_ranks)

__all__ = ["Prepared", "Restored", "Restorer", "StepLoader"]

log = logging.getLogger("tierckpt.recovery")

_CANNOT = -2  # restore(step=...): this rank cannot reach the step (below -1, no step at all)


class Prepared(Protocol):
    """A rank's part of a step, read and verified but not yet applied (what a :class:`StepLoader` returns)."""

    #: what was read from where
    reports: list[ShardReport]

    def finish(self) -> None:
        """Apply it (once), then release it."""

    def release(self) -> None:
        """Drop it without applying it; a second call does nothing."""


class StepLoader(Protocol):
    """Reads a planned step for the caller's state: verified, not applied until ``Prepared.finish``.

    A failed read raises ShardUnavailableError, StepNotFoundError, ManifestError or TierError (the restorer
    then looks elsewhere); anything else (a state that does not match the checkpoint) ends the restore.
    """

    def prepare(self, plan: RestorePlan) -> Prepared:
        """This rank's own shard (or its replicas' chunks, ``plan.replicas``)."""

    def prepare_resharded(self, plan: RestorePlan) -> Prepared:
        """Every chunk the state needs, from whichever shard of ``plan`` holds it (another world size, or a
        shared tier's view of a step whose ranks held copies of each other's chunks)."""


@dataclass
class Restored:
    """What a restore did: the step, the manifest it was read by, and per shard which tier served it."""

    step: int
    #: the manifest the step was read by (None only when it was read by another rank's retry of it)
    manifest: Manifest | None
    shards: list[ShardReport]
    #: newer steps committed somewhere that could not be restored, and why (empty when the newest was)
    passed_over: dict[int, str] = field(default_factory=dict)
    #: tiers that could not be listed (``<tier> (<place>): <why>``): they may hold a newer step
    unreachable: list[str] = field(default_factory=list)


def _identity(value: int) -> int:
    return value


def _no_costs(_invs: list[TierInventory]) -> tuple[CostModel, str | None]:
    return CostModel(), None


class Restorer:
    """Restores one rank of ``job`` (``world`` ranks restore together); see the module docstring.

    ``near()`` lists memory, peers and disk; ``far()`` lists S3 (None: there is no S3), asked only when
    needed. ``far_may_be_newer(newest)``: whether S3 may hold a step newer than ``newest``, this rank's newest
    near one (True when unknown). ``others(manifest, ranks)``: more tiers to look for the shards of ``ranks``
    (every rank if None) in when a resharded read needs shards the listed tiers lack (other nodes' memory
    and disks). ``agree(value)``: the smallest of every rank's ``value``, a collective (the identity with one
    rank). ``costs(invs)``: the node's cost model and the file to save what it learns to (None: not kept).
    ``before_read(step)``: called before each read of a step (the caller's agent drops the steps after it).
    ``replicas``: a shard counts as reachable when its rank can be restored from the job's own replicas (for a
    loader that reads such plans, :attr:`~recovery.planner.RestorePlan.replicas`).

    After :meth:`restore` or :meth:`agree_step`, ``invs`` holds the places listed and ``far_unlisted`` says
    whether the far tier is there and was not listed.
    """

    def __init__(self, job: str, rank: int = 0, world: int = 1, *,
                 near: Callable[[], list[TierInventory]],
                 far: Callable[[], list[TierInventory]] | None = None,
                 far_may_be_newer: Callable[[int], bool] = lambda _newest: True,
                 others: Callable[[Manifest, list[int] | None], list[Tier]] = lambda _m, _ranks: [],
                 agree: Callable[[int], int] = _identity,
                 costs: Callable[[list[TierInventory]], tuple[CostModel, str | None]] = _no_costs,
                 before_read: Callable[[int], None] = lambda _step: None, replicas: bool = True) -> None:
        self.job, self.rank, self.world, self.replicas = job, rank, world, replicas
        self._near, self._far, self._far_may_be_newer = near, far, far_may_be_newer
        self._others, self._agree, self._costs, self._before_read = others, agree, costs, before_read
        self.invs: list[TierInventory] = []
        self.far_unlisted = False

    # ------------------------------------------------------------------ places
    def _steps(self) -> list[int]:
        return complete_steps(self.invs, self.job, [self.rank], replicas=self.replicas)

    def _add_far(self) -> list[int]:
        self.far_unlisted = False
        self.invs = self.invs + self._far()
        return self._steps()

    def _list(self, step: int | None, newer: bool) -> list[int]:
        """List the near tiers, then the far one when ``step`` is not near or (with ``newer``) the far one may
        hold a step newer than the newest near; return the steps complete for this rank, ascending."""
        # memory, peers and disk first; S3 (a client to create, a prefix to list) only when it may matter
        self.invs = self._near()
        steps = self._steps()
        self.far_unlisted = self._far is not None
        if self.far_unlisted and ((step is not None and step not in steps)
                                  or (newer and self._far_may_be_newer(steps[-1] if steps else -1))):
            steps = self._add_far()
        return steps

    # ------------------------------------------------------------------ step
    def agree_step(self, step: int | None = None) -> int:
        """The step the ranks agree on without reading it: ``step`` when every rank holds it complete, else
        the newest step every rank holds complete; -1 when there is none (or some rank lacks ``step``).

        For a reader that plans and reads the step itself (DCP's): no fallback, no error; the far tier is
        listed for a newer step only when no ``step`` is given. A collective when ``world > 1``.
        """
        steps = self._list(step, newer=step is None)
        if step is not None:
            return self._agree(step if step in steps else -1)
        return self._agree(steps[-1] if steps else -1)

    # ------------------------------------------------------------------ restore
    def restore(self, loader: StepLoader, step: int | None = None) -> Restored | None:
        """Restore the newest step every rank can reach (or ``step``) through ``loader``; return what was
        restored (applied by then), or None on a fresh start.

        Returns None only when every tier could be listed and none holds a committed step of the job.
        Raises StepNotFoundError for a ``step`` that is not complete, RestoreError (a StepNotFoundError) when
        a committed step cannot be restored intact from any tier or a tier that may hold one is unreachable;
        whatever else ``loader`` raises comes as it is. Nothing is applied when it raises.
        """
        steps = self._list(step, newer=True)
        if step is not None:
            keys.check_step(step)
        failed: dict[int, str] = {}  # step -> why it could not be restored intact
        skipped: dict[int, set[str]] = {}  # step -> checksums of the manifests it failed with
        # step -> (Prepared, manifest) where this rank read it intact but another rank did not: kept unapplied
        # while the others look again
        restored: dict[int, tuple] = {}
        try:
            while True:
                usable = [s for s in steps if s not in failed]
                if step is None:
                    mine = usable[-1] if usable else -1
                else:
                    if step not in usable and self.far_unlisted:
                        steps = self._add_far()
                        continue
                    # a rank that cannot reach the step says so in the agreement: every rank raises, none waits on it
                    mine = step if step in usable else _CANNOT
                agreed = self._agree(mine)
                cannot = None
                if agreed != mine and agreed >= 0 and agreed not in usable and self.far_unlisted:
                    steps = self._add_far()  # another rank can reach only an older step: S3 may hold it for this one
                    usable = [s for s in steps if s not in failed]
                if agreed != mine and agreed >= 0 and agreed not in usable:
                    # a failure of this rank's, taken through the same collectives as a failed read
                    cannot = f"rank {self.rank} cannot reach step {agreed}, the newest the other ranks can"
                if agreed == _CANNOT:
                    if mine == _CANNOT:
                        self._raise_not_restorable(step, failed)
                    raise StepNotFoundError(f"step {step} of job {self.job!r} cannot be restored: another rank cannot "
                                            "reach it (its error says why); nothing was restored")
                if agreed < 0:
                    if self.far_unlisted and self.world == 1 and (failed or committed_steps(self.invs, self.job)
                                                                  or unreachable(self.invs)):
                        steps = self._add_far()  # something was committed near but is not restorable: S3 may hold it
                        continue
                    # a fresh start only if no rank found a trace: every rank raises otherwise
                    fresh = self._fresh(failed)
                    if fresh and not self._agree(int(fresh)):
                        raise RestoreError(f"job {self.job!r}: another rank found a committed step it could not "
                                           "restore (its error says which); nothing was started fresh")
                    self._raise_not_restorable(None, failed)
                    return None
                skip = skipped.setdefault(agreed, set())
                if agreed in restored:  # this rank read it already; another rank looked again elsewhere
                    prepared, used = restored[agreed]
                    why = None
                elif cannot is not None:
                    used, why = None, cannot
                else:
                    used = manifest_for(self.invs, self.job, agreed, skip)
                    try:
                        prepared = self._read(loader, agreed, skip)
                        why = None
                    except (ShardUnavailableError, StepNotFoundError, ManifestError, TierError) as e:
                        why = str(e)
                ok = local_ok = why is None
                # a collective every rank takes, its own read failed or not
                if not self._agree(int(ok)) and ok:
                    ok, why = False, "another rank could not restore it"
                if ok:
                    restored.pop(agreed, None)
                    prepared.finish()  # every rank holds the step verified: now it is applied
                    break
                other = False
                if local_ok:
                    restored[agreed] = (prepared, used)
                elif used is not None:
                    skip.add(used.checksum)
                    other = manifest_for(self.invs, self.job, agreed, skip) is not None
                # whether any rank has somewhere else to look for this step: then every rank tries it again, or a rank
                # that has already looked everywhere (S3 too) would pass it over for an older one while the others
                # found it complete (a collective: every rank's step failed on some rank, so every rank comes here)
                elsewhere = bool(-self._agree(-int(other or (self.far_unlisted and not local_ok))))
                if other:
                    # another tier holds a different manifest of the step (another save of it): try that one
                    log.warning("step %d of %s could not be restored with the manifest from the cheapest tier "
                                "(%s): trying another tier's", agreed, self.job, why)
                    continue
                if self.far_unlisted and not local_ok:
                    log.warning("step %d of %s could not be restored from memory, peers or disk (%s): trying S3",
                                agreed, self.job, why)
                    skip.clear()  # S3 may hold intact shards of the very manifests that failed
                    steps = self._add_far()
                    continue
                if elsewhere:
                    log.info("step %d of %s: another rank looks for it in another tier; waiting for it", agreed,
                             self.job)
                    continue
                failed[agreed] = why
                if agreed in restored:
                    restored.pop(agreed)[0].release()
                log.warning("step %d of %s could not be restored intact from any tier: %s", agreed, self.job, why)
                if step is not None:
                    self._raise_not_restorable(step, failed)
        finally:
            for held, _ in restored.values():
                held.release()
        return self._report(agreed, used, prepared.reports, failed, step)

    def _read(self, loader: StepLoader, step: int, skip: set[str]) -> Prepared:
        """Plan (passing over the manifests in ``skip``) and prepare ``step`` through ``loader``; learn what the
        reads cost."""
        self._before_read(step)
        costs, costs_file = self._costs(self.invs)
        # this rank's own shard, or (when only disk or S3 hold it, or nothing does) its unique part and the
        # shards of the data-parallel replicas that hold the rest, from memory
        plan = plan_restore(self.invs, self.job, step, [self.rank], costs=costs, skip=skip, replicas=self.replicas)
        # another world size, or the shared tier's manifest of a step whose ranks held copies of each other's
        # chunks (each chunk is in the shard of the rank that wrote it): every chunk from whichever shard has it
        if plan.manifest.world != self.world or "durable_of" in plan.manifest.metadata:
            # the same world through a shared tier's view: this rank's part and those of the ranks that wrote
            # its replicated chunks are all it reads (ShardInfo.unique names them); another world: every rank's
            needed = view_ranks(plan.manifest, self.rank) if plan.manifest.world == self.world else None
            try:
                whole = plan_restore(self.invs, self.job, step, needed, costs=costs, skip=skip)
            except StepNotFoundError:
                others = self._others(plan.manifest, needed)
                if not others:
                    raise
                whole = plan_restore(self.invs + scan_tiers(others, self.job), self.job, step, needed,
                                     costs=costs, skip=skip)
            prepared = loader.prepare_resharded(whole)
        else:
            prepared = loader.prepare(plan)
        self._learn(costs, costs_file, prepared.reports)
        return prepared

    @staticmethod
    def _learn(costs: CostModel, path: str | None, reports: list[ShardReport]) -> None:
        """Feed this restore's transfers to the node's cost model, so the next restore orders sources by them."""
        for r in reports:
            if r.source and r.nbytes and r.tier != "replicas":  # several places at once: no one place's cost
                costs.observe(r.source, r.nbytes, r.seconds, kind=r.tier)
        if path is not None:
            try:
                costs.save(path)
            except OSError as e:
                log.warning("could not save the learned restore costs to %s: %s", path, e)

    def _report(self, step: int, used: Manifest | None, shards: list[ShardReport], failed: dict[int, str],
                asked: int | None) -> Restored:
        """What was restored, with the newer steps passed over (a warning, when the newest was asked for)."""
        passed_over = {s: failed.get(s) or f"not restorable: {describe_step(self.invs, self.job, s)}"
                       for s in sorted(committed_steps(self.invs, self.job) | set(failed)) if s > step}
        if passed_over and asked is None:
            log.warning("restoring step %d of %s although newer step(s) %s were committed: %s", step, self.job,
                        ", ".join(map(str, passed_over)), "; ".join(f"{s}: {w}" for s, w in passed_over.items()))
        down = unreachable(self.invs)
        if down:
            log.warning("restored step %d of %s without looking in tier(s) that could not be reached, which may "
                        "hold a newer step: %s", step, self.job, "; ".join(down))
        return Restored(step, used, shards, passed_over, down)

    # ------------------------------------------------------------------ errors
    def _fresh(self, failed: dict[int, str]) -> bool:
        """Whether this is a fresh start: every tier listed, and no step committed (a manifest present, valid or
        not) in any of them. Shards without a manifest anywhere are a save cut short before it committed."""
        return not failed and not unreachable(self.invs) and not committed_steps(self.invs, self.job)

    def _raise_not_restorable(self, step: int | None, failed: dict[int, str]) -> None:
        """Raise the error that says why nothing (or not ``step``) could be restored; return when this is a
        fresh start (:meth:`_fresh`)."""
        invs = self.invs
        down = unreachable(invs)
        committed = committed_steps(invs, self.job)
        if step is None and self._fresh(failed):
            return
        want = step if step is not None else max(committed | set(failed), default=None)
        if want is None:
            raise RestoreError(
                f"job {self.job!r}: no step could be looked for in every tier ({'; '.join(down)}); a step may be "
                "there: make the tier reachable and restore again (nothing was started fresh)")
        if step is not None and want not in committed and want not in failed and not down:
            raise StepNotFoundError(
                f"step {step} of job {self.job!r} is not complete in any tier "
                f"({describe_step(invs, self.job, step)}); `ckpt list {self.job}` shows the steps")
        why = failed.get(want) or "no tier holds it complete and intact"
        raise RestoreError(" ".join(
            f"step {want} of job {self.job!r} could not be restored intact ({why}); tried: "
            f"{describe_step(invs, self.job, want)}. `ckpt verify {self.job} --step {want}` shows what is "
            "damaged; make an unreachable tier reachable, or pass an older step to restore(step=...)".split()))
