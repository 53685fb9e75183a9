"""What one node pays as the job grows: N node agents on loopback, and where the measured trend points.

    python benchmarks/bench_scale.py [--part agents|metadata|all] [--nodes 4,8,16,32,64] [--steps 5]
        [--ranks-per-node 8] [--shard-kib 4] [--tensors-per-rank 1] [--replicas 2] [--idle-seconds 5]
        [--step-timeout 60] [--max-never 2] [--max-seconds-per-n 600]

Parts:

(a) ``metadata``: one step's metadata for Llama-3-like jobs of 64, 1,024 and 16,384 ranks (FSDP2
    dim-0 shards of bf16 parameters and fp32 AdamW moments; synthetic layouts, no tensors): the old
    format (each rank's layout inline in its commit record, sent to every node, and in the manifest)
    against layouts by digest (a commit row per rank up the tree, one manifest down, deflated), the
    layout objects stored once, what a same-world restore reads, and the all-rank Parquet chunk
    table (written, one rank's rows read, one tensor's rows read). Per-rank layout figures come from
    a sample of ranks times the world, as the table says; the old manifest is one record times the
    world (building it at 1,024 ranks took 69 s).

(b) ``agents``: for each N, N ``ckpt agent`` processes on 127.0.0.1, each with its own folder under
    /dev/shm standing for a node, started as a job script would (``--peers FILE --secret-file F
    --node-rank i``, every other setting at its default). This process plays the trainers, without
    torch: every step, each of the ``--ranks-per-node`` ranks of every node leases a staging slot
    (``begin``), writes its shard's bytes into it and commits it with a one-tensor layout, as a
    Checkpointer would. Measured:

    * per step: how long each rank waited for the agent (``begin``'s answer plus ``commit``'s);
      the time from the last rank's commit (its answer) to the step's manifest present in every
      node's memory folder (polled), or "never" when that is not so within ``--step-timeout`` s of
      the step's first ``begin``; per node, peer requests and request-body bytes received (the peer
      server's ``/metrics``: ``tierckpt_peer_requests_total``, ``tierckpt_peer_request_bytes_total``)
      and sent (what every other node received from this one, by the signed sender node:
      ``tierckpt_peer_sender_*``), heartbeats and listings left out (they are the idle rows), commit
      records among them; agent CPU seconds (``/proc/<pid>/stat``) less the idle rate over the same
      window;
    * idle (``--idle-seconds`` with no saves, after every agent has heard from every peer): CPU per
      agent, heartbeat and listing requests per node per second, established TCP connections per
      peer-server port (``/proc/net/tcp``), the oldest heartbeat answer any agent holds (the
      ``status`` op's ``last_seen_s``: when it passes ``dead_after`` the peer is declared dead);
    * over the whole run: peers declared dead after start-up (false deaths: no agent was stopped;
      "declared dead" lines in the agents' logs), requests answered 503 and connections refused at
      the peer server's connection cap.

(c) a least-squares fit of each figure against N (constant, linear, logarithmic) over the N at which
    the cluster worked (every step completed, no false death), and its value at 1,000 and 10,000
    nodes: printed as a separate table, extrapolated, not measured.

Every N has a time budget (``--max-seconds-per-n``); a step that does not complete on every node in
time is recorded as "never", not waited for, and after ``--max-never`` such steps in a row the N's
other steps are not run. Agents are stopped and their folders removed at the end of each N, on
errors, on Ctrl-C and on SIGTERM (the tables then show the N measured so far); they also die with
this process (``PR_SET_PDEATHSIG``).

All N agents share this machine's cores: once the agents' total demand nears the cores (the
"Σ agents" column; "other load" is what other processes took meanwhile), per-agent CPU is capped
by the machine and latencies and false deaths grow from starvation as well as from the protocol.
Each agent's asyncio default executor has min(32, cores + 4) threads, printed in the setup line.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import ctypes
import http.client
import json
import math
import os
import re
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

from _common import OtherLoad, _proc_cpu, fmt, machine_info, markdown_table  # noqa: E402

from agents.config import Settings, socket_path_for  # noqa: E402
from agents.peer_server import MAX_CONNECTIONS  # noqa: E402
from agents.protocol import AgentClient, AgentError, AgentUnreachableError  # noqa: E402
from tiers import keys  # noqa: E402

JOB = "scale"
#: peer-server routes of the background (heartbeats, re-replication listings), reported as idle rates
BACKGROUND_ROUTES = frozenset({"health", "list"})
#: routes that are the benchmark's own reading of the servers
IGNORED_ROUTES = frozenset({"metrics"})
#: the commit tree's routes: rows up, manifests and views down
COMMIT_ROUTES = ("/v1/up", "/v1/down")
DEATH_LINE = "declared dead"
EXTRAPOLATE_TO = (1_000, 10_000)


# ---------------------------------------------------------------------------- agents
_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here: a forked child must not dlopen
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the agent (between fork and exec): be killed when the benchmark dies, however it dies."""
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


_OWNER = "owner.pid"


def _sweep_stale(base: str | None) -> None:
    """Remove work folders left by a benchmark that was killed outright (its agents died with it)."""
    base = base or tempfile.gettempdir()
    for name in os.listdir(base):
        if not name.startswith("bench-scale-"):
            continue
        try:
            with open(os.path.join(base, name, _OWNER)) as f:
                owner = int(f.read())
        except (OSError, ValueError):
            continue
        if owner != os.getpid() and not os.path.exists(f"/proc/{owner}"):
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports (held open together, so none is handed out twice)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class AgentCluster:
    """``n`` agents on 127.0.0.1, one folder under /dev/shm each, one peers file and one secret.

    ``close()`` stops every agent (SIGTERM, then SIGKILL after ``stop_timeout`` s) and removes the
    work folder (kept when ``KEEP_BENCH`` is set). Raises RuntimeError when the agents do not all
    answer within ``start_timeout`` s (the ones started are stopped first).
    """

    def __init__(self, n: int, *, replicas: int, start_timeout: float, agent_args: tuple[str, ...] = (),
                 start_over: float = 0.0) -> None:
        self.n = n
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        _sweep_stale(base)
        self.work = tempfile.mkdtemp(prefix=f"bench-scale-{n}-", dir=base)
        with open(os.path.join(self.work, _OWNER), "w") as f:
            f.write(str(os.getpid()))
        self.procs: list[subprocess.Popen] = []
        self._logs: list = []
        self._clients: dict[int, AgentClient] = {}
        try:
            self.ports = _free_ports(n)
            self.peers = os.path.join(self.work, "peers.txt")
            with open(self.peers, "w") as f:
                f.write("".join(f"127.0.0.1:{p}\n" for p in self.ports))
            self.secret = os.path.join(self.work, "secret")
            fd = os.open(self.secret, os.O_WRONLY | os.O_CREAT, 0o600)
            os.write(fd, secrets.token_hex(32).encode())
            os.close(fd)
            env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
            t0 = time.perf_counter()
            # every agent is started before any is waited for: started one by one, the first would
            # spend the others' start-up heartbeating peers that are not there yet
            for i in range(n):
                if start_over and i:
                    time.sleep(start_over / n)  # agents of a big cluster come up over a while, not at once
                os.makedirs(self.shm(i))
                log = open(self.log_path(i), "ab")
                self._logs.append(log)
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "ckpt.cli", "agent", "--shm", self.shm(i), "--node-rank", str(i),
                     "--peers", self.peers, "--secret-file", self.secret, "--replicas", str(replicas),
                     *agent_args],
                    stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True,
                    preexec_fn=_die_with_parent))
            deadline = time.monotonic() + start_timeout + start_over
            for i in range(n):
                while True:
                    c = AgentClient.try_connect(socket_path_for(self.shm(i)), timeout=60)
                    if c is not None:
                        self._clients[i] = c
                        break
                    if self.procs[i].poll() is not None:
                        raise RuntimeError(f"agent {i} exited with {self.procs[i].returncode}: "
                                           f"{self.log_tail(i)}")
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"agent {i} of {n} did not answer within {start_timeout:.0f} s")
                    time.sleep(0.05)
            self.start_seconds = time.perf_counter() - t0
        except BaseException:
            self.close()
            raise

    def shm(self, i: int) -> str:
        return os.path.join(self.work, f"node{i}", "shm")

    def log_path(self, i: int) -> str:
        return os.path.join(self.work, f"node{i}", "agent.log")

    def log_tail(self, i: int, nbytes: int = 1500) -> str:
        with contextlib.suppress(OSError), open(self.log_path(i), "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - nbytes))
            return f.read().decode(errors="replace")
        return ""

    def client(self, i: int) -> AgentClient:
        """Node ``i``'s trainer connection (one per node, held like a trainer's); raises AgentUnreachableError."""
        c = self._clients.get(i)
        if c is None:
            c = self._clients[i] = AgentClient(socket_path_for(self.shm(i)), timeout=60)
        return c

    def drop_client(self, i: int) -> None:
        """Forget node ``i``'s trainer connection (after a request it did not answer in time: a late answer
        would be read as the next one's); the agent releases the connection's leases."""
        c = self._clients.pop(i, None)
        if c is not None:
            with contextlib.suppress(OSError):
                c._sock.shutdown(socket.SHUT_RDWR)
            c.close()

    def call(self, i: int, op: str, io_timeout: float = 30, **kw) -> dict | None:
        """One request on a connection of its own; None when the agent does not answer in ``io_timeout`` s."""
        try:
            with AgentClient(socket_path_for(self.shm(i)), timeout=io_timeout) as c:
                return c.call(op, **kw)
        except (AgentError, AgentUnreachableError, OSError):
            return None

    def deaths(self) -> list[int]:
        """Per agent, the "declared dead" lines its log holds so far."""
        out = []
        for i in range(self.n):
            try:
                with open(self.log_path(i), "rb") as f:
                    out.append(f.read().count(DEATH_LINE.encode()))
            except OSError:
                out.append(0)
        return out

    def close(self, stop_timeout: float = 15.0) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(OSError):
                    p.terminate()
        for i in list(self._clients):
            self.drop_client(i)  # wakes a worker thread still waiting for an answer
        deadline = time.monotonic() + stop_timeout
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for f in self._logs:
            f.close()
        if os.environ.get("KEEP_BENCH"):
            print(f"work folder kept: {self.work}", file=sys.stderr)
        else:
            shutil.rmtree(self.work, ignore_errors=True)

    def __enter__(self) -> "AgentCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------------- readings
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

Metrics = dict[tuple[str, frozenset], float]


def scrape(port: int, timeout: float = 10.0, tries: int = 3) -> Metrics | None:
    """One peer server's ``/metrics`` as ``{(name, labels): value}``; None if it does not answer."""
    for attempt in range(tries):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        try:
            conn.request("GET", "/metrics")
            resp = conn.getresponse()
            text = resp.read().decode()
            if resp.status == 200:
                out: Metrics = {}
                for line in text.splitlines():
                    m = _SAMPLE.match(line)
                    if m:
                        labels = frozenset(_LABEL.findall(m.group(2) or ""))
                        out[(m.group(1), labels)] = float(m.group(3))
                return out
        except (OSError, http.client.HTTPException):
            pass
        finally:
            conn.close()
        time.sleep(0.2 * (attempt + 1))
    return None


def total(m: Metrics | None, name: str, keep: Callable[[dict], bool] = lambda labels: True) -> float:
    if m is None:
        return math.nan
    return sum(v for (n, labels), v in m.items() if n == name and keep(dict(labels)))


def delta(after: Metrics | None, before: Metrics | None, name: str,
          keep: Callable[[dict], bool] = lambda labels: True) -> float:
    """The counter's growth; NaN when either reading is missing."""
    return total(after, name, keep) - total(before, name, keep)


def _step_route(labels: dict) -> bool:
    return labels.get("route") not in BACKGROUND_ROUTES | IGNORED_ROUTES


def _background_route(labels: dict) -> bool:
    return labels.get("route") in BACKGROUND_ROUTES


def established_per_port(ports: list[int]) -> list[int]:
    """Established TCP connections whose local end is each of ``ports`` (a server's accepted ones)."""
    want = set(ports)
    count: Counter[int] = Counter()
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            parts = line.split(None, 4)
            if parts[3] == "01":  # ESTABLISHED
                port = int(parts[1].rsplit(":", 1)[1], 16)
                if port in want:
                    count[port] += 1
    return [count[p] for p in ports]


# ---------------------------------------------------------------------------- results
@dataclass
class StepResult:
    """One save step across the cluster. Per-node lists are indexed by node; NaN where unread."""

    step: int
    #: seconds from the last rank's commit answer to the manifest in each node's memory (None: never)
    manifest_s: list[float | None]
    skipped: int = 0
    errors: list[str] = field(default_factory=list)
    window_s: float = 0.0
    rx_msgs: list[float] = field(default_factory=list)
    rx_commits: list[float] = field(default_factory=list)
    rx_bytes: list[float] = field(default_factory=list)
    tx_msgs: list[float] = field(default_factory=list)
    tx_bytes: list[float] = field(default_factory=list)
    #: agent CPU seconds over the step's window, less the idle rate over the same time
    cpu_s: list[float] = field(default_factory=list)
    copies_done: bool = False
    #: ranks whose begin and commit were answered within the step's time, of ``ranks``
    committed: int = 0
    ranks: int = 0
    #: per rank committed: seconds the trainer waited for the agent (begin's answer + commit's answer)
    call_s: list[float] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return all(x is not None for x in self.manifest_s)

    @property
    def lag_all(self) -> float | None:
        """Seconds until the manifest was in every node's memory; None if some node never got it."""
        return max(self.manifest_s) if self.complete else None


@dataclass
class ScaleRun:
    """Everything measured for one N."""

    n: int
    ranks_per_node: int
    start_s: float | None = None
    warm_s: float | None = None
    idle_s: float = 0.0
    idle_cpu: list[float] = field(default_factory=list)  # cores per agent
    idle_rx_rate: list[float] = field(default_factory=list)  # background requests received per s per node
    idle_tx_rate: list[float] = field(default_factory=list)  # background requests sent per s per node
    conns_idle: list[int] = field(default_factory=list)
    conns_peak: int = 0
    oldest_heartbeat_s: float | None = None
    steps: list[StepResult] = field(default_factory=list)
    deaths_at_start: int = 0
    false_deaths: int = 0
    dead_at_end: int | None = None
    answered_503: float = 0.0
    refused_connections: float = 0.0
    notes: list[str] = field(default_factory=list)
    #: the agents' process ids (all stopped by the time the run is returned)
    pids: list[int] = field(default_factory=list)
    #: cores kept busy by processes other than this benchmark and its agents while measuring
    other_load: float | None = None


# ---------------------------------------------------------------------------- one N
def _layout(rank: int, world: int, nbytes: int, tensors: int) -> list[dict]:
    """``tensors`` uint8 chunks filling the shard, each rank's chunk of a tensor shaped [world * part]."""
    out, offset = [], 0
    for t in range(tensors):
        part = nbytes // tensors + (1 if t < nbytes % tensors else 0)
        out.append({"kind": "tensor", "name": f"w{t}", "dtype": "uint8", "global_shape": [world * part],
                    "offsets": [rank * part], "shape": [part], "offset": offset, "nbytes": part})
        offset += part
    return out


@dataclass
class _NodeSave:
    last_commit: float | None = None  # perf_counter of the last commit's answer
    committed: int = 0
    skipped: int = 0
    errors: list[str] = field(default_factory=list)
    call_s: list[float] = field(default_factory=list)


def _save_node(cluster: AgentCluster, i: int, step: int, rpn: int, world: int, data: bytes,
               tensors: int, deadline: float) -> _NodeSave:
    """Node ``i``'s ranks stage and commit one step, one after another, each request bounded by
    ``deadline`` (perf_counter); a rank not answered in time ends the node's part of the step."""
    out = _NodeSave()
    for r in range(i * rpn, (i + 1) * rpn):
        left = deadline - time.perf_counter()
        if left <= 0:
            out.errors.append(f"node {i}: ranks {r}..{(i + 1) * rpn - 1} not committed: out of time")
            break
        try:
            c = cluster.client(i)
            t0 = time.perf_counter()
            got = c.call("begin", io_timeout=left, job=JOB, rank=r, world=world, nbytes=len(data), wait=False)
            waited = time.perf_counter() - t0
            if "skip" in got:
                out.skipped += 1
                continue
            fd = os.open(got["slot"], os.O_RDWR)
            try:
                os.pwrite(fd, data, 0)
            finally:
                os.close(fd)
            t1 = time.perf_counter()
            c.call("commit", io_timeout=max(deadline - t1, 0.001), job=JOB, step=step, rank=r, world=world,
                   slot=got["slot"], nbytes=len(data), entries=_layout(r, world, len(data), tensors),
                   save_index=step)
            out.last_commit = time.perf_counter()
            out.call_s.append(waited + out.last_commit - t1)
            out.committed += 1
        except AgentUnreachableError as e:
            # no answer in time (or the connection broke): this connection can no longer be trusted
            cluster.drop_client(i)
            out.errors.append(f"node {i} rank {r}: {e}")
            break
        except (AgentError, OSError) as e:
            out.errors.append(f"node {i} rank {r}: {e}")
    return out


def _scrape_all(pool, cluster: AgentCluster) -> list[Metrics | None]:
    return list(pool.map(scrape, cluster.ports))


def _cpu_all(cluster: AgentCluster) -> list[float]:
    return [_proc_cpu(p.pid) for p in cluster.procs]


def _sent(scrapes: list[Metrics | None], before: list[Metrics | None], node: int, name: str,
          keep: Callable[[dict], bool]) -> float:
    """What every other server counted from ``node`` under ``name`` between two readings."""
    return sum(delta(a, b, name, lambda lb: lb.get("node") == str(node) and keep(lb))
               for j, (a, b) in enumerate(zip(scrapes, before)) if j != node)


def _oldest_heartbeat(cluster: AgentCluster, pool) -> tuple[float | None, int]:
    """(largest ``last_seen_s`` any agent reports for any peer, peers reported dead) from ``status``."""
    oldest, dead = None, 0
    for st in pool.map(lambda i: cluster.call(i, "status"), range(cluster.n)):
        if st is None:
            continue
        for p in st.get("peers", []):
            dead += not p.get("alive")
            # an agent heartbeats only the peers it watches (tree neighbours, placement partners)
            if p.get("watched", True) and p.get("last_seen_s") is not None:
                oldest = max(oldest or 0.0, float(p["last_seen_s"]))
    return oldest, dead


def run_agents(n: int, *, ranks_per_node: int = 8, shard_bytes: int = 4096, replicas: int = 2, steps: int = 5,
               idle_seconds: float = 5.0, settle_seconds: float = 10.0, step_timeout: float = 60.0,
               start_over: float = 0.0,
               max_seconds: float = 600.0,
               tensors_per_rank: int = 1, max_never: int = 2, agent_args: tuple[str, ...] = (),
               log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)) -> ScaleRun:
    """Start ``n`` agents, measure them idle and over ``steps`` saves, stop them; see the module docstring.

    Bounded by ``max_seconds`` (start-up included, the final stop not): what did not fit is recorded
    as not measured, and a step not complete on every node within ``step_timeout`` s of its first
    ``begin`` as never; after ``max_never`` such steps in a row the rest are not run.
    """
    res = ScaleRun(n, ranks_per_node)
    t_begin = time.monotonic()
    budget_end = t_begin + max_seconds
    left = lambda: budget_end - time.monotonic()  # noqa: E731
    world = n * ranks_per_node
    log(f"N={n}: starting {n} agents")
    try:
        cluster = AgentCluster(n, replicas=replicas, start_timeout=min(120.0, max(left(), 1.0)),
                               agent_args=agent_args, start_over=start_over)
    except RuntimeError as e:
        res.notes.append(f"start-up failed: {e}")
        return res
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=min(n, 16))
    try:
        res.start_s = cluster.start_seconds
        res.pids = [p.pid for p in cluster.procs]
        t_up = time.monotonic()
        log(f"N={n}: every agent answers after {res.start_s:.1f} s; waiting until each has heard from every peer")
        # warm: every agent has a heartbeat answer from every peer dated after the last agent came up
        while left() > 0 and time.monotonic() - t_up < 30:
            up_for = time.monotonic() - t_up
            sts = list(pool.map(lambda i: cluster.call(i, "status"), range(n)))
            if all(st is not None and all(p.get("alive") and (not p.get("watched", True) or (
                    p.get("last_seen_s") is not None and p["last_seen_s"] < up_for)) for p in st["peers"])
                   for st in sts):
                res.warm_s = time.monotonic() - t_up
                break
            time.sleep(0.25)
        if res.warm_s is None:
            res.notes.append("agents never all heard from every peer within 30 s of start-up")
        deaths0 = cluster.deaths()
        res.deaths_at_start = sum(deaths0)
        first = _scrape_all(pool, cluster)
        other = OtherLoad()
        other.pids = list(res.pids)
        other.start()

        # -- idle
        idle_for = min(idle_seconds, max(left() - 1 - settle_seconds, 0))
        if idle_for > 0:
            # start-up work (first heartbeats, the warm restore's listings, imports) is over before the window
            time.sleep(settle_seconds)
            log(f"N={n}: idle for {idle_for:.0f} s (after {settle_seconds:.0f} s to settle)")
            before, cpu0, t0 = _scrape_all(pool, cluster), _cpu_all(cluster), time.perf_counter()
            # nothing is asked of the agents during the window (a status answer costs O(N) itself)
            time.sleep(idle_for)
            cpu1, t1 = _cpu_all(cluster), time.perf_counter()
            after = _scrape_all(pool, cluster)
            oldest = None
            for _ in range(6):
                # sampled off the heartbeat's beat (1 s), so the samples fall at every phase of a round
                o, _ = _oldest_heartbeat(cluster, pool)
                if o is not None:
                    oldest = max(oldest or 0.0, o)
                time.sleep(0.37)
            res.idle_s = t1 - t0
            res.idle_cpu = [(b - a) / res.idle_s for a, b in zip(cpu0, cpu1)]
            res.idle_rx_rate = [delta(a, b, "tierckpt_peer_requests_total", _background_route) / res.idle_s
                                for a, b in zip(after, before)]
            res.idle_tx_rate = [_sent(after, before, i, "tierckpt_peer_sender_requests_total", _background_route)
                                / res.idle_s for i in range(n)]
            res.conns_idle = established_per_port(cluster.ports)
            res.conns_peak = max(res.conns_idle)
            res.oldest_heartbeat_s = oldest
        else:
            res.notes.append("no time left for the idle interval")
        idle_rate = res.idle_cpu or [0.0] * n

        # -- steps
        for step in range(steps):
            if len(res.steps) >= max_never and not any(x.complete for x in res.steps[-max_never:]):
                res.notes.append(f"steps {step}..{steps - 1} not run: the last {max_never} never completed")
                break
            if left() < min(step_timeout, 10.0):
                res.notes.append(f"steps {step}..{steps - 1} not run: the {max_seconds:.0f} s budget ran out")
                break
            timeout = min(step_timeout, left())
            data = os.urandom(shard_bytes)
            before, cpu0, t0 = _scrape_all(pool, cluster), _cpu_all(cluster), time.perf_counter()
            deadline = t0 + timeout
            done = list(pool.map(lambda i: _save_node(cluster, i, step, ranks_per_node, world, data,
                                                      tensors_per_rank, deadline), range(n)))
            sr = StepResult(step, [None] * n, skipped=sum(d.skipped for d in done),
                            errors=[e for d in done for e in d.errors], committed=sum(d.committed for d in done),
                            ranks=world, call_s=[x for d in done for x in d.call_s])
            # the reference is the last rank's commit; a step whose ranks did not all commit is never complete
            t_commit = max(d.last_commit for d in done) if sr.committed == world else None
            paths = [os.path.join(cluster.shm(i), keys.manifest_key(JOB, step)) for i in range(n)]
            waiting = set(range(n)) if t_commit is not None else set()
            while waiting and time.perf_counter() < deadline:
                for i in list(waiting):
                    if os.path.exists(paths[i]):
                        sr.manifest_s[i] = time.perf_counter() - t_commit
                        waiting.discard(i)
                if waiting:
                    time.sleep(0.01)
            if sr.complete:
                # the step's copies to peers too, so their requests fall in this step's window
                wait_s = max(1.0, deadline - time.perf_counter())
                got = list(pool.map(lambda i: cluster.call(i, "wait", io_timeout=wait_s + 5, job=JOB, step=step,
                                                           timeout=wait_s), range(n)))
                sr.copies_done = all(g is not None and g.get("done") for g in got)
            cpu1, t1 = _cpu_all(cluster), time.perf_counter()
            after = _scrape_all(pool, cluster)
            sr.window_s = t1 - t0
            sr.rx_msgs = [delta(a, b, "tierckpt_peer_requests_total", _step_route) for a, b in zip(after, before)]
            sr.rx_commits = [delta(a, b, "tierckpt_peer_requests_total", lambda lb: lb.get("route") in COMMIT_ROUTES)
                             for a, b in zip(after, before)]
            sr.rx_bytes = [delta(a, b, "tierckpt_peer_request_bytes_total", _step_route) for a, b in zip(after, before)]
            sr.tx_msgs = [_sent(after, before, i, "tierckpt_peer_sender_requests_total", _step_route) for i in range(n)]
            sr.tx_bytes = [_sent(after, before, i, "tierckpt_peer_sender_bytes_total", _step_route) for i in range(n)]
            sr.cpu_s = [(c1 - c0) - rate * sr.window_s for c0, c1, rate in zip(cpu0, cpu1, idle_rate)]
            res.steps.append(sr)
            res.conns_peak = max(res.conns_peak, *established_per_port(cluster.ports))
            got = sum(x is not None for x in sr.manifest_s)
            log(f"N={n}: step {step}: " + (f"manifest on every node {sr.lag_all:.3f} s after the last commit"
                                           if sr.complete else
                                           f"{sr.committed} of {world} ranks committed, manifest on {got} of {n} "
                                           f"nodes within {timeout:.0f} s")
                + (f"; {sr.skipped} ranks skipped" if sr.skipped else "")
                + (f"; {len(sr.errors)} errors, first: {sr.errors[0]}" if sr.errors else ""))

        # -- the whole run
        res.other_load = other.stop()
        last = _scrape_all(pool, cluster)
        res.answered_503 = sum(delta(a, b, "tierckpt_peer_requests_total", lambda lb: lb.get("status") == "503")
                               for a, b in zip(last, first))
        res.refused_connections = sum(delta(a, b, "tierckpt_peer_connections_refused_total")
                                      for a, b in zip(last, first))
        if any(m is None for m in last + first):
            res.notes.append(f"{sum(m is None for m in last + first)} /metrics readings got no answer")
        res.false_deaths = sum(cluster.deaths()) - res.deaths_at_start
        _, res.dead_at_end = _oldest_heartbeat(cluster, pool)
        return res
    finally:
        log(f"N={n}: stopping the agents")
        # agents first: a request still under way in a worker thread then fails at once instead of timing out
        cluster.close()
        pool.shutdown(wait=True, cancel_futures=True)


# ---------------------------------------------------------------------------- (a) metadata
#: synthetic Llama-3-like models: layers, hidden, ffn, vocab, kv dim; and the world they run on
MODELS = {
    "8B / 64 ranks": (32, 4096, 14336, 128256, 1024, 64),
    "70B / 1,024 ranks": (80, 8192, 28672, 128256, 1024, 1024),
    "405B / 16,384 ranks": (126, 16384, 53248, 128256, 1024, 16384),
}
#: ranks whose layouts are built in full per model (the rest are estimated from them: said in the table)
SAMPLED_RANKS = 8


def _tensors(layers: int, h: int, f: int, vocab: int, kv: int) -> list[tuple[str, tuple[int, ...]]]:
    out = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, h)),
                (p + "mlp.gate_proj.weight", (f, h)), (p + "mlp.up_proj.weight", (f, h)),
                (p + "mlp.down_proj.weight", (h, f)), (p + "input_layernorm.weight", (h,)),
                (p + "post_attention_layernorm.weight", (h,))]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]


def synthetic_layout(model: tuple, rank: int) -> "Layout":
    """One FSDP2 rank's layout (dim-0 shards of every parameter and of AdamW's two moments), no tensors."""
    from tiers.layout import Layout
    from tiers.manifest import TensorChunk

    layers, h, f, vocab, kv, world = model
    chunks, off = [], 0
    for name, shape in _tensors(layers, h, f, vocab, kv):
        per = -(-shape[0] // world)
        start = min(rank * per, shape[0])
        rows = max(0, min(per, shape[0] - start))
        local = (rows,) + shape[1:]
        for prefix, dtype, size in (("model.", "bfloat16", 2), ("optim.state.exp_avg.", "float32", 4),
                                    ("optim.state.exp_avg_sq.", "float32", 4)):
            n = math.prod(local) * size
            off = (off + 63) // 64 * 64
            chunks.append(TensorChunk(prefix + name, dtype, shape, (start,) + (0,) * (len(shape) - 1), local, off, n))
            off += n
    return Layout(tuple(chunks))


def _timed(fn, *a, **kw):
    t0 = time.perf_counter()
    out = fn(*a, **kw)
    return out, time.perf_counter() - t0


def bench_metadata(ranks_per_node: int = 8, fanout: int = 8) -> list[dict]:
    """Metadata per step for the three jobs: the old format (every layout inline in every commit record
    and manifest) against layouts by digest; sizes computed from synthetic layouts, no tensors."""
    import zlib

    import xxhash

    from tiers.layout import Layout, chunk_table_bytes, read_chunk_table
    from tiers.manifest import JsonEntry, Manifest, ShardInfo

    rows_out = []
    for label, model in MODELS.items():
        world = model[-1]
        nodes = world // ranks_per_node
        sample = sorted({0, world - 1} | {r * world // SAMPLED_RANKS for r in range(SAMPLED_RANKS)})
        layouts = {r: synthetic_layout(model, r) for r in sample}
        lay0 = layouts[0]
        # old format: a rank's commit record carried its entries, sent to every node; the manifest held all
        v1_row = ShardInfo(0, lay0.end, "xxh3_64:0123456789abcdef", lay0.chunks + (JsonEntry("data/pos", 1),), 0)
        v1_record = len(json.dumps(v1_row.to_json(), separators=(",", ":")))
        v1_rx = v1_record * ranks_per_node * (nodes - 1)
        v1_manifest = v1_record * world
        # new: rows name layouts by digest; one manifest of `world` rows, deflated on the wire
        # digests and checksums as random as real ones (they do not compress)
        digests = {r: layouts[r].digest if r in layouts else xxhash.xxh3_128_hexdigest(b"layout%d" % r)
                   for r in range(world)}
        sums = {r: f"xxh3_64:{xxhash.xxh3_64_hexdigest(b'shard%d' % r)}" for r in range(world)}
        shards = tuple(ShardInfo(r, lay0.end, sums[r],
                                 (JsonEntry("data/pos", 1000 + r),), r // ranks_per_node, digests[r])
                       for r in range(world))
        m = Manifest("job", 1000, world, shards, {"save_index": 1000})
        data, t_build = _timed(m.to_bytes)
        _, t_parse = _timed(Manifest.from_bytes, data)
        wire = len(zlib.compress(data, 1))
        up_row = len(json.dumps({"job": "job", "step": 1000, "rank": 0, "world": world, "nbytes": lay0.end,
                                 "layout": lay0.digest, "values": [["data/pos", 1000]],
                                 "checksum": "xxh3_64:0123456789abcdef", "save_index": 1000, "metadata": {},
                                 "node": 0}, separators=(",", ":")))
        # received per node per step: a leaf takes the manifest; the busiest node (the root) also takes every
        # other node's rows, coming up from its children deflated (what an inner node forwards is a share of it)
        others = [{"job": "job", "step": 1000, "rank": r, "world": world, "nbytes": lay0.end,
                   "layout": digests[r], "values": [["data/pos", 1000 + r]],
                   "checksum": sums[r], "save_index": 1000, "metadata": {},
                   "node": r // ranks_per_node} for r in range(ranks_per_node, world)]
        root_rx = len(zlib.compress(json.dumps({"rows": others}, separators=(",", ":")).encode(), 1))
        lay_bytes = {r: len(lay.to_bytes()) for r, lay in layouts.items()}
        per_rank = statistics.mean(lay_bytes.values())
        own = lay_bytes[0]
        row = {"job": label, "world": world, "v1 record": v1_record, "v1 rx/node/step": v1_rx,
               "v1 manifest": v1_manifest, "row": up_row, "manifest": len(data), "manifest wire": wire,
               "rx leaf": wire, "rx root": root_rx, "build s": t_build, "parse s": t_parse,
               "layout/rank": own, "layouts stored": per_rank * world, "restore reads": len(data) + own}
        if world <= 1024:
            table_layouts = {r: layouts.get(r) or synthetic_layout(model, r) for r in range(world)}
            table, t_table = _timed(chunk_table_bytes, table_layouts)
            _, t_one = _timed(read_chunk_table, table, ranks=[world // 2])
            name = "model.model.layers.7.self_attn.q_proj.weight"
            _, t_name = _timed(read_chunk_table, table, names=[name])
            row.update({"table": len(table), "table write s": t_table, "one rank s": t_one, "one tensor s": t_name})
        rows_out.append(row)
    return rows_out


def print_metadata(rows: list[dict]) -> None:
    print("\n(a) metadata per step, synthetic FSDP2 layouts (bf16 params + fp32 AdamW moments, no tensors); "
          f"per-rank layout figures from {SAMPLED_RANKS}+ sampled ranks x world")
    head = ["job", "old: record", "old: rx/node/step", "old: manifest", "new: row up", "new: manifest",
            "new: on the wire", "rx/node/step leaf / root", "build / parse s", "layout/rank",
            "layouts stored", "same-world restore reads", "chunk table", "write / 1 rank / 1 tensor s"]
    out = [head]
    for r in rows:
        out.append([r["job"], _b(r["v1 record"]), _b(r["v1 rx/node/step"]), _b(r["v1 manifest"]), _b(r["row"]),
                    _b(r["manifest"]), _b(r["manifest wire"]), f"{_b(r['rx leaf'])} / {_b(r['rx root'])}",
                    f"{r['build s']:.3f} / {r['parse s']:.3f}", _b(r["layout/rank"]), _b(r["layouts stored"]),
                    _b(r["restore reads"]),
                    _b(r["table"]) if "table" in r else "not built",
                    f"{r['table write s']:.1f} / {r['one rank s']:.3f} / {r['one tensor s']:.3f}" if "table" in r
                    else "-"])
    widths = [max(len(str(x[i])) for x in out) for i in range(len(head))]
    for i, line in enumerate(out):
        print("  ".join(str(c).ljust(w) for c, w in zip(line, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))


def _b(n: float) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{int(n)} B"


# ---------------------------------------------------------------------------- tables
def _finite(xs) -> list[float]:
    return [float(x) for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]


def _med_max(xs, digits: int = 0) -> str:
    v = _finite(xs)
    if not v:
        return "—"
    return f"{fmt(statistics.median(v), digits)} / {fmt(max(v), digits)}"


def _per_step(run: ScaleRun, attr: str) -> list[float]:
    """Per step, the median across nodes of ``attr``."""
    out = []
    for s in run.steps:
        v = _finite(getattr(s, attr))
        if v:
            out.append(statistics.median(v))
    return out


def _across(run: ScaleRun, attr: str) -> list[float]:
    """Every node's value in every step (for the max across nodes)."""
    return [x for s in run.steps for x in _finite(getattr(s, attr))]


def _lags(run: ScaleRun) -> tuple[list[float], int]:
    done = [s.lag_all for s in run.steps if s.complete]
    return done, sum(not s.complete for s in run.steps)


def step_table(runs: list[ScaleRun]) -> str:
    headers = ["N", "steps on every node", "ranks committed", "trainer wait per rank s (begin+commit)",
               "commit → manifest on every node, s (median / max)",
               "requests rx", "commit-tree msgs rx", "body bytes rx", "requests tx", "body bytes tx",
               "agent CPU s, net of idle", "replica copies done"]
    rows = []
    for r in runs:
        lags, never = _lags(r)
        lag = "—" if not lags else f"{fmt(statistics.median(lags))} / {fmt(max(lags))}"
        if never:
            lag += f"; never: {never}"

        def cell(attr: str, digits: int = 0) -> str:
            v = _per_step(r, attr)
            if not v:
                return "—"
            return f"{fmt(statistics.median(v), digits)} / {fmt(max(_across(r, attr)), digits)}"

        calls = [x for s in r.steps for x in s.call_s]
        rows.append([str(r.n), f"{sum(s.complete for s in r.steps)}/{len(r.steps)}",
                     f"{sum(s.committed for s in r.steps)}/{sum(s.ranks for s in r.steps)}",
                     f"{fmt(statistics.median(calls))} / {fmt(max(calls))}" if calls else "—", lag,
                     cell("rx_msgs"), cell("rx_commits"), cell("rx_bytes"), cell("tx_msgs"), cell("tx_bytes"),
                     cell("cpu_s", 3), f"{sum(s.copies_done for s in r.steps)}/{len(r.steps)}"])
    return markdown_table(headers, rows)


def idle_table(runs: list[ScaleRun], cores: int) -> str:
    headers = ["N", "agents up s", "CPU per agent, cores", f"Σ agents, cores (of {cores})",
               "heartbeat+list rx /s", "heartbeat+list tx /s", "TCP conns per server port", "peak conns",
               "oldest heartbeat answer s", "false deaths", "dead at end", "503s", "refused conns",
               "other load, cores"]
    rows = []
    for r in runs:
        rows.append([
            str(r.n), fmt(r.start_s, 1), _med_max(r.idle_cpu, 3), f"{sum(r.idle_cpu):.3f}" if r.idle_cpu else "—",
            _med_max(r.idle_rx_rate, 1), _med_max(r.idle_tx_rate, 1), _med_max(r.conns_idle),
            str(r.conns_peak), fmt(r.oldest_heartbeat_s, 2), str(r.false_deaths),
            "—" if r.dead_at_end is None else str(r.dead_at_end), fmt(r.answered_503, 0), fmt(r.refused_connections, 0),
            "—" if r.other_load is None else f"{r.other_load:.2f}",
        ])
    return markdown_table(headers, rows)


# ---------------------------------------------------------------------------- (c) fit
@dataclass
class Fit:
    """``y = a + b·g(N)`` with g = 0 (constant), N (linear) or ln N (log), least squares."""

    model: str
    a: float
    b: float
    r2: float
    r2_by_model: dict[str, float]

    def at(self, n: float) -> float:
        g = {"constant": 0.0, "linear": n, "log": math.log(n)}[self.model]
        return self.a + self.b * g

    def reaches(self, limit: float) -> float | None:
        """The N at which the fit reaches ``limit`` (None if it never does as N grows)."""
        if self.model == "constant" or self.b <= 0 or self.a >= limit:
            return None
        g = (limit - self.a) / self.b
        return g if self.model == "linear" else math.exp(min(g, 700))


def fit(ns: list[int], ys: list[float]) -> Fit | None:
    """The best of constant, linear and log in N; a sloped model only when it rises and explains at least
    half the variance. None with fewer than two measured points."""
    pts = [(n, y) for n, y in zip(ns, ys) if y is not None and not math.isnan(y)]
    if len(pts) < 2:
        return None
    x = np.array([p[0] for p in pts], dtype=float)
    y = np.array([p[1] for p in pts], dtype=float)
    tss = float(((y - y.mean()) ** 2).sum())
    fits: dict[str, tuple[float, float, float]] = {}
    for model, g in (("constant", np.zeros_like(x)), ("linear", x), ("log", np.log(x))):
        a_mat = np.column_stack([np.ones_like(x), g]) if model != "constant" else np.ones((len(x), 1))
        coef, *_ = np.linalg.lstsq(a_mat, y, rcond=None)
        rss = float(((a_mat @ coef - y) ** 2).sum())
        r2 = 1.0 - rss / tss if tss > 0 else 1.0
        fits[model] = (float(coef[0]), float(coef[1]) if model != "constant" else 0.0, r2)
    best = max(("linear", "log"), key=lambda m: fits[m][2])
    # none of these per-node costs can shrink as nodes are added: a falling fit is noise
    if tss == 0 or fits[best][2] < 0.5 or fits[best][1] < 0:
        best = "constant"
    a, b, r2 = fits[best]
    return Fit(best, a, b, r2, {m: f[2] for m, f in fits.items()})


def _figures(runs: list[ScaleRun]) -> list[tuple[str, str, list[float | None], float | None, str]]:
    """(figure, unit, value per run, a limit the code has, what the limit is) for every per-node figure."""

    def med(xs) -> float | None:
        v = _finite(xs)
        return statistics.median(v) if v else None

    dead_after = Settings().dead_after
    out = [
        ("trainer wait per rank (begin + commit answers)", "s",
         [med([x for s in r.steps for x in s.call_s]) for r in runs], None, ""),
        ("commit → manifest on every node", "s", [med(_lags(r)[0]) for r in runs], None, ""),
        ("requests rx per node per step", "requests", [med(_per_step(r, "rx_msgs")) for r in runs], None, ""),
        ("commit-tree messages rx per node per step", "requests", [med(_per_step(r, "rx_commits")) for r in runs], None, ""),
        ("body bytes rx per node per step", "bytes", [med(_per_step(r, "rx_bytes")) for r in runs], None, ""),
        ("requests tx per node per step", "requests", [med(_per_step(r, "tx_msgs")) for r in runs], None, ""),
        ("body bytes tx per node per step", "bytes", [med(_per_step(r, "tx_bytes")) for r in runs], None, ""),
        ("agent CPU per node per step, net of idle", "CPU s", [med(_per_step(r, "cpu_s")) for r in runs], None, ""),
        ("idle CPU per agent", "cores", [med(r.idle_cpu) for r in runs], 1.0,
         "one core (the agent's event loop and its threads share one GIL)"),
        ("idle heartbeat+list requests rx per node", "per s", [med(r.idle_rx_rate) for r in runs], None, ""),
        ("TCP connections per server port", "connections", [med(r.conns_idle) for r in runs], float(MAX_CONNECTIONS),
         f"the peer server's cap ({MAX_CONNECTIONS}; more are answered 503)"),
        ("oldest heartbeat answer held", "s", [r.oldest_heartbeat_s for r in runs], dead_after,
         f"dead_after ({dead_after:g} s: the peer is declared dead)"),
    ]
    return out


def _num(x: float | None) -> str:
    if x is None or math.isnan(x):
        return "—"
    if abs(x) >= 1e5:
        return f"{x:.2e}"
    if abs(x) >= 100:
        return f"{x:.0f}"
    return f"{x:.3g}"


def healthy(run: ScaleRun) -> bool:
    """Every step it ran completed on every node, and no peer was declared dead while measuring."""
    return bool(run.steps) and all(s.complete for s in run.steps) and run.false_deaths == 0


def extrapolation_table(runs: list[ScaleRun]) -> tuple[str, list[str]]:
    """The fit table over the runs that worked (:func:`healthy`); the others are shown, starred, unused."""
    ns = [r.n for r in runs]
    ok = [healthy(r) for r in runs]
    headers = ["figure", "unit", "measured (" + ", ".join(f"N={n}" + ("" if g else "*") for n, g in zip(ns, ok))
               + ")", "model", "R² (const/lin/log)", *[f"N={n:,}" for n in EXTRAPOLATE_TO]]
    rows, notes = [], []
    if not all(ok):
        notes.append("* not used in the fits: at that N some step never completed on every node, or a peer was "
                     "declared dead while measuring, so its figures describe a broken cluster, not a trend")
    for name, unit, ys, limit, what in _figures(runs):
        f = fit([n for n, g in zip(ns, ok) if g], [y for y, g in zip(ys, ok) if g])
        measured = ", ".join(_num(y) for y in ys)
        if f is None:
            rows.append([name, unit, measured, "too few points", "—", *["—" for _ in EXTRAPOLATE_TO]])
            continue
        model = {"constant": "a", "linear": "a + b·N", "log": "a + b·ln N"}[f.model]
        model += f" (a={_num(f.a)}" + (f", b={_num(f.b)})" if f.model != "constant" else ")")
        r2 = "/".join(f"{max(0.0, f.r2_by_model[m]):.2f}" for m in ("constant", "linear", "log"))
        rows.append([name, unit, measured, model, r2, *[_num(f.at(n)) for n in EXTRAPOLATE_TO]])
        if limit is not None:
            at = f.reaches(limit)
            if at is not None and at <= 1e9:
                notes.append(f"{name}: the fit reaches {what} at N ≈ {at:,.0f}")
    return markdown_table(headers, rows), notes


# ---------------------------------------------------------------------------- main
def _executor_threads() -> int:
    """Threads of an agent's default asyncio executor (the agent's Python, run the same way as this one)."""
    count = os.process_cpu_count() if hasattr(os, "process_cpu_count") else os.cpu_count()
    return min(32, (count or 1) + 4)


def _terminate(signum, frame) -> None:
    # unwinds through every finally (agents stopped, folders removed), then prints what was measured
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("agents", "metadata", "all"), default="agents")
    ap.add_argument("--nodes", default="4,8,16,32,64", help="comma-separated N (node agents) to measure")
    ap.add_argument("--steps", type=int, default=5, help="save steps per N")
    ap.add_argument("--ranks-per-node", type=int, default=8)
    ap.add_argument("--shard-kib", type=int, default=4, help="bytes each rank saves per step, KiB")
    ap.add_argument("--tensors-per-rank", type=int, default=1, help="tensor chunks in each rank's layout")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--idle-seconds", type=float, default=10.0, help="length of the idle window, s")
    ap.add_argument("--settle-seconds", type=float, default=10.0,
                    help="wait after start-up before the idle window, s")
    ap.add_argument("--step-timeout", type=float, default=60.0, help="seconds before a step counts as never done")
    ap.add_argument("--max-seconds-per-n", type=float, default=600.0)
    ap.add_argument("--start-over", type=float, default=0.0,
                    help="seconds over which the agents are started, evenly (0: all at once)")
    ap.add_argument("--max-never", type=int, default=2,
                    help="stop an N's steps after this many in a row never complete")
    a = ap.parse_args(argv)
    nodes = [int(x) for x in a.nodes.split(",") if x.strip()]
    if any(n < 2 for n in nodes):
        ap.error("every N must be >= 2 (agents with peers)")
    signal.signal(signal.SIGTERM, _terminate)

    info = machine_info()
    print(f"setup: N = {', '.join(map(str, nodes))} node agents on 127.0.0.1 (one /dev/shm folder each), "
          f"{a.ranks_per_node} ranks per node, shard {a.shard_kib} KiB per rank per step "
          f"({a.tensors_per_rank} tensor chunk(s)), replicas {a.replicas}, {a.steps} steps, "
          f"idle interval {a.idle_seconds:g} s after {a.settle_seconds:g} s to settle, step timeout {a.step_timeout:g} s, "
          f"budget {a.max_seconds_per_n:g} s per N; agent defaults otherwise "
          f"(heartbeat {Settings().heartbeat:g} s, dead_after {Settings().dead_after:g} s, "
          f"connection cap {MAX_CONNECTIONS}, asyncio default executor {_executor_threads()} threads); "
          f"machine: {info['cores']} cores ({info['cpu']}), {info['ram_gib']} GiB", flush=True)

    status = 0
    if a.part in ("metadata", "all"):
        print_metadata(bench_metadata(a.ranks_per_node, Settings().fanout))
        if a.part == "metadata":
            return 0
    runs: list[ScaleRun] = []
    try:
        for n in nodes:
            runs.append(run_agents(n, ranks_per_node=a.ranks_per_node, shard_bytes=a.shard_kib << 10,
                                   replicas=a.replicas, steps=a.steps, idle_seconds=a.idle_seconds,
                                   settle_seconds=a.settle_seconds, start_over=a.start_over,
                                   step_timeout=a.step_timeout, max_seconds=a.max_seconds_per_n + a.start_over,
                                   tensors_per_rank=a.tensors_per_rank, max_never=a.max_never))
    except KeyboardInterrupt:
        print("\ninterrupted: the tables hold the N measured so far", file=sys.stderr)
        status = 130
    if not runs:
        return status or 1

    print("\n(b) per save step, per node: median / max (the median over steps of the median across nodes, "
          "then the largest single node in any step); rx = requests this node's peer server answered, "
          "tx = requests the other nodes' servers answered from this node (by the signed node header); "
          "heartbeats and listings are in the idle table\n")
    print(step_table(runs))
    print(f"\n(b) idle ({a.idle_seconds:g} s without saves or requests, {a.settle_seconds:g} s after every agent "
          "heard from every peer it watches; the oldest heartbeat sampled just after): "
          "per node median / max; 503s and refused connections over the whole run; "
          "false deaths: peers declared dead after start-up (no agent was stopped)\n")
    print(idle_table(runs, info["cores"]))
    for r in runs:
        for note in r.notes:
            print(f"note N={r.n}: {note}")
        if r.deaths_at_start:
            print(f"note N={r.n}: {r.deaths_at_start} peers declared dead during start-up (before measuring)")
    if len(runs) >= 2:
        table, notes = extrapolation_table(runs)
        print("\n(c) EXTRAPOLATED, NOT MEASURED: least-squares fit of each figure against N over the measured "
              "N at which the cluster worked (unstarred), and its value at 1,000 and 10,000 nodes. A fit knows "
              "nothing of limits and saturation past the measured N; on one machine the agents share its cores, so figures measured "
              "under saturation (Σ agents ≈ cores) are lower bounds of what N separate nodes would show\n")
        print(table)
        for note in notes:
            print(f"- {note}")
    return status


if __name__ == "__main__":
    sys.exit(main())
