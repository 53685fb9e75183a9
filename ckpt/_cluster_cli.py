"""``ckpt retire``: take nodes out of a running cluster whose membership is in etcd.

Never imports torch. Usage::

    ckpt retire --etcd http://etcd:2379 --cluster c1 3 [4 ...] [--force]

A retired rank keeps its place (the ranks after it keep theirs) and leaves the cluster for good: every
agent drops it as a peer, placement and the commit quorum count the nodes left, and the heal makes up
the copies it held. A rank registered by an agent that still answers is refused unless ``--force`` (its
agent then stops). With a peers file, mark the node's line ``role=retired`` on every node instead.
"""

from __future__ import annotations

import argparse
import asyncio

from agents.directory import retire_nodes


DESCRIPTION = """\
Take nodes out of a running cluster whose membership is in etcd. A retired rank keeps its place (the
ranks after it keep theirs) and leaves the cluster for good: every agent drops it as a peer, placement
and the commit quorum count the nodes left, and the heal makes up the copies it held. A rank registered
by an agent that still answers is refused unless --force (its agent then stops); no rank can be claimed
again once retired (a machine joins again as a new rank, e.g. with --node-rank auto). With a peers file,
mark the node's line role=retired on every node instead."""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``retire`` command on ``subparsers``; it runs :func:`cmd_retire` via ``fn``."""
    p = subparsers.add_parser(
        "retire", help="take nodes out of a running etcd cluster for good (their ranks are not reused)",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ranks", type=int, nargs="+", metavar="RANK", help="node ranks to retire")
    p.add_argument("--etcd", required=True, help="etcd endpoints (http://host:2379, comma-separated)")
    p.add_argument("--cluster", default="default", help="the cluster's name in etcd (default 'default')")
    p.add_argument("--force", action="store_true",
                   help="retire a node even while its agent answers (that agent stops)")
    p.set_defaults(fn=cmd_retire)
    return p


def cmd_retire(a: argparse.Namespace) -> int:
    from .cli import CliError

    try:
        lines = asyncio.run(retire_nodes(a.etcd, a.cluster, a.ranks, force=a.force))
    except ValueError as e:
        raise CliError(str(e)) from None
    for line in lines:
        print(line)
    return 0
