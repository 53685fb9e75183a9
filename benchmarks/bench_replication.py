"""Replication throughput between two agents on loopback, against a raw socket transfer, and memory per node.

    python benchmarks/bench_replication.py [--size-mib 512] [--runs 5]

Rows (medians of ``--runs``; ratios against the raw socket bound measured in the same run):

* raw socket: ``socket.sendfile`` of a tmpfs file → ``recv_into`` a pre-faulted buffer, two processes;
* PeerTier.put: the peer protocol alone (HTTP/1.1, sendfile body, signed, checksum verified by the receiver);
* agent → agent: from a shard's commit on node 0 to its verified replica published on node 1
  (checksum, signed PUT, receiver's verify and rename — everything replication does).

Then the memory each node holds for ``replicas`` and ``keep_memory``, measured against the formula.
"""

from __future__ import annotations

import argparse
import mmap
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from agents.config import socket_path_for  # noqa: E402
from agents.protocol import AgentClient  # noqa: E402
from tiers.wire import load_secret  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_RECEIVER = r"""
import socket, sys, mmap
size = int(sys.argv[1]); srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
print(srv.getsockname()[1], flush=True)
buf = mmap.mmap(-1, size); buf[:] = b"\0" * size
mv = memoryview(buf)
while True:
    c, _ = srv.accept()
    done = 0
    while done < size:
        n = c.recv_into(mv[done:])
        if not n: break
        done += n
    c.sendall(b"k"); c.close()
"""


def raw_socket(path: str, size: int, runs: int) -> list[float]:
    rx = subprocess.Popen([sys.executable, "-c", _RECEIVER, str(size)], stdout=subprocess.PIPE, text=True)
    port = int(rx.stdout.readline())
    times = []
    try:
        with open(path, "rb") as f:
            for _ in range(runs + 1):
                s = socket.create_connection(("127.0.0.1", port))
                t0 = time.perf_counter()
                s.sendfile(f, 0, size)
                s.recv(1)
                times.append(time.perf_counter() - t0)
                s.close()
    finally:
        rx.kill()
    return times[1:]


def cluster_files(work: str, n: int = 2) -> tuple[list[int], str, str]:
    """Free loopback ports for ``n`` agents, their peers file and a shared secret file, in ``work``."""
    ports = [free_port() for _ in range(n)]
    peers = os.path.join(work, "peers.txt")
    with open(peers, "w") as f:
        f.write("".join(f"127.0.0.1:{p}\n" for p in ports))
    secret = os.path.join(work, "secret")
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, secrets.token_hex(32).encode())  # text: load_secret strips trailing whitespace
    os.close(fd)
    return ports, peers, secret


def start_agent(shm: str, peers: str, rank: int, secret: str, *extra: str) -> subprocess.Popen:
    """Node ``rank``'s agent of the cluster in ``peers``, with ``extra`` flags; returns once it answers."""
    return launch_agent(shm, f"agent{rank}.log", "--node-rank", str(rank), "--peers", peers,
                        "--secret-file", secret, "--keep-memory", "2", *extra)


def launch_agent(shm: str, log_name: str, *args: str) -> subprocess.Popen:
    """``ckpt agent --shm SHM ARGS``, logging beside ``shm`` to ``log_name``; returns once it answers."""
    os.makedirs(shm, exist_ok=True)
    log = open(os.path.join(os.path.dirname(shm), log_name), "ab")
    p = subprocess.Popen([sys.executable, "-m", "ckpt.cli", "agent", "--shm", shm, *args],
                         stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    for _ in range(600):
        c = AgentClient.try_connect(socket_path_for(shm), timeout=2)
        if c is not None:
            c.close()
            return p
        time.sleep(0.05)
    raise RuntimeError("agent did not start")


def stage(shm: str, job: str, step: int, size: int, fill: bytes) -> float:
    with AgentClient(socket_path_for(shm)) as c:
        slot = c.call("begin", job=job, rank=0, world=1, nbytes=size)["slot"]
        with open(slot, "r+b") as f, mmap.mmap(f.fileno(), size) as mm:
            mm[:] = fill
        entries = [{"kind": "tensor", "name": "w", "dtype": "uint8", "global_shape": [size], "offsets": [0],
                    "shape": [size], "offset": 0, "nbytes": size}]
        c.call("commit", job=job, step=step, rank=0, world=1, slot=slot, nbytes=size, entries=entries,
               save_index=step)
        return time.perf_counter()


def du(path: str) -> int:
    total = 0
    seen = set()
    for folder, _, files in os.walk(path):
        for f in files:
            st = os.lstat(os.path.join(folder, f))
            if st.st_ino not in seen:
                seen.add(st.st_ino)
                total += st.st_blocks * 512
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    size = a.size_mib << 20
    work = tempfile.mkdtemp(prefix="bench-repl-", dir="/dev/shm")
    procs = []
    try:
        src = os.path.join(work, "src.bin")
        fill = os.urandom(1 << 20) * a.size_mib
        with open(src, "wb") as f:
            f.write(fill)
        raw = raw_socket(src, size, a.runs)

        ports, peers, secret = cluster_files(work)
        shms = [os.path.join(work, f"node{i}", "shm") for i in range(2)]
        procs = [start_agent(shms[i], peers, i, secret) for i in range(2)]

        from tiers.peer import PeerTier

        peer = PeerTier(f"127.0.0.1:{ports[1]}", secret=load_secret(secret), node=0, timeout=120)
        put = []
        for i in range(a.runs + 1):
            t0 = time.perf_counter()
            peer.put(f"probe/step-{i}/rank-0.shard", src)
            put.append(time.perf_counter() - t0)
            peer.delete(f"probe/step-{i}/rank-0.shard")
        put = put[1:]

        agent = []
        for step in range(a.runs + 1):
            target = os.path.join(shms[1], "bench", f"step-{step}", "rank-0.shard")
            t0 = stage(shms[0], "bench", step, size, fill)
            while not os.path.exists(target):
                time.sleep(0.0005)
            agent.append(time.perf_counter() - t0)
        agent = agent[1:]
        time.sleep(1.0)
        held = [du(s) for s in shms]

        bound = statistics.median(raw)
        rows = [("raw socket sendfile → recv_into (bound)", bound),
                ("PeerTier.put (HTTP, signed, receiver verifies)", statistics.median(put)),
                ("agent → agent replica (commit → verified replica)", statistics.median(agent))]
        print(f"\n{os.cpu_count()} cores, shard {a.size_mib} MiB, loopback, median of {a.runs}\n")
        print("| path | median s | GB/s | vs bound |")
        print("|---|---|---|---|")
        for name, t in rows:
            print(f"| {name} | {t:.3f} | {size / t / 1e9:.2f} | {bound / t:.2f}× |")
        keep = 2
        own = size * (keep + 1)  # the ring of staging slots: keep + 1 per rank
        rep = size * keep        # one peer's retained steps
        print(f"\nmemory held per node (replicas=2, keep_memory={keep}, one {a.size_mib} MiB shard per node per step):")
        print("| node | measured GiB | formula GiB | formula |")
        print("|---|---|---|---|")
        print(f"| 0 (saves) | {held[0] / 2**30:.2f} | {own / 2**30:.2f} | (keep+1) × shard: staging ring |")
        print(f"| 1 (replica of 0) | {held[1] / 2**30:.2f} | {rep / 2**30:.2f} | keep × shard × (replicas−1) |")
        print("\nIn a job where every node saves, each node holds (keep+1 + keep×(replicas−1)) × its shard size.")
        return 0
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(60)
        if os.environ.get("KEEP_BENCH"):
            print("work folder kept:", work)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
