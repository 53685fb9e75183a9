"""Membership changes timed: a node that joins, one that is lost, one that retires; peers file and heartbeats
against etcd's lease and watch, in the same run.

    python benchmarks/bench_membership.py [--nodes 4] [--trials 5]

Each trial starts ``--nodes`` agents on loopback (simulated nodes, one machine), every one with heartbeat
0.2 s and dead_after 3 s (the tests' settings; with etcd the lease is dead_after too), group placement with
2 copies, and commits step 1 (one 1 MiB shard per rank, this process playing the trainers). Then, timed
from the change to what every agent reports:

* **join**: a new node (rank ``--nodes``) starts: with the peers file its line is appended first, with etcd
  it only registers. Until every agent counts it and answers it.
* **loss**: node 1's machine is lost (``kill -9``, its memory gone). Until every other agent marks it dead,
  and until each rank's shard of step 1 has 2 copies again on the nodes left (the heal).
* **retire**: the lost node is retired (``role=retired`` on its line in every node's peers file, or
  ``ckpt retire`` with etcd). Until every agent counts one node fewer.

The table gives the median and the maximum over the trials of each, per membership source, and the ratio
etcd / peers file. etcd is one member on loopback here: its own latency on a real network is not in it.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

JOB = "mem"


def _has(shm: str, rank: int) -> bool:
    return os.path.exists(os.path.join(shm, JOB, "step-1", f"rank-{rank}.shard"))


class _Peers:
    """The peers-file cluster of the tests (tests/test_e2e_peers.py), with the same start-up grace as etcd's."""

    name = "peers file + heartbeats"

    def __init__(self, root: pathlib.Path, n: int) -> None:
        import test_e2e_peers as tp

        self.c = tp.Cluster(root, n, extra=("--startup-grace", "20"))
        self.n = n

    def shm(self, i: int) -> str:
        return self.c.shm(i)

    def add(self) -> int:
        from s3util import free_port

        i = self.c.n
        port = free_port()
        self.c.ports.append(port)
        with open(self.c.peers, "a") as f:
            f.write(f"127.0.0.1:{port}\n")
        self.c.n += 1
        self.c.start(i)
        return i

    def lose(self, i: int) -> None:
        self.c.kill(i)

    def retire(self, i: int) -> None:
        lines = open(self.c.peers).read().splitlines()
        with open(self.c.peers + ".tmp", "w") as f:
            f.writelines(f"{ln} role=retired\n" if k == i else f"{ln}\n" for k, ln in enumerate(lines))
        os.replace(self.c.peers + ".tmp", self.c.peers)

    def live(self) -> list[int]:
        return sorted(self.c.procs)

    def close(self) -> None:
        self.c.close()


class _Etcd:
    name = "etcd lease + watch"

    def __init__(self, root: pathlib.Path, n: int) -> None:
        import test_e2e_etcd as te

        self.c = te.EtcdCluster(root, n, members=1)
        self.n = n

    def shm(self, i: int) -> str:
        return self.c.shm(i)

    def add(self) -> int:
        i = len(self.c.gen)
        self.c.start(i)
        return i

    def lose(self, i: int) -> None:
        from procs import kill9

        kill9(self.c.procs.pop(i))
        shutil.rmtree(os.path.dirname(self.c.shm(i)))

    def retire(self, i: int) -> None:
        subprocess.run([sys.executable, "-m", "ckpt.cli", "retire", "--etcd", self.c.etcd.endpoints, "--cluster", "c1",
                        str(i)], check=True, capture_output=True, cwd=ROOT, timeout=120)

    def live(self) -> list[int]:
        return sorted(self.c.procs)

    def close(self) -> None:
        self.c.close()


def _wait(cond, what: str, timeout: float = 120.0) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if cond():
            return time.monotonic() - t0
        time.sleep(0.02)
    raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")


def trial(kind, root: pathlib.Path, n: int) -> dict:
    from procs import agent_call
    from test_e2e_faults import _stage_ranks

    def status(i: int) -> dict:
        return agent_call(c.shm(i), "status")

    def peers_alive(i: int) -> dict[int, bool]:
        return {p["node"]: p["alive"] for p in status(i)["peers"]}

    c = kind(root, n)
    try:
        _stage_ranks({r: c.shm(r) for r in range(n)}, JOB, 1, 1 << 20, world=n)
        _wait(lambda: all(os.path.exists(os.path.join(c.shm(i), JOB, "step-1", "manifest.json")) for i in range(n)),
              "step 1 on every node")
        t0 = time.monotonic()
        new = c.add()
        _wait(lambda: all(status(i)["tree"]["nodes"] == n + 1 for i in c.live())
              and all(peers_alive(i).get(new) for i in c.live() if i != new), "the new node counted and answered")
        join = time.monotonic() - t0
        lost = 1
        t0 = time.monotonic()
        c.lose(lost)
        _wait(lambda: all(peers_alive(i).get(lost) is False for i in c.live()), "the lost node dead everywhere")
        dead = time.monotonic() - t0
        _wait(lambda: all(sum(_has(c.shm(i), r) for i in c.live()) >= 2 for r in range(n)),
              "every rank's shard of step 1 on 2 of the nodes left")
        healed = time.monotonic() - t0
        t0 = time.monotonic()
        c.retire(lost)
        _wait(lambda: all(status(i)["tree"]["nodes"] == n for i in c.live()), "one node fewer counted everywhere")
        retired = time.monotonic() - t0
        return {"join_s": join, "dead_s": dead, "healed_s": healed, "retired_s": retired}
    finally:
        c.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--trials", type=int, default=5)
    a = ap.parse_args()
    from etcd_server import etcd_missing

    kinds = [_Peers]
    why = etcd_missing()
    if why:
        print(f"bench_membership: etcd rows left out: {why}", file=sys.stderr)
    else:
        kinds.append(_Etcd)
    results: dict[str, list[dict]] = {}
    for k in range(a.trials):  # the sources take turns, so both see the same load over the run
        for kind in kinds:
            with tempfile.TemporaryDirectory(prefix="bench-membership-") as d:
                r = trial(kind, pathlib.Path(d), a.nodes)
            results.setdefault(kind.name, []).append(r)
            print(f"  {kind.name} trial {k + 1}: " + ", ".join(f"{x} {v:.2f}" for x, v in r.items()), file=sys.stderr)
    print(f"{a.nodes} agents on loopback (simulated nodes), heartbeat 0.2 s, dead_after 3 s, {a.trials} trials; "
          "seconds, median / max\n")
    names = list(results)
    print("| from the change until | " + " | ".join(names) + (" | etcd / peers file (medians) |" if len(names) > 1
                                                               else " |"))
    print("|---" * (len(names) + 1 + (len(names) > 1)) + "|")
    for label, key in (("join: every agent counts and answers the new node", "join_s"),
                       ("loss: every other agent marks the node dead", "dead_s"),
                       ("loss: every rank's shard has 2 copies again (heal)", "healed_s"),
                       ("retire: every agent counts one node fewer", "retired_s")):
        cells = []
        meds = []
        for name in names:
            v = [r[key] for r in results[name]]
            meds.append(statistics.median(v))
            cells.append(f"{meds[-1]:.2f} / {max(v):.2f}")
        ratio = f" | {meds[1] / meds[0]:.2f}x" if len(meds) > 1 and meds[0] > 0 else ""
        print(f"| {label} | " + " | ".join(cells) + ratio + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
