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

from recovery.inventory import scan_tier
from tiers import keys
from tiers.base import Tier
from tiers.checksum import checksum_file
from tiers.disk import DiskTier
from tiers.errors import ManifestError, TierError
from tiers.layout import Layout
from tiers.manifest import Manifest, ShardInfo

from .config import Settings
from .drain import ByteBudget, Drainer, delete_step
from .layouts import LayoutBook
from .protocol import MAX_LINE, PROTOCOL_VERSION, RequestError
from .stepbook import Pending, Row, StepBook
from .dissemination import Disseminator, View, tree_children, tree_parent
from .replication import DEFLATED_JSON, Membership, PeerLink, load_peer_list, post_json
from .tierset import disk_tier, memory_tier, peer_tier_map, s3_tier

__all__ = ["Agent", "AgentAlreadyRunningError", "run_agent"]

log = logging.getLogger("tierckpt.agent")


#: the largest control message (commit rows, manifests, views) accepted once inflated, in bytes
MAX_CONTROL_BODY = 64 << 20


class AgentAlreadyRunningError(RuntimeError):
    """Another agent already owns the memory folder."""


@dataclass(eq=False)
class _Conn:
    """One trainer connection; ``pid`` is its process (from the socket's credentials)."""

    pid: int = 0
    leases: set[str] = field(default_factory=set)
    jobs: set[str] = field(default_factory=set)


class Agent:
    """One node's checkpoint agent. ``await agent.serve()`` runs it until shutdown."""

    def __init__(self, settings: Settings, *, embedded: bool = False, idle_exit: float | None = None) -> None:
        self.settings = settings.validate()
        self.embedded = embedded
        self.idle_exit = idle_exit
        self.memory = memory_tier(settings)
        self.disk: Tier | None = disk_tier(settings)
        self.s3: Tier | None = s3_tier(settings)
        self.lower: list[Tier] = [t for t in (self.disk, self.s3) if t is not None]
        self.stats = {"saves": 0, "bytes_in": 0, "drained": {t.name: 0 for t in self.lower}, "replicated_bytes": 0}
        self.me = settings.node_rank
        self.layouts = LayoutBook(self.memory, settings.layout_grace)
        self.book = StepBook(self.memory, self.me, self.stats)
        self._budget = ByteBudget(settings.max_inflight_bytes)
        self.drain = Drainer(settings, self.me, self.memory, self.book, self.layouts, self._budget, self.stats,
                             self._slots_freed)
        self.book.on_commit = self.drain.committed
        self._layout_pushes: dict[tuple[int, str, str], asyncio.Future] = {}
        self._leases: set[str] = set()
        self._lease_conn: dict[str, _Conn] = {}
        #: copies of local shards to peers still under way, per step (``wait`` waits for them too)
        self._copies: dict[tuple[str, int], set[asyncio.Future]] = {}
        self._slot_cond: asyncio.Condition | None = None
        self._conns: set[_Conn] = set()
        self._last_activity = time.monotonic()
        self._stop: asyncio.Event | None = None
        self._lock_fd: int | None = None
        self._server: asyncio.AbstractServer | None = None
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
        self.peer_tiers = peer_tier_map(s, timeout=s.peer_timeout, secret=self._secret,
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
        self.dis = Disseminator(self.me, alive=self.members.alive, post=self._post, on_rows=self.book.take_rows,
                                on_manifest=self.book.receive_manifest, on_view=self._adopt_view,
                                on_report=self.members.mark, dead=self.members.dead, fanout=s.fanout,
                                resend_after=s.peer_timeout, retry_after=s.heartbeat)
        self.book.tree = self.dis
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
        self.drain.start(self.lower)
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
        while self.drain.busy():
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        abandoned = {f"{j}/step-{s}": sorted(t) for (j, s), t in self.book.draining.items() if t}
        self.drain.stop()
        for w in self._tasks:
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
            busy = self._conns or self.drain.busy()
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
                    self.book.seen(job, max(steps))
        self.book.lower_known = all(linv.error is None for linv in lower.values())
        for job, steps in inv.steps.items():
            for step, st in sorted(steps.items()):
                if st.manifest is None:
                    log.info("dropping %s step %d from memory: it was never completed (%s)",
                             job, step, st.problem or "no manifest")
                    await asyncio.to_thread(delete_step, self.memory, job, step)
                    continue
                mine = [sh for sh in st.manifest.shards if sh.node == self.me]
                if any(st.shards.get(sh.rank) != sh.size for sh in mine):
                    continue
                save_index = int(st.manifest.metadata.get("save_index", step))
                for t in self.drain.targets(save_index):
                    have = lower[t.name].job(job).get(step)
                    if lower[t.name].error is None and (have is None or not have.complete):
                        log.info("re-queueing %s step %d for the %s tier (interrupted before)", job, step, t.name)
                        self.drain.enqueue(t, job, step)
        await self.drain.trim_all()

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
                return {"slot": slot, "errors": self.book.take_errors(job)}
            await self.drain.trim(self.memory, job, layouts=False)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                busy = sorted(f"step {s} ({', '.join(sorted(t))})" for (j, s), t in self.book.draining.items()
                              if j == job and t)
                why = (f"no free staging slot for {job} rank {rank}: "
                       f"{'still draining: ' + '; '.join(busy) if busy else 'every slot holds a retained step'}"
                       f"; save skipped (raise keep_memory or drain faster)")
                if wait:
                    log.warning(why)
                return {"skip": why, "errors": self.book.take_errors(job)}
            async with self._slot_cond:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._slot_cond.wait(), timeout=min(remaining, 1.0))

    async def _slots_freed(self) -> None:
        async with self._slot_cond:
            self._slot_cond.notify_all()

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
        layout, values = await self.layouts.commit(job, rank, nbytes, req)
        if not isinstance(req.get("metadata", {}), dict):
            raise RequestError("metadata must be a JSON object")
        row = Row(job, step, rank, world, nbytes, layout.digest, values, int(req.get("save_index", step)),
                  req.get("metadata") or {}, self.me)
        pend = self.book.admit(row, local=True)
        await asyncio.to_thread(self.memory.adopt, keys.shard_key(job, step, rank), slot)
        owner.leases.discard(slot)
        self._leases.discard(slot)
        self._lease_conn.pop(slot, None)
        self.book.record(pend, row, asyncio.ensure_future(asyncio.to_thread(checksum_file, slot, nbytes)), local=True)
        self.stats["bytes_in"] += nbytes
        if self.members is not None:
            asyncio.create_task(self._share(job, step, rank, world, nbytes, pend))
        return {"errors": self.book.take_errors(job)}

    # ------------------------------------------------------------------ peers
    async def _share(self, job: str, step: int, rank: int, world: int, nbytes: int, pend: Pending) -> None:
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
        if self.layouts.held(f"node-{r}", job, digest):
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
            self.layouts.mark(f"node-{r}", job, digest)
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
               "tierckpt_inflight_bytes": self._budget.used}
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
                self.layouts.forget_place(f"node-{r}")
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
                if st.manifest is None or (job, step) in self.book.pending:
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
                            self.layouts.forget(f"node-{r}", job, sh.layout)  # it came back empty
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
            self.layouts.mark("memory", job, digest)
            return True
        return False

    async def _op_prefetch(self, conn: _Conn, req: dict) -> dict:
        """The warm restore's report; with ``timeout`` (seconds), wait up to that long for it to finish."""
        timeout = float(req.get("timeout") or 0)
        if self._prefetched is not None and timeout > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._prefetched.wait(), timeout)
        return dict(self.prefetch)

    # ------------------------------------------------------------------ other ops
    async def _op_wait(self, conn: _Conn, req: dict) -> dict:
        job = keys.check_job(req["job"])
        step = req.get("step")
        timeout = float(req.get("timeout") or 3600)
        if step is None:
            evs = [ev for (j, _), ev in self.book.settled.items() if j == job]
            copies = [f for (j, _), fs in self._copies.items() if j == job for f in fs]
        else:
            evs = [self.book.settled[(job, keys.check_step(step))]] if (job, step) in self.book.settled else []
            copies = list(self._copies.get((job, step), ()))
        try:
            # written to every tier, and copied to the peers placement names (a failed copy is reported by
            # status and healed later: it does not fail the wait)
            await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in evs), *copies), timeout)
            done = True
        except asyncio.TimeoutError:
            done = False
        return {"done": done, "errors": self.book.take_errors(job)}

    async def _op_lower(self, conn: _Conn, req: dict) -> dict:
        """The newest step of ``job`` that any tier could hold, as far as this agent knows: ``known`` is
        False when the agent never saw the job or could not list every lower tier at start-up."""
        job = keys.check_job(req["job"])
        newest = self.book.newest(job)
        return {"known": self.book.lower_known and newest is not None, "newest": newest}

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
        later |= {s for (j, s) in list(self.book.pending) + list(self.book.settled) if j == job and s > step}
        waits = [self.book.settled[(job, s)].wait() for s in later if (job, s) in self.book.draining]
        waits += [f for s in later for f in self._copies.get((job, s), ())]
        if waits:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.gather(*waits, return_exceptions=True), self.settings.grace)
        for s in sorted(later):
            self.book.forget(job, s)
            await asyncio.to_thread(delete_step, self.memory, job, s)
        if later:
            log.info("%s resumed from step %d: dropped later steps %s from memory", job, step, sorted(later))
            async with self._slot_cond:
                self._slot_cond.notify_all()
        return {"dropped": sorted(later)}

    async def _op_errors(self, conn: _Conn, req: dict) -> dict:
        return {"errors": self.book.take_errors(keys.check_job(req["job"]))}

    async def _op_status(self, conn: _Conn, req: dict) -> dict:
        return {
            "pid": os.getpid(), "embedded": self.embedded, "connections": len(self._conns),
            "pending": [f"{j}/step-{s}: ranks {sorted(p.sizes)} of {p.world}" for (j, s), p in self.book.pending.items()],
            "draining": {f"{j}/step-{s}": sorted(t) for (j, s), t in self.book.draining.items()},
            "queued": self.drain.queued(),
            "inflight_bytes": self._budget.used,
            "errors": self.book.error_counts(),
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
        if self.book.draining.get((job, step)) or (job, step) in self.book.pending:
            raise RequestError(f"step {step} of {job} is being written; wait for it first")
        for t in [self.memory] + self.lower:
            if t.name in names:
                await asyncio.to_thread(delete_step, t, job, step)
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
