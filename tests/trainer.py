"""A small deterministic training job for end-to-end tests (run as a real process).

Each step's batch depends only on the step number, so a run resumed from a
checkpoint must produce bit-identical losses to an uninterrupted run. One JSON
line per event goes to ``--out``: ``{"restored": step, "tiers": [...]}`` and
``{"step": s, "loss": "<float.hex>"}``; ``STAGED <step>`` is printed on stdout
when a save's copy is complete (tests kill the process after it).

    python tests/trainer.py --job J --shm DIR [--disk DIR] [--s3 URL --s3-endpoint URL]
           --steps N [--every K] [--hang-after S] [--fsdp] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

import ckpt


class TinyGPT(torch.nn.Module):
    """A small GPT-style model: token + position embeddings, causal transformer blocks, a head."""

    def __init__(self, vocab: int = 64, dim: int = 32, layers: int = 2, ctx: int = 16) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Embedding(ctx, dim)
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(dim, 4, 2 * dim, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers))
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, x):
        h = self.tok(x) + self.pos(torch.arange(x.shape[1]))
        mask = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        for b in self.blocks:
            h = b(h, src_mask=mask, is_causal=True)
        return self.head(h)


def build(fsdp: bool, width: int, gpt: bool = False):
    torch.manual_seed(1234)
    if gpt:
        model = TinyGPT()
        shard_units = list(model.blocks)
    else:
        model = torch.nn.Sequential(
            torch.nn.Linear(32, width), torch.nn.LayerNorm(width), torch.nn.GELU(),
            torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, 8),
        )
        shard_units = [m for m in model if isinstance(m, torch.nn.Linear)]
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        for unit in shard_units:
            fully_shard(unit, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    return model, optim


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--job", required=True)
    p.add_argument("--shm", required=True)
    p.add_argument("--disk")
    p.add_argument("--s3")
    p.add_argument("--s3-endpoint")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--every", type=int, default=1)
    p.add_argument("--disk-every", type=int)
    p.add_argument("--s3-every", type=int)
    p.add_argument("--hang-after", type=int, default=-1, help="after staging this step, print and block")
    p.add_argument("--fsdp", action="store_true")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--no-spawn", action="store_true", help="use the running agent; never start one")
    p.add_argument("--keep-memory", action="store_true",
                   help="keep the job's memory tier when it ends cleanly (keep_memory_after_close)")
    p.add_argument("--raise-at", type=int, default=-1,
                   help="after this step is saved and written, raise inside the with block (first attempt only)")
    p.add_argument("--peer-hangs", action="store_true",
                   help="with --kill-at: the other ranks block after that step (torchrun's SIGTERM ends them)")
    p.add_argument("--fresh", action="store_true", help="start from step 0 without restoring")
    p.add_argument("--keep-after-crash", type=float, help="keep_after_crash (seconds)")
    p.add_argument("--out")
    p.add_argument("--dump", help="at the end, torch.save this rank's parameters and optimizer state here")
    p.add_argument("--gpt", action="store_true", help="train TinyGPT on token batches")
    p.add_argument("--full", action="store_true", help="--dump whole tensors (gathered), not this rank's shards")
    p.add_argument("--kill-rank", type=int, default=-1, help="with --kill-at: this rank kill -9s itself ...")
    p.add_argument("--kill-at", type=int, default=-1, help="... after this step is saved, in the first attempt only")
    a = p.parse_args()
    if a.fsdp:
        torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank() if a.fsdp else 0
    out = open(f"{a.out}.{rank}" if a.out else os.devnull, "a")

    def emit(**kw) -> None:
        out.write(json.dumps(kw) + "\n")
        out.flush()

    model, optim = build(a.fsdp, a.width, a.gpt)
    # a bytes value of each rank (as a data loader's pickled state is): raw in the shard, restored per rank
    # and per-parameter hyperparameters as plain values, as torchtitan's optimizer container saves them: too many
    # for the manifest, so they travel in the shard (tiers.manifest.SPILL_BYTES), resharded restores included
    hyper = {f"p{i}": {"lr": 1e-3, "betas": (0.9, 0.95), "rank": rank} for i in range(200)}
    state = {"model": model, "optim": optim, "progress": {"step": -1, "token": b""}, "hyper": hyper}
    with ckpt.Checkpointer(a.job, shm=a.shm, disk=a.disk, s3=a.s3, s3_endpoint=a.s3_endpoint, every=a.every,
                           disk_every=a.disk_every, s3_every=a.s3_every, spawn=not a.no_spawn,
                           keep_memory_after_close=True if a.keep_memory else None,
                           keep_after_crash=a.keep_after_crash) as ck:
        last = None if a.fresh else ck.restore(state)
        if last is not None:
            assert state["progress"]["step"] == last, (state["progress"], last)
            # a resharded restore gives each rank the bytes of the same rank, or of rank 0 when there are more ranks
            assert state["progress"]["token"] in (f"{rank}:{last}".encode(), f"0:{last}".encode()), state["progress"]
            assert state["hyper"]["p7"]["betas"] == (0.9, 0.95)
            assert state["hyper"]["p7"]["rank"] == int(state["progress"]["token"].split(b":")[0])
            emit(restored=last, tiers=ck.last_restore.tiers)
        for step in range(0 if last is None else last + 1, a.steps):
            g = torch.Generator().manual_seed(step * 1000 + rank)
            if a.gpt:
                tokens = torch.randint(0, 64, (4, 17), generator=g)
                logits = model(tokens[:, :-1])
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            else:
                x = torch.randn(16, 32, generator=g)
                y = torch.randn(16, 8, generator=g)
                loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
            emit(step=step, loss=float(loss.item()).hex())
            state["progress"]["step"] = step
            state["progress"]["token"] = f"{rank}:{step}".encode()
            fut = ck.save(step, state)
            first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
            if step == a.raise_at and first_attempt:
                fut.wait_staged()
                ck.wait()
                raise RuntimeError("CUDA out of memory (raised by the test)")
            if step == a.kill_at and rank != a.kill_rank and a.peer_hangs and first_attempt:
                ck.wait()
                print(f"HANGING {step}", flush=True)
                while True:  # until torchrun's SIGTERM, once the killed rank is seen gone
                    time.sleep(0.2)
            if step == a.kill_at and rank == a.kill_rank and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
                fut.wait_staged()
                ck.wait()
                # die only once the step is committed on every rank (its manifest is in this node's memory),
                # so the step every rank restores is known
                from tiers.keys import manifest_key

                done = os.path.join(a.shm, *manifest_key(a.job, step).split("/"))
                deadline = time.monotonic() + 60
                while not os.path.exists(done) and time.monotonic() < deadline:
                    time.sleep(0.01)
                os.kill(os.getpid(), 9)
            if step == a.hang_after:
                fut.wait_staged()
                ck.wait()
                print(f"STAGED {step}", flush=True)
                parent = os.getppid()
                while os.getppid() == parent:  # wait to be killed; never outlive the launcher
                    time.sleep(0.2)
                os._exit(1)
    if a.dump:
        def local(t):
            if a.full and hasattr(t, "full_tensor"):
                return t.full_tensor()  # the whole tensor, comparable across world sizes
            return t.to_local() if hasattr(t, "to_local") else t

        params = {n: local(p.detach()).clone() for n, p in model.named_parameters()}
        names = {id(p): n for n, p in model.named_parameters()}
        opt = {f"{names[id(p)]}/{k}": local(v).clone() for p, st in optim.state.items() for k, v in st.items()
               if isinstance(v, torch.Tensor)}
        torch.save({"params": params, "optim": opt}, f"{a.dump}.{rank}")
    if a.fsdp:
        torch.distributed.destroy_process_group()
        out.close()
        sys.stdout.flush()
        sys.stderr.flush()
        # everything is written: skip interpreter teardown, where a gloo/FSDP2 process was seen to abort
        # once in many runs ("terminate called without an active exception") after its work was done
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
