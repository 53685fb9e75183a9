"""Which tensors only an optimizer step changes, and one hook that makes every optimizer step wait for their copy.

A save copies those tensors (parameters and optimizer state) while the next forward/backward runs, so
the copy must be over before any optimizer changes them. One global optimizer step pre-hook
(``torch.optim.optimizer.register_optimizer_step_pre_hook``) does that for every optimizer of the
process, whatever holds it: a bare optimizer, one inside a ``Stateful`` container (torchtitan's
``OptimizersContainer``), one a framework builds itself. Global pre-hooks run before an optimizer's
own, and a container's step runs its optimizers' steps, so each waits.

The same hook learns the optimizers: every optimizer that has stepped in this process is known, and its
parameters and state tensors are guarded from then on. Before the first optimizer step nothing is
known (and everything is copied before ``save`` returns), which is also when nothing needs the overlap.
Optimizers named explicitly (in the state, or found inside a ``Stateful`` object of it) are known at
once.

The promise this rests on: between two optimizer steps, only an optimizer step changes a parameter or
an optimizer state tensor in place. A training loop that edits weights by hand (an EMA written into the
parameters, a manual clamp) outside ``optimizer.step`` must not use the overlap (``overlap=False``).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Hashable, Iterable

import torch

from ._devices import storage_key
from ._tensors import local_tensor

__all__ = ["register_waiter", "known_optimizers", "guarded_storages", "find_optimizers"]

_lock = threading.Lock()
_known: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
_waiters: dict[int, Callable[[], None]] = {}
_handle: Any = None
_next_id = 0


def _pre_hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if opt not in _known:
        with _lock:
            _known.add(opt)
    for wait in list(_waiters.values()):
        wait()


class _Registration:
    def __init__(self, key: int) -> None:
        self._key = key

    def remove(self) -> None:
        global _handle
        with _lock:
            _waiters.pop(self._key, None)
            if not _waiters and _handle is not None:
                _handle.remove()
                _handle = None


def register_waiter(wait: Callable[[], None]) -> _Registration:
    """Call ``wait()`` before every optimizer step of the process until ``.remove()`` is called.

    ``wait`` returns once the copies it stands for are done (quickly when none is running); it must not
    raise. The global hook is installed with the first waiter and removed with the last.
    """
    global _handle, _next_id
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    with _lock:
        _next_id += 1
        _waiters[_next_id] = wait
        if _handle is None:
            _handle = register_optimizer_step_pre_hook(_pre_hook)
        return _Registration(_next_id)


def known_optimizers() -> list[torch.optim.Optimizer]:
    """Every optimizer that has stepped in this process since the hook was installed, or was named."""
    with _lock:
        return list(_known)


def learn(optims: Iterable[Any]) -> None:
    """Add optimizers named or found in a state (their tensors are guarded from now on); each item may be an
    optimizer or a container that holds some (torchtitan's ``OptimizersContainer``, an lr scheduler)."""
    found = [o for x in optims for o in find_optimizers(x)]
    with _lock:
        for o in found:
            _known.add(o)


def guarded_storages(optims: Iterable[torch.optim.Optimizer] | None = None) -> set[Hashable]:
    """Storage keys of every parameter and optimizer state tensor of ``optims`` (default: the known ones)."""
    out: set[Hashable] = set()
    for o in (known_optimizers() if optims is None else optims):
        for g in o.param_groups:
            for p in g["params"]:
                out.add(storage_key(local_tensor(p)))
        for st in o.state.values():
            if isinstance(st, dict):
                for v in st.values():
                    if isinstance(v, torch.Tensor):
                        out.add(storage_key(local_tensor(v)))
    return out


#: attributes every ``torch.optim.Optimizer`` has, which hold parameters, their state and hyperparameters
_OPTIMIZER_OWN = frozenset({"state", "param_groups", "defaults"})


def find_optimizers(obj: Any, depth: int = 2) -> list[torch.optim.Optimizer]:
    """Optimizers held by ``obj``: itself, or (for a ``Stateful`` container such as torchtitan's
    ``OptimizersContainer`` or an lr scheduler) its attributes and the lists, tuples and dicts in them, up to
    ``depth`` levels down."""
    found: list[torch.optim.Optimizer] = []
    seen: set[int] = set()

    def visit(x: Any, d: int) -> None:
        if id(x) in seen or d < 0:
            return
        seen.add(id(x))
        if isinstance(x, torch.optim.Optimizer):
            found.append(x)
        if isinstance(x, (list, tuple)):
            for y in x:
                visit(y, d - 1)
        elif isinstance(x, dict):
            for y in x.values():
                visit(y, d - 1)
        elif isinstance(x, (torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler)) or (
                callable(getattr(x, "state_dict", None)) and not isinstance(x, (torch.Tensor, torch.nn.Module))):
            optimizer = isinstance(x, torch.optim.Optimizer)
            for attr, y in getattr(x, "__dict__", {}).items():
                if optimizer and attr in _OPTIMIZER_OWN:
                    continue  # its per-parameter state and groups: thousands of entries, never an optimizer
                if isinstance(y, (torch.optim.Optimizer, list, tuple, dict)) or callable(getattr(y, "state_dict", None)):
                    visit(y, d - 1)

    visit(obj, depth)
    return found
