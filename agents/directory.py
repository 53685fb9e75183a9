"""Membership from etcd: agents register under a cluster prefix with a lease, and watch it.

With ``--etcd URL[,URL...] --cluster NAME --nodes N --node-rank R --advertise HOST:PORT``, an agent keeps
``/tierckpt/<cluster>/nodes/<R>`` = ``{"addr", "domain", "role", "pid"}`` alive under a lease of about
``dead_after`` seconds, and turns what the prefix holds into the peers file every other part reads
(``<shm>/.peers.txt``, rewritten atomically on every change): trainers and the agent's own peer side use
it as they would a hand-written one, and the agent takes changed addresses in while it runs
(:meth:`agents.replicator.Replicator.reload_peers`). So a node replaced at a new address is seen by every
agent as soon as its new agent registers, with no file to edit anywhere.

* A rank whose key is gone (its lease expired: the agent died, or lost etcd for longer than the lease) is
  asked once, directly; if it does not answer it is declared dead for placement and healing at once,
  without waiting for heartbeats. It keeps its last address in the file.
* A rank not registered yet is listed at an address nothing answers (``unregistered-R.invalid``): its
  peers see it as not started, under the start-up grace, and take its address in when it registers.
  No agent waits at start for the others.
* A rank past ``--nodes`` that registers (a node added to a running cluster, started with its own rank)
  grows the file, and every agent takes it in as a new node.
* A rank retired (``ckpt retire --etcd ... RANK``: its key holds ``role: retired``, with no lease) leaves the
  cluster for good: its line says ``role=retired``, so every agent drops it as a peer, placement and the
  commit quorum count the nodes left, and the heal makes up the copies it held. Its agent, if it still
  runs, stops; no agent may claim the rank again (``--node-rank auto`` takes a free one).
* **etcd down.** The agent keeps serving, committing and restoring with the last membership it saw; no
  node is declared dead because etcd is unreachable (the heartbeats still judge liveness). Registration
  and the watch are retried, and the reason is logged once per outage. A node that joins meanwhile waits.

The client speaks etcd's JSON gateway (``/v3/...``) through aiohttp, already a dependency, rather than a
gRPC client: the few calls used here (lease grant and keep-alive, put, range, watch) are plain JSON, and
the Python gRPC clients for etcd v3 are no longer kept up.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Callable

__all__ = ["EtcdClient", "EtcdDirectory", "EtcdError", "RankTakenError", "UNREGISTERED", "retire_nodes"]

log = logging.getLogger("tierckpt.agent")

#: node ranks a cluster may use (a rank past ``--nodes`` joins the cluster; one past this is a mistake)
MAX_NODES = 1 << 16

#: the address a rank that never registered is listed at (nothing answers there), ``{rank}`` filled in
UNREGISTERED = "unregistered-{rank}.invalid:1"


class EtcdError(ConnectionError):
    """etcd could not be reached, or refused a request."""


def _b64(b: bytes | str) -> str:
    return base64.b64encode(b.encode() if isinstance(b, str) else b).decode()


def _unb64(s: str) -> bytes:
    return base64.b64decode(s)


def _prefix_end(prefix: str) -> str:
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return bytes(raw).decode()


class EtcdClient:
    """The etcd v3 calls membership needs, over the JSON gateway; endpoints are tried in turn."""

    def __init__(self, endpoints: list[str], timeout: float = 5.0) -> None:
        if not endpoints:
            raise ValueError("give at least one etcd endpoint (http://host:2379)")
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.timeout = timeout
        self._session = None

    async def _http(self):
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.timeout))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def call(self, path: str, body: dict) -> dict:
        import aiohttp

        session = await self._http()
        errors = []
        for ep in self.endpoints:
            try:
                async with session.post(f"{ep}/v3/{path}", json=body,
                                        timeout=aiohttp.ClientTimeout(total=self.timeout)) as resp:
                    data = await resp.json(content_type=None)
                    if resp.status != 200:
                        raise EtcdError(f"etcd {ep} refused {path}: {resp.status} {data}")
                    return data
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
                errors.append(f"{ep}: {type(e).__name__}: {e}")
        raise EtcdError(f"etcd unreachable ({'; '.join(errors)})")

    async def grant(self, ttl: int) -> int:
        return int((await self.call("lease/grant", {"TTL": ttl}))["ID"])

    async def keepalive(self, lease: int) -> int:
        """Refresh ``lease``; its TTL, 0 once it expired."""
        got = await self.call("lease/keepalive", {"ID": str(lease)})
        return int(got.get("result", {}).get("TTL", 0))

    async def put(self, key: str, value: bytes, lease: int | None = None) -> None:
        body = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        await self.call("kv/put", body)

    async def get(self, key: str) -> tuple[bytes, int] | None:
        """``key``'s value and the revision of its last change, or None when it does not exist."""
        kvs = (await self.call("kv/range", {"key": _b64(key)})).get("kvs", [])
        return (_unb64(kvs[0].get("value", "")), int(kvs[0]["mod_revision"])) if kvs else None

    async def put_if(self, key: str, value: bytes, lease: int | None, mod_revision: int) -> bool:
        """Put ``key`` under ``lease`` only if its last change is still ``mod_revision`` (0: only if it does not
        exist), in one transaction; whether it was put."""
        cmp = ({"key": _b64(key), "target": "CREATE", "create_revision": "0", "result": "EQUAL"} if not mod_revision
               else {"key": _b64(key), "target": "MOD", "mod_revision": str(mod_revision), "result": "EQUAL"})
        put = {"request_put": {"key": _b64(key), "value": _b64(value), **({"lease": str(lease)} if lease else {})}}
        return bool((await self.call("kv/txn", {"compare": [cmp], "success": [put]})).get("succeeded"))

    async def revoke(self, lease: int) -> None:
        await self.call("lease/revoke", {"ID": str(lease)})

    async def range(self, prefix: str) -> tuple[dict[str, bytes], int]:
        """Every key under ``prefix`` and its value, and the store's revision."""
        got = await self.call("kv/range", {"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix))})
        kvs = {_unb64(kv["key"]).decode(): _unb64(kv.get("value", "")) for kv in got.get("kvs", [])}
        return kvs, int(got["header"]["revision"])

    async def watch(self, prefix: str, start_revision: int, *,
                    one_key: bool = False) -> AsyncIterator[tuple[str, str, bytes]]:
        """``(PUT|DELETE, key, value)`` for every change under ``prefix`` (or to that key alone, ``one_key``)
        from ``start_revision`` on."""
        session = await self._http()
        body = {"create_request": {"key": _b64(prefix), "start_revision": str(start_revision),
                                   **({} if one_key else {"range_end": _b64(_prefix_end(prefix))})}}
        errors = []
        for ep in self.endpoints:
            try:
                async with session.post(f"{ep}/v3/watch", json=body) as resp:
                    async for line in resp.content:
                        if not line.strip():
                            continue
                        msg = json.loads(line).get("result", {})
                        for ev in msg.get("events", ()):
                            kv = ev["kv"]
                            yield ev.get("type", "PUT"), _unb64(kv["key"]).decode(), _unb64(kv.get("value", ""))
                return
            except Exception as e:  # noqa: BLE001 - the next endpoint, then the caller's retry
                errors.append(f"{ep}: {type(e).__name__}: {e}")
        raise EtcdError(f"etcd watch failed ({'; '.join(errors)})")


class RankTakenError(EtcdError):
    """The node rank asked for is held in etcd by another live agent."""


def _entry(value: bytes) -> dict | None:
    try:
        obj = json.loads(value)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


async def _answers(addr: str, timeout: float) -> bool:
    """Whether something accepts a TCP connection at ``host:port`` within ``timeout`` s."""
    host, _, port = addr.rpartition(":")
    try:
        _, w = await asyncio.wait_for(asyncio.open_connection(host.strip("[]"), int(port)), timeout)
    except (OSError, ValueError, asyncio.TimeoutError):
        return False
    w.close()
    with contextlib.suppress(Exception):
        await w.wait_closed()
    return True


def _node_line(obj: dict) -> str:
    line = obj["addr"]
    if obj.get("domain"):
        line += f" domain={obj['domain']}"
    if obj.get("role") in ("memory", "retired"):
        line += f" role={obj['role']}"
    return line


def _retired(obj: dict | None) -> bool:
    return bool(obj) and obj.get("role") == "retired"


class EtcdDirectory:
    """This agent's registration in etcd and the peers file made from the cluster's (see the module docstring).

    ``bootstrap()`` (blocking, before the agent is built) registers and writes the file; ``run()``
    keeps the lease, watches the prefix and rewrites the file; ``on_gone(rank)`` is called when a rank's
    key disappears (lease expired)."""

    def __init__(self, settings, *, on_gone: Callable[[int], None] | None = None, auto_rank: bool = False) -> None:
        self.settings = settings
        #: ``--node-rank auto``: the rank is claimed in etcd at start (see :meth:`_claim_any`)
        self.auto_rank = auto_rank
        self.rank_file = os.path.join(settings.shm, ".node-rank")
        #: called with the reason when another agent took this node's rank over (this one then stops)
        self.on_replaced: Callable[[str], None] | None = None
        self.client = EtcdClient([e.strip() for e in settings.etcd.split(",") if e.strip()],
                                 timeout=max(1.0, settings.peer_timeout / 2))
        self.prefix = f"/tierckpt/{settings.cluster}/nodes/"
        #: the newest commit-root epoch won: ``{"epoch", "node", "addr"}`` (agents/election.py)
        self.root_key = f"/tierckpt/{settings.cluster}/root"
        self.root: dict | None = None
        #: called with each higher root epoch seen in etcd (the election promises it)
        self.on_root_epoch: Callable[[int], None] | None = None
        self.path = os.path.join(settings.shm, ".peers.txt")
        self.ttl = max(2, int(round(settings.etcd_lease or settings.dead_after)))
        self.lease = 0
        #: every rank's last registration (kept when its lease runs out), and the ranks registered now
        self.nodes: dict[int, dict] = {}
        self.registered: set[int] = set()
        self.on_gone = on_gone
        self.outage_since: float | None = None
        self.last_error = ""
        self.revision = 0

    # -- the file ---------------------------------------------------------------------------
    def _me(self, rank: int | None = None) -> dict:
        s = self.settings
        return {"rank": s.node_rank if rank is None else rank, "addr": s.advertise, "domain": s.domain,
                "role": "memory" if s.memory_only else "train", "pid": os.getpid()}

    def _write(self) -> None:
        lines = []
        # --nodes is the cluster's size at start; a node registered past it (one added later) grows the file
        for r in range(max(self.settings.nodes, max(self.nodes, default=-1) + 1)):
            lines.append(_node_line(self.nodes[r]) if r in self.nodes else UNREGISTERED.format(rank=r))
        tmp = f"{self.path}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("".join(f"{ln}\n" for ln in lines))
        os.replace(tmp, self.path)

    def _take(self, key: str, value: bytes | None) -> int | None:
        """Apply one key's value (None: deleted); the rank it was about, or None."""
        try:
            rank = int(key[len(self.prefix):])
        except ValueError:
            return None
        if not 0 <= rank < MAX_NODES:
            log.warning("etcd lists node %s, outside the ranks 0-%d a cluster may use: ignored", key, MAX_NODES - 1)
            return None
        if rank >= self.settings.nodes and rank not in self.nodes:
            log.info("node %d registered in etcd past the %d nodes cluster %s started with: it joins", rank,
                     self.settings.nodes, self.settings.cluster)
        if value is None:  # its lease ran out: it keeps its last address (it may register again)
            self.registered.discard(rank)
            return rank
        try:
            obj = json.loads(value)
            if not isinstance(obj, dict) or not isinstance(obj.get("addr"), str):
                raise ValueError("no addr")
        except ValueError as e:
            log.warning("etcd holds a malformed entry for node %d (%s): ignored", rank, e)
            return None
        self.nodes[rank] = obj
        if _retired(obj):
            self.registered.discard(rank)
        else:
            self.registered.add(rank)
        return rank

    # -- start ------------------------------------------------------------------------------
    def bootstrap(self) -> str:
        """Register (retrying for up to ``startup_grace`` while etcd cannot be reached) and write the peers file
        from what is registered now. Returns the file's path."""
        return asyncio.run(self._bootstrap())

    async def _bootstrap(self) -> str:
        deadline = time.monotonic() + self.settings.startup_grace
        try:
            while True:
                try:
                    # a lease long enough for the agent to start: the first thing run() does is register again
                    # under a lease of the usual length, so start-up time never passes for a death
                    ttl = self.ttl + int(self.settings.startup_grace)
                    if self.auto_rank:
                        await self._claim_any(ttl)
                    else:
                        await self._claim(self.settings.node_rank, ttl)
                    kvs, self.revision = await self.client.range(self.prefix)
                    break
                except RankTakenError:
                    raise
                except EtcdError as e:
                    if time.monotonic() > deadline:
                        raise
                    log.warning("waiting for etcd to register this node: %s", e)
                    await asyncio.sleep(1.0)
            self.nodes, self.registered = {}, set()
            for k, v in kvs.items():
                self._take(k, v)
            missing = self.settings.nodes - len(self.nodes)
            if missing:
                log.info("%d of %d nodes registered in etcd so far; the others are taken in as they register",
                         len(self.nodes), self.settings.nodes)
            self._write()
            return self.path
        finally:
            await self.client.close()

    async def _register(self, ttl: int | None = None) -> None:
        """This node's key again, under a new lease (the agent's first registration was :meth:`_claim`'s)."""
        await self._claim(self.settings.node_rank, ttl or self.ttl)

    async def _claim(self, rank: int, ttl: int) -> None:
        """Register as node ``rank`` under a new lease of ``ttl`` s, in one transaction against what the key held
        when looked at. The key may be free, or this node's own (its address: an earlier agent on this
        machine), or another address's that does not answer (a machine replaced: the new one takes its rank
        over). Held by another address that answers, it is not taken: RankTakenError."""
        key = f"{self.prefix}{rank}"
        for _ in range(8):
            held = await self.client.get(key)
            rev = 0
            if held is not None:
                value, rev = held
                other = _entry(value)
                if _retired(other):
                    raise RankTakenError(
                        f"node rank {rank} of cluster {self.settings.cluster!r} is retired in etcd (it left the "
                        "cluster; the ranks after it keep theirs): start this node with --node-rank auto, or a "
                        "rank nobody holds, to join as a new node")
                addr = other.get("addr") if other else None
                if addr and (addr, other.get("pid")) != (self.settings.advertise, os.getpid()):
                    # not this agent's own key: someone answering there (another agent, at this address too)
                    # holds the rank; nobody answering means that agent is gone
                    if await _answers(addr, max(1.0, self.settings.peer_timeout / 2)):
                        raise RankTakenError(
                            f"node rank {rank} of cluster {self.settings.cluster!r} is registered in etcd by a live "
                            f"agent at {addr} (pid {other.get('pid')}): give this node another --node-rank (or "
                            "--node-rank auto), or stop that agent first")
                if addr and addr != self.settings.advertise:
                    log.warning("node rank %d was registered by %s, which does not answer: this node (%s) takes it "
                                "over", rank, addr, self.settings.advertise)
            if await self._put_claim(rank, ttl, rev):
                return
        raise EtcdError(f"node rank {rank}: its key in etcd kept changing while this agent registered")

    async def _put_claim(self, rank: int, ttl: int, rev: int) -> bool:
        """Put this node's key for ``rank`` under a new lease if the key's last change is still ``rev`` (0: if
        it does not exist); then this node is ``rank`` (kept in ``<shm>/.node-rank``) and its old lease is
        revoked. False, with nothing changed, when the key changed since it was read."""
        lease = await self.client.grant(ttl)
        if not await self.client.put_if(f"{self.prefix}{rank}", json.dumps(self._me(rank)).encode(), lease, rev):
            with contextlib.suppress(EtcdError):
                await self.client.revoke(lease)
            return False
        self.settings.node_rank = rank
        old, self.lease = self.lease, lease
        if old:
            with contextlib.suppress(EtcdError):
                await self.client.revoke(old)
        self._remember(rank)
        return True

    async def _claim_any(self, ttl: int) -> None:
        """``--node-rank auto``: the rank this machine had before (kept in ``<shm>/.node-rank``) if it can
        have it back, else the lowest rank nobody holds, claimed in a transaction (agents starting together
        each get their own)."""
        try:
            with open(self.rank_file) as f:
                before = int(f.read().strip())
        except (OSError, ValueError):
            before = None
        if before is not None and 0 <= before < MAX_NODES:
            try:
                await self._claim(before, ttl)
                log.info("node rank %d claimed in etcd again (this machine's before)", before)
                return
            except RankTakenError as e:
                log.warning("%s; this node takes a free rank instead", e)
        for _ in range(64):
            kvs, _ = await self.client.range(self.prefix)
            held = set()
            for k in kvs:
                with contextlib.suppress(ValueError):
                    held.add(int(k[len(self.prefix):]))
            rank = next(r for r in range(MAX_NODES + 1) if r not in held)
            if rank >= MAX_NODES:
                raise RankTakenError(f"cluster {self.settings.cluster!r} has every one of its {MAX_NODES} ranks taken")
            if await self._put_claim(rank, ttl, 0):
                log.info("node rank %d claimed in etcd (the lowest free one)", rank)
                return
            # another node claimed it first: the next free one
        raise EtcdError("no free node rank could be claimed in etcd: the cluster's ranks kept changing")

    def _remember(self, rank: int) -> None:
        tmp = f"{self.rank_file}.tmp"
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(f"{rank}\n")
        os.replace(tmp, self.rank_file)

    # -- running ----------------------------------------------------------------------------
    async def run(self) -> None:
        """Keep this node's lease and watch the cluster until cancelled."""
        try:
            await asyncio.gather(self._keep(), self._watch(), self._watch_root())
        finally:
            await self.client.close()

    def _outage(self, e: BaseException) -> None:
        self.last_error = str(e)
        if self.outage_since is None:
            self.outage_since = time.monotonic()
            log.warning("etcd unreachable (%s): keeping the last membership seen; no node is declared dead for "
                        "this, and nodes that join wait until it is back", e)

    def _back(self) -> None:
        if self.outage_since is not None:
            log.info("etcd reachable again after %.1f s", time.monotonic() - self.outage_since)
        self.outage_since = None
        self.last_error = ""

    async def _keep(self) -> None:
        try:
            await self._register()
        except RankTakenError as e:
            self._replaced(str(e))
            return
        except EtcdError as e:
            self._outage(e)
        while True:
            await asyncio.sleep(self.ttl / 3)
            try:
                if not self.lease or await self.client.keepalive(self.lease) == 0:
                    await self._register()  # the lease ran out (etcd was away longer than it): register again
                self._back()
            except RankTakenError as e:
                self._replaced(str(e))
                return
            except EtcdError as e:
                self._outage(e)

    async def _watch(self) -> None:
        while True:
            try:
                kvs, rev = await self.client.range(self.prefix)
                self._apply_all(kvs)
                self.revision = rev
                self._back()
                if self._taken_over(kvs.get(f"{self.prefix}{self.settings.node_rank}")):
                    return
                async for kind, key, value in self.client.watch(self.prefix, rev + 1):
                    if kind != "DELETE" and key == f"{self.prefix}{self.settings.node_rank}" \
                            and self._taken_over(value):
                        return
                    before = dict(self.nodes)
                    rank = self._take(key, None if kind == "DELETE" else value)
                    if rank is None:
                        continue
                    if self.nodes != before:
                        self._write()
                    if kind == "DELETE" and rank != self.settings.node_rank and self.on_gone is not None:
                        self.on_gone(rank)
            except EtcdError as e:
                self._outage(e)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a broken stream: list again and watch again
                self._outage(e)
            await asyncio.sleep(1.0)

    def _taken_over(self, value: bytes | None) -> bool:
        """Whether this node's key holds another agent's registration (listed or watched): then this agent
        stops being the node (:meth:`_replaced`)."""
        other = _entry(value) if value is not None else None
        if other is None or (other.get("addr"), other.get("pid")) == (self.settings.advertise, os.getpid()):
            return False
        if _retired(other):
            self._replaced(f"node rank {self.settings.node_rank} was retired in etcd (ckpt retire)")
        else:
            self._replaced(f"node rank {self.settings.node_rank} was taken over in etcd by the agent at "
                           f"{other.get('addr')} (pid {other.get('pid')})")
        return True

    def _replaced(self, why: str) -> None:
        """Another agent holds this node's rank now (this machine was cut off long enough to be replaced), or
        the rank was retired: this agent must not act as that node any more."""
        log.error("%s: this agent stops (its node was %s); start it again with --node-rank auto, or another "
                  "rank, to join as a new node", why, "retired" if "retired in etcd" in why else "replaced")
        if self.on_replaced is not None:
            self.on_replaced(why)

    # -- the commit root's epoch --------------------------------------------------------------
    async def record_root(self, epoch: int, node: int) -> int | None:
        """Write that ``node`` won ``epoch``, unless etcd holds a higher epoch (returned then). None once written,
        or when etcd cannot be reached (the votes decide alone; see agents/election.py)."""
        value = json.dumps({"epoch": epoch, "node": node, "addr": self.settings.advertise}).encode()
        try:
            for _ in range(8):
                held = await self.client.get(self.root_key)
                rev = 0
                if held is not None:
                    obj, rev = _entry(held[0]) or {}, held[1]
                    known = obj.get("epoch")
                    if isinstance(known, int) and (known > epoch or known == epoch and obj.get("node") != node):
                        return known
                if await self.client.put_if(self.root_key, value, None, rev):
                    self._saw_root(json.loads(value))
                    return None
        except EtcdError as e:
            self._outage(e)
            return None
        return None

    def _saw_root(self, obj: dict | None) -> None:
        if not obj or not isinstance(obj.get("epoch"), int):
            return
        if self.root is None or obj["epoch"] > self.root.get("epoch", -1):
            self.root = obj
            if self.on_root_epoch is not None:
                self.on_root_epoch(obj["epoch"])

    async def _watch_root(self) -> None:
        while True:
            try:
                kvs, rev = await self.client.range(self.root_key)
                if self.root_key in kvs:
                    self._saw_root(_entry(kvs[self.root_key]))
                async for kind, _key, value in self.client.watch(self.root_key, rev + 1, one_key=True):
                    if kind != "DELETE":
                        self._saw_root(_entry(value))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - etcd away or a broken stream: look again
                self._outage(e)
            await asyncio.sleep(1.0)

    def _apply_all(self, kvs: dict[str, bytes]) -> None:
        before, was = dict(self.nodes), set(self.registered)
        self.registered = set()
        for k, v in kvs.items():
            self._take(k, v)
        if self.nodes != before:
            self._write()
        if self.on_gone is not None:
            for r in was - self.registered - {self.settings.node_rank}:
                self.on_gone(r)

    def status(self) -> dict:
        return {"etcd": self.client.endpoints, "cluster": self.settings.cluster, "lease": self.lease,
                "registered": sorted(self.registered), "revision": self.revision, "root": self.root,
                "outage_s": None if self.outage_since is None else round(time.monotonic() - self.outage_since, 1),
                "last_error": self.last_error}


async def retire_nodes(endpoints: str, cluster: str, ranks: list[int], *, force: bool = False,
                       timeout: float = 5.0) -> list[str]:
    """Mark ``ranks`` of ``cluster`` retired in etcd: each key is put as ``{"rank", "addr", "role": "retired",
    "last_addr"}`` with no lease, in a transaction against what it held when read. A rank registered by an
    agent that answers is refused (ValueError, before any rank is changed) unless ``force``: retiring it
    stops that agent. Returns one line per rank saying what was done."""
    bad = [r for r in ranks if not 0 <= r < MAX_NODES]
    if bad:
        raise ValueError(f"node rank {bad[0]} is outside the ranks 0-{MAX_NODES - 1} a cluster may use")
    client = EtcdClient([e.strip() for e in endpoints.split(",") if e.strip()], timeout=timeout)
    prefix = f"/tierckpt/{cluster}/nodes/"

    async def look(rank: int) -> tuple[dict, int]:
        held = await client.get(f"{prefix}{rank}")
        obj, rev = (_entry(held[0]) or {}, held[1]) if held is not None else ({}, 0)
        addr = obj.get("addr")
        if not _retired(obj) and isinstance(addr, str) and not force and await _answers(addr, timeout):
            raise ValueError(
                f"node {rank} of cluster {cluster!r} is registered by an agent that answers at {addr}: stop it "
                "first (the job's ranks must be off that node), or pass --force to retire it anyway (its agent "
                "then stops); no node was retired")
        return obj, rev

    done: list[str] = []
    try:
        for rank in ranks:  # every rank checked before any is changed
            await look(rank)
        for rank in ranks:
            for _ in range(8):
                obj, rev = await look(rank)
                if _retired(obj):
                    done.append(f"node {rank}: already retired")
                    break
                addr = obj.get("addr") if isinstance(obj.get("addr"), str) else None
                # listed at an address of its own that nothing answers: the machine may join again, as a new rank
                value = json.dumps({"rank": rank, "addr": f"retired-{rank}.invalid:1", "role": "retired",
                                    "last_addr": addr, "retired_at": time.time()}).encode()
                if await client.put_if(f"{prefix}{rank}", value, None, rev):
                    done.append(f"node {rank}: retired" + (f" (last at {addr})" if addr else " (never registered)"))
                    break
            else:
                raise EtcdError(f"node rank {rank}: its key in etcd kept changing while it was being retired")
    finally:
        await client.close()
    return done
