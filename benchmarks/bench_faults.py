"""Network faults under a real cluster layout: agents in Linux network namespaces, links taken down and split.

    sudo python benchmarks/bench_faults.py [--nodes 4] [--memory-nodes 1] [--trials 5] [--outage 30]
        [--faults blip,split,replace]

Each trial starts ``--nodes`` agents, one per namespace, each bound to its own address on a bridge, with
every setting at its default (heartbeat 1 s, dead_after 5 s, start-up grace 120 s), and one rank per node
(this process plays the trainers without torch: 1 MiB shards through the agents' sockets). Step 1 commits
everywhere, then the fault lasts ``--outage`` seconds while every rank saves step 2:

* ``blip``: the last node's link is down;
* ``split``: the nodes are cut into two halves;
* ``etcd``: membership from a 3-member etcd (loopback, the tests' cluster settings), all of etcd down for
  ``--outage`` s while every rank saves every 2 s; counted: saves committed, saves failed, deaths;
* ``etcd-replace``: the same with membership from etcd (loopback): no file is edited, the new agent registers;
* ``replace``: the last node's machine is lost (agent killed, memory gone) and a new machine at a new address
  takes its line of the peers file (no outage wait); timed: until every running agent answers it at the new
  address, and until its agent holds its ranks' shards again from its partner's memory (warm restore).

Then the network is back, and step 3 is saved. Per trial it counts: healthy nodes declared dead by a healthy
node (a node on the same side of the fault), epochs with two roots, steps committed with fewer than every
rank (a manifest on a node during the outage that the fault should have held back), steps with two
different manifests, requests refused as late ("request timestamp is ... off"); and it times how long after
the network came back step 2 was committed on every node, against 2 x dead_after. Needs root (namespaces);
the kernel's netem is not used.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

DEAD_AFTER = 5.0  # the default


def etcd_trial(nodes: int, outage: float, root: pathlib.Path) -> dict:
    """Membership from a 3-member etcd; all of etcd is down for ``outage`` s while every rank saves every 2 s."""
    import test_e2e_etcd as te

    c = te.EtcdCluster(root, nodes, members=3)
    try:
        step, failed, saved = 1, 0, 0
        c.stage("etcd", step, list(range(nodes)))
        c.wait_for(lambda: all(c.manifest(i, "etcd", 1) for i in range(nodes)), "step 1 on every node")
        for i in range(3):
            c.etcd.stop(i)
        t0 = time.monotonic()
        while time.monotonic() - t0 < outage:
            step += 1
            try:
                c.stage("etcd", step, list(range(nodes)))
                c.wait_for(lambda s=step: all(c.manifest(i, "etcd", s) for i in range(nodes)), f"step {step}",
                           timeout=60)
                saved += 1
            except AssertionError:
                failed += 1
            time.sleep(2.0)
        for i in range(3):
            c.etcd.start(i, wait=False)
        for i in range(3):
            c.etcd.wait_ready(i)
        c.wait_for(lambda: all(c.status(i)["etcd"]["outage_s"] is None for i in range(nodes)), "etcd back",
                   timeout=120)
        deaths = sum(len(re.findall(r"node \d+ \(\S+\) declared dead", c.log(i))) for i in range(nodes))
        return {"saved": saved, "failed": failed, "false_deaths": deaths}
    finally:
        c.close()


def etcd_replace_trial(nodes: int, root: pathlib.Path) -> dict:
    """Membership from etcd (one member, loopback): the last node's machine is lost and a new agent with its
    rank registers at a new address. Timed: until every running agent answers it there, through the watch."""
    import test_e2e_etcd as te
    from procs import agent_call

    c = te.EtcdCluster(root, nodes, members=1)
    try:
        c.stage("er", 1, list(range(nodes)))
        c.wait_for(lambda: all(c.manifest(i, "er", 1) for i in range(nodes)), "step 1 on every node")
        last = nodes - 1
        t0 = time.monotonic()
        c.replace(last)
        started = time.monotonic() - t0
        new = f"127.0.0.1:{c.ports[last]}"
        c.wait_for(lambda: all(p["addr"] == new and p["alive"] for i in range(last)
                               for p in c.status(i)["peers"] if p["node"] == last), "new address seen")
        seen = time.monotonic() - t0
        warm = agent_call(c.shm(last), "prefetch", timeout=300)["seconds"]
        c.stage("er", 2, list(range(nodes)))
        c.wait_for(lambda: all(c.manifest(i, "er", 2) for i in range(nodes)), "step 2 on every node")
        return {"agent_start_s": started, "seen_s": seen, "warm_s": warm, "resumed": True}
    finally:
        c.close()


def replace_trial(nodes: int, root: pathlib.Path) -> dict:
    import test_e2e_netns as t
    from procs import agent_call

    t.ARGS = ["--startup-grace", "10"]
    c = t.NetCluster(root, nodes)
    try:
        c.stage("rep", 1)
        c.wait_for(lambda: c.committed_everywhere("rep", 1), "step 1 on every node", timeout=120)
        last = nodes - 1
        t0 = time.monotonic()
        c.replace(last)
        started = time.monotonic() - t0
        new = f"{c.hosts.addr(c.host(last))}:{t.PORT}"
        c.wait_for(lambda: all(p["addr"] == new and p["alive"] for i in range(last)
                               for p in c.status(i)["peers"] if p["node"] == last), "new address seen")
        seen = time.monotonic() - t0
        rep = agent_call(c.shm(last), "prefetch", timeout=300)
        warm = rep["seconds"]  # the warm restore's own duration, from the agent's start
        c.stage("rep", 2)
        c.wait_for(lambda: c.committed_everywhere("rep", 2), "step 2 on every node", timeout=120)
        return {"agent_start_s": started, "seen_s": seen, "warm_s": warm, "warm_steps": rep.get("steps"),
                "resumed": True}
    finally:
        c.close()


def trial(fault: str, nodes: int, outage: float, root: pathlib.Path, memory: int = 0) -> dict:
    import test_e2e_netns as t

    t.ARGS = []  # every setting at its default
    c = t.NetCluster(root, nodes + memory, memory=memory)
    try:
        c.stage(fault, 1)
        c.wait_for(lambda: c.committed_everywhere(fault, 1), "step 1 on every node", timeout=120)
        # the blip cuts the last training node; the split puts the second half of the training nodes and the
        # memory nodes on one side
        side = {nodes - 1} if fault == "blip" else set(range(nodes // 2, nodes + memory))
        if fault == "blip":
            c.hosts.link(nodes - 1, up=False)
        else:
            c.hosts.partition(side)
        t0 = time.monotonic()
        c.stage(fault, 2)
        # step 2 needs every rank's row, and rank `side`'s cannot reach a root: any manifest of it during the
        # outage would be a commit without every rank
        early = 0
        while time.monotonic() - t0 < outage:
            early += sum(c.manifest(i, fault, 2) is not None for i in range(nodes + memory))
            time.sleep(0.5)
        blocked = [i for i in range(nodes + memory) if c.status(i)["tree"]["blocked"]]
        if fault == "blip":
            c.hosts.link(nodes - 1, up=True)
        else:
            c.hosts.heal()
        heal_s = c.wait_for(lambda: c.committed_everywhere(fault, 2), "step 2 on every node", timeout=300)
        c.stage(fault, 3)
        c.wait_for(lambda: c.committed_everywhere(fault, 3), "step 3 on every node", timeout=120)
        rest = set(range(nodes + memory)) - side
        false = c.false_deaths(rest) + c.false_deaths(side)
        roots: dict[int, set[int]] = {}
        for i in range(nodes + memory):
            for e in c.status(i)["tree"]["won_epochs"]:
                roots.setdefault(e, set()).add(i)
        two_manifests = sum(len({c.manifest(i, fault, s) for i in range(nodes + memory)} - {None}) > 1
                            for s in (1, 2, 3))
        late = sum(len(re.findall(r"request timestamp is", c.log(i))) for i in range(nodes + memory))
        return {"false_deaths": len(false), "two_roots": sum(len(r) > 1 for r in roots.values()),
                "partial": early, "two_manifests": two_manifests,
                "late_refused": late, "heal_s": heal_s, "blocked": len(blocked), "resumed": True}
    finally:
        c.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--outage", type=float, default=30.0)
    ap.add_argument("--faults", default="blip,split")
    ap.add_argument("--memory-nodes", type=int, default=0, help="memory-only nodes beside the training nodes")
    a = ap.parse_args()
    from netns import unavailable

    why = unavailable()
    if why:
        print(f"bench_faults: cannot run here: {why}")
        return 2
    print(f"{a.nodes} training nodes and {a.memory_nodes} memory-only in network namespaces, one agent each at "
          f"default settings (dead_after "
          f"{DEAD_AFTER:.0f} s), outage {a.outage:.0f} s, {a.trials} trials per fault\n")
    print("| fault | trials | healthy declared dead | epochs with 2 roots | partial-world commits | steps with 2 manifests"
          " | late requests refused | step 2 everywhere after the network is back, s median / max | within 2 x "
          "dead_after | checkpointing resumed |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    faults = a.faults.split(",")
    for fault in [f for f in faults if f not in ("replace", "etcd", "etcd-replace")]:
        runs = []
        for k in range(a.trials):
            with tempfile.TemporaryDirectory(prefix="bench-faults-") as d:
                runs.append(trial(fault, a.nodes, a.outage, pathlib.Path(d), a.memory_nodes))
            print(f"  {fault} trial {k + 1}: {runs[-1]}", file=sys.stderr)
        heal = [r["heal_s"] for r in runs]
        print(f"| {fault} | {len(runs)} | {sum(r['false_deaths'] for r in runs)} | {sum(r['two_roots'] for r in runs)} | "
              f"{sum(r['partial'] for r in runs)} | {sum(r['two_manifests'] for r in runs)} | "
              f"{sum(r['late_refused'] for r in runs)} | {statistics.median(heal):.1f} / {max(heal):.1f} | "
              f"{sum(h <= 2 * DEAD_AFTER for h in heal)}/{len(heal)} | {sum(r['resumed'] for r in runs)}/{len(runs)} |")
    if "etcd" in faults:
        runs = []
        for k in range(a.trials):
            with tempfile.TemporaryDirectory(prefix="bench-faults-") as d:
                runs.append(etcd_trial(a.nodes, a.outage, pathlib.Path(d)))
            print(f"  etcd trial {k + 1}: {runs[-1]}", file=sys.stderr)
        print(f"\n| etcd (3 members) down {a.outage:.0f} s, membership from etcd | trials | saves committed everywhere "
              "during the outage | saves failed | nodes declared dead |\n|---|---|---|---|---|")
        print(f"| all members down | {len(runs)} | {sum(r['saved'] for r in runs)} | {sum(r['failed'] for r in runs)} | "
              f"{sum(r['false_deaths'] for r in runs)} |")
    for kind, fn, what in (("replace", replace_trial, "peers file, network namespaces"),
                           ("etcd-replace", etcd_replace_trial, "etcd watch, loopback, heartbeat 0.2 s")):
        if kind not in faults:
            continue
        runs = []
        for k in range(a.trials):
            with tempfile.TemporaryDirectory(prefix="bench-faults-") as d:
                runs.append(fn(a.nodes, pathlib.Path(d)))
            print(f"  {kind} trial {k + 1}: {runs[-1]}", file=sys.stderr)
        print(f"\n| node replaced at a new address ({what}) | median / max, s |\n|---|---|")
        for name, key in (("its agent up", "agent_start_s"), ("its warm restore (shards back from the partner's memory)", "warm_s"),
                          ("every running agent answers it at the new address", "seen_s")):
            v = [r[key] for r in runs]
            print(f"| {name} | {statistics.median(v):.2f} / {max(v):.2f} |")
        print(f"| checkpointing resumed | {sum(r['resumed'] for r in runs)}/{len(runs)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
