"""An SPMD-sharded model on 4 CPU XLA devices, saved and restored through the Checkpointer (run by test_xla.py).

Usage: ``PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 python xla_spmd.py SHM_DIR``; prints ``spmd ok`` when every check
passed. SPMD must be on before any XLA tensor exists, hence a process of its own.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
import torch_xla
import torch_xla.runtime as xr

xr.use_spmd()
import torch_xla.distributed.spmd as xs  # noqa: E402

import ckpt  # noqa: E402

DEV = torch_xla.device()
N = xr.global_runtime_device_count()
MESH = xs.Mesh(np.arange(N), (N, 1), ("x", "y"))
spec = torch_xla._XLAC._get_xla_sharding_spec


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 6)).to(DEV)
    xs.mark_sharding(m[0].weight, MESH, ("x", "y"))
    xs.mark_sharding(m[2].weight, MESH, ("x", None))  # 6 rows over 4 devices: uneven shards
    return m


def train(m: torch.nn.Module, o: torch.optim.Optimizer, start: int, steps: int) -> list[float]:
    losses = []
    for i in range(start, start + steps):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(8, 16, generator=g).to(DEV), torch.randn(8, 6, generator=g).to(DEV)
        loss = torch.nn.functional.mse_loss(m(x), y)
        loss.backward()
        o.step()
        o.zero_grad()
        torch_xla.sync()
        losses.append(loss.item())
    return losses


def state(seed: int) -> dict:
    m = model(seed)
    g = torch.Generator().manual_seed(seed)
    # an XLAShardedTensor wrapper held in the state directly
    table = xs.mark_sharding(torch.randn(8, 4, generator=g).to(DEV), MESH, ("x", None))
    return {"model": m, "optim": torch.optim.AdamW(m.parameters(), lr=1e-2), "table": table}


def main(shm: str) -> None:
    assert N == 4, f"expected 4 XLA devices (CPU_NUM_DEVICES=4), got {N}"
    s = state(0)
    train(s["model"], s["optim"], 0, 3)
    saved = {k: v.cpu() for k, v in s["model"].state_dict().items()}
    saved_table = s["table"].global_tensor.cpu()
    with ckpt.Checkpointer("spmd", shm=shm) as ck:
        ck.save(3, s).wait()
        uninterrupted = train(s["model"], s["optim"], 3, 3)
        r = state(1)
        assert ck.restore(r) == 3
    m = r["model"]
    for k, v in m.state_dict().items():
        assert torch.equal(v.cpu(), saved[k]), k
    assert torch.equal(r["table"].global_tensor.cpu(), saved_table)
    assert spec(m[0].weight) == spec(s["model"][0].weight) != "", spec(m[0].weight)
    assert spec(m[2].weight) == spec(s["model"][2].weight) != "", spec(m[2].weight)
    resumed = train(m, r["optim"], 3, 3)
    assert resumed == uninterrupted, (resumed, uninterrupted)
    print("spmd ok")


if __name__ == "__main__":
    main(sys.argv[1])
