"""The DCP storage plug-in: ``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` through the node agent.

Three objects, all importable from ``ckpt``:

* :class:`DcpWriter` (a DCP ``StorageWriter``): each rank's items of a DCP save plan become that rank's
  shard of one step, in a shared-memory slot of the node agent, committed to the agent as a
  ``Checkpointer`` save is; the agent checksums it, builds the step's manifest once every rank
  committed, replicates it and writes it to disk and S3. A step saved this way is listed, verified and
  restored by the ``ckpt`` CLI like any other.
* :class:`DcpStager` (a DCP ``AsyncStager``, for ``dcp.async_save``): leases the slot and returns a
  staged state dict whose tensors are views into it, so the writer finds them already in place and
  copies nothing again. Tensors that only an optimizer step changes (parameters and optimizer state,
  see :mod:`ckpt._guard`) are copied in the background while the next forward/backward runs; every
  optimizer step of the process waits for that copy first.
* :class:`DcpReader` (a DCP ``StorageReader``): reads a step from the fastest tier that holds each
  shard intact (checksums verified), for any world size (DCP reshards).

Checkpoint ids: the job comes from the constructor (``DcpWriter(job=...)``); ``checkpoint_id`` names the
step: an int step, or a string or path whose last component is ``step-N`` or ``N`` (torchtitan's
folders are ``<dump>/checkpoint/step-N``). Anything else is a ValueError. Entry names in the step's
manifest are DCP's fully qualified names (``model.layers.0.weight``); values DCP serialises itself
(non-tensor objects, ``torch.save``'d by its planner) are kept as raw ``bytes`` chunks.

Call order (DCP's, per rank): writer ``reset(checkpoint_id)`` → ``set_up_storage_writer`` →
``prepare_local_plan`` → ``prepare_global_plan`` (coordinator) → ``write_data`` → ``finish``
(coordinator); with ``async_save`` the stager's ``stage`` runs first, on the training thread, and the
rest on DCP's upload thread. Reader: ``reset`` → ``read_metadata`` → ``set_up_storage_reader`` →
``prepare_local_plan`` → ``prepare_global_plan`` → ``read_data``.
"""

from __future__ import annotations

import concurrent.futures as cf
import copy
import io
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import StorageReader, StorageWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from agents.protocol import AgentError
from recovery import RestorePlan, node_costs, plan_restore, scan_tiers
from recovery.fetch import ShardUnavailableError
from recovery.planner import RestoreError, StepNotFoundError, describe_step
from recovery.restorer import Restorer
from tiers import keys
from tiers.layout import Layout
from tiers.manifest import BYTES_DTYPE, TensorChunk

from . import _guard
from ._devices import storage_key
from ._tensors import dtype_name

__all__ = ["DcpWriter", "DcpStager", "DcpReader", "step_of"]

log = logging.getLogger("tierckpt")
_ALIGN = 64
_STEP_RE = re.compile(r"^(?:step[-_])?([0-9]+)$")


#: a non-tensor value DCP serialises to more than this many bytes is warned about, once per name
BIG_OBJECT = 1 << 20


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def step_of(checkpoint_id: Any) -> int:
    """The step a DCP ``checkpoint_id`` names: an int, or a string/path whose last component is ``step-N``
    or ``N``. Raises ValueError for anything else."""
    if isinstance(checkpoint_id, int) and not isinstance(checkpoint_id, bool):
        return keys.check_step(checkpoint_id)
    if isinstance(checkpoint_id, (str, os.PathLike)):
        last = os.path.basename(os.fspath(checkpoint_id).rstrip("/"))
        m = _STEP_RE.match(last)
        if m:
            return keys.check_step(int(m.group(1)))
    raise ValueError(f"checkpoint_id {checkpoint_id!r} names no step: pass an int step, or a path whose last "
                     "component is 'step-N' or 'N' (the job is the one given to the writer or reader)")


def _checkpointer(job: str | None, checkpointer: Any, settings: dict) -> tuple[Any, bool]:
    """The Checkpointer to go through (one given, or a new one that the plug-in object owns)."""
    if checkpointer is not None:
        if job is not None and job != checkpointer.job:
            raise ValueError(f"job {job!r} differs from the checkpointer's job {checkpointer.job!r}")
        if settings:
            raise ValueError("pass settings to the Checkpointer, or no checkpointer: not both")
        return checkpointer, False
    if job is None:
        raise ValueError("name the job (job=...) or pass a checkpointer")
    from .checkpointer import Checkpointer

    return Checkpointer(job, **settings), True


# --------------------------------------------------------------------------------------- staging
@dataclass
class _Staged:
    """One state dict staged into a slot by :class:`DcpStager`, waiting for the writer."""

    slot: str
    buf: torch.Tensor | None
    total: int
    room: int  # where the room reserved for values DCP serialises begins
    done: cf.Future = field(default_factory=cf.Future)  # set when every copy into the slot is done
    leased: bool = True  # the slot is still this save's to commit or release

    def holds(self, t: torch.Tensor) -> bool:
        return self.buf is not None and t.is_cpu and t.numel() > 0 \
            and t.untyped_storage().data_ptr() == self.buf.untyped_storage().data_ptr()


def _is_leaf(x: Any) -> bool:
    """Whether DCP's planner saves ``x`` as one item (a tensor, or one value it serialises): its
    ``traverse_state_dict`` descends into mappings, and into lists that hold a tensor or a mapping at some
    depth; everything else (tuples included) is one item."""
    if isinstance(x, Mapping):
        return False
    if not isinstance(x, list):
        return True
    for v in x:
        if isinstance(v, torch.Tensor) or (isinstance(v, (Mapping, list)) and not _is_leaf(v)):
            return False
    return True


class DcpStager:
    """A DCP ``AsyncStager`` that stages straight into the node agent's shared-memory slot.

    ``dcp.async_save(sd, storage_writer=w, async_stager=DcpStager(w))``. ``stage`` leases the slot
    (pre-leased after the previous save, off the training thread), copies every tensor that anything but
    an optimizer step may change before it returns, and copies parameters and optimizer state in the
    background; every optimizer step of the process waits for that copy (one global optimizer step
    pre-hook), so the checkpoint holds the values of the step it names. Optimizers are known once they
    stepped after the writer was made, or at once when given (``optimizers=``: optimizers, or containers that
    hold them such as torchtitan's ``OptimizersContainer``).

    ``stage`` returns the staged state dict (tensors are views into the slot; DTensors keep their mesh,
    placements, shape and stride); DCP's upload thread plans and writes it while the copy may still run,
    and :class:`DcpWriter` commits the slot once the copy is done. ``async_save`` therefore returns DCP's
    plain upload future (``should_synchronize_after_execute`` is False; ``synchronize_staging`` waits for
    the copy). Non-tensor values are deep-copied at ``stage`` and room is reserved for DCP's
    serialisation of them; when it does not fit, the writer takes a fresh slot and copies the step once
    more. Raises CheckpointError when the agent cannot take the save.
    """

    _synchronize_after_execute = False

    def __init__(self, writer: "DcpWriter", *, optimizers: list | None = None) -> None:
        self.writer = writer
        if optimizers:
            _guard.learn(optimizers)

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: dict) -> dict:
        return self.writer._stage(state_dict)

    def synchronize_staging(self) -> None:
        """Wait until every staged tensor is copied into the slot."""
        self.writer._wait_copies()

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------------------- writer
class DcpWriter(StorageWriter):
    """A DCP ``StorageWriter`` that saves a step through the node agent (see the module docstring).

    ``DcpWriter(job, **settings)`` opens a :class:`~ckpt.Checkpointer` of its own (same settings:
    ``shm``, ``disk``, ``s3``, ``keep_memory``, ...; closed by :meth:`close`), or
    ``DcpWriter(checkpointer=ck)`` shares one. ``disk_every`` and ``s3_every`` count step numbers here
    (step N goes to disk when N % disk_every == 0). ``dcp.save`` returns once this rank's shard is
    committed to its agent (the agent finishes the step when every rank committed); :meth:`wait` blocks
    until the agent wrote everything everywhere.

    Raises ValueError for a checkpoint_id that names no step (see :func:`step_of`), CheckpointError when
    the agent cannot take the save or a commit is refused (a step saved already in this run).
    """

    def __init__(self, job: str | None = None, *, checkpointer: Any = None, **settings: Any) -> None:
        super().__init__()
        self.ck, self._owns = _checkpointer(job, checkpointer, settings)
        self.job = self.ck.job
        # the step of the save under way, per thread: DCP calls reset ... write_data of one save on one thread,
        # and async saves in flight at once run on threads of their own
        self._save = threading.local()
        self._staged: list[_Staged] = []
        self._rooms: dict[tuple, int] = {}  # see _room_for
        self._big: set[str] = set()  # names of large serialised values already warned about (_write)
        self._writing = 0  # write_data calls under way
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when a staged save is written or dropped

    # -------------------------------------------------------------- DCP's calls
    def reset(self, checkpoint_id: Any = None) -> None:
        self._save.step = None if checkpoint_id is None else step_of(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        try:
            step_of(checkpoint_id)
        except ValueError:
            return False
        return True

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if getattr(self._save, "step", None) is None:
            raise ValueError("no step to save: pass checkpoint_id=<step> (an int, or a path ending in 'step-N') "
                             "to dcp.save / dcp.async_save")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> torch.futures.Future:
        step = self._save.step
        assert step is not None  # set_up_storage_writer checked it
        self._save.step = None  # each save names its step
        with self._lock:
            self._writing += 1
        try:
            staged = self._take_staged(planner)
            try:
                self.ck._raise_pending()
                results = self._write(step, plan, planner, staged)
            except AgentError as e:
                from .checkpointer import CheckpointError

                raise CheckpointError(f"step {step} of {self.job!r}: the node agent refused the save ({e.kind}: "
                                      f"{e})") from e
            except BaseException:
                if staged is not None and staged.leased:
                    self._release(staged.slot)
                raise
        finally:
            with self._idle:
                self._writing -= 1
                self._idle.notify_all()
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        pass  # the agent builds the step's manifest once every rank committed

    # -------------------------------------------------------------- ours
    def wait(self, timeout: float | None = None) -> None:
        """Block until every save so far is written to all its tiers; raise background errors."""
        self._wait_copies()
        self.ck.wait(timeout)

    def close(self, timeout: float = 60.0) -> None:
        """Wait for the saves under way (staged by the stager, or being written) to be committed, up to ``timeout``
        seconds for those DCP has not started writing; release what is left; close the Checkpointer if this
        writer opened it. Call it once the last ``async_save``'s future is done, as DCP asks of a stager."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._writing or (self._staged and time.monotonic() < deadline):
                self._idle.wait(max(0.0, min(1.0, deadline - time.monotonic())) if not self._writing else 1.0)
            left, self._staged = self._staged, []
        if left:
            log.warning("closing with %d staged save(s) of %s that DCP never wrote: released", len(left), self.job)
        for st in left:
            self._wait_copy(st)
            self._release(st.slot)
        if self._owns:
            self.ck.close()

    def reader(self, **kw: Any) -> "DcpReader":
        """A :class:`DcpReader` of the same job through the same Checkpointer."""
        return DcpReader(checkpointer=self.ck, **kw)

    def __enter__(self) -> "DcpWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _release(self, slot: str) -> None:
        try:
            self.ck._client.call("release", slot=slot)
        except Exception:
            pass  # the agent takes a dead trainer's leases back

    def _lease(self, nbytes: int) -> str:
        """A slot for ``nbytes`` bytes without waiting for one (``Checkpointer._lease_now``: it may be only
        sized, and faulted in by the copies). Raises CheckpointError when the agent has none."""
        from .checkpointer import CheckpointError

        try:
            slot, why = self.ck._lease_now(nbytes)
        except AgentError as e:
            raise CheckpointError(f"the node agent could not take a save of {nbytes} bytes ({e.kind}: {e}); free "
                                  "host memory or lower keep_memory, then save again") from e
        if slot is None:
            raise CheckpointError(f"the node agent could not take the save: {why}")
        return slot

    def _wait_copies(self) -> None:
        with self._lock:
            pending = list(self._staged)
        for st in pending:
            self._wait_copy(st)

    @staticmethod
    def _wait_copy(st: _Staged) -> None:
        try:
            st.done.result()
        except Exception:
            pass  # raised by the write that takes it

    def _room_for(self, x: Any) -> int:
        """Bytes to reserve for DCP's serialisation of the value ``x`` (it ``torch.save``s it), with slack.

        Measured once per distinct small hashable value: an optimizer container's state holds thousands of
        values (each parameter's ``lr``, ``betas``, ...) but few distinct ones, and a ``torch.save`` each save
        cost 0.2 s of the blocking time for 1,800 of them."""
        key = None
        if isinstance(x, (int, float, bool, str, tuple, type(None))) and len(repr(x)) <= 256:
            try:
                key = (type(x), x, repr(x))
                hash(key)
            except TypeError:
                key = None
        if key is not None:
            got = self._rooms.get(key)
            if got is not None:
                return got
        b = io.BytesIO()
        torch.save(x, b)  # what DCP's planner will write for it, give or take a few bytes
        n = _aligned(len(b.getbuffer()) + len(b.getbuffer()) // 4 + 512)
        if key is not None and len(self._rooms) < 65536:
            self._rooms[key] = n
        return n

    def _stage(self, state_dict: dict) -> dict:
        """Lease a slot, lay out ``state_dict``'s tensors in it, copy them (guarded ones in the background);
        return the staged state dict."""
        from .checkpointer import SaveFuture

        ck = self.ck
        ck._raise_pending()
        if ck._inflight is not None:
            ck._wait_guarded()
        if ck.overlap:
            ck._install_hook()
        guarded = _guard.guarded_storages() if ck.overlap else set()
        tensors: list[tuple[torch.Tensor, torch.Tensor, int, int]] = []  # (original, local, offset, nbytes)
        room = 0

        def plan(x: Any) -> None:
            nonlocal room
            if isinstance(x, torch.Tensor):
                local = x.to_local() if hasattr(x, "placements") else x
                tensors.append((x, local.detach(), 0, local.numel() * local.element_size()))
            elif isinstance(x, Mapping):
                for v in x.values():
                    plan(v)
            elif not _is_leaf(x):
                for v in x:
                    plan(v)
            else:
                room += self._room_for(x)

        plan(state_dict)
        off = 0
        for i, (t, local, _, n) in enumerate(tensors):
            off = _aligned(off)
            tensors[i] = (t, local, off, n)
            off += n
        room_at = _aligned(off)
        total = room_at + room
        slot = self._lease(total)
        st = _Staged(slot, None, total, room_at)
        fut = SaveFuture(-1, _ck=None)
        copies = [(local, o, n, ck.overlap and n > 0 and storage_key(local) in guarded)
                  for _, local, o, n in tensors]
        buf, later, waits, sparse = ck._stage_now(slot, total, copies, "the save")  # releases the slot on failure
        st.buf = buf
        try:
            views: dict[int, torch.Tensor] = {}
            for t, local, o, n in tensors:
                v = buf[o:o + n].view(local.dtype).view(local.shape) if n else torch.empty(local.shape,
                                                                                           dtype=local.dtype)
                if hasattr(t, "placements"):
                    from torch.distributed.tensor import DTensor

                    # the same mesh, placements, shape and stride around the slot view (DCP's own transport builds
                    # DTensors this way); from_local would move a host view back to a CUDA mesh's device
                    v = DTensor(v, t._spec, requires_grad=False)
                views[id(t)] = v
        except BaseException:
            self._release(slot)
            raise
        with self._lock:
            self._staged.append(st)

        def finish() -> None:
            try:
                if sparse:
                    ck._allocate(slot, [(0, total)])  # before any copy (and DCP's values in its room) writes
                ck._copy_parallel(buf, later)
                for done in waits:
                    done()
                st.done.set_result(None)
                fut._staged.set_result(None)
            except BaseException as e:
                st.done.set_exception(e)
                fut._staged.set_exception(e)

        ck._inflight = fut  # the optimizer step pre-hook waits for it
        if later or waits:
            ck._pool.submit(finish)
        else:
            finish()
        return self._rebuild(state_dict, views)

    @staticmethod
    def _rebuild(x: Any, views: dict[int, torch.Tensor]) -> Any:
        if isinstance(x, torch.Tensor):
            return views[id(x)]
        if isinstance(x, Mapping):
            return {k: DcpWriter._rebuild(v, views) for k, v in x.items()}
        if not _is_leaf(x):
            return [DcpWriter._rebuild(v, views) for v in x]
        try:
            return copy.deepcopy(x)  # a snapshot: the upload thread serialises it after training moved on
        except Exception:
            return x

    def _take_staged(self, planner: SavePlanner) -> _Staged | None:
        """The staged slot that holds this save's tensors (DCP's planner holds the staged dict), else the oldest
        one staged (a state with no tensors), else None (``dcp.save`` without the stager)."""
        sd = getattr(planner, "state_dict", None) or {}
        with self._lock:
            if not self._staged:
                return None
            for v in sd.values():
                if isinstance(v, torch.Tensor):
                    local = v.to_local() if hasattr(v, "placements") else v
                    for st in self._staged:
                        if st.holds(local):
                            self._staged.remove(st)
                            return st
            # a state whose tensors are all empty, or none: DCP saves in order, so the oldest is this one
            return self._staged.pop(0)

    def _write(self, step: int, plan: SavePlan, planner: SavePlanner, st: _Staged | None) -> list[WriteResult]:
        ck = self.ck
        chunks: list[TensorChunk] = []
        extra: list[tuple[Any, Any, int]] = []  # (write item, tensor or bytes, nbytes) to copy into the slot
        names: set[str] = set()
        for item in plan.items:
            name = item.index.fqn
            if name in names:
                raise ValueError(f"{name}: two chunks of one tensor on rank {ck.rank}; the plug-in keeps one chunk "
                                 "per name and rank (use DCP's DefaultSavePlanner)")
            names.add(name)
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                raw = data.getbuffer() if isinstance(data, io.BytesIO) else memoryview(bytes(data))
                extra.append((item, raw, len(raw)))
                if len(raw) > BIG_OBJECT and name not in self._big:
                    self._big.add(name)
                    log.warning("%s: %r is not a tensor, so DCP pickles it (torch.save) on every save: %.1f MiB at "
                                "step %d, copied and checksummed with the step, which slows each save; keep large "
                                "state as tensors (a state_dict of tensors), or out of the saved state (said once "
                                "per name)", self.job, name, len(raw) / (1 << 20), step)
                continue
            t = data.detach()
            n = t.numel() * t.element_size()
            if st is not None and st.holds(t) and t.is_contiguous():
                off = t.data_ptr() - st.buf.data_ptr()
                chunks.append(self._chunk(item, t, off, n))
            else:
                extra.append((item, t, n))
        if st is not None:
            st.done.result()  # every staged copy is in the slot
        room = st.room if st is not None else 0
        need = sum(_aligned(n) for _, _, n in extra)
        if st is not None and room + need <= st.total:
            slot, buf, total = st.slot, st.buf, st.total
        else:
            # no stager, or its reserved room is too small: a fresh slot with every chunk laid out again
            # (the staged bytes are copied out and its slot released first: the ring may have no slot to spare)
            kept = [(c, st.buf[c.offset:c.offset + c.nbytes].clone()) for c in chunks] if st is not None else []
            if st is not None:
                self._release(st.slot)
                st.leased = False
            total = sum(_aligned(c.nbytes) for c in chunks) + need
            slot = self._lease(total)
            try:
                if total and not ck._backed(slot, total):  # leased only sized: its memory first (DCP's upload thread)
                    ck._allocate(slot, [(0, total)])
                buf = ck._map(slot, total)
                room = 0
                chunks, items = [], []
                for c, data in kept:
                    items.append((data, room, c.nbytes))
                    chunks.append(TensorChunk(c.name, c.dtype, c.global_shape, c.offsets, c.shape, room, c.nbytes))
                    room += _aligned(c.nbytes)
                ck._copy_parallel(buf, items)
                del kept, items
            except BaseException:
                self._release(slot)
                raise
        try:
            copies = []
            for item, data, n in extra:
                if isinstance(data, torch.Tensor):
                    chunks.append(self._chunk(item, data, room, n))
                    if not data.is_cpu:
                        data = data.cpu()
                    copies.append((data, room, n))
                else:
                    chunks.append(TensorChunk(item.index.fqn, BYTES_DTYPE, (n,), (0,), (n,), room, n))
                    if n:
                        copies.append((torch.frombuffer(data, dtype=torch.uint8), room, n))
                room += _aligned(n)
            ck._copy_parallel(buf, copies)
            layout = Layout(tuple(sorted(chunks, key=lambda c: c.offset)))
            r = ck._commit(step=step, slot=slot, nbytes=total, layout=layout, values=[], save_index=step,
                           metadata=dict(ck.metadata))
        except BaseException:
            self._release(slot)
            if st is not None:
                st.leased = False
            raise
        if st is not None:
            st.leased = False  # the agent's now: the step's shard
        ck._collect(r)
        try:
            ck._prelease_fut = ck._leaser.submit(ck._prelease, total)
        except RuntimeError:
            pass  # the Checkpointer is closing: no next save to lease for
        return [WriteResult(index=item.index, size_in_bytes=0, storage_data=None) for item in plan.items]

    @staticmethod
    def _chunk(item: Any, t: torch.Tensor, off: int, n: int) -> TensorChunk:
        td = item.tensor_data
        if tuple(t.shape) != tuple(td.chunk.sizes):
            raise ValueError(f"{item.index.fqn}: DCP planned a chunk of {list(td.chunk.sizes)}, the tensor is "
                             f"{list(t.shape)}")
        return TensorChunk(item.index.fqn, dtype_name(t.dtype), tuple(td.size), tuple(td.chunk.offsets),
                           tuple(t.shape), off, n)


# --------------------------------------------------------------------------------------- reader
class DcpReader(StorageReader):
    """A DCP ``StorageReader`` over the job's tiers: ``dcp.load(sd, storage_reader=DcpReader(job, ...))``.

    Reads ``checkpoint_id``'s step (see :func:`step_of`), or, when none is given, the newest step that every
    rank can reach (the ranks agree on it). Each shard comes from the cheapest tier that holds it intact
    (memory, peers, disk, S3; checksums verified; a damaged copy falls back to the next place), for any
    world size: DCP reshards. Values DCP serialised are handed to its planner's ``load_bytes`` once their
    shard's checksum is verified (DCP's planner unpickles them: ``torch.load(weights_only=False)``).

    Loading a step resumes the job from it (``rewind=True``): the agent drops the steps after it from
    memory, as ``Checkpointer.restore`` does, so the resumed run can save those step numbers again. Pass
    ``rewind=False`` to read a step without resuming.

    Raises StepNotFoundError when the step is not complete anywhere (or no step is), RestoreError (a
    StepNotFoundError) when a shard cannot be read intact from any tier. A ``checkpoint_id`` passed to
    ``dcp.load`` is looked up before DCP starts (errors come as they are); errors met inside DCP's plan or
    read come wrapped in DCP's ``CheckpointException`` (its ``failures`` hold ours).
    """

    def __init__(self, job: str | None = None, *, checkpointer: Any = None, step: Any = None, rewind: bool = True,
                 verify: bool = True, **settings: Any) -> None:
        super().__init__()
        self.ck, self._owns = _checkpointer(job, checkpointer, settings)
        self.job = self.ck.job
        self.rewind = rewind
        self.verify = verify
        self.step: int | None = None if step is None else step_of(step)
        self._inner: Any = None
        self._planned = False  # _inner was planned by reset for the load that follows it
        self.reports: list = []

    def reset(self, checkpoint_id: Any = None) -> None:
        self.step = None if checkpoint_id is None else step_of(checkpoint_id)
        self._inner = None
        self._resolve()
        self._planned = True

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return DcpWriter.validate_checkpoint_id(checkpoint_id)

    def read_metadata(self) -> Metadata:
        if not self._planned:
            self._resolve()  # each load looks again: a newer step may be there since the last one
        self._planned = False
        return self._inner.read_metadata()

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future:
        try:
            return self._inner.read_data(plan, planner)
        except ShardUnavailableError as e:
            raise RestoreError(f"step {self._inner.plan.step} of {self.job!r} could not be read intact from any "
                               f"tier ({e}); `ckpt verify {self.job} --step {self._inner.plan.step}` shows what "
                               "is damaged") from e
        finally:
            self.reports = list(self._inner.reports)

    @property
    def loaded_step(self) -> int | None:
        """The step the last load read (None before one)."""
        return None if self._inner is None else self._inner.plan.step

    def close(self) -> None:
        """Close the Checkpointer if this reader opened it."""
        if self._owns:
            self.ck.close()

    def __enter__(self) -> "DcpReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def latest_step(self) -> int | None:
        """The newest step complete in the tiers every rank reaches (the ranks agree: a collective under
        torch.distributed), or None when there is none: what a resuming job passes to ``dcp.load`` as
        ``checkpoint_id``."""
        agreed = self._restorer().agree_step(None)
        return None if agreed < 0 else agreed

    def _restorer(self) -> Restorer:
        """What chooses the step and agrees on it with the other ranks (:meth:`Restorer.agree_step`; this reader
        plans and reads it itself): memory, peers and disk, then S3 when the step is not there or (no step
        given) S3 may hold a newer one. A step counts when this rank's own shard is complete, as
        Checkpointer.restore counts: the shards of other nodes' ranks that DCP may also need are looked for
        when the step is planned (other nodes' memory, then S3)."""
        from .checkpointer import _min_over_ranks

        ck = self.ck
        return Restorer(self.job, ck.rank, ck.world, near=lambda: scan_tiers(ck._near_tiers(), self.job),
                        far=(lambda: scan_tiers(ck._far_tiers(), self.job)) if ck.settings.s3 is not None else None,
                        far_may_be_newer=ck._far_may_be_newer,
                        agree=_min_over_ranks if ck.world > 1 and dist.is_initialized() else (lambda v: v),
                        replicas=False)

    def _resolve(self) -> None:
        """Agree on the step, plan where each shard is read from, and rewind the job to it."""
        from ._reader import PlanReader

        ck = self.ck
        chooser = self._restorer()
        agreed = chooser.agree_step(self.step)
        invs = chooser.invs
        if agreed < 0 or (self.step is not None and agreed != self.step):
            if self.step is not None:
                raise StepNotFoundError(f"step {self.step} of job {self.job!r} is not complete in any tier every "
                                        f"rank reaches ({describe_step(invs, self.job, self.step)}); "
                                        f"`ckpt list {self.job}` shows the steps")
            raise StepNotFoundError(f"job {self.job!r} has no step complete in any tier every rank reaches; "
                                    f"`ckpt list {self.job}` shows the steps")
        costs, _ = node_costs(ck.settings.shm, invs)
        plan = self._plan(invs, agreed, costs, chooser.far_unlisted)
        if self.rewind:
            try:
                ck._client.call("rewind", job=self.job, step=agreed, run=ck._run)
            except AgentError as e:
                log.warning("the agent could not drop steps after %d: %s", agreed, e)
        self._inner = PlanReader(plan, verify=self.verify, values=True)

    def _plan(self, invs: list, step: int, costs: Any, far: bool) -> RestorePlan:
        """Every rank's shard of ``step`` (DCP may need any of them): the other nodes' memory, then S3, when
        the near tiers do not hold them all."""
        from agents.replication import placement_partners
        from agents.tierset import peer_tiers

        ck = self.ck
        try:
            return plan_restore(invs, self.job, step, costs=costs)
        except StepNotFoundError:
            others = peer_tiers(ck.settings, exclude=placement_partners(ck.settings))
            if others:
                invs = invs + scan_tiers(others, self.job)
            if far:
                invs = invs + scan_tiers(ck._far_tiers(), self.job)
            if not others and not far:
                raise
            return plan_restore(invs, self.job, step, costs=costs)
