"""Commit dissemination over a tree of the live nodes: no all-to-all, no fixed coordinator.

What travels, per step of a job (N nodes, R ranks per node, world W = N x R):

* **up**: each node sends its ranks' commit rows (rank, size, checksum, layout
  digest, JSON values: about 200 bytes each, whatever the model) to its parent
  in the tree; a node forwards what its children send, coalesced with its own
  (whatever queued while a send was in flight goes in the next one). The root
  collects the rows.
* **down**: once the root holds all W rows it builds the step's manifest,
  commits it in its own memory and sends it to its children, who commit it
  and forward it to theirs. The manifest (W rows of ~130 bytes, deflated)
  is the only per-step message whose size grows with the world.

The tree: the live nodes, the root first and then in node-rank order,
heap-indexed with fan-out ``f``: the node at position ``i`` has parent
``(i - 1) // f`` and children ``f*i + 1 .. f*i + f``. The root is the node
elected for the current epoch by a majority (:mod:`agents.election`): the
lowest live node when it was elected. Every node computes the same tree from
the same view of who is alive.

A node holds its own rows of a step until the ranks it had in the job's
previous step are all in (at most ``hold`` seconds), and gathers rows for
``linger`` seconds (20 ms) before sending them up, so its ranks' rows and its
children's travel as one message.
Per node and step: 1-2 messages up (more only for the nodes near the root,
which forward their subtrees: at most ``f`` receptions, coalesced), 1 message
down in and ``f`` out. Independent of N for the leaves, ``O(f)`` for inner nodes.

No single point of failure:

* a node keeps its own ranks' rows until the step's manifest reaches it; on a
  change of view (a node declared dead or back) and every ``resend_after``
  seconds it sends them up again, to its parent in the new tree. Rows are
  idempotent (keyed by job, step, rank) at the root.
* the root answers rows of a step it already committed with the manifest
  itself, so a node that missed the broadcast (its parent died while
  forwarding) catches up with one request.
* the root keeps the view (see :class:`View`): nodes watch only their tree
  neighbours and placement partners, report a silent one as dead (or a dead
  one as back) up the tree, and the root bumps the view's epoch and sends it
  down with the next message. When the root itself dies, its children (who
  watch it) drop it, and the next live node is elected root for a new epoch.
  A node that sees no elected root holds its rows and says why
  (:meth:`Disseminator.blocked`).

Messages go over one keep-alive :class:`~agents.replication.PeerLink` per peer,
signed like every peer request, in the agent's control executor, so serving
never waits behind them.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from tiers.manifest import peek

from .election import Election, View
from .replication import SharedBody

__all__ = ["DEFAULT_FANOUT", "Disseminator", "View", "tree_children", "tree_parent", "tree_root"]

log = logging.getLogger("tierckpt.agent")

#: children per node in the commit tree
DEFAULT_FANOUT = 8
#: seconds a node gathers rows before sending them up
DEFAULT_LINGER = 0.02
#: committed manifests a node keeps to answer late rows (catch-up)
KEEP_COMMITTED = 512


def tree_root(live: list[int]) -> int:
    """The root of the tree over ``live`` when no other root is elected (the lowest live node)."""
    return min(live)


def _pos(live: list[int], me: int) -> tuple[list[int], int]:
    order = sorted(live)
    return order, order.index(me)


def tree_parent(live: list[int], me: int, fanout: int = DEFAULT_FANOUT) -> int | None:
    """``me``'s parent in the tree over ``live`` (None for the root, or when ``me`` is not live)."""
    if me not in live:
        return None
    order, i = _pos(live, me)
    return None if i == 0 else order[(i - 1) // fanout]


def tree_children(live: list[int], me: int, fanout: int = DEFAULT_FANOUT) -> list[int]:
    """``me``'s children in the tree over ``live``."""
    if me not in live:
        return []
    order, i = _pos(live, me)
    return order[fanout * i + 1: fanout * i + 1 + fanout]


def _parent_in(order: list[int], me: int, fanout: int) -> int | None:
    if me not in order:
        return None
    i = order.index(me)
    return None if i == 0 else order[(i - 1) // fanout]


def _children_in(order: list[int], me: int, fanout: int) -> list[int]:
    if me not in order:
        return []
    i = order.index(me)
    return order[fanout * i + 1: fanout * i + 1 + fanout]


Post = Callable[[int, str, dict], Awaitable[dict]]


@dataclass
class _Stats:
    """Control messages and body bytes this node sent and received, by direction."""

    up_sent: int = 0
    up_received: int = 0
    down_sent: int = 0
    down_received: int = 0
    rows_sent: int = 0
    catch_ups: int = 0
    resends: int = 0
    counts: dict = field(default_factory=dict)


class Disseminator:
    """One node's part of the commit tree. The agent owns it and supplies:

    ``alive()``: the live nodes as this node sees them (``me`` included);
    ``post(node, path, body)``: a signed control POST to a peer, answering its JSON (raises ConnectionError);
    ``on_rows(rows)``: the root's intake of commit rows (from any node, its own included);
    ``on_manifest(data)``: commit a manifest received from the root (verifies it; True if new here);
    ``on_view(view)``: adopt a view the root sent; ``on_report(kind, node)``: the root applies a report
    (True if it changed who is alive); ``dead()``: the nodes this node holds dead (the root's view);
    ``nodes``: how many nodes the cluster has, ``probe(node)``: whether a node answers a health check
    within a short deadline, ``quorum`` and ``state_file``: for the root's election (:class:`Election`).

    Call order: :meth:`start` once; :meth:`submit` with this node's rows as their checksums are known;
    :meth:`committed` when a manifest is committed here (the root calls :meth:`broadcast` too);
    :meth:`view_changed` after membership changes; :meth:`handle_up` / :meth:`handle_down` /
    :meth:`handle_vote` for the three routes; :meth:`stop` at the end.
    """

    def __init__(self, me: int, *, alive: Callable[[], set[int]], post: Post,
                 on_rows: Callable[[list[dict]], Awaitable[None]],
                 on_manifest: Callable[[bytes], Awaitable[bool]],
                 on_view: Callable[[View], None], on_report: Callable[[str, int], bool],
                 dead: Callable[[], set[int]], nodes: int,
                 probe: Callable[[int], Awaitable[bool]] | None = None, quorum: int | None = None,
                 state_file: str | None = None,
                 fanout: int = DEFAULT_FANOUT, resend_after: float = 10.0, retry_after: float = 1.0,
                 linger: float = DEFAULT_LINGER, hold: float = 1.0) -> None:
        self.me = me
        self.linger = linger
        self.hold = hold
        self.alive = alive
        self.post = post
        self.on_rows = on_rows
        self.on_manifest = on_manifest
        self.on_view = on_view
        self.on_report = on_report
        self.dead = dead
        self.fanout = fanout
        self.resend_after = resend_after
        self.retry_after = retry_after
        self.election = Election(me, nodes=nodes, live=alive, post=post, probe=probe or self._no_probe,
                                 quorum=quorum, state_file=state_file, retry_after=retry_after,
                                 ranks=lambda: set(alive()) | set(dead()))
        self.election.on_elected = self._elected
        self.stats = _Stats()
        #: since when (monotonic) and why sending rows up has been failing, None while it works
        self._up_failing: tuple[float, str] | None = None
        #: what the parent last answered about itself being unable to commit: (parent, why), or None
        self._parent_blocked: tuple[int, str] | None = None
        #: rows (own and forwarded) and reports waiting to go up
        self._rows: list[dict] = []
        self._reports: list[list] = []
        #: this node's own rows, per (job, step), until the step's manifest is committed here: (rows, sent at)
        self._unacked: dict[tuple[str, int], tuple[list[dict], float]] = {}
        #: own rows not sent yet, per (job, step), waiting for the node's other ranks (see :meth:`submit`)
        self._held: dict[tuple[str, int], list[dict]] = {}
        #: per job, the ranks whose rows this node sent for the newest step committed here
        self._own_ranks: dict[str, frozenset[int]] = {}
        #: recently committed manifests (to answer late rows)
        self._committed: collections.OrderedDict[tuple[str, int], bytes] = collections.OrderedDict()
        self._wake: asyncio.Event | None = None
        self._tasks: list[asyncio.Task] = []

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._wake = asyncio.Event()
        self._tasks = [asyncio.create_task(self._up_loop(), name="commit-up"),
                       asyncio.create_task(self._resend_loop(), name="commit-resend"),
                       asyncio.create_task(self._elect_loop(), name="commit-root")]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- tree --------------------------------------------------------------------------------
    @staticmethod
    async def _no_probe(node: int) -> bool:
        return False

    @property
    def view(self) -> View:
        return self.election.view

    def live(self) -> list[int]:
        return sorted(self.alive() | {self.me})

    def is_root(self) -> bool:
        return self.election.is_root()

    def root(self) -> int | None:
        """The elected root as this node knows it (None while there is none)."""
        order = self.election.order()
        return order[0] if order[0] == self.view.root and (order[0] != self.me or self.is_root()) else None

    def parent(self) -> int | None:
        return _parent_in(self.election.order(), self.me, self.fanout)

    def children(self) -> list[int]:
        return _children_in(self.election.order(), self.me, self.fanout)

    def blocked(self) -> str | None:
        """Why this node cannot commit now (no elected root it can reach), or None."""
        if self.is_root():
            return None
        e = self.election
        if not e.has_quorum():
            return (f"this node sees {len(e.live())} of {e.nodes} nodes alive and a commit root needs a majority "
                    f"({e.quorum}): steps are held until the network to the others is back (ckpt status on each)")
        if self.root() is None:
            return "no commit root elected yet" + (f" ({e.last_failure})" if e.last_failure else "")
        if self._up_failing is not None and time.monotonic() - self._up_failing[0] > self.resend_after:
            return f"commit rows cannot reach node {self.parent()}: {self._up_failing[1]}"
        if self._parent_blocked is not None:
            return f"node {self._parent_blocked[0]}, this node's way to the root, says: {self._parent_blocked[1]}"
        return None

    def _elected(self) -> None:
        """This node won an epoch: its view goes down the tree, and every node's unacked rows come to it."""
        self.view_changed()
        asyncio.ensure_future(self._send_down({"view": self.view.to_json()}))

    async def handle_vote(self, body: dict) -> dict:
        """``POST /v1/vote`` from a candidate root (see :class:`Election`)."""
        return await self.election.handle_vote(body)

    def _maybe_campaign(self) -> None:
        if self.election.candidate():
            self.election.campaign_soon()

    # -- up ----------------------------------------------------------------------------------
    def submit(self, rows: list[dict]) -> None:
        """Send this node's commit rows up; keep them until the step's manifest is committed here.

        A step's rows are held until every rank that committed the job's previous step on this node has
        its row in (at most ``hold`` seconds), then go up together: the step cannot commit before its
        last row anyway, so waiting for it costs nothing and sends one message instead of one per rank.
        """
        fresh: dict[tuple[str, int], list[dict]] = {}
        for row in rows:
            k = (row["job"], row["step"])
            if k in self._committed:
                continue
            own, _ = self._unacked.get(k, ([], 0.0))
            own.append(row)
            self._unacked[k] = (own, time.monotonic())
            fresh.setdefault(k, []).append(row)
        for k, got in fresh.items():
            held = self._held.setdefault(k, [])
            held.extend(got)
            expected = self._own_ranks.get(k[0])
            if expected is None or {r["rank"] for r in self._unacked[k][0]} >= expected:
                self._release(k)
            elif len(held) == len(got):  # the first rows held for this step: release them in time regardless
                asyncio.get_running_loop().call_later(self.hold, self._release, k)

    def _release(self, k: tuple[str, int]) -> None:
        rows = self._held.pop(k, None)
        if rows:
            self._rows.extend(rows)
            self._wake.set()

    def report(self, kind: str, node: int) -> None:
        """Tell the root that ``node`` is ``dead`` or ``alive`` as this node sees it."""
        self._reports.append([kind, node])
        self._wake.set()

    def view_changed(self) -> None:
        """The live set changed here: the tree did too, so every unacked row goes up again."""
        self._resend(force=True)
        if self._wake is not None:
            self._maybe_campaign()

    def _resend(self, force: bool = False) -> None:
        now = time.monotonic()
        for k, (rows, sent) in list(self._unacked.items()):
            if force or now - sent >= self.resend_after:
                self._unacked[k] = (rows, now)
                self._rows.extend(rows)
                self.stats.resends += 1
        if self._rows and self._wake is not None:
            self._wake.set()

    async def _resend_loop(self) -> None:
        while True:
            await asyncio.sleep(max(0.5, self.resend_after / 4))
            if self.me in self.view.dead:
                self.report("alive", self.me)  # the root holds this node dead: say it is back
            self._maybe_campaign()
            self._resend()

    async def _elect_loop(self) -> None:
        """Campaign whenever this node is first in its tree without being root (at start, once the root is
        gone); a failed campaign waits ``retry_after`` or more before the next."""
        while True:
            self._maybe_campaign()
            await asyncio.sleep(self.retry_after)

    async def _up_loop(self) -> None:
        while True:
            await self._wake.wait()
            if self.linger > 0 and self.parent() is not None:
                # rows come one per rank as each rank's copy is checksummed, and forwarded rows one per
                # child's send: sent at once, a node near the root would pass on one message per row
                # below it (253 a step at the root of 64 nodes). Waiting a moment sends them as one.
                await asyncio.sleep(self.linger)
            self._wake.clear()
            if not self._rows and not self._reports:
                continue
            if self.parent() is None and not self.is_root():
                # first in the tree but not elected: hold everything until a root is (campaigning now)
                self._maybe_campaign()
                await asyncio.sleep(self.retry_after)
                self._wake.set()
                continue
            rows, self._rows = _dedupe(self._rows), []
            reports, self._reports = self._reports, []
            try:
                await self._send_up(rows, reports)
                self._up_failing = None
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the rows stay: sent again once the tree changes or after a pause
                if self._up_failing is None:
                    self._up_failing = (time.monotonic(), str(e))
                log.warning("commit rows not sent up (%s); trying again", e)
                self._rows = rows + self._rows
                self._reports = reports + self._reports
                await asyncio.sleep(self.retry_after)
                self._wake.set()

    async def _send_up(self, rows: list[dict], reports: list[list]) -> None:
        parent = self.parent()
        if parent is None:  # the root takes its own rows and reports
            await self._take(rows, reports)
            return
        body: dict = {"packed": pack_rows(rows), "epoch": self.view.epoch}
        if reports:
            body["reports"] = reports
        answer = await self.post(parent, "/v1/up", body)
        self.stats.up_sent += 1
        self.stats.rows_sent += len(rows)
        why = answer.get("blocked")
        self._parent_blocked = (parent, why) if isinstance(why, str) and why else None
        await self._absorb(answer)

    async def _take(self, rows: list[dict], reports: list[list]) -> list[str]:
        """At the root: apply reports, take rows; answer manifests of steps already committed."""
        changed = False
        for kind, node in reports:
            changed |= self.on_report(kind, node)
        if changed or frozenset(self.dead()) != self.view.dead:
            # the root's own observations count too (it watches its children and partners)
            self.election.bump(frozenset(self.dead()))
            self.view_changed()
            asyncio.ensure_future(self._send_down({"view": self.view.to_json()}))
        late = sorted({(r["job"], r["step"]) for r in rows if (r["job"], r["step"]) in self._committed})
        fresh = [r for r in rows if (r["job"], r["step"]) not in self._committed]
        if fresh:
            await self.on_rows(fresh)
        return [self._committed[k].decode() for k in late]

    async def _absorb(self, answer: dict) -> None:
        """A parent's answer: the manifests of steps it says are committed (catch-up), and its view."""
        for text in answer.get("manifests", ()):
            self.stats.catch_ups += 1
            await self._commit_text(text)
        if "view" in answer:
            self._adopt(View.from_json(answer["view"]))

    async def handle_up(self, body: dict) -> dict:
        """``POST /v1/up`` from a child: forward toward the root, or take it at the root."""
        rows = unpack_rows(body["packed"]) if "packed" in body else body.get("rows", [])
        reports = body.get("reports", [])
        if not isinstance(rows, list) or not isinstance(reports, list):
            raise ValueError("rows and reports must be lists")
        for r in reports:
            if not (isinstance(r, list) and len(r) == 2 and r[0] in ("dead", "alive") and isinstance(r[1], int)
                    and not isinstance(r[1], bool)):
                raise ValueError("a report is [\"dead\"|\"alive\", node]")
        self.stats.up_received += 1
        epoch = body.get("epoch")
        if isinstance(epoch, int) and not isinstance(epoch, bool) and epoch > self.election.promised:
            # a child follows a newer epoch than this node: whatever this node was, it is not its root now
            self.election.note_epoch(epoch)
        answer: dict = {"view": self.view.to_json()}
        why = self.blocked()
        if why:  # the rows stop here for now: the child says so to its trainers and in its status
            answer["blocked"] = why
        if self.is_root():
            answer["manifests"] = await self._take(rows, reports)
        else:
            # forwarded with this node's next send; a row of a step committed here is answered at once
            late = sorted({(r["job"], r["step"]) for r in rows if (r["job"], r["step"]) in self._committed})
            answer["manifests"] = [self._committed[k].decode() for k in late]
            self._rows.extend(r for r in rows if (r["job"], r["step"]) not in self._committed)
            self._reports.extend(reports)
            self._wake.set()
        return answer

    # -- down --------------------------------------------------------------------------------
    def committed(self, job: str, step: int, data: bytes) -> None:
        """The step's manifest is committed here: drop its unacked rows, keep it for late rows."""
        own = self._unacked.pop((job, step), None)
        self._held.pop((job, step), None)
        if own is not None:
            self._own_ranks[job] = frozenset(r["rank"] for r in own[0])
        self._committed[(job, step)] = data
        while len(self._committed) > KEEP_COMMITTED:
            self._committed.popitem(last=False)

    def forget(self, job: str, steps: set[int]) -> None:
        """Steps dropped by a rewind: later rows for the same numbers belong to a new run."""
        for s in steps:
            self._committed.pop((job, s), None)
            self._unacked.pop((job, s), None)
            self._held.pop((job, s), None)

    def broadcast(self, data: bytes) -> None:
        """At the root: send a manifest just committed here down the tree."""
        asyncio.ensure_future(self._send_down({"manifests": [data.decode()], "view": self.view.to_json()}))

    async def _send_down(self, body: dict) -> None:
        body = SharedBody(body)  # the same message to every child: serialised and compressed once

        async def one(child: int) -> None:
            try:
                await self.post(child, "/v1/down", body)
                self.stats.down_sent += 1
            except Exception as e:  # the child's rows stay unacked there: it catches up from the root
                log.info("node %d did not take a message down the commit tree: %s", child, e)

        await asyncio.gather(*(one(c) for c in self.children()))

    async def handle_down(self, body: dict) -> dict:
        """``POST /v1/down`` from the parent: adopt its view, commit its manifests, forward to the children."""
        texts = body.get("manifests", [])
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise ValueError("manifests must be a list of strings")
        self.stats.down_received += 1
        if "view" in body:
            self._adopt(View.from_json(body["view"]))
        # forwarded before it is committed here: each level of the tree adds one hop, not one commit
        asyncio.ensure_future(self._send_down(body))
        for text in texts:
            await self._commit_text(text)
        return {}

    async def _commit_text(self, text: str) -> None:
        data = text.encode()
        # a manifest committed here already is not parsed again (catch-up answers repeat them)
        if peek(data) in self._committed:
            return
        await self.on_manifest(data)

    def _adopt(self, view: View) -> None:
        if self.election.adopt(view):
            self.on_view(view)
            self.view_changed()


def pack_rows(rows: list[dict]) -> dict:
    """Rows as they travel up: the fields every row of the message shares once (job, step, world, values,
    metadata, node: the same for a node's ranks and mostly for a subtree's), then each row's own fields.
    Deflated on the wire, a rank costs about its checksum and layout digest."""
    if not rows:
        return {"common": {}, "rows": []}
    first = rows[0]
    common = {k: v for k, v in first.items() if all(k in r and r[k] == v for r in rows[1:])}
    if len(rows) == 1:
        common = {k: v for k, v in first.items() if k in ("job", "step", "world")}
    return {"common": common, "rows": [{k: v for k, v in r.items() if k not in common} for r in rows]}


def unpack_rows(packed: object) -> list[dict]:
    """The rows of :func:`pack_rows`; ValueError when ``packed`` is not of that form."""
    if not isinstance(packed, dict) or not isinstance(packed.get("common"), dict) \
            or not isinstance(packed.get("rows"), list) or not all(isinstance(r, dict) for r in packed["rows"]):
        raise ValueError("packed rows are {common: {...}, rows: [{...}]}")
    common = packed["common"]
    return [{**common, **r} for r in packed["rows"]]


def _dedupe(rows: list[dict]) -> list[dict]:
    seen: dict[tuple, dict] = {}
    for r in rows:
        seen[(r.get("job"), r.get("step"), r.get("rank"))] = r
    return list(seen.values())
