"""``ckpt placement``: where each node's checkpoint copies go, and which node failures a memory restore survives.

Never imports torch. Usage::

    ckpt placement --nodes 16 --replicas 2 --failures 2 [--placement group|ring]
    ckpt placement --peers nodes.txt --replicas 2 --failures 2
    ckpt placement --nodes 8 --mesh dp_replicate=2,dp_shard=4,tp=2 --replicate dp_replicate \
                   --ranks-per-node 2 [--replicas 2] [--failures 1]

With ``--peers`` the node count and failure domains come from the peers file.
With ``--mesh`` the table is per piece of the model state (a position on the
mesh's non-replicate dims): the nodes its data-parallel replicas already run
on, the peer copies the agents add (see :mod:`agents.mesh_placement`), and
survival counted over both.
"""

from __future__ import annotations

import argparse
import sys

from agents.mesh_placement import (
    Mesh,
    MeshError,
    max_failures_survived,
    parse_mesh,
    piece_label,
    piece_losing_failure,
    weakest,
    piece_survival_probability,
    plan_copies,
)
from agents.placement import (
    PLACEMENTS,
    Node,
    PeerListError,
    holders,
    losing_failure,
    parse_peers,
    survival_probability,
)

__all__ = ["add_parser", "cmd_placement"]

EXIT_ERROR = 1
EXIT_USAGE = 2

#: at most this many pieces get a row of their own; the rest are summed up
MAX_PIECE_ROWS = 32
#: at most this many nodes are listed by name in the peer copies each sends
MAX_NODES_LISTED = 16


class _UsageError(Exception):
    """A flag's value cannot be used; exit status 2."""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``placement`` command on ``subparsers``; it runs :func:`cmd_placement` via ``fn``."""
    p = subparsers.add_parser(
        "placement",
        help="which nodes hold each node's checkpoint, and which failures a memory restore survives",
        description="Show where each node's in-memory checkpoint copies go and whether a restore from "
                    "memory survives F simultaneous node failures.")
    p.add_argument("--nodes", type=int, metavar="N", help="number of nodes (else the peers file's)")
    p.add_argument("--replicas", type=int, default=2, metavar="K",
                   help="copies of each checkpoint, the node's own included (default 2)")
    p.add_argument("--failures", type=int, default=1, metavar="F",
                   help="nodes failing at the same time (default 1)")
    p.add_argument("--placement", choices=PLACEMENTS, default="group",
                   help="group (GEMINI; default) or ring")
    p.add_argument("--peers", metavar="FILE", help="peers file: host:port [domain=LABEL] per line, in node-rank order")
    p.add_argument("--mesh", metavar="DIM=SIZE,...",
                   help="the job's device mesh, outermost dim first, ranks row-major over it "
                        "(e.g. dp_replicate=2,dp_shard=4,tp=2): count the model's own replicas as copies")
    p.add_argument("--replicate", metavar="DIM[,DIM]",
                   help="with --mesh: the dims along which ranks hold identical state (e.g. dp_replicate; "
                        "'none' for none)")
    p.add_argument("--ranks-per-node", type=int, metavar="G",
                   help="with --mesh: trainer ranks per node; rank r runs on node r // G "
                        "(default: the mesh's ranks over the node count)")
    p.set_defaults(fn=cmd_placement)
    return p


def _nodes(a: argparse.Namespace) -> list[Node] | int:
    if a.peers is None:
        if a.nodes is None:
            raise _UsageError("give --nodes N or --peers FILE")
        if a.nodes < 1:
            raise _UsageError(f"--nodes must be at least 1, got {a.nodes}")
        return a.nodes
    try:
        with open(a.peers, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise OSError(f"cannot read peers file {a.peers}: {e.strerror or e}; check --peers") from e
    try:
        nodes = parse_peers(text)
    except PeerListError as e:
        raise PeerListError(f"{a.peers}: {e}") from e
    if a.nodes is not None and a.nodes != len(nodes):
        raise _UsageError(f"--nodes {a.nodes} but {a.peers} lists {len(nodes)} agents; drop --nodes or fix the file")
    active = [n for n in nodes if n.role != "retired"]  # left the cluster: placed nowhere, as the agents do
    if not active:
        raise _UsageError(f"every node in {a.peers} is retired (role=retired): there is no cluster to place on")
    return active


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _ranks(ranks) -> str:
    return ", ".join(str(r) for r in sorted(ranks))


def cmd_placement(a: argparse.Namespace) -> int:
    """Print the holders table, whether every ``F`` failures are survived, and the odds for random ones.

    Returns the exit status: 0 on success, 2 for unusable flag values, 1 for an
    unreadable or malformed peers file. Errors are one line on stderr.
    """
    if getattr(a, "mesh", None) is not None:
        return _cmd_mesh(a)
    try:
        for flag, value in (("--replicate", getattr(a, "replicate", None)),
                            ("--ranks-per-node", getattr(a, "ranks_per_node", None))):
            if value is not None:
                raise _UsageError(f"{flag} describes the job's mesh; give --mesh DIM=SIZE,... with it or drop it")
        nodes = _nodes(a)
        if a.replicas < 1:
            raise _UsageError(f"--replicas must be at least 1 (the node's own copy), got {a.replicas}")
        n = nodes if isinstance(nodes, int) else len(nodes)
        if not 0 <= a.failures <= n:
            raise _UsageError(f"--failures must be from 0 to the node count {n}, got {a.failures}")
        table = holders(nodes, a.replicas, a.placement)
        example = losing_failure(nodes, a.replicas, a.failures, a.placement)
        odds = survival_probability(nodes, a.replicas, a.failures, a.placement)
    except _UsageError as e:
        print(f"ckpt placement: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (OSError, ValueError) as e:
        print(f"ckpt placement: {e}", file=sys.stderr)
        return EXIT_ERROR

    by_rank = {x.rank: x for x in nodes} if not isinstance(nodes, int) else {}
    domains = any(x.domain is not None for x in by_rank.values())

    def where(r: int) -> str:
        d = by_rank[r].domain if r in by_rank else None
        return f"{r} ({d})" if domains and d is not None else str(r)

    head = ["node"] + (["addr"] if by_rank else []) + (["domain"] if domains else []) + ["replicas on"]
    rows = [head]
    for r, copies in table.items():
        row = [str(r)]
        if by_rank:
            row.append(by_rank[r].addr)
        if domains:
            row.append(by_rank[r].domain or "-")
        row.append(", ".join(where(t) for t in copies[1:]) or "(none: only the node's own copy)")
        rows.append(row)

    n = len(table)
    f = a.failures
    print(f"{a.placement} placement, {n} node{'s' * (n != 1)}, {a.replicas} "
          f"cop{'ies' if a.replicas != 1 else 'y'} of each checkpoint (the node's own included)")
    print(_table(rows))
    print()
    if example is None:
        print(f"memory restore survives every {f} simultaneous node failure{'s' * (f != 1)}: yes")
    else:
        # the holders of one checkpoint are what must fail; which other nodes fail does not matter
        victim, core = min(table.items(), key=lambda kv: len(kv[1]))
        rest = f - len(core)
        others = f" and any {rest} other{'s' * (rest != 1)}" if rest else ""
        print(f"memory restore survives every {f} simultaneous node failure{'s' * (f != 1)}: no "
              f"(e.g. node{'s' * (len(core) != 1)} {_ranks(core)}{others} fail{'s' * (f == 1)}: "
              f"no copy of node {victim}'s checkpoint is left)")
    print(f"probability that every checkpoint keeps a copy in memory after {f} random simultaneous "
          f"node failure{'s' * (f != 1)}: {odds.probability:.6f} ({odds.method})")
    return 0


# -- --mesh: the model's own replicas count as copies -----------------------------------------

def _mesh_setup(a: argparse.Namespace) -> tuple[Mesh, list[Node] | int]:
    """The mesh and the nodes from the flags; _UsageError for flag values that cannot be used."""
    try:
        dims = parse_mesh(a.mesh)
    except MeshError as e:
        raise _UsageError(f"--mesh: {e}") from e
    world = 1
    for _, size in dims:
        world *= size
    if a.replicate is None:
        raise _UsageError("give --replicate DIM[,DIM] with --mesh: the dims along which ranks hold identical "
                          "state (e.g. dp_replicate for HSDP, dp for DDP; 'none' if no dim does)")
    replicate = [d.strip() for d in a.replicate.split(",")]
    if replicate == ["none"]:
        replicate = []
    elif not all(replicate):
        raise _UsageError(f"--replicate {a.replicate!r} has an empty dim name; write DIM[,DIM], e.g. dp_replicate")
    if a.ranks_per_node is not None and a.ranks_per_node < 1:
        raise _UsageError(f"--ranks-per-node must be at least 1, got {a.ranks_per_node}")
    if a.peers is None and a.nodes is None:
        if a.ranks_per_node is None:
            raise _UsageError("give --nodes N, --peers FILE or --ranks-per-node G with --mesh")
        if world % a.ranks_per_node:
            raise _UsageError(f"the mesh has {world} ranks, not a multiple of --ranks-per-node "
                              f"{a.ranks_per_node}; every node runs the same number of ranks")
        nodes: list[Node] | int = world // a.ranks_per_node
    else:
        nodes = _nodes(a)
    n = nodes if isinstance(nodes, int) else len(nodes)
    per_node = a.ranks_per_node
    if per_node is None:
        if world % n:
            raise _UsageError(f"the mesh's {world} ranks do not split evenly over {n} nodes; "
                              "give --ranks-per-node G with nodes x G = the mesh's ranks")
        per_node = world // n
    if n * per_node != world:
        raise _UsageError(f"{n} node{'s' * (n != 1)} x {per_node} rank{'s' * (per_node != 1)} per node = "
                          f"{n * per_node} ranks, but the mesh has "
                          f"{world}; make nodes x --ranks-per-node equal the product of the mesh's sizes")
    unknown = [d for d in replicate if d not in {name for name, _ in dims}]
    if unknown:
        raise _UsageError(f"--replicate names {', '.join(unknown)}, not a dim of --mesh "
                          f"({', '.join(name for name, _ in dims)}); name dims of the mesh")
    try:
        mesh = Mesh(dims, frozenset(replicate), per_node)
    except MeshError as e:
        raise _UsageError(str(e)) from e
    return mesh, nodes


def _cmd_mesh(a: argparse.Namespace) -> int:
    """``ckpt placement --mesh``: per piece, its model replicas and peer copies; survival over both."""
    try:
        mesh, nodes = _mesh_setup(a)
        n = mesh.nodes
        if a.replicas < 1:
            raise _UsageError(f"--replicas must be at least 1 (the model's own copy), got {a.replicas}")
        if not 0 <= a.failures <= n:
            raise _UsageError(f"--failures must be from 0 to the node count {n}, got {a.failures}")
        plan = plan_copies(mesh, nodes, a.replicas, a.placement)
        example = piece_losing_failure(plan, a.failures)
        odds = piece_survival_probability(plan, a.failures)
    except _UsageError as e:
        print(f"ckpt placement: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (OSError, ValueError) as e:
        print(f"ckpt placement: {e}", file=sys.stderr)
        return EXIT_ERROR

    k, f = a.replicas, a.failures
    g = mesh.ranks_per_node
    dims = ",".join(f"{name}={size}" for name, size in mesh.dims)
    rep = ", ".join(name for name, _ in mesh.dims if name in mesh.replicate) or "none"
    print(f"{a.placement} placement, {n} node{'s' * (n != 1)} of {g} rank{'s' * (g != 1)}, mesh {dims} "
          f"({mesh.world} ranks, replicate dims: {rep})")
    print(f"{k} cop{'ies' if k != 1 else 'y'} of each piece wanted on distinct nodes (the model's replicas included)")
    rows = [["piece", "ranks", "model replicas on", "peer copies", "held on"]]
    for pc in plan.pieces[:MAX_PIECE_ROWS]:
        copies = f"{pc.lead} -> {_ranks(pc.targets)}" if pc.targets else "-"
        if pc.short_by:
            copies += f" (short by {pc.short_by})"
        rows.append([piece_label(pc.piece), _ranks(pc.ranks), _ranks(pc.model_holders), copies,
                     _ranks(pc.holders)])
    print(_table(rows))
    left = len(plan.pieces) - MAX_PIECE_ROWS
    if left > 0:
        print(f"({left} more piece{'s' * (left != 1)} not shown)")
    enough = sum(1 for pc in plan.pieces if not pc.targets and not pc.short_by)
    copied = sum(1 for pc in plan.pieces if pc.targets)
    short = sum(1 for pc in plan.pieces if pc.short_by)
    print(f"pieces: {len(plan.pieces)}; on {k}+ nodes by the model's replicas alone: {enough}; "
          f"with peer copies: {copied}; short of {k} nodes: {short}"
          + (f" (only {n} node{'s' * (n != 1)})" if short else ""))
    print(f"each rank's unique part (what no other rank holds: plain tensors such as an optimizer's step count, "
          f"its values; a few kB) goes to its node's {min(k - 1, n - 1)} placement "
          f"target{'s' * (min(k - 1, n - 1) != 1)} as well, with the shard or alone")
    print()
    per_rank_today = plan.baseline_sends[0] // g
    print(f"peer copies per save: {plan.peer_copies} shard{'s' * (plan.peer_copies != 1)} "
          f"(today {plan.baseline_copies}: every rank's shard to {per_rank_today} "
          f"peer{'s' * (per_rank_today != 1)}); {plan.copy_fraction:.3f} of today's")
    print(f"shards each node sends to peers per save: {_sends(plan.sends)}")
    print()
    if example is None:
        print(f"memory restore survives every {f} simultaneous node failure{'s' * (f != 1)}: yes")
    else:
        what, core = weakest(plan)
        rest = f - len(core)
        others = f" and any {rest} other{'s' * (rest != 1)}" if rest else ""
        print(f"memory restore survives every {f} simultaneous node failure{'s' * (f != 1)}: no "
              f"(e.g. node{'s' * (len(core) != 1)} {_ranks(core)}{others} fail{'s' * (f == 1)}: "
              f"no copy of {what} is left)")
    best = max_failures_survived(plan)
    print(f"largest number of simultaneous node failures always survived: {best}")
    print(f"probability that every piece and unique part keeps a copy in memory after {f} random simultaneous "
          f"node failure{'s' * (f != 1)}: {odds.probability:.6f} ({odds.method})")
    return 0


def _sends(sends) -> str:
    """Per node shard copies sent, listed by node when few, else summed up."""
    if len(sends) <= MAX_NODES_LISTED:
        return ", ".join(f"node {r}: {c}" for r, c in sends.items())
    top = max(sends, key=lambda r: (sends[r], -r))
    idle = sum(1 for c in sends.values() if c == 0)
    return (f"at most {sends[top]} (node {top}), {sum(sends.values()) / len(sends):.2f} on average; "
            f"{idle} of {len(sends)} nodes send none")
