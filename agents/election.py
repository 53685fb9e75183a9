"""Who may act as the commit tree's root: one root per epoch, elected by a majority of the nodes.

The root is the node that takes every node's commit rows, builds each step's
manifest and keeps the view of who is dead (see :mod:`agents.dissemination`).
Two roots at once would mean two views and, after a partition, two histories.
So a node acts as root only for an **epoch** it won:

* A node that is first in its own tree order (the lowest node it sees alive,
  or the sitting root) and is not the root asks every node it sees alive for
  its vote in epoch ``e``, one more than the highest epoch it knows.
* A node grants epoch ``e`` at most once, and only when ``e`` is above every
  epoch it granted or adopted before (its *promise*, kept in a file so a
  restarted agent does not vote twice). It refuses a candidate when it can
  itself reach a node that should come before it: a lower node it sees alive
  is asked once, with a short deadline, before the vote is given. So a node
  cut off from the root cannot take over while the others still reach it.
* The candidate is root for ``e`` once a **quorum** (a majority of the nodes in
  the peers file, itself counted) granted ``e``. Two majorities share a node,
  and that node granted ``e`` once: at most one root per epoch. (Two nodes
  elect with one vote by default, see :func:`majority`.)
* The root stops acting as root as soon as it sees fewer than a quorum of
  nodes alive, or learns of a higher epoch (in a vote it is asked for, or a
  view it is sent). Within its epoch it numbers its views (``seq``): a view
  replaces another when ``(epoch, seq)`` is higher.

With etcd, a won epoch is also written there (``/tierckpt/<cluster>/root``, only ever to a higher epoch,
in a transaction) before the winner acts on it, and every agent watches that key: a root that sees a
higher epoch recorded stops at once, even while it still sees a quorum (a root cut off from the others
by a partition they detect first). etcd only adds a reason to stop: with etcd down the votes decide alone,
so commits go on.

A side of a partition without a majority has no root: its nodes keep what
they hold, serve restores, and say in ``ckpt status`` (and to their trainers)
why they cannot commit. A step needs every rank's row anyway, so nothing a
minority could commit is lost by waiting for the link to come back.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

__all__ = ["Election", "View", "majority"]

log = logging.getLogger("tierckpt.agent")


def majority(n: int) -> int:
    """The default quorum of ``n`` nodes: more than half of them, from three nodes on. Of two nodes a majority
    is both, so one failure would stop every commit: two nodes elect with one vote (a lone survivor keeps
    committing, and a partition of the two may give each side a root; ``quorum=2`` rules that out)."""
    return n // 2 + 1 if n >= 3 else 1


@dataclass(frozen=True)
class View:
    """Who is dead, as the root of ``epoch`` last said; ``(epoch, seq)`` orders views."""

    epoch: int = 0
    seq: int = 0
    root: int | None = None
    dead: frozenset[int] = field(default_factory=frozenset)

    def newer_than(self, other: "View") -> bool:
        return (self.epoch, self.seq) > (other.epoch, other.seq)

    def to_json(self) -> dict:
        return {"epoch": self.epoch, "seq": self.seq, "root": self.root, "dead": sorted(self.dead)}

    @classmethod
    def from_json(cls, obj: object) -> "View":
        def rank(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and v >= 0

        if not isinstance(obj, dict) or not rank(obj.get("epoch")) or not rank(obj.get("seq", 0)) \
                or not (obj.get("root") is None or rank(obj.get("root"))) \
                or not isinstance(obj.get("dead"), list) or not all(rank(r) for r in obj["dead"]):
            raise ValueError("a view is {epoch: int, seq: int, root: int|null, dead: [int]}")
        return cls(obj["epoch"], obj.get("seq", 0), obj.get("root"), frozenset(obj["dead"]))


Post = Callable[[int, str, dict], Awaitable[dict]]


class Election:
    """One node's part in electing the commit root (see the module docstring).

    ``live()``: the nodes this node sees alive, itself included; ``nodes``: how many nodes the cluster
    has (the quorum is a majority of them unless ``quorum`` is given); ``post(node, path, body)``: a
    signed control POST (raises ConnectionError); ``probe(node)``: whether a node answers a health check
    within a short deadline; ``state_file``: where the promise is kept across restarts (None: in memory).
    """

    def __init__(self, me: int, *, nodes: int, live: Callable[[], set[int]], post: Post,
                 probe: Callable[[int], Awaitable[bool]], quorum: int | None = None,
                 state_file: str | None = None, retry_after: float = 1.0,
                 ranks: Callable[[], set[int]] | None = None) -> None:
        self.me = me
        #: every node's rank (live or not; retired nodes are not nodes): the dead are those not live
        self.ranks = ranks or (lambda: set(range(self.nodes)))
        self.nodes = nodes
        self._fixed_quorum = quorum
        self.quorum = quorum if quorum else majority(nodes)
        if not 1 <= self.quorum <= max(1, nodes):
            raise ValueError(f"quorum {self.quorum} must be between 1 and the {nodes} nodes")
        self._live = live
        self.post = post
        self.probe = probe
        self.retry_after = retry_after
        self.state_file = state_file
        self.view = View()
        #: the highest epoch this node granted, won or adopted: it grants none at or below it
        self.promised = self._load()
        #: the epoch this node won, if any
        self.won: int | None = None
        #: why the last campaign failed ("" once one succeeded)
        self.last_failure = ""
        self.campaigns = 0
        #: the epochs this node won (kept for status and tests: a few per failover)
        self.won_epochs: list[int] = []
        self._campaign: asyncio.Task | None = None
        #: called once this node won an epoch (the commit tree sends the new view down)
        self.on_elected: Callable[[], None] | None = None
        #: with etcd, ``record(epoch, me)`` writes a won epoch there before this node acts on it: a higher epoch
        #: already recorded (returned) means this node lost it after all; None when it was recorded, or etcd
        #: cannot be reached (the vote alone decides then)
        self.record: Callable[[int, int], Awaitable[int | None]] | None = None

    # -- state ---------------------------------------------------------------------------------
    def _load(self) -> int:
        if not self.state_file:
            return 0
        try:
            with open(self.state_file) as f:
                got = json.load(f).get("promised", 0)
            return got if isinstance(got, int) and got >= 0 else 0
        except (OSError, ValueError, AttributeError):
            return 0

    def _promise(self, epoch: int) -> None:
        self.promised = max(self.promised, epoch)
        if self.state_file:
            tmp = f"{self.state_file}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump({"promised": self.promised}, f)
            os.replace(tmp, self.state_file)

    # -- who is root -----------------------------------------------------------------------------
    def live(self) -> set[int]:
        return self._live() | {self.me}

    def resize(self, nodes: int) -> None:
        """The cluster has ``nodes`` nodes now (nodes were added or retired): the quorum is a majority of them,
        unless it was given (then at most ``nodes``). A sitting root that no longer sees a quorum steps down
        at its next check, as after a loss."""
        if nodes < 1 or nodes == self.nodes:
            return
        self.nodes = nodes
        self.quorum = min(self._fixed_quorum, nodes) if self._fixed_quorum else majority(nodes)

    def has_quorum(self) -> bool:
        return len(self.live()) >= self.quorum

    def is_root(self) -> bool:
        """Whether this node acts as root now: it won the current epoch and still sees a quorum."""
        return self.won is not None and self.won == self.view.epoch == self.promised \
            and self.view.root == self.me and self.has_quorum()

    def sitting(self) -> int | None:
        """The root of this node's view while that view's epoch is the newest this node promised: once it
        promised a higher one (it voted in a newer election, or etcd records one) that root is superseded,
        alive or not, so it neither comes first in the tree order nor holds off a candidate."""
        return self.view.root if self.view.epoch >= self.promised else None

    def order(self) -> list[int]:
        """The live nodes in tree order: the sitting root first while it is alive here, then by rank."""
        live = sorted(self.live())
        root = self.sitting()
        if root is not None and root in live and (root != self.me or self.is_root()):
            return [root] + [r for r in live if r != root]
        return live

    def candidate(self) -> bool:
        """Whether this node should campaign: it comes first in its tree order and is not the root."""
        return self.order()[0] == self.me and not self.is_root()

    # -- views ---------------------------------------------------------------------------------
    def adopt(self, view: View) -> bool:
        """Take a view sent by a root if it is newer and of an epoch this node did not promise away."""
        if view.epoch < self.promised or not view.newer_than(self.view):
            return False
        if view.epoch > self.promised:
            self._promise(view.epoch)
        self.view = view
        return True

    def note_epoch(self, epoch: int) -> None:
        """Another node follows ``epoch``: promise it, so this node is root of no older one."""
        if epoch > self.promised:
            self._promise(epoch)

    def bump(self, dead: frozenset[int]) -> View:
        """At the root: the next view of its epoch, with ``dead``."""
        self.view = View(self.view.epoch, self.view.seq + 1, self.me, dead)
        return self.view

    # -- campaigning ---------------------------------------------------------------------------
    def campaign_soon(self) -> None:
        """Start a campaign unless one runs (the caller checked :meth:`candidate`)."""
        if self._campaign is None or self._campaign.done():
            self._campaign = asyncio.ensure_future(self._run_campaign())

    async def _run_campaign(self) -> None:
        try:
            await self.campaign()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - recorded for status; the caller campaigns again later
            self.last_failure = f"{type(e).__name__}: {e}"
            log.warning("commit root election failed: %s", self.last_failure)

    async def _ask(self, others: list[int], body: dict) -> tuple[int, list[str]]:
        answers = await asyncio.gather(*(self.post(r, "/v1/vote", body) for r in others), return_exceptions=True)
        votes, refusals = 1, []
        for r, a in zip(others, answers):
            if isinstance(a, BaseException):
                refusals.append(f"node {r}: {a}")
                continue
            if a.get("granted") is True:
                votes += 1
            else:
                refusals.append(f"node {r}: {a.get('why', 'refused')}")
                # a refusal says the epoch the node promised: campaign above it next time, not for it again
                # (a candidate that only adopted views asked for an epoch promised to a failed candidate forever)
                epoch = a.get("epoch")
                if isinstance(epoch, int) and not isinstance(epoch, bool) and epoch > self.promised:
                    self.note_epoch(epoch)
            if "view" in a:  # a refusal names the sitting root: follow it instead of campaigning again
                try:
                    self.adopt(View.from_json(a["view"]))
                except ValueError:
                    pass
        return votes, refusals

    async def campaign(self) -> bool:
        """Ask every live node for its vote in the next epoch; True once this node won it.

        First without promising anything (would each node grant it?), so a candidate that cannot win, a
        node back from a partition for instance, disturbs nobody: the answers name the sitting root and
        its view, which this node then follows. Only with a quorum of such answers does it ask for the
        votes themselves."""
        live = self.live()
        if len(live) < self.quorum:
            self.last_failure = (f"this node sees {len(live)} of {self.nodes} nodes alive and a commit root needs "
                                 f"{self.quorum}: check the network between the nodes (ckpt status on each)")
            return False
        epoch = max(self.promised, self.view.epoch) + 1
        self.campaigns += 1
        dead = sorted(self.ranks() - live)
        others = sorted(live - {self.me})
        votes, refusals = await self._ask(others, {"epoch": epoch, "root": self.me, "dead": dead, "pre": True})
        if votes >= self.quorum and self.candidate() and epoch > self.promised:
            self._promise(epoch)  # its own vote
            votes, refusals = await self._ask(others, {"epoch": epoch, "root": self.me, "dead": dead})
            newer = await self.record(epoch, self.me) if self.record is not None and votes >= self.quorum \
                and self.promised == epoch else None
            if newer is not None:
                self.note_epoch(newer)
                self.last_failure = f"epoch {epoch} won, but etcd records epoch {newer} already: following it"
                log.info("%s", self.last_failure)
                return False
            if votes >= self.quorum and self.promised == epoch:
                self.won = epoch
                self.view = View(epoch, 0, self.me, frozenset(dead))
                self.last_failure = ""
                self.won_epochs = (self.won_epochs + [epoch])[-64:]
                log.info("this node is the commit root for epoch %d (%d of %d votes)", epoch, votes, self.nodes)
                if self.on_elected is not None:
                    self.on_elected()
                return True
        if not self.candidate():
            self.last_failure = ""
            return False
        self.last_failure = (f"not elected commit root for epoch {epoch}: {votes} of {self.nodes} votes, "
                             f"{self.quorum} needed ({'; '.join(refusals[:4]) or 'a newer epoch was seen'})")
        log.info("%s", self.last_failure)
        await asyncio.sleep(self.retry_after * (1 + random.random()))
        return False

    async def handle_vote(self, body: dict) -> dict:
        """``POST /v1/vote``: grant the candidate its epoch unless this node promised it away, or reaches a
        node that should come before the candidate. With ``pre``, only say whether it would."""
        epoch, cand = body.get("epoch"), body.get("root")
        for v in (epoch, cand):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError("a vote request is {epoch: int, root: int, dead: [int], pre: bool}")

        def refuse(why: str) -> dict:
            return {"granted": False, "epoch": self.promised, "view": self.view.to_json(), "why": why}

        if epoch <= self.promised:
            return refuse(f"epoch {epoch} is not newer than epoch {self.promised}, which node {self.me} knows")
        before = [r for r in sorted(self.live()) if r < cand]
        if self.me in before and self.has_quorum():
            return refuse(f"node {self.me} comes before node {cand} and sees a quorum itself")
        others = [r for r in before if r != self.me]
        root = self.sitting()
        if root is not None and root not in (cand, self.me) and root not in others and root in self.live():
            others.append(root)  # the sitting root: a candidate takes over only once it is gone
        reached = await asyncio.gather(*(self.probe(r) for r in others))
        alive = [r for r, ok in zip(others, reached) if ok]
        if alive:
            return refuse(f"node {self.me} still reaches node {alive[0]}, which comes before node {cand}")
        if epoch <= self.promised:  # promised meanwhile (while probing)
            return refuse(f"epoch {self.promised} came first")
        if not body.get("pre"):
            self._promise(epoch)
        return {"granted": True, "epoch": epoch}
