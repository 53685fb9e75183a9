"""What ``ckpt list JOB`` reads and how long it takes, for a job of many committed steps on disk and in S3.

    python benchmarks/bench_list.py [--steps 1000] [--world 2] [--shard-bytes 64] [--runs 3] [--scan]

Writes ``--steps`` committed steps of one job (``--world`` small shards each, a version-2 manifest last) into a
disk folder and into a bucket of a moto S3 server started for the run (reached over HTTP), then runs the
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
import re
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from s3util import FAKE_AWS_ENV, start_moto_server, stop_moto_server  # noqa: E402
from tiers import keys  # noqa: E402
from tiers.checksum import checksum_bytes  # noqa: E402
from tiers.disk import DiskTier  # noqa: E402
from tiers.manifest import Manifest, ShardInfo  # noqa: E402

JOB = "bench-list"
BUCKET = "bench-list"

#: run inside the measured process: counts the manifest and index files it opens, prints them at exit
_COUNTING = """
import atexit, json, sys
opened = {"manifests": 0, "indexes": 0}
def hook(event, args):
    if event == "open" and isinstance(args[0], str):
        if args[0].endswith("/manifest.json"): opened["manifests"] += 1
        elif args[0].endswith("/index.json"): opened["indexes"] += 1
sys.addaudithook(hook)
atexit.register(lambda: print("OPENED " + json.dumps(opened), file=sys.stderr))
from ckpt.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _populate(tier, steps: int, world: int, shard_bytes: int, threads: int) -> None:
    def one(step: int) -> None:
        shards = []
        for r in range(world):
            data = bytes([step % 251, r]) * (shard_bytes // 2)
            tier.put(keys.shard_key(JOB, step, r), data)
            shards.append(ShardInfo(r, len(data), checksum_bytes(data), node=r, layout="0" * 32))
        m = Manifest(JOB, step, world, tuple(shards), {"save_index": step})
        tier.put(keys.manifest_key(JOB, step), m.to_bytes())

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(steps)))


def _run(args: list[str], env: dict) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", _COUNTING, *args], capture_output=True, text=True, env=env,
                       timeout=600)
    return time.perf_counter() - t0, p


def _s3_requests(log, start: int) -> dict[str, int]:
    log.seek(start)
    out: dict[str, int] = {}
    for line in log.read().decode(errors="replace").splitlines():
        line = re.sub(r"\x1b\[[0-9;]*m", "", line)  # the server colours some status lines
        m = re.search(r'"(GET|HEAD|PUT|DELETE|POST) /[^ ]*?(\?list-type=2[^ ]*)? HTTP', line)
        if m:
            kind = "LIST" if m.group(2) else m.group(1)
            out[kind] = out.get(kind, 0) + 1
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--shard-bytes", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--scan", action="store_true", help="pass --scan to ckpt list")
    a = ap.parse_args()
    env = dict(os.environ, **FAKE_AWS_ENV, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    os.environ.update(FAKE_AWS_ENV)
    proc, url = start_moto_server()
    report: dict = {"steps": a.steps, "world": a.world, "scan_flag": a.scan}
    try:
        import boto3

        from tiers.s3 import S3Tier

        boto3.client("s3", endpoint_url=url, region_name="us-east-1").create_bucket(Bucket=BUCKET)
        with tempfile.TemporaryDirectory() as tmp:
            disk = os.path.join(tmp, "disk")
            t0 = time.perf_counter()
            _populate(DiskTier(disk, durable=False), a.steps, a.world, a.shard_bytes, 4)
            with S3Tier(BUCKET, "ckpt", endpoint_url=url) as s3:
                _populate(s3, a.steps, a.world, a.shard_bytes, 16)
            report["populate_s"] = round(time.perf_counter() - t0, 1)
            nowhere = ["--shm", os.path.join(tmp, "no-memory"), "--socket", os.path.join(tmp, "no-agent.sock")]
            flags = ["--scan"] if a.scan else []
            for name, where in (("disk", ["--disk", disk]),
                                ("s3", ["--s3", f"s3://{BUCKET}/ckpt", "--s3-endpoint", url])):
                walls, counts = [], {}
                for _ in range(a.runs):
                    start = os.fstat(proc.log.fileno()).st_size
                    wall, p = _run(["list", JOB, *flags, *nowhere, *where], env)
                    rows = [ln for ln in p.stdout.splitlines()[2:] if ln.strip()]
                    opened = json.loads(p.stderr.split("OPENED ", 1)[1].splitlines()[0])
                    time.sleep(0.2)  # let the server flush its log
                    counts = opened if name == "disk" else _s3_requests(proc.log, start)
                    walls.append(wall)
                report[name] = {"wall_s": round(statistics.median(walls), 2), "exit": p.returncode,
                                "rows": len(rows), "read": counts,
                                "notes": [ln for ln in p.stderr.splitlines() if not ln.startswith("OPENED")]}
    finally:
        stop_moto_server(proc)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
