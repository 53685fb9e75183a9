"""``ckpt placement``: where each node's checkpoint copies go, and which node failures a memory restore survives.

Never imports torch. Usage::

    ckpt placement --nodes 16 --replicas 2 --failures 2 [--placement group|ring]
    ckpt placement --peers nodes.txt --replicas 2 --failures 2

With ``--peers`` the node count and failure domains come from the peers file.
"""

from __future__ import annotations

import argparse
import sys

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
    return nodes


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
    try:
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
