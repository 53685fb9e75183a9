"""Loading a planned step's bytes into a training state, in place: the data path of a restore.

:class:`ShardLoader` reads this rank's shard of a planned step straight into the state's tensors where
the place allows it (``preadv`` from a local file, ranged reads from a peer), through a verified buffer
otherwise, and through DCP's resharding when the step was saved by another number of ranks; it checks
every name, dtype and shape against the checkpoint before anything is applied, and verifies every
checksum. Which step, which places and what to do when a place fails is the Checkpointer's business
(:meth:`ckpt.Checkpointer.restore`); :func:`kept` puts the CPU tensors back if a load fails half-way.

A load comes in two halves: :meth:`ShardLoader.prepare` (and ``prepare_resharded``) reads and verifies
everything and returns a :class:`Prepared`; its ``finish`` writes the state (tensors, values, the
containers' state dicts). A shard in a local file is hashed first and copied into the tensors only by
``finish``: nothing is written before every byte is verified, so nothing has to be copied to be put back.
A peer's ranged reads land in the caller's staging buffer (``stage``: the next save's slot, its memory faulted
in already), verified as they land, and are copied into the tensors by ``finish`` too. Only reads that land in
CPU tensors as they are verified (a peer's ranged reads without a staging buffer, DCP's resharding) write
during ``prepare``, after the caller's ``before_write`` hook (:meth:`Kept.take`). Under torch.distributed the
Checkpointer finishes only once every rank has prepared the same step, so a step that fails on one rank
leaves nothing but those CPU tensors (put back by :func:`kept`) changed on the others.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import time
import warnings
from typing import Any, Callable

import torch

from recovery import RestorePlan, ShardReport, open_shard, source_name
from recovery.fetch import ShardUnavailableError
from tiers.errors import TierError
from tiers import keys
from tiers.base import Tier
from tiers.manifest import BYTES_DTYPE, VALUES_NAME, JsonEntry, TensorChunk, parse_spilled

from ._devices import DeviceAdapter
from ._flatten import Flat, Leaf, decode_value, flatten_state, forget_initialized
from ._tensors import buffer_allocator, buffer_view as _buffer_view, dtype_name as _dtype_name
from ._tensors import dtype_of as _dtype, local_chunk

__all__ = ["Kept", "Prepared", "ShardLoader", "StateMismatchError", "kept", "values_rank"]

log = logging.getLogger("tierckpt")


class StateMismatchError(KeyError):
    """The state to restore into does not match the checkpoint (missing names, other shapes or dtypes)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


#: ``stage(nbytes)``: a writable buffer of exactly ``nbytes`` bytes whose memory is faulted in already (the
#: next save's staging slot), for a shard read that would otherwise land in fresh memory or in the tensors
#: before it is verified; None when there is none (the read then goes as it would without it)
Stage = Callable[[int], "memoryview | None"]

#: bytes one copier thread reads before the restore hashes them (large enough that per-batch overhead is
#: small, small enough that hashing the last batch after the reads end is short)
_READ_BATCH = 16 << 20


#: bytes per read of the pass that verifies a local file before anything is written (:meth:`ShardLoader.
#: _load_verified_file`): small enough to stay in the core's cache between the read and the hash
_VERIFY_BLOCK = 2 << 20


def _pread_batch(fd: int, path: str, batch: list[tuple[int, memoryview]]) -> None:
    """Fill each ``(offset, view)`` of ``batch`` from ``fd`` at that offset (OSError if the file ends early)."""
    for at, mv in batch:
        done = 0
        while done < len(mv):
            n = os.preadv(fd, [mv[done:]], at + done)
            if n <= 0:
                raise OSError(f"{path} ended early")
            done += n


def _batches(pieces: list[tuple[int, memoryview, Any]]) -> list[list[tuple[int, memoryview]]]:
    """``pieces`` (shard offset, view, …) cut into batches of up to :data:`_READ_BATCH` bytes, in order."""
    batches: list[list[tuple[int, memoryview]]] = [[]]
    filled = 0
    for at, mv, _ in pieces:
        for lo in range(0, len(mv), _READ_BATCH):
            part = mv[lo:lo + _READ_BATCH]
            if filled and filled + len(part) > _READ_BATCH:
                batches.append([])
                filled = 0
            batches[-1].append((at + lo, part))
            filled += len(part)
    return batches


def _run_batches(copiers: list, read_batch: Callable, batches: list) -> list:
    """Submit each batch to the copier threads, round robin; the futures, in order."""
    return [copiers[i % len(copiers)].submit(read_batch, b) for i, b in enumerate(batches)]


def _settle(futs: list) -> None:
    """Cancel what has not started and let the rest end (a read still running writes into its buffer)."""
    for f in futs:
        f.cancel()
    for f in futs:
        if not f.cancelled():
            f.exception()


@contextlib.contextmanager
def _direct_reader(tier: Tier, key: str, size: int):
    """A function that fills a batch of contiguous ``(offset, view)`` pieces of ``key`` from ``tier`` without a
    buffer of its own, or None when the tier cannot: ``preadv`` from the tier's local file, or the tier's
    ranged reads (one request per batch)."""
    path = getattr(tier, "local_file", lambda k: None)(key)
    if path is not None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            yield None
            return
        try:
            found = os.fstat(fd).st_size
            if found != size:
                # a damaged copy: the direct load fails on it and moves on to the next place
                def read_batch(batch: list[tuple[int, memoryview]]) -> None:
                    raise OSError(f"{path} is {found} bytes, the manifest says {size}")
            else:
                def read_batch(batch: list[tuple[int, memoryview]]) -> None:
                    _pread_batch(fd, path, batch)
            yield read_batch
        finally:
            os.close(fd)
        return
    ranges = getattr(tier, "read_ranges", None)
    if ranges is None:
        yield None
        return
    yield lambda batch: ranges(key, batch)


class Kept:
    """The state's CPU tensors as they were before a restore read into them (:func:`kept`), taken by
    :meth:`take` just before the first read, so a restore that reads nothing copies nothing."""

    def __init__(self, state: dict) -> None:
        self.state = state
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        #: the optimizers that had no state before :meth:`take` (:attr:`Flat.uninitialized`)
        self.uninitialized: list[torch.optim.Optimizer] = []
        self._flat: Flat | None = None

    @property
    def flat(self) -> Flat | None:
        """The state flattened for restore by :meth:`mark` (None before)."""
        return self._flat

    def mark(self) -> None:
        """Note the optimizers that have no state yet (the restore's flattening initialises them), without
        copying anything; :meth:`put_back` gives them their empty state back."""
        if self._flat is None:
            self._flat = flatten_state(self.state, for_restore=True)
            self.uninitialized = self._flat.uninitialized

    def take(self) -> None:
        """Copy the CPU tensors (once; later calls do nothing)."""
        if self.saved is not None:
            return
        self.mark()
        flat = self._flat
        self.saved = []
        for leaf in flat.leaves:
            if leaf.tensor is not None:
                local = local_chunk(leaf.tensor)[0]
                if local.is_cpu and local.numel():
                    self.saved.append((local, local.detach().clone()))

    def put_back(self) -> None:
        """The CPU tensors as they were, and the optimizers that had no state without one."""
        with torch.no_grad():
            for local, old in self.saved or ():
                local.copy_(old)
        forget_initialized(self.uninitialized)


@contextlib.contextmanager
def kept(state: dict, take: bool = True):
    """Put the state's CPU tensors back as they were if the block raises (:class:`Kept`, yielded; copied on
    entry, or with ``take=False`` when the block calls ``take()``); optimizers that had no state get their
    empty state back too.

    A read through DCP's resharding (or from a peer, when there is no staging buffer to read into) lands
    straight in CPU tensors and is verified as it lands, so a damaged copy is found only once it has
    overwritten them: they are copied first (one copy of them in host memory, for as long as the block runs).
    A local file is verified before it is copied in, a peer's read staged, and every other write waits for
    verified bytes, so those restores copy nothing to put back.
    """
    k = Kept(state)
    if take:
        k.take()
    else:
        k.mark()
    try:
        yield k
    except BaseException:
        k.put_back()
        raise


def values_rank(plan: RestorePlan, rank: int, names: Any, world: int | None = None) -> int:
    """The saved rank whose JSON and bytes values ``rank`` restores when the world size changed.

    ``rank`` itself when ``world`` (the restoring job's size) is the saved one: its own row holds its values in
    any manifest of the step, a shared tier's view included, whatever tensors it wrote.

    The first of the same rank (if the checkpoint had it), then ranks 0, 1, … whose shard holds the most of
    this rank's tensors (``names``) by name. With data or FSDP parallelism every shard holds every name, so
    that is the same rank, or rank 0; with pipeline parallelism the stages' names are disjoint, so a rank
    takes its values (a step counter, the optimizer's parameter groups) from a rank of its own stage, never
    from another stage's whose values under the same names differ.
    """
    if world == plan.manifest.world and rank < world:
        return rank
    world = plan.manifest.world
    wanted = set(names)
    order = ([rank] if rank < world else []) + list(range(world))
    if not wanted:
        return order[0]
    held = {r: sum(1 for e in plan.entries(r) if isinstance(e, TensorChunk) and e.dtype != BYTES_DTYPE
                   and e.name in wanted) for r in set(order)}
    if "durable_of" in plan.manifest.metadata:
        # the shared tier's manifest lists each replicated chunk under one holder only, so counts say little:
        # the first rank holding any of these tensors (the same rank, when it wrote any of them) is of the
        # same stage
        return next((r for r in order if held[r]), order[0])
    return max(order, key=lambda r: (held[r], -order.index(r)))


@dataclasses.dataclass
class _Rebuilt:
    """A shard put together from a head and replicas' chunks, in the shape :meth:`ShardLoader._apply` reads."""

    view: memoryview
    report: ShardReport


class Prepared:
    """A rank's part of a step, read and verified but not yet applied (:meth:`ShardLoader.prepare`).

    ``reports``: what was read from where. ``finish()`` applies it to the state (once); ``release()`` drops
    it without applying (the buffers it holds). Either may be called more than once; only the first acts.
    """

    def __init__(self, reports: list[ShardReport], apply: Callable[[], None],
                 release: Callable[[], None] | None = None) -> None:
        self.reports = reports
        self._apply: Callable[[], None] | None = apply
        self._release = release

    def finish(self) -> None:
        apply, self._apply = self._apply, None
        try:
            if apply is not None:
                apply()
        finally:
            self.release()

    def release(self) -> None:
        self._apply = None
        release, self._release = self._release, None
        if release is not None:
            release()


def _first_failure(e: Any) -> BaseException:
    """The exception a rank's read raised inside ``dcp.load`` (DCP's ``CheckpointException`` holds it), or a
    ShardUnavailableError saying what it was when it is not an ``Exception`` of its own."""
    for exc, _ in getattr(e, "failures", {}).values():
        if isinstance(exc, Exception):
            return exc
    return ShardUnavailableError(f"the resharded restore failed inside DCP: {str(e)[:2000]}")


class ShardLoader:
    """Loads this rank's part of a planned step into a state (see the module docstring).

    ``rank``: this rank; ``verify``: check checksums; ``copiers``: single-thread executors the reads run on;
    ``device``: the adapter of a device type (non-CPU tensors get their verified bytes through it).
    """

    def __init__(self, rank: int, verify: bool, copiers: list, device: Callable[[str], DeviceAdapter]) -> None:
        self.rank = rank
        self.verify = verify
        self.copiers = copiers
        self.device = device
        #: ``(state, its flattening for restore)`` while :meth:`prepare` runs with a flattening the caller made
        #: already (:attr:`Kept.flat`): flattening a large model's state dicts again costs tens of ms
        self._given: tuple[dict, Flat] | None = None

    def load_resharded(self, plan: RestorePlan, state: dict, world: int | None = None) -> list[ShardReport]:
        """:meth:`prepare_resharded`, then finish it."""
        prepared = self.prepare_resharded(plan, state, world)
        prepared.finish()
        return prepared.reports

    def prepare_resharded(self, plan: RestorePlan, state: dict, world: int | None = None,
                          before_write: Callable[[], None] | None = None) -> Prepared:
        """Restore a step saved by another number of ranks (``world``: the restoring job's), or through a shared
        tier's view: DCP reshards the tensors through :class:`ckpt._reader.PlanReader`, from the shards the plan
        has sources for (all, or those holding this rank's chunks), each tensor checked to be covered by them;
        JSON and bytes values come from one saved rank's shard (:func:`values_rank`). DCP writes the tensors
        as it reads them, those on other devices too; the values and state dicts wait for ``finish``."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        from ._reader import PlanReader

        flat = flatten_state(state, for_restore=True)
        tensors = {leaf.name: leaf.tensor for leaf in flat.leaves if leaf.tensor is not None}
        saved = {e.name for sh in plan.manifest.shards if sh.rank in plan.sources for e in plan.entries(sh.rank)
                 if isinstance(e, TensorChunk)}
        missing = sorted(set(tensors) - saved)
        if missing:
            raise StateMismatchError(f"step {plan.step} of {plan.job!r} has no {', '.join(missing[:5])}: the "
                                     "state does not match the checkpoint")
        # a chunk every rank lists under one name (a step counter, an RNG state: each rank's own) comes from the
        # saved rank whose values this rank takes, so the two agree: itself, at the same world size
        src_rank = values_rank(plan, self.rank, tensors, world)
        reader = PlanReader(plan, verify=self.verify, prefer=src_rank)
        short = reader.uncovered(tensors)
        if short:
            # DCP's partial load would leave those elements as they are, without a word
            raise ShardUnavailableError(
                f"step {plan.step} of {plan.job!r}: the shards planned for rank {self.rank} "
                f"({', '.join(map(str, sorted(plan.sources)))}) do not hold all of {', '.join(short[:5])}"
                f"{' …' if len(short) > 5 else ''}; `ckpt verify {plan.job} --step {plan.step}` checks the step")
        # each rank plans its own reads from its own tensors: no collective, so ranks that restore by another
        # route in the same attempt (their own shard, their replicas) never leave this one waiting
        if before_write is not None:
            before_write()  # DCP writes each tensor as its shard is read: keep what they held
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            try:
                dcp.load(tensors, storage_reader=reader, planner=DefaultLoadPlanner(allow_partial_load=True),
                         no_dist=True)
            except CheckpointException as e:
                # DCP wraps what the reads raised: the restore falls back on ours (a damaged or missing shard)
                raise _first_failure(e) from e
        values = {e.name: e for e in plan.entries(src_rank)
                  if isinstance(e, JsonEntry) or e.dtype == BYTES_DTYPE}
        spill = values.get(VALUES_NAME)
        for leaf in flat.leaves:
            if leaf.tensor is None and leaf.name not in values and (spill is None or isinstance(leaf.value, bytes)):
                raise StateMismatchError(f"step {plan.step} of {plan.job!r} has no value {leaf.name}")
        raw = self._read_values(plan, src_rank, [values[leaf.name] for leaf in flat.leaves if leaf.tensor is None
                                                 and isinstance(leaf.value, bytes)] + ([spill] if spill else []))
        self._spilled(plan, values, Flat([leaf for leaf in flat.leaves if leaf.tensor is None]),
                      raw.get(VALUES_NAME) if spill else None)

        def apply() -> None:
            for leaf in flat.leaves:
                if leaf.tensor is None:
                    self._fill(leaf, values[leaf.name], None, raw.get(leaf.name, b""))
            for run in flat.appliers:
                run()

        return Prepared(reader.reports, apply)

    def _read_values(self, plan: RestorePlan, rank: int, entries: list[TensorChunk]) -> dict[str, bytes]:
        """The bytes values ``entries`` of ``rank``'s shard (its whole shard is read and verified)."""
        if not entries:
            return {}
        keep: list[torch.Tensor] = []
        shard = open_shard(plan, rank, buffer_allocator(keep), verify=self.verify)
        try:
            return {e.name: bytes(shard.view[e.offset: e.offset + e.nbytes]) for e in entries}
        finally:
            shard.close()

    def load(self, plan: RestorePlan, state: dict) -> ShardReport:
        """:meth:`prepare`, then finish it."""
        prepared = self.prepare(plan, state)
        prepared.finish()
        return prepared.reports[0]

    def prepare(self, plan: RestorePlan, state: dict, before_write: Callable[[], None] | None = None,
                flat: Flat | None = None, stage: Stage | None = None) -> Prepared:
        """Read and verify this rank's shard of ``plan`` (or rebuild it from its replicas), from the first of its
        places that holds it intact. A local file (memory, uncompressed disk) is verified first and copied into
        the tensors by ``finish``. A peer's ranged reads go to ``stage(size)``'s buffer when the caller gives
        one (memory already faulted in: the next save's staging slot), verified as they land, and are copied
        into the tensors by ``finish``; without one they land in CPU tensors now, after ``before_write()``
        (the caller keeping what the tensors held: :meth:`Kept.take`), or straight away when ``before_write``
        is None (nothing to keep). Everything else is read into ``stage``'s buffer (or a fresh one) and
        written by ``finish``. ``flat``: ``state`` flattened for restore already (``flatten_state(state,
        for_restore=True)``), used instead of flattening it again."""
        self._given = None if flat is None else (state, flat)
        try:
            return self._prepare(plan, state, before_write, stage)
        finally:
            self._given = None

    def _prepare(self, plan: RestorePlan, state: dict, before_write: Callable[[], None] | None,
                 stage: Stage | None = None) -> Prepared:
        if self.rank in plan.replicas:
            return self._load_replicas(plan, state)
        info = plan.manifest.shard(self.rank)
        key = keys.shard_key(plan.job, plan.step, self.rank)
        rest = list(plan.sources.get(self.rank, []))
        failures: list[str] = []
        # sources that can read byte ranges straight into the tensors go first, as the plan orders them;
        # the first one that cannot ends the direct attempts, and the rest go through a buffer
        while rest and info.size:
            path = getattr(rest[0], "local_file", lambda k: None)(key) if self.verify else None
            if path is not None:
                report = self._load_verified_file(plan, state, info, rest[0], path)
                if isinstance(report, Prepared):
                    report.reports[0].failures = failures + report.reports[0].failures
                    return report
                failures.append(f"{source_name(rest[0])}: {report}")
                rest = rest[1:]
                continue
            with _direct_reader(rest[0], key, info.size) as read_batch:
                if read_batch is None:
                    break
                staged = stage(info.size) if stage is not None and before_write is not None else None
                if staged is not None:
                    report = self._load_staged(plan, state, info, rest[0], read_batch, staged)
                else:
                    report = self._load_direct(plan, state, info, rest[0], read_batch, before_write)
            if isinstance(report, Prepared):
                report.reports[0].failures = failures + report.reports[0].failures
                return report
            failures.append(f"{source_name(rest[0])}: {report}")
            rest = rest[1:]  # damaged or unreachable there: the next place, in order
        plan = dataclasses.replace(plan, sources={**plan.sources, self.rank: rest})
        keep: list[torch.Tensor] = []
        fresh = buffer_allocator(keep)

        def alloc(n: int) -> memoryview:
            staged = stage(n) if stage is not None else None
            return fresh(n) if staged is None else staged

        try:
            shard = open_shard(plan, self.rank, alloc, verify=self.verify)
        except ShardUnavailableError as e:
            if not failures:
                raise
            raise ShardUnavailableError(
                f"shard {self.rank} of {plan.job!r} step {plan.step} could not be read intact from any tier "
                f"({'; '.join(failures)}{'; ' + str(e) if rest else ''})") from e
        shard.report.failures = failures + shard.report.failures

        def release() -> None:
            shard.close()
            keep.clear()  # the tensors that own the shard's buffer: held until it is applied or dropped

        try:
            return self._apply(plan, state, info, shard, release=release)
        except BaseException:
            release()
            raise

    def _load_replicas(self, plan: RestorePlan, state: dict) -> Prepared:
        """Rebuild this rank's shard from its unique part (a peer's copy of its head) and the verified shards of
        ranks of its holder groups (``plan.replicas``), then load it like a shard read whole.

        Every byte comes verified: the head against ``ShardInfo.unique``'s checksum, each holder's shard
        against its own. A chunk after the unique part is taken from a holder's shard only where the holder
        has the same tensor, offsets, shape and dtype after its own unique part: chunks both ranks hold as
        replicas of one DTensor, identical by construction. The whole shard's checksum is not checked: the
        padding between chunks is not restored (nothing reads it)."""
        from tiers.checksum import checksum_bytes

        t0 = time.perf_counter()
        info = plan.manifest.shard(self.rank)
        route = plan.replicas[self.rank]
        assert info.unique is not None
        n, head_sum, _ = info.unique
        buf = bytearray(info.size)
        view = memoryview(buf)
        failures: list[str] = []
        sources: list[str] = []
        if n:
            hkey = keys.head_key(plan.job, plan.step, self.rank)
            for tier in route.heads:
                try:
                    data = tier.get(hkey)
                except (OSError, TierError) as e:
                    failures.append(f"{source_name(tier)}: {e}")
                    continue
                got = checksum_bytes(data) if self.verify else head_sum
                if len(data) != n or got != head_sum:
                    failures.append(f"{source_name(tier)}: {hkey} has {len(data)} bytes, checksum {got}; the "
                                    f"manifest says {n}, {head_sum}")
                    continue
                view[:n] = data
                sources.append(source_name(tier))
                break
            else:
                raise ShardUnavailableError(
                    f"shard {self.rank} of {plan.job!r} step {plan.step}: its unique part could not be read intact "
                    f"from any peer ({'; '.join(failures) or 'none holds it'})")
        chunks = [e for e in plan.entries(self.rank) if isinstance(e, TensorChunk) and e.nbytes and e.offset >= n]
        left = {(e.name, e.offsets, e.shape, e.dtype, e.global_shape): e for e in chunks}
        for q in route.holders:
            if not left:
                break
            qn = plan.manifest.shard(q).unique
            start = qn[0] if qn is not None else plan.manifest.shard(q).size
            keep: list[torch.Tensor] = []
            shard = open_shard(plan, q, buffer_allocator(keep), verify=self.verify)
            try:
                failures += shard.report.failures
                sources.append(shard.report.source)
                for qe in plan.entries(q):
                    if not isinstance(qe, TensorChunk) or qe.offset < start:
                        continue
                    e = left.pop((qe.name, qe.offsets, qe.shape, qe.dtype, qe.global_shape), None)
                    if e is not None and qe.nbytes == e.nbytes:
                        view[e.offset:e.offset + e.nbytes] = shard.view[qe.offset:qe.offset + qe.nbytes]
                    elif e is not None:
                        left[(e.name, e.offsets, e.shape, e.dtype, e.global_shape)] = e
            finally:
                shard.close()
                keep.clear()
        if left:
            names = sorted({k[0] for k in left})
            raise ShardUnavailableError(
                f"shard {self.rank} of {plan.job!r} step {plan.step}: {', '.join(names[:5])} held by none of the "
                f"replicas read (ranks {route.holders})")
        report = ShardReport(self.rank, "replicas", info.size, time.perf_counter() - t0, failures,
                             " + ".join(dict.fromkeys(sources)))

        return self._apply(plan, state, info, _Rebuilt(view, report))

    def _read_verified(self, info: Any, tier: Tier, read_batch: Callable[[list[tuple[int, memoryview]]], None],
                       batches: list[list[tuple[int, memoryview]]]) -> str | None:
        """Read ``batches`` (every byte of the shard, in order) on the copier threads and hash each batch on
        this thread as soon as it is in, so the checksum pass overlaps the reads. Returns why when a read
        fails or the checksum is not the manifest's, else None."""
        from tiers.checksum import Hasher

        hasher = Hasher()
        futs = _run_batches(self.copiers, read_batch, batches)
        try:
            for batch, f in zip(batches, futs):
                f.result()
                if self.verify:
                    for _, mv in batch:
                        hasher.update(mv)
        except OSError as e:
            log.warning("restore of rank %d from %s failed, trying the next place: %s", self.rank,
                        source_name(tier), e)
            return f"read failed: {e}"
        finally:
            _settle(futs)  # a read still running writes into its buffer: let it end first
        if self.verify:
            got = hasher.hexdigest()
            if got != info.checksum:
                log.warning("rank %d shard in %s has checksum %s, manifest says %s: trying the next place",
                            self.rank, source_name(tier), got, info.checksum)
                return f"checksum {got}, the manifest says {info.checksum}"
        return None

    def _load_staged(self, plan: RestorePlan, state: dict, info: Any, tier: Tier,
                     read_batch: Callable[[list[tuple[int, memoryview]]], None], staged: memoryview
                     ) -> Prepared | str:
        """Read the shard from a peer into ``staged`` (exactly its size, memory already faulted in), hashing
        each batch as it lands, and copy it into the tensors in ``finish``: nothing is written before every
        byte is verified, so nothing has to be kept to be put back, and the copy runs between two warm
        buffers. Returns why, with nothing written, when a read fails or the checksum does not match."""
        t0 = time.perf_counter()
        view = memoryview(staged).cast("B")
        batches = [[(at, view[at:at + _READ_BATCH])] for at in range(0, info.size, _READ_BATCH)]
        failed = self._read_verified(info, tier, read_batch, batches)
        if failed is not None:
            return failed
        report = ShardReport(self.rank, tier.name, info.size, time.perf_counter() - t0, source=source_name(tier))
        return self._apply(plan, state, info, _Rebuilt(view, report))

    def _load_direct(self, plan: RestorePlan, state: dict, info: Any, tier: Tier,
                     read_batch: Callable[[list[tuple[int, memoryview]]], None],
                     before_write: Callable[[], None] | None = None) -> Prepared | str:
        """Read the shard's bytes straight into the state's tensors and hash what was read.

        ``read_batch`` fills a batch of contiguous ``(shard offset, view)`` pieces, in order: ``preadv``
        from a local file (memory, uncompressed disk), or one ranged request to a peer. One copy per
        byte, no intermediate buffer, no mapping (on tmpfs, faulting a mapping's page tables in costs more
        than the copy). Returns why, with the tensors possibly half-written (``before_write()`` ran first: the
        caller keeps their previous values, see :class:`Kept`), when a read fails or the checksum does not match.
        """
        t0 = time.perf_counter()
        by_name, flat, targets = self._targets(plan, state, info)
        raw: list[tuple[Leaf | None, bytearray]] = []  # bytes values (and spilled JSON), read on their own
        pos = 0
        # every byte range of the shard, in order: (offset, destination view, tensor to copy to or None)
        pieces: list[tuple[int, memoryview, Any]] = []
        for off in sorted(targets):
            leaf, entry = targets[off]
            if off > pos:
                pieces.append((pos, memoryview(bytearray(off - pos)), None))
            if leaf is None or leaf.tensor is None:
                raw.append((leaf, bytearray(entry.nbytes)))
                pieces.append((off, memoryview(raw[-1][1]), None))
                pos = off + entry.nbytes
                continue
            local = local_chunk(leaf.tensor)[0]
            direct = local.is_cpu and local.is_contiguous()
            dst = local if direct else self.device(local.device.type).host_empty(entry.shape, local.dtype)
            pieces.append((off, _buffer_view(dst.data_ptr(), entry.nbytes), None if direct else (local, dst)))
            pos = off + entry.nbytes
        if pos < info.size:
            pieces.append((pos, memoryview(bytearray(info.size - pos)), None))
        # the reads run on the copier threads (they release the GIL) in shard order, a batch of up to
        # _READ_BATCH bytes at a time, round robin; this thread hashes each batch as soon as it is in,
        # so the checksum pass overlaps the reads instead of following them
        batches = _batches(pieces)
        if before_write is not None:
            before_write()  # the tensors are written before their bytes are verified: keep what they held
        failed = self._read_verified(info, tier, read_batch, batches)
        if failed is not None:
            return failed
        got_raw = {id(leaf): bytes(b) for leaf, b in raw if leaf is not None}
        self._spilled(plan, by_name, flat, next((b for leaf, b in raw if leaf is None), None))

        def apply() -> None:
            self._finish_pieces(pieces, flat, by_name, got_raw)

        report = ShardReport(self.rank, tier.name, info.size, time.perf_counter() - t0, source=source_name(tier))
        return Prepared([report], apply, pieces.clear)

    def _finish_pieces(self, pieces: list[tuple[int, memoryview, Any]], flat: Flat, by_name: dict,
                       raw: dict[int, bytes]) -> None:
        """Apply a shard read in place: tensors not read in place (other devices, strided ones) get their
        verified bytes through their device's adapter, values are set (``raw``: bytes values by leaf id), then
        the containers' state dicts are loaded."""
        by_device: dict[str, list] = {}
        for _, _, staged in pieces:
            if staged is not None:
                by_device.setdefault(staged[0].device.type, []).append(staged)
        for device_type, pairs in by_device.items():
            self.device(device_type).restore(pairs)
        with torch.no_grad():
            for leaf in flat.leaves:
                if leaf.tensor is None:
                    self._fill(leaf, by_name[leaf.name], None, raw.get(id(leaf), b""))
        for run in flat.appliers:
            run()

    def _targets(self, plan: RestorePlan, state: dict, info: Any) -> tuple[dict, Flat, dict[int, tuple]]:
        """:meth:`_target`, each leaf checked against its entry, and what the shard's bytes fill:
        ``{offset: (leaf, entry)}`` (leaf None for the spilled JSON values)."""
        by_name, flat = self._target(plan, state, info)
        targets: dict[int, tuple[Leaf | None, Any]] = {}
        for leaf in flat.leaves:
            entry = by_name.get(leaf.name)
            if entry is None:
                continue  # a JSON value kept in the shard: checked once read
            if leaf.tensor is not None:
                self._check_leaf(leaf, entry)
            else:
                self._check_value(leaf, entry)
            if isinstance(entry, TensorChunk) and entry.nbytes:
                targets[entry.offset] = (leaf, entry)
        spill = by_name.get(VALUES_NAME)
        if spill is not None and spill.nbytes:
            targets[spill.offset] = (None, spill)
        return by_name, flat, targets

    def _hash_file(self, fd: int, path: str, size: int) -> str:
        """The checksum of ``fd``'s first ``size`` bytes: the copier threads read it in blocks of
        :data:`_VERIFY_BLOCK` into a ring of buffers, this thread hashes each block in order as it arrives."""
        from collections import deque

        from tiers.checksum import Hasher

        hasher = Hasher()
        depth = 2 * len(self.copiers) + 2
        ring = [memoryview(bytearray(_VERIFY_BLOCK)) for _ in range(depth)]
        running: deque = deque()
        at = i = 0
        try:
            while at < size or running:
                # a buffer is handed out again only once its block is hashed: at most ``depth`` in flight
                while at < size and len(running) < depth:
                    view = ring[i % depth][:min(_VERIFY_BLOCK, size - at)]
                    running.append((self.copiers[i % len(self.copiers)].submit(_pread_batch, fd, path, [(at, view)]),
                                    view))
                    at += len(view)
                    i += 1
                fut, view = running.popleft()
                fut.result()
                hasher.update(view)
        finally:
            _settle([f for f, _ in running])
        return hasher.hexdigest()

    def _load_verified_file(self, plan: RestorePlan, state: dict, info: Any, tier: Tier,
                            path: str) -> Prepared | str:
        """Verify the shard's local file (memory, uncompressed disk) before anything is written, then copy it
        into the state's tensors in ``finish``: one pass hashing the file, one ``preadv`` straight into the
        tensors, and no copy of what the tensors held, since nothing is written unless the bytes are intact.

        Returns why, with nothing written, when the file cannot be read or its checksum does not match. The
        file is checked again once copied (inode, size, change times): a shard rewritten in between, which no
        agent does to a committed step, fails the restore loudly rather than loading unverified bytes.
        """
        t0 = time.perf_counter()
        by_name, flat, targets = self._targets(plan, state, info)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            return f"could not open {path}: {e}"
        keep_fd = False
        try:
            st = os.fstat(fd)
            if st.st_size != info.size:
                return f"{path} is {st.st_size} bytes, the manifest says {info.size}"
            try:
                got = self._hash_file(fd, path, info.size)
            except OSError as e:
                log.warning("restore of rank %d from %s failed, trying the next place: %s", self.rank,
                            source_name(tier), e)
                return f"read failed: {e}"
            if got != info.checksum:
                log.warning("rank %d shard in %s has checksum %s, manifest says %s: trying the next place",
                            self.rank, source_name(tier), got, info.checksum)
                return f"checksum {got}, the manifest says {info.checksum}"
            # values (bytes, the spilled JSON) now: they go into no tensor
            raw: dict[int, bytes] = {}
            spilled = None
            for off, (leaf, entry) in targets.items():
                if leaf is None or leaf.tensor is None:
                    buf = bytearray(entry.nbytes)
                    _pread_batch(fd, path, [(off, memoryview(buf))])
                    if leaf is None:
                        spilled = buf
                    else:
                        raw[id(leaf)] = bytes(buf)
            self._spilled(plan, by_name, flat, spilled)
            keep_fd = True
        finally:
            if not keep_fd:
                os.close(fd)
        seen = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

        def apply() -> None:
            pieces: list[tuple[int, memoryview, Any]] = []
            for off, (leaf, entry) in sorted(targets.items()):
                if leaf is None or leaf.tensor is None:
                    continue
                local = local_chunk(leaf.tensor)[0]
                direct = local.is_cpu and local.is_contiguous()
                dst = local if direct else self.device(local.device.type).host_empty(entry.shape, local.dtype)
                pieces.append((off, _buffer_view(dst.data_ptr(), entry.nbytes), None if direct else (local, dst)))
            futs = _run_batches(self.copiers, functools.partial(_pread_batch, fd, path), _batches(pieces))
            try:
                for f in futs:
                    f.result()
            finally:
                _settle(futs)
            now = os.fstat(fd)
            if (now.st_ino, now.st_size, now.st_mtime_ns, now.st_ctime_ns) != seen:
                raise ShardUnavailableError(
                    f"{path} changed while rank {self.rank}'s state was read from it (after it was verified): "
                    "the state's CPU tensors may hold some of the new bytes; restore again")
            self._finish_pieces(pieces, flat, by_name, raw)

        closed = False

        def release() -> None:
            nonlocal closed
            if not closed:
                closed = True
                os.close(fd)

        report = ShardReport(self.rank, tier.name, info.size, time.perf_counter() - t0, source=source_name(tier))
        return Prepared([report], apply, release)

    def _target(self, plan: RestorePlan, state: dict, info: Any) -> tuple[dict, Flat]:
        """The shard's entries by name and the flattened state to fill; StateMismatchError if names are missing."""
        by_name = {e.name: e for e in plan.entries(info.rank)}
        given = self._given
        flat = given[1] if given is not None and given[0] is state else flatten_state(state, for_restore=True)
        spilled = VALUES_NAME in by_name  # JSON values in the shard: checked once it is read (_spilled)
        missing = [leaf.name for leaf in flat.leaves if leaf.name not in by_name
                   and not (spilled and leaf.tensor is None and not isinstance(leaf.value, bytes))]
        if missing:
            raise StateMismatchError(
                f"step {plan.step} of {plan.job!r} has no {', '.join(missing[:5])}"
                f"{' …' if len(missing) > 5 else ''}: the state does not match the checkpoint")
        return by_name, flat

    @staticmethod
    def _spilled(plan: RestorePlan, by_name: dict, flat: Flat, data: bytes | memoryview | None) -> None:
        """Add the JSON values kept in the shard (``data``: its :data:`VALUES_NAME` chunk) to ``by_name``, and
        raise StateMismatchError for a value of the state that neither the manifest nor the shard has."""
        if data is not None:
            for e in parse_spilled(data, f"values of step {plan.step} of {plan.job!r}"):
                by_name.setdefault(e.name, e)
        missing = [leaf.name for leaf in flat.leaves if leaf.name not in by_name]
        if missing:
            raise StateMismatchError(
                f"step {plan.step} of {plan.job!r} has no {', '.join(missing[:5])}"
                f"{' …' if len(missing) > 5 else ''}: the state does not match the checkpoint")

    @staticmethod
    def _check_value(leaf: Leaf, entry: Any) -> None:
        """StateMismatchError unless a value of the state (bytes, or a JSON value) is one in the checkpoint."""
        if isinstance(leaf.value, bytes):
            if not (isinstance(entry, TensorChunk) and entry.dtype == BYTES_DTYPE):
                raise StateMismatchError(f"{leaf.name} is bytes in the state but not in the checkpoint")
        elif not isinstance(entry, JsonEntry):
            what = "bytes" if isinstance(entry, TensorChunk) and entry.dtype == BYTES_DTYPE else "a tensor"
            raise StateMismatchError(f"{leaf.name} is a value in the state but {what} in the checkpoint")

    @staticmethod
    def _check_leaf(leaf: Leaf, entry: Any) -> None:
        if not isinstance(entry, TensorChunk) or entry.dtype == BYTES_DTYPE:
            raise StateMismatchError(f"{leaf.name} is a tensor in the state but a value in the checkpoint")
        local, gshape, offsets = local_chunk(leaf.tensor)
        dt = _dtype(entry.dtype)
        if dt != local.dtype or tuple(local.shape) != entry.shape or gshape != entry.global_shape \
                or offsets != entry.offsets:
            raise StateMismatchError(
                f"{leaf.name}: the state has {_dtype_name(local.dtype)}{list(local.shape)} at {list(offsets)} of "
                f"{list(gshape)}, the checkpoint {entry.dtype}{list(entry.shape)} at {list(entry.offsets)} of "
                f"{list(entry.global_shape)}")

    def _apply(self, plan: RestorePlan, state: dict, info: Any, shard: Any,
               release: Callable[[], None] | None = None) -> Prepared:
        """Check the state against the verified ``shard`` now; fill it from the shard in ``finish``, then
        ``release`` the shard."""
        report = shard.report
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a copy-on-write mapping is writable; torch cannot tell
            buf = torch.frombuffer(shard.view, dtype=torch.uint8) if info.size else torch.empty(0, dtype=torch.uint8)
        by_name, flat = self._target(plan, state, info)
        spill = by_name.get(VALUES_NAME)
        self._spilled(plan, by_name, flat, None if spill is None else
                      shard.view[spill.offset: spill.offset + spill.nbytes])
        for leaf in flat.leaves:  # every mismatch is found before anything is written
            if leaf.tensor is not None:
                self._check_leaf(leaf, by_name[leaf.name])
            else:
                self._check_value(leaf, by_name[leaf.name])

        def apply() -> None:
            with torch.no_grad():
                for leaf in flat.leaves:
                    self._fill(leaf, by_name[leaf.name], buf)
            for run in flat.appliers:
                run()

        def drop() -> None:
            nonlocal buf
            buf = None
            if release is not None:
                release()

        return Prepared([report], apply, drop)

    @staticmethod
    def _fill(leaf: Leaf, entry: Any, buf: torch.Tensor | None, raw: bytes | None = None) -> None:
        """Put the checkpoint's value of ``leaf`` into the state: from ``buf`` (the shard), or, for a bytes
        value read on its own, ``raw``."""
        if leaf.tensor is None:
            ShardLoader._check_value(leaf, entry)
            if isinstance(entry, TensorChunk):
                v: Any = raw if raw is not None else bytes(buf[entry.offset: entry.offset + entry.nbytes].numpy())
            else:
                v = decode_value(entry.value)
                if isinstance(leaf.value, tuple) and isinstance(v, list):
                    v = tuple(v)  # a checkpoint from before tuples were told apart
            if leaf.parent is not None and not isinstance(leaf.parent, tuple):
                leaf.parent[leaf.key] = v
            return
        ShardLoader._check_leaf(leaf, entry)
        if entry.nbytes:
            src = buf[entry.offset : entry.offset + entry.nbytes].view(_dtype(entry.dtype)).view(entry.shape)
            local_chunk(leaf.tensor)[0].copy_(src)
