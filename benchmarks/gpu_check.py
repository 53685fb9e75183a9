"""On a machine with a CUDA GPU: what a save stalls training for, against a plain copy into pinned memory,
and whether a restore brings back every byte.

    .venv/bin/python benchmarks/gpu_check.py [--size-gib 1.0] [--runs 5] [--batch 8]

The state is the GPT-like model of ``bench_save.py`` and its AdamW state, on ``cuda:0``. Rows, each the
median of ``--runs`` after warm-up saves that fill the slot ring:

- ``copy_ into pinned memory (bound)``: every tensor ``copy_(non_blocking=True)`` into a pre-allocated pinned
  host buffer, then ``torch.cuda.synchronize()``: the least a device-to-host snapshot can take;
- ``tierckpt``: ``Checkpointer.save``. "returns" is until ``save`` returns (the copies are only enqueued on
  the side stream), "staged" until every byte is in the agent's shared memory (``wait_staged``).

"stall" is what a training loop pays: save, then one training step, minus a plain step (for the bound:
copy, synchronize, step). Ratios are against the bound. Then the state is saved once more, a fresh model is
restored from that save and compared exactly with a host copy taken at the save.

Without CUDA it says so and exits 0; it exits 1 when the restore is not exact.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import GiB, build_state, fmt, machine_info, markdown_table, median, ratio  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gib", type=float, default=1.0, help="parameters + AdamW state, GiB")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8, help="sequences of 128 tokens per training step")
    ap.add_argument("--device", default="cuda", help="cpu only checks this script itself: its numbers mean nothing")
    args = ap.parse_args()
    gpu = args.device == "cuda"
    if gpu and not torch.cuda.is_available():
        print("gpu_check: skipped, no CUDA device here (torch.cuda.is_available() is False); "
              "run it on a machine with a GPU")
        return 0

    import ckpt

    sync = torch.cuda.synchronize if gpu else (lambda: None)
    ts = build_state(args.size_gib, device=args.device)
    ts.set_batch(args.batch, 128)
    state = {"model": ts.model, "optim": ts.optim}
    tensors = ts.tensors()
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    print(f"machine: {machine_info()}")
    where = f"GPU: {torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}" if gpu else "device: cpu"
    print(f"{where}; state: {len(tensors)} tensors, "
          f"{nbytes / GiB:.3f} GiB; {args.runs} runs per row", flush=True)

    def step() -> float:
        sync()
        t0 = time.perf_counter()
        ts.step()
        sync()
        return time.perf_counter() - t0

    for _ in range(3):
        step()
    plain = median(step() for _ in range(args.runs))

    # the bound: one pinned host tensor per state tensor, allocated once
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=gpu) for t in tensors]

    def copy_pinned() -> None:
        for dst, src in zip(pinned, tensors):
            dst.copy_(src, non_blocking=True)
        sync()

    rows = {}
    copies, stalls = [], []
    for i in range(args.runs + 1):
        step()
        t0 = time.perf_counter()
        copy_pinned()
        t1 = time.perf_counter()
        ts.step()
        sync()
        t2 = time.perf_counter()
        if i:
            copies.append(t1 - t0)
            stalls.append(t2 - t0 - plain)
    rows["copy_ into pinned memory (bound)"] = (median(copies), median(copies), median(stalls))
    del pinned

    exact = True
    with tempfile.TemporaryDirectory() as tmp:
        with ckpt.Checkpointer("gpu-check", shm=os.path.join(tmp, "shm")) as ck:
            returns, staged, stalls = [], [], []
            warm = 3  # keep_memory + 1 slots to map, pin and fault in
            k = 0
            for i in range(args.runs + warm):
                step()
                t0 = time.perf_counter()
                fut = ck.save(k, state)
                t1 = time.perf_counter()
                fut.wait_staged()
                t2 = time.perf_counter()
                fut.wait()
                k += 1
                if i >= warm:
                    returns.append(t1 - t0)
                    staged.append(t2 - t0)
            for i in range(args.runs):
                step()
                t0 = time.perf_counter()
                fut = ck.save(k, state)
                ts.step()  # its optimizer step waits for the copies still running
                sync()
                stalls.append(time.perf_counter() - t0 - plain)
                fut.wait()
                k += 1
            rows["tierckpt"] = (median(returns), median(staged), median(stalls))

            step()
            snap = [t.cpu() for t in ts.tensors()]
            names = list(ts.model.state_dict())
            ck.save(k, state).wait()
            fresh = build_state(args.size_gib, seed=1, device=args.device)
            assert ck.restore({"model": fresh.model, "optim": fresh.optim}) == k
            got = [t.cpu() for t in fresh.tensors()]
            bad = [names[i] if i < len(names) else f"optimizer tensor {i - len(names)}"
                   for i, (a, b) in enumerate(zip(snap, got)) if a.dtype != b.dtype or not torch.equal(a, b)]
            exact = len(snap) == len(got) and not bad
            on_gpu = all(t.device.type == args.device for t in fresh.model.parameters())

    base = rows["copy_ into pinned memory (bound)"]
    table = [[name, fmt(r), fmt(ratio(r, base[1]), 2), fmt(s), fmt(ratio(s, base[1]), 2), fmt(st),
              fmt(ratio(st, base[2]), 2)] for name, (r, s, st) in rows.items()]
    print()
    print(f"plain training step: {fmt(plain)} s")
    print(markdown_table(["method", "returns s", "× bound", "staged s", "× bound", "stall s", "× bound"], table))
    print()
    print(f"restore: {'exact' if exact else 'NOT EXACT'} ({len(snap)} tensors"
          f"{'' if exact else ', differing: ' + ', '.join(bad[:5])}); parameters on {args.device}: {on_gpu}")
    return 0 if exact and on_gpu else 1


if __name__ == "__main__":
    sys.exit(main())
