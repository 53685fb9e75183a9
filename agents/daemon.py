"""The node agent: owns the memory tier, takes shards from trainers, drains them to disk and S3.

Life of a step, as the agent sees it::

    begin   (each rank)  lease a pre-faulted staging slot in the memory folder (or, for a trainer that cannot
                         wait, one only sized); size and fault in the rest of the rank's ring of slots in the
                         background (the first time, and when the size changes)
    commit  (each rank)  the slot becomes the rank's shard (a hard link); checksum it
    ── all ``world`` ranks committed ──
    manifest written to the memory tier (the step is now complete in memory)
    drain   disk every ``disk_every`` saves, S3 every ``s3_every`` saves:
            every shard first, the manifest last, in each tier
    trim    each tier keeps its newest ``keep_*`` complete steps
    end     (each rank, at a clean close) once every trainer of the job on this node ended, an embedded
            agent frees the job's memory tier if a lower tier holds its newest step

Everything slow (checksums, copies, uploads) runs in worker threads, so the
agent keeps answering trainers while it drains. A failure in the background is
stored and handed to the job's trainers, once, in the answer to their next
request. The agent never crashes on a bad request: it answers with an error.

This module keeps the agent's lifecycle (the memory folder's lock, the rebuild
after a restart, start, serve, stop, the embedded agent's idle exit), the Unix
socket and its ops (:mod:`agents.protocol`), staging-slot leases and status.
The work is done by the parts it wires together, each readable alone::

    agents.layouts     LayoutBook: layouts parsed once, stored once per place, trimmed
    agents.stepbook    StepBook: per-step state and the one intake for commit rows
    agents.drain       Drainer: write-back to disk and S3, retention of every tier
    agents.replicator  Replicator (with peers): copies, commit tree, heartbeats, heal
    agents.warm        WarmRestore (with peers): the pull of this node's shards at start

Call order: ``Agent(settings)`` builds the tiers (:mod:`agents.tierset`) and
the parts; ``start()`` takes the lock, starts the drain workers, sweeps temp
files, rebuilds, starts replication and the warm restore, then opens the
socket; ``stop()`` waits up to ``grace`` s for drains, then stops the parts.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from recovery import step_index
from recovery.inventory import scan_tier
from tiers import keys
from tiers.base import Tier
from tiers.checksum import checksum_file, checksum_file_and_heads
from tiers.disk import DiskTier
from tiers.errors import TierError
from tiers.memory import background_priority

from .config import Settings, SettingsError, private_socket_folder
from .drain import ByteBudget, Drainer, delete_step
from .jobends import JobEnds
from .takeover import RUN_KEY, take_over
from .layouts import LayoutBook
from .protocol import MAX_LINE, PROTOCOL_VERSION, RequestError, peer_credentials, trusted_uid
from .replicator import Replicator
from .stepbook import Row, StepBook, unique_part
from .tierset import disk_tier, memory_tier, s3_tier
from .warm import WarmRestore, idle_report

__all__ = ["Agent", "AgentAlreadyRunningError", "run_agent"]

log = logging.getLogger("tierckpt.agent")

#: seconds between two log lines about connections refused on the control socket (each is counted)
_REFUSAL_LOG_EVERY = 10.0


class AgentAlreadyRunningError(RuntimeError):
    """Another agent already owns the memory folder."""


@dataclass(eq=False)
class _Conn:
    """One trainer connection; ``pid`` is its process (from the socket's credentials)."""

    pid: int = 0
    leases: set[str] = field(default_factory=set)
    jobs: set[str] = field(default_factory=set)
    #: jobs this trainer ended cleanly (the ``end`` op)
    ended: set[str] = field(default_factory=set)
    #: the run of each job this trainer said hello for (None: a trainer that named no run)
    runs: dict[str, str | None] = field(default_factory=dict)


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
        self.stats = {"saves": 0, "bytes_in": 0, "drained": {t.name: 0 for t in self.lower}, "replicated_bytes": 0,
                      "refused_connections": 0}
        self.me = settings.node_rank
        self.layouts = LayoutBook(self.memory, settings.layout_grace)
        self.book = StepBook(self.memory, self.me, self.stats)
        self._budget = ByteBudget(settings.max_inflight_bytes)
        self.drain = Drainer(settings, self.me, self.memory, self.book, self.layouts, self._budget, self.stats,
                             self._slots_freed)
        self.book.on_commit = self.drain.committed
        self._leases: set[str] = set()
        self._lease_conn: dict[str, _Conn] = {}
        #: free slots being sized and faulted in ahead of the saves that will lease them, and the task per
        #: ``(job, rank)`` doing it
        self._filling: set[str] = set()
        self._fillers: dict[tuple[str, int], asyncio.Task] = {}
        #: the threads that size and fault in staging slots, at the lowest CPU priority: the trainers' steps
        #: that run meanwhile on the same cores go first
        self._slot_pool = ThreadPoolExecutor(2, thread_name_prefix="agent-slots", initializer=background_priority)
        #: runs, clean ends and crashes of each job (what a crashed job keeps, and until when)
        self.ends = JobEnds(settings.keep_after_crash, self._kept_ran_out)
        self._slot_cond: asyncio.Condition | None = None
        self._conns: set[_Conn] = set()
        self._last_activity = time.monotonic()
        self._stop: asyncio.Event | None = None
        self._lock_fd: int | None = None
        self._server: asyncio.AbstractServer | None = None
        #: ``(pid, uid, gid)`` of a connected socket's other end; replaced by tests
        self._credentials = peer_credentials
        self._refusal_logged_at = -1e9
        self.replicator: Replicator | None = None
        self.warm: WarmRestore | None = None
        #: membership from etcd (agents/directory.py), when the settings name it; set by run_agent
        self.directory = None
        #: why this agent stopped being its node (another took the rank over in etcd), or ""
        self.replaced = ""
        self._directory_task: asyncio.Task | None = None
        if settings.peers:
            self.replicator = Replicator(settings, self.memory, self.book, self.layouts, self._budget, self.stats,
                                         self._metrics)
            self.warm = WarmRestore(settings, self.memory, self.replicator, self.layouts, self._budget)

    # ------------------------------------------------------------------ lifecycle
    def _take_lock(self) -> None:
        with contextlib.suppress(OSError):  # the memory folder is this user's alone (a folder of another's stays)
            if os.stat(self.memory.root).st_uid == os.getuid():
                os.chmod(self.memory.root, 0o700)
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
        if self.replicator is not None:
            await self.replicator.start()
            self.warm.start()
        if self.directory is not None:
            self.directory.on_gone = self.replicator.member_gone if self.replicator else None
            self.directory.on_replaced = self._replaced
            if self.replicator is not None:  # won epochs are recorded in etcd, and a higher one there is followed
                election = self.replicator.dis.election
                election.record = self.directory.record_root
                self.directory.on_root_epoch = election.note_epoch
            self._directory_task = asyncio.create_task(self.directory.run(), name="etcd")
        path = self.settings.socket_path
        private_socket_folder(path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        # the folder is this user's alone (0700), so nobody else can reach the socket before the chmod either
        self._server = await asyncio.start_unix_server(self._handle, path=path, limit=MAX_LINE)
        os.chmod(path, 0o600)
        log.info(
            "agent %d ready on %s (memory %s, disk %s, s3 %s)",
            os.getpid(), path.replace("\0", "@"), self.memory.root, self.settings.disk, self.settings.s3,
        )

    def _replaced(self, why: str) -> None:
        self.replaced = why
        self._stop.set()

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
        for task in self._fillers.values():
            task.cancel()
        self._slot_pool.shutdown(wait=False, cancel_futures=True)
        self.ends.close()
        self.drain.stop()
        if self._directory_task is not None:
            self._directory_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._directory_task
        if self.replicator is not None:
            self.warm.stop()
            await self.replicator.stop()
        if abandoned:
            log.warning("agent stopping with writes abandoned (left incomplete, never reported complete): %s",
                        json.dumps(abandoned))
        else:
            log.info("agent stopping: every write finished")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.settings.socket_path)
        for t in self.lower:
            with contextlib.suppress(Exception):
                t.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    async def _idle_watch(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            # a crashed job's memory is kept for its restart: the agent it connects to stays up meanwhile
            busy = self._conns or self.drain.busy() or self.ends.keeping()
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
                for t in self.drain.targets(save_index, bool(st.manifest.metadata.get("every_tier"))):
                    have = lower[t.name].job(job).get(step)
                    # a node's disk holds its own ranks' shards (node-complete); the shared S3 prefix every
                    # rank's (job-complete)
                    done = have is not None and (have.complete if lower[t.name].shared
                                                 else have.node_complete(self.me))
                    if lower[t.name].error is None and not done:
                        log.info("re-queueing %s step %d for the %s tier (interrupted before)", job, step, t.name)
                        self.drain.enqueue(t, job, step)
        await asyncio.to_thread(step_index.rebuild_places, [inv, *lower.values()])
        await self.drain.trim_all()

    # ------------------------------------------------------------------ requests
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Conn()
        sock = writer.get_extra_info("socket")
        try:
            conn.pid, uid, _gid = self._credentials(sock)
        except (OSError, AttributeError) as e:
            # who connected cannot be told, so it cannot be trusted
            self._refuse_local(f"a connection whose credentials cannot be read ({e})")
            await self._close_refused(reader, writer, "the agent cannot read this connection's credentials")
            return
        if not trusted_uid(uid):
            self._refuse_local(f"pid {conn.pid} running as uid {uid}")
            await self._close_refused(
                reader, writer, f"this agent serves only uid {os.getuid()}; you are uid {uid}: run your own agent "
                        "(ckpt agent --shm DIR)")
            return
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
                await self._slots_freed()
            with contextlib.suppress(Exception):
                writer.close()
            if self._stop is not None and not self._stop.is_set():
                # the agent stopping cancels this task: a crash is not learnt then (the memory stays anyway)
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await self._gone(conn)

    def _refuse_local(self, who: str) -> None:
        """Count a refused connection and log it, at most once per ``_REFUSAL_LOG_EVERY`` seconds."""
        self.stats["refused_connections"] += 1
        now = time.monotonic()
        if now - self._refusal_logged_at >= _REFUSAL_LOG_EVERY:
            self._refusal_logged_at = now
            log.warning("refused %s on the control socket (%d refused so far): only uid %d and root are served",
                        who, self.stats["refused_connections"], os.getuid())

    @staticmethod
    async def _close_refused(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, message: str) -> None:
        """Answer a refused connection with one error line and close it, having read (and dropped) what its
        first request sent for up to a second: closing on unread bytes would reset the connection before the
        client reads why."""
        with contextlib.suppress(Exception):
            await Agent._reply(writer, {"ok": False, "error": "PermissionError", "message": message})
            await asyncio.wait_for(reader.read(1 << 16), 1.0)
        with contextlib.suppress(Exception):
            writer.close()

    @staticmethod
    async def _reply(writer: asyncio.StreamWriter, resp: dict) -> None:
        writer.write(json.dumps(resp, separators=(",", ":")).encode() + b"\n")
        await writer.drain()

    async def _op_hello(self, conn: _Conn, req: dict) -> dict:
        if req.get("job") is not None:  # a trainer of this job, from its first request on
            job = keys.check_job(req["job"])
            run = req.get("run")
            if run is not None and (not isinstance(run, str) or not run or len(run) > 200):
                raise RequestError("run must be a non-empty string of at most 200 characters")
            self.ends.hello(job, run, conn.pid, [(c.pid, c.runs) for c in self._conns if c is not conn])
            conn.jobs.add(job)
            conn.runs[job] = run
        return {"version": PROTOCOL_VERSION, "pid": os.getpid(), "embedded": self.embedded,
                "settings": self.settings.to_dict()}

    async def _op_begin(self, conn: _Conn, req: dict) -> dict:
        if self.settings.memory_only:
            raise RequestError("this agent is memory-only (--memory-only): it holds replicas for the training "
                               "nodes and takes no saves; point the trainer at its own node's agent")
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
                    # a trainer that cannot wait (its save is blocked meanwhile) takes the slot only sized and
                    # faults it in while it copies: ``fault`` False
                    await self._prepare_slot(slot, nbytes, bool(req.get("fault", True)))
                except BaseException:
                    self._leases.discard(slot)
                    conn.leases.discard(slot)
                    self._lease_conn.pop(slot, None)
                    raise
                self._fill_ahead(job, rank, nbytes)
                # a lease taken ahead in a trainer's background thread asks for no errors (``errors`` False):
                # handed to it, they could reach the trainer after its wait() had answered that there were none
                return {"slot": slot, "ring": self._ready_slots(job, rank, nbytes),
                        "errors": self.book.take_errors(job) if req.get("errors", True) else []}
            await self.drain.trim(self.memory, job, layouts=False)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                busy = sorted(f"step {s} ({', '.join(sorted(t))})" for (j, s), t in self.book.draining.items()
                              if j == job and t)
                blocked = self._commit_blocked(job, None)
                why = (f"no free staging slot for {job} rank {rank}: "
                       f"{'still draining: ' + '; '.join(busy) if busy else 'every slot holds a retained step'}"
                       + (f"; {blocked}; save skipped" if blocked
                          else "; save skipped (raise keep_memory or drain faster)"))
                if wait:
                    log.warning(why)
                return {"skip": why, "errors": self.book.take_errors(job) if req.get("errors", True) else []}
            async with self._slot_cond:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._slot_cond.wait(), timeout=min(remaining, 1.0))

    async def _slots_freed(self) -> None:
        """Wake the begins waiting for a staging slot: one may be free now."""
        async with self._slot_cond:
            self._slot_cond.notify_all()

    @property
    def ring(self) -> int:
        """Staging slots per ``(job, rank)``: the ``keep_memory`` retained steps, the step being committed
        (its manifest not yet written, so the oldest retained step is not trimmed yet) and the next save's,
        leased right after that commit: so the next save finds a free, faulted slot without waiting."""
        return self.settings.keep_memory + 2

    async def _prepare_slot(self, slot: str, nbytes: int, fault: bool = True) -> bool:
        """``memory.prepare_slot``: faulting in (ahead of the save that will use the slot) on the low-priority
        slot threads (:attr:`_slot_pool`); only sizing (a save is blocked on it) at normal priority."""
        if not fault:
            return await asyncio.to_thread(self.memory.prepare_slot, slot, nbytes, False)
        return await asyncio.get_running_loop().run_in_executor(
            self._slot_pool, self.memory.prepare_slot, slot, nbytes, True)

    def _free_slot(self, job: str, rank: int, skip: set[str] = frozenset()) -> str | None:
        """A free slot of ``(job, rank)`` (not leased, not being filled, not in ``skip``), or the path of a new
        one while the ring is not full; None when every slot is taken."""
        slots = self.memory.slots(job, rank)
        for p in slots:
            if p not in self._leases and p not in self._filling and p not in skip and self.memory.slot_is_free(p):
                return p
        # a new slot leased by a begin still preparing it (in a thread) is not a file yet: it counts too
        folder = self.memory.slot_dir(job, rank)
        taken = set(slots) | {p for p in self._leases | self._filling if os.path.dirname(p) == folder}
        if len(taken) < self.ring:
            used = {os.path.basename(p) for p in taken}
            i = next(i for i in range(len(taken) + 1) if f"slot-{i}" not in used)
            return self.memory.new_slot_path(job, rank, i)
        return None

    def _ready_slots(self, job: str, rank: int, nbytes: int) -> list[str]:
        """The slots of ``(job, rank)`` already sized to ``nbytes`` and faulted in (the trainer maps them ahead
        of the saves that will lease them)."""
        out = []
        for p in self.memory.slots(job, rank):
            if p in self._filling:
                continue
            with contextlib.suppress(OSError):
                st = os.stat(p)
                if nbytes and st.st_size == nbytes and st.st_blocks * 512 >= nbytes:
                    out.append(p)
        return out

    def _fill_ahead(self, job: str, rank: int, nbytes: int) -> None:
        """Size and fault in the rest of ``(job, rank)``'s ring now, in the background, so the saves after
        this one never fault fresh memory (a copy into fresh tmpfs pages is several times slower)."""
        key = (job, rank)
        task = self._fillers.get(key)
        if nbytes == 0 or (task is not None and not task.done()):
            return
        self._fillers[key] = asyncio.create_task(self._fill_ring(job, rank, nbytes), name=f"fill-{job}-{rank}")

    async def _fill_ring(self, job: str, rank: int, nbytes: int) -> None:
        done: set[str] = set()
        while True:
            slot = self._free_slot(job, rank, skip=done)
            if slot is None:
                return
            self._filling.add(slot)
            try:
                await self._prepare_slot(slot, nbytes)
            except (OSError, TierError) as e:
                # not an error of any save: a begin that needs this slot sizes it itself and reports it
                log.warning("could not fault in a staging slot of %s rank %d ahead of time: %s", job, rank, e)
                return
            finally:
                self._filling.discard(slot)
                await self._slots_freed()
            done.add(slot)

    async def _op_release(self, conn: _Conn, req: dict) -> dict:
        slot = str(req["slot"])
        owner = self._lease_conn.get(slot)
        if owner is not None and owner.pid == conn.pid:
            owner.leases.discard(slot)
            self._leases.discard(slot)
            self._lease_conn.pop(slot, None)
        await self._slots_freed()
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
        meta = dict(req.get("metadata") or {})
        if req.get("every_tier"):
            meta["every_tier"] = True  # a forced save: every lower tier, whatever disk_every and s3_every say
        if isinstance(req.get("run"), str):
            meta[RUN_KEY] = req["run"]  # which run wrote the step: a new run takes over other runs' steps
        durable = req.get("durable")
        part = None if durable is None else await self.layouts.durable(job, rank, layout, durable)
        unique = req.get("unique")
        if unique is not None:
            if not isinstance(unique, list) or len(unique) != 2:
                raise RequestError("unique must be [bytes, [[rank, ...], ...]]")
            unique = unique_part(unique[0], unique[1], rank, world, nbytes, durable)
            self.layouts.check_boundary(rank, layout, unique[0], "unique")
        row = Row(job, step, rank, world, nbytes, layout.digest, values, int(req.get("save_index", step)),
                  meta, self.me, None if part is None else (durable, part.digest), unique)
        pend = self.book.admit(row, local=True)
        await asyncio.to_thread(self.memory.adopt, keys.shard_key(job, step, rank), slot)
        owner.leases.discard(slot)
        self._leases.discard(slot)
        self._lease_conn.pop(slot, None)
        if part is None and unique is None:
            self.book.record(pend, row, asyncio.ensure_future(asyncio.to_thread(checksum_file, slot, nbytes)),
                             local=True)
        else:
            # one pass gives the whole shard's checksum and those of its durable and unique parts
            heads = [durable if part is not None else nbytes, unique[0] if unique is not None else 0]
            every = asyncio.ensure_future(asyncio.to_thread(checksum_file_and_heads, slot, nbytes, heads))
            whole = asyncio.ensure_future(_pick(every, 0))
            self.book.record(pend, row, whole, local=True,
                             durable_checksum=asyncio.ensure_future(_pick_head(every, 0)) if part is not None else None,
                             unique_checksum=asyncio.ensure_future(_pick_head(every, 1)) if unique is not None else None)
        self.stats["bytes_in"] += nbytes
        if self.replicator is not None:
            asyncio.create_task(self.replicator.share(job, step, rank, world, nbytes, pend))
        return {"errors": self.book.take_errors(job)}

    # ------------------------------------------------------------------ other ops
    def _metrics(self) -> dict[str, float]:
        out = {"tierckpt_saves_total": self.stats["saves"], "tierckpt_bytes_in_total": self.stats["bytes_in"],
               "tierckpt_replicated_bytes_total": self.stats["replicated_bytes"],
               "tierckpt_inflight_bytes": self._budget.used,
               "tierckpt_control_refused_total": self.stats["refused_connections"]}
        if self.replicator is not None:
            out["tierckpt_peers_alive"] = len(self.replicator.members.alive()) - 1
        return out

    async def _op_prefetch(self, conn: _Conn, req: dict) -> dict:
        """The warm restore's report; with ``timeout`` (seconds), wait up to that long for it to finish."""
        if self.warm is None:
            return idle_report()
        return await self.warm.wait(float(req.get("timeout") or 0))

    async def _op_wait(self, conn: _Conn, req: dict) -> dict:
        job = keys.check_job(req["job"])
        step = req.get("step")
        timeout = float(req.get("timeout") or 3600)
        if step is None:
            evs = [ev for (j, _), ev in self.book.settled.items() if j == job]
            copies = self.replicator.copies(job) if self.replicator else []
        else:
            evs = [self.book.settled[(job, keys.check_step(step))]] if (job, step) in self.book.settled else []
            copies = self.replicator.copies(job, [step]) if self.replicator else []
        waiting = asyncio.ensure_future(asyncio.gather(*(ev.wait() for ev in evs), *copies))
        deadline = time.monotonic() + timeout
        blocked_since: float | None = None
        try:
            # written to every tier, and copied to the peers placement names (a failed copy is reported by
            # status and healed later: it does not fail the wait). A step this node cannot commit (no commit
            # root it can reach) is answered as such once that lasted dead_after, not after the timeout
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    return {"done": False, "errors": self.book.take_errors(job), "notices": self.book.take_notices(job)}
                done, _ = await asyncio.wait({waiting}, timeout=min(left, 1.0))
                if done:
                    waiting.result()
                    return {"done": True, "errors": self.book.take_errors(job), "notices": self.book.take_notices(job)}
                why = self._commit_blocked(job, step)
                if why is None:
                    blocked_since = None
                    continue
                blocked_since = blocked_since or time.monotonic()
                if time.monotonic() - blocked_since >= self.settings.dead_after:
                    return {"done": False, "errors": self.book.take_errors(job) + [why],
                            "notices": self.book.take_notices(job)}
        finally:
            waiting.cancel()

    def _commit_blocked(self, job: str, step: int | None) -> str | None:
        """Why a step of ``job`` pending on this node cannot commit now, or None."""
        if self.replicator is None:
            return None
        pending = sorted(s for (j, s) in self.book.pending if j == job and (step is None or s == step))
        if not pending:
            return None
        why = self.replicator.dis.blocked()
        if why is None:
            return None
        return f"step {pending[0]} of {job} cannot commit: {why}"

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

        Holds the job's commit lock throughout, so a step that was finishing when the rewind came is either
        committed before it (and then dropped whole, after its writes) or never committed (its commit finds
        it forgotten): never a manifest without its shards, never a failure handed to the new run.
        """
        job = keys.check_job(req["job"])
        step = req["step"]
        if not isinstance(step, int) or isinstance(step, bool) or step < -1:
            raise RequestError(f"step must be an integer >= -1, got {step!r}")
        if isinstance(req.get("run"), str):
            self.ends.resumed(job, req["run"])  # the run restored: its saves supersede the later steps
        async with self.book.lock(job):
            inv = await asyncio.to_thread(scan_tier, self.memory, job, with_sizes=False)
            later = {s for s in inv.job(job) if s > step}
            later |= {s for (j, s) in list(self.book.pending) + list(self.book.settled) if j == job and s > step}
            waits = [self.book.settled[(job, s)].wait() for s in later if (job, s) in self.book.draining]
            waits += self.replicator.copies(job, later) if self.replicator else []
            if waits:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.gather(*waits, return_exceptions=True), self.settings.grace)
            # a step still finishing is forgotten here: its commit, waiting for this lock, then drops it
            for s in sorted(later):
                self.book.forget(job, s)
                await asyncio.to_thread(delete_step, self.memory, job, s)
        if later:
            log.info("%s resumed from step %d: dropped later steps %s from memory", job, step, sorted(later))
            await self._slots_freed()
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
            "leased_slots": len(self._leases),
            "errors": self.book.error_counts(),
            "stats": self.stats, "settings": self.settings.to_dict(),
            "node": self.me, "peers": self.replicator.peer_status() if self.replicator else [],
            "prefetch": self.warm.report if self.warm else idle_report(),
            "tree": self.replicator.tree_status() if self.replicator else None,
            "etcd": self.directory.status() if self.directory is not None else None,
        }

    async def _op_delete(self, conn: _Conn, req: dict) -> dict:
        job = keys.check_job(req["job"])
        step = keys.check_step(req["step"])
        names = req.get("tiers") or ["memory"] + [t.name for t in self.lower]
        if self.book.draining.get((job, step)) or (job, step) in self.book.pending:
            raise RequestError(f"step {step} of {job} is being written; wait for it first")
        for t in [self.memory] + self.lower:
            if t.name in names:
                await asyncio.to_thread(delete_step, t, job, step)
        await self._slots_freed()
        return {}

    async def _op_shutdown(self, conn: _Conn, req: dict) -> dict:
        """Stop the agent. With ``if_alone`` (a job closing the embedded agent it started) only when no other
        trainer uses it: another job's trainers connected to the same memory folder keep it running, and it
        exits by itself once idle. With ``if_idle`` (a job that needs other settings than this embedded
        agent's) only when, besides, nothing is being committed or written. Answers whether it is stopping."""
        # this trainer's other connections (its lease connection) hold no other job than this one
        others = [c for c in self._conns if c is not conn and not (c.pid == conn.pid and c.jobs <= conn.jobs)]
        if (req.get("if_alone") or req.get("if_idle")) and others:
            log.info("not stopping: %d other trainer connection(s) still use this agent", len(others))
            return {"stopping": False}
        if req.get("if_alone") and self.ends.kept:
            log.info("not stopping: the memory of crashed job(s) %s is kept for their restart",
                     ", ".join(sorted(self.ends.kept)))
            return {"stopping": False}
        if req.get("if_idle") and (self.drain.busy() or self.book.pending):
            log.info("not stopping: steps are still being committed or written")
            return {"stopping": False}
        self._stop.set()
        return {"stopping": True}

    async def _op_end(self, conn: _Conn, req: dict) -> dict:
        """A trainer of ``job`` closed cleanly, every rank of the job having agreed that it ended (``agreed``,
        default true: a single-rank job). Once every trainer of the job connected here ended it, an embedded
        agent (one started for its job) frees the job's memory tier, unless ``keep_memory_after_close`` is set
        or no lower tier holds the job's newest step (then it says so in its log and keeps it). Answers what
        it freed: ``{"released": bool, "bytes": N, "why": "..."}``."""
        job = keys.check_job(req["job"])
        conn.ended.add(job)
        self.ends.ended(job, conn.pid, agreed=bool(req.get("agreed", True)))
        if not self.ends.all_ended(job, [c.pid for c in self._conns if job in c.jobs]):
            return {"released": False, "bytes": 0, "why": "other trainers of the job are still running"}
        if not self.embedded:
            return {"released": False, "bytes": 0, "why": "a node agent keeps what it holds (ckpt gc frees it)"}
        if self.settings.keep_memory_after_close:
            log.info("%s ended: its memory tier is kept (keep_memory_after_close)", job)
            return {"released": False, "bytes": 0, "why": "keep_memory_after_close is set"}
        return await self._release_job(job)

    async def _op_crashed(self, conn: _Conn, req: dict) -> dict:
        """A trainer of ``job`` is leaving without a clean end (``why``: an exception, the ranks could not
        agree): keep the job's memory tier for its restart. Answers what is kept and for how long:
        ``{"steps": [...], "bytes": N, "seconds": S or null (until ckpt gc), "embedded": bool}``."""
        job = keys.check_job(req["job"])
        why = str(req.get("why") or "a trainer left without a clean end")[:300]
        return await self._keep_crashed(job, f"pid {conn.pid}: {why}")

    async def _op_takeover(self, conn: _Conn, req: dict) -> dict:
        """A run of ``job`` (``run``) that did not restore saves ``step`` first: drop the steps of other runs
        from ``step`` on, from memory and disk here and, with ``shared`` (rank 0's agent), from S3. Done once
        per run and agent (later ranks' calls answer at once); answers ``{"dropped": {tier: [steps]}}``."""
        job = keys.check_job(req["job"])
        step = keys.check_step(req["step"])
        run = req.get("run")
        if not isinstance(run, str) or not run:
            raise RequestError("takeover needs the run's id (run)")
        local = not self.ends.settled(job, run, "local")
        shared = bool(req.get("shared")) and not self.ends.settled(job, run, "shared")
        lower = [t for t in self.lower if (t is self.s3 and shared) or (t is not self.s3 and local)]
        if not local and not lower:
            return {"dropped": {}}
        dropped = await take_over(job, step, run, memory=self.memory, book=self.book, lower=lower,
                                  grace=self.settings.grace, copies=self.replicator.copies if self.replicator else None)
        if not local:
            dropped.pop(self.memory.name, None)
        if dropped:
            await self._slots_freed()
        return {"dropped": dropped}

    async def _gone(self, conn: _Conn) -> None:
        """A trainer's connection closed: a job it neither ended cleanly nor left by another connection
        still open crashed (a kill, an exit without close)."""
        for job in conn.jobs:
            if self.ends.ended_by(job, conn.pid) or job in self.ends.kept:
                continue
            if any(c.pid == conn.pid and job in c.jobs for c in self._conns):
                continue  # the trainer's other connection is open still: it ends or crashes there
            await self._keep_crashed(job, f"trainer pid {conn.pid} left without a clean end")

    async def _keep_crashed(self, job: str, why: str) -> dict:
        """Keep ``job``'s memory tier after a crash (see :mod:`agents.jobends`); answer what is kept."""
        inv = await asyncio.to_thread(scan_tier, self.memory, job)
        # the newest keep_memory committed steps: an older one still being written down goes once it is
        steps = sorted(s for s, st in inv.job(job).items() if st.committed)[-self.settings.keep_memory:]
        nbytes = sum(st.nbytes for s, st in inv.job(job).items() if s in steps)
        out = {"steps": steps, "bytes": nbytes, "seconds": None, "embedded": self.embedded}
        if not steps:
            return out
        if not self.embedded or self.settings.keep_memory_after_close:
            log.info("%s crashed (%s): steps %s stay in memory (this agent frees nothing at a job's end; "
                     "`ckpt gc %s` removes them)", job, why, steps, job)
            return out
        k = self.ends.keep(job, why)
        out["seconds"] = self.ends.keep_s
        log.warning("%s crashed (%s): keeping steps %s (%d bytes) in memory for %.0f s, for its restart "
                    "(`ckpt gc %s --all --force` frees them)", job, why, steps, nbytes, k.until - time.time(), job)
        return out

    async def _kept_ran_out(self, job: str) -> None:
        """The time a crashed job's memory was kept ran out with no new run: write its newest step to disk if
        disk lacks it, then free memory as at a clean end."""
        if any(job in c.jobs for c in self._conns):
            return
        if self.disk is not None:
            inv = await asyncio.to_thread(scan_tier, self.memory, job)
            committed = sorted(s for s, st in inv.job(job).items() if st.complete or st.node_complete(self.me))
            if committed:
                newest = committed[-1]
                low = await asyncio.to_thread(scan_tier, self.disk, job)
                have = low.job(job).get(newest)
                if low.error is None and (have is None or not have.node_complete(self.me)) \
                        and (job, newest) not in self.book.draining:
                    log.info("%s: writing its newest step %d to disk before its memory is freed", job, newest)
                    done = asyncio.Event()
                    self.book.settled[(job, newest)] = done
                    self.drain.enqueue(self.disk, job, newest)
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(done.wait(), max(self.settings.grace, 600.0))
        if any(job in c.jobs for c in self._conns):
            return  # a new run connected meanwhile: it is the run's memory now
        await self._release_job(job)

    async def _release_job(self, job: str) -> dict:
        """Free ``job``'s memory tier (steps, layouts, index, free slots) when a lower tier holds its newest
        committed step in full; otherwise keep its steps (only its free slots go) and say why."""
        # nothing more is faulted in for a job that ended
        fillers = [t for (j, _), t in self._fillers.items() if j == job]
        for t in fillers:
            t.cancel()
        for t in fillers:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        async with self.book.lock(job):
            why = ""
            busy = [s for (j, s) in self.book.pending if j == job]
            busy += [s for (j, s), t in self.book.draining.items() if j == job and t]
            inv = await asyncio.to_thread(scan_tier, self.memory, job)
            committed = sorted(s for s, st in inv.job(job).items() if st.committed)
            held: list[str] = []
            if busy:
                why = f"step(s) {sorted(set(busy))} still being committed or written"
            elif committed:
                newest = committed[-1]
                for t in self.lower:
                    low = await asyncio.to_thread(scan_tier, t, job)
                    have = low.job(job).get(newest)
                    if low.error is None and have is not None and (
                            have.complete if low.shared else have.node_complete(self.me)):
                        held.append(t.name)
                if not held:
                    why = (f"its newest step {newest} is only in memory" if self.lower
                           else "memory is its only tier")
            freed = 0
            if not why:
                freed = await asyncio.to_thread(self._unlinked_bytes, job, sorted(inv.job(job)))
                for s in sorted(inv.job(job)):
                    self.book.forget(job, s)
                    await asyncio.to_thread(delete_step, self.memory, job, s)
                for k in await asyncio.to_thread(self.memory.list, keys.layouts_prefix(job)):
                    await asyncio.to_thread(self.memory.delete, k)
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(self.memory.delete, keys.index_key(job))
            # slots no retained step links to hold nothing: they go either way
            freed += await asyncio.to_thread(self.memory.drop_slots, job, self._leases | self._filling)
        if why:
            log.info("%s ended: its memory tier is kept (%s; %d bytes of free staging slots freed); "
                     "`ckpt gc %s --all` frees it", job, why, freed, job)
            return {"released": False, "bytes": freed, "why": why}
        log.info("%s ended: freed its memory tier (%d bytes)%s", job, freed,
                 f"; its newest step {committed[-1]} is in {', '.join(held)}" if committed else "")
        return {"released": True, "bytes": freed, "why": ""}

    def _unlinked_bytes(self, job: str, steps: list[int]) -> int:
        """Bytes the files of ``job``'s ``steps`` in memory free when removed: a shard that is a hard link to
        a staging slot frees nothing until its slot goes (counted by :meth:`MemoryTier.drop_slots`)."""
        n = 0
        for s in steps:
            for k in self.memory.list(keys.step_prefix(job, s)):
                with contextlib.suppress(OSError):
                    st = os.stat(self.memory.path(k))
                    if st.st_nlink == 1:
                        n += st.st_blocks * 512
        return n

def run_agent(settings: Settings, *, embedded: bool = False, idle_exit: float | None = None,
              auto_rank: bool = False) -> int:
    """Run an agent in this process until it is stopped; return the exit status (4: its node rank was taken
    over in etcd by a replacement, so it stopped). ``auto_rank``: with etcd, claim a node rank there.

    The process's umask becomes 077: every file the agent writes (shards, manifests, indexes, logs, locks) is
    readable by its user alone, and every folder it creates is 0700.
    """
    os.umask(0o077)
    directory = None
    if settings.etcd:
        from .directory import EtcdDirectory, EtcdError, RankTakenError

        os.makedirs(settings.shm, mode=0o700, exist_ok=True)
        directory = EtcdDirectory(settings, auto_rank=auto_rank)
        try:
            settings.peers = directory.bootstrap()
        except RankTakenError as e:
            log.error("%s", e)
            return 2
        except EtcdError as e:
            log.error("cannot register in etcd within %.0f s (%s): check --etcd and that etcd runs",
                      settings.startup_grace, e)
            return 2
    try:
        agent = Agent(settings, embedded=embedded, idle_exit=idle_exit)
        agent.directory = directory
        asyncio.run(agent.serve())
        if agent.replaced:
            return 4
    except AgentAlreadyRunningError as e:
        log.error("%s", e)
        return 3
    except SettingsError as e:  # e.g. a socket folder that belongs to another user
        log.error("%s", e)
        return 2
    return 0


async def _pick(fut: "asyncio.Future", i: int):
    return (await fut)[i]


async def _pick_head(fut: "asyncio.Future", i: int):
    return (await fut)[1][i]
