"""Flatten a training state into named leaves, and put restored leaves back.

A state is a dict whose values may be tensors (plain or DTensor), ``nn.Module``s,
optimizers, DCP ``Stateful`` objects, nested dicts / lists / tuples, and small
JSON values (int, float, str, bool, None). Leaves are named by their path,
``/``-separated, with ``~`` escapes (``~0`` = ``~``, ``~1`` = ``/``) and ``~i``
before an int dict key.

Modules and optimizers go through ``torch.distributed.checkpoint.state_dict``
(sharded for FSDP2 / DTensor, plain otherwise), as DCP does, so FQN-keyed
optimizer state and DTensor shards come out the same way DCP sees them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ._devices import settle, storage_key

__all__ = ["Leaf", "Flat", "flatten_state", "StateError"]

JSON_SCALARS = (int, float, str, bool, type(None))


class StateError(TypeError):
    """The state holds something the Checkpointer cannot save or restore."""


def _seg(k: Any) -> str:
    if isinstance(k, bool) or not isinstance(k, (str, int)):
        raise StateError(f"dict key {k!r} is a {type(k).__name__}: state dict keys must be str or int")
    if isinstance(k, int):
        return f"~i{k}"
    return k.replace("~", "~0").replace("/", "~1")


def _join(prefix: str, k: Any) -> str:
    return f"{prefix}/{_seg(k)}" if prefix else _seg(k)


@dataclass
class Leaf:
    """One named value: a tensor (``tensor`` set) or a JSON value (``value``).

    ``parent``/``key`` locate it in its container so a restore can put a new
    value back; ``guarded``: only an optimizer step may change it (so its copy
    may overlap forward/backward).
    """

    name: str
    tensor: torch.Tensor | None = None
    value: Any = None
    parent: Any = None
    key: Any = None
    guarded: bool = False


@dataclass
class Flat:
    """A flattened state: leaves in order, plus how to apply restored containers."""

    leaves: list[Leaf] = field(default_factory=list)
    #: run after the leaves were filled in place: load module/optimizer/Stateful state dicts, then let each
    #: device the state lives on finish what that queued (``DeviceAdapter.settle``)
    appliers: list[Callable[[], None]] = field(default_factory=list)
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)


def _is_stateful(v: Any) -> bool:
    return callable(getattr(v, "state_dict", None)) and callable(getattr(v, "load_state_dict", None))


def _param_storages(optims: list[torch.optim.Optimizer]) -> set:
    keys = set()
    for o in optims:
        for g in o.param_groups:
            for p in g["params"]:
                keys.add(storage_key(_local(p)))
    return keys


def flatten_state(state: dict, *, for_restore: bool = False) -> Flat:
    """Flatten ``state`` (see module docstring). Raises StateError for unsupported values.

    ``for_restore``: optimizers whose state is still empty are initialised first
    (as DCP does), so their tensors exist to be filled in place.
    """
    if not isinstance(state, dict):
        raise StateError(f"state must be a dict, got {type(state).__name__}")
    from torch.distributed.checkpoint import state_dict as dsd

    flat = Flat()
    modules = [v for v in state.values() if isinstance(v, nn.Module)]
    optims = [v for v in state.values() if isinstance(v, torch.optim.Optimizer)]
    flat.optimizers = optims
    opts = dsd.StateDictOptions(full_state_dict=False, cpu_offload=False)

    def owner_of(opt: torch.optim.Optimizer) -> nn.Module:
        params = {id(p) for g in opt.param_groups for p in g["params"]}
        for m in modules:
            if any(id(p) in params for p in m.parameters()):
                return m
        raise StateError(
            "an optimizer in the state optimizes parameters of no module in the state: "
            "put the model in the state too (e.g. {'model': model, 'optim': optim})"
        )

    for name, v in state.items():
        prefix = _seg(name)
        if isinstance(v, nn.Module):
            sd = dsd.get_model_state_dict(v, options=opts)
            flat.appliers.append(lambda v=v, sd=sd: dsd.set_model_state_dict(v, sd, options=opts))
            _walk(sd, prefix, flat, None, None)
        elif isinstance(v, torch.optim.Optimizer):
            model = owner_of(v)
            sd = dsd.get_optimizer_state_dict(model, v, options=opts)
            flat.appliers.append(
                lambda m=model, o=v, sd=sd: dsd.set_optimizer_state_dict(m, o, sd, options=opts))
            start = len(flat.leaves)
            _walk(sd, prefix, flat, None, None)
            for leaf in flat.leaves[start:]:
                leaf.guarded = leaf.tensor is not None
        elif _is_stateful(v) and not isinstance(v, torch.Tensor):
            sd = v.state_dict()
            flat.appliers.append(lambda v=v, sd=sd: v.load_state_dict(sd))
            _walk(sd, prefix, flat, None, None)
        else:
            _walk(v, prefix, flat, state, name)
    if optims:
        guarded = _param_storages(optims)
        for leaf in flat.leaves:
            if leaf.tensor is not None and not leaf.guarded:
                if storage_key(_local(leaf.tensor)) in guarded:
                    leaf.guarded = True
    if for_restore:
        devices = {leaf.tensor.device.type for leaf in flat.leaves
                   if leaf.tensor is not None and not leaf.tensor.is_cpu}
        if devices:
            flat.appliers.append(lambda: settle(devices))
    return flat


def _local(t: torch.Tensor) -> torch.Tensor:
    if hasattr(t, "to_local"):
        if hasattr(t, "global_tensor"):
            # torch-xla's XLAShardedTensor is a DTensor whose to_local raises: its data is the global tensor
            return t.global_tensor
        if hasattr(t, "placements"):
            return t.to_local()
    return t


def _walk(v: Any, name: str, flat: Flat, parent: Any, key: Any) -> None:
    if isinstance(v, torch.Tensor):
        flat.leaves.append(Leaf(name, tensor=v, parent=parent, key=key))
    elif isinstance(v, dict):
        if not v:
            flat.leaves.append(Leaf(name, value={}, parent=parent, key=key))
        for k, x in v.items():
            _walk(x, _join(name, k), flat, v, k)
    elif isinstance(v, tuple) and all(isinstance(x, JSON_SCALARS) for x in v):
        flat.leaves.append(Leaf(name, value=v, parent=parent, key=key))
    elif isinstance(v, (list, tuple)):
        if not v:
            flat.leaves.append(Leaf(name, value=[] if isinstance(v, list) else (), parent=parent, key=key))
        # tuples are immutable: their elements are restored through a list and re-tupled
        for i, x in enumerate(v):
            _walk(x, _join(name, i), flat, v, i)
    elif isinstance(v, JSON_SCALARS):
        if isinstance(v, float) and v != v or v in (float("inf"), float("-inf")):
            raise StateError(f"{name} is {v}: non-finite floats cannot be saved as JSON; store a tensor instead")
        flat.leaves.append(Leaf(name, value=v, parent=parent, key=key))
    elif isinstance(v, (nn.Module, torch.optim.Optimizer)) or _is_stateful(v):
        raise StateError(f"{name}: modules, optimizers and Stateful objects must be top-level entries of the state")
    else:
        raise StateError(
            f"{name} is a {type(v).__name__}: the state may hold tensors, modules, optimizers, "
            "Stateful objects, dicts, lists and JSON values (int, float, str, bool, None)"
        )
