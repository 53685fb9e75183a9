"""XLA (torch-xla 2.9: TPU, Trainium's Neuron stack through its 2.9 release, and the CPU PJRT client).

XLA tensors are lazy: a tensor may still be a pending graph. ``stage`` runs the pending graph once
(``torch_xla.sync()``), then fetches every XLA tensor of the step in one batched device-to-host transfer
(``_xla_get_cpu_tensors``; per-tensor ``.cpu()`` where a torch-xla lacks it). Both happen on the training
thread: the next step's in-place updates replace a tensor's data as they are traced, so a transfer started
later could read the next step's values. The fetched host tensors belong to the adapter; the Checkpointer
copies them into the slot in the background.

SPMD-sharded tensors (one process driving all of a host's devices) come back whole: the checkpoint holds the
global tensor, and ``restore`` copies it into the sharded tensor in place, which keeps its sharding; ``settle``
runs the queued copies as one graph once the state dicts are loaded. A multi-host SPMD job, whose processes
each address only some shards, is not supported.

This module is imported only when a step holds an XLA tensor, so torch_xla is already loaded by then and
importing it here costs nothing (and changes no environment variable that the trainer had not changed).
"""

from __future__ import annotations

from typing import Hashable

import torch
import torch_xla

from .base import CpuAdapter, Item, Staging

__all__ = ["XlaAdapter", "storage_key"]


def _sync() -> None:
    sync = getattr(torch_xla, "sync", None)
    if sync is not None:
        sync()
    else:  # torch-xla before 2.6
        import torch_xla.core.xla_model as xm

        xm.mark_step()


def fetch(tensors: list[torch.Tensor], batched: bool = True) -> list[torch.Tensor]:
    """Host copies of XLA tensors: one transfer for all of them, or one per tensor without ``batched``."""
    get = getattr(torch_xla._XLAC, "_xla_get_cpu_tensors", None) if batched else None
    if get is None:
        return [t.cpu() for t in tensors]
    return list(get(tensors))


def storage_key(t: torch.Tensor) -> Hashable:
    """Equal for a parameter and the state-dict tensors that alias it: XLA tensors have no host storage."""
    return ("xla", torch_xla._XLAC._unique_id_for_ir_and_data(t))


class XlaAdapter(CpuAdapter):
    """Staging and restore for ``xla`` tensors (see the module docstring)."""

    def __init__(self, batched: bool = True) -> None:
        self.batched = batched

    def stage(self, now: list[Item], later: list[Item], buf: torch.Tensor) -> Staging:
        items = now + later
        _sync()
        hosts = fetch([t for t, _, _ in items], self.batched)
        return Staging([], [(h, off, n) for h, (_, off, n) in zip(hosts, items)])

    def restore(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        with torch.no_grad():
            for t, host in pairs:
                # in place: the Parameter object, its optimizer's reference and its sharding stay
                t.copy_(host)

    def settle(self) -> None:
        # loading the state dicts queued copies into the parameters; left pending, a later ``.cpu()`` of an
        # unevenly sharded parameter runs them as a graph of its own and comes back replicated (torch-xla 2.9)
        _sync()

    def storage_key(self, t: torch.Tensor) -> Hashable:
        return storage_key(t)
