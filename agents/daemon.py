"""The node agent: owns the memory tier, takes shards from trainers, drains them to disk and S3.

Life of a step, as the agent sees it::

    begin   (each rank)  lease a pre-faulted staging slot in the memory folder
    commit  (each rank)  the slot becomes the rank's shard (a hard link); checksum it
    ── all ``world`` ranks committed ──
    manifest written to the memory tier (the step is now complete in memory)
    drain   disk every ``disk_every`` saves, S3 every ``s3_every`` saves:
            every shard first, the manifest last, in each tier
    trim    each tier keeps its newest ``keep_*`` complete steps

Everything slow (checksums, copies, uploads) runs in worker threads, so the
agent keeps answering trainers while it drains. A failure in the background is
stored and handed to the job's trainers, once, in the answer to their next
request. The agent never crashes on a bad request: it answers with an error.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import fcntl
import functools
import json
import logging
import os
import signal
import socket
import struct
import time
import zlib
from dataclasses import dataclass, field

from recovery import step_index
from recovery.inventory import scan_tier
from tiers import keys
from tiers.base import Tier
from tiers.checksum import checksum_file
from tiers.disk import DiskTier
from tiers.errors import KeyNotFoundError, ManifestError, TierError
from tiers.layout import Layout
from tiers.manifest import JsonEntry, Manifest, ShardInfo, TensorChunk, validate_layout
from tiers.memory import MemoryTier

from .config import Settings
from .protocol import MAX_LINE, PROTOCOL_VERSION
from .dissemination import Disseminator, View, tree_children, tree_parent
from .replication import DEFLATED_JSON, Membership, PeerLink, load_peer_list, post_json

__all__ = ["Agent", "AgentAlreadyRunningError", "run_agent"]

log = logging.getLogger("tierckpt.agent")


#: the largest control message (commit rows, manifests, views) accepted once inflated, in bytes
MAX_CONTROL_BODY = 64 << 20


class AgentAlreadyRunningError(RuntimeError):
    """Another agent already owns the memory folder."""


class RequestError(ValueError):
    """A request is malformed or not allowed; answered to the client, never fatal."""


class UnknownLayoutError(RequestError):
    """A commit names a layout by digest that this agent does not hold: the trainer sends its entries again."""


@dataclass
class _Pending:
    """A step some ranks have committed: per-rank layouts and checksums as they arrive."""

    world: int
    save_index: int
    metadata: dict
    sizes: dict[int, int] = field(default_factory=dict)
    #: each rank's JSON values, parsed and checked once when they arrive
    entries: dict[int, tuple] = field(default_factory=dict)
    #: each rank's layout digest
    layouts: dict[int, str] = field(default_factory=dict)
    checksums: dict[int, asyncio.Future] = field(default_factory=dict)
    nodes: dict[int, int] = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    #: the manifest is being built (all ``world`` rows are here)
    finishing: bool = False


@dataclass(eq=False)
class _Conn:
    """One trainer connection; ``pid`` is its process (from the socket's credentials)."""

    pid: int = 0
    leases: set[str] = field(default_factory=set)
    jobs: set[str] = field(default_factory=set)


class _ByteBudget:
    """Bounds shard bytes being drained at once (a shard larger than the bound runs alone)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._cond = asyncio.Condition()

    async def acquire(self, n: int) -> int:
        n = min(n, self.limit)
        async with self._cond:
            await self._cond.wait_for(lambda: self.used + n <= self.limit)
            self.used += n
        return n

    async def release(self, n: int) -> None:
        async with self._cond:
            self.used -= n
            self._cond.notify_all()


class Agent:
    """One node's checkpoint agent. ``await agent.serve()`` runs it until shutdown."""

    def __init__(self, settings: Settings, *, embedded: bool = False, idle_exit: float | None = None) -> None:
        self.settings = settings.validate()
        self.embedded = embedded
        self.idle_exit = idle_exit
        self.memory = MemoryTier(settings.shm)
        self.disk: Tier | None = DiskTier(settings.disk, compress=settings.compress) if settings.disk else None
        self.s3: Tier | None = None
        if settings.s3:
            from tiers.s3 import S3Tier

            self.s3 = S3Tier.from_url(
                settings.s3, endpoint_url=settings.s3_endpoint, retry_deadline=settings.s3_retry_deadline
            )
        self.lower: list[Tier] = [t for t in (self.disk, self.s3) if t is not None]
        #: layouts this agent has parsed, by (job, digest): each is parsed and stored once, then named by digest
        self._layouts: dict[tuple[str, str], Layout] = {}
        #: (place, job, digest) of layout objects known to be stored in a place (a tier name, or a peer node)
        self._layout_at: set[tuple[str, str, str]] = set()
        self._layout_pushes: dict[tuple[int, str, str], asyncio.Future] = {}
        self._layouts_trimmed: dict[tuple[str, str], float] = {}
        self._pending: dict[tuple[str, int], _Pending] = {}
        self._leases: set[str] = set()
        self._lease_conn: dict[str, _Conn] = {}
        self._errors: dict[str, list[str]] = {}
        self._draining: dict[tuple[str, int], set[str]] = {}
        self._settled: dict[tuple[str, int], asyncio.Event] = {}
        #: per job, the newest step this agent has any sign of: objects in any tier at start-up, a shard
        #: committed here, a peer's commit record. A step reaches disk or S3 only after it was committed in
        #: some node's memory, and every live node is sent every commit record, so no tier can hold a newer
        #: step of a job this agent has seen (unless it was cut off from its peers meanwhile)
        self._seen_newest: dict[str, int] = {}
        self._lower_known = False
        #: copies of local shards to peers still under way, per step (``wait`` waits for them too)
        self._copies: dict[tuple[str, int], set[asyncio.Future]] = {}
        self._queues: dict[str, asyncio.Queue] = {}
        self._workers: list[asyncio.Task] = []
        self._slot_cond: asyncio.Condition | None = None
        self._budget: _ByteBudget | None = None
        self._conns: set[_Conn] = set()
        self._last_activity = time.monotonic()
        self._stop: asyncio.Event | None = None
        self._lock_fd: int | None = None
        self._server: asyncio.AbstractServer | None = None
        self.stats = {"saves": 0, "bytes_in": 0, "drained": {t.name: 0 for t in self.lower}, "replicated_bytes": 0}
        self.me = settings.node_rank
        self.members: Membership | None = None
        self.peer_tiers: dict[int, Tier] = {}
        self.peer_server = None
        self._secret: bytes | None = None
        self._client_ssl = None
        self._tasks: list[asyncio.Task] = []
        self._heal_now: asyncio.Event | None = None
        self._pushing: set[tuple[int, str]] = set()
        #: pulled copies waiting for the primary's checksum: token -> (key, temp file, checksum, since)
        self._unpublished: dict[str, tuple[str, str, str, float]] = {}
        #: the warm restore run at start (state idle|running|done, steps, shards, bytes, seconds, errors)
        self.prefetch: dict = {"state": "idle", "steps": {}, "shards": 0, "bytes": 0, "seconds": 0.0, "errors": []}
        self._prefetched: asyncio.Event | None = None
        self.dis: Disseminator | None = None
        self._links: dict[int, PeerLink] = {}
        self._ctrl_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._out_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pull_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._sources_cache: tuple[frozenset[int], set[int]] | None = None
        if settings.peers:
            self._setup_peers()

    def _setup_peers(self) -> None:
        from tiers.peer import PeerTier
        from tiers.wire import TokenBucket, load_secret

        from .peer_server import PeerServer

        s = self.settings
        nodes = load_peer_list(s.peers)
        self.members = Membership(nodes, s.node_rank, s.replicas, s.placement, s.dead_after)
        self._secret = load_secret(s.secret_file) if s.secret_file else None
        server_ssl = None
        if s.tls_cert:
            import ssl

            server_ssl = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            server_ssl.load_cert_chain(s.tls_cert, s.tls_key)
            self._client_ssl = ssl.create_default_context(cafile=s.tls_ca)
        bucket = TokenBucket(s.peer_bandwidth) if s.peer_bandwidth else None
        for n in nodes:
            if n.rank != self.me:
                self.peer_tiers[n.rank] = PeerTier(n.addr, secret=self._secret, node=self.me, timeout=s.peer_timeout,
                                                   ssl_context=self._client_ssl, bucket=bucket)
        mine = nodes[self.me]
        self._bucket = bucket
        # control messages (commit tree, heartbeats) get their own threads and one keep-alive link per peer,
        # so neither the peer server (its own threads) nor the drains (the default executor) wait behind them
        self._ctrl_pool = concurrent.futures.ThreadPoolExecutor(max(4, 2 * s.fanout + 4),
                                                                thread_name_prefix="tierckpt-ctrl")
        # outgoing peer requests (which wait on a remote) and pulls served for a peer's fetch (which only wait
        # on the remote's sendfile) each have their own threads: neither can starve the other, nor serving
        self._out_pool = concurrent.futures.ThreadPoolExecutor(16, thread_name_prefix="tierckpt-out")
        self._pull_pool = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="tierckpt-pull")
        self._links = {n.rank: PeerLink(n.addr, secret=self._secret, node=self.me, timeout=s.peer_timeout,
                                        ssl_context=self._client_ssl) for n in nodes if n.rank != self.me}
        self.dis = Disseminator(self.me, alive=self.members.alive, post=self._post, on_rows=self._take_rows,
                                on_manifest=self._receive_manifest, on_view=self._adopt_view,
                                on_report=self.members.mark, dead=self.members.dead, fanout=s.fanout,
                                resend_after=s.peer_timeout, retry_after=s.heartbeat)
        self.peer_server = PeerServer(
            self.memory, host=mine.host, port=mine.port, secret=self._secret, node=self.me, ssl_context=server_ssl,
            extra_routes=[("POST", "/v1/up", self._tree_route(self.dis.handle_up)),
                          ("POST", "/v1/down", self._tree_route(self.dis.handle_down)),
                          ("POST", "/v1/fetch", self._http_fetch), ("POST", "/v1/publish", self._http_publish)],
            metrics_cb=self._metrics, long_paths=("/v1/fetch",),
        )

    # ------------------------------------------------------------------ lifecycle
    def _take_lock(self) -> None:
        path = os.path.join(self.memory.root, ".agent.lock")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            raise AgentAlreadyRunningError(
                f"another agent already owns {self.memory.root}: use it, or stop it first"
            ) from e
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._lock_fd = fd

    async def start(self) -> None:
        """Take the memory folder, rebuild the inventory, open the socket."""
        self._take_lock()
        self._stop = asyncio.Event()
        self._slot_cond = asyncio.Condition()
        self._budget = _ByteBudget(self.settings.max_inflight_bytes)
        for t in self.lower:
            self._queues[t.name] = asyncio.Queue()
            self._workers.append(asyncio.create_task(self._drain_worker(t), name=f"drain-{t.name}"))
        await asyncio.to_thread(self._sweep_temp_files)
        await self._rebuild()
        if self.peer_server is not None:
            await self.peer_server.start()
            self.dis.start()
            self.dis.report("alive", self.me)  # a restarted node tells the root it is back
            self._heal_now = asyncio.Event()
            self._tasks.append(asyncio.create_task(self._heartbeat_loop(), name="heartbeat"))
            self._tasks.append(asyncio.create_task(self._heal_loop(), name="heal"))
            self._prefetched = asyncio.Event()
            if self.settings.prefetch:
                self.prefetch["state"] = "running"
                self._tasks.append(asyncio.create_task(self._prefetch(), name="prefetch"))
            else:
                self._prefetched.set()
        path = self.settings.socket_path
        if not path.startswith("\0"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self._server = await asyncio.start_unix_server(self._handle, path=path, limit=MAX_LINE)
        if not path.startswith("\0"):
            os.chmod(path, 0o600)
        log.info(
            "agent %d ready on %s (memory %s, disk %s, s3 %s)",
            os.getpid(), path.replace("\0", "@"), self.memory.root, self.settings.disk, self.settings.s3,
        )

    async def serve(self) -> None:
        """Run until shutdown is asked for or a signal arrives, then stop gracefully."""
        await self.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self._stop.set)
        watcher = asyncio.create_task(self._idle_watch()) if self.idle_exit else None
        await self._stop.wait()
        if watcher:
            watcher.cancel()
        await self.stop()

    async def stop(self) -> None:
        """Stop taking requests; finish in-flight writes for up to ``grace`` s, then abandon them."""
        if self._server:
            self._server.close()
        deadline = time.monotonic() + self.settings.grace
        while any(self._draining.values()) or any(not q.empty() for q in self._queues.values()):
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        abandoned = {f"{j}/step-{s}": sorted(t) for (j, s), t in self._draining.items() if t}
        for w in self._workers + self._tasks:
            w.cancel()
        if self.dis is not None:
            await self.dis.stop()
        if self.peer_server is not None:
            with contextlib.suppress(Exception):
                await self.peer_server.stop()
        for link in self._links.values():
            link.close()
        for pool in (self._ctrl_pool, self._out_pool, self._pull_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        if abandoned:
            log.warning("agent stopping with writes abandoned (left incomplete, never reported complete): %s",
                        json.dumps(abandoned))
        else:
            log.info("agent stopping: every write finished")
        path = self.settings.socket_path
        if not path.startswith("\0"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        for t in self.lower:
            with contextlib.suppress(Exception):
                t.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    async def _idle_watch(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            busy = self._conns or any(self._draining.values()) or any(not q.empty() for q in self._queues.values())
            if busy:
                self._last_activity = time.monotonic()
            elif time.monotonic() - self._last_activity > self.idle_exit:
                log.info("no trainer connected for %.0f s: embedded agent exits", self.idle_exit)
                self._stop.set()
                return

    def _sweep_temp_files(self) -> None:
        for root in [self.memory.root] + [t.root for t in self.lower if isinstance(t, DiskTier)]:
            for folder, dirs, files in os.walk(root):
                dirs[:] = [d for d in dirs if d != ".slots"]
                for f in files:
                    if f.startswith(".tmp-"):
                        with contextlib.suppress(OSError):
                            os.unlink(os.path.join(folder, f))

    async def _rebuild(self) -> None:
        """After a (re)start: drop steps never committed, re-queue drains a crash interrupted."""
        inv = await asyncio.to_thread(scan_tier, self.memory)
        lower = {t.name: await asyncio.to_thread(scan_tier, t) for t in self.lower}
        for linv in [inv, *lower.values()]:
            for job, steps in linv.steps.items():
                if steps:
                    self._seen(job, max(steps))
        self._lower_known = all(linv.error is None for linv in lower.values())
        for job, steps in inv.steps.items():
            for step, st in sorted(steps.items()):
                if st.manifest is None:
                    log.info("dropping %s step %d from memory: it was never completed (%s)",
                             job, step, st.problem or "no manifest")
                    await asyncio.to_thread(self._delete_step, self.memory, job, step)
                    continue
                mine = [sh for sh in st.manifest.shards if sh.node == self.me]
                if any(st.shards.get(sh.rank) != sh.size for sh in mine):
                    continue
                save_index = int(st.manifest.metadata.get("save_index", step))
                for t in self._targets(save_index):
                    have = lower[t.name].job(job).get(step)
                    if lower[t.name].error is None and (have is None or not have.complete):
                        log.info("re-queueing %s step %d for the %s tier (interrupted before)", job, step, t.name)
                        self._enqueue(t, job, step)
        await asyncio.to_thread(step_index.rebuild_places, [inv, *lower.values()])
        await self._trim_all()

    # ------------------------------------------------------------------ requests
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Conn()
        sock = writer.get_extra_info("socket")
        try:
            cred = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            conn.pid = struct.unpack("3i", cred)[0]
        except (OSError, AttributeError):
            conn.pid = id(conn)
        self._conns.add(conn)
        try:
            while True:
                try:
                    line = await reader.readline()
                except (asyncio.LimitOverrunError, ValueError):
                    await self._reply(writer, {"ok": False, "error": "RequestError",
                                               "message": f"request line over {MAX_LINE} bytes"})
                    break
                if not line:
                    break
                self._last_activity = time.monotonic()
                try:
                    req = json.loads(line)
                    if not isinstance(req, dict) or not isinstance(req.get("op"), str):
                        raise RequestError("a request is a JSON object with a string 'op'")
                    handler = getattr(self, f"_op_{req['op']}", None)
                    if handler is None:
                        raise RequestError(f"unknown op {req['op']!r}")
                    resp = await handler(conn, req)
                    resp["ok"] = True
                except (RequestError, ValueError, TierError, OSError, KeyError, TypeError) as e:
                    resp = {"ok": False, "error": type(e).__name__, "message": str(e)}
                except Exception as e:  # the agent must outlive any request
                    log.exception("request failed")
                    resp = {"ok": False, "error": type(e).__name__, "message": str(e)}
                await self._reply(writer, resp)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._conns.discard(conn)
            for slot in conn.leases:
                self._leases.discard(slot)
                self._lease_conn.pop(slot, None)
            if conn.leases:
                async with self._slot_cond:
                    self._slot_cond.notify_all()
            with contextlib.suppress(Exception):
                writer.close()

    @staticmethod
    async def _reply(writer: asyncio.StreamWriter, resp: dict) -> None:
        writer.write(json.dumps(resp, separators=(",", ":")).encode() + b"\n")
        await writer.drain()

    def _take_errors(self, job: str | None) -> list[str]:
        if job is None:
            return []
        return self._errors.pop(job, [])

    async def _op_hello(self, conn: _Conn, req: dict) -> dict:
        return {"version": PROTOCOL_VERSION, "pid": os.getpid(), "embedded": self.embedded,
                "settings": self.settings.to_dict()}

    async def _op_begin(self, conn: _Conn, req: dict) -> dict:
        job = keys.check_job(req["job"])
        rank = keys.check_rank(req["rank"])
        nbytes = int(req["nbytes"])
        if nbytes < 0:
            raise RequestError("nbytes must be >= 0")
        conn.jobs.add(job)
        wait = self.settings.full_policy != "skip" and req.get("wait", True)
        deadline = time.monotonic() + (self.settings.slot_wait if wait else 0)
        while True:
            slot = self._free_slot(job, rank)
            if slot is not None:
                self._leases.add(slot)
                conn.leases.add(slot)
                self._lease_conn[slot] = conn
                try:
                    await asyncio.to_thread(self.memory.prepare_slot, slot, nbytes)
                except BaseException:
                    self._leases.discard(slot)
                    conn.leases.discard(slot)
                    raise
                return {"slot": slot, "errors": self._take_errors(job)}
            await self._trim_memory(job)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                busy = sorted(f"step {s} ({', '.join(sorted(t))})" for (j, s), t in self._draining.items()
                              if j == job and t)
                why = (f"no free staging slot for {job} rank {rank}: "
                       f"{'still draining: ' + '; '.join(busy) if busy else 'every slot holds a retained step'}"
                       f"; save skipped (raise keep_memory or drain faster)")
                if wait:
                    log.warning(why)
                return {"skip": why, "errors": self._take_errors(job)}
            async with self._slot_cond:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._slot_cond.wait(), timeout=min(remaining, 1.0))

    def _free_slot(self, job: str, rank: int) -> str | None:
        slots = self.memory.slots(job, rank)
        for p in slots:
            if p not in self._leases and self.memory.slot_is_free(p):
                return p
        if len(slots) < self.settings.keep_memory + 1:
            used = {os.path.basename(p) for p in slots}
            i = next(i for i in range(len(slots) + 1) if f"slot-{i}" not in used)
            return self.memory.new_slot_path(job, rank, i)
        return None

    async def _op_release(self, conn: _Conn, req: dict) -> dict:
        slot = str(req["slot"])
        owner = self._lease_conn.get(slot)
        if owner is not None and owner.pid == conn.pid:
            owner.leases.discard(slot)
            self._leases.discard(slot)
            self._lease_conn.pop(slot, None)
        async with self._slot_cond:
            self._slot_cond.notify_all()
        return {}

    async def _op_commit(self, conn: _Conn, req: dict) -> dict:
        job = keys.check_job(req["job"])
        step = keys.check_step(req["step"])
        rank = keys.check_rank(req["rank"])
        world = int(req["world"])
        nbytes = int(req["nbytes"])
        slot = str(req["slot"])
        if not 0 <= rank < world:
            raise RequestError(f"rank {rank} is outside world {world}")
        owner = self._lease_conn.get(slot)
        if owner is None or owner.pid != conn.pid:
            raise RequestError(f"slot {slot} is not leased to this trainer (call begin first)")
        if os.path.getsize(slot) != nbytes:
            raise RequestError(f"slot holds {os.path.getsize(slot)} bytes, commit says {nbytes}")
        layout, values = await self._commit_layout(job, rank, nbytes, req)
        if not isinstance(req.get("metadata", {}), dict):
            raise RequestError("metadata must be a JSON object")
        key = (job, step)
        self._seen(job, step)
        pend = self._pending.get(key)
        if pend is None:
            if (job, step) in self._settled and self._settled[key].is_set():
                raise RequestError(f"step {step} of {job} is already committed")
            pend = self._pending[key] = _Pending(world, int(req.get("save_index", step)), req.get("metadata") or {})
            self._settled.setdefault(key, asyncio.Event())
        if pend.world != world:
            raise RequestError(f"rank {rank} says world {world}, an earlier rank said {pend.world}")
        if rank in pend.sizes:
            raise RequestError(f"rank {rank} already committed step {step} of {job}")
        await asyncio.to_thread(self.memory.adopt, keys.shard_key(job, step, rank), slot)
        owner.leases.discard(slot)
        self._leases.discard(slot)
        self._lease_conn.pop(slot, None)
        pend.sizes[rank] = nbytes
        pend.entries[rank] = values
        pend.layouts[rank] = layout.digest
        pend.nodes[rank] = self.me
        pend.checksums[rank] = asyncio.ensure_future(asyncio.to_thread(checksum_file, slot, nbytes))
        self.stats["bytes_in"] += nbytes
        if self.members is not None:
            # the rows go up the commit tree; its root builds the manifest
            asyncio.create_task(self._share(job, step, rank, world, nbytes, pend))
        elif len(pend.sizes) == world and not pend.finishing:
            pend.finishing = True
            asyncio.create_task(self._finish_step(job, step, pend))
        return {"errors": self._take_errors(job)}

    async def _commit_layout(self, job: str, rank: int, nbytes: int, req: dict) -> tuple[Layout, tuple]:
        """The committing rank's layout and JSON values.

        A trainer sends its layout's entries when the layout is new (or changed) and names it by digest
        (``layout``) otherwise; ``values`` are its JSON values as ``[[name, value], ...]``. Entries that mix
        tensor chunks and JSON values (``{"kind": "json"}``) are read too. A new layout is checked against
        the shard, stored once in the memory tier and named by digest from then on. Raises
        UnknownLayoutError for a digest this agent does not hold, so the trainer sends the entries.
        """
        where = f"rank {rank} layout"
        values: list = []
        entries = req.get("entries")
        digest = req.get("layout")
        if entries is not None:
            parsed = validate_layout(entries, nbytes, where)
            layout = Layout(tuple(e for e in parsed if isinstance(e, TensorChunk)))
            values = [e for e in parsed if isinstance(e, JsonEntry)]
            if digest is not None and digest != layout.digest:
                raise RequestError(f"{where}: the entries sent have digest {layout.digest}, the commit names {digest}")
        else:
            if not isinstance(digest, str):
                raise RequestError("a commit needs its layout: 'entries', or 'layout' (a digest) sent before")
            keys.check_digest(digest)
            layout = self._layouts.get((job, digest))
            if layout is None:
                try:
                    data = await asyncio.to_thread(self.memory.get, keys.layout_key(job, digest))
                    layout = Layout.from_bytes(data, digest)
                except (KeyNotFoundError, ManifestError) as e:
                    raise UnknownLayoutError(f"layout {digest} of {job} is not held by this agent ({e}): "
                                             "send its entries") from e
        raw = req.get("values") or []
        if not isinstance(raw, list) or not all(isinstance(v, list) and len(v) == 2 and isinstance(v[0], str)
                                                for v in raw):
            raise RequestError("values must be a list of [name, value]")
        values += [JsonEntry(n, v) for n, v in raw]
        names = [c.name for c in layout.chunks] + [v.name for v in values]
        if len(set(names)) != len(names):
            raise RequestError(f"{where}: a name appears twice among the tensors and values")
        try:
            layout.check_fits(nbytes, f"rank {rank}")
        except ManifestError as e:
            raise RequestError(str(e)) from e
        if (job, layout.digest) not in self._layouts:
            if len(self._layouts) > 4096:  # a job that changes layouts all the time: forget the oldest
                self._layouts.pop(next(iter(self._layouts)))
            self._layouts[(job, layout.digest)] = layout
        if ("memory", job, layout.digest) not in self._layout_at:
            lkey = keys.layout_key(job, layout.digest)
            if not await asyncio.to_thread(os.path.exists, self.memory.path(lkey)):
                await asyncio.to_thread(self.memory.put, lkey, layout.to_bytes())
            self._layout_at.add(("memory", job, layout.digest))
        return layout, tuple(values)

    async def _ensure_layout(self, place: str, tier: Tier, job: str, digest: str) -> None:
        """Store the layout object ``digest`` in ``tier`` (``place`` names it) unless it is known to be there."""
        if (place, job, digest) in self._layout_at:
            return
        lkey = keys.layout_key(job, digest)
        try:
            await asyncio.to_thread(tier.stat, lkey)
        except KeyNotFoundError:
            await asyncio.to_thread(tier.put, lkey, self.memory.path(lkey))
        self._layout_at.add((place, job, digest))

    # ------------------------------------------------------------------ peers
    async def _share(self, job: str, step: int, rank: int, world: int, nbytes: int, pend: _Pending) -> None:
        """Tell every live peer about a local shard (for its manifest), and copy it to its placement targets."""
        key = keys.shard_key(job, step, rank)
        path = self.memory.path(key)
        digest = pend.layouts[rank]

        async def copy(r: int) -> bool:
            if not await self._push_layout(r, job, digest):
                return False
            return await self._push(r, key, path, nbytes, pend.checksums[rank])

        copies = [asyncio.ensure_future(copy(r)) for r in self.members.targets(self.me)]
        under_way = self._copies.setdefault((job, step), set())
        for f in copies:
            under_way.add(f)

            def done(f: asyncio.Future, k: tuple[str, int] = (job, step)) -> None:
                left = self._copies.get(k)
                if left is not None:
                    left.discard(f)
                    if not left:
                        del self._copies[k]

            f.add_done_callback(done)
        try:
            checksum = await pend.checksums[rank]
        except Exception:
            await asyncio.gather(*copies, return_exceptions=True)
            return
        record = {"job": job, "step": step, "rank": rank, "world": world, "nbytes": nbytes, "layout": digest,
                  "values": [[e.name, e.value] for e in pend.entries[rank]],
                  "checksum": checksum, "save_index": pend.save_index, "metadata": pend.metadata, "node": self.me}
        self.dis.submit([record])
        await asyncio.gather(*copies)

    async def _push(self, r: int, key: str, src: str | bytes, nbytes: int,
                    checksum: "str | asyncio.Future | None" = None) -> bool:
        """Get ``key`` onto node ``r``: a shard is pulled by ``r`` from this node (GET with sendfile,
        read straight into its memory folder — the fast direction of HTTP), a small object is PUT."""
        if (r, key) in self._pushing:
            return True  # already on its way there
        self._pushing.add((r, key))
        st = self.members.peers[r]
        st.debt_bytes += nbytes
        held = await self._budget.acquire(nbytes)
        t0 = time.perf_counter()
        try:
            if isinstance(src, str) and keys.parse_key(key) and not key.endswith(keys.MANIFEST_NAME):
                addr = self.members.nodes[r].addr
                # a pull of a large shard may take a while: allow for a slow 50 MB/s link
                timeout = self.settings.peer_timeout + nbytes / 50e6

                def call(path: str, body: dict, t: float = self.settings.peer_timeout) -> dict:
                    return post_json(addr, path, body, secret=self._secret, node=self.me, timeout=t,
                                     ssl_context=self._client_ssl)

                if isinstance(checksum, str):
                    await self._out(call, "/v1/fetch", {"key": key, "size": nbytes, "checksum": checksum,
                                                                "from": self.me}, timeout)
                else:
                    # the peer pulls while this node's checksum is still being computed; the copy is
                    # published only once the two checksums are known to agree
                    pull = asyncio.ensure_future(asyncio.to_thread(
                        call, "/v1/fetch", {"key": key, "size": nbytes, "from": self.me}, timeout))
                    if checksum is None:
                        checksum = asyncio.ensure_future(asyncio.to_thread(checksum_file, src, nbytes))
                    expected = await checksum
                    got = await pull
                    match = got.get("checksum") == expected
                    await self._out(call, "/v1/publish", {"token": got.get("token", ""),
                                                                  "checksum": expected, "publish": match})
                    if not match:
                        from tiers.errors import ChecksumMismatchError

                        raise ChecksumMismatchError(f"{key} reached node {r} with checksum {got.get('checksum')}, "
                                                    f"the primary has {expected}: copy dropped")
            else:
                await self._out(self.peer_tiers[r].put, key, src)
            st.sent_bytes += nbytes
            self.stats["replicated_bytes"] += nbytes
            log.info("%s copied to node %d: %d bytes in %.3f s", key, r, nbytes, time.perf_counter() - t0)
            return True
        except (TierError, OSError) as e:
            self._peer_error(r, e)
            return False
        finally:
            await self._budget.release(held)
            st.debt_bytes -= nbytes
            self._pushing.discard((r, key))

    async def _push_layout(self, r: int, job: str, digest: str) -> bool:
        """Make sure node ``r`` holds the layout object ``digest`` (sent once per peer, before any shard using it).

        Concurrent callers for the same copy share one transfer and all wait for it, so no shard that names
        the layout reaches ``r`` before the layout does."""
        if (f"node-{r}", job, digest) in self._layout_at:
            return True
        k = (r, job, digest)
        fut = self._layout_pushes.get(k)
        if fut is None:
            fut = self._layout_pushes[k] = asyncio.ensure_future(self._send_layout(r, job, digest))
            fut.add_done_callback(lambda _f: self._layout_pushes.pop(k, None))
        return await asyncio.shield(fut)

    async def _send_layout(self, r: int, job: str, digest: str) -> bool:
        lkey = keys.layout_key(job, digest)
        try:
            data = await asyncio.to_thread(self.memory.get, lkey)
        except (TierError, OSError) as e:
            self._peer_error(r, e)
            return False
        if await self._push(r, lkey, data, len(data)):
            self._layout_at.add((f"node-{r}", job, digest))
            return True
        return False

    def _peer_error(self, r: int, e: BaseException) -> None:
        st = self.members.peers[r]
        st.errors += 1
        st.last_error = str(e)
        log.warning("node %d (%s): %s", r, st.node.addr, e)

    # ------------------------------------------------------------------ commit tree
    async def _out(self, fn, *args):
        """Run a blocking request to a peer in the outgoing-request threads."""
        return await asyncio.get_running_loop().run_in_executor(self._out_pool, functools.partial(fn, *args))

    async def _pulling(self, fn, *args):
        """Run a pull from a peer (replication, warm restore) in the pull threads."""
        return await asyncio.get_running_loop().run_in_executor(self._pull_pool, functools.partial(fn, *args))

    async def _post(self, r: int, path: str, body: dict) -> dict:
        """A signed control POST to node ``r`` over its keep-alive link, in the control executor."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._ctrl_pool, functools.partial(self._links[r].post, path, body))
        except ConnectionError as e:
            self._peer_error(r, e)
            raise

    async def _take_rows(self, rows: list[dict]) -> None:
        """The commit tree's root takes commit rows (its own node's and every other's): one intake for all.
        A step whose ``world`` rows are all here gets its manifest built, committed here and sent down."""
        for rec in rows:
            try:
                job = keys.check_job(rec["job"])
                step = keys.check_step(rec["step"])
                rank = keys.check_rank(rec["rank"])
                world, nbytes, node = int(rec["world"]), int(rec["nbytes"]), int(rec["node"])
                if not 0 <= rank < world or nbytes < 0 or not isinstance(rec["checksum"], str):
                    raise RequestError("rank, world, nbytes or checksum out of range")
                digest = keys.check_digest(rec["layout"])
                raw = rec.get("values") or []
                if not isinstance(raw, list) or not all(isinstance(v, list) and len(v) == 2
                                                        and isinstance(v[0], str) for v in raw):
                    raise RequestError("values must be a list of [name, value]")
                values = tuple(JsonEntry(n, v) for n, v in raw)
                metadata = rec.get("metadata") or {}
                if not isinstance(metadata, dict):
                    raise RequestError("metadata must be a JSON object")
                save_index = int(rec.get("save_index", step))
            except (ValueError, KeyError, TypeError) as e:
                log.warning("commit row dropped: %s", e)
                continue
            key = (job, step)
            self._seen(job, step)
            if os.path.exists(self.memory.path(keys.manifest_key(job, step))) and key not in self._pending:
                continue  # committed here already
            pend = self._pending.get(key)
            if pend is None:
                pend = self._pending[key] = _Pending(world, save_index, metadata)
                self._settled.setdefault(key, asyncio.Event())
            if pend.world != world:
                log.warning("%s step %d: rank %d says world %d, an earlier rank said %d: row dropped",
                            job, step, rank, world, pend.world)
                continue
            if rank not in pend.sizes:
                pend.sizes[rank] = nbytes
                pend.entries[rank] = values
                pend.layouts[rank] = digest
                pend.nodes[rank] = node
                fut = asyncio.get_running_loop().create_future()
                fut.set_result(rec["checksum"])
                pend.checksums[rank] = fut
            if len(pend.sizes) == world and not pend.finishing:
                pend.finishing = True
                asyncio.create_task(self._finish_step(job, step, pend))

    async def _receive_manifest(self, job: object, step: object, data: bytes) -> bool:
        """A manifest the commit tree's root built: verify it and commit the step here. True if new here."""
        try:
            m = Manifest.from_bytes(data)
        except ManifestError as e:
            log.warning("a manifest sent down the commit tree was refused: %s", e)
            return False
        if os.path.exists(self.memory.path(keys.manifest_key(m.job, m.step))):
            self.dis.committed(m.job, m.step, data)
            return False
        return await self._commit_manifest(m, data)

    def _adopt_view(self, view: View) -> None:
        """The root's view of who is dead: adopt it for the nodes this node does not watch."""
        for kind, r in self.members.apply_view(set(view.dead) - {self.me}):
            self.dis.report(kind, r)
        self._rewatch()
        if self._heal_now is not None:
            self._heal_now.set()

    def _rewatch(self) -> None:
        """Heartbeat only this node's tree neighbours and placement partners: O(fanout + replicas) peers."""
        live = sorted(self.members.alive())
        watch = set(tree_children(live, self.me, self.settings.fanout))
        parent = tree_parent(live, self.me, self.settings.fanout)
        if parent is not None:
            watch.add(parent)
        watch |= set(self.members.targets(self.me)) | self._sources(frozenset(live))
        self.members.watch(watch - {self.me})

    def _sources(self, live: frozenset[int]) -> set[int]:
        """The live nodes whose shards placement puts on this node (cached per live set)."""
        cached = self._sources_cache
        if cached is None or cached[0] != live:
            cached = self._sources_cache = (live, {r for r in live if r != self.me
                                                   and self.me in self.members.desired(r, set(live))})
        return cached[1]

    async def _http_body(self, request) -> dict:
        data = await request.read()
        if request.content_type == DEFLATED_JSON:
            d = zlib.decompressobj()
            data = d.decompress(data, MAX_CONTROL_BODY)
            if d.unconsumed_tail:
                raise ValueError(f"control message over {MAX_CONTROL_BODY} bytes once inflated")
        body = json.loads(data)
        if not isinstance(body, dict):
            raise ValueError("a control message is a JSON object")
        return body

    def _tree_route(self, handle):
        """An aiohttp handler for one of the commit tree's routes: the body (deflated or not) to ``handle``,
        its answer as JSON; a malformed message is a 400."""
        from aiohttp import web

        async def route(request):
            try:
                answer = await handle(await self._http_body(request))
            except (ValueError, KeyError, TypeError, zlib.error) as e:
                return web.Response(status=400, text=f"bad commit-tree message: {e}\n")
            return web.json_response(answer)

        return route

    async def _http_fetch(self, request):
        """A peer asks this node to pull a shard from it (replication); answers once the copy is verified."""
        from aiohttp import web

        try:
            req = await request.json()
            key = str(req["key"])
            info = keys.parse_key(key)
            size, src = int(req["size"]), int(req["from"])
            checksum = req.get("checksum")
            if info is None or info.is_manifest or size < 0 or src not in self.peer_tiers \
                    or not (checksum is None or isinstance(checksum, str)):
                raise ValueError("key, size, checksum or source node out of range")
        except (ValueError, KeyError, TypeError) as e:
            return web.Response(status=400, text=f"bad fetch request: {e}\n")
        held = await self._budget.acquire(size)
        t0 = time.perf_counter()
        try:
            got, tmp = await self._pulling(self._pull, src, key, size, checksum)
            log.info("%s pulled from node %d: %d bytes in %.3f s", key, src, size, time.perf_counter() - t0)
        except (TierError, OSError) as e:
            return web.Response(status=502, text=f"pull of {key} from node {src} failed: {e}\n")
        finally:
            await self._budget.release(held)
        token = ""
        if tmp:
            token = os.path.basename(tmp)
            self._unpublished[token] = (key, tmp, got, time.monotonic())
        return web.json_response({"checksum": got, "token": token})

    async def _http_publish(self, request):
        """Second half of a pull without a checksum: publish the copy if the primary's checksum matches."""
        from aiohttp import web

        try:
            req = await request.json()
            token, checksum, keep = str(req["token"]), str(req["checksum"]), bool(req.get("publish", True))
        except (ValueError, KeyError, TypeError) as e:
            return web.Response(status=400, text=f"bad publish request: {e}\n")
        entry = self._unpublished.pop(token, None)
        if entry is None:
            return web.Response(status=404, text="no such pulled copy (expired or already published)\n")
        key, tmp, got, _ = entry
        if not keep or got != checksum:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            if keep:
                return web.Response(status=422, text=f"{key}: received {got}, primary has {checksum}\n")
            return web.json_response({"dropped": True})
        await asyncio.to_thread(os.rename, tmp, self.memory.path(key))
        return web.json_response({"published": True})

    def _pull(self, src: int, key: str, size: int, checksum: str | None) -> tuple[str, str]:
        """Read ``key`` from node ``src`` straight into a new file of the memory folder and checksum it.

        With ``checksum`` the copy is verified and published at once; without, it stays a temp file
        until :meth:`_publish` is told the checksum the primary computed meanwhile. Returns
        ``(checksum of the bytes received, temp file or "")``.
        """
        from tiers.checksum import checksum_bytes

        import mmap
        import uuid

        path = self.memory.path(key)
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f".tmp-pull-{uuid.uuid4().hex}")
        peer = self.peer_tiers[src]
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                if size:
                    os.ftruncate(fd, size)
                    try:
                        os.posix_fallocate(fd, 0, size)
                    except OSError as e:
                        if e.errno in (errno.ENOSPC, errno.ENOMEM):
                            from tiers.errors import TierFullError

                            raise TierFullError(e.errno, f"no room for {key} in {self.memory.root}") from e
                        raise
                    failure: BaseException | None = None
                    with mmap.mmap(fd, size) as mm:
                        mv = memoryview(mm)
                        try:
                            step = size if self._bucket is None else self._bucket.chunk()
                            for off in range(0, size, step):
                                n = min(step, size - off)
                                if self._bucket is not None:
                                    self._bucket.take(n)
                                peer.read_into(key, mv[off:off + n], off)
                            got = checksum_bytes(mv)
                        except Exception as e:
                            # the traceback's frames hold views of the mapping: drop them, or closing it
                            # raises BufferError and hides the real error
                            failure = e.with_traceback(None)
                        finally:
                            mv.release()
                    if failure is not None:
                        raise failure
                else:
                    got = checksum_bytes(b"")
            finally:
                os.close(fd)
            if checksum is None:
                return got, tmp
            if got != checksum:
                from tiers.errors import ChecksumMismatchError

                raise ChecksumMismatchError(f"{key} pulled from node {src} has checksum {got}, expected {checksum}")
            os.rename(tmp, path)
            return got, ""
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def _metrics(self) -> dict[str, float]:
        out = {"tierckpt_saves_total": self.stats["saves"], "tierckpt_bytes_in_total": self.stats["bytes_in"],
               "tierckpt_replicated_bytes_total": self.stats["replicated_bytes"],
               "tierckpt_inflight_bytes": self._budget.used if self._budget else 0}
        if self.members is not None:
            out["tierckpt_peers_alive"] = len(self.members.alive()) - 1
        return out

    async def _heartbeat_loop(self) -> None:
        """Heartbeat the watched peers (tree neighbours, placement partners); report changes to the root."""
        loop = asyncio.get_running_loop()
        self._rewatch()
        while True:
            changed = False

            async def beat(r: int) -> None:
                nonlocal changed
                try:
                    h = await loop.run_in_executor(self._ctrl_pool, self.peer_tiers[r].health)
                    if self.members.seen(r, int(h.get("bytes_held", 0))):
                        log.info("node %d is back", r)
                        self.dis.report("alive", r)
                        changed = True
                except (TierError, OSError, ValueError) as e:
                    self.members.peers[r].last_error = str(e)

            await asyncio.gather(*(beat(r) for r in sorted(self.members.watched)))
            for r in self.members.sweep():
                self._layout_at = {p for p in self._layout_at if p[0] != f"node-{r}"}
                log.warning("node %d (%s) declared dead: silent for %.1f s", r, self.members.nodes[r].addr,
                            self.settings.dead_after)
                self.dis.report("dead", r)
                changed = True
            if changed:
                self._rewatch()
                self.dis.view_changed()
                self._heal_now.set()
            await asyncio.sleep(self.settings.heartbeat)

    async def _heal_loop(self) -> None:
        """Keep ``replicas`` copies of every retained step's shards on live nodes (re-replicate, refill)."""
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._heal_now.wait(), timeout=max(5.0, 5 * self.settings.heartbeat))
            self._heal_now.clear()
            try:
                await self._heal_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("re-replication round failed; trying again")

    async def _heal_once(self) -> int:
        """One round: push every missing copy this node is responsible for; return the copies made."""
        now = time.monotonic()
        for token, (_, tmp, _, since) in list(self._unpublished.items()):
            if now - since > 600:  # the primary never came back to publish it
                self._unpublished.pop(token, None)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
        alive = self.members.alive()
        inv = await asyncio.to_thread(scan_tier, self.memory, None, with_sizes=True)
        await asyncio.to_thread(step_index.rebuild_places, [inv])  # replicas that came after their manifest
        held: dict[int, set[str]] = {self.me: set()}
        for job, steps in inv.steps.items():
            for step, st in steps.items():
                held[self.me] |= {keys.shard_key(job, step, r) for r in st.shards}
                if st.has_manifest:
                    held[self.me].add(keys.manifest_key(job, step))

        async def listing(r: int) -> None:
            try:
                held[r] = set(await self._out(self.peer_tiers[r].list, ""))
            except (TierError, OSError) as e:
                self._peer_error(r, e)

        # only the nodes placement names for the shards held here: O(replicas) peers, not every peer
        primaries = {sh.node for steps in inv.steps.values() for st in steps.values() if st.manifest is not None
                     for sh in st.manifest.shards if sh.rank in st.shards}
        partners = {r for p in primaries for r in self.members.desired(p, alive)} - {self.me}
        await asyncio.gather(*(listing(r) for r in sorted(partners & alive)))
        made = 0
        for job, steps in inv.steps.items():
            for step, st in sorted(steps.items()):
                if st.manifest is None or (job, step) in self._pending:
                    continue
                mkey = keys.manifest_key(job, step)
                for sh in st.manifest.shards:
                    key = keys.shard_key(job, step, sh.rank)
                    if st.shards.get(sh.rank) != sh.size:
                        continue
                    want = self.members.desired(sh.node, alive)
                    have = [r for r in sorted(held) if key in held[r]]
                    # the lowest live holder pushes, so exactly one node acts for each shard
                    if not have or have[0] != self.me:
                        continue
                    for r in want:
                        if r not in held or key in held[r]:
                            continue
                        if sh.layout and keys.layout_key(job, sh.layout) not in held[r]:
                            self._layout_at.discard((f"node-{r}", job, sh.layout))  # it came back empty
                            if not await self._push_layout(r, job, sh.layout):
                                continue
                            held[r].add(keys.layout_key(job, sh.layout))
                        if await self._push(r, key, self.memory.path(key), sh.size, sh.checksum):
                            made += 1
                            held[r].add(key)
                            if mkey not in held[r]:
                                data = await asyncio.to_thread(self.memory.get, mkey)
                                if await self._push(r, mkey, data, len(data)):
                                    held[r].add(mkey)
                # a live holder of shards without the manifest gets it from the lowest manifest holder
                mholders = [r for r in sorted(held) if mkey in held[r]]
                if mholders and mholders[0] == self.me:
                    prefix = keys.step_prefix(job, step)
                    for r in sorted(held):
                        if mkey not in held[r] and any(k.startswith(prefix) for k in held[r]):
                            data = await asyncio.to_thread(self.memory.get, mkey)
                            if await self._push(r, mkey, data, len(data)):
                                held[r].add(mkey)
        if made:
            log.info("re-replication: %d shard copies made", made)
        return made

    async def _prefetch(self) -> None:
        """Warm restore: pull from the peers, before this node's ranks ask, their shards of each job's newest step.

        A replacement node's agent starts with empty memory while its peers still hold the shards that
        the node's ranks saved (as replicas). For every job a peer holds, the newest step with a manifest
        is the one a restarted job restores; the shards taken by this node (``ShardInfo.node``) are pulled
        into local memory, verified against the manifest's checksums, and the manifest is written last,
        so the ranks' restore reads local memory. Runs once, at start; ``status`` and the ``prefetch`` op
        report it.
        """
        st = self.prefetch
        t0 = time.monotonic()
        try:
            listings: dict[int, set[str]] = {}

            async def listing(r: int) -> None:
                try:
                    listings[r] = set(await self._out(self.peer_tiers[r].list, ""))
                except (TierError, OSError) as e:
                    st["errors"].append(f"node {r}: {e}")

            # the nodes placement puts this node's copies on first; every other peer only if they hold nothing
            nodes = set(self.members.desired(self.me, {n.rank for n in self.members.nodes})) - {self.me}
            await asyncio.gather(*(listing(r) for r in sorted(nodes)))
            if not any(keys.parse_key(k) is not None for held in listings.values() for k in held):
                await asyncio.gather(*(listing(r) for r in sorted(set(self.peer_tiers) - nodes)))
            steps: dict[str, dict[int, int]] = {}  # job -> step -> a node that holds its manifest
            for r, held in sorted(listings.items(), reverse=True):
                for key in held:
                    info = keys.parse_key(key)
                    if info is not None and info.is_manifest:
                        steps.setdefault(info.job, {})[info.step] = r
            for job, where in sorted(steps.items()):
                # the newest step whose shards of this node the peers hold in full (a node lost during a
                # replication leaves the newest step short of some)
                for step in sorted(where, reverse=True)[:self.settings.keep_memory + 1]:
                    if await self._prefetch_step(job, step, where[step], listings):
                        break
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the agent must outlive a failed warm restore: restores read the peers instead
            log.exception("warm restore failed")
            st["errors"].append(f"{type(e).__name__}: {e}")
        finally:
            st["state"] = "done"
            st["seconds"] = round(time.monotonic() - t0, 3)
            self._prefetched.set()
        if st["shards"]:
            log.info("warm restore: %d shards (%d bytes) of %s pulled from peers in %.3f s", st["shards"],
                     st["bytes"], ", ".join(f"{j} step {s}" for j, s in sorted(st["steps"].items())), st["seconds"])

    async def _prefetch_step(self, job: str, step: int, holder: int, listings: dict[int, set[str]]) -> bool:
        """Pull this node's shards of one step, then its manifest; True when the step is here (or not ours)."""
        st = self.prefetch
        mkey = keys.manifest_key(job, step)
        if await asyncio.to_thread(os.path.exists, self.memory.path(mkey)):
            return True
        try:
            data = await self._out(self.peer_tiers[holder].get, mkey)
            m = Manifest.from_bytes(data, job=job, step=step)
        except (TierError, OSError, ValueError) as e:
            st["errors"].append(f"{mkey} from node {holder}: {e}")
            return False
        mine = [sh for sh in m.shards if sh.node == self.me]
        if not mine:
            return True
        if any(not any(keys.shard_key(job, step, sh.rank) in held for held in listings.values()) for sh in mine):
            return False

        async def one(sh: ShardInfo) -> bool:
            key = keys.shard_key(job, step, sh.rank)
            with contextlib.suppress(OSError):
                if os.stat(self.memory.path(key)).st_size == sh.size:
                    return True
            for r in [q for q in sorted(listings) if key in listings[q]]:
                held = await self._budget.acquire(sh.size)
                try:
                    await self._pulling(self._pull, r, key, sh.size, sh.checksum)
                    st["shards"] += 1
                    st["bytes"] += sh.size
                    return True
                except (TierError, OSError) as e:
                    st["errors"].append(f"{key} from node {r}: {e}")
                finally:
                    await self._budget.release(held)
            return False

        if not all(await asyncio.gather(*(one(sh) for sh in mine))):
            return False
        for digest in sorted({sh.layout for sh in mine if sh.layout}):
            if not await self._pull_layout(job, digest, [holder] + sorted(listings)):
                return False
        await asyncio.to_thread(self.memory.put, mkey, data)
        await asyncio.to_thread(step_index.note_commit, self.memory, m)
        st["steps"][job] = step
        return True

    async def _pull_layout(self, job: str, digest: str, nodes: list[int]) -> bool:
        """Copy the layout object ``digest`` into local memory from the first of ``nodes`` that has it intact."""
        lkey = keys.layout_key(job, digest)
        if await asyncio.to_thread(os.path.exists, self.memory.path(lkey)):
            return True
        for r in dict.fromkeys(nodes):
            try:
                data = await self._out(self.peer_tiers[r].get, lkey)
                Layout.from_bytes(data, digest)
            except (TierError, OSError, ManifestError) as e:
                self.prefetch["errors"].append(f"{lkey} from node {r}: {e}")
                continue
            await asyncio.to_thread(self.memory.put, lkey, data)
            self._layout_at.add(("memory", job, digest))
            return True
        return False

    async def _op_prefetch(self, conn: _Conn, req: dict) -> dict:
        """The warm restore's report; with ``timeout`` (seconds), wait up to that long for it to finish."""
        timeout = float(req.get("timeout") or 0)
        if self._prefetched is not None and timeout > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._prefetched.wait(), timeout)
        return dict(self.prefetch)

    async def _finish_step(self, job: str, step: int, pend: _Pending) -> None:
        """All ``world`` rows are here (a single node, or the commit tree's root): build the manifest,
        commit it here, and send it down the tree."""
        key = (job, step)
        try:
            shards = []
            for r in range(pend.world):
                shards.append(ShardInfo(r, pend.sizes[r], await pend.checksums[r], pend.entries[r],
                                        pend.nodes.get(r, self.me), pend.layouts[r]))
            meta = dict(pend.metadata)
            meta["save_index"] = pend.save_index
            m = Manifest(job, step, pend.world, tuple(shards), meta, created=pend.created)
            data = m.to_bytes()
        except Exception as e:
            self._error(job, f"step {step} could not be committed to memory: {e}")
            self._pending.pop(key, None)
            self._settled.setdefault(key, asyncio.Event()).set()
            return
        if await self._commit_manifest(m, data) and self.dis is not None:
            self.dis.broadcast(data)

    async def _commit_manifest(self, m: Manifest, data: bytes) -> bool:
        """Commit a step in this node's memory: the manifest written last, then the drains it is due."""
        job, step = m.job, m.step
        key = (job, step)
        self._settled.setdefault(key, asyncio.Event())
        try:
            await asyncio.to_thread(self.memory.put, keys.manifest_key(job, step), data)
        except Exception as e:
            self._error(job, f"step {step} could not be committed to memory: {e}")
            self._pending.pop(key, None)
            self._settled[key].set()
            return False
        self._pending.pop(key, None)
        await asyncio.to_thread(step_index.note_commit, self.memory, m)
        self._seen(job, step)
        self.stats["saves"] += 1
        if self.dis is not None:
            self.dis.committed(job, step, data)
        targets = self._targets(int(m.metadata.get("save_index", step)))
        for t in targets:
            self._enqueue(t, job, step)
        if not targets:
            self._settled[key].set()
        await self._trim_memory(job)
        await self._trim_layouts(self.memory, job)
        return True

    def _targets(self, save_index: int) -> list[Tier]:
        out = []
        if self.disk is not None and save_index % self.settings.disk_every == 0:
            out.append(self.disk)
        if self.s3 is not None and save_index % self.settings.s3_every == 0:
            out.append(self.s3)
        return out

    def _enqueue(self, tier: Tier, job: str, step: int) -> None:
        self._draining.setdefault((job, step), set()).add(tier.name)
        self._settled.setdefault((job, step), asyncio.Event())
        self._queues[tier.name].put_nowait((job, step))

    def _error(self, job: str, msg: str) -> None:
        log.error("%s: %s", job, msg)
        self._errors.setdefault(job, []).append(msg)

    # ------------------------------------------------------------------ drain
    async def _drain_worker(self, tier: Tier) -> None:
        q = self._queues[tier.name]
        while True:
            job, step = await q.get()
            # a newer step of the same job already waiting supersedes this one for this tier
            newer = [s for (j, s) in list(q._queue) if j == job and s > step]  # noqa: SLF001
            if newer:
                log.info("%s step %d not written to %s: step %d supersedes it", job, step, tier.name, max(newer))
                self._drained(tier, job, step)
                continue
            try:
                await self._drain_step(tier, job, step)
                self.stats["drained"][tier.name] += 1
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self._error(job, f"step {step} could not be written to the {tier.name} tier "
                                 f"({tier.describe()}): {e}")
            finally:
                self._drained(tier, job, step)
            with contextlib.suppress(Exception):
                await self._trim(tier, job)
            await self._trim_memory(job)
            if tier is self.disk:
                await self._trim_layouts(tier, job)

    def _drained(self, tier: Tier, job: str, step: int) -> None:
        left = self._draining.get((job, step))
        if left is not None:
            left.discard(tier.name)
            if not left:
                del self._draining[(job, step)]
                ev = self._settled.get((job, step))
                if ev:
                    ev.set()

    async def _drain_step(self, tier: Tier, job: str, step: int) -> None:
        mkey = keys.manifest_key(job, step)
        manifest_bytes = await asyncio.to_thread(self.memory.get, mkey)
        m = Manifest.from_bytes(manifest_bytes, job=job, step=step)
        t0 = time.perf_counter()

        async def one(rank: int, size: int) -> None:
            n = await self._budget.acquire(size)
            try:
                src = self.memory.path(keys.shard_key(job, step, rank))
                await asyncio.to_thread(tier.put, keys.shard_key(job, step, rank), src)
            finally:
                await self._budget.release(n)

        mine = [s for s in m.shards if s.node == self.me]
        if not mine:
            return  # this node took no shard of the step from a trainer: nothing of it is this node's to write
        # layouts first (once per tier), then shards, then the manifest: what a manifest names is always there
        for digest in sorted({s.layout for s in mine if s.layout}):
            await self._ensure_layout(tier.name, tier, job, digest)
        await asyncio.gather(*(one(s.rank, s.size) for s in mine))
        nbytes = sum(s.size for s in mine)
        if tier is self.s3 and len(mine) < len(m.shards):
            # a shared bucket: the manifest goes in once every node's shards are there; the last node to
            # finish sees them all (S3 lists are strongly consistent) and commits the step
            present = set(await asyncio.to_thread(tier.list, keys.step_prefix(job, step)))
            if not all(keys.shard_key(job, step, s.rank) in present for s in m.shards):
                log.info("%s step %d: this node's shards are in %s; the last node to finish commits it",
                         job, step, tier.name)
                return
        await asyncio.to_thread(tier.put, mkey, manifest_bytes)
        await asyncio.to_thread(step_index.note_commit, tier, m)
        dt = time.perf_counter() - t0
        log.info("%s step %d written to %s: %d bytes in %.2f s (%.2f GB/s)", job, step, tier.name,
                 nbytes, dt, nbytes / dt / 1e9 if dt else 0)

    # ------------------------------------------------------------------ retention
    def _delete_step(self, tier: Tier, job: str, step: int) -> None:
        """Index row, manifest (un-commit), the row again (in case another writer put it back), then the shards."""
        prefix = keys.step_prefix(job, step)
        step_index.note_delete(tier, job, step)
        tier.delete(keys.manifest_key(job, step))
        step_index.note_delete(tier, job, step)
        for k in tier.list(prefix):
            tier.delete(k)

    async def _trim(self, tier: Tier, job: str) -> None:
        keep = self.settings.keep_disk if tier is self.disk else self.settings.keep_s3
        inv = await asyncio.to_thread(scan_tier, tier, job, with_sizes=False)
        steps = inv.job(job)
        # committed = manifest here, whatever shards this place holds (a node's disk holds its own ranks only)
        committed = sorted(s for s, st in steps.items() if st.committed)
        drop = set(committed[:-keep]) if len(committed) > keep else set()
        drop |= inv.stale_steps(job)
        drop = {s for s in drop if tier.name not in self._draining.get((job, s), set())}
        for s in sorted(drop):
            await asyncio.to_thread(self._delete_step, tier, job, s)
            log.info("%s step %d removed from %s (retention keeps %d)", job, s, tier.name, keep)

    async def _trim_memory(self, job: str) -> None:
        inv = await asyncio.to_thread(scan_tier, self.memory, job, with_sizes=False)
        steps = inv.job(job)
        committed = sorted(s for s, st in steps.items() if st.committed)
        keep = self.settings.keep_memory
        drop = set(committed[:-keep]) if len(committed) > keep else set()
        # steps without a manifest older than the newest committed one will never be committed here
        drop |= inv.stale_steps(job)
        drop = {s for s in drop if not self._draining.get((job, s))}
        if not drop:
            return
        for s in sorted(drop):
            pend = self._pending.pop((job, s), None)
            if pend is not None:
                log.warning("%s step %d abandoned: only ranks %s of %d committed it", job, s,
                            sorted(pend.sizes), pend.world)
                ev = self._settled.get((job, s))
                if ev:
                    ev.set()
            await asyncio.to_thread(self._delete_step, self.memory, job, s)
        async with self._slot_cond:
            self._slot_cond.notify_all()

    async def _trim_layouts(self, tier: Tier, job: str) -> None:
        """Delete the layout objects of ``job`` in a tier only this node writes (its memory or disk) that no
        manifest there names and no step being committed uses, once older than ``layout_grace`` seconds (a
        layout is stored before the manifest that names it). The shared S3 prefix keeps its layouts: another
        node may be writing a step that names one; ``ckpt gc --all`` removes them with the job."""
        last = self._layouts_trimmed.get((tier.name, job), 0.0)
        if time.monotonic() - last < min(60.0, self.settings.layout_grace):
            return  # at most once a minute: layouts change rarely, and this reads every manifest of the job
        self._layouts_trimmed[(tier.name, job)] = time.monotonic()
        using = {d for (j, _), p in self._pending.items() if j == job for d in p.layouts.values()}

        def run() -> list[str]:
            listed = tier.list(keys.layouts_prefix(job))
            if not listed:
                return []
            inv = scan_tier(tier, job, with_sizes=False)
            steps = inv.job(job).values()
            if inv.error is not None or any(st.has_manifest and st.manifest is None for st in steps):
                return []  # a manifest that cannot be read may name any of them
            named = using | {d for st in steps if st.manifest is not None for d in st.manifest.layouts}
            now, dropped = time.time(), []
            for key in listed:
                parsed = keys.parse_layout_key(key)
                if parsed is None or parsed[1] in named:
                    continue
                with contextlib.suppress(KeyNotFoundError):
                    if now - tier.stat(key).mtime > self.settings.layout_grace:
                        tier.delete(key)
                        dropped.append(parsed[1])
            return dropped

        try:
            dropped = await asyncio.to_thread(run)
        except (TierError, OSError) as e:
            log.warning("%s: layouts in the %s tier not trimmed: %s", job, tier.name, e)
            return
        place = "memory" if tier is self.memory else tier.name
        for d in dropped:
            self._layout_at.discard((place, job, d))
            self._layouts.pop((job, d), None)
        if dropped:
            log.info("%s: %d layouts no retained step names removed from %s", job, len(dropped), tier.name)

    async def _trim_all(self) -> None:
        for job in {k[0] for k in self._draining} | set((await asyncio.to_thread(scan_tier, self.memory)).steps):
            await self._trim_memory(job)

    # ------------------------------------------------------------------ other ops
    async def _op_wait(self, conn: _Conn, req: dict) -> dict:
        job = keys.check_job(req["job"])
        step = req.get("step")
        timeout = float(req.get("timeout") or 3600)
        if step is None:
            evs = [ev for (j, _), ev in self._settled.items() if j == job]
            copies = [f for (j, _), fs in self._copies.items() if j == job for f in fs]
        else:
            evs = [self._settled[(job, keys.check_step(step))]] if (job, step) in self._settled else []
            copies = list(self._copies.get((job, step), ()))
        try:
            # written to every tier, and copied to the peers placement names (a failed copy is reported by
            # status and healed later: it does not fail the wait)
            await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in evs), *copies), timeout)
            done = True
        except asyncio.TimeoutError:
            done = False
        return {"done": done, "errors": self._take_errors(job)}

    def _seen(self, job: str, step: int) -> None:
        if step > self._seen_newest.get(job, -1):
            self._seen_newest[job] = step

    async def _op_lower(self, conn: _Conn, req: dict) -> dict:
        """The newest step of ``job`` that any tier could hold, as far as this agent knows: ``known`` is
        False when the agent never saw the job or could not list every lower tier at start-up."""
        job = keys.check_job(req["job"])
        newest = self._seen_newest.get(job)
        return {"known": self._lower_known and newest is not None, "newest": newest}

    async def _op_rewind(self, conn: _Conn, req: dict) -> dict:
        """The job resumed from ``step``: its later steps here belong to the run that failed; drop them.

        Called by every rank's restore once the ranks agreed on ``step``, before any new save, so the new
        run's saves of those step numbers are taken, not refused as already committed. Drops them from
        memory only (after their writes to disk and S3 finish); the lower tiers are overwritten when the
        new run saves the same steps. Answers the steps dropped.
        """
        job = keys.check_job(req["job"])
        step = int(req["step"])
        if step < -1:
            raise RequestError(f"step must be >= -1, got {step}")
        inv = await asyncio.to_thread(scan_tier, self.memory, job, with_sizes=False)
        later = {s for s in inv.job(job) if s > step}
        later |= {s for (j, s) in list(self._pending) + list(self._settled) if j == job and s > step}
        waits = [self._settled[(job, s)].wait() for s in later if (job, s) in self._draining]
        waits += [f for s in later for f in self._copies.get((job, s), ())]
        if waits:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.gather(*waits, return_exceptions=True), self.settings.grace)
        for s in sorted(later):
            self._pending.pop((job, s), None)
            ev = self._settled.pop((job, s), None)
            if ev is not None:
                ev.set()
            await asyncio.to_thread(self._delete_step, self.memory, job, s)
        if later:
            log.info("%s resumed from step %d: dropped later steps %s from memory", job, step, sorted(later))
            async with self._slot_cond:
                self._slot_cond.notify_all()
        return {"dropped": sorted(later)}

    async def _op_errors(self, conn: _Conn, req: dict) -> dict:
        return {"errors": self._take_errors(keys.check_job(req["job"]))}

    async def _op_status(self, conn: _Conn, req: dict) -> dict:
        return {
            "pid": os.getpid(), "embedded": self.embedded, "connections": len(self._conns),
            "pending": [f"{j}/step-{s}: ranks {sorted(p.sizes)} of {p.world}" for (j, s), p in self._pending.items()],
            "draining": {f"{j}/step-{s}": sorted(t) for (j, s), t in self._draining.items()},
            "queued": {n: q.qsize() for n, q in self._queues.items()},
            "inflight_bytes": self._budget.used if self._budget else 0,
            "errors": {j: len(e) for j, e in self._errors.items()},
            "stats": self.stats, "settings": self.settings.to_dict(),
            "node": self.me, "peers": self._peer_status(), "prefetch": self.prefetch, "tree": self._tree_status(),
        }

    def _tree_status(self) -> dict | None:
        """This node's place in the commit tree and its control traffic (None without peers)."""
        if self.dis is None:
            return None
        d = self.dis
        return {"live": d.live(), "root": min(d.live()), "parent": d.parent(), "children": d.children(),
                "epoch": d.view.epoch, "dead": sorted(d.view.dead), "watched": sorted(self.members.watched),
                "stats": {k: v for k, v in vars(d.stats).items() if isinstance(v, int)},
                "sent": sum(link.sent for link in self._links.values()),
                "sent_bytes": sum(link.sent_bytes for link in self._links.values())}

    def _peer_status(self) -> list[dict]:
        if self.members is None:
            return []
        now = time.monotonic()
        return [{"node": r, "addr": p.node.addr, "domain": p.node.domain, "alive": p.alive,
                 "last_seen_s": None if p.last_seen is None else round(now - p.last_seen, 3),
                 "bytes_held": p.bytes_held, "sent_bytes": p.sent_bytes, "debt_bytes": p.debt_bytes,
                 "errors": p.errors, "last_error": p.last_error,
                 "replicates_to": r in self.members.targets(self.me), "watched": r in self.members.watched}
                for r, p in sorted(self.members.peers.items())]

    async def _op_delete(self, conn: _Conn, req: dict) -> dict:
        job = keys.check_job(req["job"])
        step = keys.check_step(req["step"])
        names = req.get("tiers") or ["memory"] + [t.name for t in self.lower]
        if self._draining.get((job, step)) or (job, step) in self._pending:
            raise RequestError(f"step {step} of {job} is being written; wait for it first")
        for t in [self.memory] + self.lower:
            if t.name in names:
                await asyncio.to_thread(self._delete_step, t, job, step)
        async with self._slot_cond:
            self._slot_cond.notify_all()
        return {}

    async def _op_shutdown(self, conn: _Conn, req: dict) -> dict:
        self._stop.set()
        return {}


def run_agent(settings: Settings, *, embedded: bool = False, idle_exit: float | None = None) -> int:
    """Run an agent in this process until it is stopped; return the exit status."""
    agent = Agent(settings, embedded=embedded, idle_exit=idle_exit)
    try:
        asyncio.run(agent.serve())
    except AgentAlreadyRunningError as e:
        log.error("%s", e)
        return 3
    return 0
