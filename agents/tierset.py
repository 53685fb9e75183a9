"""The tiers a :class:`~agents.config.Settings` names, built in one place.

The agent, the ``ckpt`` CLI and the Checkpointer each open the same places
(this node's memory, its disk, the S3 prefix, the peers' memory) from the
same settings; they differ only in how long they let S3 retry and how long a
peer may take. Every caller builds its tiers here::

    memory_tier(s)                       this node's host-memory folder
    disk_tier(s)                         the disk folder, or None
    s3_tier(s, retry_deadline=…)         the S3 prefix, or None (boto3 imported only then)
    peer_tiers(s, only=…, exclude=…)     a client per other node, in node order
    peer_tier_map(s, …)                  the same, keyed by node rank (the agent's)
    peer_disk_tiers(s, only=…, exclude=…)  the other nodes' disks, read-only, through their agents
"""

from __future__ import annotations

from tiers.base import Tier
from tiers.disk import DiskTier
from tiers.memory import MemoryTier

from .replication import load_peer_list

__all__ = ["disk_tier", "memory_tier", "peer_disk_tiers", "peer_tier_map", "peer_tiers", "s3_tier"]


def memory_tier(settings) -> MemoryTier:
    """This node's memory tier (the agent's ``shm`` folder)."""
    return MemoryTier(settings.shm)


def disk_tier(settings) -> DiskTier | None:
    """This node's disk tier, or None when no disk folder is set."""
    if not settings.disk:
        return None
    return DiskTier(settings.disk, compress=settings.compress)


def s3_tier(settings, *, retry_deadline: float | None = None, max_attempts: int | None = None) -> Tier | None:
    """The job's shared S3 tier, or None when no S3 URL is set.

    ``retry_deadline`` (seconds) defaults to ``settings.s3_retry_deadline``; ``max_attempts`` to the
    tier's own default. Raises ValueError for a URL that is not ``s3://bucket/prefix``.
    """
    if not settings.s3:
        return None
    from tiers.s3 import S3Tier

    kw = {} if max_attempts is None else {"max_attempts": max_attempts}
    deadline = settings.s3_retry_deadline if retry_deadline is None else retry_deadline
    return S3Tier.from_url(settings.s3, endpoint_url=settings.s3_endpoint, retry_deadline=deadline, **kw)


def peer_tier_map(settings, *, timeout: float, secret: bytes | None, ssl_context=None, bucket=None,
                  only: set[int] | None = None, exclude: set[int] | None = None, disk: bool = False) -> dict:
    """A client tier for every other node in ``settings.peers``, by node rank (empty without peers).

    ``timeout`` is in seconds; ``bucket`` (a :class:`~tiers.wire.TokenBucket`) paces the bytes read;
    ``only`` / ``exclude`` narrow it to / away from those node ranks; with ``disk``, the nodes' disk tiers
    (read-only) instead of their memory.
    """
    if not settings.peers:
        return {}
    from tiers.peer import PeerDiskTier, PeerTier

    kind = PeerDiskTier if disk else PeerTier
    return {n.rank: kind(n.addr, secret=secret, node=settings.node_rank, timeout=timeout,
                             ssl_context=ssl_context, bucket=bucket)
            for n in load_peer_list(settings.peers) if n.rank != settings.node_rank and n.role != "retired"
            and (only is None or n.rank in only) and (exclude is None or n.rank not in exclude)}


def peer_tiers(settings, *, timeout: float | None = None, only: set[int] | None = None,
               exclude: set[int] | None = None, disk: bool = False) -> list:
    """A client tier for every other node in ``settings.peers`` (none without peers), in node order;
    ``only`` / ``exclude`` narrow it to / away from those node ranks; with ``disk``, their disk tiers. For a
    restore or the CLI: a peer gets at most 5 s (``timeout``, seconds, overrides it)."""
    if not settings.peers:
        return []
    from tiers.wire import load_secret

    secret = load_secret(settings.secret_file) if settings.secret_file else None
    ctx = None
    if settings.tls_ca:
        import ssl

        ctx = ssl.create_default_context(cafile=settings.tls_ca)
    tiers = peer_tier_map(settings, timeout=timeout or min(settings.peer_timeout, 5.0), secret=secret,
                          ssl_context=ctx, only=only, exclude=exclude, disk=disk)
    return [tiers[r] for r in sorted(tiers)]


def peer_disk_tiers(settings, *, timeout: float | None = None, only: set[int] | None = None,
                    exclude: set[int] | None = None) -> list:
    """The other nodes' disk tiers, read-only through their agents, in node order (see :func:`peer_tiers`):
    a node's disk holds its ranks' durable parts, so a restore from disk reads the other ranks' from them."""
    return peer_tiers(settings, timeout=timeout, only=only, exclude=exclude, disk=True)
