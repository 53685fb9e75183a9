"""What ``ckpt list JOB`` reads and how long it takes, for a job of many committed steps on disk and in S3.

    python benchmarks/bench_list.py [--steps 1000] [--world 2] [--shard-bytes 64] [--runs 3] [--scan] [--no-index]

Writes ``--steps`` committed steps of one job (``--world`` small shards each, a version-2 manifest last) into a
disk folder and into a bucket of a moto S3 server started for the run (reached over HTTP), and each place's
step index as a rebuild from a scan would (unless ``--no-index``), then runs the
``ckpt list`` command as a user would (a new process per run) against each tier alone. Measured per tier:
wall seconds of the whole command (interpreter start included; median of ``--runs``), the manifests and
index objects it opened (disk: the process's own ``open`` calls, seen by an audit hook) or the S3 requests
it sent, by kind (the server's request log). ``--scan`` passes ``--scan`` to ``ckpt list`` (the command
reads every manifest, as it did before the per-job index); an older ``ckpt`` without the flag always scans.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from procs import ckpt_counting_opens  # noqa: E402
from s3util import FAKE_AWS_ENV, server_log_size, server_requests, start_moto_server, stop_moto_server  # noqa: E402
from steps import commit_steps  # noqa: E402
from tiers.disk import DiskTier  # noqa: E402

JOB = "bench-list"
BUCKET = "bench-list"

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--shard-bytes", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--scan", action="store_true", help="pass --scan to ckpt list")
    ap.add_argument("--no-index", action="store_true", help="write no step index (as a tierckpt without one did)")
    a = ap.parse_args()
    os.environ.update(FAKE_AWS_ENV)
    proc, url = start_moto_server()
    report: dict = {"steps": a.steps, "world": a.world, "scan_flag": a.scan, "index": not a.no_index}
    try:
        import boto3

        from tiers.s3 import S3Tier

        boto3.client("s3", endpoint_url=url, region_name="us-east-1").create_bucket(Bucket=BUCKET)
        with tempfile.TemporaryDirectory() as tmp:
            disk = os.path.join(tmp, "disk")
            t0 = time.perf_counter()
            commit_steps(DiskTier(disk, durable=False), JOB, range(a.steps), a.world, a.shard_bytes, threads=4,
                         index=not a.no_index)
            with S3Tier(BUCKET, "ckpt", endpoint_url=url) as s3:
                commit_steps(s3, JOB, range(a.steps), a.world, a.shard_bytes, threads=16, index=not a.no_index)
            report["populate_s"] = round(time.perf_counter() - t0, 1)
            nowhere = ["--shm", os.path.join(tmp, "no-memory"), "--socket", os.path.join(tmp, "no-agent.sock")]
            flags = ["--scan"] if a.scan else []
            for name, where in (("disk", ["--disk", disk]),
                                ("s3", ["--s3", f"s3://{BUCKET}/ckpt", "--s3-endpoint", url])):
                walls, counts = [], {}
                for _ in range(a.runs):
                    start = server_log_size(proc)
                    t0 = time.perf_counter()
                    p, opened = ckpt_counting_opens("list", JOB, *flags, *nowhere, *where)
                    walls.append(time.perf_counter() - t0)
                    rows = [ln for ln in p.stdout.splitlines()[2:] if ln.strip()]
                    counts = opened if name == "disk" else server_requests(proc, start)
                report[name] = {"wall_s": round(statistics.median(walls), 2), "exit": p.returncode,
                                "rows": len(rows), "read": counts,
                                "notes": p.stderr.splitlines()}
    finally:
        stop_moto_server(proc)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
