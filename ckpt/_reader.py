"""A DCP ``StorageReader`` over a restore plan, so DCP can reshard a checkpoint across world sizes.

Call order (DCP's): ``reset`` → ``read_metadata`` → ``set_up_storage_reader`` → ``prepare_local_plan``
→ ``prepare_global_plan`` (coordinator) → ``read_data``. The metadata comes from the tierckpt manifest
(every tensor chunk of every rank, with its global shape and offsets); ``read_data`` maps each shard it
needs once, verified, from the cheapest tier that holds it intact, and copies the asked-for hypercube of
each chunk into DCP's target. For the Checkpointer only tensors go through DCP (its JSON and bytes values are
restored by the Checkpointer); for the DCP plug-in (``values=True``) the ``bytes`` chunks are values DCP serialised
itself, handed to the planner's ``load_bytes`` once their shard is verified.
"""

from __future__ import annotations

import io
import math
import warnings
from typing import Any

import torch
from torch.distributed.checkpoint import StorageReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner

from recovery import RestorePlan, open_shard
from tiers.manifest import BYTES_DTYPE, TensorChunk

from ._tensors import buffer_allocator, dtype_of as _dtype, local_chunk

__all__ = ["PlanReader"]


class PlanReader(StorageReader):
    """Reads the tensors (and with ``values``, the values DCP serialised) of one planned step, any world
    size, for ``dcp.load``."""

    def __init__(self, plan: RestorePlan, *, verify: bool = True, values: bool = False,
                 prefer: int | None = None) -> None:
        super().__init__()
        self.plan = plan
        self.verify = verify
        self.reports: list = []
        # (fqn, chunk offsets) -> (rank, entry)
        self._where: dict[tuple[str, tuple[int, ...]], tuple[int, TensorChunk]] = {}
        # fqn -> (rank, entry) of a value DCP serialised (values=True only)
        self._values: dict[str, tuple[int, TensorChunk]] = {}
        # the shards planned: every rank's, or (a shared tier's view at the same world) those of the ranks that
        # hold this rank's chunks. A chunk several shards list (a plain tensor every rank has under one name:
        # an optimizer's step, an RNG state) comes from ``prefer``'s shard when it has one, else the lowest's
        ranks = sorted(r for r in (sh.rank for sh in plan.manifest.shards) if r in plan.sources)
        if prefer in ranks:
            ranks.remove(prefer)
            ranks.insert(0, prefer)
        for rank in ranks:
            for e in plan.entries(rank):
                if not isinstance(e, TensorChunk):
                    continue
                if e.dtype != BYTES_DTYPE:
                    self._where.setdefault((e.name, e.offsets), (rank, e))
                elif values:
                    self._values.setdefault(e.name, (rank, e))

    def uncovered(self, tensors: dict[str, torch.Tensor]) -> list[str]:
        """The names of ``tensors`` (a rank's, DTensors by their local chunk) that the planned shards' chunks
        do not cover in full. Chunks of one tensor at distinct offsets are disjoint (as DCP writes them), so
        the volume they share with the local chunk adds up to its volume exactly when it is covered."""
        by_name: dict[str, list[TensorChunk]] = {}
        for (name, _), (_, e) in self._where.items():
            by_name.setdefault(name, []).append(e)
        out = []
        for name, t in tensors.items():
            local, _, offsets = local_chunk(t)
            shape = tuple(local.shape)
            want = math.prod(shape)
            if not want:
                continue
            got = 0
            for e in by_name.get(name, ()):
                if len(e.offsets) != len(offsets):
                    continue
                got += math.prod(max(0, min(o + n, eo + en) - max(o, eo))
                                 for o, n, eo, en in zip(offsets, shape, e.offsets, e.shape))
            if got < want:
                out.append(name)
        return out

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md: dict[str, TensorStorageMetadata] = {}
        for (name, offsets), (_, e) in self._where.items():
            m = md.get(name)
            if m is None:
                m = md[name] = TensorStorageMetadata(TensorProperties(dtype=_dtype(e.dtype)),
                                                     torch.Size(e.global_shape), [])
            m.chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(e.shape)))
        out: dict[str, Any] = dict(md)
        for name in self._values:
            out[name] = BytesStorageMetadata()
        return Metadata(state_dict_metadata=out)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future:
        # one saved shard at a time, each closed (its buffer freed) once every chunk this rank needs from
        # it is copied: memory stays bounded by the largest shard, whatever the number of shards
        by_rank: dict[int, list] = {}
        for req in plan.items:
            if req.type == LoadItemType.BYTE_IO:
                rank, e = self._values[req.storage_index.fqn]
            else:
                rank, e = self._where[(req.storage_index.fqn, tuple(req.storage_index.offset))]
            by_rank.setdefault(rank, []).append((req, e))
        for rank in sorted(by_rank):
            keep: list[torch.Tensor] = []
            shard = open_shard(self.plan, rank, buffer_allocator(keep), verify=self.verify)
            self.reports.append(shard.report)
            try:
                self._copy_out(shard, by_rank[rank], planner)
            finally:
                shard.close()
                keep.clear()
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(None)
        return fut

    @staticmethod
    def _copy_out(shard: Any, items: list, planner: LoadPlanner) -> None:
        for req, e in items:
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(bytes(shard.view[e.offset:e.offset + e.nbytes])))
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a copy-on-write mapping is writable; torch cannot tell
                src = torch.frombuffer(shard.view, dtype=torch.uint8, count=e.nbytes, offset=e.offset) \
                    if e.nbytes else torch.empty(0, dtype=torch.uint8)
            src = src.view(_dtype(e.dtype)).view(e.shape)
            for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths)):
                src = src.narrow(dim, start, length)
            target = planner.resolve_tensor(req).detach()
            if target.size() != src.size():
                raise ValueError(f"{req.storage_index.fqn}: chunk {list(src.size())} vs target "
                                 f"{list(target.size())}")
            target.copy_(src)
            planner.commit_tensor(req, target)
            del src

