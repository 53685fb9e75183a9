"""A training state built from torchtitan's own checkpoint components, as its CheckpointManager hands it to DCP.

``{"model": ModelWrapper, "optimizer": OptimizersContainer, "lr_scheduler": LRSchedulersContainer,
"dataloader": ParallelAwareDataloader, "train_state": TrainProgress}``: every value a ``Stateful``
object, the optimizers inside a container, the data loader's state a pickled ``bytes`` value (torchtitan
keeps it so), the lr schedulers' and train state's plain ints. Shared by the tests and ``bench_save.py``.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import nn
from torch.utils.data import IterableDataset


class Tokens(IterableDataset):
    """An endless stream of token windows, resumable by position (a torchdata Stateful dataset)."""

    def __init__(self, vocab: int, seq: int, seed: int = 0) -> None:
        self.vocab, self.seq, self.seed, self.pos = vocab, seq, seed, 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.pos)
            self.pos += 1
            yield torch.randint(0, self.vocab, (self.seq + 1,), generator=g)

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict) -> None:
        self.pos = sd["pos"]


class TrainProgress:
    """torchtitan's trainer saves itself as ``train_state``: step and tokens seen."""

    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]


def titan_state(model: nn.Module, *, lr: float = 1e-3, vocab: int = 64, seq: int = 8, batch: int = 2,
                warmup: int = 2, steps: int = 100, init: bool = True) -> dict:
    """torchtitan's checkpoint state over ``model`` (AdamW through its OptimizersContainer).

    ``init``: take one zero-learning-rate step so the optimizer state exists (torchtitan's containers do
    the same before their first state_dict)."""
    from torchtitan.components.checkpoint import ModelWrapper
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    optim = OptimizersContainer(
        OptimizersContainer.Config(
            param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW",
                                           optimizer_kwargs={"lr": lr, "betas": (0.9, 0.95), "weight_decay": 0.1})],
            implementation="for-loop"),
        model_parts=[model])
    if init:
        from torchtitan.components.optimizer.utils import init_optim_state

        for o in optim.optimizers:
            init_optim_state(o)
    sched = LRSchedulersContainer.Config(warmup_steps=warmup).build(optimizers=optim, training_steps=steps)
    loader = ParallelAwareDataloader(Tokens(vocab, seq), dp_rank=0, dp_world_size=1, batch_size=batch)
    return {"model": ModelWrapper(model), "optimizer": optim, "lr_scheduler": sched, "dataloader": loader,
            "train_state": TrainProgress()}
