"""A job on a 2-D device mesh for the parallelism tests (run under torchrun, gloo, 4 ranks).

    python -m torch.distributed.run --nproc-per-node 4 tests/mesh_job.py --mode hsdp|fsdp_tp
           --job J --shm DIR [--disk DIR] --steps N --out FILE

``ddp``: ``DistributedDataParallel`` over the world, its model and optimizer described to the Checkpointer
as replicated on every rank (``replicated=``), as no DTensor says so. ``hsdp``: ``fully_shard`` on a
(replicate=2, shard=2) mesh, the parameters and optimizer state
``(Replicate(), Shard(0))`` DTensors. ``fsdp_tp``: a (dp=2, tp=2) mesh, an MLP block parallelised as
torchtitan does (column-wise, then row-wise with a sequence-sharded output, the norm sequence-parallel so
its weight and bias are replicated over tp), then ``fully_shard`` over dp.

Each rank trains a few deterministic steps, checkpoints every step, and writes one JSON line to
``--out.<rank>``: for every tensor chunk it holds, the chunk's name, offsets, shape and bytes, and the
holders and owner :mod:`ckpt._replicas` computes for it; its shard's size in the newest step's manifest;
and the losses. Each rank's values and a plain tensor of its own (``progress``) say after a restore whether
it got its own back.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import torch
import torch.distributed as dist
import xxhash
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import ckpt
from ckpt._flatten import flatten_state
from ckpt._replicas import OwnerBalance
from ckpt._tensors import local_chunk


class Block(torch.nn.Module):
    def __init__(self, dim: int = 16, hidden: int = 64) -> None:
        super().__init__()
        self.up = torch.nn.Linear(dim, hidden)
        self.down = torch.nn.Linear(hidden, dim)
        self.norm = torch.nn.LayerNorm(dim)

    def forward(self, x):
        return self.norm(self.down(torch.nn.functional.gelu(self.up(x))))


class Net(torch.nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(dim, 4 * dim) for _ in range(2))
        self.head = torch.nn.Linear(dim, 4)
        self.dim = dim

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


def build(mode: str, replicas: int = 0, dim: int = 16):
    torch.manual_seed(7)
    model = Net(dim)
    if mode == "hsdp":
        world = dist.get_world_size()
        r = replicas or world // 2
        mesh = init_device_mesh("cpu", (r, world // r), mesh_dim_names=("replicate", "shard"))
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif mode == "fsdp_tp":
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                       parallelize_module)

        mesh = init_device_mesh("cpu", (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "tp"))
        for b in model.blocks:
            parallelize_module(b, mesh["tp"], {
                "up": ColwiseParallel(input_layouts=Replicate()),
                "down": RowwiseParallel(output_layouts=Shard(1)),
                "norm": SequenceParallel(use_local_output=False),
            })
            # the block's output (sequence-sharded over tp) back to whole rows for the residual
            b.register_forward_hook(lambda m, i, o: o.redistribute(o.device_mesh, [Replicate()]).to_local())
            fully_shard(b, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    elif mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    else:
        raise SystemExit(f"unknown --mode {mode}")
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def dump(model, optim) -> dict:
    """Whole tensors (gathered), comparable across world sizes: parameters and optimizer state by name."""
    def whole(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    model = getattr(model, "module", model)  # DDP's names without its prefix
    names = {id(p): n for n, p in model.named_parameters()}
    out = {f"param/{n}": whole(p.detach()).clone() for n, p in model.named_parameters()}
    for p, st in optim.state.items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"optim/{names[id(p)]}/{k}"] = whole(v).clone()
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--shm", required=True)
    p.add_argument("--disk")
    p.add_argument("--s3")
    p.add_argument("--s3-endpoint")
    p.add_argument("--no-spawn", action="store_true", help="use the running agent; never start one")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--restore-only", action="store_true", help="restore the newest step, dump it, and stop")
    p.add_argument("--restore-step", type=int, help="with --restore-only: this step, not the newest")
    p.add_argument("--restore-may-fail", action="store_true",
                   help="with --restore-only: a failed restore is reported (error), with the state before and after")
    p.add_argument("--out", required=True)
    p.add_argument("--replicas", type=int, default=0, help="hsdp: replica groups (default: world / 2)")
    p.add_argument("--dim", type=int, default=16, help="the model's width")
    p.add_argument("--describe-on", type=int, nargs="*",
                   help="ddp: only these ranks describe the replication (a job that gives it on some ranks only)")
    a = p.parse_args()
    if os.environ.get("TIERCKPT_TEST_LOG"):  # a debugging run: each rank's log on stderr
        logging.basicConfig(level=os.environ["TIERCKPT_TEST_LOG"],
                            format=f"%(asctime)s r{os.environ.get('RANK')} %(name)s %(levelname)s %(message)s")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, optim = build(a.mode, a.replicas, a.dim)
    # each rank's own values, as a data loader's position is: a restore gives a rank its own back
    # and a plain tensor of its own under the same name on every rank (as an RNG state is)
    state = {"model": model, "optim": optim, "progress": {"rank": rank, "token": f"rank-{rank}".encode(),
                                                          "seen": torch.full((2,), float(rank))}}
    if a.restore_only:
        state["progress"] = {"rank": -1, "token": b"", "seen": torch.full((2,), -1.0)}
    losses = []
    report: dict = {"rank": rank}
    # DDP: every rank holds the same model and optimizer state (a process group, and a list of ranks)
    replicated = {"model": dist.group.WORLD, "optim": range(dist.get_world_size())} if a.mode == "ddp" else None
    if a.describe_on is not None and rank not in a.describe_on:
        replicated = None
    with ckpt.Checkpointer(a.job, shm=a.shm, disk=a.disk, s3=a.s3, s3_endpoint=a.s3_endpoint,
                           s3_every=1 if a.s3 else None, spawn=not a.no_spawn, replicated=replicated) as ck:
        if a.restore_only:
            if a.restore_may_fail:
                torch.save(dump(model, optim), f"{a.out}.before.{rank}")
            try:
                report["restored"] = ck.restore(state, step=a.restore_step)
                report["tiers"] = ck.last_restore.tiers
                report["seconds"] = ck.last_restore.seconds
            except Exception as e:
                if not a.restore_may_fail:
                    raise
                report["error"] = f"{type(e).__name__}: {e}"
            report["progress"] = [state["progress"]["rank"], state["progress"]["token"].decode(),
                                  state["progress"]["seen"].tolist()]
            torch.save(dump(model, optim), f"{a.out}.dump.{rank}")
        else:
            for step in range(a.steps):
                # the same batch on the tp ranks of a dp rank; HSDP's and DDP's every rank is a dp rank
                dp = rank // 2 if a.mode == "fsdp_tp" else rank
                g = torch.Generator().manual_seed(step * 100 + dp)
                x = torch.randn(4, 8, a.dim, generator=g)
                loss = model(x).pow(2).mean()
                loss.backward()
                optim.step()
                optim.zero_grad(set_to_none=True)
                losses.append(float(loss.item()).hex())
                ck.save(step, state)
            ck.wait()
            torch.save(dump(model, optim), f"{a.out}.dump.{rank}")
            flat = flatten_state(state)
            bal = OwnerBalance()
            chunks = []
            for leaf in flat.leaves:
                if leaf.tensor is None:
                    continue
                local, _, offsets = local_chunk(leaf.tensor)
                n = local.numel() * local.element_size()
                r = ck._planner.replicas(leaf.name, leaf.tensor) if n else None
                if r is not None:
                    r = bal.deal(r, n)
                raw = local.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                chunks.append({"name": leaf.name, "offsets": list(offsets), "shape": list(local.shape),
                               "nbytes": n, "dtensor": hasattr(leaf.tensor, "placements"),
                               "sum": xxhash.xxh3_64_hexdigest(raw),
                               "holders": list(r.holders) if r else [rank],
                               "owner": r.holders[r.owner] if r else rank})
            from tiers.keys import manifest_key
            from tiers.manifest import Manifest

            path = os.path.join(a.shm, *manifest_key(a.job, a.steps - 1).split("/"))
            with open(path, "rb") as f:
                sh = Manifest.from_bytes(f.read()).shard(rank)
            report.update(chunks=chunks, shard_size=sh.size, durable=sh.durable and sh.durable[0], losses=losses)
    with open(f"{a.out}.{rank}", "w") as f:
        f.write(json.dumps(report) + "\n")
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
