"""The device-adapter contract, and the two adapters that need nothing but torch: cpu and generic.

A device adapter moves the tensors of one device type (``tensor.device.type``) into a staging slot in host
memory and back. The Checkpointer gives each adapter all of a step's tensors of its device type at once, so
an adapter can batch the transfer (one XLA call, one CUDA stream).

Call order, for one Checkpointer:

- ``prepare_host(buf)`` once per staging slot mapping, before that slot's first ``stage`` (CUDA pins it):
  for the slots of the ring mapped ahead, on the Checkpointer's leaser thread, while the training thread
  may be staging into another slot; ``release_host(buf)`` before the mapping is closed. Both are cheap when
  repeated, and must be safe to call from two threads at once.
- ``stage(now, later, buf)`` on the training thread, once per save. It starts the transfer and returns a
  :class:`Staging`: host tensors the Checkpointer still has to copy into the slot (``now`` before ``save``
  returns, ``later`` in its background threads) and ``done``, which the Checkpointer's staging thread calls
  before it tells the agent that the slot is complete.
- On restore: ``host_empty(shape, dtype)`` for each tensor's host buffer; the Checkpointer reads and verifies
  the shard into those buffers, then calls ``restore(pairs)`` once with every (tensor, host buffer) pair.
  Once the module, optimizer and Stateful state dicts are loaded, ``settle()`` runs once for each device type
  the state holds, whichever path the restore took.

``now`` tensors may change as soon as ``save`` returns (buffers, plain tensors); ``later`` tensors change only
in an optimizer step, which waits until the save is staged. Items are ``(tensor, offset, nbytes)``: the
tensor's bytes go to ``buf[offset : offset + nbytes]``, laid out contiguously in the tensor's shape.
"""

from __future__ import annotations

from typing import Callable, Hashable, NamedTuple, Protocol

import torch

__all__ = ["Item", "Staging", "DeviceAdapter", "CpuAdapter", "GenericAdapter", "slot_view"]

#: (tensor, byte offset in the slot, byte count)
Item = tuple[torch.Tensor, int, int]


class Staging(NamedTuple):
    """What is left of one ``stage`` call for the Checkpointer to do."""

    #: host tensors to copy into the slot before ``save`` returns
    now: list[Item]
    #: host tensors to copy into the slot in the background (they belong to the adapter, not the trainer)
    later: list[Item]
    #: blocks until the adapter's own copies into the slot are complete and raises their error; None if none
    done: Callable[[], None] | None = None


class DeviceAdapter(Protocol):
    """Staging and restore for tensors of one device type (see the module docstring for the call order)."""

    def prepare_host(self, buf: torch.Tensor) -> None:
        """Make a staging slot (a uint8 CPU tensor over shared memory) ready for this device's transfers."""

    def release_host(self, buf: torch.Tensor) -> None:
        """Undo ``prepare_host`` before the slot's mapping goes away; a no-op for a slot never prepared."""

    def stage(self, now: list[Item], later: list[Item], buf: torch.Tensor) -> Staging:
        """Start copying every tensor of one save that lives on this device type into ``buf``."""

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous CPU tensor to read a shard's bytes into before ``restore``."""

    def restore(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy each verified host tensor into its tensor on the device, in place; return when done."""

    def settle(self) -> None:
        """Finish what loading the restored state dicts left queued on the device, before training resumes."""

    def storage_key(self, t: torch.Tensor) -> Hashable:
        """A key equal for two tensors that share their data (a parameter and its state-dict entry)."""


def slot_view(buf: torch.Tensor, off: int, n: int, like: torch.Tensor) -> torch.Tensor:
    """``buf[off : off + n]`` seen as a contiguous tensor of ``like``'s dtype and shape."""
    return buf[off : off + n].view(like.dtype).view(like.shape)


class CpuAdapter:
    """Tensors already in host memory: the Checkpointer copies them into the slot itself, on its copier
    threads, so this adapter only hands the lists back."""

    def prepare_host(self, buf: torch.Tensor) -> None:
        pass

    def release_host(self, buf: torch.Tensor) -> None:
        pass

    def stage(self, now: list[Item], later: list[Item], buf: torch.Tensor) -> Staging:
        return Staging(now, later)

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def restore(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        with torch.no_grad():
            for t, host in pairs:
                t.copy_(host)

    def settle(self) -> None:
        pass

    def storage_key(self, t: torch.Tensor) -> Hashable:
        return t.untyped_storage().data_ptr()


class GenericAdapter(CpuAdapter):
    """Any other device (a PrivateUse1 backend such as Trainium's native ``neuron`` device): ``.to("cpu")``
    per tensor on the training thread, then the Checkpointer's background copy into the slot. Correct
    wherever the backend implements ``.to("cpu")`` and ``copy_`` from a CPU tensor; not the fastest."""

    def stage(self, now: list[Item], later: list[Item], buf: torch.Tensor) -> Staging:
        # every device op on the training thread: nothing is known about a backend's thread safety
        return Staging([], [(t.to("cpu"), off, n) for t, off, n in now + later])

    def storage_key(self, t: torch.Tensor) -> Hashable:
        try:
            return t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            # a backend without host-visible storage: a parameter is then recognised only as itself
            return ("id", id(t))
