"""What a save costs on an XLA device: one batched device-to-host transfer against one ``.cpu()`` per tensor.

    PJRT_DEVICE=CPU .venv-xla/bin/python benchmarks/bench_xla.py [--size-gib 0.25] [--runs 5] [--layers 12]

Needs torch 2.9 and torch-xla 2.9 (``pip install -e '.[xla]'``). The state is the GPT-like model of
``bench_save.py`` and its AdamW state, trained on the XLA device. Before every measured save the loop runs
one training step and ``torch_xla.sync()``, so each save fetches fresh device data. Rows:

- ``.cpu() per tensor``: the plain way to get the state to the host (no checkpointer);
- ``_xla_get_cpu_tensors``: the same tensors in one batched call (no checkpointer);
- ``tierckpt``: ``Checkpointer.save`` with the XLA adapter (sync, one batched transfer, then the copy into the
  agent's shared memory in the background); "blocking" is until ``save`` returns, "staged" until every byte
  is in shared memory;
- ``tierckpt, per-tensor``: the same with the adapter's fallback for a torch-xla without the batched call.

The four methods take turns (round robin, each round starting one method later), so the drifts of a shared
machine hit them alike. Medians of ``--runs`` rounds after two warm-up rounds, in seconds; ratios against
``.cpu() per tensor``. On the CPU PJRT client a transfer
is a memory copy inside the process, so these numbers say what the per-tensor overhead costs, not what a
TPU's or Trainium's PCIe link does.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import GiB, GPT, fmt, gpt_dims, machine_info, markdown_table, median, ratio  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gib", type=float, default=0.25, help="parameters + AdamW state, GiB")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()

    import torch_xla

    import ckpt
    from ckpt._devices.xla import XlaAdapter, fetch

    dev = torch_xla.device()
    torch.manual_seed(0)
    vocab, d = gpt_dims(args.size_gib, args.layers)
    model = GPT(vocab, d, args.layers, 128).to(dev)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (1, 16), generator=g).to(dev)
    y = torch.randint(0, vocab, (1, 16), generator=g).to(dev)

    def step() -> None:
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        torch_xla.sync(wait=True)

    for _ in range(3):  # compile the step
        step()
    state = {"model": model, "optim": optim}

    def xla_tensors() -> list[torch.Tensor]:
        # taken afresh after every step, as a save does: a state_dict entry taken before the step would alias
        # the parameter's old value and make each fetch run a graph of its own
        out = list(model.state_dict().values())
        return out + [v for st in optim.state.values() for v in st.values() if torch.is_tensor(v) and v.device == dev]

    tensors = xla_tensors()
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    print(f"machine: {machine_info()}")
    print(f"torch_xla {torch_xla.__version__}, PJRT_DEVICE={os.environ.get('PJRT_DEVICE')}; state: "
          f"{len(tensors)} XLA tensors, {nbytes / GiB:.3f} GiB; {args.runs} runs per row", flush=True)

    def fetch_once(batched: bool) -> tuple[float, float]:
        tensors = xla_tensors()
        t0 = time.perf_counter()
        fetch(tensors, batched)
        t = time.perf_counter() - t0
        return t, t

    saves = {True: 0, False: 0}

    def save_once(ck, batched: bool) -> tuple[float, float]:
        t0 = time.perf_counter()
        fut = ck.save(saves[batched], state)
        t1 = time.perf_counter()
        fut.wait_staged()
        t2 = time.perf_counter()
        fut.wait()
        saves[batched] += 1
        return t1 - t0, t2 - t0

    times: dict[str, list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp, \
            ckpt.Checkpointer("bench-xla", shm=os.path.join(tmp, "shm1"), keep_memory=1) as ck, \
            ckpt.Checkpointer("bench-xla-per-tensor", shm=os.path.join(tmp, "shm2"), keep_memory=1) as ck_pt:
        ck_pt._devices["xla"] = XlaAdapter(batched=False)  # this Checkpointer stages as a torch-xla without it
        methods = {".cpu() per tensor": lambda: fetch_once(False),
                   "_xla_get_cpu_tensors": lambda: fetch_once(True),
                   "tierckpt": lambda: save_once(ck, True),
                   "tierckpt, per-tensor": lambda: save_once(ck_pt, False)}
        # round robin, so the machine's drifts hit every method alike, and each round starts one method later
        # so none always follows the same one; the first two rounds set up the slot rings and are not counted
        names = list(methods)
        for r in range(args.runs + 2):
            for name in names[r % len(names):] + names[:r % len(names)]:
                run = methods[name]
                step()
                got = run()
                if r >= 2:
                    times.setdefault(name, []).append(got)
            if r >= 2:
                print(f"round {r - 1}: " + ", ".join(f"{k} {fmt(v[-1][1])}" for k, v in times.items()), flush=True)
    base = median(b for b, _ in times[".cpu() per tensor"])
    table = []
    for name in methods:
        v = times[name]
        b, s = median(x for x, _ in v), median(x for _, x in v)
        spread = f"{fmt(min(x for x, _ in v))}–{fmt(max(x for x, _ in v))}"
        table.append([name, fmt(b), spread, fmt(ratio(b, base), 2), fmt(s), fmt(ratio(s, base), 2)])
    print()
    print(markdown_table(["method", "blocking s", "blocking min–max s", "× per-tensor", "until staged s",
                          "× per-tensor"], table))


if __name__ == "__main__":
    main()
