"""Flatten a training state into named leaves, and put restored leaves back.

A state is a dict whose values may be tensors (plain or DTensor), ``nn.Module``s,
optimizers, DCP ``Stateful`` objects (at any depth: a Stateful inside a dict,
or inside another Stateful's state dict), nested dicts / lists / tuples,
``bytes`` (kept raw in the shard, not in the manifest), and small JSON values
(int, float, str, bool, None). Leaves are named by their path, ``/``-separated,
with ``~`` escapes (``~0`` = ``~``, ``~1`` = ``/``) and ``~i`` before an int
dict key. A list or tuple of JSON values only is one leaf, whichever of the two
it is, so a state whose tuples became lists (or back) still matches its
checkpoint; tuples come back as tuples.

Modules and optimizers go through ``torch.distributed.checkpoint.state_dict``
(sharded for FSDP2 / DTensor, plain otherwise), as DCP does, so FQN-keyed
optimizer state and DTensor shards come out the same way DCP sees them. An
optimizer subclass with a ``state_dict`` of its own (torchtitan's
``OptimizersContainer``) and every other Stateful object go through their own
``state_dict`` / ``load_state_dict``. Which tensors only an optimizer step
changes (so their copy may overlap forward/backward) is decided by
:mod:`ckpt._guard`, whatever container holds the optimizer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from tiers.manifest import decode_value, encode_value

from . import _guard
from ._devices import settle, storage_key
from ._tensors import local_tensor

__all__ = ["Leaf", "Flat", "flatten_state", "forget_initialized", "StateError", "encode_value", "decode_value"]

JSON_SCALARS = (int, float, str, bool, type(None))


class StateError(TypeError):
    """The state holds something the Checkpointer cannot save or restore."""


def _seg(k: Any) -> str:
    if isinstance(k, bool) or not isinstance(k, (str, int)):
        raise StateError(f"dict key {k!r} is a {type(k).__name__}: state dict keys must be str or int")
    if isinstance(k, int):
        return f"~i{k}"
    return k.replace("~", "~0").replace("/", "~1")


#: (prefix, key) -> joined name: a state's names are the same at every save, and an optimizer container's
#: thousands of per-parameter values made building them again a fifth of the flattening time
_joined: dict[tuple[str, Any, type], str] = {}


def _join(prefix: str, k: Any) -> str:
    key = (prefix, k, type(k))  # True and 1 are equal keys but different segments (one is refused)
    got = _joined.get(key)
    if got is None:
        got = f"{prefix}/{_seg(k)}" if prefix else _seg(k)
        if len(_joined) >= 1 << 18:
            _joined.clear()
        _joined[key] = got
    return got


#: prefix -> (the keys of the dict last walked there, their names), for dicts whose keys are all ``str``: a
#: state dict has the same keys at every save, so one comparison of the key tuple names every entry (a key
#: tuple of str can equal no tuple holding an int or bool key, whose segments differ)
_dict_names: dict[str, tuple[tuple, tuple[str, ...]]] = {}


def _names_of(prefix: str, d: dict) -> tuple[tuple, tuple[str, ...]]:
    """``(keys, names)`` of the entries of ``d`` walked under ``prefix``; raises StateError for a bad key."""
    keys = tuple(d)
    got = _dict_names.get(prefix)
    if got is not None and got[0] == keys:
        return got
    names = tuple(_join(prefix, k) for k in keys)
    if all(type(k) is str for k in keys):
        if len(_dict_names) >= 1 << 14:
            _dict_names.clear()
        _dict_names[prefix] = (keys, names)
    return keys, names


@dataclass(slots=True)
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
    #: optimizers that had no state before this flattening: DCP's state-dict helper gave them one (a step with
    #: zero gradients and no learning rate; AdamW's step count is 1 then), see :func:`forget_initialized`
    uninitialized: list[torch.optim.Optimizer] = field(default_factory=list)


def forget_initialized(optimizers: list[torch.optim.Optimizer]) -> None:
    """Give ``optimizers`` (:attr:`Flat.uninitialized`) back the empty state they had before a flattening
    initialised it, so that their first real step starts as it would have without a checkpoint library: for a
    fresh start, a lease sized from the state, a restore that failed."""
    for o in optimizers:
        o.state.clear()


def _is_stateful(v: Any) -> bool:
    return callable(getattr(v, "state_dict", None)) and callable(getattr(v, "load_state_dict", None)) \
        and not isinstance(v, torch.Tensor)


def _own_state_dict(o: torch.optim.Optimizer) -> bool:
    """An optimizer subclass with a ``state_dict`` of its own (a container such as torchtitan's
    ``OptimizersContainer``): its state dict is what it says it is, not what DCP's helper computes."""
    return type(o).state_dict is not torch.optim.Optimizer.state_dict


def _modules_in(v: Any, depth: int = 2) -> list[nn.Module]:
    """Modules held by a state value: itself, or those in a ``Stateful`` wrapper's attributes (torchtitan's
    ``ModelWrapper.model``) and in the lists, tuples and dicts of the state."""
    out: list[nn.Module] = []

    def visit(x: Any, d: int) -> None:
        if d < 0:
            return
        if isinstance(x, nn.Module):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            for y in x:
                visit(y, d - 1)
        elif isinstance(x, dict):
            for y in x.values():
                visit(y, d - 1)
        elif _is_stateful(x) and not isinstance(x, torch.optim.Optimizer):
            for y in getattr(x, "__dict__", {}).values():
                if isinstance(y, (nn.Module, list, tuple)):
                    visit(y, d - 1)

    visit(v, depth)
    return out


def _json_only(v: Any) -> bool:
    """A list or tuple (nested to any depth) of JSON scalars only: saved as one value."""
    return all(isinstance(x, JSON_SCALARS) or isinstance(x, (list, tuple)) and _json_only(x) for x in v)


def _loads_in_place(module: nn.Module, sd: dict) -> bool:
    """True when loading ``sd`` back into ``module`` would change nothing once ``sd``'s tensors are filled:
    every value is a CPU or CUDA tensor that is one of the module's own parameters or buffers (same memory,
    shape, strides and dtype), and no submodule changes what a load does (load hooks, as FSDP's, or an
    overridden load). Then a restore, which writes those tensors in place, need not load the state dict
    (DCP's ``set_model_state_dict`` costs about 14 ms over 200 parameters, to copy each onto itself)."""
    base_load, base_from = nn.Module.load_state_dict, nn.Module._load_from_state_dict
    for m in module.modules():
        if (m._load_state_dict_pre_hooks or m._load_state_dict_post_hooks
                or type(m).load_state_dict is not base_load or type(m)._load_from_state_dict is not base_from):
            return False
    own = set()
    for t in (*module.parameters(), *module.buffers()):
        t = local_tensor(t)
        if t.device.type not in ("cpu", "cuda"):
            return False
        own.add((t.data_ptr(), t.dtype, tuple(t.shape), t.stride()))
    for v in sd.values():
        if not isinstance(v, torch.Tensor):
            return False
        v = local_tensor(v)
        if v.device.type not in ("cpu", "cuda") or (v.data_ptr(), v.dtype, tuple(v.shape), v.stride()) not in own:
            return False
    return True


def flatten_state(state: dict, *, for_restore: bool = False) -> Flat:
    """Flatten ``state`` (see module docstring). Raises StateError for unsupported values.

    ``for_restore``: optimizers whose state is still empty are initialised first
    (as DCP does), so their tensors exist to be filled in place.
    """
    if not isinstance(state, dict):
        raise StateError(f"state must be a dict, got {type(state).__name__}")
    from torch.distributed.checkpoint import state_dict as dsd

    flat = Flat()
    modules = [m for v in state.values() for m in _modules_in(v)]
    optims: list[torch.optim.Optimizer] = []
    opts = dsd.StateDictOptions(full_state_dict=False, cpu_offload=False)
    fixups: list[Callable[[], None]] = []
    no_dsd: set[int] = set()  # modules saved through their own state_dict (see below)

    def owner_of(opt: torch.optim.Optimizer) -> nn.Module | None:
        params = {id(p) for g in opt.param_groups for p in g["params"]}
        for m in modules:
            if any(id(p) in params for p in m.parameters()):
                return m
        return None

    def entry(v: Any, prefix: str, parent: Any, key: Any) -> None:
        if isinstance(v, nn.Module):
            try:
                sd = dsd.get_model_state_dict(v, options=opts)
                if not (for_restore and _loads_in_place(v, sd)):
                    flat.appliers.append(lambda v=v, sd=sd: dsd.set_model_state_dict(v, sd, options=opts))
            except (AttributeError, KeyError):
                # state-dict hooks that rename parameters (a fused QKV projection saved as wq/wk/wv, as
                # torchtitan's models do) defeat DCP's helper, which looks each key up as a parameter: the
                # module's own state_dict / load_state_dict, whose hooks undo each other, are used instead
                sd = v.state_dict()
                flat.appliers.append(lambda v=v, sd=sd: v.load_state_dict(sd))
                no_dsd.add(id(v))
            _walk(sd, prefix, flat, None, None, fixups, entry)
        elif isinstance(v, torch.optim.Optimizer):
            optims.append(v)
            if not v.state:
                flat.uninitialized.append(v)
            model = None if _own_state_dict(v) else owner_of(v)
            plain = model is not None and id(model) in no_dsd
            if model is None and not _own_state_dict(v):
                raise StateError(
                    f"{prefix}: an optimizer in the state optimizes parameters of no module in the state: "
                    "put the model in the state too (e.g. {'model': model, 'optim': optim})")
            start = len(flat.leaves)
            sd = None
            if model is not None and not plain:
                try:
                    sd = dsd.get_optimizer_state_dict(model, v, options=opts)
                    flat.appliers.append(
                        lambda m=model, o=v, sd=sd: dsd.set_optimizer_state_dict(m, o, sd, options=opts))
                except (AttributeError, KeyError):  # its model's parameters are renamed by hooks (see above)
                    sd = None
            if sd is None:
                sd = v.state_dict()
                flat.appliers.append(lambda v=v, sd=sd: v.load_state_dict(sd))
            _walk(sd, prefix, flat, None, None, fixups, entry)
            for leaf in flat.leaves[start:]:
                leaf.guarded = leaf.tensor is not None
        elif _is_stateful(v):
            inner = _guard.find_optimizers(v)
            optims.extend(inner)
            flat.uninitialized.extend(o for o in inner if not o.state)
            sd = v.state_dict()
            flat.appliers.append(lambda v=v, sd=sd: v.load_state_dict(sd))
            _walk(sd, prefix, flat, None, None, fixups, entry)
        else:
            _walk(v, prefix, flat, parent, key, fixups, entry)

    for name, v in state.items():
        entry(v, _seg(name), state, name)
    for o in list(optims):
        optims.extend(x for x in _guard.find_optimizers(o) if x is not o)
    flat.optimizers = optims
    _guard.learn(optims)
    guarded = _guard.guarded_storages()
    if guarded:
        for leaf in flat.leaves:
            if leaf.tensor is not None and not leaf.guarded:
                if storage_key(local_tensor(leaf.tensor)) in guarded:
                    leaf.guarded = True
    # tuples rebuilt (innermost first) before any container loads the state dict that holds them
    flat.appliers[:0] = fixups
    if for_restore:
        devices = {leaf.tensor.device.type for leaf in flat.leaves
                   if leaf.tensor is not None and not leaf.tensor.is_cpu}
        if devices:
            flat.appliers.append(lambda: settle(devices))
    return flat


#: exact types walked inline in a dict's loop (a subclass takes the general path of :func:`_walk`)
_TENSOR_TYPES = frozenset({torch.Tensor, nn.Parameter})
_SCALAR_TYPES = frozenset({int, str, bool, type(None)})


def _non_finite(name: str, v: float) -> StateError:
    return StateError(f"{name} is {v}: non-finite floats cannot be saved as JSON; store a tensor instead")


def _walk(v: Any, name: str, flat: Flat, parent: Any, key: Any, fixups: list, entry: Callable) -> None:
    if isinstance(v, torch.Tensor):
        flat.leaves.append(Leaf(name, v, None, parent, key))
    elif isinstance(v, dict):
        if not v:
            flat.leaves.append(Leaf(name, None, {}, parent, key))
            return
        keys, names = _names_of(name, v)
        leaves = flat.leaves
        # tensors and JSON scalars (most of a state's entries) without a call each
        for nm, k, x in zip(names, keys, v.values()):
            tx = type(x)
            if tx in _TENSOR_TYPES:
                leaves.append(Leaf(nm, x, None, v, k))
            elif tx is float:
                if x - x != 0.0:  # inf or nan
                    raise _non_finite(nm, x)
                leaves.append(Leaf(nm, None, x, v, k))
            elif tx in _SCALAR_TYPES:
                leaves.append(Leaf(nm, None, x, v, k))
            else:
                _walk(x, nm, flat, v, k, fixups, entry)
    elif isinstance(v, (list, tuple)) and _json_only(v):
        flat.leaves.append(Leaf(name, None, v, parent, key))
    elif isinstance(v, (list, tuple)):
        # a tuple is immutable: its elements are restored into a list, turned back into a tuple afterwards
        items = list(v) if isinstance(v, tuple) else v
        for i, x in enumerate(items):
            _walk(x, _join(name, i), flat, items, i, fixups, entry)
        if isinstance(v, tuple) and parent is not None and not isinstance(parent, tuple):
            fixups.append(lambda p=parent, k=key, items=items: p.__setitem__(k, tuple(items)))
    elif isinstance(v, (bytes, bytearray)):
        flat.leaves.append(Leaf(name, None, bytes(v), parent, key))
    elif isinstance(v, JSON_SCALARS):
        if isinstance(v, float) and not math.isfinite(v):
            raise _non_finite(name, v)
        flat.leaves.append(Leaf(name, None, v, parent, key))
    elif isinstance(v, (nn.Module, torch.optim.Optimizer)) or _is_stateful(v):
        entry(v, name, parent, key)  # nested: the same as at the top level
    else:
        raise StateError(
            f"{name} is a {type(v).__name__}: the state may hold tensors, modules, optimizers, "
            "Stateful objects, dicts, lists, tuples, bytes and JSON values (int, float, str, bool, None)"
        )
