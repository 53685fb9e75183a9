"""Which ranks hold identical bytes of a tensor, and which one of them is to write it to the slow tiers.

The job's own parallelism keeps copies: with HSDP every data-parallel replica group holds the same
shards, with tensor parallelism every TP rank holds the whole of a replicated norm or bias. A DTensor
says so itself: along each mesh dimension whose placement is ``Replicate``, every rank holds the same
chunk. So, with no configuration:

* the **holders** of this rank's chunk of a DTensor are the ranks of its mesh that differ from this
  rank only in the replicated dimensions (this rank included), ordered by their coordinates there;
* one holder **owns** the chunk: the one that writes it to disk and S3 for all of them. Owners are
  balanced by bytes: the chunks of the tensors that share a mesh and a set of replicated dimensions
  are dealt, in state order, each to the holder with the fewest bytes so far (ties to the lowest index).
  Every holder sees the same tensors with the same chunk sizes in the same order (it holds the same
  chunks), so each computes the same owners alone, with no message. Replica groups sit on different
  nodes in the usual layouts (HSDP's replicate dimension is the outer one), so this balances the
  bytes each node drains too.

A tensor that is not a DTensor (plain DDP, a pipeline stage's module) says nothing about copies: it is
taken as this rank's alone, unless the job describes it (:func:`described`: ``Checkpointer(replicated=
{"model": dp_group, "optim": dp_group})``), when its holders are the described group, dealt owners as
above. ``Partial`` placements hold different bytes per rank and are never shared.

Pure and cheap (a few microseconds per DTensor): called on every save's flattened state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ._flatten import _seg

__all__ = ["Replicas", "OwnerBalance", "replicas_of", "described", "unique_bytes"]


@dataclass(frozen=True)
class Replicas:
    """The ranks that hold identical bytes of one chunk, and which of them owns it.

    ``holders``: global ranks, this rank's among them, ordered by their coordinates along the
    replicated mesh dimensions; ``index``: this rank's position in ``holders``; ``owner``: the
    position of the holder that writes the chunk to the slow tiers; ``group``: what tensors are
    balanced together (the mesh and its replicated dimensions).
    """

    holders: tuple[int, ...]
    index: int
    owner: int = 0
    group: tuple = ()

    @property
    def count(self) -> int:
        return len(self.holders)

    @property
    def mine(self) -> bool:
        """Whether this rank writes the chunk to the slow tiers."""
        return self.owner == self.index


def replicas_of(t: Any) -> Replicas | None:
    """The holders of this rank's chunk of ``t`` (``owner`` not yet dealt: 0), or None when ``t`` is not a
    DTensor replicated along any mesh dimension (this rank's alone), or this rank is not in its mesh."""
    placements = getattr(t, "placements", None)
    mesh = getattr(t, "device_mesh", None)
    if placements is None or mesh is None or hasattr(t, "global_tensor"):
        return None  # not a DTensor; torch-xla's sharded tensor is saved whole by every rank (ckpt._devices.xla)
    # the same for every tensor of a mesh and placements, at every save: computed once (the save path calls it)
    key = (mesh, tuple(placements))
    try:
        return _known[key]
    except KeyError:
        pass
    except TypeError:  # a mesh that cannot be hashed: computed each time
        return _holders(mesh, placements)
    got = _known[key] = _holders(mesh, placements)
    return got


#: (mesh, placements) -> the holders of a chunk of a DTensor laid out so (see :func:`replicas_of`)
_known: dict[tuple, "Replicas | None"] = {}


def _holders(mesh: Any, placements: Any) -> "Replicas | None":
    try:
        rep = tuple(i for i, p in enumerate(placements) if p.is_replicate())
        if not rep:
            return None
        coord = mesh.get_coordinate()
    except (AttributeError, RuntimeError):
        return None  # a mesh that cannot say where this rank is: the chunk is taken as this rank's alone
    if coord is None:
        return None
    ranks = mesh.mesh  # a tensor of global ranks shaped like the mesh
    if math.prod(ranks.shape[i] for i in rep) == 1:
        return None
    # fix every non-replicated coordinate at this rank's; what varies is the replica
    index: list[Any] = [slice(None) if i in rep else c for i, c in enumerate(coord)]
    holders = tuple(int(r) for r in ranks[tuple(index)].reshape(-1).tolist())
    me = holders.index(int(ranks[tuple(coord)]))
    group = (tuple(ranks.shape), tuple(int(r) for r in ranks.reshape(-1).tolist()[:1]), rep,
             getattr(mesh, "mesh_dim_names", None))
    return Replicas(holders, me, 0, group)


@dataclass
class OwnerBalance:
    """Deals owners for one save (see the module docstring): ``deal(replicas, nbytes)`` in state order."""

    loads: dict[tuple, list[int]] = field(default_factory=dict)

    def deal(self, r: Replicas, nbytes: int) -> Replicas:
        """``r`` with its owner set: the holder with the fewest bytes of ``r.group`` so far."""
        key = (r.group, r.count)
        load = self.loads.setdefault(key, [0] * r.count)
        owner = min(range(r.count), key=lambda i: (load[i], i))
        load[owner] += nbytes
        return Replicas(r.holders, r.index, owner, r.group)


def unique_bytes(tensors: list[tuple[torch.Tensor, int]]) -> tuple[int, int]:
    """(bytes this rank holds, bytes of them it owns) for ``(tensor, nbytes of its local chunk)`` pairs in state
    order: what it stages into host memory, and what it alone would write to disk and S3."""
    bal = OwnerBalance()
    held = owned = 0
    for t, n in tensors:
        held += n
        r = replicas_of(t)
        if r is None or bal.deal(r, n).mine:
            owned += n
    return held, owned


def described(replicated: Any, rank: int, world: int) -> dict[str, Replicas]:
    """The holders of this rank's plain tensors under each top-level key of the state, as the job says them:
    ``Checkpointer(replicated={"model": group, "optim": group})``. For what no DTensor placement tells: a
    DDP model and its optimizer, a pipeline stage kept by several data-parallel replicas. A group is a
    process group, a 1-D device mesh or a sequence of global ranks, this rank among them; its ranks must
    hold the same tensors under the key, with the same bytes, in the same order (as data-parallel replicas
    do), and every one of them must describe the same group. DTensors under a described key keep what
    their placements say.

    Returns ``{escaped key: Replicas}`` (keys whose group is this rank alone are left out); raises
    ``ValueError`` saying what is wrong with a description."""
    if replicated is None:
        return {}
    if not isinstance(replicated, dict):
        raise ValueError(f"replicated must be a dict of state key -> group of ranks holding identical copies, "
                         f"got a {type(replicated).__name__}")
    out: dict[str, Replicas] = {}
    for key, group in replicated.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"replicated: {key!r} is not a top-level key of the state (a non-empty str)")
        ranks = _group_ranks(key, group)
        bad = [r for r in ranks if not 0 <= r < world]
        if bad:
            raise ValueError(f"replicated[{key!r}] names ranks {bad} outside the job's world of {world}")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"replicated[{key!r}] names a rank twice: {list(ranks)}")
        if rank not in ranks:
            raise ValueError(f"replicated[{key!r}] = {list(ranks)} does not include this rank ({rank}): give each "
                             f"rank the group of ranks that hold the same copy as it does (its data-parallel "
                             f"group)")
        holders = tuple(sorted(ranks))
        if len(holders) > 1:
            out[_seg(key)] = Replicas(holders, holders.index(rank), 0, ("described", holders))
    return out


def _group_ranks(key: str, group: Any) -> tuple[int, ...]:
    """The global ranks of a process group, a 1-D device mesh, or a sequence of ranks."""
    mesh = getattr(group, "mesh", None)
    if isinstance(mesh, torch.Tensor):  # a DeviceMesh
        if mesh.dim() != 1:
            names = getattr(group, "mesh_dim_names", None)
            raise ValueError(f"replicated[{key!r}] is a {mesh.dim()}-D device mesh{f' {names}' if names else ''}: "
                             f"give the 1-D mesh of the replicas (e.g. mesh['dp'])")
        return tuple(int(r) for r in mesh.tolist())
    if isinstance(group, (list, tuple, range)):
        if not all(isinstance(r, int) and not isinstance(r, bool) for r in group):
            raise ValueError(f"replicated[{key!r}] must hold global ranks (ints), got {list(group)!r}")
        return tuple(group)
    import torch.distributed as dist

    if dist.is_available() and isinstance(group, dist.ProcessGroup):
        return tuple(int(r) for r in dist.get_process_group_ranks(group))
    raise ValueError(f"replicated[{key!r}] is a {type(group).__name__}: give a process group, a 1-D device mesh or "
                     f"a list of global ranks")
