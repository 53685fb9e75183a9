"""Bytes per step in each tier for an HSDP job with R replica groups: what each chunk costs once, against today.

    python benchmarks/bench_dedup.py [--dim 256] [--steps 3] [--replicas 1,2,4] [--no-whole] [--mode ddp]

A real job (tests/mesh_job.py: FSDP2 ``fully_shard`` on a (replicate=R, shard=4/R) mesh, 4 ranks, gloo)
on two simulated nodes of 2 ranks, each with its own agent and shared-memory folder on loopback, every
step saved to memory, a peer, the node's disk and S3 (moto's server on 127.0.0.1, over HTTP). For the
last step it measures, from the objects each place holds:

* unique: the bytes of every distinct chunk once (what the ranks computed as owners), plus values;
* memory: every rank's whole shard (each replica holds its copy: R x unique);
* S3: the shard objects in the bucket (each rank's durable part) -- and what S3 held before each chunk was
  written once, which is every rank's whole shard, the memory figure of the same run;
* disk: the shards on the nodes' disks: each rank's durable part (each chunk once across the job's disks),
  against the same job run with ``--disk-whole`` in the same invocation (each rank's whole shard on its node's
  disk, as before each chunk was written once);
* disk restore: both nodes restart without their memory and every rank restores the last step from disk:
  each rank's ``restore()`` in seconds (median and worst of the 4 ranks), each rank's durable part from its own
  disk and its replicas' chunks from the other node's disk through its agent, against ``--disk-whole``, where
  every rank reads its whole shard from its own disk;
* peer: the copies each node's memory holds for the other node's ranks: whole shards, or only a shard's
  unique part (``rank-R.head``) where the job's own data-parallel replicas already keep the asked-for two
  copies of every replicated chunk on distinct nodes -- against what it held before that rule, every
  other node's whole shard (the memory figure of the same run, two nodes each copying to the other).

``--mode ddp``: the same for ``DistributedDataParallel`` on the 4 ranks (R = 4), its model and optimizer
described to the Checkpointer as replicated on every rank (``replicated=``); the ``--disk-whole`` run and the
"before" columns are what every rank wrote without a description.

Ratios are against unique. Scale: a model of ``--dim`` (about 100 * dim^2 bytes of parameters and AdamW
state); the ratios do not depend on it beyond alignment and values.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from _common import markdown_table  # noqa: E402
from procs import env, start_agent, write_secret  # noqa: E402
from s3util import FAKE_AWS_ENV, free_port, start_moto_server, stop_moto_server  # noqa: E402

JOB = os.path.join(ROOT, "tests", "mesh_job.py")


def _sizes(folder: str, job: str, step: int, kind: str = ".shard") -> dict[int, int]:
    d = os.path.join(folder, job, f"step-{step}")
    out = {}
    for name in os.listdir(d) if os.path.isdir(d) else []:
        if name.startswith("rank-") and name.endswith(kind):
            out[int(name[5:-len(kind)])] = os.path.getsize(os.path.join(d, name))
    return out


def run(replicas: int, dim: int, steps: int, endpoint: str, root: str, whole: bool = False,
        mode: str = "hsdp") -> dict:
    import boto3

    bucket = f"dedup-r{replicas}" + ("-whole" if whole else "")
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    ports = [free_port(), free_port()]
    peers = os.path.join(root, "peers.txt")
    with open(peers, "w") as f:
        f.write("".join(f"127.0.0.1:{p}\n" for p in ports))
    secret = write_secret(os.path.join(root, "secret"))
    shms = [os.path.join(root, f"node{n}", "shm") for n in (0, 1)]
    disks = [os.path.join(root, f"node{n}", "disk") for n in (0, 1)]
    def agents() -> list:
        out = []
        for n in (0, 1):
            os.makedirs(shms[n], exist_ok=True)
            out.append(start_agent(shms[n], "--node-rank", str(n), "--peers", peers, "--secret-file", secret,
                                   "--disk", disks[n], "--disk-every", "1", "--s3", f"s3://{bucket}/ckpt",
                                   "--s3-endpoint", endpoint, "--s3-every", "1", "--keep-memory", "1",
                                   *(["--disk-whole"] if whole else [])))
        return out

    def job(out: str, *args: str) -> None:
        port = free_port()
        running = agents()
        try:
            jobs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
                                      str(n), "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                                      "--master-port", str(port), JOB, "--mode", mode, "--replicas", str(replicas),
                                      "--dim", str(dim), "--job", "dedup", "--shm", shms[n], "--no-spawn",
                                      "--out", out, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, env=env())
                    for n in (0, 1)]
            for j in jobs:
                _, err = j.communicate(timeout=1200)
                if j.returncode:
                    raise RuntimeError(f"R={replicas}: the job failed:\n{err[-3000:]}")
        finally:
            for a in running:
                a.send_signal(signal.SIGKILL)
                a.wait(30)

    out = os.path.join(root, "report")
    job(out, "--steps", str(steps))
    rows = [json.loads(open(f"{out}.{r}").read()) for r in range(4)]
    step = steps - 1
    mem = {n: _sizes(shms[n], "dedup", step) for n in (0, 1)}
    own = {r: mem[r // 2][r] for r in range(4)}
    heads = {n: _sizes(shms[n], "dedup", step, ".head") for n in (0, 1)}
    peer = sum(size for n in (0, 1) for part in (mem[n], heads[n]) for r, size in part.items() if r // 2 != n)
    disk = sum(sum(_sizes(d, "dedup", step).values()) for d in disks)
    c = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    objs = c.list_objects_v2(Bucket=bucket, Prefix=f"ckpt/dedup/step-{step}/").get("Contents", [])
    s3 = {int(o["Key"].rsplit("rank-", 1)[1][:-6]): o["Size"] for o in objs if o["Key"].endswith(".shard")}
    unique = sum(ch["nbytes"] for row in rows for ch in row["chunks"] if ch["owner"] == row["rank"])
    disk_nodes = [sum(_sizes(d, "dedup", step).values()) for d in disks]
    # a reboot: memory gone, disks kept; every rank restores the last step
    for n in (0, 1):
        shutil.rmtree(shms[n])
    again = os.path.join(root, "again")
    job(again, "--restore-only")
    back = [json.loads(open(f"{again}.{r}").read()) for r in range(4)]
    for row in back:
        if row["restored"] != step or not set(row["tiers"]) <= {"disk", "peer-disk"}:
            raise RuntimeError(f"R={replicas}: the restore from disk did not go as planned: {row}")
    return {"replicas": replicas, "unique": unique, "memory": sum(own.values()), "s3": sum(s3.values()),
            "s3_before": sum(own.values()), "disk": disk, "peer": peer, "disk_nodes": disk_nodes,
            "s3_nodes": [s3.get(0, 0) + s3.get(1, 0), s3.get(2, 0) + s3.get(3, 0)],
            "restore": sorted(row["seconds"] for row in back)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--replicas", default="1,2,4")
    ap.add_argument("--no-whole", dest="whole", action="store_false",
                    help="skip the --disk-whole baseline runs")
    ap.add_argument("--mode", choices=("hsdp", "ddp"), default="hsdp",
                    help="ddp: DistributedDataParallel described as replicated on all 4 ranks (R = 4)")
    a = ap.parse_args()
    if a.mode == "ddp":
        a.replicas = "4"
    os.environ.update(FAKE_AWS_ENV)
    proc, endpoint = start_moto_server()
    results, whole = [], {}
    try:
        for r in [int(x) for x in a.replicas.split(",")]:
            for w in ([False, True] if a.whole else [False]):
                root = tempfile.mkdtemp(prefix=f"bench-dedup-r{r}-")
                try:
                    got = run(r, a.dim, a.steps, endpoint, root, whole=w, mode=a.mode)
                finally:
                    shutil.rmtree(root, ignore_errors=True)
                if w:
                    whole[r] = got
                else:
                    results.append(got)
                print(f"R={r}{' --disk-whole' if w else ''} done", file=sys.stderr, flush=True)
    finally:
        stop_moto_server(proc)

    def x(n: int, base: int) -> str:
        if n < 100e3:  # a few small unique parts: say how few
            return f"{n / 1e3:.1f} kB ({n / base:.4f}x)"
        return f"{n / 1e6:.2f} MB ({n / base:.2f}x)"

    table = [[str(r["replicas"]), f"{r['unique'] / 1e6:.2f} MB", x(r["memory"], r["unique"]),
              x(r["s3_before"], r["unique"]), x(r["s3"], r["unique"]),
              f"{r['s3_nodes'][0] / 1e6:.2f} / {r['s3_nodes'][1] / 1e6:.2f}",
              x(whole[r["replicas"]]["disk"], r["unique"]) if r["replicas"] in whole else "-",
              x(r["disk"], r["unique"]), f"{r['disk_nodes'][0] / 1e6:.2f} / {r['disk_nodes'][1] / 1e6:.2f}",
              x(r["memory"], r["unique"]), x(r["peer"], r["unique"])] for r in results]
    print(f"{a.mode.upper()}, 4 ranks on 2 loopback nodes, dim {a.dim}, bytes of one step (step {a.steps - 1}) per place")
    print(markdown_table(["R", "unique", "memory (all ranks)", "S3 before (whole shards)", "S3 now",
                          "S3 node 0 / node 1 MB", "disk, --disk-whole", "disk now", "disk node 0 / node 1 MB",
                          "peer copies before", "peer copies now"], table))
    print()
    print("Restore of the last step from disk after both nodes lost their memory: seconds per rank, "
          "median / worst of the 4 ranks")
    rows = []
    for r in results:
        t = r["restore"]
        row = [str(r["replicas"]), f"{(t[1] + t[2]) / 2:.3f} / {t[-1]:.3f}"]
        if r["replicas"] in whole:
            b = whole[r["replicas"]]["restore"]
            row += [f"{(b[1] + b[2]) / 2:.3f} / {b[-1]:.3f}", f"{((t[1] + t[2]) / 2) / ((b[1] + b[2]) / 2):.2f}x / "
                    f"{t[-1] / b[-1]:.2f}x"]
        else:
            row += ["-", "-"]
        rows.append(row)
    print(markdown_table(["R", "each chunk once (own disk + peer's disk)", "--disk-whole (own disk)",
                          "ratio median / worst"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
