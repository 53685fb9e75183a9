"""Small tensor helpers shared by the Checkpointer, the DCP reader and the CLI."""

from __future__ import annotations

import ctypes
from typing import Callable

import torch

__all__ = ["dtype_name", "dtype_of", "buffer_view", "buffer_allocator", "local_chunk", "local_tensor"]


def dtype_name(dt: torch.dtype) -> str:
    """The manifest's name for a dtype (``float32``, ``bfloat16``, …)."""
    return str(dt).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype a manifest names; KeyError (with the name) if this torch has none."""
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        from ._load import StateMismatchError

        raise StateMismatchError(f"checkpoint holds dtype {name!r}, unknown to this torch")
    return dt


def buffer_view(ptr: int, n: int) -> memoryview:
    """A writable byte view of ``n`` bytes of memory at ``ptr`` (a tensor's storage)."""
    return memoryview((ctypes.c_char * n).from_address(ptr)).cast("B")


def buffer_allocator(keep: list[torch.Tensor]) -> Callable[[int], memoryview]:
    """``alloc(n)`` for recovery's fetchers: a fresh CPU tensor's bytes, kept alive in ``keep``."""

    def alloc(n: int) -> memoryview:
        t = torch.empty(max(n, 1), dtype=torch.uint8)
        keep.append(t)
        return buffer_view(t.data_ptr(), n)

    return alloc


def local_chunk(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(local tensor, global shape, offsets of the local chunk)."""
    if hasattr(t, "to_local"):
        if hasattr(t, "global_tensor"):  # torch-xla's XLAShardedTensor: saved whole (see ckpt._devices.xla)
            return t.global_tensor, tuple(t.shape), (0,) * t.dim()
        if hasattr(t, "placements"):
            local = t.to_local()
            chunks = t.__create_chunk_list__()
            offsets = tuple(chunks[0].offsets) if chunks else (0,) * t.dim()
            return local, tuple(t.shape), offsets
    return t, tuple(t.shape), (0,) * t.dim()


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The data this rank holds of ``t``: a DTensor's local shard, torch-xla's sharded tensor whole (its
    ``to_local`` raises), any other tensor itself."""
    if hasattr(t, "to_local"):
        if hasattr(t, "global_tensor"):
            return t.global_tensor
        if hasattr(t, "placements"):
            return t.to_local()
    return t
