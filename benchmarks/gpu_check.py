"""On a machine with a CUDA GPU: what a save stalls training for, against a plain copy into pinned memory and
against DCP's ``async_save`` with its pinned shared-memory stager; what a restore from host memory takes,
against a plain copy back to the GPU; and whether a restore brings back every byte and training goes on as
if it had never stopped.

    python benchmarks/gpu_check.py [--size-gib 1.0] [--runs 5] [--batch 8] [--train-steps 5] [--json PATH]

The state is the GPT-like model of ``bench_save.py`` and its AdamW state, on ``cuda:0``. Every number is a
median of ``--runs`` after warm-up saves that fill the slot ring (and DCP's staging cache), with the
maximum beside it. Save rows:

- ``copy_ into pinned memory (bound)``: every tensor ``copy_(non_blocking=True)`` into a pre-allocated pinned
  host buffer, then ``torch.cuda.synchronize()``: the least a device-to-host snapshot can take;
- ``tierckpt``: ``Checkpointer.save``. "returns" is until ``save`` returns (the copies are only enqueued on
  the side stream), "staged" until every byte is in the agent's shared memory (``wait_staged``), "done"
  until the memory tier holds the step (``wait``);
- ``DCP async_save``: ``torch.distributed.checkpoint.async_save`` with a ``DefaultStager`` that stages into
  pinned shared memory on a side stream in a thread (``StagingOptions(use_pinned_memory, use_shared_memory,
  use_async_staging, use_non_blocking_copy)``) and a ``FileSystemWriter`` into the same memory folder
  (tmpfs): "staged" is ``staging_completion``, "done" ``upload_completion``. Skipped, with the reason, where
  the installed torch lacks these. torch 2.11's ``DefaultStager`` closes its state-dict copier at the end of
  each staging and cannot stage again; there each save gets a new stager, which allocates and pins its
  memory again (the report says so): that row is then DCP as it runs on that release, not at its best.

"stall" is what a training loop pays: save, then one training step, minus a plain step (for the bound:
copy, synchronize, step; for DCP: save, forward/backward, wait for ``staging_completion`` before the
optimizer step, as DCP asks of its caller). "step after" is the next training step minus a plain one, while
the save is still being persisted in the background. Ratios are against the bound.

Restore rows: ``copy_ from pinned memory (bound)`` copies every tensor from pinned host memory to the GPU;
``tierckpt restore`` reads the step from the agent's memory tier, verifies it and copies it to the GPU;
``DCP load`` reads DCP's files from the memory folder into the GPU tensors.

Exactness: the state is saved once more; the trained model goes on for ``--train-steps`` steps; a fresh
model restored from that save must hold every tensor bit for bit, then train the same steps with the same
losses, bit for bit (deterministic algorithms and the math attention kernel for those steps only).

Without CUDA it says so and exits 0 (``--device cpu`` checks this script itself: its numbers mean
nothing); it exits 1 when a restore is not exact or training does not go on the same.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import GiB, build_state, fmt, machine_info, markdown_table, median, ratio  # noqa: E402

BOUND = "copy_ into pinned memory (bound)"
RBOUND = "copy_ from pinned memory (bound)"


def gpu_info() -> dict:
    """Name, driver, CUDA and torch versions of ``cuda:0``."""
    out = {"name": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
           "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
           "memory_gib": round(torch.cuda.get_device_properties(0).total_memory / GiB, 1)}
    try:
        p = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
        out["driver"] = p.stdout.strip().splitlines()[0] if p.returncode == 0 and p.stdout.strip() else "?"
    except (OSError, subprocess.SubprocessError):
        out["driver"] = "?"
    return out


def mm(xs: list[float]) -> str:
    """``median (max)`` in seconds."""
    if not xs:
        return "—"
    return f"{fmt(median(xs))} ({fmt(max(xs))})"


def dcp_parts(gpu: bool):
    """DCP's ``async_save``, ``load``, writer, reader and a pinned shared-memory async stager; or the reason
    the installed torch cannot run that baseline."""
    try:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError as e:
        return None, f"torch {torch.__version__} has no DefaultStager/StagingOptions ({e})"
    fields = set(inspect.signature(StagingOptions).parameters)
    want = {"use_pinned_memory": gpu, "use_shared_memory": True, "use_async_staging": True,
            "use_non_blocking_copy": gpu}
    opts = StagingOptions(**{k: v for k, v in want.items() if k in fields})
    nodist = {"no_dist": True} if "no_dist" in inspect.signature(dcp.async_save).parameters else {}
    return (dcp, DefaultStager, opts, nodist), None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gib", type=float, default=1.0, help="parameters + AdamW state, GiB")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8, help="sequences of 128 tokens per training step")
    ap.add_argument("--train-steps", type=int, default=5, help="steps trained on after the restore")
    ap.add_argument("--no-dcp", action="store_true", help="leave out the DCP rows")
    ap.add_argument("--json", help="write every measurement here")
    ap.add_argument("--device", default="cuda", help="cpu only checks this script itself: its numbers mean nothing")
    args = ap.parse_args()
    gpu = args.device == "cuda"
    if gpu and not torch.cuda.is_available():
        print("gpu_check: skipped, no CUDA device here (torch.cuda.is_available() is False); "
              "run it on a machine with a GPU")
        return 0
    # cuBLAS picks the same kernels every time only with a fixed workspace: the losses after the restore
    # are compared bit for bit (set before the first matrix product creates the handle)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

    import ckpt

    # DCP says once per call that it saves and loads in one process, which is what is asked of it here
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    ts = build_state(args.size_gib, device=args.device)
    ts.set_batch(args.batch, 128)
    state = {"model": ts.model, "optim": ts.optim}
    tensors = ts.tensors()
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    info = {"machine": machine_info(), "size_gib": args.size_gib, "bytes": nbytes, "tensors": len(tensors),
            "runs": args.runs, "batch": [args.batch, 128]}
    print(f"machine: {info['machine']}")
    if gpu:
        info["gpu"] = gpu_info()
        where = "GPU: " + ", ".join(f"{k} {v}" for k, v in info["gpu"].items())
    else:
        where = "device: cpu"
    print(f"{where}; state: {len(tensors)} tensors, {nbytes / GiB:.3f} GiB; {args.runs} runs per row", flush=True)

    def fwd_bwd() -> torch.Tensor:
        loss = F.cross_entropy(ts.model(ts._x).flatten(0, 1), ts._y.flatten())
        loss.backward()
        return loss

    def opt() -> None:
        ts.optim.step()
        ts.optim.zero_grad(set_to_none=True)

    def step() -> float:
        sync()
        t0 = time.perf_counter()
        ts.step()
        sync()
        return time.perf_counter() - t0

    for _ in range(3):
        step()
    plains = [step() for _ in range(args.runs)]
    plain = median(plains)
    info["plain_step_s"] = plains

    # ------------------------------------------------------------------ save: the bound
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=gpu) for t in tensors]

    def copy_pinned() -> None:
        for dst, src in zip(pinned, tensors):
            dst.copy_(src, non_blocking=True)
        sync()

    rows: dict[str, dict[str, list[float]]] = {}
    r = rows[BOUND] = {"returns": [], "staged": [], "done": [], "stall": [], "after": []}
    for i in range(args.runs + 1):
        step()
        t0 = time.perf_counter()
        copy_pinned()
        t1 = time.perf_counter()
        ts.step()
        sync()
        t2 = time.perf_counter()
        after = step()
        if i:
            for k in ("returns", "staged", "done"):
                r[k].append(t1 - t0)
            r["stall"].append(t2 - t0 - plain)
            r["after"].append(after - plain)
    del pinned
    print(f"bound: {mm(r['returns'])} s per copy = {nbytes / median(r['returns']) / 1e9:.1f} GB/s", flush=True)

    shm_root = "/dev/shm" if os.path.isdir("/dev/shm") else None
    exact = trains_on = on_device = dcp_exact = True
    notes: list[str] = []
    restore_rows: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(dir=shm_root, prefix="gpu-check-") as tmp:
        # ------------------------------------------------------------------ save: DCP
        parts, why = (None, "left out (--no-dcp)") if args.no_dcp else dcp_parts(gpu)
        stager = None
        dcp_dirs: list[str] = []
        closed_by: list[str] = []  # where DCP closed the stager it was given, the first time
        restaged = [0]

        def new_stager():
            s = parts[1](parts[2])
            inner = getattr(s, "_state_dict_stager", None)
            if inner is not None and hasattr(inner, "close"):
                close = inner.close

                def close_and_say_where() -> None:
                    if not closed_by:
                        closed_by.append("".join(traceback.format_stack(limit=10)))
                    close()

                inner.close = close_and_say_where
            return s

        fresh_each = [False]  # DCP closes the stager after each save: each save gets a new one

        def dcp_save(name: str):
            nonlocal stager
            dcp, _, _, nodist = parts
            if stager is None or fresh_each[0]:
                # a closed DefaultStager cannot stage again: a new one allocates and pins its memory again
                restaged[0] += stager is not None
                stager = new_stager()
            d = os.path.join(tmp, name)
            dcp_dirs.append(d)
            sd = {"model": ts.model.state_dict(), "optim": ts.optim.state_dict()}
            return dcp.async_save(sd, storage_writer=dcp.FileSystemWriter(d), async_stager=stager, **nodist)

        def staging_of(resp) -> None:
            if hasattr(resp, "staging_completion"):
                resp.staging_completion.result()

        def upload_of(resp) -> None:
            (resp.upload_completion if hasattr(resp, "upload_completion") else resp).result()

        def drop_old_dcp() -> None:
            while len(dcp_dirs) > 1:
                shutil.rmtree(dcp_dirs.pop(0), ignore_errors=True)

        if parts is not None:
            try:
                r = rows["DCP async_save (pinned shm stager)"] = {k: [] for k in ("returns", "staged", "done",
                                                                                    "stall", "after")}
                n = 0
                for i in range(args.runs + 2):  # two warm-ups: the stager pins its shared memory once
                    step()
                    t0 = time.perf_counter()
                    resp = dcp_save(f"dcp-{n}")
                    t1 = time.perf_counter()
                    staging_of(resp)
                    t2 = time.perf_counter()
                    upload_of(resp)
                    t3 = time.perf_counter()
                    if n == 0:
                        # the upload's callbacks run just after its result is set: did one close the stager?
                        time.sleep(0.2)
                        fresh_each[0] = bool(closed_by)
                    n += 1
                    drop_old_dcp()
                    if i < 2:
                        r.setdefault("warm_up", []).append(t2 - t0)
                    else:
                        r["returns"].append(t1 - t0)
                        r["staged"].append(t2 - t0)
                        r["done"].append(t3 - t0)
                for i in range(args.runs):
                    step()
                    t0 = time.perf_counter()
                    resp = dcp_save(f"dcp-{n}")
                    fwd_bwd()
                    staging_of(resp)  # DCP leaves it to the caller: the parameters must not change before
                    opt()
                    sync()
                    r["stall"].append(time.perf_counter() - t0 - plain)
                    r["after"].append(step() - plain)
                    upload_of(resp)
                    n += 1
                    drop_old_dcp()
            except Exception as e:  # a baseline that does not run here is reported, not fatal
                traceback.print_exc()
                why = f"failed: {type(e).__name__}: {e}"
                rows.pop("DCP async_save (pinned shm stager)", None)
                parts = None
        if closed_by:
            notes.append(f"DCP's DefaultStager closed its state-dict copier after a save, so it cannot stage "
                         f"again: {restaged[0]} more saves, each staged by a new DefaultStager (which allocates "
                         "and pins its staging memory again); the close came from:\n"
                         + closed_by[0])
        if parts is None:
            notes.append(f"DCP async_save row: {why}")
            print(f"DCP async_save: {why}", flush=True)

        # ------------------------------------------------------------------ save: tierckpt
        with ckpt.Checkpointer("gpu-check", shm=os.path.join(tmp, "shm")) as ck:
            r = rows["tierckpt Checkpointer.save"] = {k: [] for k in ("returns", "staged", "done", "stall",
                                                                      "after")}
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
                t3 = time.perf_counter()
                k += 1
                if i < warm:
                    r.setdefault("warm_up", []).append(t2 - t0)
                else:
                    r["returns"].append(t1 - t0)
                    r["staged"].append(t2 - t0)
                    r["done"].append(t3 - t0)
            for i in range(args.runs):
                step()
                t0 = time.perf_counter()
                fut = ck.save(k, state)
                ts.step()  # its optimizer step waits for the copies still running
                sync()
                r["stall"].append(time.perf_counter() - t0 - plain)
                r["after"].append(step() - plain)
                fut.wait()
                k += 1
            slots = [buf for _, _, buf in ck._maps.values() if buf is not None]
            pinned_slots = sum(1 for b in slots if gpu and b.is_pinned())
            print(f"tierckpt: {pinned_slots} of {len(slots)} mapped slots pinned; warm-up saves staged in "
                  f"{', '.join(fmt(x) for x in r['warm_up'])} s", flush=True)
            info["pinned_slots"] = [pinned_slots, len(slots)]

            # ------------------------------------------------------------------ exactness
            step()
            snap = [torch.empty(t.shape, dtype=t.dtype, pin_memory=gpu and t.is_cuda).copy_(t)
                    for t in ts.tensors()]
            names = list(ts.model.state_dict())
            ck.save(k, state).wait()
            if parts is not None:
                resp = dcp_save("dcp-exact")
                upload_of(resp)
                dcp_dir = dcp_dirs[-1]
            fresh = build_state(args.size_gib, seed=1, device=args.device)
            fresh.set_batch(args.batch, 128)
            fstate = {"model": fresh.model, "optim": fresh.optim}

            def differing() -> list[str]:
                got = fresh.tensors()
                if len(got) != len(snap):
                    return [f"{len(got)} tensors, saved {len(snap)}"]
                return [names[i] if i < len(names) else f"optimizer tensor {i - len(names)}"
                        for i, (a, b) in enumerate(zip(snap, got))
                        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b.cpu())]

            ref = train_on(ts, args.train_steps, gpu)

            rt: list[float] = []
            t0 = time.perf_counter()
            assert ck.restore(fstate) == k
            sync()
            rt.append(time.perf_counter() - t0)
            bad = differing()
            exact = not bad
            on_device = all(t.device.type == args.device for t in fresh.model.parameters())
            got = train_on(fresh, args.train_steps, gpu)
            trains_on = ref == got
            info["losses"] = {"uninterrupted": ref, "restored": got}
            for _ in range(args.runs - 1):
                t0 = time.perf_counter()
                assert ck.restore(fstate) == k
                sync()
                rt.append(time.perf_counter() - t0)
            bad2 = differing()
            exact = exact and not bad2
            restore_rows["tierckpt restore (memory tier)"] = rt

        # ------------------------------------------------------------------ restore: the bound
        bt = []
        for i in range(args.runs + 1):
            sync()
            t0 = time.perf_counter()
            for dst, src in zip(fresh.tensors(), snap):
                dst.copy_(src, non_blocking=True)
            sync()
            if i:
                bt.append(time.perf_counter() - t0)
        restore_rows[RBOUND] = bt

        # ------------------------------------------------------------------ restore: DCP
        if parts is not None:
            dcp = parts[0]
            lt = []
            try:
                for i in range(args.runs):
                    with torch.no_grad():
                        for t in fresh.tensors():
                            t.zero_()
                    sync()
                    t0 = time.perf_counter()
                    sd = {"model": fresh.model.state_dict(), "optim": fresh.optim.state_dict()}
                    # in place: the state dicts hold the module's and the optimizer's own tensors
                    dcp.load(sd, storage_reader=dcp.FileSystemReader(dcp_dir), **parts[3])
                    sync()
                    lt.append(time.perf_counter() - t0)
                dbad = differing()
                dcp_exact = not dbad
                restore_rows["DCP load (files in memory)"] = lt
            except Exception as e:
                traceback.print_exc()
                notes.append(f"DCP load row: failed: {type(e).__name__}: {e}")
                dcp_exact = None
        if stager is not None:
            stager.close()

    # ------------------------------------------------------------------ report
    base = rows[BOUND]
    b_staged, b_stall = median(base["staged"]), median(base["stall"])
    table = [[name, mm(r["returns"]), mm(r["staged"]), fmt(ratio(median(r["staged"]), b_staged), 2),
              mm(r["done"]), mm(r["stall"]), fmt(ratio(median(r["stall"]), b_stall), 2), mm(r["after"])]
             for name, r in rows.items()]
    rbase = median(restore_rows[RBOUND])
    rtable = [[name, mm(v), f"{nbytes / median(v) / 1e9:.1f}", fmt(ratio(median(v), rbase), 2)]
              for name, v in sorted(restore_rows.items(), key=lambda kv: kv[0] != RBOUND)]
    print()
    print(f"plain training step: {mm(plains)} s; state {nbytes / GiB:.3f} GiB; seconds, median of "
          f"{args.runs} (max)")
    print(markdown_table(["save", "returns s", "staged s", "× bound", "done s", "stall s", "× bound",
                          "step after s"], table))
    print()
    print(markdown_table(["restore", "s", "GB/s", "× bound"], rtable))
    print()
    print(f"restore: {'exact' if exact else 'NOT EXACT'} ({len(snap)} tensors bit for bit"
          f"{'' if exact else ', differing: ' + ', '.join((bad or bad2)[:5])}); parameters on {args.device}: "
          f"{on_device}")
    print(f"training on after the restore: {args.train_steps} losses "
          f"{'equal bit for bit' if trains_on else 'DIFFER'} to the uninterrupted run's "
          f"({', '.join(f'{x:.6f}' for x in got)})")
    if parts is not None or dcp_exact is None:
        print(f"DCP load: {'exact' if dcp_exact else 'not run' if dcp_exact is None else 'NOT EXACT'}")
    for n in notes:
        print(n)
    if args.json:
        info.update(save=rows, restore=restore_rows, exact=exact, trains_on=trains_on, dcp_exact=dcp_exact,
                    on_device=on_device, notes=notes)
        with open(args.json, "w") as f:
            json.dump(info, f, indent=1)
    return 0 if exact and on_device and trains_on and dcp_exact is not False else 1


def train_on(ts, steps: int, gpu: bool) -> list[float]:
    """``steps`` training steps of ``ts``; their losses. Deterministic kernels only (the math attention
    kernel: the fused ones accumulate in an order that can change from run to run)."""
    losses = []
    with contextlib.ExitStack() as stack:
        torch.use_deterministic_algorithms(True, warn_only=True)
        stack.callback(torch.use_deterministic_algorithms, False)
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore")
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            stack.enter_context(sdpa_kernel([SDPBackend.MATH]))
        except ImportError:
            pass
        for _ in range(steps):
            loss = F.cross_entropy(ts.model(ts._x).flatten(0, 1), ts._y.flatten())
            loss.backward()
            ts.optim.step()
            ts.optim.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        if gpu:
            torch.cuda.synchronize()
    return [float(x) for x in losses]


if __name__ == "__main__":
    sys.exit(main())
