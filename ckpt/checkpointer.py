"""The Checkpointer: save a training state into the node agent's memory, restore from the fastest tier.

Call order::

    ck = Checkpointer(job, ...)        # or ``with Checkpointer(...) as ck:``
    step = ck.restore(state)           # once, before the first step: newest complete step, or None
    ck.save(step, state)               # every step; acts on steps that ``every`` selects
    ck.wait()                          # optional: until the agent has written every save everywhere
    ck.close()                         # waits, raises any background error, disconnects

``save`` copies the state into a pre-faulted shared-memory slot of the node
agent, leased and mapped ahead, off the training thread, after each save
(and at ``restore``). ``save`` never waits for that slot: when it is not
ready yet (saves back to back at the start of a job, faster than the agent
faults a slot in), it takes one the agent only sizes, and the save's own
copies allocate and fault in its memory, in the background for the tensors
copied there; the copy takes longer once, ``save`` does not block longer.
Only when the agent has no free slot at all does ``save`` wait, or skip,
as its full policy says (a state with tensors on an accelerator has its
slot's memory allocated before ``save`` returns: its adapter may pin it).

Tensors that only an optimizer step may change (parameters and optimizer
state) are copied in the background while the next forward/backward runs;
an optimizer step pre-hook waits for that copy before any parameter changes
(one global hook, :mod:`ckpt._guard`, for every optimizer of the process,
bare or inside a ``Stateful`` container). Everything else of the caller's
(buffers, plain tensors) is copied before ``save`` returns, and the JSON
values and bytes are captured then (copied later from private buffers).
Once the copy is done the agent is told, and it does the rest (checksum,
manifest, disk, S3) in its own process. Where each leaf goes in the slot is
worked out again only when the state's shape changed (:mod:`ckpt._shard_plan`).

Each device type's tensors reach the slot through that type's adapter
(:mod:`ckpt._devices`): CPU tensors on this module's copier threads, CUDA
tensors by DMA on a side stream into the pinned slot, XLA tensors in one
batched transfer; a restore hands non-CPU tensors back to the same adapters.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import errno
import logging
import mmap
import os
import secrets
import socket
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from agents.config import Settings, SettingsConflictError, SettingsError, given_settings, setting_conflicts
from agents.launch import connect_or_spawn, wait_stopped
from agents.replication import placement_partners
from agents.protocol import AgentClient, AgentError, AgentUnreachableError
from agents.tierset import disk_tier, memory_tier, peer_disk_tiers, peer_tiers, s3_tier
from recovery import RestorePlan, ShardReport, node_costs, replica_nodes, scan_tiers
from recovery.inventory import TierInventory
from recovery.planner import RestoreError
from recovery.restorer import Restorer
from tiers import keys
from tiers.base import Tier
from tiers.layout import Layout
from tiers.manifest import Manifest
from tiers.memory import background_priority

from ._devices import DeviceAdapter, Item, make_adapter
from . import _guard
from ._flatten import StateError, flatten_state, forget_initialized
from ._load import Prepared, ShardLoader, StateMismatchError, kept
from ._replicas import described
from ._shard_plan import ShardPlanner
from ._tensors import buffer_view as _buffer_view

__all__ = ["Checkpointer", "SaveFuture", "RestoreReport", "CheckpointError", "RestoreError", "StateMismatchError"]

log = logging.getLogger("tierckpt")


class CheckpointError(RuntimeError):
    """A save failed in the background (staging, the agent, or writing to a tier)."""


def _min_over_ranks(value: int) -> int:
    """The smallest of every rank's ``value`` (a collective: every rank calls it at the same point)."""
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


#: this process's run id per ``(rank, world)`` (see :func:`_run_id`)
_RUNS: dict[tuple[int, int], str] = {}


def _run_id(rank: int, world: int) -> str:
    """The id of the run this process is part of: rank 0's host, pid and a random part, the same on every rank
    (a collective, once per process and world: every rank makes its first Checkpointer at the same point).

    The agents tell runs of a job apart by it: a run that did not restore takes over other runs' steps, and two
    live runs of one job on one node are refused. A restarted process (torchrun's restart, a requeue) is a new
    run; every Checkpointer of one process (a DCP reader's and writer's) is the same run."""
    key = (rank, world)
    if key not in _RUNS:
        token = secrets.randbits(62)
        if world > 1:
            token = _min_over_ranks(token if rank == 0 else (1 << 62))
        _RUNS[key] = f"{socket.gethostname()}-{token:016x}"
    return _RUNS[key]


def _warn_restart_store(rank: int) -> None:
    """Say so when torchrun will restart ranks that cannot form a process group again.

    torchrun's rendezvous shares one TCP store with the ranks' process group, and a restarted group can read
    the previous attempt's addresses from it and fail to connect (pytorch/pytorch#135712); launching with
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` gives every attempt a fresh store.
    """
    e = os.environ
    if rank != 0 or e.get("TORCHELASTIC_USE_AGENT_STORE") != "True" \
            or e.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1":
        return
    try:
        restarts = int(e.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    except ValueError:
        return
    if restarts > 0:
        warnings.warn("torchrun --max-restarts with a shared rendezvous store: restarted ranks may fail to form "
                      "their process group (pytorch/pytorch#135712); launch torchrun with "
                      "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 so each restart can resume from the checkpoint",
                      RuntimeWarning, stacklevel=3)


@dataclass
class SaveFuture:
    """One save in flight: ``wait_staged`` until the snapshot is consistent, ``wait`` until persisted."""

    step: int
    started: float = field(default_factory=time.perf_counter)
    staged_at: float | None = None
    _staged: cf.Future = field(default_factory=cf.Future)
    _ck: "Checkpointer | None" = None

    def wait_staged(self, timeout: float | None = None) -> float:
        """Block until every tensor is copied into the agent's memory; return the seconds the copy took."""
        self._staged.result(timeout)
        return (self.staged_at or time.perf_counter()) - self.started

    def staged(self) -> bool:
        return self._staged.done()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the agent wrote this step to every tier it goes to; raise its errors."""
        self.wait_staged(timeout)
        if self._ck is not None:
            self._ck._agent_wait(self.step, timeout)


@dataclass
class RestoreReport:
    """What a restore did: the step, and per shard of this rank which tier served it and how fast."""

    step: int
    shards: list[ShardReport]
    seconds: float
    #: newer steps committed somewhere that could not be restored, and why (empty when the newest was)
    passed_over: dict[int, str] = field(default_factory=dict)
    #: tiers that could not be listed (``<tier> (<place>): <why>``): they may hold a newer step
    unreachable: list[str] = field(default_factory=list)

    @property
    def tiers(self) -> list[str]:
        return [s.tier for s in self.shards]


@dataclass
class _StateLoader:
    """The :class:`recovery.restorer.StepLoader` of one restore: ``loader`` reads into ``state``, calling
    ``before_write()`` before the first read that lands in CPU tensors before its bytes are verified."""

    loader: ShardLoader
    state: dict
    world: int
    before_write: Callable[[], None] | None
    #: ``state`` flattened for restore already (:attr:`Kept.flat`)
    flat: Any = None
    #: warm buffers for reads that are verified before they are applied (:data:`ckpt._load.Stage`)
    stage: Any = None

    def prepare(self, plan: RestorePlan) -> Prepared:
        return self.loader.prepare(plan, self.state, self.before_write, self.flat, self.stage)

    def prepare_resharded(self, plan: RestorePlan) -> Prepared:
        return self.loader.prepare_resharded(plan, self.state, self.world, self.before_write)


#: a leased slot whose size differs from the save's by at most this many bytes is resized to fit
_RESIZE_SLACK = 1 << 20
#: madvise(2) advice that faults a range's page tables in, writable, without touching its bytes (Linux 5.14)
_MADV_POPULATE_WRITE = 23
_madvise: Any = None


def _populate(ptr: int, nbytes: int) -> None:
    """Fault the page tables of a mapping of memory the agent has allocated in, with the GIL released (a
    ctypes call), so the copies into it take no page faults. Where the kernel cannot (before Linux 5.14) the
    copies fault them in instead: slower, never wrong. Never writes a byte: other slots of the ring that are
    mapped ahead hold retained steps."""
    global _madvise
    if _madvise is None:
        try:
            import ctypes

            fn = ctypes.CDLL(None, use_errno=True).madvise
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            fn.restype = ctypes.c_int
            _madvise = fn
        except (OSError, AttributeError) as e:  # no libc to ask: the copies fault the pages in
            log.debug("cannot populate staging slots' mappings: %s", e)
            _madvise = False
    # in pieces: populating holds the process's memory-map lock, which the training thread's allocator needs
    # (mmap, munmap, brk): a piece holds it a few milliseconds, the whole GiB a quarter of a second
    step = 16 << 20
    for off in range(0, nbytes, step) if _madvise else ():
        if _madvise(ptr + off, min(step, nbytes - off), _MADV_POPULATE_WRITE):
            return  # an older kernel: the copies fault the pages in


class Checkpointer:
    """Tiered checkpoints for one job; see the module docstring for the call order.

    Arguments not given come from ``CKPT_*`` variables, then the TOML config,
    then defaults (:class:`agents.config.Settings`). When an agent already runs
    on this node's memory folder, the settings this job did not give are that
    agent's; a setting the job gave (argument, variable or config file) that the
    agent has otherwise is refused, unless the agent is an embedded one that
    another job left idle: that one is stopped and one with this job's settings
    started. When none runs one is started (``spawn=True``) and stopped after
    the job, once no other job uses it; a clean end frees the job's memory
    tier when a lower tier holds its newest step (``keep_memory_after_close``
    keeps it).

    ``overlap``: copy parameters and optimizer state while the next
    forward/backward runs, with every optimizer step of the process waiting
    for that copy (:mod:`ckpt._guard`: one global optimizer step pre-hook,
    whatever container holds the optimizer). Pass False when something other
    than an optimizer step changes parameters in place (weights edited by
    hand): every tensor is then copied before ``save`` returns.

    ``replicated``: which parts of the state other ranks hold identical
    copies of where no DTensor placement says so, ``{top-level state key:
    group}`` with a group a process group, a 1-D device mesh or a list of
    global ranks, this rank among them: ``{"model": dp_group, "optim":
    dp_group}`` for a DDP job, or for a pipeline stage kept by several
    data-parallel replicas. The plain tensors under those keys are then
    written to disk and S3 by one rank of the group for all of them, and
    count as copies in memory. Every rank of a group must give the same
    group (a step whose ranks disagree is not committed, and the next save
    says who) and hold the same tensors there, bit for bit, as
    data-parallel replicas do: that is trusted, as DTensor placements are.
    Never describe per-rank tensors (RNG states, a data loader's position).

    Raises InvalidNameError for a bad job name, ValueError for a
    ``replicated`` that names ranks not holding this rank's copy, AgentUnreachableError when no
    agent runs and ``spawn`` is False, SettingsConflictError (a ValueError)
    naming each setting the running agent has otherwise.
    """

    def __init__(
        self,
        job: str,
        *,
        every: int = 1,
        disk: str | None = None,
        s3: str | None = None,
        agent: str | None = None,
        shm: str | None = None,
        s3_endpoint: str | None = None,
        disk_every: int | None = None,
        s3_every: int | None = None,
        keep_memory: int | None = None,
        keep_disk: int | None = None,
        keep_s3: int | None = None,
        keep_memory_after_close: bool | None = None,
        keep_after_crash: float | None = None,
        metadata: dict | None = None,
        spawn: bool = True,
        config: str | None = None,
        idle_exit: float = 120.0,
        verify: bool = True,
        overlap: bool = True,
        replicated: dict | None = None,
    ) -> None:
        self.job = keys.check_job(job)
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an integer >= 1, got {every!r}")
        self.every = every
        self.metadata = dict(metadata or {})
        self.verify = verify
        self.overlap = overlap
        args = dict(shm=shm, disk=disk, s3=s3, s3_endpoint=s3_endpoint, socket=agent, disk_every=disk_every,
                    s3_every=s3_every, keep_memory=keep_memory, keep_disk=keep_disk, keep_s3=keep_s3,
                    keep_memory_after_close=keep_memory_after_close, keep_after_crash=keep_after_crash)
        given = given_settings(args, config_file=config)
        self.settings = Settings.load(args, config_file=config)
        if dist.is_available() and dist.is_initialized():
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
        else:
            self.rank, self.world = 0, 1
        holders = described(replicated, self.rank, self.world)  # a bad description fails before an agent starts
        self._replicated = tuple(replicated or ())
        _warn_restart_store(self.rank)
        self._run = _run_id(self.rank, self.world)
        #: whether this run's first save here went through the takeover (see :meth:`_take_over`)
        self._took_over = False
        self._client, self._started_agent, self.settings = self._connect(given, spawn, idle_exit)
        self._check_nodes()
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="tierckpt-stage")
        self._copiers = [cf.ThreadPoolExecutor(1, thread_name_prefix=f"tierckpt-copy{i}")
                         for i in range(max(1, min(4, torch.get_num_threads())))]
        self._loader = ShardLoader(self.rank, verify, self._copiers, self._device)
        self._maps: dict[str, tuple[int, mmap.mmap, torch.Tensor | None]] = {}
        self._map_ino: dict[str, int] = {}
        self._map_lock = threading.Lock()
        self._devices: dict[str, DeviceAdapter] = {}
        self._inflight: SaveFuture | None = None
        #: where each leaf goes in the shard, worked out again only when the state's shape changes
        self._planner = ShardPlanner(holders)
        #: the digest of the last layout the agent accepted
        self._layout_sent: str | None = None
        self._errors: list[str] = []
        #: what the node's agent said about this job's saves that lost nothing but is worth knowing (a copy a
        #: peer refused or failed: the step has fewer copies in memory than asked for until the heal makes it
        #: up); logged as warnings when a wait hears of them, the newest 100 kept here
        self.notices: list[str] = []
        self._hook: Any = None
        self._lock = threading.Lock()
        self._closed = False
        self._next_slot: tuple[str, int] | None = None
        self._prelease_fut: cf.Future | None = None
        self._leaser = cf.ThreadPoolExecutor(1, thread_name_prefix="tierckpt-lease", initializer=background_priority)
        self._lease_client: AgentClient | None = None
        self.last_restore: RestoreReport | None = None
        self.skipped: list[tuple[int, str]] = []
        self._said_every = False
        if overlap:
            self._install_hook()  # from now on it learns every optimizer that steps

    def _check_nodes(self) -> None:
        """Refuse a job that spans several nodes when this node's agent has no peers: a step commits only once
        the agents have every rank's report, which reaches them through their peers (each save would wait for
        ever)."""
        local = os.environ.get("LOCAL_WORLD_SIZE", "")
        if self.world == 1 or self.settings.peers or not local.isdigit() or int(local) >= self.world:
            return
        self._client.close()  # an agent started for this job exits once idle
        raise SettingsError(
            f"job {self.job!r} runs {self.world} ranks, {local} on this node, but the agent on {self.settings.shm} "
            "has no peer list: no node could commit a step, which needs every node's report. Start every node's "
            "agent with the same --peers FILE (one host:port per node, in node-rank order) and --node-rank N, or "
            "set peers= and node_rank= in the job's settings")

    def _connect(self, given: dict, spawn: bool, idle_exit: float) -> tuple[AgentClient, bool, Settings]:
        """Connect to the node agent (starting one if allowed): ``(client, started it, its settings)``."""
        for attempt in range(5):
            # an agent that is shutting down may accept and then drop us: try again, then start a new one
            client, started = connect_or_spawn(self.settings, spawn=spawn, idle_exit=idle_exit)
            try:
                hello = client.call("hello", job=self.job, run=self._run)
            except AgentUnreachableError:
                client.close()
                if attempt == 4:
                    raise
                time.sleep(0.2 * (attempt + 1))
                continue
            theirs = Settings.from_dict(hello["settings"])
            differ = setting_conflicts(given, theirs)
            if not differ:
                return client, started, theirs
            if spawn and not started and hello.get("embedded") and attempt < 4:
                # an agent another job started here and left running: when nobody uses it any more it makes
                # way for one with this job's settings
                try:
                    stopping = client.call("shutdown", if_idle=True).get("stopping")
                except (AgentError, AgentUnreachableError):
                    stopping = False
                if stopping:
                    client.close()
                    wait_stopped(theirs, theirs.grace + 10)
                    log.info("stopped the idle embedded agent on %s: it had other settings (%s)", theirs.shm,
                             "; ".join(differ))
                    continue
            client.close()
            raise SettingsConflictError(
                f"job {self.job!r}: the agent running on {theirs.shm} (pid {hello.get('pid')}) has other settings: "
                f"{'; '.join(differ)}; give this job the agent's values, or a memory folder of its own (shm= or "
                "CKPT_SHM) so it gets its own agent, or stop that agent first")
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ tiers
    def tiers(self) -> list[Tier]:
        """The tiers to restore from, cheapest first: memory, the other nodes' memory, disk, S3."""
        return self._near_tiers() + self._far_tiers()

    def _near_tiers(self) -> list[Tier]:
        out: list[Tier] = [memory_tier(self.settings)]
        # the peers placement puts this node's copies on: a rank never lists every node's memory
        out += peer_tiers(self.settings, only=placement_partners(self.settings))
        disk = disk_tier(self.settings)
        return out + ([disk] if disk is not None else [])

    def _scan_near(self) -> list[TierInventory]:
        """List the near tiers, then the memory of the nodes running this rank's data-parallel replicas when
        the rank's own shard of a listed step is in no memory listed (its node lost it): the placement
        partners hold its unique part, those nodes the rest (a few nodes, never the whole job)."""
        invs = scan_tiers(self._near_tiers(), self.job)
        listed = placement_partners(self.settings) | {self.settings.node_rank}
        more = replica_nodes(invs, self.job, self.rank) - listed
        if more:
            log.info("rank %d: its shard is in no memory listed; looking in the memory of its replicas' "
                     "node(s) %s", self.rank, sorted(more))
            invs += scan_tiers(peer_tiers(self.settings, only=more), self.job)
        return invs

    def _far_tiers(self) -> list[Tier]:
        s3 = s3_tier(self.settings, retry_deadline=min(self.settings.s3_retry_deadline, 30.0))
        return [s3] if s3 is not None else []

    def _far_may_be_newer(self, near_newest: int) -> bool:
        """Whether S3 could hold a step of this job newer than ``near_newest`` (this rank's newest step in
        memory, peers and disk). The node agent knows the newest step of the job any tier could hold (what
        it found at start-up, then every commit here and every commit record from its peers), so a restore
        that memory can serve needs no S3 client and no S3 listing. Without that knowledge: True."""
        if not self.settings.s3:
            return False
        try:
            r = self._client.call("lower", job=self.job)
        except AgentError:
            return True
        return not r.get("known") or int(r["newest"]) > near_newest

    # ------------------------------------------------------------------ errors
    def _collect(self, resp: dict) -> None:
        errs = resp.get("errors") or []
        if errs:
            with self._lock:
                self._errors.extend(errs)
        for msg in resp.get("notices") or ():
            # nothing lost (a peer refused a copy, which stays with its primary): said, never raised
            log.warning("%s: %s", self.job, msg)
            with self._lock:
                self.notices.append(msg)
                del self.notices[:-100]

    def _raise_pending(self) -> None:
        with self._lock:
            errs, self._errors = self._errors, []
        if errs:
            raise CheckpointError(
                f"{len(errs)} background checkpoint error(s) for job {self.job!r}: " + " | ".join(errs)
            )

    # ------------------------------------------------------------------ save
    def _wait_guarded(self, *_: Any) -> None:
        f = self._inflight
        if f is not None and not f.staged():
            try:
                f.wait_staged()
            except Exception:
                pass  # stored; raised at the next save/wait/close

    def _install_hook(self) -> None:
        # one hook for every optimizer of the process (ckpt._guard): it also learns the optimizers that step,
        # so parameters and optimizer state inside any container are copied in the background from then on
        if self._hook is None:
            self._hook = _guard.register_waiter(self._wait_guarded)

    def _device(self, device_type: str) -> DeviceAdapter:
        ad = self._devices.get(device_type)
        if ad is None:
            ad = self._devices[device_type] = make_adapter(device_type)
        return ad

    def _unmap(self, mm: mmap.mmap | None, buf: torch.Tensor | None) -> None:
        if buf is not None:
            for ad in list(self._devices.values()):
                ad.release_host(buf)
            # torch.frombuffer does not hold the mapping open: a reference left anywhere (a traceback's frame,
            # printed by pytest or a logger) would read unmapped memory and crash the process, so the tensor
            # is emptied before the mapping goes
            buf.set_()
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass

    def _map(self, slot: str, nbytes: int, populate: bool = True) -> torch.Tensor | None:
        """The slot's bytes, mapped once per slot file (a slot removed and made again is a new file: a mapping of
        the old one would stage into memory nobody reads, so it is checked by inode). ``populate``: fault the
        page tables in now, without the GIL (:func:`_populate`), else the copies fault them."""
        ino = os.stat(slot).st_ino if nbytes else 0

        def cached() -> tuple | None:
            c = self._maps.get(slot)
            return c if c is not None and c[0] == nbytes and self._map_ino.get(slot) == ino else None

        with self._map_lock:
            c = cached()
        if c is not None:
            return c[2]
        mm = buf = None
        if nbytes:
            # mapped outside the lock: faulting the page tables in takes a while, and the leaser thread maps
            # the ring's other slots while a save maps its own. Not with MAP_POPULATE: Python's mmap holds the
            # GIL through the call, which froze the training thread for 0.5 s per GiB while the leaser mapped
            with open(slot, "r+b") as f:
                mm = mmap.mmap(f.fileno(), nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            buf = torch.frombuffer(mm, dtype=torch.uint8)
            if populate:
                _populate(buf.data_ptr(), nbytes)
            # pinned (CUDA) here, on the leaser thread for the ring's slots, not by the first save to use the
            # slot: registering a slot of several GiB takes about a second
            for ad in list(self._devices.values()):
                ad.prepare_host(buf)
        with self._map_lock:
            c = cached()
            if c is not None:  # the other thread mapped it meanwhile
                self._unmap(mm, buf)
                return c[2]
            old = self._maps.get(slot)
            if old is not None:
                self._unmap(old[1], old[2])
            self._maps[slot] = (nbytes, mm, buf)  # type: ignore[assignment]
            self._map_ino[slot] = ino
        return buf

    def save(self, step: int, state: dict, *, metadata: dict | None = None, force: bool = False
             ) -> SaveFuture | None:
        """Checkpoint ``state`` at ``step`` if ``every`` selects it (``step % every == 0``), or whatever
        ``every`` says with ``force=True``; return its SaveFuture, else None (the first step skipped this
        way is logged once, at INFO).

        Saves are numbered ``step // every``; the agent writes the saves whose number is a multiple of
        ``disk_every`` to disk and of ``s3_every`` to S3. A forced save (a final one, say) goes to every
        tier whatever its number, and numbers nothing: the saves after it keep theirs.

        Returns once the copy into host memory is under way (see the module
        docstring). Raises CheckpointError for an earlier save that failed in
        the background or one the agent cannot take (its memory full),
        StateError for a state it cannot save.
        """
        keys.check_step(step)
        if self._closed:
            raise RuntimeError("the Checkpointer is closed")
        self._raise_pending()
        if step % self.every and not force:
            if not self._said_every:
                self._said_every = True
                log.info("step %d not checkpointed: every=%d saves only steps that are multiples of %d "
                         "(save(..., force=True) saves any step); said once", step, self.every, self.every)
            return None
        if self._inflight is not None:
            self._wait_guarded()
            self._raise_pending()
        if self.overlap:
            self._install_hook()  # before flattening: a container's state_dict may take an optimizer step
        if self._replicated and not all(k in state for k in self._replicated):
            raise StateError(f"replicated describes {[k for k in self._replicated if k not in state]}, which the "
                             f"state does not hold (its keys: {list(state)[:20]}): describe keys of the state saved")
        plan = self._planner.plan(flatten_state(state), self.overlap)
        layout, values, copies, total = plan.layout, plan.values, plan.copies, plan.total
        durable, unique = plan.durable, plan.unique
        try:
            slot, why = self._lease_now(total)
        except AgentError as e:  # the agent's memory is full, or it refused the save: the user's error type
            raise CheckpointError(f"step {step}: the node agent could not take the save ({e.kind}: {e}); "
                                  "free host memory or lower keep_memory, then save again") from e
        if slot is None:
            log.warning("step %d not checkpointed: %s", step, why)
            self.skipped.append((step, why))
            return None
        fut = SaveFuture(step, _ck=self)
        buf, later, waits, sparse = self._stage_now(slot, total, copies, f"step {step}")
        meta = {**self.metadata, **(metadata or {})}
        self._inflight = fut

        def finish() -> None:
            try:
                if sparse:
                    self._allocate(slot, [(0, total)])
                self._copy_parallel(buf, later)
                for done in waits:
                    done()
                fut.staged_at = time.perf_counter()
                r = self._commit(step=step, slot=slot, nbytes=total, layout=layout, values=values,
                                 save_index=step // self.every, metadata=meta,
                                 **({"every_tier": True} if force else {}),
                                 **({"durable": durable} if durable < total else {}),
                                 **({"unique": list(unique)} if unique is not None else {}))
                self._collect(r)
                # queued before the save is reported staged, so the next save always sees (and waits for) it
                self._prelease_fut = self._leaser.submit(self._prelease, total)
                fut._staged.set_result(None)
            except BaseException as e:
                with self._lock:
                    self._errors.append(f"step {step}: staging failed: {type(e).__name__}: {e}")
                try:
                    self._client.call("release", slot=slot)
                except Exception:
                    pass
                fut._staged.set_exception(CheckpointError(f"step {step}: staging failed: {e}"))

        if later or waits:
            self._pool.submit(finish)
        else:
            finish()
        return fut

    def _stage_now(self, slot: str, total: int, copies: list[tuple[torch.Tensor, int, int, bool]], what: str
                   ) -> tuple[torch.Tensor | None, list[Item], list, bool]:
        """Map the slot and make the copies that cannot wait; return the slot's bytes, the copies and the
        adapters' waits left for the background, and whether the slot still needs its memory allocated
        (:meth:`_allocate` over the whole slot, before the background copies). Releases the slot and raises
        CheckpointError when there is no memory for it."""
        try:
            sparse = total > 0 and not self._backed(slot, total)
            # a slot mapped here (not ahead, by the leaser) is not populated: the copies fault its page tables
            # in, mostly in the background. One only sized (leased without waiting for the agent to fault it
            # in) gets its memory allocated before each copy writes: a full /dev/shm is an error, never SIGBUS
            buf = self._map(slot, total, populate=False)
            if sparse and any(not src.is_cpu for src, *_ in copies):
                # another device's adapter may write the slot (a DMA) or pin it: all of it is allocated now
                self._allocate(slot, [(0, total)])
                sparse = False
            now, later, waits = self._stage(buf, copies)
            if sparse and now:
                self._allocate(slot, [(off, n) for _, off, n in now])
            self._copy(buf, now)
        except BaseException as e:
            with contextlib.suppress(AgentError, AgentUnreachableError):
                self._client.call("release", slot=slot)
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.ENOMEM):
                raise CheckpointError(f"{what}: no host memory for the {total}-byte staging slot ({e}); "
                                      "free host memory or lower keep_memory, then save again") from e
            raise
        return buf, later, waits, sparse

    @staticmethod
    def _backed(slot: str, nbytes: int) -> bool:
        """Whether every byte of the slot has memory (the agent faulted it in, or an earlier save wrote it)."""
        st = os.stat(slot)
        return st.st_size == nbytes and st.st_blocks * 512 >= nbytes

    @staticmethod
    def _allocate(slot: str, spans: list[tuple[int, int]]) -> None:
        """Allocate the slot's memory under each ``(offset, bytes)`` span (whole pages, neighbours merged).
        Raises OSError (ENOSPC) when /dev/shm has no room, where a write to an unallocated page of a full
        tmpfs would kill the process with SIGBUS."""
        page = mmap.PAGESIZE
        merged: list[list[int]] = []
        for off, n in sorted(spans):
            if n <= 0:
                continue
            lo, hi = off - off % page, off + n
            if merged and lo <= merged[-1][1] + page:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        if not merged:
            return
        fd = os.open(slot, os.O_RDWR)
        try:
            for lo, hi in merged:
                os.posix_fallocate(fd, lo, hi - lo)
        finally:
            os.close(fd)

    def _lease_now(self, nbytes: int) -> tuple[str | None, str | None]:
        """A slot for a save of ``nbytes`` bytes, without waiting for one: ``(slot, None)``, or ``(None, why)``
        when the agent has none (its full policy said skip, or its wait ran out).

        The slot leased ahead when it is ready; else one the agent only sizes, whose memory the save's own
        copies fault in (in the background, for tensors that may be copied there). Only when the agent has
        no free slot at all does the save wait for the one being leased ahead. Raises AgentError when the
        agent refuses (its memory is full)."""
        slot = self._take_prelease(nbytes, wait=False)
        if slot is not None:
            return slot, None
        ahead = self._prelease_fut is not None
        r = self._client.call("begin", job=self.job, rank=self.rank, world=self.world, nbytes=nbytes,
                              fault=False, **({"wait": False} if ahead else {}))
        self._collect(r)
        if r.get("slot"):
            return r["slot"], None
        if ahead:
            # no free slot: the one being leased ahead is the next to free up
            slot = self._take_prelease(nbytes, wait=True)
            if slot is not None:
                return slot, None
            r = self._client.call("begin", job=self.job, rank=self.rank, world=self.world, nbytes=nbytes,
                                  fault=False)
            self._collect(r)
            if r.get("slot"):
                return r["slot"], None
        return None, r.get("skip") or "the agent leased no slot"

    def _stage(self, buf: torch.Tensor | None, copies: list[tuple[torch.Tensor, int, int, bool]]
               ) -> tuple[list[Item], list[Item], list]:
        """Hand each device type's tensors to its adapter; return the host copies to make now, those to make
        in the background, and the adapters' completion waits."""
        cpu_now: list[Item] = []
        cpu_later: list[Item] = []
        other: dict[str, tuple[list[Item], list[Item]]] = {}
        for src, off, n, guarded in copies:
            if src.is_cpu:
                (cpu_later if guarded else cpu_now).append((src, off, n))
            else:
                group = other.get(src.device.type)
                if group is None:
                    group = other[src.device.type] = ([], [])
                group[1 if guarded else 0].append((src, off, n))
        now: list[Item] = []
        later: list[Item] = []
        waits: list = []
        for device_type, (dnow, dlater) in [("cpu", (cpu_now, cpu_later)), *other.items()]:
            ad = self._device(device_type)
            if buf is not None:
                ad.prepare_host(buf)
            st = ad.stage(dnow, dlater, buf)
            now += st.now
            later += st.later
            if st.done is not None:
                waits.append(st.done)
        return now, later, waits

    def _prelease(self, nbytes: int, ring: bool = True) -> None:
        """Lease the next save's slot now and map it, off the training thread, so ``save`` neither waits for
        the agent nor faults the mapping's pages in (the agent faults the slot's memory in when it leases it,
        and the rest of the ring in the background after the first lease). With ``ring``, the ring's other
        slots are mapped too; a restore leaves them to its first save's lease, so mapping them (page tables
        for several times the state) does not take the cores the first training steps after it run on."""
        with self._lock:
            if self._next_slot is not None:
                return  # leased ahead by an earlier task that a save did not wait for: the next save takes it
        try:
            # a connection of its own: waiting here for a slot to free up never holds up a commit
            if self._lease_client is None:
                self._lease_client = AgentClient(self.settings.socket_path)
            # no background errors in this answer: collected on this thread, they could miss a wait() that
            # the agent answered meanwhile (they go to the training thread's next request instead)
            r = self._lease_client.call("begin", job=self.job, rank=self.rank, world=self.world, nbytes=nbytes,
                                        errors=False)
        except (AgentError, AgentUnreachableError) as e:
            log.debug("could not lease the next slot ahead of time: %s", e)
            return
        self._collect(r)
        if not r.get("slot"):
            return
        try:
            # the training thread maps only after this task is done (``_take_prelease`` waits for it)
            self._map(r["slot"], nbytes)
        except (OSError, ValueError) as e:  # removed or resized meanwhile
            log.debug("could not map the next slot ahead of time: %s", e)
            with contextlib.suppress(AgentError, AgentUnreachableError):
                self._lease_client.call("release", slot=r["slot"])
            return
        with self._lock:
            self._next_slot = (r["slot"], nbytes)
        ring = [p for p in r.get("ring") or [] if p != r["slot"]] if ring else []
        if ring:
            # the ring's other slots, faulted in by the agent: mapped now, so the saves that lease them next
            # find their mappings ready; queued after this lease, so the next save does not wait for them
            with contextlib.suppress(RuntimeError):  # closing: nothing more to map
                self._leaser.submit(self._map_ahead, ring, nbytes)

    def _map_ahead(self, slots: list[str], nbytes: int) -> None:
        for slot in slots:
            if self._closed:
                return
            try:
                self._map(slot, nbytes)
            except (OSError, ValueError) as e:  # removed or resized meanwhile: mapped when it is leased
                log.debug("could not map slot %s ahead of time: %s", slot, e)

    def _lease_for(self, state: dict) -> None:
        """Lease and fault in, in the background, the slot of a first save of ``state`` (a fresh start's
        restore): the first save then waits for no fresh memory when the first step outlasts the faulting."""
        try:
            flat = flatten_state(state)
        except Exception:  # the save says what is wrong with the state
            return
        try:
            total = self._planner.plan(flat, self.overlap).total
        except Exception:
            return
        finally:
            forget_initialized(flat.uninitialized)  # sized only: the first step starts from an empty state
        self._lease_ahead(total)

    def _lease_ahead(self, nbytes: int) -> None:
        """Start leasing (and mapping) the slot of the next save of ``nbytes`` bytes in the background (the
        first save after a restore or a fresh start: the ring's other slots wait for its own lease)."""
        with self._lock:
            if self._next_slot is not None:
                return  # leased already (a restore staged a peer's read through it)
        if self._prelease_fut is None and not self._closed:
            self._prelease_fut = self._leaser.submit(self._prelease, nbytes, False)

    def _take_prelease(self, nbytes: int, wait: bool = True) -> str | None:
        """The slot leased ahead, resized to ``nbytes`` when that is close, or None. ``wait``: for the lease
        still under way (done in steady state); without it, a lease not done yet is left for a later save."""
        pending = self._prelease_fut
        if pending is not None:
            if not wait and not pending.done():
                return None
            pending.result()
            self._prelease_fut = None
        with self._lock:
            nxt, self._next_slot = self._next_slot, None
        if nxt is None:
            return None
        if nxt[1] == nbytes:
            return nxt[0]
        if nbytes and abs(nxt[1] - nbytes) <= _RESIZE_SLACK:
            # the state's values changed size a little (an lr scheduler's state after the first step): the
            # leased, faulted-in slot is resized to fit rather than traded for a fresh one faulted in now
            try:
                os.truncate(nxt[0], nbytes)
                return nxt[0]
            except OSError as e:
                log.debug("could not resize slot %s to %d bytes: %s", nxt[0], nbytes, e)
        self._client.call("release", slot=nxt[0])  # the state changed size: lease one that fits (same process)
        return None

    def _copy_parallel(self, buf: torch.Tensor | None, items: list[tuple[torch.Tensor, int, int]]) -> None:
        """Copy from several threads, split by bytes: one background thread copies ~25% slower than
        the main thread does (measured), while two reach main-thread speed."""
        n = len(self._copiers)
        if n <= 1 or len(items) < 2:
            self._copy(buf, items)
            return
        parts: list[list] = [[] for _ in range(n)]
        loads = [0] * n
        for item in sorted(items, key=lambda it: -it[2]):
            i = loads.index(min(loads))
            parts[i].append(item)
            loads[i] += item[2]
        futs = [pool.submit(self._copy, buf, part) for pool, part in zip(self._copiers, parts)]
        for f in futs:
            f.result()

    @staticmethod
    def _copy(buf: torch.Tensor | None, items: list[Item]) -> None:
        for src, off, n in items:
            if n == 0:
                continue
            dst = buf[off : off + n].view(src.dtype).view(src.shape)
            dst.copy_(src)

    def _commit(self, *, layout: Layout, **kw: Any) -> dict:
        """Tell the agent the shard is staged. The layout's entries go only when the agent has not had them:
        it stores each layout once and every later commit names it by digest."""
        if not self._took_over:
            self._take_over(kw["step"])
        send = layout.digest != self._layout_sent
        kw.setdefault("run", self._run)
        for attempt in range(2):
            try:
                r = self._client.call("commit", job=self.job, rank=self.rank, world=self.world,
                                      layout=layout.digest, **({"entries": layout.to_json()} if send else {}), **kw)
                self._layout_sent = layout.digest
                return r
            except AgentError as e:
                if e.kind != "UnknownLayoutError" or send:
                    raise
                send = True  # the agent restarted, or dropped it: send the entries again
        raise AssertionError("unreachable")

    def _take_over(self, step: int) -> None:
        """Before this run's first commit: a run that did not restore (a fresh start on purpose) takes the
        job's step numbers over from ``step`` on. The agents drop the steps of other runs from there (this
        node's memory and disk; rank 0's agent S3 too), which would otherwise be refused as already committed
        and could be restored in place of this run's. A run that restored already dropped them (rewind):
        the agent answers at once."""
        self._took_over = True
        try:
            r = self._client.call("takeover", job=self.job, step=step, run=self._run, shared=self.rank == 0)
        except AgentError as e:
            if e.kind == "RequestError" and "unknown op" in str(e):
                return  # an agent of an earlier version
            raise
        dropped = r.get("dropped") or {}
        if dropped:
            log.warning("job %r starts again without restoring: its first save is step %d, so the earlier run's "
                        "steps from there on are dropped (%s); restore() before the first save resumes instead",
                        self.job, step, "; ".join(f"{steps} from {tier}" for tier, steps in sorted(dropped.items())))

    # ------------------------------------------------------------------ wait / close
    def _agent_wait(self, step: int | None, timeout: float | None) -> None:
        r = self._client.call("wait", io_timeout=None if timeout is None else timeout + 5,
                              job=self.job, step=step, timeout=timeout or 3600)
        self._collect(r)
        self._raise_pending()
        if not r.get("done"):
            raise TimeoutError(f"the agent had not finished writing job {self.job!r} after {timeout} s")

    def wait(self, timeout: float | None = None) -> None:
        """Block until every save so far is staged and written to all its tiers; raise background errors."""
        if self._inflight is not None:
            try:
                self._inflight.wait_staged(timeout)
            except CheckpointError:
                pass
        self._agent_wait(None, timeout)

    def close(self) -> None:
        """Wait for outstanding saves, raise their errors once, release hooks and the agent.

        A clean close (no exception being handled, every save written, and with several ranks every rank
        agreeing so, an all-reduce) tells the agent the job ended: an agent started for the job frees the
        job's memory tier once every rank on the node ended it, if a lower tier holds the newest step (see
        ``keep_memory_after_close``). Anything else is a crash: called while an exception is being handled
        (``with`` left by one, a framework's ``except`` calling close), a save that failed, a rank that could
        not agree. Then the agent keeps the job's memory tier for ``keep_after_crash`` s, so the restart
        restores from memory, and says so in one log line."""
        self._close(sys.exc_info()[1])

    def _close(self, exc: BaseException | None) -> None:
        if self._closed:
            return
        self._closed = True
        crash: str | None = None
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            exc = None  # sys.exit(0): the program ends on purpose
        try:
            if exc is not None:
                crash = f"{type(exc).__name__}: {exc}"[:200]
                self._settle_staging()
                self._crashed(crash)
                return
            err: BaseException | None = None
            try:
                self.wait()
            except BaseException as e:  # raised below, once the ranks know
                err = e
                crash = f"a save failed ({type(e).__name__})"
            if self.world > 1:
                crash = self._agree_end(crash)
            if crash is None:
                self._end()
            else:
                self._crashed(crash)
            if err is not None:
                raise err
        finally:
            if self._hook is not None:
                self._hook.remove()
                self._hook = None
            self._pool.shutdown(wait=True)
            for c in self._copiers:
                c.shutdown(wait=True)
            self._leaser.shutdown(wait=True)
            if self._lease_client is not None:
                self._lease_client.close()
            if self._started_agent and self.world == 1 and crash is None:
                try:
                    # another job may have connected to the agent this one started, or it keeps a crashed
                    # job's memory: then it keeps running
                    if self._client.call("shutdown", if_alone=True).get("stopping", True):
                        # the agent answers before it stops: wait until it is gone so a new one can start cleanly
                        wait_stopped(self.settings, self.settings.grace + 5)
                except (AgentError, AgentUnreachableError):
                    pass
            self._client.close()
            for _, mm, buf in self._maps.values():
                self._unmap(mm, buf)
            self._maps.clear()

    def _settle_staging(self, timeout: float = 60.0) -> None:
        """Leaving by an exception: let a save being copied out finish (its step may be the newest the
        restart gets), without waiting for the agent, whose step may never complete (a dead rank)."""
        f = self._inflight
        if f is not None:
            with contextlib.suppress(BaseException):
                f.wait_staged(timeout)

    def _agree_end(self, crash: str | None) -> str | None:
        """With several ranks: whether every rank ended cleanly (an all-reduce). Answers why not, or None."""
        if not (dist.is_available() and dist.is_initialized()):
            return crash or ("the process group was destroyed before close(), so the ranks could not agree "
                             "that the job ended (close the Checkpointer first)")
        try:
            every = _min_over_ranks(int(crash is None))
        except Exception as e:  # a dead peer: the job crashed
            return crash or f"the ranks could not agree that the job ended ({type(e).__name__}: {e})"[:200]
        return crash or (None if every else "another rank did not end cleanly")

    def _return_lease(self) -> None:
        """Give back a slot leased ahead, so the agent can free it with the job's other slots."""
        pending = self._prelease_fut
        if pending is not None:
            with contextlib.suppress(Exception):
                pending.result()
            self._prelease_fut = None
        with self._lock:
            nxt, self._next_slot = self._next_slot, None
        if nxt is not None:
            with contextlib.suppress(AgentError, AgentUnreachableError):
                self._client.call("release", slot=nxt[0])

    def _end(self) -> None:
        """Tell the agent this rank ended the job cleanly (see :meth:`close`); log what it freed."""
        # it counts this rank's connections, the lease connection too, as ended by process
        self._return_lease()
        try:
            r = self._client.call("end", job=self.job, rank=self.rank, agreed=True)
        except (AgentError, AgentUnreachableError) as e:  # an agent of an earlier version: nothing is freed
            log.debug("the agent did not take the end of the job: %s", e)
            return
        if r.get("released"):
            log.info("the agent freed %s's memory tier (%d bytes)", self.job, r.get("bytes", 0))
        elif r.get("why"):
            log.info("%s's memory tier stays: %s", self.job, r["why"])

    def _crashed(self, why: str) -> None:
        """Tell the agent this rank leaves without a clean end (``why``): it keeps the job's memory tier for the
        restart. One log line (from each node's first rank) says what is kept and for how long."""
        self._return_lease()
        try:
            r = self._client.call("crashed", job=self.job, why=why)
        except (AgentError, AgentUnreachableError) as e:
            log.warning("job %r did not end cleanly (%s); the agent could not be told (%s): what it holds in "
                        "memory is kept until `ckpt gc %s` removes it", self.job, why, e, self.job)
            return
        if os.environ.get("LOCAL_RANK", "0") != "0":
            return
        steps = r.get("steps") or []
        if not steps:
            log.info("job %r did not end cleanly (%s); nothing of it is in memory", self.job, why)
            return
        span = (f"step {steps[0]}" if len(steps) == 1 else f"steps {', '.join(map(str, steps))}" if len(steps) <= 6
                else f"{len(steps)} steps, {steps[0]} to {steps[-1]}")
        secs = r.get("seconds")
        until = (f"for {secs:.0f} s (keep_after_crash), so a restart restores from memory; "
                 f"`ckpt gc {self.job} --all --force` frees it sooner" if secs is not None
                 else f"until `ckpt gc {self.job}` removes it (the node agent frees nothing at a job's end)")
        log.warning("job %r did not end cleanly (%s): the agent on %s keeps %s (%.1f MiB) in memory %s",
                    self.job, why, self.settings.shm, span, r.get("bytes", 0) / 2**20, until)

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self._close(None)
            return
        try:
            self._close(exc if exc is not None else exc_type())
        except Exception as e:  # the training loop's own exception is the one to see
            log.error("while closing after %s: %s", exc_type.__name__, e)

    # ------------------------------------------------------------------ restore
    def latest_step(self) -> int | None:
        """The newest step complete in any tier this rank can reach, or None."""
        from recovery.planner import complete_steps

        invs = self._scan_near() + scan_tiers(self._far_tiers(), self.job)
        steps = complete_steps(invs, self.job, [self.rank], replicas=True)
        return steps[-1] if steps else None

    def restore(self, state: dict, step: int | None = None, *, keep_state: bool = True) -> int | None:
        """Load the newest complete step (or ``step``) into ``state`` in place; return it, or None on a fresh start.

        Every rank restores the same step, the newest all ranks can reach, each
        shard from the cheapest tier that holds it intact; a damaged copy falls
        back to every other tier before an older step is tried (said in
        ``last_restore.passed_over``). None only when no tier holds a committed
        step of the job. A failed restore leaves ``state`` as it was: bytes are
        verified before they are written (a peer's are staged in the next save's
        slot), and a read that cannot be (a resharded step) first copies the
        CPU tensors, unless ``keep_state=False``. Raises StepNotFoundError, RestoreError (a committed
        step not restorable intact, or a tier that may hold one unreachable),
        StateMismatchError. The README's "Using it in a training loop" has the
        whole contract.
        """
        t0 = time.perf_counter()
        self._await_prefetch()
        # the CPU tensors a read fills in place, copied before the first read and put back if no step is
        # restored in the end (every other write waits for Prepared.finish, which only a step prepared on every
        # rank gets)
        with kept(state, take=False) as before:
            loader = _StateLoader(self._loader, state, self.world, before.take if keep_state else None, before.flat,
                                  self._restore_slot)
            done = self._restorer().restore(loader, step)
            if done is None:
                self._lease_for(state)  # a fresh start: the first save's slot is faulted in meanwhile
                forget_initialized(before.uninitialized)  # its first step starts as it would without us
                return None
            self.last_restore = RestoreReport(done.step, done.shards, time.perf_counter() - t0, done.passed_over,
                                              done.unreachable)
            used = done.manifest
            if used is not None and used.world == self.world and "durable_of" not in used.metadata:
                # the next save stages as many bytes as this shard holds: its slot is leased and faulted in now
                # (a shared tier's view names each rank's durable part, not its whole shard: no size to lease)
                self._lease_ahead(used.shard(self.rank).size)
            log.info("rank %d restored %s step %d from %s in %.3f s", self.rank, self.job, done.step,
                     ", ".join(sorted({r.tier for r in done.shards})) or "nowhere", self.last_restore.seconds)
            return done.step

    def _restore_slot(self, nbytes: int) -> memoryview | None:
        """A staging slot of ``nbytes`` bytes, leased and mapped with its memory faulted in, for a shard read
        that is verified before it is applied (a peer's, or into a buffer): the bytes then land in warm memory,
        not in the tensors before they are verified (which would mean copying the tensors first, into fresh
        memory: slower than the read itself) nor in a fresh buffer. The slot stays leased as the next save's,
        which needs one of the same size; None when the agent has no slot free now (the read then goes as
        it would without one)."""
        if not nbytes:
            return None
        try:
            slot = self._take_prelease(nbytes)
            if slot is None:
                r = self._client.call("begin", job=self.job, rank=self.rank, world=self.world, nbytes=nbytes,
                                      fault=False, wait=False)
                self._collect(r)
                slot = r.get("slot")
                if not slot:
                    return None
            # not populated here: the reads fault the pages in as they land, on the copier threads
            buf = self._map(slot, nbytes, populate=False)
        except (AgentError, AgentUnreachableError, OSError, ValueError) as e:
            log.debug("no staging slot to restore through: %s", e)
            return None
        with self._lock:
            self._next_slot = (slot, nbytes)
        return _buffer_view(buf.data_ptr(), nbytes)

    def _restorer(self) -> Restorer:
        """The restore engine for this rank: the tiers it lists, the agreement between ranks, the learned
        costs and the agent's rewind, for :meth:`restore`."""
        return Restorer(self.job, self.rank, self.world, near=self._scan_near,
                        far=(lambda: scan_tiers(self._far_tiers(), self.job)) if self.settings.s3 is not None
                        else None,
                        far_may_be_newer=self._far_may_be_newer, others=self._other_places,
                        agree=_min_over_ranks if self.world > 1 else (lambda v: v),
                        costs=lambda invs: node_costs(self.settings.shm, invs), before_read=self._rewind)

    def _rewind(self, step: int) -> None:
        """Have the agent drop what a failed run left after ``step``: saves after this restore retake those
        step numbers, so they are not refused as already committed."""
        try:
            self._client.call("rewind", job=self.job, step=step, run=self._run)
        except AgentError as e:
            log.warning("the agent could not drop steps after %d: %s", step, e)

    def _other_places(self, m: Manifest, needed: list[int] | None) -> list[Tier]:
        """Where to look for the shards of ``needed`` (every rank if None) of ``m``'s step that the listed tiers
        lack: the other nodes' memory holds those shards before S3 does, and their disks hold the durable
        parts of their ranks (each chunk once across the job's disks); only the nodes of the ranks needed,
        when they are known."""
        partners = placement_partners(self.settings)
        nodes = None if needed is None else {m.shard(q).node for q in needed} - {self.settings.node_rank}
        others = peer_tiers(self.settings, exclude=partners) if nodes is None else \
            peer_tiers(self.settings, only=nodes - partners)
        if self.settings.disk:
            others += peer_disk_tiers(self.settings, only=nodes)
        return others

    def _await_prefetch(self) -> None:
        """Let a replacement node's agent finish pulling this node's shards from its peers (warm restore).

        The agent starts pulling at once; reading the same bytes from the peers in parallel would only
        split the same links. Waits at most a few peer timeouts; restore then reads whatever is where.
        """
        if not self.settings.peers or not self.settings.prefetch:
            return
        limit = 6 * self.settings.peer_timeout
        try:
            with AgentClient(self.settings.socket_path, timeout=limit + 5) as c:
                rep = c.call("prefetch", timeout=limit)
        except (AgentError, AgentUnreachableError, OSError) as e:
            log.warning("could not ask the agent about its warm restore: %s", e)
            return
        if rep.get("state") != "done":
            log.warning("the agent's warm restore is still running after %.0f s: restoring from where the "
                        "shards are now", limit)
        elif rep.get("shards"):
            log.info("the agent pulled %d shards (%d bytes) from peers before this restore", rep["shards"],
                     rep["bytes"])
