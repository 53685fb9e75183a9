"""Device adapters: how tensors of each ``tensor.device.type`` are staged into host memory and restored.

The contract is :class:`base.DeviceAdapter`; ``cpu`` and the generic fallback live beside it, ``cuda`` and
``xla`` in their own modules, imported only when a tensor of that type shows up (torch_xla is never imported
by this package unless the trainer already holds an XLA tensor).
"""

from __future__ import annotations

from typing import Callable, Hashable

import torch

from .base import CpuAdapter, DeviceAdapter, GenericAdapter, Item, Staging, slot_view

__all__ = ["DeviceAdapter", "Staging", "Item", "CpuAdapter", "GenericAdapter", "slot_view", "make_adapter",
           "register_adapter", "settle", "storage_key"]


def _cuda() -> DeviceAdapter:
    from .cuda import CudaAdapter

    return CudaAdapter()


def _xla() -> DeviceAdapter:
    from .xla import XlaAdapter

    return XlaAdapter()


_FACTORIES: dict[str, Callable[[], DeviceAdapter]] = {"cpu": CpuAdapter, "cuda": _cuda, "xla": _xla}


def register_adapter(device_type: str, factory: Callable[[], DeviceAdapter]) -> None:
    """Use ``factory()`` for tensors whose ``device.type`` is ``device_type`` from now on (for a backend
    that can do better than the generic ``.to("cpu")``)."""
    _FACTORIES[device_type] = factory


def make_adapter(device_type: str) -> DeviceAdapter:
    """A new adapter for ``device_type``; the generic one for a type nothing was registered for."""
    return _FACTORIES.get(device_type, GenericAdapter)()


def settle(device_types: set[str]) -> None:
    """Run ``settle`` of each of these device types' adapters (after a restore loaded the state dicts)."""
    for device_type in sorted(device_types):
        make_adapter(device_type).settle()


def storage_key(t: torch.Tensor) -> Hashable:
    """A key equal for tensors that share their data, on any device (see ``DeviceAdapter.storage_key``)."""
    if t.is_cpu or t.is_cuda:
        return t.untyped_storage().data_ptr()
    return make_adapter(t.device.type).storage_key(t)
