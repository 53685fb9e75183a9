"""A Hugging Face ``LlamaForCausalLM`` trained with FSDP2 and checkpointed through DCP's own API with the
tierckpt storage plug-in, as a DCP user does it (run as a real process, under torchrun or alone).

The model comes from a small ``LlamaConfig`` (random weights, seeded; nothing downloaded). The state is
one ``Stateful`` (PyTorch's recipe: ``get_state_dict`` / ``set_state_dict`` over the model and its
optimizer) plus a data loader position kept as ``bytes``; it is saved every step with ``dcp.async_save``
(``DcpWriter`` + ``DcpStager``, on a gloo group of its own) and resumed with ``dcp.load`` (``DcpReader``).
Each step's batch depends only on the step and rank, so a resumed run's losses must equal an
uninterrupted run's. One JSON line per event goes to ``--out``.<rank>: ``{"restored": step, "tiers": [...]}``,
``{"step": s, "loss": "<float.hex>"}``, and at the end ``{"saves": n, "leases": n}`` (slots leased).
``SAVED <step>`` is printed once ``--hang-after``'s save is committed on every rank (tests kill the job
after it).

    torchrun --nproc-per-node 2 tests/dcp_hf_trainer.py --job J --shm DIR --steps N [--hang-after S]
    python tests/dcp_hf_trainer.py --job J --shm DIR --load-only --dump FILE   # one rank, resharded
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

import ckpt

VOCAB = 128


def build(fsdp: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      attn_implementation="eager")
    model = LlamaForCausalLM(cfg)
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    return model, optim


class AppState(Stateful):
    """The model and its optimizer as one Stateful (PyTorch's DCP recipe)."""

    def __init__(self, model, optim) -> None:
        self.model, self.optim = model, optim

    def state_dict(self) -> dict:
        msd, osd = get_state_dict(self.model, self.optim)
        return {"model": msd, "optim": osd}

    def load_state_dict(self, sd: dict) -> None:
        set_state_dict(self.model, self.optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


class Loader(Stateful):
    """A data loader whose position is kept as bytes (as torchtitan's is)."""

    def __init__(self) -> None:
        self.next_step = 0

    def state_dict(self) -> dict:
        return {"position": json.dumps({"next": self.next_step}).encode()}

    def load_state_dict(self, sd: dict) -> None:
        self.next_step = json.loads(sd["position"])["next"]


def full(model, optim) -> dict:
    """Every parameter and optimizer tensor whole (a collective under FSDP2)."""
    msd, osd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
    out = {f"model/{k}": v.clone() for k, v in msd.items()}
    for p, st in osd["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"optim/{p}/{k}"] = v.clone()
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--job", required=True)
    p.add_argument("--shm", required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--hang-after", type=int, default=-1)
    p.add_argument("--no-spawn", action="store_true")
    p.add_argument("--out")
    p.add_argument("--dump", help="at the end, torch.save every tensor of the state, whole, here (rank 0)")
    p.add_argument("--load-only", action="store_true", help="one process, no FSDP: load the newest step, dump")
    a = p.parse_args()
    distributed = not a.load_only
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    out = open(f"{a.out}.{rank}" if a.out else os.devnull, "a")

    def emit(**kw) -> None:
        out.write(json.dumps(kw) + "\n")
        out.flush()

    model, optim = build(distributed)
    loader = Loader()
    state = {"app": AppState(model, optim), "loader": loader}
    writer = ckpt.DcpWriter(a.job, shm=a.shm, spawn=not a.no_spawn)
    leases: list[int] = []  # slots leased: one per save when the stager's slot takes every byte of it
    lease = writer._lease
    writer._lease = lambda nbytes: (leases.append(nbytes), lease(nbytes))[1]
    stager = ckpt.DcpStager(writer)
    reader = writer.reader()
    last = reader.latest_step()
    if last is not None:
        dcp.load(state, storage_reader=reader, checkpoint_id=last)
        assert loader.next_step == last + 1, (loader.next_step, last)
        emit(restored=last, tiers=sorted({r.tier for r in reader.reports}))
    if a.load_only:
        torch.save(full(model, optim), a.dump)
        writer.close()
        return 0
    save_group = dist.new_group(backend="gloo")  # DCP's upload thread talks on a group of its own
    pending = None
    saves = 0
    for step in range(loader.next_step, a.steps):
        g = torch.Generator().manual_seed(step * 1000 + rank)
        tokens = torch.randint(0, VOCAB, (4, 17), generator=g)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        emit(step=step, loss=float(loss.item()).hex())
        loader.next_step = step + 1
        if pending is not None:
            pending.result()
        pending = dcp.async_save(state, storage_writer=writer, async_stager=stager, checkpoint_id=step,
                                 process_group=save_group)
        saves += 1
        if step == a.hang_after:
            pending.result()  # committed on every rank: dcp.save returns after every rank's write
            print(f"SAVED {step}", flush=True)
            parent = os.getppid()
            while os.getppid() == parent:  # wait to be killed; never outlive the launcher
                time.sleep(0.2)
            os._exit(1)
    if pending is not None:
        pending.result()
    writer.wait()
    emit(saves=saves, leases=len(leases))
    if a.dump:
        whole = full(model, optim)
        if rank == 0:
            torch.save(whole, a.dump)
    writer.close()
    dist.destroy_process_group()
    out.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as tests/trainer.py: skip a gloo/FSDP2 teardown that can abort after the work is done


if __name__ == "__main__":
    sys.exit(main())
