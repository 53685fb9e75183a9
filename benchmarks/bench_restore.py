"""Restore time per tier for a ~1 GiB state, against a memory copy, raw loopback TCP and DCP load.

    python benchmarks/bench_restore.py [--size-gib 0.25,1.0] [--runs 5]

One checkpoint of a GPT-like model + AdamW state is saved through a node agent that has a peer, a disk
folder and an S3 endpoint (moto's server on 127.0.0.1). Then:

1. the data path: the same step is restored into a fresh state from each tier alone (read,
   checksum-verify, copy into the tensors, load the state dicts), median of ``--runs``;
2. recovery, from restart to the first training step: what a restarted trainer pays, per tier, once
   its process and model exist: connect to the node's agent (``Checkpointer(...)``), ``restore()``
   (inventory of every tier the agent names, plan, fetch, verify, load) and one training step. Each
   tier is the only one that holds the step for the agent the trainer talks to: the saving node's
   agent (local memory), a third node's agent with no copy of its own (peer memory), an agent with
   only the disk folder, an agent with only the S3 prefix. DCP's row is ``dcp.load`` from a local
   folder plus the same step.

Baselines from the same run: a copy of the same tensors between two warm buffers (the bound for a
memory restore), a raw socket ``sendfile`` → ``recv_into`` of the same bytes between two processes
(the bound for a peer restore), and ``dcp.load`` from a local folder. Process start, ``import torch``
and building the model are the same whatever the tier and are left out.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

# DCP's baseline runs without a process group on purpose; its warning about that says nothing here
warnings.filterwarnings("ignore", message="torch.distributed is disabled")

from _common import build_state  # noqa: E402
from bench_replication import cluster_files, launch_agent, raw_socket, start_agent  # noqa: E402
from ckpt._demo import start_local_s3  # noqa: E402


NO_KEEP = "memory, keep_state=False"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", default="0.25,1.0", help="state sizes, comma-separated (GiB)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tiers", default="memory,peer,disk,s3",
                    help="tiers to restore from (each needs agents of its own, holding a staging ring of about "
                         "4x the state: at 1 GiB on a 24 GiB machine, run memory,disk and peer,s3 apart)")
    a = ap.parse_args()
    chosen = [t for t in a.tiers.split(",") if t]
    if "memory" not in chosen or not set(chosen) <= {"memory", "peer", "disk", "s3"}:
        ap.error("--tiers: memory and any of peer, disk, s3")
    sizes = [float(x) for x in a.size_gib.split(",")]
    for size in sizes:
        run_size(size, a.runs, chosen)
    return 0


def _plain_ranged_gets(endpoint: str, bucket: str, key: str, runs: int, threads: int = 8) -> list[float]:
    """Seconds to read ``key`` by parallel ranged ``get_object`` calls into one buffer, ``runs`` times.

    The object is cut into ranges the way the S3 tier cuts a read (one range per thread, none under 8 MiB
    nor over 64 MiB), so the two differ only in what the tier adds (checksums, tensors), not in range
    sizes: an S3-compatible server in Python slows down with many small ranges of one large object."""
    import concurrent.futures as cf

    import boto3
    from botocore.config import Config

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                          config=Config(max_pool_connections=threads))
    size = client.head_object(Bucket=bucket, Key=key)["ContentLength"]
    part = max(8 << 20, min(64 << 20, -(-size // threads)))
    buf = memoryview(bytearray(size))

    def one(lo: int) -> None:
        hi = min(size, lo + part) - 1
        body = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={lo}-{hi}")["Body"]
        at = lo
        while at <= hi:
            chunk = body.read(min(1 << 20, hi + 1 - at))
            if not chunk:
                raise OSError(f"{key} ended at {at}")
            buf[at:at + len(chunk)] = chunk
            at += len(chunk)

    out = []
    with cf.ThreadPoolExecutor(threads) as pool:
        for run in range(runs + 1):
            t0 = time.perf_counter()
            list(pool.map(one, range(0, size, part)))
            if run:
                out.append(time.perf_counter() - t0)
    return out


def _mm(xs: list[float]) -> str:
    """``median / max`` seconds of ``xs``."""
    return f"{statistics.median(xs):.3f} / {max(xs):.3f}"


def run_size(size_gib: float, runs: int, chosen: list[str]) -> None:
    """Every table for one state size (see the module docstring)."""
    import ckpt
    from recovery import plan_restore, scan_tiers
    from tiers import DiskTier, MemoryTier, keys
    from tiers.peer import PeerTier
    from tiers.wire import load_secret
    from tiers.s3 import S3Tier

    work = tempfile.mkdtemp(prefix="bench-restore-", dir="/dev/shm")
    disk = tempfile.mkdtemp(prefix="bench-restore-disk-")
    procs: list[subprocess.Popen] = []
    try:
        moto, endpoint = start_local_s3("bench")
        procs.append(moto)
        ports, peers, secret = cluster_files(work, 3)
        shms = [os.path.join(work, f"node{i}", "shm") for i in range(3)]
        lower = ["--disk", disk] + (["--s3", "s3://bench/c", "--s3-endpoint", endpoint] if "s3" in chosen else [])
        procs += [start_agent(shms[i], peers, i, secret, *lower) for i in range(2)]
        # node 2 holds no copy: its trainer reads node 0's (or node 1's) memory over loopback
        if "peer" in chosen:
            procs.append(start_agent(shms[2], peers, 2, secret, "--no-prefetch"))
        only = {"disk": ["--disk", disk], "s3": ["--s3", "s3://bench/c", "--s3-endpoint", endpoint]}
        only = {k: v for k, v in only.items() if k in chosen}
        for name, args in only.items():
            procs.append(launch_agent(os.path.join(work, f"only-{name}", "shm"), "agent.log", *args))
        recovery_shm = {"memory": shms[0], "peer": shms[2], "disk": os.path.join(work, "only-disk", "shm"),
                        "s3": os.path.join(work, "only-s3", "shm")}
        recovery_shm = {k: v for k, v in recovery_shm.items() if k in chosen}

        ts = build_state(size_gib)
        state = {"model": ts.model, "optim": ts.optim}
        with ckpt.Checkpointer("bench", shm=shms[0], spawn=False) as ck:
            ck.save(0, state).wait()
        time.sleep(1.0)
        target_ts = build_state(size_gib, seed=1)
        target = {"model": target_ts.model, "optim": target_ts.optim}
        tensors = ts.tensors()
        nbytes = sum(t.numel() * t.element_size() for t in tensors)

        # bound for a memory restore: the same tensors copied between two warm buffers
        dst = [torch.empty_like(t) for t in tensors]
        copies = []
        for _ in range(runs + 1):
            t0 = time.perf_counter()
            for d, s in zip(dst, tensors):
                d.copy_(s)
            copies.append(time.perf_counter() - t0)
        del dst
        src = os.path.join(work, "raw.bin")
        with open(src, "wb") as f:
            f.write(os.urandom(1 << 20) * (nbytes >> 20))
        raw = raw_socket(src, (nbytes >> 20) << 20, runs)
        raw_gbps = ((nbytes >> 20) << 20) / statistics.median(raw) / 1e9
        os.unlink(src)

        import torch.distributed.checkpoint as dcp

        dcp_dir = os.path.join(disk, "dcp")
        sd = {"model": ts.model.state_dict(), "optim": ts.optim.state_dict()}
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(dcp_dir), no_dist=True)
        dcp_times = []
        for _ in range(runs + 1):
            tgt = {"model": target_ts.model.state_dict(), "optim": target_ts.optim.state_dict()}
            t0 = time.perf_counter()
            dcp.load(tgt, storage_reader=dcp.FileSystemReader(dcp_dir), no_dist=True)
            dcp_times.append(time.perf_counter() - t0)

        secret_bytes = load_secret(secret)
        tiers = {"memory": MemoryTier(shms[0]),
                 "peer": PeerTier(f"127.0.0.1:{ports[1]}", secret=secret_bytes, node=0, timeout=120),
                 "disk": DiskTier(disk), "s3": S3Tier("bench", "c", endpoint_url=endpoint)}
        tiers = {k: v for k, v in tiers.items() if k in chosen}
        results: dict[str, list[float]] = {name: [] for name in tiers}
        with ckpt.Checkpointer("bench", shm=shms[0], spawn=False) as ck:
            plans = {name: plan_restore(scan_tiers([tier], "bench"), "bench", 0) for name, tier in tiers.items()}
            # round robin over the tiers, so drift in the machine's load spreads over all of them
            for run in range(runs + 1):
                for name, plan in plans.items():
                    t0 = time.perf_counter()
                    report = ck._loader.load(plan, target)
                    took = time.perf_counter() - t0
                    assert report.tier == name, report
                    if run:
                        results[name].append(took)
        for a_, b_ in zip(ts.model.state_dict().values(), target_ts.model.state_dict().values()):
            assert torch.equal(a_, b_)
        # bound for an S3 restore: the same shard's bytes by plain parallel ranged get_object calls through
        # boto3 against the same endpoint, into one buffer (no checksum, no tensors)
        s3_plain: list[float] = []
        if "s3" in chosen:
            s3_plain = _plain_ranged_gets(endpoint, "bench", f"c/{keys.shard_key('bench', 0, 0)}", runs)

        # recovery: from a restarted trainer's first call to the end of its first training step
        target_ts.set_batch(*ts.batch)
        # "memory, keep_state=False": the same restore without the copy of the CPU tensors kept to put back
        # if it fails (what that safety net costs)
        recovery: dict[str, list[float]] = {name: [] for name in (*recovery_shm, NO_KEEP, "dcp")}
        restore_only: dict[str, list[float]] = {name: [] for name in recovery}
        connect: list[float] = []
        for run in range(runs + 1):
            for name, shm in [*recovery_shm.items(), (NO_KEEP, recovery_shm["memory"])]:
                t0 = time.perf_counter()
                with ckpt.Checkpointer("bench", shm=shm, spawn=False) as ck:
                    if run and name == "memory":
                        connect.append(time.perf_counter() - t0)
                    assert ck.restore(target, keep_state=name != NO_KEEP) == 0
                    t1 = time.perf_counter()
                    assert ck.last_restore.tiers == [name.split(",")[0]], (name, ck.last_restore.shards)
                    target_ts.step()
                    took = time.perf_counter() - t0
                if run:
                    recovery[name].append(took)
                    restore_only[name].append(t1 - t0)
            t0 = time.perf_counter()
            tgt = {"model": target_ts.model.state_dict(), "optim": target_ts.optim.state_dict()}
            dcp.load(tgt, storage_reader=dcp.FileSystemReader(dcp_dir), no_dist=True)
            target_ts.model.load_state_dict(tgt["model"])
            target_ts.optim.load_state_dict(tgt["optim"])
            t1 = time.perf_counter()
            target_ts.step()
            if run:
                recovery["dcp"].append(time.perf_counter() - t0)
                restore_only["dcp"].append(t1 - t0)

        med = {k: statistics.median(v) for k, v in results.items()}
        bound = statistics.median(copies[1:])
        dcp_med = statistics.median(dcp_times[1:])
        print(f"\n{os.cpu_count()} cores, torch {torch.__version__}, state {nbytes / 2**30:.2f} GiB in "
              f"{len(tensors)} tensors, {runs} runs each (median / max); disk and DCP reads are from the page "
              "cache\n")
        print("| restore from | s, median / max | GB/s (median) | compared with (medians) |")
        print("|---|---|---|---|")
        print(f"| memory copy of the tensors (bound) | {_mm(copies[1:])} | {nbytes / bound / 1e9:.2f} | |")
        print(f"| raw loopback socket (bound for peer) | {_mm(raw)} | {raw_gbps:.2f} | |")
        print(f"| DCP load, local folder | {_mm(dcp_times[1:])} | {nbytes / dcp_med / 1e9:.2f} | |")
        for name in [n for n in ("memory", "peer", "disk", "s3") if n in chosen]:
            t = med[name]
            gbps = nbytes / t / 1e9
            vs = {"memory": f"{t / bound:.2f}x the memory copy's time",
                  "peer": f"{gbps / raw_gbps:.2f}x raw socket's speed",
                  "disk": f"{dcp_med / t:.2f}x DCP load's speed",
                  "s3": ""}[name]
            print(f"| tierckpt {name} | {_mm(results[name])} | {gbps:.2f} | {vs} |")
        if s3_plain:
            print(f"| plain ranged get_object, 8 threads (bound for S3) | {_mm(s3_plain)} | "
                  f"{nbytes / statistics.median(s3_plain) / 1e9:.2f} | tierckpt S3 at "
                  f"{statistics.median(s3_plain) / med['s3']:.2f}x its speed |")
        print("\nEach tierckpt row: read + verify every checksum + copy into the tensors + load the state dicts.")
        rmed = {k: statistics.median(v) for k, v in recovery.items()}
        print("\nRecovery, restart to first training step (connect + restore() + one step), "
              f"{runs} runs (median / max):\n")
        print("| restore from | to first step s | of which connect + restore() s | compared with DCP (medians) |")
        print("|---|---|---|---|")
        for name in [n for n in ("memory", NO_KEEP, "peer", "disk", "s3", "dcp") if n in recovery]:
            label = "get_state_dict + DCP load + set_state_dict, local folder" if name == "dcp" \
                else f"tierckpt {name}"
            vs = "" if name == "dcp" else (f"{rmed['dcp'] / rmed[name]:.2f}x faster to the first step; restore "
                                          f"{statistics.median(restore_only['dcp']) / statistics.median(restore_only[name]):.2f}x")
            print(f"| {label} | {_mm(recovery[name])} | {_mm(restore_only[name])} | {vs} |")
        print(f"\nconnect to a running agent (Checkpointer(...)): {_mm(connect)} s")
        if "peer" in rmed and "s3" in rmed:
            print(f"peer recovery is {rmed['s3'] / rmed['peer']:.1f}x faster than S3's")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(60)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
