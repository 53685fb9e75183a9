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

__all__ = ["DEFLATED_JSON", "SharedBody", "encode_body", "LinkPool", "PeerLink", "placement_partners", "PeerState", "Membership", "find_own_rank", "load_peer_list"]


def load_peer_list(spec: str) -> list[Node]:
    """Nodes from a peers file, or from an inline comma-separated list (``CKPT_PEERS``)."""
    if os.path.exists(spec):
        with open(spec) as f:
            return parse_peers(f.read())
    return parse_peers(spec)


def find_own_rank(nodes: list[Node]) -> int:
    """The rank of the one node whose address belongs to this machine (an address this machine can bind).

    Raises PeerListError (a ValueError) when none does, or several do (loopback addresses, or a host name
    that resolves here more than once): then the rank must be given."""
    import socket

    from .placement import PeerListError

    mine = []
    for n in nodes:
        try:
            infos = socket.getaddrinfo(n.host, None, type=socket.SOCK_STREAM)
        except socket.gaierror:
            continue
        for family, _, _, _, addr in infos:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind((addr[0], 0))
                except OSError:
                    continue
            mine.append(n)
            break
    if len(mine) == 1:
        return mine[0].rank
    if not mine:
        raise PeerListError("no line of the peers file names an address of this machine: add this node's "
                            "host:port to the file (the same file on every node), or give --node-rank")
    raise PeerListError(f"{len(mine)} lines of the peers file name addresses of this machine "
                        f"({', '.join(n.addr for n in mine[:4])}): give --node-rank")


@dataclass
class PeerState:
    """What this node knows of one peer."""

    node: Node
    last_seen: float | None = None
    alive: bool = True
    #: when (monotonic) it last answered a health check; None until it first does, and until then
    #: ``startup_grace`` applies, not ``dead_after``
    last_answer: float | None = None
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
    #: silence allowed a peer that never answered yet (agents start at different times); at least dead_after
    startup_grace: float = 0.0
    peers: dict[int, PeerState] = field(default_factory=dict)
    #: the peers this node heartbeats (every peer until :meth:`watch` narrows it)
    watched: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        if not 0 <= self.me < len(self.nodes):
            raise ValueError(f"node rank {self.me} is not in the peer list of {len(self.nodes)} agents")
        if self.nodes[self.me].role == "retired":
            raise ValueError(f"node {self.me} is retired in the peer list (role=retired): it is no longer part of "
                             "the cluster; give its line another role to bring it back")
        now = time.monotonic()
        for n in self.nodes:
            if n.rank != self.me and n.role != "retired":
                # a peer starts alive with a full grace period: it may still be starting
                self.peers[n.rank] = PeerState(n, last_seen=now)
        self.watched = set(self.peers)
        self._order = placement_order(self.active())
        self._base: dict[int, list[int]] = {}

    def active(self) -> list[Node]:
        """The nodes that are part of the cluster: every node but the retired ones (``role=retired``)."""
        return [n for n in self.nodes if n.role != "retired"]

    def seen(self, rank: int, bytes_held: int) -> bool:
        """Record a heartbeat answer; True if the peer was dead until now."""
        p = self.peers[rank]
        p.last_seen = p.last_answer = time.monotonic()
        p.bytes_held = bytes_held
        revived = not p.alive
        p.alive = True
        return revived

    def silence_allowed(self, rank: int) -> float:
        """Seconds peer ``rank`` may be silent before it is declared dead."""
        p = self.peers[rank]
        return self.dead_after if p.last_answer is not None else max(self.dead_after, self.startup_grace)

    def sweep(self) -> list[int]:
        """Declare watched peers silent for ``dead_after`` seconds dead; return the newly dead.

        Only peers in :attr:`watched` are judged here; the others live or die by the view the commit
        tree's root sends (:meth:`apply_view`)."""
        now = time.monotonic()
        dead = []
        for r, p in self.peers.items():
            if r not in self.watched:
                continue
            if p.alive and (p.last_seen is None or now - p.last_seen > self.silence_allowed(r)):
                p.alive = False
                dead.append(r)
        return dead

    def watch(self, nodes: set[int]) -> None:
        """Heartbeat ``nodes`` from now on (tree neighbours and placement partners); a node newly watched
        gets a full grace period before it can be declared dead."""
        now = time.monotonic()
        for r in nodes - self.watched:
            if r in self.peers:
                self.peers[r].last_seen = now
        self.watched = {r for r in nodes if r in self.peers}

    def apply_view(self, dead: set[int]) -> list[tuple[str, int]]:
        """Adopt the root's view for the peers this node does not watch; for the watched ones keep what
        this node saw, and return the ``(kind, node)`` reports where the two disagree."""
        reports = []
        now = time.monotonic()
        for r, p in self.peers.items():
            if r in self.watched:
                if r in dead and p.alive and (p.last_answer is None or now - p.last_answer > self.dead_after / 2):
                    p.alive = False  # not heard from lately either: the root's word stands
                elif (r in dead) == p.alive:
                    reports.append(("alive" if p.alive else "dead", r))
                continue
            if p.alive and r in dead:
                p.alive = False
            elif not p.alive and r not in dead:
                p.alive = True
                p.last_seen = now
        return reports

    def mark(self, kind: str, node: int) -> bool:
        """Apply a report (``dead`` or ``alive``) about ``node``; True when it changed who is alive."""
        p = self.peers.get(node)
        if p is None:
            return False
        if kind == "alive" and not p.alive:
            p.alive, p.last_seen = True, time.monotonic()
            return True
        if kind == "dead" and p.alive:
            p.alive = False
            return True
        return False

    def replace(self, node: Node) -> None:
        """Node ``node.rank`` is another machine now (a new address or domain): it starts over as a peer that
        has not answered yet, and placement is computed again when its domain changed."""
        old = self.nodes[node.rank]
        self.nodes[node.rank] = node
        self.peers[node.rank] = PeerState(node, last_seen=time.monotonic(), alive=True)
        if (old.domain, old.role) != (node.domain, node.role):
            self._order = placement_order(self.active())
            self._base.clear()

    def retire(self, node: Node) -> None:
        """Node ``node.rank`` left the cluster (its line says ``role=retired``): no longer a peer, never
        heartbeat or counted; placement is computed again over the nodes left, and the heal makes up the
        copies it held."""
        self.nodes[node.rank] = node
        self.peers.pop(node.rank, None)
        self.watched.discard(node.rank)
        self._order = placement_order(self.active())
        self._base.clear()

    def add(self, node: Node) -> None:
        """Node ``node.rank`` (the next rank) joins: a peer that has not answered yet, with the start-up grace;
        placement is computed again over the larger cluster."""
        if node.rank != len(self.nodes):
            raise ValueError(f"node {node.rank} cannot join a cluster of {len(self.nodes)} nodes: ranks are added "
                             "in order")
        self.nodes.append(node)
        if node.role != "retired":
            self.peers[node.rank] = PeerState(node, last_seen=time.monotonic(), alive=True)
        self._order = placement_order(self.active())
        self._base.clear()

    def dead(self) -> set[int]:
        return {r for r, p in self.peers.items() if not p.alive}

    def alive(self) -> set[int]:
        return {self.me} | {r for r, p in self.peers.items() if p.alive}

    def desired(self, primary: int, alive: set[int] | None = None) -> list[int]:
        """Nodes that should hold a shard whose primary copy is on ``primary`` (see module docstring)."""
        alive = self.alive() if alive is None else alive
        base = self._base.get(primary)
        if base is None:
            # depends only on the peer list: computed once per primary (it walks the whole placement)
            active = self.active()
            base = self._base[primary] = [primary] + (
                replica_targets(active, primary, self.replicas, self.placement)
                if any(n.rank == primary for n in active) else [])
        pos = self._order.index(primary) if primary in self._order else 0
        rest = self._order[pos + 1:] + self._order[:pos]
        out: list[int] = []
        for r in base + rest:
            if r in alive and r not in out:
                out.append(r)
            if len(out) == min(self.replicas, len(alive)):
                break
        return out

    def fallbacks(self, primary: int, count: int) -> list[int]:
        """The ``count`` nodes after ``primary``'s placement partners in placement order: where copies of
        its shards go when partners die (see :meth:`desired`), so where a replacement looks next."""
        pos = self._order.index(primary) if primary in self._order else 0
        partners = set(self.desired(primary, {n.rank for n in self.active()}))
        rest = [r for r in self._order[pos + 1:] + self._order[:pos] if r not in partners]
        return rest[:count]

    def targets(self, primary: int) -> list[int]:
        """Where the primary sends copies now: desired holders other than itself."""
        return [r for r in self.desired(primary) if r != primary]


class PeerLink:
    """One keep-alive HTTP connection to one peer agent for small signed control requests.

    Requests on a link run one at a time (a lock), so each agent holds at most
    one control connection to each peer it talks to, however many callers
    share it. A broken connection is reopened once per request. Bodies above
    ``COMPRESS_ABOVE`` bytes are sent deflated (``Content-Type: application/x-tierckpt-deflate``).
    """

    COMPRESS_ABOVE = 512

    def __init__(self, addr: str, *, secret: bytes | None, node: int, timeout: float, ssl_context=None) -> None:
        import threading

        self.addr = addr
        self.secret = secret
        self.node = node
        self.timeout = timeout
        self.ssl_context = ssl_context
        self._conn = None
        self._lock = threading.Lock()
        #: requests sent and body bytes sent on the wire (after compression)
        self.sent = 0
        self.sent_bytes = 0

    def _connect(self):
        import http.client

        host, _, port = self.addr.rpartition(":")
        host = host.strip("[]")
        if self.ssl_context is not None:
            return http.client.HTTPSConnection(host, int(port), timeout=self.timeout, context=self.ssl_context)
        return http.client.HTTPConnection(host, int(port), timeout=self.timeout)

    def post(self, path: str, obj: dict, *, timeout: float | None = None) -> dict:
        """POST ``obj`` as JSON; return the JSON answer. Raises ConnectionError when the peer cannot be
        reached or refuses the request. A :class:`SharedBody` is serialised once for every link."""
        import json

        from tiers.wire import sign

        body, ctype = obj.encoded() if isinstance(obj, SharedBody) else encode_body(obj)
        with self._lock:
            for attempt in (0, 1):
                if self._conn is None:
                    self._conn = self._connect()
                self._conn.timeout = timeout or self.timeout
                if self._conn.sock is not None:
                    self._conn.sock.settimeout(self._conn.timeout)
                headers = {"Content-Type": ctype, "Content-Length": str(len(body))}
                if self.secret:
                    headers.update(sign(self.secret, "POST", path, None, node=self.node, content_length=len(body),
                                        to=self.addr))
                try:
                    self._conn.request("POST", path, body=body, headers=headers)
                    resp = self._conn.getresponse()
                    data = resp.read(64 << 20)
                except OSError as e:
                    self.close_locked()
                    if attempt == 0 and not isinstance(e, TimeoutError):
                        continue  # a keep-alive connection the server closed meanwhile: one fresh try
                    raise ConnectionError(f"peer {self.addr} unreachable: {e}") from e
                except Exception as e:  # http.client's protocol errors (RemoteDisconnected is an OSError)
                    self.close_locked()
                    if attempt == 0:
                        continue
                    raise ConnectionError(f"peer {self.addr} answered {path} badly: {e}") from e
                self.sent += 1
                self.sent_bytes += len(body)
                if resp.will_close:
                    self.close_locked()
                if resp.status >= 300:
                    raise ConnectionError(
                        f"peer {self.addr} refused {path}: {resp.status} {data[:200].decode(errors='replace')}")
                return json.loads(data or b"{}")
        raise AssertionError("unreachable")

    def close_locked(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def close(self) -> None:
        with self._lock:
            self.close_locked()


class LinkPool:
    """Up to ``size`` keep-alive :class:`PeerLink` s per peer, for requests that may run side by side
    (replication's fetch and publish: one per shard being copied).

    A request takes an idle link of its peer, or opens one while the peer has fewer than ``size``, or
    waits for one to come back. So a server holds at most ``size`` such connections from each client,
    and a step's copies reuse them instead of opening a connection per shard.
    """

    def __init__(self, addrs: dict[int, str], size: int, **link_kw) -> None:
        import threading

        self.size = size
        self._addrs = addrs
        self._kw = link_kw
        self._idle: dict[int, list[PeerLink]] = {r: [] for r in addrs}
        self._open: dict[int, int] = dict.fromkeys(addrs, 0)
        self._cond = threading.Condition()
        self._closed = False

    def post(self, r: int, path: str, obj: dict, *, timeout: float | None = None) -> dict:
        """POST ``obj`` to node ``r`` on a pooled link (see :meth:`PeerLink.post`)."""
        with self._cond:
            while not self._idle[r] and self._open[r] >= self.size and not self._closed:
                self._cond.wait()
            if self._closed:
                raise ConnectionError("the agent is stopping")
            if self._idle[r]:
                link = self._idle[r].pop()
            else:
                link = PeerLink(self._addrs[r], **self._kw)
                self._open[r] += 1
        try:
            return link.post(path, obj, timeout=timeout)
        finally:
            with self._cond:
                if self._closed:
                    link.close()
                elif link.addr != self._addrs[r]:  # the node moved meanwhile
                    link.close()
                    self._open[r] -= 1
                else:
                    self._idle[r].append(link)
                self._cond.notify()

    def readdress(self, r: int, addr: str) -> None:
        """Node ``r`` is at ``addr`` from now on (a node that joined: its first address): its idle links
        close, links in use close when returned."""
        with self._cond:
            if r not in self._addrs:
                self._addrs[r] = addr
                self._idle[r] = []
                self._open[r] = 0
                return
            self._addrs[r] = addr
            for link in self._idle[r]:
                link.close()
            self._open[r] -= len(self._idle[r])
            self._idle[r] = []
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for links in self._idle.values():
                for link in links:
                    link.close()
                links.clear()
            self._cond.notify_all()


#: Content-Type of a zlib-deflated JSON body (control messages above a few KB)
DEFLATED_JSON = "application/x-tierckpt-deflate"


def encode_body(obj: dict) -> tuple[bytes, str]:
    """A control message's body and content type: JSON, deflated above ``PeerLink.COMPRESS_ABOVE`` bytes."""
    import json
    import zlib

    body = json.dumps(obj, separators=(",", ":")).encode()
    if len(body) > PeerLink.COMPRESS_ABOVE:
        return zlib.compress(body, 1), DEFLATED_JSON
    return body, "application/json"


class SharedBody(dict):
    """A control message sent to several peers (a manifest down the commit tree goes to every child):
    serialised and compressed once, on the first send. Not to be changed after that."""

    def encoded(self) -> tuple[bytes, str]:
        import threading

        lock = self.__dict__.setdefault("_lock", threading.Lock())
        with lock:
            if "_encoded" not in self.__dict__:
                self.__dict__["_encoded"] = encode_body(self)
            return self.__dict__["_encoded"]


def placement_partners(settings) -> set[int]:
    """The nodes that placement puts copies of this node's shards on (all alive), this node excluded."""
    if not settings.peers:
        return set()
    nodes = load_peer_list(settings.peers)
    m = Membership(nodes, settings.node_rank, settings.replicas, settings.placement, settings.dead_after)
    return set(m.desired(settings.node_rank, {n.rank for n in m.active()})) - {settings.node_rank}

