"""Replica placement: which peers hold copies of a node's checkpoint, and what failures that survives.

Every node's agent computes the same answer from the same peer list: every
function here is pure (no I/O, no clock, no global state), so nothing has to
be agreed over the network.

Replication factor ``k`` (``replicas``) counts every copy, the node's own
included: ``k = 2`` means the primary copy plus one peer.

Two placements:

``group`` (GEMINI, SOSP'23)
    The nodes are cut into groups of ``k``; each node replicates to the other
    members of its group. A memory restore then survives any failure that
    leaves at least one node of every group alive. When ``N`` is not a
    multiple of ``k``, GEMINI's mixed strategy: the first ``N // k - 1`` groups
    of ``k`` use group placement and the last ``k + N % k`` nodes form a ring
    in which each node replicates to the ``k - 1`` that follow it (see
    :func:`replica_targets`).
``ring``
    Node ``i`` replicates to ``i + 1, ..., i + k - 1`` (mod ``N``).

Failure domains (a rack label on each node, see :func:`parse_peers`): the
nodes are first interleaved by domain, so that consecutive nodes sit in
different domains wherever the labels allow, and the placement above runs
over that order; groups stay groups, only their members change. Where a copy
would still share a domain with the primary or another copy, it is moved to
the nearest node whose domain is not used yet, if there is one. Copies never
share a failure domain when another choice exists.

:func:`survival_probability` says how likely a memory restore is to survive
``F`` simultaneous node failures chosen uniformly at random, exactly where it
can and by a seeded Monte Carlo estimate where it cannot.
"""

from __future__ import annotations

import ipaddress
import itertools
import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "PLACEMENTS",
    "ROLES",
    "Node",
    "PeerListError",
    "SurvivalResult",
    "holders",
    "losing_failure",
    "parse_peers",
    "placement_order",
    "replica_targets",
    "survival_probability",
    "survives",
    "survives_all",
]

#: the placement names :func:`replica_targets` accepts
PLACEMENTS = ("group", "ring")
#: what a node is for: training (its ranks' shards have their primary copy there), memory only, or nothing any
#: more (retired: it left the cluster, and its line stays so that the other nodes keep their ranks)
ROLES = ("train", "memory", "retired")

#: at most this many failure sets are enumerated for an exact answer; beyond it, Monte Carlo
MAX_ENUMERATED = 2_000_000
#: failure sets drawn by the Monte Carlo estimate
MONTE_CARLO_SAMPLES = 100_000
#: seed of the Monte Carlo estimate, so the same question always gets the same answer
MONTE_CARLO_SEED = 0


@dataclass(frozen=True)
class Node:
    """One node's agent as listed in the peer list.

    ``rank`` is the node rank (0-based position in the peer list), ``addr`` the
    agent's ``host:port`` (``[v6addr]:port`` for IPv6; empty when only the
    rank matters, as in planning), ``domain`` its failure-domain label (a rack,
    a power feed) or None when it has none.
    """

    rank: int
    addr: str = ""
    domain: str | None = None
    #: "train" (the default), or "memory": a node that trains nothing and offers its host memory as replica
    #: targets (see :func:`replica_targets`)
    role: str = "train"

    @property
    def host(self) -> str:
        """The host part of ``addr``, without IPv6 brackets."""
        host = self.addr.rpartition(":")[0]
        return host[1:-1] if host.startswith("[") else host

    @property
    def port(self) -> int:
        """The TCP port of ``addr``."""
        return int(self.addr.rpartition(":")[2])


class PeerListError(ValueError):
    """A peer list (file or ``CKPT_PEERS``) is malformed; the message names the line and the fix."""


@dataclass(frozen=True)
class SurvivalResult:
    """How likely a memory restore is to survive some number of random simultaneous node failures.

    ``probability`` is the chance (0..1) that every node's checkpoint still has
    a live copy in some node's memory; ``exact`` whether it was computed exactly
    rather than estimated; ``method`` how, in words (``"exact: ..."`` or
    ``"Monte Carlo, N samples (seed S)"``); ``all_survive`` whether *every*
    choice of that many failed nodes leaves a live copy (always exact).
    """

    probability: float
    exact: bool
    method: str
    all_survive: bool


# -- the peer list -------------------------------------------------------------------------

_HOST = re.compile(r"[A-Za-z0-9_.-]+\Z")


def _parse_addr(addr: str, where: str) -> tuple[str, tuple[str, int]]:
    """Check one ``host:port``; return it as written (port normalised) and a key for duplicates."""
    host, sep, port_s = addr.rpartition(":")
    if not sep:
        raise PeerListError(f"{where}: {addr!r} has no port; write host:port, e.g. node1:9000")
    if host.startswith("[") or host.endswith("]"):
        if not (host.startswith("[") and host.endswith("]")):
            raise PeerListError(f"{where}: unbalanced brackets in {addr!r}; write IPv6 as [::1]:9000")
        try:
            ip = ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise PeerListError(f"{where}: {host} is not an IPv6 address; write IPv6 as [::1]:9000") from None
        key_host = str(ip)
    elif ":" in host:
        raise PeerListError(f"{where}: {addr!r} looks like a bare IPv6 address; put it in brackets, e.g. [::1]:9000")
    elif not host:
        raise PeerListError(f"{where}: {addr!r} has no host; write host:port, e.g. node1:9000")
    elif not _HOST.match(host):
        raise PeerListError(f"{where}: host {host!r} has characters a host name cannot have; write host:port")
    else:
        key_host = host.lower()
    if not port_s.isdigit() or not 1 <= int(port_s) <= 65535:
        raise PeerListError(f"{where}: port {port_s!r} in {addr!r} is not a number from 1 to 65535")
    port = int(port_s)
    return f"{host}:{port}", (key_host, port)


def parse_peers(text: str) -> list[Node]:
    """Parse a peer list into nodes, ranked in the order listed.

    A peers file has one agent per line, in node-rank order::

        # rack A
        10.0.0.1:7070  domain=rackA
        node2.cluster:7070 domain=rackA
        [fd00::3]:7070 domain=rackB

    Each entry is ``host:port`` (IPv6 in brackets) optionally followed by
    ``domain=LABEL``; blank lines and ``#`` comments are ignored. Entries may
    also be separated by commas, which gives the single-line form used by the
    ``CKPT_PEERS`` variable (``a:7070 domain=r1,b:7070 domain=r2``).

    Raises :class:`PeerListError` (a ``ValueError``) naming the line (and the
    entry, on a line with several) for: a missing or malformed host, a port
    outside 1..65535, an unknown or repeated field, an address listed twice, or
    a list with no entries at all.
    """
    nodes: list[Node] = []
    seen: dict[tuple[str, int], str] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0]
        entries = line.split(",")
        for entno, entry in enumerate(entries, 1):
            where = f"line {lineno}" + (f", entry {entno}" if len(entries) > 1 else "")
            words = entry.split()
            if not words:
                if len(entries) > 1:
                    raise PeerListError(f"{where}: empty entry between commas; remove the extra comma")
                continue
            if "=" in words[0]:
                raise PeerListError(f"{where}: starts with {words[0]!r}; put host:port first, then domain=LABEL")
            addr, key = _parse_addr(words[0], where)
            domain = None
            role = None
            for word in words[1:]:
                name, eq, value = word.partition("=")
                if not eq or name not in ("domain", "role"):
                    raise PeerListError(f"{where}: unknown field {word!r}; only domain=LABEL and role=train|memory|retired "
                                        "may follow host:port")
                if name == "role":
                    if role is not None:
                        raise PeerListError(f"{where}: role given twice; give one role=train|memory|retired per agent")
                    if value not in ROLES:
                        raise PeerListError(f"{where}: role {value!r} is not train, memory or retired")
                    role = value
                    continue
                if domain is not None:
                    raise PeerListError(f"{where}: domain given twice; give one domain=LABEL per agent")
                if not value:
                    raise PeerListError(f"{where}: empty domain; write domain=LABEL, e.g. domain=rack1")
                domain = value
            if key in seen:
                raise PeerListError(f"{where}: {addr} is already listed on {seen[key]}; list each agent once")
            seen[key] = where
            nodes.append(Node(len(nodes), addr, domain, role or "train"))
    if not nodes:
        raise PeerListError("line 1: the peer list names no agent; write one host:port per line")
    return nodes


# -- placement -----------------------------------------------------------------------------

NodesOrCount = int | Sequence[Node]


def _as_nodes(n: NodesOrCount) -> list[Node]:
    if isinstance(n, int):
        if n < 1:
            raise ValueError(f"need at least one node, got {n}")
        return [Node(i) for i in range(n)]
    nodes = sorted(n, key=lambda x: x.rank)
    if not nodes:
        raise ValueError("need at least one node, got an empty list")
    if len({x.rank for x in nodes}) != len(nodes):
        raise ValueError("two nodes share a rank; every node needs its own rank")
    return nodes


def _check(replicas: int, placement: str) -> None:
    if replicas < 1:
        raise ValueError(f"replicas must be at least 1 (the node's own copy), got {replicas}")
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r}; use one of {', '.join(PLACEMENTS)}")


def _domain(node: Node) -> object:
    # a node without a label is a failure domain of its own
    return node.domain if node.domain is not None else ("no domain", node.rank)


def placement_order(nodes: Sequence[Node]) -> list[int]:
    """The node ranks in the order the placement walks them: interleaved by failure domain.

    Domains are taken in the order they first appear (by rank); the order is
    the first node of each domain, then the second of each, and so on, so
    consecutive nodes sit in different domains wherever the labels allow. A
    node without a domain is a domain of its own, so with no labels at all
    this is plain rank order.
    """
    by_domain: dict[object, list[int]] = {}
    for node in _as_nodes(nodes):
        by_domain.setdefault(_domain(node), []).append(node.rank)
    columns = list(by_domain.values())
    return [col[i] for i in range(max(map(len, columns))) for col in columns if i < len(col)]


def _base_targets(n: int, k: int, pos: int, placement: str) -> list[int]:
    """Positions (in placement order) that hold copies of position ``pos``'s data, before domains."""
    k = min(k, n)
    if placement == "ring":
        return [(pos + d) % n for d in range(1, k)]
    full = (n // k - (1 if n % k else 0)) * k  # positions [0, full) are whole groups
    start, size = (pos - pos % k, k) if pos < full else (full, n - full)
    return [start + (pos - start + d) % size for d in range(1, k)]


def _layout(nodes: NodesOrCount, replicas: int, placement: str) -> tuple[dict[int, list[int]], bool]:
    """Every node's targets, and whether the domain pass moved any copy off the base placement."""
    _check(replicas, placement)
    everyone = _as_nodes(nodes)
    pool = [x for x in everyone if x.role == "memory"]
    if pool:
        return _pool_layout([x for x in everyone if x.role != "memory"], pool, replicas, placement)
    ranked = {x.rank: x for x in everyone}
    order = placement_order(list(ranked.values()))
    n = len(order)
    domains = {_domain(x) for x in ranked.values()}
    moved = False
    out: dict[int, list[int]] = {}
    for pos, me in enumerate(order):
        base = [order[p] for p in _base_targets(n, replicas, pos, placement)]
        used = {_domain(ranked[me])}
        slots: list[int | None] = []
        for t in base:
            if _domain(ranked[t]) in used:
                slots.append(None)
            else:
                slots.append(t)
                used.add(_domain(ranked[t]))
        for i, slot in enumerate(slots):
            if slot is not None:
                continue
            chosen = {me, *(s for s in slots if s is not None)}
            nearest = None if domains <= used else next(
                (order[(pos + d) % n] for d in range(1, n)
                 if order[(pos + d) % n] not in chosen and _domain(ranked[order[(pos + d) % n]]) not in used), None)
            if nearest is None:
                # every domain already holds a copy: keep the base target so k copies still exist
                slots[i] = base[i]
            else:
                slots[i] = nearest
                used.add(_domain(ranked[nearest]))
                moved = True
        out[me] = [s for s in slots if s is not None]
    return {r: out[r] for r in sorted(out)}, moved


def _pool_layout(trainers: list[Node], pool: list[Node], replicas: int,
                 placement: str) -> tuple[dict[int, list[int]], bool]:
    """Targets when some nodes are memory-only: each training node's copies go to the pool first, spread
    round-robin over it (the ``i``-th training node in placement order starts at pool node ``i * (k-1)``),
    a node in a domain no copy uses yet before one in a used domain; what the pool cannot give (fewer pool
    nodes than ``k - 1``) comes from the trainers' own placement. A memory node holds nothing of its own."""
    out: dict[int, list[int]] = {x.rank: [] for x in pool}
    moved = False
    if not trainers:
        return {r: out[r] for r in sorted(out)}, moved
    ranked = {x.rank: x for x in trainers + pool}
    order = placement_order(trainers)
    porder = placement_order(pool)
    own, moved = _layout(trainers, replicas, placement) if len(trainers) > 1 else ({order[0]: []}, False)
    want = replicas - 1
    for pos, me in enumerate(order):
        used = {_domain(ranked[me])}
        start = (pos * max(1, want)) % len(porder)
        ring = porder[start:] + porder[:start]
        picked: list[int] = []
        for prefer_new_domain in (True, False):
            for r in ring:
                if len(picked) == min(want, len(porder)):
                    break
                if r in picked or (prefer_new_domain and _domain(ranked[r]) in used):
                    continue
                picked.append(r)
                used.add(_domain(ranked[r]))
        picked += [t for t in own[me] if t not in picked][:want - len(picked)]
        out[me] = picked
    return {r: out[r] for r in sorted(out)}, moved


def replica_targets(nodes: Sequence[Node], me: int, replicas: int, placement: str = "group") -> list[int]:
    """The ranks of the nodes that hold copies of the shards whose primary copy is on node ``me``.

    Returns ``replicas - 1`` distinct ranks, never ``me`` (fewer only when
    there are fewer other nodes). The result depends only on the peer list
    (ranks and domains), ``replicas`` and ``placement``, so every node computes
    the same placement.

    ``group`` follows GEMINI (SOSP'23): in placement order (see
    :func:`placement_order`; rank order without domains) the nodes are cut into
    groups of ``k = replicas`` consecutive nodes and each replicates to the
    rest of its group. When ``N`` is not a multiple of ``k`` this is GEMINI's
    mixed strategy: the first ``N // k - 1`` groups are groups, and the last
    ``k + N % k`` nodes form a ring in which each replicates to the ``k - 1``
    nodes after it (wrapping inside that ring). Ring placement inside the last
    block keeps every node at exactly ``k`` copies, where one larger group
    would give its members more, and the ring never has fewer than ``k``
    nodes. Example, ``N = 5, k = 2``: 0↔1 form a group; 2→3, 3→4, 4→2. With
    ``N < k`` all nodes form one group.

    ``ring``: node ``i`` replicates to the ``k - 1`` nodes after it in
    placement order, wrapping around.

    Failure domains: a copy that would share a domain with ``me`` or with
    another copy moves to the nearest node after ``me`` in placement order
    whose domain holds no copy yet, if any; else it stays where it was.

    Memory-only nodes (``role=memory`` in the peers file): when there are any,
    a training node's copies go to them first, spread over them, in a failure
    domain no other copy uses where one is left; only what the pool cannot
    give comes from the training nodes' placement above. A memory-only node
    has no targets: it holds no checkpoint of its own.

    Raises ``ValueError`` for ``replicas < 1``, an unknown placement, ranks
    given twice, or a ``me`` that is not in ``nodes``.
    """
    layout, _ = _layout(nodes, replicas, placement)
    if me not in layout:
        raise ValueError(f"node rank {me} is not in the peer list (ranks {min(layout)}..{max(layout)})")
    return layout[me]


def holders(nodes: NodesOrCount, replicas: int, placement: str = "group") -> dict[int, list[int]]:
    """For every node rank, the ranks holding its checkpoint in memory: ``[rank] + replica_targets``.

    ``nodes`` is the peer list, or a node count for nodes without domains.
    Raises ``ValueError`` as :func:`replica_targets` does.
    """
    layout, _ = _layout(nodes, replicas, placement)
    memory = {x.rank for x in _as_nodes(nodes) if x.role == "memory"}
    return {r: [r, *t] for r, t in layout.items() if r not in memory}


# -- survival ------------------------------------------------------------------------------

def survives(nodes: NodesOrCount, replicas: int, placement: str, failed: set[int]) -> bool:
    """True iff every node's checkpoint still has a live copy after the nodes ``failed`` (ranks) fail.

    Raises ``ValueError`` for a failed rank that is not a node.
    """
    h = holders(nodes, replicas, placement)
    unknown = set(failed) - {x.rank for x in _as_nodes(nodes)}
    if unknown:
        raise ValueError(f"failed ranks {sorted(unknown)} are not nodes (ranks {min(h)}..{max(h)})")
    return not any(set(copies) <= set(failed) for copies in h.values())


def _check_failures(n: int, failures: int) -> None:
    if not 0 <= failures <= n:
        raise ValueError(f"failures must be from 0 to the node count {n}, got {failures}")


def losing_failure(n: NodesOrCount, replicas: int, failures: int, placement: str = "group") -> set[int] | None:
    """One set of ``failures`` node ranks whose loss leaves some checkpoint with no copy, or None.

    Deterministic: the holders of the node with the fewest copies (lowest rank
    first), topped up with the lowest other ranks. Raises ``ValueError`` for
    ``failures`` outside ``0..N``.
    """
    h = holders(n, replicas, placement)
    _check_failures(len(h), failures)
    smallest = min(h.values(), key=len)
    if len(smallest) > failures:
        return None
    out = set(smallest)
    out.update(itertools.islice((r for r in h if r not in out), failures - len(out)))
    return out


def survives_all(n: NodesOrCount, replicas: int, failures: int, placement: str = "group") -> bool:
    """True iff *every* choice of ``failures`` simultaneous node failures leaves every checkpoint a copy.

    ``n`` is a node count, or the peer list when domains matter. That holds
    exactly when ``failures`` is smaller than the fewest copies any node has:
    any node's holders, topped up to ``failures`` nodes, lose its data.
    Raises ``ValueError`` for ``failures`` outside ``0..N``.
    """
    return losing_failure(n, replicas, failures, placement) is None


def _gemini_closed_form(n: int, k: int, f: int) -> int:
    """F-sets that leave a copy of everything when the ``n`` nodes form ``n/k`` closed groups of ``k``.

    Data is lost only if all ``k`` members of some group fail; inclusion–exclusion
    over the groups that fail whole: sum_j (-1)^j C(G, j) C(n - jk, f - jk).
    """
    g = n // k
    return sum((-1) ** j * math.comb(g, j) * math.comb(n - j * k, f - j * k) for j in range(min(g, f // k) + 1))


def _ring_counts(length: int, window: int, fmax: int) -> list[int]:
    """``out[j]``: j-subsets of a ring of ``length`` nodes with no ``window`` consecutive nodes all chosen.

    That is the number of ways ``j`` failures inside a ring segment lose
    nothing, when each node's copies are the ``window`` nodes starting at it.
    """
    top = min(fmax, length)
    # lin[m][j]: strings of m nodes, j failed, no run of `window` failed (bounded by live nodes both sides)
    lin = [[0] * (top + 1) for _ in range(length + 1)]
    lin[0][0] = 1
    for m in range(1, length + 1):
        for j in range(top + 1):
            total = lin[m - 1][j]
            for run in range(1, min(window - 1, j, m) + 1):
                total += (1 if run == j else 0) if run == m else lin[m - run - 1][j - run]
            lin[m][j] = total
    out = []
    for j in range(top + 1):
        if j == 0:
            out.append(1)
        elif j == length:
            out.append(0)
        elif j == length - 1:
            out.append(length if window >= length else 0)
        else:
            # a leading run of a and a trailing run of b failed nodes join across the wrap: a + b < window
            out.append(sum((s + 1) * lin[length - s - 2][j - s] for s in range(min(window - 1, j) + 1)))
    return out


def _poly_mul(a: list[int], b: list[int], top: int) -> list[int]:
    out = [0] * min(len(a) + len(b) - 1, top + 1)
    for i, x in enumerate(a):
        if x:
            for j, y in enumerate(b[: len(out) - i]):
                out[i + j] += x * y
    return out


def _structured_count(n: int, k: int, f: int, placement: str) -> tuple[int, str]:
    """Exact count of surviving ``f``-sets for the base placement (no copy moved for domains)."""
    k = min(k, n)
    if placement == "group" and n % k == 0:
        return _gemini_closed_form(n, k, f), "exact: GEMINI closed form over groups"
    if placement == "ring":
        blocks = [(n, k)]
    else:
        whole = n // k - 1
        blocks = [(k, k)] * whole + [(n - whole * k, k)]
    poly = [1]
    for length, window in blocks:
        poly = _poly_mul(poly, _ring_counts(length, window, f), f)
    return (poly[f] if f < len(poly) else 0), "exact: counted over groups and rings"


def survival_probability(n: NodesOrCount, replicas: int, failures: int, placement: str = "group",
                         *, samples: int = MONTE_CARLO_SAMPLES, seed: int = MONTE_CARLO_SEED) -> SurvivalResult:
    """The probability that ``failures`` nodes failing at once, chosen uniformly at random, lose nothing.

    "Lose nothing" means every node's checkpoint still has a copy in some live
    node's memory, so a restore can come from memory alone. ``n`` is a node
    count, or the peer list when domains matter.

    How it is computed (``method`` in the result says which):

    * placements no domain has altered: exactly, by GEMINI's closed form for
      group placement with ``N`` a multiple of ``k`` (inclusion–exclusion over
      groups that fail whole), else by counting failure sets that leave no
      ``k`` consecutive nodes of a ring (or a whole group) failed;
    * otherwise exactly, by enumerating every failure set, when there are at
      most ``MAX_ENUMERATED`` of them (C(N, F));
    * otherwise a Monte Carlo estimate from ``samples`` failure sets drawn
      with ``random.Random(seed)`` (``exact`` is False; its standard error is
      at most 0.5 / sqrt(samples)).

    Raises ``ValueError`` for ``failures`` outside ``0..N``, ``samples < 1``,
    or the errors of :func:`replica_targets`.
    """
    layout, moved = _layout(n, replicas, placement)
    total_nodes = len(layout)
    _check_failures(total_nodes, failures)
    all_survive = failures < 1 + min(map(len, layout.values()))
    if all_survive:
        return SurvivalResult(1.0, True, "exact: fewer failures than copies of any checkpoint", True)
    total = math.comb(total_nodes, failures)
    if not moved:
        count, method = _structured_count(total_nodes, replicas, failures, placement)
        return SurvivalResult(count / total, True, method, False)

    # bit masks over positions 0..N-1 in rank order
    index = {r: i for i, r in enumerate(layout)}
    need = [sum(1 << index[h] for h in (r, *t)) for r, t in layout.items()]

    def lost(failed: Sequence[int]) -> bool:
        mask = 0
        for i in failed:
            mask |= 1 << i
        # only a failed node's own data can be lost: it is one of its holders
        return any(need[i] & ~mask == 0 for i in failed)

    if total <= MAX_ENUMERATED:
        alive = sum(1 for c in itertools.combinations(range(total_nodes), failures) if not lost(c))
        return SurvivalResult(alive / total, True, f"exact: enumerated all {total} failure sets", False)
    if samples < 1:
        raise ValueError(f"samples must be at least 1, got {samples}")
    rng = random.Random(seed)
    alive = sum(1 for _ in range(samples) if not lost(rng.sample(range(total_nodes), failures)))
    return SurvivalResult(alive / samples, False, f"Monte Carlo, {samples} samples (seed {seed})", False)
