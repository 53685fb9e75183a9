"""Peer copies that count the job's own data-parallel replicas, and what failures memory restore then survives.

A job's ranks form a mesh: ordered dims with sizes (``dp_replicate=2,
dp_shard=4, tp=2``), ranks laid out row-major over it (the rank is the
row-major index of its coordinates, the last dim varying fastest: DeviceMesh's
default), ``G`` ranks per node (the node of a rank is ``rank // G``). Some
dims are *replicate* dims: ranks that differ only along them hold identical
state (HSDP's ``dp_replicate``; plain DDP's ``dp``). A *piece* is a position
on the other dims; the ranks at that position (every replicate coordinate)
hold the same shard, and the distinct nodes they run on are the piece's
*model holders*. Every model holder stages its own copy in its node's memory,
so those nodes already hold the piece, with no network traffic.

The peer-copy policy the agents follow (:func:`shard_copies`, which the
agents call for every shard), with ``k`` (``replicas``) the copies wanted of
each piece on distinct nodes, the model holders' own included:

1. A piece whose model holders already number at least ``k`` distinct nodes
   gets no peer copy.
2. Otherwise only its *lead* holder, the lowest-numbered node among its model
   holders, copies the shard (of the piece's lowest rank on that node) to
   peers: to the first nodes of the lead's usual placement targets
   (:func:`agents.placement.replica_targets`, in that order, failure domains
   respected as there) that are not model holders already, until the piece is
   on ``k`` distinct nodes.
3. When the targets run out first (only when ``k`` exceeds the node count)
   the piece stays short; :attr:`PieceCopies.short_by` says by how many.
4. What a rank holds that no other rank does (its *unique part*: a plain
   tensor such as an optimizer's step count, its values) is no piece: every
   rank's goes to its node's ``k - 1`` placement targets, inside the whole
   shard or alone (``ShardInfo.unique``, a few kB), so it is held on the
   node's usual placement nodes (:attr:`CopyPlan.unique_holders`).

Every agent computes this alone from the mesh, ``G``, the peer list, ``k``
and the placement: every function here is pure (no I/O, no clock, no global
state). Today's behaviour, against which :class:`CopyPlan` compares, copies
every rank's shard to the node's ``k - 1`` placement targets regardless.

Survival: a memory restore loses a piece when every node holding it (model
holders and peer-copy targets) fails, and loses a rank's unique part when
every node of its node's placement fails. So a failure set loses something
exactly when it contains one of these holder sets, and the smallest losing
set is the smallest holder set: every ``F`` simultaneous failures are
survived iff ``F`` is below the fewest holders any of them has
(:func:`max_failures_survived`).
:func:`piece_survival_probability` gives the odds for ``F`` uniformly random
failures, exactly where it can and by a seeded Monte Carlo estimate where not.
"""

from __future__ import annotations

import itertools
import math
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from . import placement as _placement
from .placement import NodesOrCount, SurvivalResult

__all__ = [
    "CopyPlan",
    "Mesh",
    "MeshError",
    "PieceCopies",
    "max_failures_survived",
    "parse_mesh",
    "shard_copies",
    "weakest",
    "piece_label",
    "piece_losing_failure",
    "piece_survival_probability",
    "pieces_survive",
    "plan_copies",
]

#: a piece: its coordinate on each non-replicate dim, as (dim name, index) pairs in mesh order
Piece = tuple[tuple[str, int], ...]

_DIM = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


class MeshError(ValueError):
    """A mesh description cannot be used; the message says what is wrong and how to write it."""


def parse_mesh(spec: str) -> tuple[tuple[str, int], ...]:
    """Parse ``"dp_replicate=2,dp_shard=4,tp=2"`` into ``(("dp_replicate", 2), ("dp_shard", 4), ("tp", 2))``.

    Dims are comma-separated ``NAME=SIZE`` in mesh order (outermost first);
    blanks around them are ignored. Raises :class:`MeshError` (a
    ``ValueError``) for an empty spec, an entry without ``=``, a name that is
    not an identifier, a size that is not a whole number of at least 1, or a
    name given twice.
    """
    dims: list[tuple[str, int]] = []
    entries = [e.strip() for e in spec.split(",")]
    if not any(entries):
        raise MeshError("the mesh names no dim; write NAME=SIZE,..., e.g. dp_replicate=2,dp_shard=4,tp=2")
    for entry in entries:
        name, eq, size = (s.strip() for s in entry.partition("="))
        if not entry:
            raise MeshError(f"empty dim in mesh {spec!r}; remove the extra comma")
        if not eq:
            raise MeshError(f"mesh dim {entry!r} has no size; write NAME=SIZE, e.g. tp=2")
        if not size.isdigit() or int(size) < 1:
            raise MeshError(f"mesh dim {name!r} has size {size!r}; a size is a whole number of at least 1")
        dims.append((name, int(size)))
    Mesh(tuple(dims), frozenset(), 1)  # names checked in one place
    return tuple(dims)


@dataclass(frozen=True)
class Mesh:
    """A job's device mesh as the placement sees it.

    ``dims``: ``(name, size)`` pairs in mesh order, outermost first; ranks are
    laid out row-major (rank = row-major index of the coordinates).
    ``replicate``: the names of the dims along which ranks hold identical
    state. ``ranks_per_node``: trainer ranks per node ``G``; rank ``r`` runs
    on node ``r // G``.

    Raises :class:`MeshError` (a ``ValueError``) for no dims, a dim name that
    is not an identifier or is given twice, a size below 1, a replicate name
    that is not a dim, ``ranks_per_node`` below 1, or a world size (product of
    the sizes) that is not a multiple of ``ranks_per_node``.
    """

    dims: tuple[tuple[str, int], ...]
    replicate: frozenset[str] = field(default_factory=frozenset)
    ranks_per_node: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "dims", tuple((str(n), int(s)) for n, s in self.dims))
        object.__setattr__(self, "replicate", frozenset(self.replicate))
        if not self.dims:
            raise MeshError("the mesh names no dim; give at least one NAME=SIZE")
        names = [n for n, _ in self.dims]
        for name, size in self.dims:
            if not _DIM.match(name):
                raise MeshError(f"mesh dim name {name!r} is not an identifier; "
                                "use letters, digits and _, e.g. dp_shard")
            if size < 1:
                raise MeshError(f"mesh dim {name!r} has size {size}; a size is at least 1")
            if names.count(name) > 1:
                raise MeshError(f"mesh dim {name!r} is given twice; name each dim once")
        unknown = sorted(self.replicate - set(names))
        if unknown:
            raise MeshError(f"replicate dim{'s' * (len(unknown) > 1)} {', '.join(unknown)} not in the mesh "
                            f"({', '.join(names)}); name dims of the mesh")
        if self.ranks_per_node < 1:
            raise MeshError(f"ranks per node must be at least 1, got {self.ranks_per_node}")
        if self.world % self.ranks_per_node:
            raise MeshError(f"the mesh has {self.world} ranks, not a multiple of {self.ranks_per_node} ranks per "
                            "node; every node runs the same number of ranks")

    @property
    def world(self) -> int:
        """Number of ranks: the product of the dim sizes."""
        return math.prod(s for _, s in self.dims)

    @property
    def nodes(self) -> int:
        """Number of nodes: ``world // ranks_per_node``."""
        return self.world // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        """The node rank ``rank`` runs on. Raises ``ValueError`` for a rank outside ``0..world-1``."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is not in the mesh (ranks 0..{self.world - 1})")
        return rank // self.ranks_per_node

    def coords(self, rank: int) -> tuple[int, ...]:
        """``rank``'s coordinate on every dim, in mesh order. Raises ``ValueError`` as :meth:`node_of`."""
        self.node_of(rank)
        out = []
        for _, size in reversed(self.dims):
            rank, c = divmod(rank, size)
            out.append(c)
        return tuple(reversed(out))

    def piece_of(self, rank: int) -> Piece:
        """The piece ``rank`` holds: its coordinates on the non-replicate dims."""
        return tuple((n, c) for (n, _), c in zip(self.dims, self.coords(rank)) if n not in self.replicate)

    def pieces(self) -> dict[Piece, tuple[int, ...]]:
        """Every piece and the ranks holding it (ascending), pieces in row-major order of their coordinates."""
        out: dict[Piece, list[int]] = {}
        for rank in range(self.world):
            out.setdefault(self.piece_of(rank), []).append(rank)
        return {p: tuple(r) for p, r in sorted(out.items(), key=lambda kv: [c for _, c in kv[0]])}


def piece_label(piece: Piece) -> str:
    """A piece as ``dp_shard=0,tp=1``; ``(all)`` when every dim is a replicate dim (one piece)."""
    return ",".join(f"{n}={c}" for n, c in piece) or "(all)"


@dataclass(frozen=True)
class PieceCopies:
    """Where one piece lives: in the model's replicas and in peer copies.

    ``ranks``: the ranks holding the piece; ``model_holders``: their distinct
    nodes, ascending; ``source_rank``: the rank whose shard the lead holder
    copies (the piece's lowest rank on the lead node), None when no copy is
    made; ``targets``: the nodes that receive a peer copy, in the order they
    are chosen; ``short_by``: how many nodes short of the requested copies the
    piece stays because the lead ran out of placement targets (0 normally).
    """

    piece: Piece
    ranks: tuple[int, ...]
    model_holders: tuple[int, ...]
    source_rank: int | None
    targets: tuple[int, ...]
    short_by: int

    @property
    def lead(self) -> int:
        """The lowest-numbered model holder: the only node that sends the piece to peers."""
        return self.model_holders[0]

    @property
    def holders(self) -> frozenset[int]:
        """Every node holding the piece in memory: model holders and peer-copy targets."""
        return frozenset(self.model_holders) | frozenset(self.targets)


@dataclass(frozen=True)
class CopyPlan:
    """The peer copies the agents make for one mesh, and today's for comparison.

    ``pieces``: one :class:`PieceCopies` per piece, in :meth:`Mesh.pieces`
    order. ``sends``: per node, the shard copies it sends to peers per save
    (every node listed, zeros included). ``baseline_sends``: the same today,
    when every rank's shard goes to its node's ``k - 1`` placement targets
    (``G * min(k - 1, N - 1)`` per node). Counts are shard copies; a node's
    bytes sent to peers are the sum of those shards' sizes.
    """

    mesh: Mesh
    replicas: int
    placement: str
    nodes: int
    pieces: tuple[PieceCopies, ...]
    sends: Mapping[int, int]
    baseline_sends: Mapping[int, int]
    #: per node, the nodes holding its ranks' unique parts: the node and its placement targets (rule 4)
    unique_holders: Mapping[int, frozenset[int]] = field(default_factory=dict)

    def holder_sets(self) -> list[tuple[str, frozenset[int]]]:
        """What a memory restore needs, each with the nodes holding it: every piece, then every node's ranks'
        unique parts (``(label, nodes)``)."""
        return ([(f"piece {piece_label(pc.piece)}", pc.holders) for pc in self.pieces]
                + [(f"the unique parts of node {n}'s ranks", h) for n, h in self.unique_holders.items()])

    @property
    def peer_copies(self) -> int:
        """Shard copies sent to peers per save, over all nodes."""
        return sum(self.sends.values())

    @property
    def baseline_copies(self) -> int:
        """Shard copies sent to peers per save today (every rank's shard to ``k - 1`` peers)."""
        return sum(self.baseline_sends.values())

    @property
    def copy_fraction(self) -> float:
        """``peer_copies / baseline_copies``: the share of today's peer traffic, when shards are equal-sized.

        1.0 when today sends nothing either (``k = 1`` or one node).
        """
        return self.peer_copies / self.baseline_copies if self.baseline_copies else 1.0

    def bytes_fraction(self, shard_bytes: Mapping[Piece, int]) -> float:
        """Bytes sent to peers per save as a share of today's, given each piece's shard size in bytes.

        Today every rank sends its shard (its piece's size) to its node's
        targets; the plan sends one shard per peer-copy target. Returns 1.0
        when today sends nothing. Raises ``KeyError`` naming a piece missing
        from ``shard_bytes``.
        """
        per_rank_today = self.baseline_sends[0] // self.mesh.ranks_per_node if self.baseline_sends else 0
        now = today = 0
        for pc in self.pieces:
            if pc.piece not in shard_bytes:
                raise KeyError(f"no shard size for piece {piece_label(pc.piece)}")
            size = shard_bytes[pc.piece]
            now += size * len(pc.targets)
            today += size * len(pc.ranks) * per_rank_today
        return now / today if today else 1.0


def plan_copies(mesh: Mesh, nodes: NodesOrCount, replicas: int, placement: str = "group") -> CopyPlan:
    """The peer copies every piece of ``mesh`` gets under the policy in this module's docstring.

    ``nodes`` is the peer list (domains matter) or a node count; it must
    equal ``mesh.nodes``. ``replicas`` (``k``) is the number of distinct
    nodes each piece should be on, model holders included.

    Raises ``ValueError`` when the node count is not ``mesh.nodes``, and the
    errors of :func:`agents.placement.replica_targets` (``replicas < 1``, an
    unknown placement, ranks given twice).
    """
    layout = _placement.holders(nodes, replicas, placement)
    n = len(layout)
    if sorted(layout) != list(range(n)):
        raise ValueError(f"node ranks must be 0..{n - 1}, got {sorted(layout)}")
    if n != mesh.nodes:
        raise ValueError(f"the mesh has {mesh.world} ranks at {mesh.ranks_per_node} per node, so "
                         f"{mesh.nodes} node{'s' * (mesh.nodes != 1)}, not {n}; the node count times the ranks "
                         "per node must equal the mesh's rank count")
    sends = dict.fromkeys(range(n), 0)
    out = []
    for piece, ranks in mesh.pieces().items():
        model = tuple(sorted({mesh.node_of(r) for r in ranks}))
        want = replicas - len(model)
        targets: list[int] = []
        if want > 0:
            lead = model[0]
            targets = [t for t in layout[lead][1:] if t not in model][:want]
            sends[lead] += len(targets)
        source = next(r for r in ranks if mesh.node_of(r) == model[0]) if targets else None
        out.append(PieceCopies(piece, ranks, model, source, tuple(targets), max(0, want - len(targets))))
    per_node_today = mesh.ranks_per_node * (len(layout[0]) - 1)
    return CopyPlan(mesh, replicas, placement, n, tuple(out), sends, dict.fromkeys(range(n), per_node_today),
                    {r: frozenset(layout[r]) for r in range(n)})


def shard_copies(rank: int, groups: Sequence[Sequence[int]], node_of: Mapping[int, int], targets: Sequence[int],
                 replicas: int) -> dict[int, bool]:
    """What the node of ``rank`` sends each of its placement ``targets`` (in placement order) of the rank's
    shard: True for the whole shard, False for its unique part alone (the policy in the module docstring).

    ``groups``: the holder groups of the shard's replicated chunks (``ShardInfo.unique``: global ranks, this
    one among them), empty when it has none; ``node_of``: rank → node, for every rank of the groups (a rank
    missing makes every copy whole); ``replicas``: the copies wanted on distinct nodes.

    * every group on ``replicas`` distinct nodes or more: the unique part to every target;
    * one group on fewer: its lead rank (the lowest of the group on the group's lowest node) sends the whole
      shard to the first targets that hold no replica, as many as are missing, and the unique part to the
      others; every other rank of the group sends the unique part;
    * several groups, one on fewer nodes: the whole shard to every target (as with no groups).
    """
    whole = dict.fromkeys(targets, True)
    if not groups or any(r not in node_of for g in groups for r in g):
        return whole
    spans = [{node_of[r] for r in g} for g in groups]
    if all(len(nodes) >= replicas for nodes in spans):
        return dict.fromkeys(targets, False)
    if len(groups) > 1:
        return whole
    nodes = spans[0]
    lead_node = min(nodes)
    lead = min(r for r in groups[0] if node_of[r] == lead_node)
    out = dict.fromkeys(targets, False)
    if rank == lead:
        for t in [t for t in targets if t not in nodes][:replicas - len(nodes)]:
            out[t] = True
    return out


# -- survival ------------------------------------------------------------------------------

def _check_failures(plan: CopyPlan, failures: int) -> None:
    if not 0 <= failures <= plan.nodes:
        raise ValueError(f"failures must be from 0 to the node count {plan.nodes}, got {failures}")


def pieces_survive(plan: CopyPlan, failed: Iterable[int]) -> bool:
    """True iff every piece and unique part still has a node holding it after the nodes ``failed`` (node
    ranks) fail.

    Raises ``ValueError`` for a failed rank that is not a node.
    """
    failed = set(failed)
    unknown = sorted(r for r in failed if not 0 <= r < plan.nodes)
    if unknown:
        raise ValueError(f"failed ranks {unknown} are not nodes (ranks 0..{plan.nodes - 1})")
    return not any(h <= failed for _, h in plan.holder_sets())


def weakest(plan: CopyPlan) -> tuple[str, frozenset[int]]:
    """What has the fewest holders, and its holders: the first such piece in piece order, else the first
    node's unique parts."""
    return min(plan.holder_sets(), key=lambda x: len(x[1]))


def max_failures_survived(plan: CopyPlan) -> int:
    """The largest ``F`` such that every set of ``F`` simultaneous node failures leaves a holder of each piece.

    A failure set loses a piece only by containing all of that piece's
    holders, so the smallest losing set is the smallest holder set: the
    answer is the fewest holders any piece has, minus one (0 when some piece
    is on one node only).
    """
    return len(weakest(plan)[1]) - 1


def piece_losing_failure(plan: CopyPlan, failures: int) -> set[int] | None:
    """One set of ``failures`` node ranks whose loss leaves some piece with no holder, or None if none exists.

    Deterministic: the holders of the piece with the fewest (first in piece
    order), topped up with the lowest other node ranks. Raises ``ValueError``
    for ``failures`` outside ``0..N``.
    """
    _check_failures(plan, failures)
    core = weakest(plan)[1]
    if len(core) > failures:
        return None
    out = set(core)
    out.update(itertools.islice((r for r in range(plan.nodes) if r not in out), failures - len(out)))
    return out


def _minimal_sets(plan: CopyPlan) -> list[int]:
    """The distinct holder sets as bit masks over node ranks, dropping any that contains another.

    A failure set that contains a larger holder set also contains the smaller
    one, so only the minimal sets decide what is lost.
    """
    masks = sorted({sum(1 << r for r in h) for _, h in plan.holder_sets()}, key=lambda m: m.bit_count())
    out: list[int] = []
    for m in masks:
        if not any(o & m == o for o in out):
            out.append(m)
    return out


def _components(masks: list[int]) -> list[list[int]]:
    """The masks grouped into classes that share nodes (transitively): each class fails independently."""
    groups: list[tuple[int, list[int]]] = []
    for m in masks:
        joined, members = m, [m]
        rest = []
        for union, ms in groups:
            if union & joined:
                joined |= union
                members += ms
            else:
                rest.append((union, ms))
        groups = rest + [(joined, members)]
    return [ms for _, ms in groups]


def _surviving_poly(masks: list[int], fmax: int, budget: int) -> tuple[list[int] | None, int]:
    """``out[j]``: ``j``-subsets of the masks' nodes that contain no mask, for ``j <= fmax``, and the work spent.

    The polynomial is None when the work would pass ``budget``.

    Inclusion–exclusion over the masks, merging terms with the same union:
    sum over subfamilies T of (-1)^|T| C(c - |∪T|, j - |∪T|). Unions of more
    than ``fmax`` nodes contribute nothing to ``j <= fmax`` and are dropped.
    The work is the number of terms visited, over all masks.
    """
    nodes = 0
    for m in masks:
        nodes |= m
    c = nodes.bit_count()
    terms: dict[int, int] = {0: 1}
    work = 0
    for m in masks:
        work += len(terms)
        if work > budget:
            return None, work
        new = dict(terms)
        for union, coef in terms.items():
            u = union | m
            if u.bit_count() <= fmax:
                new[u] = new.get(u, 0) - coef
        terms = {u: v for u, v in new.items() if v}
    top = min(fmax, c)
    out = [0] * (top + 1)
    for union, coef in terms.items():
        size = union.bit_count()
        for j in range(size, top + 1):
            out[j] += coef * math.comb(c - size, j - size)
    return out, work


def piece_survival_probability(plan: CopyPlan, failures: int, *, samples: int | None = None,
                               seed: int | None = None) -> SurvivalResult:
    """The probability that ``failures`` nodes failing at once, chosen uniformly at random, lose no piece.

    "Lose no piece" means every piece still has a live node holding it, a
    model replica or a peer copy, so a restore can come from memory alone.

    How (``method`` in the result says which):

    * exactly, by inclusion–exclusion over the pieces' holder sets (only the
      minimal distinct ones; groups of sets that share no node counted
      apart and combined), while the terms stay within
      ``agents.placement.MAX_ENUMERATED``;
    * else exactly, by enumerating all C(N, F) failure sets when there are at
      most ``MAX_ENUMERATED``;
    * else a Monte Carlo estimate from ``samples`` failure sets (default
      ``agents.placement.MONTE_CARLO_SAMPLES``) drawn with
      ``random.Random(seed)`` (default ``MONTE_CARLO_SEED``); ``exact`` is
      False and the standard error at most 0.5 / sqrt(samples).

    ``all_survive`` is always exact (:func:`max_failures_survived`). Raises
    ``ValueError`` for ``failures`` outside ``0..N`` or ``samples < 1``.
    """
    _check_failures(plan, failures)
    samples = _placement.MONTE_CARLO_SAMPLES if samples is None else samples
    seed = _placement.MONTE_CARLO_SEED if seed is None else seed
    if samples < 1:
        raise ValueError(f"samples must be at least 1, got {samples}")
    if failures <= max_failures_survived(plan):
        return SurvivalResult(1.0, True, "exact: fewer failures than holders of any piece", True)
    n = plan.nodes
    total = math.comb(n, failures)
    masks = _minimal_sets(plan)
    limit = _placement.MAX_ENUMERATED

    poly: list[int] | None = [1]
    covered = 0
    budget = limit
    for comp in _components(masks):
        part, work = _surviving_poly(comp, failures, budget)
        budget -= work
        if part is None:
            poly = None
            break
        poly = _placement._poly_mul(poly, part, failures)
        for m in comp:
            covered |= m
    if poly is not None:
        # nodes holding no piece's minimal holder set fail freely
        free = [math.comb(n - covered.bit_count(), j) for j in range(failures + 1)]
        poly = _placement._poly_mul(poly, free, failures)
        alive = poly[failures] if failures < len(poly) else 0
        return SurvivalResult(alive / total, True, "exact: inclusion-exclusion over the pieces' holder sets", False)

    # a set is lost only if its lowest node failed: look only at the sets of failed nodes
    by_lowest: dict[int, list[int]] = {}
    for m in masks:
        by_lowest.setdefault((m & -m).bit_length() - 1, []).append(m)

    def lost(failed: Sequence[int]) -> bool:
        mask = 0
        for i in failed:
            mask |= 1 << i
        return any(m & ~mask == 0 for i in failed for m in by_lowest.get(i, ()))

    if total <= limit:
        alive = sum(1 for c in itertools.combinations(range(n), failures) if not lost(c))
        return SurvivalResult(alive / total, True, f"exact: enumerated all {total} failure sets", False)
    rng = random.Random(seed)
    alive = sum(1 for _ in range(samples) if not lost(rng.sample(range(n), failures)))
    return SurvivalResult(alive / samples, False, f"Monte Carlo, {samples} samples (seed {seed})", False)
