"""Where each leaf of a flattened state goes in this rank's shard, worked out once while the state keeps its shape.

A training state has the same tensors at every save (names, dtypes, shapes, chunks of DTensors) and mostly
the same JSON values; what changes is the tensors' bytes. So a save's layout is a function of a short
**signature**: per tensor leaf its name, dtype and shape (for a DTensor also its local chunk and who else
holds it), per ``bytes`` leaf its name and length, and the length of the values' JSON when it goes into the
shard. When the signature equals the last save's, the last layout, its offsets and its digest are reused;
anything else (a key added, a dtype or shape changed, a tensor replaced by a value, bytes of another
length) lays the shard out again. Only where things go is reused: every save still copies the current
tensors, bytes and values.

Values in the shard get room to grow: their chunk is laid out an eighth larger than their JSON (in 4 KiB
pages) and the JSON is followed by spaces, so values that grow a little (an lr scheduler's state after the
first step) change neither the layout nor the size of the slot leased for the save; values that outgrow
the room, or shrink below half of it, lay the shard out again.

The JSON of the values is kept the same way, per value: a value is encoded again unless it is the very
object saved last time and deeply immutable (a number, string, bool, None, or a tuple of those). A list
(mutable) is encoded at every save; equal but not identical values (``0.0`` and ``-0.0``, ``1`` and
``True`` inside a tuple) are never taken for each other.
"""

from __future__ import annotations

import json
import operator
from dataclasses import dataclass, field
from typing import Any

import torch

from tiers.layout import Layout
from tiers.manifest import BYTES_DTYPE, SPILL_BYTES, VALUES_NAME, TensorChunk, encode_group, encode_value

from ._flatten import Flat
from ._replicas import OwnerBalance, Replicas, replicas_of
from ._tensors import dtype_name, local_chunk

__all__ = ["ShardPlan", "ShardPlanner", "ALIGN"]

#: every chunk starts at a multiple of this many bytes
ALIGN = 64
#: the values chunk is this many bytes or a multiple, and an eighth larger than its JSON when laid out
_ROOM_PAGE = 4096
#: exact tensor types whose local chunk is the tensor itself (subclasses, DTensors among them, are asked)
_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})
_FROZEN = frozenset({int, float, str, bool, type(None)})


def _frozen(v: Any) -> bool:
    """Whether ``v`` can never change: a JSON scalar of an exact type, or a tuple of such values."""
    t = type(v)
    return t in _FROZEN or t is tuple and all(_frozen(x) for x in v)


def _aligned(off: int) -> int:
    return (off + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class ShardPlan:
    """One save's shard: its layout, the JSON values that go in the manifest (empty when they are in the
    shard), the copies that fill it (``(source tensor, offset, bytes, may be copied in the background)``),
    its size, its durable part (the bytes before the chunks another rank writes to the shared tier) and its
    unique part (``(bytes before the first chunk another rank also holds, the holder groups of those
    chunks as the agent is sent them, :func:`tiers.manifest.encode_group`)``, None when no other rank holds
    any: see ``ShardInfo.unique``)."""

    layout: Layout
    values: list[list]
    copies: list[tuple[torch.Tensor, int, int, bool]]
    total: int
    durable: int
    unique: tuple[int, list[Any]] | None = None


@dataclass
class _Values:
    """The values' JSON, one fragment per value, kept with the objects it was made from."""

    names: list[str] = field(default_factory=list)
    objs: list[Any] = field(default_factory=list)
    frozen: list[bool] = field(default_factory=list)
    encoded: list[Any] = field(default_factory=list)
    frags: list[str] = field(default_factory=list)
    all_frozen: bool = False
    blob: bytes = b"[]"
    rows: list[list] | None = None

    def update(self, names: list[str], objs: list[Any]) -> tuple[bytes, list[list]]:
        """``(JSON of [[name, value], ...], those rows)`` for these values. Raises ValueError for a value
        JSON cannot hold (a non-finite float inside a list)."""
        same_names = names == self.names
        if same_names and self.all_frozen and all(map(operator.is_, objs, self.objs)):
            return self.blob, self._rows()
        if not same_names:
            self.names, self.objs, self.frozen, self.encoded, self.frags = names, [], [], [], []
        old, olds = self.objs, len(self.objs)
        frozen, encoded, frags = self.frozen, self.encoded, self.frags
        dumps = json.JSONEncoder(allow_nan=False, separators=(",", ":")).encode
        for i, (name, v) in enumerate(zip(names, objs)):
            if i < olds:
                if v is old[i] and frozen[i]:
                    continue
                frozen[i] = _frozen(v)
                encoded[i] = encode_value(v)
                frags[i] = dumps([name, encoded[i]])
            else:
                frozen.append(_frozen(v))
                encoded.append(encode_value(v))
                frags.append(dumps([name, encoded[-1]]))
        self.objs = list(objs)
        self.all_frozen = all(frozen)
        self.blob = ("[" + ",".join(frags) + "]").encode()
        self.rows = None
        return self.blob, self._rows()

    def _rows(self) -> list[list]:
        if len(self.blob) > SPILL_BYTES:
            return []  # not needed: the values go into the shard
        if self.rows is None:
            self.rows = [[n, e] for n, e in zip(self.names, self.encoded)]
        return self.rows


class ShardPlanner:
    """Lays out one rank's shard for each save (see the module docstring); one per Checkpointer."""

    def __init__(self, described: dict[str, Replicas] | None = None) -> None:
        #: escaped top-level key -> the holders of this rank's plain tensors under it (``_replicas.described``)
        self.described = dict(described or {})
        self._sig: list | None = None
        self._offsets: list[int] = []
        self._sizes: list[int] = []
        self._layout: Layout | None = None
        self._values_at = -1
        #: bytes of the shard's values chunk: the values' JSON, then spaces (room to grow into)
        self._values_room = 0
        self._total = 0
        self._durable = 0
        self._unique: tuple[int, list[list[int]]] | None = None
        self._values = _Values()

    def replicas(self, name: str, t: Any) -> Replicas | None:
        """The holders of this rank's chunk of the tensor ``t`` named ``name`` in the flattened state: a
        DTensor's from its placements, a plain tensor's from the description of its top-level key."""
        if type(t) in _PLAIN:
            if not self.described:
                return None
            return self.described.get(name.split("/", 1)[0])
        return replicas_of(t)

    def plan(self, flat: Flat, overlap: bool) -> ShardPlan:
        """The shard of ``flat``, in three parts (:mod:`ckpt._replicas`): what no other rank holds (its own
        chunks, bytes values, the values kept in the shard: the *unique* part), the chunks other ranks hold
        copies of that this rank writes to the shared tier for all of them (with the unique part, the
        *durable* part), then the copies another rank writes. ``overlap``: guarded tensors may be copied in
        the background."""
        sig: list = []
        sources: list[Any] = []  # per chunk in leaf order: a tensor, or bytes
        guards: list[bool] = []
        names: list[str] = []
        objs: list[Any] = []
        for leaf in flat.leaves:
            t = leaf.tensor
            if t is None:
                v = leaf.value
                if type(v) is bytes:
                    sig.append((leaf.name, len(v)))
                    sources.append(v)
                    guards.append(overlap)  # a private, immutable object: nobody changes it meanwhile
                else:
                    names.append(leaf.name)
                    objs.append(v)
                continue
            if type(t) in _PLAIN:
                local = t.detach() if t.requires_grad else t
                sig.append((leaf.name, t.dtype, t.shape))
            else:
                local, gshape, offsets = local_chunk(t)
                if local.requires_grad:  # state-dict entries come detached; on XLA a detach is a traced op
                    local = local.detach()
                n = local.numel() * local.element_size()
                sig.append((leaf.name, local.dtype, local.shape, gshape, offsets, replicas_of(t) if n else None))
            sources.append(local)
            guards.append(leaf.guarded and overlap)
        blob, rows = self._values.update(names, objs)
        room = -1  # the values stay in the manifest
        if len(blob) > SPILL_BYTES:
            room = self._values_room
            if not room // 2 <= len(blob) <= room:
                room = -(-(len(blob) + len(blob) // 8) // _ROOM_PAGE) * _ROOM_PAGE
        sig.append(room)
        if sig != self._sig:
            self._lay_out(flat, sig, sources, room)
        copies: list[tuple[Any, int, int, bool]] = []
        for src, off, n, g in zip(sources, self._offsets, self._sizes, guards):
            if type(src) is bytes:
                if not n:
                    continue
                # torch reads only writable buffers without a warning; the copy is private to this save
                src = torch.frombuffer(bytearray(src), dtype=torch.uint8)
            copies.append((src, off, n, g))
        if room >= 0:
            # spaces after the JSON fill the room, so values that grow a little keep the layout and the slot
            padded = bytearray(room)
            padded[:len(blob)] = blob
            padded[len(blob):] = b" " * (room - len(blob))
            copies.append((torch.frombuffer(padded, dtype=torch.uint8), self._values_at, room, overlap))
        assert self._layout is not None
        return ShardPlan(self._layout, rows, copies, self._total, self._durable, self._unique)

    def _lay_out(self, flat: Flat, sig: list, sources: list[Any], spill: int) -> None:
        """Place every chunk again (the signature changed); ``spill``: bytes of the values chunk, or -1 when the
        values go in the manifest."""
        chunks: list[TensorChunk] = []
        offsets = [0] * len(sources)
        sizes = [0] * len(sources)
        off = 0
        owned: list[tuple[int, TensorChunk]] = []
        tail: list[tuple[int, TensorChunk]] = []
        groups: dict[tuple[int, ...], None] = {}
        balance = OwnerBalance()
        i = 0
        for leaf in flat.leaves:
            if leaf.tensor is None and type(leaf.value) is not bytes:
                continue
            src = sources[i]
            if type(src) is bytes:
                n = len(src)
                off = _aligned(off)
                chunks.append(TensorChunk(leaf.name, BYTES_DTYPE, (n,), (0,), (n,), off, n))
                offsets[i], sizes[i] = off, n
                off += n
                i += 1
                continue
            local = src
            _, gshape, chunk_offsets = local_chunk(leaf.tensor)
            n = local.numel() * local.element_size()
            chunk = TensorChunk(leaf.name, dtype_name(local.dtype), tuple(gshape), tuple(chunk_offsets),
                                tuple(local.shape), 0, n)
            sizes[i] = n
            rep = self.replicas(leaf.name, leaf.tensor) if n else None
            if rep is not None:
                groups[rep.holders] = None
                # this rank writes it to the shared tier for every holder, or another holder does
                (owned if balance.deal(rep, n).mine else tail).append((i, chunk))
            else:
                off = _aligned(off)
                offsets[i] = off
                chunks.append(_at(chunk, off))
                off += n
            i += 1
        values_at = -1
        self._values_room = max(spill, 0)
        if spill >= 0:
            # too many for the manifest every node receives: into this rank's shard (tiers.manifest.SPILL_BYTES)
            off = values_at = _aligned(off)
            chunks.append(TensorChunk(VALUES_NAME, BYTES_DTYPE, (spill,), (0,), (spill,), off, spill))
            off += spill
        unique = off

        def place(part: list[tuple[int, TensorChunk]], off: int) -> int:
            for i, chunk in part:
                off = _aligned(off)
                offsets[i] = off
                chunks.append(_at(chunk, off))
                off += chunk.nbytes
            return off

        durable = off = place(owned, off)
        off = place(tail, off)
        layout = Layout(tuple(chunks))
        if layout == self._layout:
            layout = self._layout  # keeps its digest: computed once while the layout does not change
        self._sig, self._offsets, self._sizes, self._layout = sig, offsets, sizes, layout
        self._values_at, self._total, self._durable = values_at, off, durable
        self._unique = (unique, [encode_group(g) for g in groups]) if groups else None


def _at(c: TensorChunk, off: int) -> TensorChunk:
    return TensorChunk(c.name, c.dtype, c.global_shape, c.offsets, c.shape, off, c.nbytes)
