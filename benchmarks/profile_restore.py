"""Where a restore from memory spends its time, against the copies the machine can make.

    python benchmarks/profile_restore.py [--size-gib 1.0] [--runs 5] [--shm /dev/shm]

One step of a GPT-like state is saved through an embedded agent whose memory folder is below
``--shm`` (and to a disk folder below the system's temporary directory). Then, from each tier alone,
the shard loader restores it into a second state ``--runs`` times, timed by phase:

* verify: the shard's file read through cache-sized buffers and hashed (``ShardLoader._hash_file``);
* prepare: verify, plus the name/shape checks and the values read (``_load_verified_file``);
* finish: ``preadv`` into the tensors, then the state dicts loaded (``Prepared.finish``).

Beside them, from the same run and the same files, what the machine can do with the bytes: a
copy between two warm tensors (``copy_``), ``preadv`` of the file into a warm buffer on one and
on two threads, and reading it through buffers while hashing it (the verify pass's floor).
Medians and maxima of ``--runs``.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402
import xxhash  # noqa: E402

from _common import build_state  # noqa: E402


def _mm(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} / {max(xs):.3f}"


def _timed(store: dict, name: str, fn):
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            store.setdefault(name, []).append(time.perf_counter() - t0)
    return wrapper


def _kernel_rows(path: str, size: int, runs: int) -> dict[str, list[float]]:
    """The file read by the kernel into a warm buffer (1 and 2 threads), and read while hashed."""
    dst = torch.empty(size, dtype=torch.uint8)
    dst.fill_(1)
    view = memoryview((ctypes.c_char * size).from_address(dst.data_ptr())).cast("B")
    fd = os.open(path, os.O_RDONLY)
    pool = ThreadPoolExecutor(2)
    block = 2 << 20

    def pread(lo: int, hi: int) -> None:
        at = lo
        while at < hi:
            at += os.preadv(fd, [view[at:min(hi, at + (16 << 20))]], at)

    def two() -> None:
        list(pool.map(lambda r: pread(*r), [(0, size // 2), (size // 2, size)]))

    def read_and_hash() -> None:
        ring = [memoryview(bytearray(block)) for _ in range(6)]
        h = xxhash.xxh3_64()
        pending = []
        for i, at in enumerate(range(0, size, block)):
            buf = ring[i % len(ring)][:min(block, size - at)]
            pending.append((pool.submit(os.preadv, fd, [buf], at), buf))
            if len(pending) >= len(ring) - 1:
                f, b = pending.pop(0)
                f.result()
                h.update(b)
        for f, b in pending:
            f.result()
            h.update(b)

    out: dict[str, list[float]] = {}
    try:
        for name, fn in (("preadv, 1 thread", lambda: pread(0, size)), ("preadv, 2 threads", two),
                         ("read through buffers + xxh3 (verify floor)", read_and_hash)):
            fn()
            out[name] = []
            for _ in range(runs):
                t0 = time.perf_counter()
                fn()
                out[name].append(time.perf_counter() - t0)
    finally:
        pool.shutdown()
        os.close(fd)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--shm", default="/dev/shm", help="folder the memory tier's folder is made in")
    a = ap.parse_args()
    import ckpt
    from ckpt import _load
    from recovery import plan_restore, scan_tiers
    from tiers import DiskTier, MemoryTier, keys

    shm = tempfile.mkdtemp(prefix="profile-restore-", dir=a.shm)
    disk = tempfile.mkdtemp(prefix="profile-restore-disk-")
    phases: dict[str, list[float]] = {}
    _load.ShardLoader._hash_file = _timed(phases, "verify", _load.ShardLoader._hash_file)
    _load.ShardLoader._load_verified_file = _timed(phases, "prepare", _load.ShardLoader._load_verified_file)
    _load.Prepared.finish = _timed(phases, "finish", _load.Prepared.finish)
    try:
        ts = build_state(a.size_gib)
        target_ts = build_state(a.size_gib, seed=1)
        target = {"model": target_ts.model, "optim": target_ts.optim}
        tensors = ts.tensors()
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        dst = [torch.empty_like(t) for t in tensors]
        copies = []
        for _ in range(a.runs + 1):
            t0 = time.perf_counter()
            for d, s in zip(dst, tensors):
                d.copy_(s)
            copies.append(time.perf_counter() - t0)
        del dst
        print(f"\n{os.cpu_count()} cores, torch {torch.__version__}, state {nbytes / 2**30:.2f} GiB in "
              f"{len(tensors)} tensors, {a.runs} runs (median / max s)\n")
        print("| what | memory tier | disk folder (page cache) |")
        print("|---|---|---|")
        with ckpt.Checkpointer("profile", shm=shm, disk=disk, disk_every=1) as ck:
            ck.save(0, {"model": ts.model, "optim": ts.optim}).wait()
            rows: dict[str, dict[str, list[float]]] = {}
            for name, tier in (("memory", MemoryTier(shm)), ("disk", DiskTier(disk))):
                plan = plan_restore(scan_tiers([tier], "profile"), "profile", 0)
                ck._loader.load(plan, target)  # warm
                phases.clear()
                total = []
                for _ in range(a.runs):
                    t0 = time.perf_counter()
                    rep = ck._loader.load(plan, target)
                    total.append(time.perf_counter() - t0)
                    assert rep.tier == name, rep
                rows[name] = {"verify (read + xxh3)": list(phases["verify"]),
                              "prepare (verify + checks + values)": list(phases["prepare"]),
                              "finish (preadv into the tensors + state dicts)": list(phases["finish"]),
                              "restore from the tier, total": total}
                path = tier.local_file(keys.shard_key("profile", 0, 0))
                rows[name].update(_kernel_rows(path, os.path.getsize(path), a.runs))
        for what in rows["memory"]:
            print(f"| {what} | {_mm(rows['memory'][what])} | {_mm(rows['disk'][what])} |")
        print(f"| copy between two warm tensors (bound) | {_mm(copies[1:])} | |")
        bound = statistics.median(copies[1:])
        print(f"\nrestore from memory: {statistics.median(rows['memory']['restore from the tier, total']) / bound:.2f}x "
              f"the copy's time; the two passes the machine allows (verify floor + preadv on 2 threads): "
              f"{(statistics.median(rows['memory']['read through buffers + xxh3 (verify floor)']) + statistics.median(rows['memory']['preadv, 2 threads'])) / bound:.2f}x")
        return 0
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
