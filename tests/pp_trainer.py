"""A deterministic pipeline-parallel training job for end-to-end tests (run under torchrun, gloo, CPU).

The world is a 2-D device mesh ``("pp", "dp")``: ``--stages`` pipeline stages, each kept by ``world //
stages`` data-parallel replicas (rank = stage * replicas + replica). The pipeline runs through
``torch.distributed.pipelining`` (``PipelineStage`` + ``ScheduleGPipe``, 2 microbatches) on CPU with gloo:
activations and their gradients travel as point-to-point sends within the stage's ``pp`` group. The stages
are given their shapes (``input_args``, ``output_args``, ``input_grads``, ``output_grads``): with shapes
inferred at the first step instead (torch 2.13), the last stage blocked sending its backward metadata to a
first stage that had gone on to its forward sends, and the job hung. Every stage names the loss function,
or its schedule runs forward only.

The replicas of a stage keep the same weights by an all-reduce (average) of the gradients within the
stage's ``dp`` group before the optimizer step.

Each stage's module is the whole model built from one seed with the other stages' layers deleted (as
torchtitan splits a model), so every tensor keeps the model's own fully qualified name (``layers.2.weight``)
and the stages' names are disjoint: a stage's tensors can be found by name whatever the world size.

The batch of a step depends only on the step and the replica, so an uninterrupted run's losses are
reproducible. One JSON line per event goes to ``--out.<rank>``: ``{"restored": step, "tiers": [...],
"ranks": [...], "bytes": [...]}`` (per shard read: its tier, saved rank and size), then per step
``{"step": s, "loss": "<float.hex>" | null, "digest": "<sha256 of the stage's parameters>"}`` (the loss is
known on the last stage only). ``STAGED <step>`` is printed once ``--hang-after``'s save is committed.

With ``--describe`` the Checkpointer is told that the replicas of a stage hold the same model and optimizer
(``replicated=``, a process group and a 1-D device mesh), so each stage is written to disk and S3 once.

    torchrun --nproc-per-node 4 tests/pp_trainer.py --job J --shm DIR --steps N [--stages 2] [--describe]
             [--hang-after S] [--dump FILE] [--dump-restored FILE] [--init-from FILE --init-step S]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import ckpt

DIM, LAYERS, MICROBATCHES, BATCH = 32, 4, 2, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.nn.functional.gelu(self.fc(self.norm(h)))


class Model(nn.Module):
    """An input projection, ``LAYERS`` residual blocks and a head; a stage keeps its own part of it."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, DIM)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(LAYERS)})
        self.head = nn.Linear(DIM, 4)
        # a plain tensor that is not a parameter: saved with the stage that holds it
        self.register_buffer("out_scale", torch.linspace(0.5, 2.0, 4))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.inp is not None:
            h = self.inp(h)
        for block in self.layers.values():
            h = block(h)
        if self.head is not None:
            h = self.head(h) * self.out_scale
        return h


def build_stage(stage: int, stages: int) -> nn.Module:
    """The whole model from one seed, less the layers of the other stages (their names stay as they were)."""
    torch.manual_seed(1234)
    model = Model()
    per = LAYERS // stages
    for i in range(LAYERS):
        if i // per != stage:
            del model.layers[str(i)]
    if stage != 0:
        model.inp = None
    if stage != stages - 1:
        model.head = None
        del model.out_scale
    return model


def batch(step: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + seed)
    return torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 4, generator=g)


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def dump(path: str, model: nn.Module, optim: torch.optim.Optimizer) -> None:
    """This rank's stage state as plain torch objects: the model's state dict and the optimizer's."""
    torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, path)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--job", required=True)
    p.add_argument("--shm", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--no-spawn", action="store_true", help="use the running agent; never start one")
    p.add_argument("--hang-after", type=int, default=-1, help="after this step is committed, print and block")
    p.add_argument("--out", required=True)
    p.add_argument("--dump", help="at the end, torch.save this rank's stage state to DUMP.<rank>")
    p.add_argument("--dump-restored", help="right after the restore, torch.save the restored state here")
    p.add_argument("--init-from", help="start from the stage state in INIT_FROM.<rank of the stage's first "
                                       "replica in the run that dumped it> instead of restoring")
    p.add_argument("--init-step", type=int, default=-1, help="with --init-from: the step that state is of")
    p.add_argument("--init-replicas", type=int, default=1, help="with --init-from: that run's replicas per stage")
    p.add_argument("--describe", action="store_true",
                   help="tell the Checkpointer that a stage's replicas hold the same model and optimizer")
    a = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    replicas = world // a.stages
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    mesh = init_device_mesh("cpu", (a.stages, replicas), mesh_dim_names=("pp", "dp"))
    stage_id, replica = divmod(rank, replicas)
    dp_group = mesh["dp"].get_group()
    model = build_stage(stage_id, a.stages)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    micro = BATCH // MICROBATCHES
    width_in = 16 if stage_id == 0 else DIM
    width_out = 4 if stage_id == a.stages - 1 else DIM
    # shapes given up front: no metadata exchange at the first step (see the module docstring)
    first = stage_id == 0
    pipe = PipelineStage(model, stage_id, a.stages, torch.device("cpu"), group=mesh["pp"].get_group(),
                         input_args=torch.empty(micro, width_in, requires_grad=not first),
                         output_args=torch.empty(micro, width_out),
                         output_grads=None if stage_id == a.stages - 1 else torch.empty(micro, width_out),
                         input_grads=None if first else torch.empty(micro, width_in))
    last_stage = stage_id == a.stages - 1
    schedule = ScheduleGPipe(pipe, n_microbatches=MICROBATCHES, loss_fn=torch.nn.functional.mse_loss)
    out = open(f"{a.out}.{rank}", "a")

    def emit(**kw) -> None:
        out.write(json.dumps(kw) + "\n")
        out.flush()

    # the stage number is a value that differs between stages: a rank must get its own stage's back
    state = {"model": model, "optim": optim, "progress": {"step": -1, "stage": stage_id}}
    replicated = {"model": dp_group, "optim": mesh["dp"]} if a.describe else None
    with ckpt.Checkpointer(a.job, shm=a.shm, every=1, spawn=not a.no_spawn, replicated=replicated) as ck:
        if a.init_from:
            src = torch.load(f"{a.init_from}.{stage_id * a.init_replicas}", weights_only=True)
            model.load_state_dict(src["model"])
            optim.load_state_dict(src["optim"])
            last = a.init_step
        else:
            last = ck.restore(state)
        if last is not None and not a.init_from:
            assert state["progress"] == {"step": last, "stage": stage_id}, (rank, state["progress"])
            rep = ck.last_restore.shards
            emit(restored=last, tiers=[r.tier for r in rep], ranks=[r.rank for r in rep],
                 bytes=[r.nbytes for r in rep])
            if a.dump_restored:
                dump(f"{a.dump_restored}.{rank}", model, optim)
        for step in range(0 if last is None else last + 1, a.steps):
            x, y = batch(step, replica)
            losses: list[torch.Tensor] = []
            if stage_id == 0:
                schedule.step(x)
            elif last_stage:
                schedule.step(target=y, losses=losses)
            else:
                schedule.step()
            for prm in model.parameters():
                dist.all_reduce(prm.grad, group=dp_group)
                prm.grad /= replicas
            optim.step()
            optim.zero_grad(set_to_none=True)
            loss = float(torch.stack(losses).mean()).hex() if losses else None
            emit(step=step, loss=loss, digest=digest(model))
            state["progress"]["step"] = step
            fut = ck.save(step, state)
            if step == a.hang_after:
                fut.wait_staged()
                ck.wait()
                # block only once the step is committed on every node, so the step a resume restores is known
                from tiers.keys import manifest_key

                done = os.path.join(a.shm, *manifest_key(a.job, step).split("/"))
                deadline = time.monotonic() + 120
                while not os.path.exists(done) and time.monotonic() < deadline:
                    time.sleep(0.05)
                print(f"STAGED {step}", flush=True)
                parent = os.getppid()
                while os.getppid() == parent:  # wait to be killed; never outlive the launcher
                    time.sleep(0.2)
                os._exit(1)
    if a.dump:
        dump(f"{a.dump}.{rank}", model, optim)
    dist.destroy_process_group()
    out.close()
    sys.stdout.flush()
    sys.stderr.flush()
    # everything is written: skip interpreter teardown (see tests/trainer.py)
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
