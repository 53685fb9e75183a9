"""CUDA: the staging slot registered as pinned memory, device-to-host copies on a side stream.

``stage`` only enqueues: the copies run on one side stream per device while the next forward/backward runs
on the compute stream. The compute stream waits (on the GPU, not the host) for the copies of the tensors
that the next step may change in place (``now``: buffers, plain tensors); the optimizer step pre-hook waits
for the rest. ``done`` blocks the Checkpointer's staging thread, never the training thread, until every copy
has landed in the slot, so the agent hears of the slot only once its bytes are there.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Hashable

import torch

from .base import Item, Staging, slot_view

__all__ = ["CudaAdapter"]

#: cudaHostRegisterPortable: pinned for every CUDA context of the process, as DCP registers its shared memory
_REGISTER_PORTABLE = 1


class CudaAdapter:
    """Staging and restore for ``cuda`` tensors (see the module docstring).

    ``cudart`` (for tests) stands in for ``torch.cuda.cudart()``; ``pin`` False skips registration, as it is
    skipped when CUDA is not available.
    """

    def __init__(self, cudart: Any = None, pin: bool | None = None) -> None:
        self._cudart = cudart
        self._pin = torch.cuda.is_available() if pin is None else pin
        self._registered: dict[int, int] = {}  # data_ptr -> bytes
        # slots are pinned by the Checkpointer's leaser thread as well as by the training thread
        self._lock = threading.Lock()
        self._side: dict[int, torch.cuda.Stream] = {}
        #: the device the staged tensors live on, once one was staged: registration runs with it current, so
        #: a background thread (whose current device is 0) never creates a context on another rank's GPU
        self._home: int | None = None
        self._said_unpinned = False

    # ------------------------------------------------------------ host memory
    def _rt(self) -> Any:
        if self._cudart is None:
            self._cudart = torch.cuda.cudart()
        return self._cudart

    def _on_home(self) -> Any:
        if self._home is None or not torch.cuda.is_available():
            return contextlib.nullcontext()
        return torch.cuda.device(self._home)

    def _clear_error(self) -> None:
        """Reset this thread's CUDA runtime error after a failed call: the runtime keeps it as its "last
        error", and torch's check after the next kernel launch on this thread would raise it there
        (``CUDA error: invalid argument`` from an unrelated copy or forward pass)."""
        rt = self._rt()
        get_last = getattr(rt, "cudaGetLastError", None)
        if get_last is not None:
            get_last()
            return
        if not torch.cuda.is_available():
            return
        # torch's runtime module has no cudaGetLastError; a kernel launch reads and resets the error, and torch
        # raises it once
        try:
            torch.zeros(1, device="cuda" if self._home is None else f"cuda:{self._home}")
        except Exception:  # noqa: BLE001 - the error being reset, whatever torch wraps it in
            pass

    def prepare_host(self, buf: torch.Tensor) -> None:
        if not self._pin or buf.numel() == 0:
            return
        ptr, n = buf.data_ptr(), buf.numel() * buf.element_size()
        with self._lock, self._on_home():
            if self._registered.get(ptr) == n:
                return
            if self._registered.pop(ptr, None) is not None:
                if int(self._rt().cudaHostUnregister(ptr)) != 0:
                    self._clear_error()
            err = int(self._rt().cudaHostRegister(ptr, n, _REGISTER_PORTABLE))
            if err == 0:
                self._registered[ptr] = n
                return
            self._clear_error()
            said, self._said_unpinned = self._said_unpinned, True
        # still correct unpinned: the copies then run synchronously, at pageable-memory speed. Seen on an H200
        # machine for every slot under /tmp, on a disk (cudaError 1), never for a slot on /dev/shm (tmpfs)
        import logging

        logging.getLogger("tierckpt").log(
            logging.DEBUG if said else logging.WARNING,
            "could not pin the %d-byte staging slot for CUDA (cudaError %d): saves from the GPU copy "
            "synchronously; put the agent's memory folder (shm) on tmpfs such as /dev/shm", n, err)

    def release_host(self, buf: torch.Tensor) -> None:
        if buf is None or buf.numel() == 0:
            return
        ptr = buf.data_ptr()
        with self._lock, self._on_home():
            if self._registered.pop(ptr, None) is not None and int(self._rt().cudaHostUnregister(ptr)) != 0:
                self._clear_error()

    def pinned(self, buf: torch.Tensor) -> bool:
        """Whether ``prepare_host`` registered this slot."""
        with self._lock:
            return buf.data_ptr() in self._registered

    # ------------------------------------------------------------ save
    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        idx = device.index if device.index is not None else torch.cuda.current_device()
        s = self._side.get(idx)
        if s is None:
            s = self._side[idx] = torch.cuda.Stream(device=idx)
        return s

    def stage(self, now: list[Item], later: list[Item], buf: torch.Tensor) -> Staging:
        by_dev: dict[torch.device, tuple[list[Item], list[Item]]] = {}
        for i, items in enumerate((now, later)):
            for item in items:
                by_dev.setdefault(item[0].device, ([], []))[i].append(item)
        events: list[torch.cuda.Event] = []
        for dev, (dnow, dlater) in by_dev.items():
            if self._home is None:
                self._home = dev.index if dev.index is not None else torch.cuda.current_device()
            compute = torch.cuda.current_stream(dev)
            side = self._stream(dev)
            # the copies read what the step wrote: start them after everything queued so far
            side.wait_stream(compute)
            with torch.cuda.stream(side):
                self._enqueue(dnow, buf, side)
                if dnow:
                    copied = torch.cuda.Event()
                    copied.record(side)
                    # the next step may change these in place: its kernels wait for their copies, on the GPU
                    compute.wait_event(copied)
                self._enqueue(dlater, buf, side)
                ev = torch.cuda.Event()
                ev.record(side)
            events.append(ev)
        return Staging([], [], _synchronize(events))

    @staticmethod
    def _enqueue(items: list[Item], buf: torch.Tensor, side: torch.cuda.Stream) -> None:
        for src, off, n in items:
            if n == 0:
                continue
            slot_view(buf, off, n, src).copy_(src, non_blocking=True)
            # the caching allocator must not hand this memory to the compute stream before the copy ran
            src.record_stream(side)

    # ------------------------------------------------------------ restore
    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=self._pin)

    def restore(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        devices = set()
        with torch.no_grad():
            for t, host in pairs:
                t.copy_(host, non_blocking=True)
                devices.add(t.device)
        for dev in devices:
            if dev.type == "cuda":
                torch.cuda.current_stream(dev).synchronize()

    def settle(self) -> None:
        pass

    def storage_key(self, t: torch.Tensor) -> Hashable:
        return t.untyped_storage().data_ptr()


def _synchronize(events: list) -> Callable[[], None]:
    def done() -> None:
        for ev in events:
            ev.synchronize()

    return done
