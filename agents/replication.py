"""The job's other agents as this node sees them: who is alive, where copies go, what is missing.

Pure bookkeeping plus the desired-holders rule; the agent does the I/O.

Desired holders of a shard whose primary copy was taken by node ``p``: the
first ``replicas`` alive nodes of ``[p] + replica_targets(p)`` followed by the
rest of the placement order after ``p``. While everyone is alive that is
exactly the placement (group or ring); when a holder dies the next node that
placement order allows takes its place; when it comes back (empty) it is
desired again and refilled. Every node computes the same answer from the same
peer list and the same view of who is alive.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from .placement import Node, parse_peers, placement_order, replica_targets

__all__ = ["PeerState", "Membership", "load_peer_list", "peer_tiers", "post_json"]


def load_peer_list(spec: str) -> list[Node]:
    """Nodes from a peers file, or from an inline comma-separated list (``CKPT_PEERS``)."""
    if os.path.exists(spec):
        with open(spec) as f:
            return parse_peers(f.read())
    return parse_peers(spec)


@dataclass
class PeerState:
    """What this node knows of one peer."""

    node: Node
    last_seen: float | None = None
    alive: bool = True
    bytes_held: int = 0
    sent_bytes: int = 0
    debt_bytes: int = 0
    errors: int = 0
    last_error: str = ""


@dataclass
class Membership:
    """Membership and placement for node ``me`` among ``nodes``."""

    nodes: list[Node]
    me: int
    replicas: int
    placement: str
    dead_after: float
    peers: dict[int, PeerState] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 <= self.me < len(self.nodes):
            raise ValueError(f"node rank {self.me} is not in the peer list of {len(self.nodes)} agents")
        now = time.monotonic()
        for n in self.nodes:
            if n.rank != self.me:
                # a peer starts alive with a full grace period: it may still be starting
                self.peers[n.rank] = PeerState(n, last_seen=now)
        self._order = placement_order(self.nodes)

    def seen(self, rank: int, bytes_held: int) -> bool:
        """Record a heartbeat answer; True if the peer was dead until now."""
        p = self.peers[rank]
        p.last_seen = time.monotonic()
        p.bytes_held = bytes_held
        revived = not p.alive
        p.alive = True
        return revived

    def sweep(self) -> list[int]:
        """Declare peers silent for ``dead_after`` seconds dead; return the newly dead."""
        now = time.monotonic()
        dead = []
        for r, p in self.peers.items():
            if p.alive and (p.last_seen is None or now - p.last_seen > self.dead_after):
                p.alive = False
                dead.append(r)
        return dead

    def alive(self) -> set[int]:
        return {self.me} | {r for r, p in self.peers.items() if p.alive}

    def desired(self, primary: int, alive: set[int] | None = None) -> list[int]:
        """Nodes that should hold a shard whose primary copy is on ``primary`` (see module docstring)."""
        alive = self.alive() if alive is None else alive
        base = [primary] + replica_targets(self.nodes, primary, self.replicas, self.placement)
        pos = self._order.index(primary) if primary in self._order else 0
        rest = self._order[pos + 1:] + self._order[:pos]
        out: list[int] = []
        for r in base + rest:
            if r in alive and r not in out:
                out.append(r)
            if len(out) == min(self.replicas, len(alive)):
                break
        return out

    def targets(self, primary: int) -> list[int]:
        """Where the primary sends copies now: desired holders other than itself."""
        return [r for r in self.desired(primary) if r != primary]


def post_json(addr: str, path: str, obj: dict, *, secret: bytes | None, node: int, timeout: float,
              ssl_context=None) -> dict:
    """POST a small signed JSON request to a peer agent; return its JSON answer.

    Raises ConnectionError when the peer cannot be reached or refuses the request.
    """
    import http.client
    import json

    from tiers.wire import sign

    body = json.dumps(obj, separators=(",", ":")).encode()
    host, _, port = addr.rpartition(":")
    host = host.strip("[]")
    conn_cls = http.client.HTTPSConnection if ssl_context is not None else http.client.HTTPConnection
    kw = {"context": ssl_context} if ssl_context is not None else {}
    conn = conn_cls(host, int(port), timeout=timeout, **kw)
    headers = {"Content-Type": "application/json", "Content-Length": str(len(body))}
    if secret:
        headers.update(sign(secret, "POST", path, None, node=node, content_length=len(body)))
    try:
        conn.request("POST", path, body=body, headers=headers)
        resp = conn.getresponse()
        data = resp.read(1 << 20)
    except OSError as e:
        raise ConnectionError(f"peer {addr} unreachable: {e}") from e
    finally:
        conn.close()
    if resp.status >= 300:
        raise ConnectionError(f"peer {addr} refused {path}: {resp.status} {data[:200].decode(errors='replace')}")
    return json.loads(data or b"{}")


def peer_tiers(settings, *, timeout: float | None = None) -> list:
    """A client tier for every other node in ``settings.peers`` (none without peers), in node order."""
    if not settings.peers:
        return []
    from tiers.peer import PeerTier
    from tiers.wire import load_secret

    secret = load_secret(settings.secret_file) if settings.secret_file else None
    ctx = None
    if settings.tls_ca:
        import ssl

        ctx = ssl.create_default_context(cafile=settings.tls_ca)
    return [PeerTier(n.addr, secret=secret, node=settings.node_rank, ssl_context=ctx,
                     timeout=timeout or min(settings.peer_timeout, 5.0))
            for n in load_peer_list(settings.peers) if n.rank != settings.node_rank]
