"""A PyTorch Lightning run that checkpoints through tierckpt from a callback, for the crash tests.

    python tests/lightning_trainer.py --job J --shm DIR [--disk DIR] --steps N [--raise-at S] --out FILE

Lightning's own ``Trainer.fit`` drives the training. The callback restores at ``on_train_start`` (the
model, its optimizer as Lightning built it, the data position), saves after every batch (each save
waited), and closes the ``Checkpointer`` in ``teardown`` (a clean end) and in ``on_exception``, which
Lightning calls from the ``except BaseException`` of its ``_call_and_handle_interrupt`` before it tears
down and re-raises. ``--raise-at S``: raise a RuntimeError (a CUDA OOM's message) once step S is saved.
``--out``: a JSON line per event (``restored``, each step's loss as an exact hex string), and the model's
final state dict saved with ``torch.save`` to ``FILE.pt``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytorch_lightning as pl  # noqa: E402

import ckpt  # noqa: E402


class Windows(torch.utils.data.Dataset):
    """Token windows by index, from ``offset`` on (set by a restore, fixed during a run): the same batch for
    the same step."""

    def __init__(self) -> None:
        self.offset = 0

    def __len__(self) -> int:
        return 10_000

    def __getitem__(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1_000_003 + self.offset + i)
        return torch.randint(0, 64, (9,), generator=g)


class TinyLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.mlp = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
        self.head = nn.Linear(32, 64)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        h = self.emb(batch[:, :-1])
        logits = self.head(h + self.mlp(h))
        return nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Tierckpt(pl.Callback):
    def __init__(self, a: argparse.Namespace, data: Windows) -> None:
        self.a, self.data = a, data
        self.ck: ckpt.Checkpointer | None = None
        self.start = 0

    def _event(self, **e) -> None:
        with open(self.a.out, "a") as f:
            f.write(json.dumps(e) + "\n")

    def _state(self, trainer: pl.Trainer, module: pl.LightningModule, pos: int = 0) -> dict:
        return {"model": module, "optim": trainer.optimizers[0], "data": {"pos": pos}}

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.ck = ckpt.Checkpointer(self.a.job, shm=self.a.shm, disk=self.a.disk, disk_every=1)
        state = self._state(trainer, module)
        last = self.ck.restore(state)
        if last is not None:
            self.start = last + 1
            self.data.offset = state["data"]["pos"]
            self._event(restored=last, tiers=self.ck.last_restore.tiers)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        step = self.start + batch_idx
        self._event(step=step, loss=float(outputs["loss"].detach()).hex())
        # the samples read so far: this run's from the offset it restored on
        pos = self.data.offset + (batch_idx + 1) * len(batch)
        self.ck.save(step, self._state(trainer, module, pos)).wait()
        if step == self.a.raise_at:
            raise RuntimeError("CUDA out of memory (raised by the test)")
        if step + 1 >= self.a.steps:
            trainer.should_stop = True

    def on_exception(self, trainer, module, exception: BaseException) -> None:
        if self.ck is not None:
            self.ck.close()  # called inside Lightning's except: the Checkpointer sees a crash

    def teardown(self, trainer, module, stage: str) -> None:
        if self.ck is not None:
            self.ck.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--job", required=True)
    ap.add_argument("--shm", required=True)
    ap.add_argument("--disk")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--raise-at", type=int)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    torch.manual_seed(0)
    data = Windows()
    module = TinyLM()
    loader = torch.utils.data.DataLoader(data, batch_size=2, shuffle=False)
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[Tierckpt(a, data)])
    trainer.fit(module, loader)
    torch.save({k: v.detach().clone() for k, v in module.state_dict().items()}, a.out + ".pt")


if __name__ == "__main__":
    main()
