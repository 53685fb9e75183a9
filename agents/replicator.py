"""Replication: this node's shards onto its placement partners, the commit tree's transport, heartbeats, heal.

Built by the agent only when it has peers. Call order::

    Replicator(...)       membership, one client tier and one keep-alive control link per peer, the
                          commit tree (agents.dissemination) wired to the step book, the peer server
                          with the agent's routes below
    start()               serve; join the commit tree; heartbeat and heal loops
    share(…)              a trainer committed a shard here: copy it to the nodes placement names (each
                          pulls it) and send its commit row up the tree once its checksum is known
    copies(job, steps)    the copies still under way (a trainer's ``wait`` waits for them too)
    stop()                cancel the loops, stop serving, close links and thread pools

The agent's routes on the peer server (all signed; small JSON bodies, sent
zlib-deflated as ``Content-Type: application/x-tierckpt-deflate`` when large;
the server's own routes are in :mod:`agents.peer_server`)::

    POST /v1/up       commit tree, child → parent: {"rows": [commit row, ...], "epoch",
                      "reports": [["dead"|"alive", node], ...]}; answers {"view": {epoch, dead},
                      "manifests": [manifest text of a step already committed here]}
    POST /v1/down     commit tree, parent → child: {"manifests": [text], "view"}; the child commits
                      each manifest and forwards the message to its children
                      (both: a malformed message is a 400)
    POST /v1/fetch    replication: {"key", "size", "from", ["checksum"]}: this node pulls the shard
                      from node ``from`` (GET /v1/o/<key>) into its memory and answers {"checksum",
                      "token"} once it is verified (published at once) or held (no checksum sent:
                      "token" names the held copy); 400 bad request, 507 no room here, 502 the pull
                      failed (each with its reason in one line)
    POST /v1/publish  {"token", "checksum", "publish"}: publish the held copy if its checksum
                      matches (else 422), or drop it ({"dropped": true}); 404 for an unknown token

Layouts travel as plain objects: ``PUT /v1/o/<layout key>`` (the peer server
checks the content against the digest), once per peer and layout, before any
shard that names it. A commit row: {"job", "step", "rank", "world", "nbytes",
"checksum", "layout" (digest), "values", "save_index", "metadata", "node"}.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import functools
import hashlib
import json
import logging
import os
import time
import zlib
from collections.abc import Callable, Iterable

from recovery import step_index
from recovery.inventory import scan_tier
from tiers import keys
from tiers.checksum import checksum_file
from tiers.errors import KeyNotFoundError, TierError
from tiers.manifest import encode_group
from tiers.memory import MemoryTier

from .config import Settings, SettingsError
from .dissemination import Disseminator, View, tree_children, tree_parent
from .drain import ByteBudget
from .layouts import LayoutBook
from .mesh_placement import shard_copies
from .replication import DEFLATED_JSON, LinkPool, Membership, PeerLink, load_peer_list
from .stepbook import Pending, StepBook
from .tierset import disk_tier, peer_tier_map

__all__ = ["MAX_CONTROL_BODY", "Replicator"]

log = logging.getLogger("tierckpt.agent")

#: the largest control message (commit rows, manifests, views) accepted once inflated, in bytes
MAX_CONTROL_BODY = 64 << 20


#: shards larger than this (bytes) are pulled by the partner while their checksum is still being computed
#: (then published once both agree); smaller ones wait for the checksum and need no publish request
OVERLAP_CHECKSUM_ABOVE = 4 << 20

def _digest(nodes) -> str:
    return hashlib.sha256("\n".join(f"{n.addr} {n.domain or ''}" for n in nodes).encode()).hexdigest()[:16]


def _stat(path: str | None) -> tuple[int, int] | None:
    try:
        st = os.stat(path) if path else None
    except OSError:
        return None
    return None if st is None else (st.st_mtime_ns, st.st_size)


def _one_line(text: str) -> str:
    """An HTTP refusal's body: one line (an error's own newlines folded), ending in a newline."""
    return " ".join(text.split()) + "\n"


def _free_bytes(folder: str) -> int | None:
    """Bytes an unprivileged writer may still put in ``folder``'s file system (None if unknown)."""
    try:
        vfs = os.statvfs(folder)
    except OSError:
        return None
    return vfs.f_bavail * vfs.f_frsize


def _without_frames(e: BaseException) -> BaseException:
    """``e`` without its traceback, nor those of the errors it was raised from, and with the locals of their
    finished frames cleared: whatever those frames referenced (views of a mapping) is released."""
    import traceback

    seen: set[int] = set()
    todo: list[BaseException | None] = [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        traceback.clear_frames(x.__traceback__)
        x.__traceback__ = None
        todo += [x.__cause__, x.__context__]
    return e


def _close_mapping(mm) -> None:
    """Close an mmap whose views were released; views still held by a reference cycle are collected first.
    Never raises: a mapping still in use is unmapped once its last view is gone."""
    try:
        mm.close()
    except BufferError:
        import gc

        gc.collect()
        with contextlib.suppress(BufferError):
            mm.close()


class Replicator:
    """One agent's side of its peers: copies out and in, the commit tree, membership, heal."""

    def __init__(self, settings: Settings, memory: MemoryTier, book: StepBook, layouts: LayoutBook,
                 budget: ByteBudget, stats: dict, metrics: Callable[[], dict[str, float]]) -> None:
        from tiers.wire import TokenBucket, load_secret

        from .peer_server import PeerServer

        s = self.settings = settings
        self.me = settings.node_rank
        self.memory = memory
        self.book = book
        self.layouts = layouts
        self.budget = budget
        self.stats = stats
        nodes = load_peer_list(s.peers)
        #: what every node's peers file must agree on (addresses and domains, in node order)
        self.peers_digest = _digest(nodes)
        self._peers_stat = _stat(s.peers)
        #: nodes whose peers file differs from this node's (named in status and logged once each)
        self.peers_differ: set[int] = set()
        if not 0 <= s.node_rank < len(nodes):
            raise SettingsError(f"node rank {s.node_rank} is not in the peers file of {len(nodes)} nodes")
        if s.memory_only != (nodes[s.node_rank].role == "memory"):
            raise SettingsError(
                f"this agent runs {'with' if s.memory_only else 'without'} --memory-only but its line ({s.node_rank + 1})"
                f" of the peers file says role={nodes[s.node_rank].role}: every node needs the same file, and a "
                "memory-only node's line ends in role=memory")
        self.members = Membership(nodes, s.node_rank, s.replicas, s.placement, s.dead_after,
                                  startup_grace=s.startup_grace)
        self._secret = load_secret(s.secret_file) if s.secret_file else None
        self._client_ssl = None
        server_ssl = None
        if s.tls_cert:
            import ssl

            server_ssl = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            server_ssl.load_cert_chain(s.tls_cert, s.tls_key)
            self._client_ssl = ssl.create_default_context(cafile=s.tls_ca)
        self._bucket = TokenBucket(s.peer_bandwidth) if s.peer_bandwidth else None
        self.peer_tiers = peer_tier_map(s, timeout=s.peer_timeout, secret=self._secret,
                                        ssl_context=self._client_ssl, bucket=self._bucket)
        # heartbeats and probes: one try each, with a deadline of their own, so a peer that does not answer
        # costs its own beat and nobody else's (a round never waits for the slowest peer)
        from tiers.peer import PeerTier

        self._beat_deadline = max(0.2, min(s.peer_timeout, s.dead_after / 2))
        self._beat_tiers = {n.rank: PeerTier(n.addr, secret=self._secret, node=self.me, timeout=self._beat_deadline,
                                             ssl_context=self._client_ssl, retries=0)
                            for n in nodes if n.rank != self.me and n.role != "retired"}
        self._beating: dict[int, asyncio.Future] = {}
        mine = nodes[self.me]
        # control messages (commit tree, heartbeats) get their own threads and one keep-alive link per peer,
        # so neither the peer server (its own threads) nor the drains (the default executor) wait behind them
        self._ctrl_pool = concurrent.futures.ThreadPoolExecutor(max(4, 2 * s.fanout + 4),
                                                                thread_name_prefix="tierckpt-ctrl")
        # outgoing peer requests (which wait on a remote) and pulls served for a peer's fetch (which only wait
        # on the remote's sendfile) each have their own threads: neither can starve the other, nor serving
        self._out_pool = concurrent.futures.ThreadPoolExecutor(16, thread_name_prefix="tierckpt-out")
        # heartbeats of the watched peers, and probes of dead ones (which may each hold a thread for a whole
        # deadline): neither waits behind the other, nor behind the commit tree
        self._beat_pool = concurrent.futures.ThreadPoolExecutor(2 * s.fanout + 2 * s.replicas + 4,
                                                                thread_name_prefix="tierckpt-beat")
        self._probe_pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="tierckpt-probe")
        self._pull_pool = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="tierckpt-pull")
        self._links = {n.rank: PeerLink(n.addr, secret=self._secret, node=self.me, timeout=s.peer_timeout,
                                        ssl_context=self._client_ssl) for n in nodes if n.rank != self.me}
        # replication's fetch/publish requests, one per shard copied, reuse a few keep-alive links per peer
        self._fetch_links = LinkPool({n.rank: n.addr for n in nodes if n.rank != self.me}, size=8,
                                     secret=self._secret, node=self.me, timeout=s.peer_timeout,
                                     ssl_context=self._client_ssl)
        self.dis = Disseminator(self.me, alive=self.members.alive, post=self._post, on_rows=book.take_rows,
                                on_manifest=book.receive_manifest, on_view=self._adopt_view,
                                on_report=self.members.mark, dead=self.members.dead, nodes=len(self.members.active()),
                                probe=self._probe, quorum=s.quorum or None,
                                state_file=os.path.join(s.shm, ".election.json"), fanout=s.fanout,
                                resend_after=s.peer_timeout, retry_after=s.heartbeat)
        book.tree = self.dis
        self.peer_server = PeerServer(
            memory, host=mine.host, port=mine.port, secret=self._secret, node=self.me, ssl_context=server_ssl,
            extra_routes=[("POST", "/v1/up", self._tree_route(self.dis.handle_up)),
                          ("POST", "/v1/vote", self._tree_route(self.dis.handle_vote)),
                          ("POST", "/v1/down", self._tree_route(self.dis.handle_down)),
                          ("POST", "/v1/fetch", self._http_fetch), ("POST", "/v1/publish", self._http_publish)],
            metrics_cb=metrics, long_paths=("/v1/fetch",), disk=disk_tier(s),
            health_extra={"peers": self.peers_digest, "role": nodes[s.node_rank].role},
        )
        #: copies of local shards to peers still under way, per step (``wait`` waits for them too)
        self._copies: dict[tuple[str, int], set[asyncio.Future]] = {}
        self._pushing: set[tuple[int, str]] = set()
        self._layout_pushes: dict[tuple[int, str, str], asyncio.Future] = {}
        #: pulled copies waiting for the primary's checksum: token -> (key, temp file, checksum, since)
        self._unpublished: dict[str, tuple[str, str, str, float]] = {}
        self._sources_cache: tuple[frozenset[int], set[int]] | None = None
        self._heal_now: asyncio.Event | None = None
        self._near_all: set[int] | None = None
        #: bytes of copies being pulled into this node now (counted against ``memory_limit``)
        self._taking = 0
        self._tasks: list[asyncio.Task] = []

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Serve the peers, join the commit tree, start heartbeats and heal."""
        await self.peer_server.start()
        self.dis.start()
        self.dis.report("alive", self.me)  # a restarted node tells the root it is back
        self._heal_now = asyncio.Event()
        self._tasks.append(asyncio.create_task(self._heartbeat_loop(), name="heartbeat"))
        self._tasks.append(asyncio.create_task(self._heal_loop(), name="heal"))

    async def stop(self) -> None:
        """Cancel the loops, leave the commit tree, stop serving, close the links and thread pools."""
        for t in self._tasks:
            t.cancel()
        await self.dis.stop()
        with contextlib.suppress(Exception):
            await self.peer_server.stop()
        for link in self._links.values():
            link.close()
        self._fetch_links.close()
        for t in self._beat_tiers.values():
            t.close()
        for pool in (self._ctrl_pool, self._out_pool, self._pull_pool, self._beat_pool, self._probe_pool):
            pool.shutdown(wait=False, cancel_futures=True)

    def copies(self, job: str, steps: Iterable[int] | None = None) -> list[asyncio.Future]:
        """Copies of the job's shards (of ``steps``, or of every step) to peers still under way."""
        if steps is None:
            return [f for (j, _), fs in self._copies.items() if j == job for f in fs]
        return [f for s in steps for f in self._copies.get((job, s), ())]

    # ------------------------------------------------------------------ copies out
    async def share(self, job: str, step: int, rank: int, world: int, nbytes: int, pend: Pending) -> None:
        """Tell every live peer about a local shard (for its manifest), and copy it to its placement targets:
        the whole shard, or only its unique part where the job's own replicas hold the rest on enough nodes
        (:meth:`whole_copies`)."""
        shard = keys.shard_key(job, step, rank)
        path = self.memory.path(shard)
        digest = pend.layouts[rank]
        head = pend.uniques.get(rank)
        decided: asyncio.Future | None = None

        async def what() -> dict[int, bool]:
            """Per placement target, whether it gets the whole shard or only its unique part (where the job's
            own replicas hold the rest on enough nodes: :meth:`whole_copies`)."""
            targets = self.members.targets(self.me)
            if head is None:
                return dict.fromkeys(targets, True)
            if self.book.node_maps.get(job, (None,))[0] != world:
                # the job's first step here: where its ranks are is known once the step is committed (every
                # rank's row in; on a loaded machine that can take several peer timeouts); copied whole if not
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.book.wait_committed(job, step), 6 * self.settings.peer_timeout)
            return self.whole_copies(job, world, rank, head[1], targets)

        async def copy(r: int) -> bool:
            nonlocal decided
            if decided is None:
                decided = asyncio.ensure_future(what())
            if not (await asyncio.shield(decided)).get(r, True):
                key, size, checksum = keys.head_key(job, step, rank), head[0], head[2]
            else:
                key, size, checksum = shard, nbytes, pend.checksums[rank]
            if await self._push_layout(r, job, digest) and await self._push(r, key, path, size, checksum):
                return True
            st = self.members.peers.get(r)  # None: retired meanwhile
            if st is not None and os.path.exists(path):  # not trimmed meanwhile: one copy fewer than asked for
                self.book.notice(job, f"step {step}: rank {rank}'s shard has no copy on node {r} ({st.node.addr}) "
                                      f"yet: {st.last_error or 'the copy failed'}; it stays on node {self.me}, and "
                                      "the heal copies it again (ckpt status shows the peers)")
            return False

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
        if rank in pend.durables:
            n, ddigest, dsum = pend.durables[rank]
            record["durable"] = [n, await dsum, ddigest]
        if rank in pend.uniques:
            n, groups, usum = pend.uniques[rank]
            record["unique"] = [n, await usum, [encode_group(g) for g in groups]]
        self.dis.submit([record])
        await asyncio.gather(*copies)

    def whole_copies(self, job: str, world: int, rank: int, groups: tuple[tuple[int, ...], ...],
                     targets: list[int], nodes: dict[int, int] | None = None) -> dict[int, bool]:
        """Per target, whether ``rank``'s shard goes there whole (True) or only its unique part
        (:func:`agents.mesh_placement.shard_copies`), with the ranks placed by ``nodes`` (rank → node) or else by
        where they saved the job's newest step committed here (:attr:`StepBook.node_maps`). Ranks on nodes not
        alive now count as unknown, and every copy of a shard is whole while one of its holders' nodes is
        unknown (the job's first step, a replica's node down)."""
        if nodes is None:
            known = self.book.node_maps.get(job)
            nodes = known[1] if known is not None and known[0] == world else {}
        alive = self.members.alive()
        live = {r: n for r, n in nodes.items() if n in alive}
        return shard_copies(rank, groups, live, targets, self.settings.replicas)

    async def _push(self, r: int, key: str, src: str | bytes, nbytes: int,
                    checksum: "str | asyncio.Future | None" = None) -> bool:
        """Get ``key`` onto node ``r``: a shard is pulled by ``r`` from this node (GET with sendfile,
        read straight into its memory folder — the fast direction of HTTP), a small object is PUT.

        A push takes none of this node's in-flight byte budget: the bytes it moves are the receiver's to
        hold (its fetch takes the receiver's budget), and this node only serves them from memory it
        already holds. A push that held its own budget while the peer's fetch waited for the peer's
        would deadlock two nodes pushing to each other until the peer timeout."""
        if (r, key) in self._pushing:
            return True  # already on its way there
        self._pushing.add((r, key))
        st = self.members.peers[r]
        st.debt_bytes += nbytes
        t0 = time.perf_counter()
        try:
            if isinstance(src, str) and keys.parse_key(key) and not key.endswith(keys.MANIFEST_NAME):
                # a pull of a large shard may take a while: allow for a slow 50 MB/s link
                timeout = self.settings.peer_timeout + nbytes / 50e6

                def call(path: str, body: dict, t: float = self.settings.peer_timeout) -> dict:
                    return self._fetch_links.post(r, path, body, timeout=t)

                if isinstance(checksum, asyncio.Future) and nbytes <= OVERLAP_CHECKSUM_ABOVE:
                    # a small shard's checksum is done in well under a millisecond: waiting for it saves
                    # the publish request that overlapping the pull with it needs
                    checksum = await checksum
                if isinstance(checksum, str):
                    await self.out(call, "/v1/fetch", {"key": key, "size": nbytes, "checksum": checksum,
                                                                "from": self.me}, timeout)
                else:
                    # the peer pulls while this node's checksum is still being computed; the copy is
                    # published only once the two checksums are known to agree. The request waits in the
                    # outgoing-request threads, never the default executor: the peer's pull is served
                    # from this node by handlers that need the default executor (file opens), and
                    # requests parked there would starve them until the peer timeout
                    pull = asyncio.ensure_future(self.out(
                        call, "/v1/fetch", {"key": key, "size": nbytes, "from": self.me}, timeout))
                    if checksum is None:
                        checksum = asyncio.ensure_future(asyncio.to_thread(checksum_file, src, nbytes))
                    expected = await checksum
                    got = await pull
                    match = got.get("checksum") == expected
                    await self.out(call, "/v1/publish", {"token": got.get("token", ""),
                                                                  "checksum": expected, "publish": match})
                    if not match:
                        from tiers.errors import ChecksumMismatchError

                        raise ChecksumMismatchError(f"{key} reached node {r} with checksum {got.get('checksum')}, "
                                                    f"the primary has {expected}: copy dropped")
            else:
                await self.out(self.peer_tiers[r].put, key, src)
            st.sent_bytes += nbytes
            self.stats["replicated_bytes"] += nbytes
            log.info("%s copied to node %d: %d bytes in %.3f s", key, r, nbytes, time.perf_counter() - t0)
            return True
        except (TierError, OSError) as e:
            if isinstance(src, str) and not os.path.exists(src):
                log.info("%s not copied to node %d: trimmed here meanwhile", key, r)
                return False
            self._peer_error(r, e)
            return False
        finally:
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

    # ------------------------------------------------------------------ threads
    async def out(self, fn, *args):
        """Run a blocking request to a peer in the outgoing-request threads."""
        return await asyncio.get_running_loop().run_in_executor(self._out_pool, functools.partial(fn, *args))

    async def pulling(self, fn, *args):
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

    # ------------------------------------------------------------------ membership
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
        watch = set(self.dis.children())
        parent = self.dis.parent()
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

    # ------------------------------------------------------------------ routes (see the module docstring)
    async def _http_body(self, request) -> dict:
        """The request's JSON object (deflated or not); ValueError when it is not one."""
        data = await request.read()
        if request.content_type == DEFLATED_JSON:
            d = zlib.decompressobj()
            try:
                data = d.decompress(data, MAX_CONTROL_BODY)
            except zlib.error as e:
                raise ValueError(f"body is not deflated: {e}") from e
            if d.unconsumed_tail:
                raise ValueError(f"control message over {MAX_CONTROL_BODY} bytes once inflated")
        try:
            body = json.loads(data)
        except RecursionError as e:
            raise ValueError("body nests too deeply") from e
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
            except (ValueError, KeyError, TypeError, ArithmeticError) as e:
                return web.Response(status=400, text=_one_line(f"bad commit-tree message: {type(e).__name__}: {e}"))
            return web.json_response(answer)

        return route

    async def _http_fetch(self, request):
        """A peer asks this node to pull a shard from it (replication); answers once the copy is verified.

        400 for a malformed request, 507 when this node's memory has no room for it, 502 when the pull
        itself failed (the answer names the real error), a source holding another size included."""
        from aiohttp import web

        from tiers.errors import TierFullError
        from tiers.wire import CHECKSUM_RE

        try:
            req = await self._http_body(request)
            key, size, src, checksum = req["key"], req["size"], req["from"], req.get("checksum")
            if not isinstance(key, str) or not (info := keys.parse_key(key)) or info.is_manifest:
                raise ValueError(f"key {str(key)[:80]!r} is not a shard key")
            if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size < 2**63:
                raise ValueError(f"size {str(size)[:40]} is not a byte count")
            if isinstance(src, bool) or not isinstance(src, int) or src not in self.peer_tiers:
                raise ValueError(f"from {str(src)[:40]} is not another node of this job")
            if not (checksum is None or (isinstance(checksum, str) and CHECKSUM_RE.match(checksum))):
                raise ValueError(f"checksum {str(checksum)[:80]!r} is not a checksum")
        except (ValueError, KeyError, TypeError) as e:
            return web.Response(status=400, text=_one_line(f"bad fetch request: {type(e).__name__}: {e}"))
        room = await asyncio.to_thread(_free_bytes, self.memory.root)
        if room is not None and size > room:
            return web.Response(status=507, text=_one_line(
                f"no room for {key} ({size} bytes) in {self.memory.root} on node {self.me}: {room} bytes free"))
        limit = self.settings.memory_limit
        if limit:
            holding = (await self.peer_server.held_bytes(fresh=True))[0] + self._taking
            if holding + size > limit:
                return web.Response(status=507, text=_one_line(
                    f"no room for {key} ({size} bytes) on node {self.me}: it holds {holding} of the {limit} bytes "
                    f"its --memory-limit allows; the copy stays with its primary (raise the limit, or add memory "
                    f"nodes)"))
        self._taking += size
        # no request to the source first: the claimed size is bounded by the room here, and a source holding
        # another size fails the pull's ranged reads (fewer bytes) or its checksum (more): a 502 either way
        held = await self.budget.acquire(size)
        t0 = time.perf_counter()
        try:
            got, tmp = await self.pulling(self.pull, src, key, size, checksum)
            log.info("%s pulled from node %d: %d bytes in %.3f s", key, src, size, time.perf_counter() - t0)
        except TierFullError as e:
            return web.Response(status=507, text=_one_line(f"no room for {key} on node {self.me}: {e}"))
        except KeyNotFoundError as e:  # the source trimmed the step meanwhile: nothing to copy, nothing wrong
            return web.Response(status=410, text=_one_line(f"{key} is gone from node {src}: {e}"))
        except Exception as e:  # noqa: BLE001 - whatever broke the pull is the answer: the peer decides
            if not isinstance(e, (TierError, OSError)):
                log.warning("pull of %s from node %d failed", key, src, exc_info=e)
            return web.Response(status=502, text=_one_line(
                f"pull of {key} from node {src} failed: {type(e).__name__}: {e}"))
        finally:
            self._taking -= size
            await self.budget.release(held)
        token = ""
        if tmp:
            token = os.path.basename(tmp)
            self._unpublished[token] = (key, tmp, got, time.monotonic())
        return web.json_response({"checksum": got, "token": token})

    async def _http_publish(self, request):
        """Second half of a pull without a checksum: publish the copy if the primary's checksum matches."""
        from aiohttp import web

        try:
            req = await self._http_body(request)
            token, checksum, keep = req["token"], req["checksum"], req.get("publish", True)
            if not isinstance(token, str) or not isinstance(checksum, str) or not isinstance(keep, bool):
                raise TypeError("token and checksum are strings, publish a boolean")
        except (ValueError, KeyError, TypeError) as e:
            return web.Response(status=400, text=_one_line(f"bad publish request: {type(e).__name__}: {e}"))
        entry = self._unpublished.pop(token, None)
        if entry is None:
            return web.Response(status=404, text="no such pulled copy (expired or already published)\n")
        key, tmp, got, _ = entry
        if not keep or got != checksum:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            if keep:
                return web.Response(status=422, text=_one_line(f"{key}: received {got}, primary has {checksum}"))
            return web.json_response({"dropped": True})
        await asyncio.to_thread(os.rename, tmp, self.memory.path(key))
        return web.json_response({"published": True})

    def pull(self, src: int, key: str, size: int, checksum: str | None) -> tuple[str, str]:
        """Read ``key`` from node ``src`` straight into a new file of the memory folder and checksum it.

        With ``checksum`` the copy is verified and published at once; without, it stays a temp file
        until :meth:`_http_publish` is told the checksum the primary computed meanwhile. Returns
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
        info = keys.parse_key(key)
        if info is not None and info.head:
            # a shard's head is the first bytes of the shard the source holds
            key = keys.shard_key(info.job, info.step, info.rank)
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
                    mm = mmap.mmap(fd, size)
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
                        # the error's traceback (and those of the errors it came from) holds views of the
                        # mapping, through the frames that read into it: drop them, so the mapping can be
                        # closed and the error that broke the pull is the one reported
                        failure = _without_frames(e)
                    finally:
                        mv.release()
                        _close_mapping(mm)
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

    # ------------------------------------------------------------------ heartbeats and heal
    async def _heartbeat_loop(self) -> None:
        """Heartbeat the watched peers (tree neighbours, placement partners) and probe the dead ones this node
        is near, each peer on its own: a beat has a deadline of its own, and the sweep that declares silent
        peers dead runs every ``heartbeat`` seconds whatever the beats still under way. Changes go to the
        root."""
        self._rewatch()
        while True:
            watched = self.members.watched
            for r in sorted(watched | self._dead_probes()):
                f = self._beating.get(r)
                if f is None or f.done():
                    self._beating[r] = asyncio.ensure_future(
                        self._beat(r, self._beat_pool if r in watched else self._probe_pool))
            changed = False
            for r in self.members.sweep():
                self.layouts.forget_place(f"node-{r}")
                log.warning("node %d (%s) declared dead: silent for %.1f s", r, self.members.nodes[r].addr,
                            self.members.silence_allowed(r))
                self.dis.report("dead", r)
                changed = True
            if changed:
                self._membership_changed()
            now_stat = _stat(self.settings.peers)
            if now_stat != self._peers_stat:
                self._peers_stat = now_stat
                self.reload_peers()
            await asyncio.sleep(self.settings.heartbeat)

    def member_gone(self, r: int) -> None:
        """Node ``r``'s registration in the membership store is gone (its lease expired): unless it answers a
        health check now, it is dead for placement and healing at once, without waiting for the heartbeats.
        (A lease also runs out when etcd itself was away, or slow to come back: a node that still answers
        is kept, and registers again.)"""
        if r not in self.members.peers or not self.members.peers[r].alive:
            return

        async def check() -> None:
            if await self._probe(r):
                log.info("node %d's etcd lease expired but it answers: kept alive (it registers again)", r)
                return
            if self.members.mark("dead", r):
                log.warning("node %d (%s) declared dead: its etcd lease expired and it does not answer", r,
                            self.members.nodes[r].addr)
                self.layouts.forget_place(f"node-{r}")
                self.dis.report("dead", r)
                self._membership_changed()

        self._tasks = [t for t in self._tasks if not t.done()]
        self._tasks.append(asyncio.ensure_future(check()))

    def reload_peers(self) -> list[int]:
        """Read the peers file again and take in the nodes whose address or domain changed (a node replaced
        by a machine at a new address) and the nodes added at its end (the cluster grew): links, clients,
        placement and the election's quorum follow, and each new machine gets a start-up grace. A node whose
        line says ``role=retired`` now leaves the cluster (a line is retired rather than removed, which would
        move every later node's rank). Returns the nodes taken in or retired."""
        from .placement import PeerListError

        try:
            new = load_peer_list(self.settings.peers)
        except (OSError, PeerListError) as e:
            log.error("the peers file %s cannot be read again (%s): keeping the %d nodes this agent knows",
                      self.settings.peers, e, len(self.members.nodes))
            return []
        old = list(self.members.nodes)
        if len(new) < len(old):
            log.error("the peers file now lists %d nodes, this agent runs with %d: nodes can be added at the end "
                      "given a new address or retired (role=retired on its line) while the agents run; a removed line "
                      "would move the ranks of the nodes after it: put it back and retire it", len(new), len(old))
            return []
        if new[self.me].addr != old[self.me].addr:
            log.error("the peers file now gives this node (%d) the address %s, it serves %s: restart this agent "
                      "to move it", self.me, new[self.me].addr, old[self.me].addr)
            return []
        added = new[len(old):]
        changed = [n for n in new[:len(old)] if n.rank != self.me
                   and (n.addr, n.domain, n.role) != (old[n.rank].addr, old[n.rank].domain, old[n.rank].role)]
        retired = [n for n in changed if n.role == "retired"]
        moved = [n for n in changed if n.role != "retired"]
        for n in added:
            log.warning("node %d (%s%s) joined: the cluster has %d nodes now", n.rank, n.addr,
                        ", memory-only" if n.role == "memory" else "", n.rank + 1)
            self.members.add(n)
            self._open_node(n)
        for n in retired:
            log.warning("node %d (%s) is retired (role=retired in the peers file): it leaves the cluster; placement, "
                        "heartbeats and the commit quorum go on without it, and the heal makes up the copies it "
                        "held", n.rank, old[n.rank].addr)
            self.members.retire(n)
            self._close_node(n.rank)
            self.layouts.forget_place(f"node-{n.rank}")
            self.peers_differ.discard(n.rank)
        for n in moved:
            was = old[n.rank]
            log.log(logging.INFO if ".invalid:" in was.addr else logging.WARNING,
                    "node %d is %s now (was %s%s): taking in the new machine", n.rank, n.addr, was.addr,
                    ", retired" if was.role == "retired" else "")
            self.members.replace(n)
            self._close_node(n.rank)
            self._open_node(n)
            self.layouts.forget_place(f"node-{n.rank}")  # a new machine holds none of the job's layouts
            self.peers_differ.discard(n.rank)
        if added or retired or any(old[n.rank].role == "retired" for n in moved):
            self.dis.election.resize(len(self.members.active()))
            self._near_all = None
            self._sources_cache = None
        self.peers_digest = _digest(self.members.nodes)
        self.peer_server.health_extra["peers"] = self.peers_digest
        if changed or added:
            self._membership_changed()
        return [n.rank for n in changed + added]

    def _open_node(self, n) -> None:
        """Links, clients and the heartbeat client for node ``n`` (one that joined or moved)."""
        from tiers.peer import PeerTier

        s = self.settings
        self._links[n.rank] = PeerLink(n.addr, secret=self._secret, node=self.me, timeout=s.peer_timeout,
                                       ssl_context=self._client_ssl)
        self._fetch_links.readdress(n.rank, n.addr)
        if n.role == "retired":
            return
        self.peer_tiers[n.rank] = PeerTier(n.addr, secret=self._secret, node=self.me, timeout=s.peer_timeout,
                                           ssl_context=self._client_ssl, bucket=self._bucket)
        self._beat_tiers[n.rank] = PeerTier(n.addr, secret=self._secret, node=self.me,
                                            timeout=self._beat_deadline, ssl_context=self._client_ssl, retries=0)

    def _close_node(self, rank: int) -> None:
        """Close what :meth:`_open_node` opened for node ``rank`` (it moved or left)."""
        for table in (self._links, self.peer_tiers, self._beat_tiers):
            client = table.pop(rank, None)
            if client is not None:
                with contextlib.suppress(Exception):
                    client.close()

    async def _health(self, r: int, pool) -> dict:
        return await asyncio.get_running_loop().run_in_executor(pool, self._beat_tiers[r].health)

    async def _beat(self, r: int, pool) -> bool:
        """One health check of node ``r``; True when it answered (a dead node that answers is back)."""
        try:
            h = await self._health(r, pool)
        except (TierError, OSError, ValueError) as e:
            self.members.peers[r].last_error = str(e)
            return False
        theirs = h.get("peers")
        if isinstance(theirs, str) and theirs != self.peers_digest:
            if r not in self.peers_differ:
                log.error("node %d (%s) has another peers file than this node (digest %s, here %s): every node "
                          "needs the same file, in the same order; copy this node's to it and restart its agent",
                          r, self.members.nodes[r].addr, theirs, self.peers_digest)
            self.peers_differ.add(r)
        else:
            self.peers_differ.discard(r)
        if self.members.seen(r, int(h.get("bytes_held", 0) or 0)):
            log.info("node %d (%s) is back", r, self.members.nodes[r].addr)
            self.dis.report("alive", r)
            self._membership_changed()
        return True

    async def _probe(self, r: int) -> bool:
        """Whether node ``r`` answers now (asked by a vote for the commit root)."""
        if r not in self._beat_tiers:
            return False
        return await self._beat(r, self._probe_pool)

    def _membership_changed(self) -> None:
        self._rewatch()
        self.dis.view_changed()
        if self._heal_now is not None:
            self._heal_now.set()

    def _dead_probes(self) -> set[int]:
        """The dead nodes this node probes until they answer: its neighbours and placement partners as if
        every node were alive, and every dead node while this node is root or sees no root (a node cut off
        from the others probes them all, so it finds its way back)."""
        dead = self.members.dead()
        if not dead:
            return set()
        if self.dis.is_root() or self.dis.root() is None:
            return dead
        near = self._near_all
        if near is None:
            everyone = sorted(n.rank for n in self.members.active())
            near = set(tree_children(everyone, self.me, self.settings.fanout))
            parent = tree_parent(everyone, self.me, self.settings.fanout)
            near |= {parent} if parent is not None else set()
            near |= {r for r in self.members.desired(self.me, set(everyone))}
            near |= {r for r in everyone if self.me in self.members.desired(r, set(everyone))}
            near = self._near_all = near - {self.me}
        return dead & near

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
        inv = await asyncio.to_thread(scan_tier, self.memory, None, with_sizes=True, cache=self.book.manifests)
        await asyncio.to_thread(step_index.rebuild_places, [inv])  # replicas that came after their manifest
        held: dict[int, set[str]] = {self.me: set()}
        for job, steps in inv.steps.items():
            for step, st in steps.items():
                held[self.me] |= {keys.shard_key(job, step, r) for r in st.shards}
                if st.has_manifest:
                    held[self.me].add(keys.manifest_key(job, step))

        async def listing(r: int) -> None:
            try:
                held[r] = set(await self.out(self.peer_tiers[r].list, ""))
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
                nodes: dict[int, int] | None = None  # rank -> node, by this step's manifest (made once)
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
                    # where the job's own replicas hold the rest, a partner needs only the unique part
                    targets = [r for r in want if r != sh.node]
                    whole = dict.fromkeys(targets, True) if sh.unique is None else self.whole_copies(
                        job, st.manifest.world, sh.rank, sh.unique[2], targets,
                        nodes if nodes is not None else (nodes := {s.rank: s.node for s in st.manifest.shards}))
                    hkey = keys.head_key(job, step, sh.rank)
                    for r in want:
                        head = not whole.get(r, True)
                        if r not in held or key in held[r] or (head and hkey in held[r]):
                            continue
                        if sh.layout and keys.layout_key(job, sh.layout) not in held[r]:
                            self.layouts.forget(f"node-{r}", job, sh.layout)  # it came back empty
                            if not await self._push_layout(r, job, sh.layout):
                                continue
                            held[r].add(keys.layout_key(job, sh.layout))
                        if not os.path.exists(self.memory.path(key)):
                            break  # trimmed here since the scan: a step on its way out is not copied again
                        if head:
                            got = await self._push(r, hkey, self.memory.path(key), sh.unique[0], sh.unique[1])
                        else:
                            got = await self._push(r, key, self.memory.path(key), sh.size, sh.checksum)
                        if got:
                            made += 1
                            held[r].add(hkey if head else key)
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

    # ------------------------------------------------------------------ status
    def tree_status(self) -> dict | None:
        """This node's place in the commit tree and its control traffic."""
        d = self.dis
        e = d.election
        return {"live": d.live(), "root": d.root(), "is_root": d.is_root(), "parent": d.parent(),
                "children": d.children(), "epoch": d.view.epoch, "seq": d.view.seq, "promised": e.promised,
                "quorum": e.quorum, "nodes": e.nodes, "campaigns": e.campaigns, "won_epochs": e.won_epochs[-8:],
                "blocked": d.blocked(), "peers_file_differs": sorted(self.peers_differ),
                "dead": sorted(d.view.dead), "watched": sorted(self.members.watched),
                "stats": {k: v for k, v in vars(d.stats).items() if isinstance(v, int)},
                "sent": sum(link.sent for link in self._links.values()),
                "sent_bytes": sum(link.sent_bytes for link in self._links.values())}

    def peer_status(self) -> list[dict]:
        """What this node knows of each peer (for ``status``)."""
        now = time.monotonic()
        return [{"node": r, "addr": p.node.addr, "domain": p.node.domain, "alive": p.alive,
                 "last_seen_s": None if p.last_seen is None else round(now - p.last_seen, 3),
                 "bytes_held": p.bytes_held, "sent_bytes": p.sent_bytes, "debt_bytes": p.debt_bytes,
                 "errors": p.errors, "last_error": p.last_error,
                 "replicates_to": r in self.members.targets(self.me), "watched": r in self.members.watched}
                for r, p in sorted(self.members.peers.items())]
