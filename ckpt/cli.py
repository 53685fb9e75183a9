"""``ckpt``: run the node agent; list, show, verify, restore and garbage-collect checkpoints.

``ckpt agent``, ``list``, ``show``, ``verify`` and ``gc`` never import torch.
Every command finds the tiers the same way: flags (``--shm``, ``--disk``,
``--s3``), then ``CKPT_*`` variables, then the TOML config; a running agent on
the memory folder fills in whatever was not given. Errors print one line that
says what is wrong and what to do, and exit non-zero.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import mmap
import os
import sys
import time
from typing import Any

from agents.config import Settings, SettingsError
from agents.protocol import AgentClient, AgentError, AgentUnreachableError
from recovery import (
    JobNotFoundError,
    StepNotFoundError,
    fetch_shards,
    plan_restore,
    scan_tiers,
)
from recovery.costs import node_costs
from recovery.fetch import ShardUnavailableError
from recovery import step_index
from recovery.inventory import StepInTier, TierInventory, stale_steps
from recovery.planner import complete_steps
from recovery.step_index import PlaceStep, index_disagreements, list_places, restorable_steps
from tiers import keys
from tiers.base import Tier
from tiers.checksum import checksum_bytes
from tiers.disk import DiskTier
from tiers.errors import InvalidNameError, KeyNotFoundError, ManifestError, TierError
from tiers.layout import Layout
from tiers.manifest import BYTES_DTYPE, DTYPE_SIZES, VALUES_NAME, JsonEntry, TensorChunk, decode_value, parse_spilled
from tiers.memory import MemoryTier
from tiers.peer import PeerDiskTier

__all__ = ["main"]

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_CORRUPT = 3
#: a shell's status for a process whose output pipe was closed (128 + SIGPIPE)
EXIT_PIPE = 141

#: the manifest's dtype name of a raw ``bytes`` value (1-D, stored like uint8)
RAW_BYTES = BYTES_DTYPE



class CliError(Exception):
    """An error to print as one line."""


def _tier_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("where checkpoints live (else CKPT_* variables, the TOML config, the running agent)")
    g.add_argument("--shm", help="host-memory folder of this node's memory tier")
    g.add_argument("--disk", help="local disk folder of the disk tier")
    g.add_argument("--s3", help="s3://bucket/prefix of the S3 tier")
    g.add_argument("--s3-endpoint", help="S3-compatible endpoint URL")
    g.add_argument("--config", help="TOML config file (default: $CKPT_CONFIG, ./tierckpt.toml)")
    g.add_argument("--socket", help="the node agent's Unix socket")


def _settings(a: argparse.Namespace, extra: dict | None = None) -> Settings:
    """The command's settings; ``a.agent_node`` becomes the node rank of the agent that answered, else None."""
    args = {"shm": a.shm, "disk": a.disk, "s3": a.s3, "s3_endpoint": a.s3_endpoint, "socket": a.socket}
    args.update(extra or {})
    s = Settings.load(args, config_file=a.config)
    if a.cmd == "agent":
        return s
    a.agent_node = None
    client = AgentClient.try_connect(s.socket_path, timeout=5)
    if client is not None:
        try:
            theirs = Settings.load(client.call("hello")["settings"], env={})
            a.agent_node = theirs.node_rank
            env_given = {f for f in ("disk", "s3", "s3_endpoint") if os.environ.get(f"CKPT_{f.upper()}")}
            for name in ("disk", "s3", "s3_endpoint", "compress", "peers", "secret_file", "node_rank", "tls_ca"):
                if args.get(name) is None and name not in env_given:
                    setattr(s, name, getattr(theirs, name))
        except (AgentError, AgentUnreachableError, KeyError):
            pass
        finally:
            client.close()
    return s


def _tiers(s: Settings, *, s3_deadline: float = 20.0) -> list[Tier]:
    from agents.tierset import disk_tier, memory_tier, peer_disk_tiers, peer_tiers, s3_tier

    out: list[Tier] = [memory_tier(s)] if os.path.isdir(s.shm) else []
    # the other nodes' memory, and their disks (each holds its own ranks' part of a step written to disk)
    out += peer_tiers(s) + peer_disk_tiers(s)
    if s.disk and not os.path.isdir(s.disk):
        raise CliError(f"disk folder {s.disk} does not exist: check --disk / CKPT_DISK")
    out += [t for t in (disk_tier(s), s3_tier(s, retry_deadline=s3_deadline, max_attempts=3)) if t is not None]
    if not out:
        raise CliError("no tier to look in: give --shm, --disk or --s3 (or start the node agent)")
    return out


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _fmt_age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.0f}h"
    return f"{seconds / 86400:.0f}d"


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _inventories(s: Settings, job: str):
    invs = scan_tiers(_tiers(s))
    _require_job(job, invs, any(inv.job(job) for inv in invs), lambda inv: inv.steps)
    return invs


def _require_job(job: str, places: list, found: bool, jobs_in) -> None:
    """Warn of each place that could not be listed; raise unless ``found`` (``jobs_in(place)``: the jobs a
    reachable place holds, named in the message)."""
    for p in places:
        if p.error is not None:
            print(f"ckpt: warning: the {p.name} tier could not be listed: {p.error}", file=sys.stderr)
    if not found:
        reachable = [p for p in places if p.error is None]
        if not reachable:
            raise CliError("no tier could be reached; see the warnings above")
        others = sorted({j for p in reachable for j in jobs_in(p)})
        known = f"jobs there: {', '.join(others[:10])}" if others else "no job is there"
        raise JobNotFoundError(
            f"no checkpoint of job {job!r} in {', '.join(p.tier.describe() for p in reachable)} ({known}): "
            "check the job name and --shm/--disk/--s3")


def _node_rank(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a node rank (0, 1, ...) nor 'auto'") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"a node rank is >= 0, got {v}")
    return v


# ---------------------------------------------------------------------- commands
def cmd_agent(a: argparse.Namespace) -> int:
    from agents.daemon import run_agent

    extra = {"disk_every": a.disk_every, "s3_every": a.s3_every, "keep_memory": a.keep_memory,
             "keep_disk": a.keep_disk, "keep_s3": a.keep_s3, "compress": True if a.compress else None,
             "disk_whole": True if a.disk_whole else None,
             "node_rank": None if a.node_rank == "auto" else a.node_rank, "peers": a.peers,
             "secret_file": a.secret_file, "replicas": a.replicas,
             "placement": a.placement, "peer_bandwidth": a.peer_bandwidth, "heartbeat": a.heartbeat,
             "dead_after": a.dead_after, "tls_cert": a.tls_cert, "tls_key": a.tls_key, "tls_ca": a.tls_ca,
             "prefetch": a.prefetch, "startup_grace": a.startup_grace, "quorum": a.quorum, "etcd": a.etcd,
             "cluster": a.cluster, "nodes": a.nodes, "advertise": a.advertise, "domain": a.domain,
             "etcd_lease": a.etcd_lease, "memory_only": True if a.memory_only else None,
             "memory_limit": a.memory_limit}
    s = _settings(a, extra)
    auto_rank = a.node_rank == "auto" and bool(s.etcd)  # claimed in etcd once it is reached (run_agent)
    if a.node_rank == "auto" and not s.etcd:
        from agents.replication import find_own_rank, load_peer_list

        if not s.peers:
            raise SettingsError("--node-rank auto finds this machine's line in the peers file (give --peers), or "
                                "claims a free rank in etcd (give --etcd)")
        s.node_rank = find_own_rank(load_peer_list(s.peers))
        s.validate()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from agents.peer_server import PeerServerError

    try:
        return run_agent(s, auto_rank=auto_rank)
    except PeerServerError as e:  # the settings ask for a peer server that may not run (no secret off loopback)
        raise SettingsError(str(e)) from e


def cmd_status(a: argparse.Namespace) -> int:
    s = Settings.load({"shm": a.shm, "socket": a.socket}, config_file=a.config)
    client = AgentClient.try_connect(s.socket_path, timeout=10)
    if client is None:
        raise CliError(f"no agent answers on {s.socket_path.replace(chr(0), '@')}: is `ckpt agent` running "
                       "with this --shm?")
    with client:
        st = client.call("status")
    if a.json:
        print(json.dumps(st, indent=2, sort_keys=True))
        return 0
    cfg = st["settings"]
    print(f"agent pid {st['pid']}  node {st['node']}  memory {cfg['shm']}  disk {cfg['disk']}  s3 {cfg['s3']}")
    print(f"saves {st['stats']['saves']}  in {_fmt_bytes(st['stats']['bytes_in'])}  "
          f"replicated {_fmt_bytes(st['stats']['replicated_bytes'])}  in flight {_fmt_bytes(st['inflight_bytes'])}  "
          f"queued {st['queued']}  pending {len(st['pending'])}  errors {st['errors'] or 'none'}")
    pf = st.get("prefetch") or {}
    if pf.get("state") not in (None, "idle"):
        pulled = ", ".join(f"{j} step {n}" for j, n in sorted(pf.get("steps", {}).items())) or "nothing"
        print(f"warm restore {pf['state']}: {pulled} ({pf.get('shards', 0)} shards, "
              f"{_fmt_bytes(pf.get('bytes', 0))}, {pf.get('seconds', 0):.2f}s)"
              + (f"  errors: {'; '.join(pf['errors'])}" if pf.get("errors") else ""))
    if st["peers"]:
        rows = [["node", "address", "domain", "alive", "last seen", "bytes held", "debt", "copies to", "errors"]]
        for p in st["peers"]:
            seen = "never" if p["last_seen_s"] is None else f"{p['last_seen_s']:.1f}s ago"
            rows.append([str(p["node"]), p["addr"], p["domain"] or "-", "yes" if p["alive"] else "DEAD", seen,
                         _fmt_bytes(p["bytes_held"]), _fmt_bytes(p["debt_bytes"]),
                         "yes" if p["replicates_to"] else "-", str(p["errors"])])
        print(_table(rows))
    tree = st.get("tree")
    if tree:
        root = tree.get("root")
        print(f"commit root: {'this node' if tree.get('is_root') else ('none' if root is None else f'node {root}')}"
              f"  epoch {tree.get('epoch')}  quorum {tree.get('quorum')} of {tree.get('nodes')}"
              f"  live {len(tree.get('live', []))}")
        if tree.get("blocked"):
            print(f"CANNOT COMMIT: {tree['blocked']}")
        if tree.get("peers_file_differs"):
            print(f"PEERS FILE DIFFERS on node(s) {', '.join(map(str, tree['peers_file_differs']))}: every node needs "
                  "the same peers file, in the same order")
    return 0


LIST_HELP = """\
Each tier's column says what that place holds of the step. The manifest is
written last in every place, so a place holding it has committed the step.
  complete        the manifest and all `world` shards: this place alone restores the step
  node N          the manifest and every shard node N's agent took (N may be a list): a node's
                  memory or disk holding its own ranks (and the nodes it keeps copies for);
                  the other ranks' shards are in their nodes' places and in S3
  manifest only   committed, no shard here (a node that took none of the step's ranks)
  missing shards  committed, but shards it should hold are gone: in S3 any of the `world`;
                  in a node's place some of a node's whose other shards are here, or (when
                  the node's agent answers) some of the node's own
  partial         shards without a manifest: not committed here (in flight, or cut short)
  bad manifest    a manifest that could not be read or parsed
  -               nothing of the step;   ?  the tier could not be listed
restorable: every shard is held, at its size, by a tier shown that committed the same manifest as
the first tier holding the step. The newest such step has its manifests read and their checksums
checked (a damaged one shows as `bad manifest`, and the next newest is checked); older steps are
taken from the index.

Each tier's step index (one object per job and place, kept by whoever commits or deletes a step
there) is read instead of every manifest; a tier whose index is absent, damaged or unreadable is
scanned instead, and the command says so. The index lists committed steps only (no `partial` rows),
as they were when committed; `--scan` reads every manifest and looks at every shard, as `ckpt
verify` does (which also reports where an index disagrees; `ckpt gc JOB` rewrites it).
"""


def _node_of(a: argparse.Namespace, inv: TierInventory) -> int | None:
    """The node a memory or disk tier belongs to, or None when unknown (no agent answered) or another kind of tier.

    The memory and disk folders a command uses are taken to be those of the
    node whose agent answered on the memory folder's socket.
    """
    return getattr(a, "agent_node", None) if isinstance(inv.tier, (MemoryTier, DiskTier)) else None


def _place_state(shared: bool, st: PlaceStep, node: int | None) -> str:
    """One cell of ``ckpt list``: see LIST_HELP. ``node``: the node the place belongs to, if known."""
    row = st.row
    if row is None:
        return "bad manifest" if st.committed else "partial"
    if row.complete:
        return "complete"
    if row.missing_ranks(shared, node):
        return "missing shards"
    if not row.held | row.stray:
        return "manifest only"
    return "node " + ",".join(str(n) for n in sorted(row.nodes_complete))


def cmd_list(a: argparse.Namespace) -> int:
    job = keys.check_job(a.job)
    s = _settings(a)
    places = list_places(_tiers(s), job, scan=a.scan)
    _require_job(job, places, any(p.steps for p in places), lambda p: ())
    for p in places:
        if p.error is None and p.note:
            print(f"ckpt: the {p.name} tier ({p.tier.describe()}): {p.note}; read every manifest there instead",
                  file=sys.stderr)
    steps = sorted({st for p in places for st in p.steps}, reverse=True)
    now = time.time()
    rows = [["step"] + [p.name for p in places] + ["size", "age", "restorable"]]
    # the newest restorable step's manifests are read and checked: an index row says a manifest was
    # committed, not that its bytes are whole; a damaged one shows as such and the next newest is checked
    restorable = restorable_steps(places, check_newest=True)
    for step in steps:
        row = [str(step)]
        size, created = 0, 0.0
        for p in places:
            st = p.steps.get(step)
            if p.error is not None:
                row.append("?")
            elif st is None:
                row.append("-")
            else:
                row.append(_place_state(p.shared, st, _node_of(a, p)))
                if st.row is not None:
                    size = size or st.row.bytes
                    created = created or st.row.created
        row += [_fmt_bytes(size) if size else "?", _fmt_age(now - created) if created else "?",
                "yes" if step in restorable else "no"]
        rows.append(row)
    print(_table(rows))
    return 0


def cmd_show(a: argparse.Namespace) -> int:
    job = keys.check_job(a.job)
    s = _settings(a)
    invs = _inventories(s, job)
    plan = plan_restore(invs, job, a.step, costs=node_costs(s.shm, invs)[0])
    m = plan.manifest
    print(f"job {job}  step {m.step}  world {m.world}  {_fmt_bytes(m.total_bytes)}  "
          f"saved {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(m.created))}  by {m.library} v{m.version}")
    if m.metadata:
        print("metadata:", json.dumps(m.metadata, sort_keys=True))
    rows = [["rank", "size", "checksum", "tiers (cheapest first)"]]
    for sh in m.shards:
        rows.append([str(sh.rank), _fmt_bytes(sh.size), sh.checksum, ", ".join(t.name for t in plan.sources[sh.rank])])
    print(_table(rows))
    print()
    rows = [["name", "dtype", "global shape", "rank: offsets"]]
    tensors: dict[str, list] = {}
    values: dict[str, dict[int, Any]] = {}  # name -> rank -> value
    spilled: list[int] = []  # ranks whose JSON values are in their shard, not the manifest
    for sh in m.shards:
        for e in plan.entries(sh.rank):
            if isinstance(e, TensorChunk) and e.name == VALUES_NAME:
                spilled.append(sh.rank)
            elif isinstance(e, TensorChunk):
                tensors.setdefault(e.name, []).append((sh.rank, e))
            else:
                values.setdefault(e.name, {})[sh.rank] = decode_value(e.value)
    for name, chunks in tensors.items():
        e0 = chunks[0][1]
        where = " ".join(f"{r}:{list(e.offsets)}" for r, e in chunks[:4]) + (" …" if len(chunks) > 4 else "")
        rows.append([name, e0.dtype, str(list(e0.global_shape)), where])
    print(_table(rows))
    if values:
        print()
        for line in _value_lines(values, m.world):
            print(line)
    if spilled:
        print(f"\nthe JSON values of {_ranks(spilled)} are too many for the manifest and are kept in the shard "
              f"(`ckpt restore {job} --step {m.step} --format torch` exports them)")
    return 0


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"{len(ranks)} ranks ({', '.join(map(str, ranks[:6]))}" \
        + (" …)" if len(ranks) > 6 else ")")


def _value_lines(values: dict[str, dict[int, Any]], world: int) -> list[str]:
    """``ckpt show``'s JSON values: ``name = v`` when every rank holds the same value, else one line per
    distinct value naming the ranks that hold it (``name [rank 1,3] = v``)."""
    lines = []
    for name, by_rank in values.items():
        groups: dict[str, list[int]] = {}
        for rank, v in sorted(by_rank.items()):
            groups.setdefault(json.dumps(v, sort_keys=True), []).append(rank)
        if len(groups) == 1 and len(by_rank) == world:
            lines.append(f"{name} = {next(iter(groups))}")
            continue
        for text, ranks in groups.items():
            lines.append(f"{name} [rank {_ranges(ranks)}] = {text}")
    return lines


def _ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2,5``."""
    out, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ",".join(out)


def _layout_problems(inv: TierInventory, job: str, m: Any, ranks: set[int],
                     seen: dict[tuple[str, str], Layout | str]) -> list[tuple[int, str]]:
    """``(rank, what is wrong)`` for each of ``ranks`` whose layout (named by ``m``) is missing, damaged or
    past its shard in ``inv``'s tier; each layout object is read once per tier (``seen`` keeps the answers)."""
    out = []
    for sh in m.shards:
        if sh.rank not in ranks or not sh.layout:
            continue
        key = (inv.name, sh.layout)
        if key not in seen:
            try:
                seen[key] = Layout.from_bytes(inv.tier.get(keys.layout_key(job, sh.layout)), sh.layout)
            except KeyNotFoundError:
                seen[key] = f"layout {sh.layout} missing"
            except (ManifestError, TierError, OSError) as e:
                seen[key] = f"layout {sh.layout} DAMAGED: {e}"
        got = seen[key]
        if isinstance(got, str):
            out.append((sh.rank, got))
            continue
        try:
            got.check_fits(sh.size, f"rank {sh.rank}")
        except ManifestError as e:
            out.append((sh.rank, f"layout {sh.layout}: {e}"))
    return out


def cmd_verify(a: argparse.Namespace) -> int:
    job = keys.check_job(a.job)
    s = _settings(a)
    invs = _inventories(s, job)
    steps = [a.step] if a.step is not None else sorted({st for inv in invs for st in inv.job(job)})
    if a.step is not None and not any(a.step in inv.job(job) for inv in invs):
        raise StepNotFoundError(f"step {a.step} of job {job!r} is in no tier; `ckpt list {job}` shows the steps")
    rows = [["step", "tier", "rank", "result"]]
    bad = 0
    layouts_seen: dict[tuple[str, str], Layout | str] = {}
    for step in steps:
        for inv in invs:
            st = inv.job(job).get(step)
            if st is None:
                continue
            if st.manifest is None:
                rows.append([str(step), inv.name, "-", st.problem or "no manifest (not committed here)"])
                bad += bool(st.problem)
                continue
            expected = set(st.expected_ranks(inv.shared, _node_of(a, inv)))
            for rank, problem in _layout_problems(inv, job, st.manifest, expected, layouts_seen):
                rows.append([str(step), inv.name, str(rank), problem])
                bad += 1
            elsewhere = [sh for sh in st.manifest.shards if sh.rank not in expected]
            if elsewhere:
                nodes = ", ".join(str(n) for n in sorted({sh.node for sh in elsewhere}))
                rows.append([str(step), inv.name, "-", f"{len(elsewhere)} shard(s) of node(s) {nodes} not held here: "
                                                       "that node's own places hold them"])
            for sh in st.manifest.shards:
                if sh.rank not in expected:
                    continue
                key = keys.shard_key(job, step, sh.rank)
                if st.shards.get(sh.rank) is None:
                    rows.append([str(step), inv.name, str(sh.rank), "missing"])
                    bad += 1
                    continue
                try:
                    data = inv.tier.get(key)
                    ok = len(data) == sh.size and checksum_bytes(data) == sh.checksum
                    rows.append([str(step), inv.name, str(sh.rank), "ok" if ok else "CORRUPT (checksum mismatch)"])
                    bad += not ok
                except (TierError, OSError) as e:
                    rows.append([str(step), inv.name, str(sh.rank), f"unreadable: {e}"])
                    bad += 1
            for rank in sorted(st.heads):  # a peer's copy of a shard's unique part (its replicas hold the rest)
                sh = st.manifest.shard(rank) if rank < st.manifest.world else None
                if sh is None or sh.unique is None:
                    rows.append([str(step), inv.name, f"{rank} (head)", "not in the manifest: stray"])
                    bad += 1
                    continue
                try:
                    data = inv.tier.get(keys.head_key(job, step, rank))
                    ok = len(data) == sh.unique[0] and checksum_bytes(data) == sh.unique[1]
                    rows.append([str(step), inv.name, f"{rank} (head)", "ok" if ok else "CORRUPT (checksum mismatch)"])
                    bad += not ok
                except (TierError, OSError) as e:
                    rows.append([str(step), inv.name, f"{rank} (head)", f"unreadable: {e}"])
                    bad += 1
    stale = 0
    for inv in invs:
        if inv.error is not None:
            continue
        problem, diffs = index_disagreements(inv.tier, job, inv.job(job))
        if problem and problem != "no step index":
            rows.append(["-", inv.name, "-", problem])
            stale += 1
        for step, why in sorted(diffs.items()):
            if a.step is None or step == a.step:
                rows.append([str(step), inv.name, "-", f"step index: {why}"])
                stale += 1
    print(_table(rows))
    if stale:
        print(f"ckpt: the step index disagrees with the objects {stale} time(s): `ckpt list` shows what the index "
              f"says (restores never read it); `ckpt gc {job}` rewrites it", file=sys.stderr)
    if bad:
        print(f"ckpt: {bad} problem(s) found; a restore will read another tier where one is intact", file=sys.stderr)
        return EXIT_CORRUPT
    return 0


GC_HELP = """\
Without --step/--all: in each tier shown, remove the steps that will never be
committed there: no manifest in that place, older than the newest step whose
manifest is there, and not restorable from the tiers shown. A step whose
manifest is in a place is never removed from it this way (in a node's memory or
disk the manifest commits the node's own shards; the other nodes' are in their
places), nor a step newer than the newest committed one (it may be in flight).

--step N / --all remove those steps from every tier shown, but refuse, deleting
nothing, when that would remove the last restorable copy the tiers shown hold,
or when a tier could not be listed; --force removes them anyway. Tiers of other
nodes that this command does not show may hold the only copy of their shards.

Every run also removes the job's free staging slots from this node's memory
folder (a slot no committed shard links to; a running trainer leases new ones).

It says what it frees, per tier: the steps removed and their bytes, then the
total; --dry-run says the same of what it would free, and removes nothing. In
the memory tier a committed shard is a second name of the staging slot it was
copied into, so its memory comes back only when the slot goes too: the memory
tier's figure counts the files that left memory (shards, manifests, layouts and
slots), once each.
"""


def _restorable_without(invs: list[TierInventory], job: str, doomed: set[tuple[int, int]]) -> set[int]:
    """Steps still restorable from ``invs`` once each ``(index into invs, step)`` in ``doomed`` is gone."""
    views = []
    for i, inv in enumerate(invs):
        v = TierInventory(inv.tier, error=inv.error)
        v.steps[job] = {s: st for s, st in inv.job(job).items() if (i, s) not in doomed}
        views.append(v)
    return set(complete_steps(views, job, replicas=True))


def _remove(tier: Tier, job: str, step: int, st: StepInTier, stale: bool) -> int | None:
    """Remove one step from one tier, manifest first; bytes freed, or None when a stale step got committed meanwhile."""
    mkey = keys.manifest_key(job, step)
    freed = sum(n for n in [*st.shards.values(), *st.heads.values()] if n > 0)
    if stale:
        try:
            tier.stat(mkey)
            return None  # its manifest arrived after the scan: committed here now, so kept
        except KeyNotFoundError:
            pass
    else:
        try:
            freed += tier.stat(mkey).size
        except KeyNotFoundError:
            pass
        step_index.note_delete(tier, job, step)
        tier.delete(mkey)
        step_index.note_delete(tier, job, step)
    for k in tier.list(keys.step_prefix(job, step)):
        if not (stale and k == mkey):
            tier.delete(k)
    return freed


def cmd_gc(a: argparse.Namespace) -> int:
    job = keys.check_job(a.job)
    s = _settings(a)
    invs = _inventories(s, job)
    explicit = a.all or a.step is not None
    # a step whose ranks can be restored from the job's own replicas counts as restorable: never removed as if not
    restorable = set(complete_steps(invs, job, replicas=True))
    doomed: set[tuple[int, int]] = set()
    for i, inv in enumerate(invs):
        if inv.error is not None or isinstance(inv.tier, PeerDiskTier):
            continue  # another node's disk is trimmed by that node's agent, or by `ckpt gc` on that node
        if explicit:
            doomed |= {(i, st) for st in inv.job(job) if a.all or st == a.step}
        else:
            doomed |= {(i, st) for st in stale_steps(inv.job(job)) if st not in restorable}
    lost = sorted(restorable - _restorable_without(invs, job, doomed))
    if lost and not a.force:
        shown = ", ".join(inv.tier.describe() for inv in invs if inv.error is None)
        raise CliError(f"not removing anything: step(s) {', '.join(map(str, lost))} would lose their last restorable "
                       f"copy among the tiers shown ({shown}); pass --force to remove them anyway")
    down = [inv.name for inv in invs if inv.error is not None]
    if explicit and doomed and down and not a.force:
        raise CliError(f"not removing anything: the {', '.join(down)} tier(s) could not be listed, so whether another "
                       "copy is left cannot be told; retry when they answer, or pass --force")
    dry = a.dry_run
    total_bytes = total_steps = 0
    for i, inv in enumerate(invs):
        if inv.error is not None:
            print(f"nothing freed in {inv.name} ({inv.tier.describe()}): it could not be listed")
            continue
        if isinstance(inv.tier, PeerDiskTier):
            if explicit:
                print(f"nothing freed in {inv.name} ({inv.tier.describe()}): another node's disk is trimmed by "
                      "that node's agent (run `ckpt gc` on that node)")
            continue
        freed, removed, extra = _gc_place(inv, job, sorted(st for j, st in doomed if j == i), explicit=explicit,
                                          everything=a.all, dry=dry)
        where = f"{inv.name} ({inv.tier.describe()})"
        if removed or extra:
            print(f"{'would free' if dry else 'freed'} {_fmt_bytes(freed)} in {where}: {removed} step(s){extra}")
        else:
            print(f"nothing to free in {where}")
        total_bytes += freed
        total_steps += removed
    if not doomed:
        print("no step to remove" + ("" if explicit else
                                    ": every step is committed, restorable, or newer than the newest committed"))
    print(f"{'would free' if dry else 'freed'} {_fmt_bytes(total_bytes)} in all: {total_steps} step(s) from "
          f"{sum(inv.error is None for inv in invs)} tier(s)" + (" (dry run: nothing was removed)" if dry else ""))
    return 0


def _gc_place(inv: TierInventory, job: str, steps: list[int], *, explicit: bool, everything: bool,
              dry: bool) -> tuple[int, int, str]:
    """Remove ``steps`` of ``job`` from one place (with ``dry``: only say what would go); ``(bytes freed, steps
    removed, what else went: ", N layout object(s), M staging slot(s)")``.

    The memory tier's bytes are what leaves memory: a committed shard is a second name of its staging slot, so
    files are counted by inode, once, when their last name goes.
    """
    tier = inv.tier
    memory = isinstance(tier, MemoryTier)
    held = _memory_files(tier, job) if memory else None
    freed = removed = 0
    gone: set[int] = set()
    names: list[str] = []  # the memory folder's files a dry run would remove
    for step in steps:
        st = inv.job(job)[step]
        if dry:
            got = sum(n for n in st.shards.values() if n > 0) + _size(tier, keys.manifest_key(job, step))
            if memory:
                names += [tier.path(k) for k in tier.list(keys.step_prefix(job, step))]
        else:
            got = _remove(tier, job, step, st, stale=not explicit)
        if got is None:
            print(f"kept step {step} in {inv.name}: it was committed there meanwhile")
            continue
        print(f"{'would remove' if dry else 'removed'} step {step} from {inv.name} ({_fmt_bytes(got)})")
        freed += got
        removed += 1
        gone.add(step)
    emptied = everything and removed == len(inv.job(job))
    if not emptied and not dry:
        # the index of this place, made to say what the scan found less what was just removed
        step_index.rebuild(tier, job, {s: st for s, st in inv.job(job).items() if s not in gone})
    extra = ""
    if emptied:
        # every step is gone from this tier: the layouts they named go with them
        layouts = tier.list(keys.layouts_prefix(job))
        for k in layouts:
            freed += _size(tier, k)
            if dry and memory:
                names.append(tier.path(k))
            elif not dry:
                tier.delete(k)
        if step_index.keeps_index(tier):
            if dry and memory:
                names.append(tier.path(keys.index_key(job)))
            elif not dry:
                tier.delete(keys.index_key(job))
        if layouts:
            extra += f", {len(layouts)} layout object(s)"
    if held is not None:
        slots = _slot_paths(tier, job)
        if dry:
            freed, dropped = _memory_freed_by(names, slots)
        else:
            tier.drop_slots(job)
            after = _memory_files(tier, job)
            freed = sum(n for ino, n in held.items() if ino not in after)
            dropped = len(slots) - len(_slot_paths(tier, job))
        if dropped:
            extra += f", {dropped} staging slot(s)"
    return freed, removed, extra


def _size(tier: Tier, key: str) -> int:
    try:
        return tier.stat(key).size
    except KeyNotFoundError:
        return 0


def _memory_freed_by(names: list[str], slots: list[str]) -> tuple[int, int]:
    """``(bytes, slots dropped)`` that removing the files ``names`` and then every free slot of ``slots`` would
    free: an inode's bytes count once all its names go; a slot is free once no other name links to it."""
    stats: dict[str, os.stat_result] = {}
    for n in (*names, *slots):
        with contextlib.suppress(OSError):
            stats[n] = os.lstat(n)
    gone: dict[tuple[int, int], int] = {}
    for n in names:
        if n in stats:
            ino = (stats[n].st_dev, stats[n].st_ino)
            gone[ino] = gone.get(ino, 0) + 1
    dropped = 0
    for n in slots:
        st = stats.get(n)
        if st is not None and st.st_nlink - gone.get((st.st_dev, st.st_ino), 0) == 1:
            gone[(st.st_dev, st.st_ino)] = st.st_nlink
            dropped += 1
    sizes = {(st.st_dev, st.st_ino): (st.st_size, st.st_nlink) for st in stats.values()}
    return sum(size for ino, (size, nlink) in sizes.items() if gone.get(ino, 0) >= nlink), dropped


def _memory_files(tier: MemoryTier, job: str) -> dict[tuple[int, int], int]:
    """``(device, inode) -> bytes`` of every file of ``job`` in a memory folder: its objects and its staging
    slots (a committed shard is a second name of its slot's file, so memory is counted once per inode)."""
    out: dict[tuple[int, int], int] = {}
    for top in (os.path.join(tier.root, job), os.path.join(tier.root, ".slots", job)):
        for folder, _, files in os.walk(top):
            for f in files:
                with contextlib.suppress(OSError):
                    st = os.lstat(os.path.join(folder, f))
                    out[(st.st_dev, st.st_ino)] = st.st_size
    return out


def _slot_paths(tier: MemoryTier, job: str) -> list[str]:
    """Every staging slot file of ``job`` in a memory folder."""
    base = os.path.join(tier.root, ".slots", job)
    try:
        ranks = [d for d in os.listdir(base) if d.startswith("rank-") and d.removeprefix("rank-").isdigit()]
    except OSError:
        return []
    return [p for d in ranks for p in tier.slots(job, int(d.removeprefix("rank-")))]


def _parse_size(text: str) -> int:
    """Bytes from ``1073741824``, ``512MiB``, ``512M``, ``4GiB``, ``4G`` (binary units)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(t[-1:], 1)
    try:
        n = int(float(t[:-1] if mult > 1 else t) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (bytes, or a number with KiB, MiB, GiB)") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"not a positive size: {text!r}")
    return n


def _anon_buffer(n: int) -> memoryview:
    # anonymous memory: no zero-fill pass, and unmapped as soon as the last view goes
    return memoryview(mmap.mmap(-1, n) if n else bytearray(0))


RESTORE_HELP = """\
Fetch a step from the fastest tiers that hold it, assemble every rank's chunks into
whole tensors, and write them where a loader reads them:

  dcp          a folder that torch.distributed.checkpoint.load reads (and torchtitan's
               --checkpoint.initial_load_path, with model-only keys: --only model)
  torch        OUT/checkpoint.pt, which torch.load(path, weights_only=True) reads
  safetensors  OUT/model.safetensors (safetensors.torch.load_file; transformers'
               from_pretrained(OUT) once OUT also holds the model's config.json).
               safetensors holds tensors only: JSON values go into the file's metadata
               as one JSON object under "tierckpt.values"; bytes values are left out.
               The command says which.

Keys: each entry's path joined with '.', as DCP and transformers name parameters
(a state {"model": model, "optim": optim} gives model.layers.0.weight, optim.state...).
  --only model           keeps model.* and takes "model." off (layers.0.weight)
  --strip-prefix PREFIX  takes PREFIX off every key that has it and keeps the rest
The dcp and torch formats keep the nesting of the state (dicts; lists as saved);
bytes values are written as Python bytes.
"""


def cmd_restore(a: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from ckpt._export import ExportError, check_dtypes, dotted, lay_out, write_export
    from ckpt._tensors import dtype_of

    def _dtype(name: str) -> torch.dtype:
        # a raw bytes value is stored as uint8 and handed over as ``bytes`` below
        return torch.uint8 if name == RAW_BYTES else dtype_of(name)

    job = keys.check_job(a.job)
    s = _settings(a)
    invs = _inventories(s, job)
    costs, costs_path = node_costs(s.shm, invs)
    plan = plan_restore(invs, job, a.step, costs=costs)
    m = plan.manifest
    try:  # a key layout that matches nothing, or a dtype the format cannot hold, is refused before any fetch
        laid = lay_out({e.name: e for sh in m.shards for e in plan.entries(sh.rank) if e.name != VALUES_NAME},
                       only=a.only, strip_prefix=a.strip_prefix)
        check_dtypes({dotted(p): _dtype(e.dtype) for p, e in laid.items()
                      if isinstance(e, TensorChunk) and e.dtype != RAW_BYTES}, a.format)
    except ExportError as e:
        raise CliError(str(e)) from None
    out: dict[str, Any] = {}
    differ: set[str] = set()
    per_rank: dict[int, dict[str, Any]] = {}  # values (JSON and bytes) of each rank: the lowest rank's win
    for sh in m.shards:
        for e in sh.entries:
            if isinstance(e, JsonEntry):
                per_rank.setdefault(sh.rank, {})[e.name] = decode_value(e.value)
    with tqdm(total=m.total_bytes, unit="B", unit_scale=True, desc=f"step {m.step}",
              disable=not sys.stderr.isatty() and not a.progress) as bar:

        def on_shard(rank: int, view: memoryview, rep: Any) -> None:
            sh = m.shard(rank)
            buf = torch.frombuffer(view, dtype=torch.uint8) if sh.size else torch.empty(0, dtype=torch.uint8)
            for e in plan.entries(rank):
                if isinstance(e, JsonEntry):
                    continue
                if e.dtype == BYTES_DTYPE:  # a bytes value, or the rank's JSON values kept in its shard
                    raw = bytes(view[e.offset: e.offset + e.nbytes])
                    if e.name == VALUES_NAME:
                        try:
                            spilled = parse_spilled(raw, f"values of rank {rank}")
                        except ManifestError as err:
                            raise CliError(str(err)) from None
                        per_rank.setdefault(rank, {}).update((v.name, decode_value(v.value)) for v in spilled)
                    else:
                        per_rank.setdefault(rank, {})[e.name] = raw
                    continue
                full = out.get(e.name)
                if full is None:
                    try:
                        full = out[e.name] = torch.empty(e.global_shape, dtype=_dtype(e.dtype))
                    except (RuntimeError, MemoryError) as err:  # the whole tensor is assembled in host memory
                        need = math.prod(e.global_shape) * DTYPE_SIZES[e.dtype]
                        raise CliError(f"{e.name} ({e.dtype} {list(e.global_shape)}) needs {_fmt_bytes(need)} of "
                                       f"host memory, which this machine cannot give ({str(err).splitlines()[0]}): "
                                       "restore on a machine with more memory") from None
                src = buf[e.offset: e.offset + e.nbytes].view(_dtype(e.dtype)).view(e.shape)
                idx = tuple(slice(o, o + n) for o, n in zip(e.offsets, e.shape))
                full[idx].copy_(src)
            bar.update(sh.size)
            bar.set_postfix_str(f"rank {rank} from {rep.source}")

        try:
            sources = fetch_shards(plan, [sh.rank for sh in m.shards], _anon_buffer, on_shard,
                                   max_bytes=a.max_memory, costs=costs)
        finally:
            if costs_path:
                try:
                    costs.save(costs_path)
                except OSError as e:
                    print(f"ckpt: warning: could not save the learned restore costs to {costs_path}: {e}",
                          file=sys.stderr)
    for rank in sorted(per_rank):
        for name, v in per_rank[rank].items():
            if name not in out:
                out[name] = v
            elif out[name] != v:
                differ.add(name)
    try:
        written = write_export(lay_out(out, only=a.only, strip_prefix=a.strip_prefix), a.format, a.to)
    except ExportError as e:
        raise CliError(str(e)) from None
    path = written.path
    # "estimated" is what the cost model expected of the first place it planned for the shard
    rows = [["rank", "tier", "source", "size", "seconds", "estimated", "GB/s"]]
    for r in sources:
        est = plan.estimates.get(r.rank)
        rows.append([str(r.rank), r.tier, r.source, _fmt_bytes(r.nbytes), f"{r.seconds:.3f}",
                     "-" if est is None else f"{est:.3g}", f"{r.gbps:.2f}"])
    print(_table(rows))
    print(f"restored {job} step {m.step} ({_fmt_bytes(m.total_bytes)}) to {path} as {a.format}")
    for note in written.notes:
        print(f"{a.format}: {note}")
    if differ:
        names = sorted(differ)
        print(f"{len(names)} value(s) differ between ranks; the lowest rank's was written (`ckpt show {job} --step "
              f"{m.step}` lists each rank's): {', '.join(names[:8])}" + (" …" if len(names) > 8 else ""))
    return 0


def cmd_demo(a: argparse.Namespace) -> int:
    from ._demo import run

    return run(a)


# ---------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ckpt", description="tiered checkpoints for PyTorch training")
    sub = p.add_subparsers(dest="cmd", required=True)

    ag = sub.add_parser("agent", help="run this node's checkpoint agent (foreground)")
    _tier_flags(ag)
    ag.add_argument("--node-rank", type=_node_rank,
                    help="this node's line in the peers file, from 0; 'auto': the line whose address is this "
                         "machine's, or with --etcd the rank this machine had before, else the lowest free one "
                         "(a DaemonSet or an sbatch script starts the same command on every node)")
    ag.add_argument("--disk-every", type=int, help="write every Nth save to disk")
    ag.add_argument("--s3-every", type=int, help="write every Nth save to S3")
    ag.add_argument("--keep-memory", type=int)
    ag.add_argument("--keep-disk", type=int)
    ag.add_argument("--keep-s3", type=int)
    ag.add_argument("--compress", action="store_true", help="LZ4-compress shards on disk")
    ag.add_argument("--disk-whole", action="store_true",
                    help="keep each rank's whole shard on disk, replicated chunks included (a disk restore then "
                         "reads no other node's disk); default: each chunk once across the job's disks")
    ag.add_argument("--peers", help="file listing every node's agent (host:port [domain=LABEL]), or a comma list")
    ag.add_argument("--secret-file", help="per-job secret that signs peer requests (required with --peers, "
                                          "loopback included; mode 0600, the same file on every node)")
    ag.add_argument("--replicas", type=int, help="copies of each shard in host memory, own included (default 2)")
    ag.add_argument("--placement", choices=("group", "ring"))
    ag.add_argument("--peer-bandwidth", type=int, help="cap on replication traffic, bytes/s")
    ag.add_argument("--heartbeat", type=float, help="seconds between heartbeats")
    ag.add_argument("--dead-after", type=float, help="seconds of silence before a peer is declared dead")
    ag.add_argument("--etcd", help="etcd endpoints (http://host:2379, comma-separated): membership from etcd "
                                   "instead of a peers file; with --nodes, --advertise and --node-rank")
    ag.add_argument("--cluster", help="the cluster's name in etcd (default 'default')")
    ag.add_argument("--nodes", type=int, help="how many nodes the cluster has (with --etcd)")
    ag.add_argument("--advertise", help="host:port the other nodes reach this agent at (with --etcd)")
    ag.add_argument("--domain", help="this node's failure domain, a rack (with --etcd)")
    ag.add_argument("--memory-only", action="store_true", default=None,
                    help="this node trains nothing: it offers its host memory as replica targets (its peers-file "
                         "line ends in role=memory)")
    ag.add_argument("--memory-limit", type=int, help="most bytes of replicas this node takes from its peers")
    ag.add_argument("--etcd-lease", type=float,
                    help="seconds this node's etcd lease lives without a keep-alive (default: --dead-after)")
    ag.add_argument("--startup-grace", type=float,
                    help="seconds a peer that has not answered yet has before it is declared dead (default 120)")
    ag.add_argument("--quorum", type=int, help="votes that elect the commit root (default: a majority of the peers)")
    ag.add_argument("--no-prefetch", dest="prefetch", action="store_false", default=None,
                    help="at start, do not pull this node's shards of the newest steps from its peers")
    ag.add_argument("--tls-cert")
    ag.add_argument("--tls-key")
    ag.add_argument("--tls-ca")
    ag.set_defaults(fn=cmd_agent)

    st = sub.add_parser("status", help="the node agent: queues, errors, and each peer (alive, last seen, bytes)")
    _tier_flags(st)
    st.add_argument("--json", action="store_true")
    st.set_defaults(fn=cmd_status)

    for name, fn, hlp, desc in (
            ("list", cmd_list, "steps x tiers: what each place holds, size, age, restorable", LIST_HELP),
            ("show", cmd_show, "one step: shards, tensors, where each is", None),
            ("verify", cmd_verify, "check every checksum a place should hold, in every tier", None),
            ("gc", cmd_gc, "remove steps that will never be committed (or --step N / --all) and free slots",
             GC_HELP)):
        sp = sub.add_parser(name, help=hlp, description=desc, formatter_class=argparse.RawDescriptionHelpFormatter)
        sp.add_argument("job")
        if name != "list":
            sp.add_argument("--step", type=int)
        else:
            sp.add_argument("--scan", action="store_true",
                            help="read every manifest and look at every shard instead of each tier's step index")
        if name == "gc":
            sp.add_argument("--all", action="store_true", help="remove every step of the job from every tier shown")
            sp.add_argument("--force", action="store_true",
                            help="with --step/--all: remove even the last restorable copy the tiers shown hold")
            sp.add_argument("--dry-run", action="store_true",
                            help="say what would be removed and freed, per tier, and remove nothing")
        _tier_flags(sp)
        sp.set_defaults(fn=fn)

    rs = sub.add_parser("restore", help="export a step to a folder as DCP, torch.save or safetensors",
                        description=RESTORE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    rs.add_argument("job")
    rs.add_argument("--step", type=int)
    rs.add_argument("--to", required=True, help="output folder")
    rs.add_argument("--format", choices=("dcp", "torch", "safetensors"), default="dcp")
    rs.add_argument("--only", metavar="NAME",
                    help="export only the entries under the top-level entry NAME, with NAME. taken off their keys")
    rs.add_argument("--strip-prefix", metavar="PREFIX",
                    help="take PREFIX off every key that starts with it (keys: entry paths joined with '.')")
    rs.add_argument("--progress", action="store_true", help="show the progress bar even when not on a terminal")
    rs.add_argument("--max-memory", type=_parse_size, default=1 << 30, metavar="SIZE",
                    help="most shard bytes held at once while fetching in parallel (bytes, or 512MiB, 4GiB; "
                         "default 1GiB); a larger shard is fetched alone")
    _tier_flags(rs)
    rs.set_defaults(fn=cmd_restore)

    from ._placement_cli import add_parser as add_placement

    add_placement(sub)

    from ._cluster_cli import add_parser as add_retire

    add_retire(sub)

    dm = sub.add_parser("demo", help="train a small model with tiered checkpoints, kill -9 it, restore, report")
    from ._demo import add_run_args

    add_run_args(dm)
    dm.set_defaults(fn=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one ``ckpt`` command; return its exit status.

    Every failure reaches the user as one line on stderr (``ckpt: error: ...``) and a non-zero status:
    2 for unusable flags or settings, 3 when a shard or step is damaged, 1 for anything else (130 on
    Ctrl-C). An output pipe closed by its reader (``ckpt list JOB | head -1``) ends the command quietly
    with status 141, as a shell reports a writer stopped by SIGPIPE. An error this module does not expect
    is printed the same way, with its type; set ``CKPT_TRACEBACK=1`` to get the traceback instead.
    """
    out = sys.stdout
    guard = sys.stdout = _Output(out)
    try:
        try:
            status = _run(argv)
        finally:  # argparse's exit (--help, a usage error) too
            sys.stdout = out
            guard.flush()
        return EXIT_PIPE if guard.reader_gone else status
    except BrokenPipeError as e:  # a socket or a pipe of the command's own broke, not its output
        _error(str(e))
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if os.environ.get("CKPT_TRACEBACK"):
            raise
        _error(f"unexpected {type(e).__name__}: {e} (set CKPT_TRACEBACK=1 to see where)")
        return EXIT_ERROR


class _Output:
    """The command's stdout, which carries on when its reader goes away (``ckpt gc JOB | head -1``).

    A command must finish what it started (``gc`` removing steps and rewriting each index) even when nobody
    reads its lines any more: once a write finds the reader gone, the rest of the output goes to /dev/null
    and the command ends with :data:`EXIT_PIPE`, quietly.
    """

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.reader_gone = False

    def _guarded(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except BrokenPipeError:
            if self.reader_gone or not _reader_gone(self._stream):
                raise
            self.reader_gone = True
            # what is still buffered goes to /dev/null from now on, and so does everything after it
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, self._stream.fileno())
            finally:
                os.close(devnull)
            return fn(*args)

    def write(self, text: str) -> int:
        return self._guarded(self._stream.write, text)

    def flush(self) -> None:
        self._guarded(self._stream.flush)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _reader_gone(stream: Any) -> bool:
    """True when ``stream`` is a pipe whose reader has gone (poll reports an error on its write end)."""
    import select

    try:
        poller = select.poll()
        poller.register(stream.fileno(), select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def _error(message: str) -> None:
    """Print one line: newlines inside ``message`` (an error's text) are folded into it."""
    line = " ".join(str(message).split()) or "failed"
    with contextlib.suppress(OSError, ValueError):
        print(f"ckpt: error: {line}", file=sys.stderr, flush=True)


def _run(argv: list[str] | None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    try:
        if getattr(a, "step", None) is not None and a.step < 0:
            raise InvalidNameError(f"invalid step {a.step}: a step is an integer >= 0")
        return a.fn(a)
    except (InvalidNameError, SettingsError) as e:
        _error(str(e))
        return EXIT_USAGE
    except ShardUnavailableError as e:
        _error(str(e))
        return EXIT_CORRUPT
    except BrokenPipeError:
        raise
    except (JobNotFoundError, StepNotFoundError, ManifestError, CliError, TierError, AgentError,
            AgentUnreachableError, OSError) as e:
        _error(str(e))
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
