"""Write a restored step where users load it: a DCP folder, one ``torch.save`` file, or safetensors.

The step arrives as its entries, by name (``/``-joined paths with ``~`` escapes, see
:mod:`ckpt._flatten`): whole tensors, raw ``bytes`` values and JSON values. The key
layout a loader expects is chosen with two options, both on the *dotted* key of an
entry (its path segments joined with ``.``, as DCP and ``transformers`` name
parameters):

- ``only=NAME``: keep the entries under ``NAME.`` and make that the root (a state
  saved as ``{"model": model, "optim": optim}`` exported with ``only="model"`` has
  keys ``layers.0.weight``);
- ``strip_prefix=PREFIX``: drop ``PREFIX`` from every key that starts with it (for
  entries named by dotted DCP names such as ``model.layers.0.weight``).

Formats:

- ``dcp``: a folder that ``torch.distributed.checkpoint.load`` reads;
- ``torch``: ``checkpoint.pt``, readable by ``torch.load(path, weights_only=True)``;
- ``safetensors``: the tensors in ``model.safetensors`` (``safetensors.torch.load_file``,
  ``from_pretrained`` beside the model's ``config.json``). safetensors holds tensors
  only: JSON values go into the file's metadata as one JSON object under
  ``tierckpt.values``; ``bytes`` values are left out. Both are reported.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["FORMATS", "ExportError", "Export", "check_dtypes", "entry_path", "lay_out", "write_export"]

FORMATS = ("dcp", "torch", "safetensors")

#: the safetensors metadata key that holds the JSON values of an export
VALUES_KEY = "tierckpt.values"

Path = tuple[Any, ...]


class ExportError(ValueError):
    """An export cannot be written as asked: ``--only`` / ``--strip-prefix`` match nothing or make keys collide, or
    the format cannot hold a value."""


@dataclass
class Export:
    """What an export wrote: ``path`` (file or folder) and ``notes`` (one line each: what was moved or left out)."""

    path: str
    notes: list[str] = field(default_factory=list)


def _unescape(seg: str) -> Any:
    if seg.startswith("~i"):
        return int(seg[2:])
    return seg.replace("~1", "/").replace("~0", "~")


def entry_path(name: str) -> Path:
    """The path of an entry name: ``"optim/state/~i0/exp_avg"`` -> ``("optim", "state", 0, "exp_avg")``."""
    return tuple(_unescape(p) for p in name.split("/"))


def dotted(path: Path) -> str:
    """An entry's flattened key, as DCP flattens nested dicts: segments joined with ``.``."""
    return ".".join(str(p) for p in path)


def _cut(path: Path, n: int) -> Path:
    """``path`` less its first ``n`` characters of :func:`dotted` (a separator at the cut is dropped too)."""
    at = 0
    for i, seg in enumerate(path):
        s = str(seg)
        end = at + len(s)
        if n < end:
            return (s[n - at:],) + path[i + 1:] if n > at else path[i:]
        if n <= end + 1:  # the cut falls at the end of this segment, or on the separator after it
            return path[i + 1:]
        at = end + 1
    return ()


def _tops(paths: list[Path]) -> str:
    names = sorted({dotted(p[:1]) for p in paths})
    shown = ", ".join(names[:20]) + (f", … ({len(names)} in all)" if len(names) > 20 else "")
    return shown or "none"


def lay_out(flat: dict[str, Any], *, only: str | None = None, strip_prefix: str | None = None) -> dict[Path, Any]:
    """The entries of ``flat`` (entry name -> value) by path, with ``only`` / ``strip_prefix`` applied.

    Raises ExportError when ``only`` or ``strip_prefix`` matches no entry (naming the top-level
    entries there are), when a key would be left empty, or when two entries would get the same key.
    """
    paths = {entry_path(name): v for name, v in flat.items()}
    out = paths
    if only is not None:
        if not only or only.startswith(".") or only.endswith("."):
            raise ExportError(f"--only {only!r}: give a top-level entry's name, such as model")
        # NAME is a top-level entry holding a subtree, or the first part of dotted names (``model.layers.0.w``)
        want = only + "."
        out = {_cut(p, len(want)): v for p, v in paths.items() if dotted(p).startswith(want)}
        if not out:
            whole = [p for p in paths if dotted(p) == only]
            why = "is a single value, not a subtree" if whole else "matches no entry"
            raise ExportError(f"--only {only}: {why}; the top-level entries are {_tops(list(paths))}")
        if len(out) < sum(1 for p in paths if dotted(p).startswith(want)):
            raise ExportError(f"--only {only}: two entries under it would get the same key; export without "
                              "--only and pick the entries after loading")
    if strip_prefix is not None:
        if not strip_prefix:
            raise ExportError("--strip-prefix needs a non-empty prefix, such as model.")
        hit = [p for p in out if dotted(p).startswith(strip_prefix)]
        if not hit:
            raise ExportError(f"--strip-prefix {strip_prefix}: no key starts with it; the top-level entries are "
                              f"{_tops(list(out))} (keys are entry paths joined with '.')")
        stripped: dict[Path, Any] = {}
        for p, v in out.items():
            if dotted(p).startswith(strip_prefix):
                q = _cut(p, len(strip_prefix))
                if not q or q == ("",):
                    raise ExportError(f"--strip-prefix {strip_prefix}: it is the whole key {dotted(p)!r}, which "
                                      "would be left with no name; give a shorter prefix")
            else:
                q = p
            if q in stripped:
                raise ExportError(f"--strip-prefix {strip_prefix}: {dotted(p)!r} would take the key {dotted(q)!r}, "
                                  "which another entry has; give a longer prefix")
            stripped[q] = v
        out = stripped
    # one entry's path may not be another's container: the nested form could not hold both
    inner = {p[:i] for p in out for i in range(1, len(p))}
    clash = sorted(dotted(p) for p in out if p in inner)
    if clash:
        given = " ".join(f"{flag} {v}" for flag, v in (("--only", only), ("--strip-prefix", strip_prefix)) if v)
        raise ExportError(f"{given}: {clash[0]!r} would be both a value and a container of other keys; "
                          "choose another prefix")
    return out


def nest(paths: dict[Path, Any]) -> dict:
    """Nested dicts from paths; a dict whose keys are exactly ``0..n-1`` becomes a list (as it was saved)."""
    root: dict = {}
    for path, v in paths.items():
        d = root
        for p in path[:-1]:
            d = d.setdefault(p, {})
        d[path[-1]] = v

    def lists(x: Any) -> Any:
        if isinstance(x, dict):
            x = {k: lists(v) for k, v in x.items()}
            if x and all(isinstance(k, int) and not isinstance(k, bool) for k in x) and \
                    sorted(x) == list(range(len(x))):
                return [x[i] for i in range(len(x))]
        return x

    return lists(root)


def write_export(paths: dict[Path, Any], fmt: str, to: str) -> Export:
    """Write ``paths`` (from :func:`lay_out`) to the folder ``to`` as ``fmt`` (one of :data:`FORMATS`)."""
    os.makedirs(to, exist_ok=True)
    if fmt == "torch":
        path = os.path.join(to, "checkpoint.pt")
        torch.save(nest(paths), path)
        return Export(path)
    if fmt == "dcp":
        import torch.distributed.checkpoint as dcp

        dcp.save(nest(paths), storage_writer=dcp.FileSystemWriter(to), no_dist=True)
        return Export(to)
    if fmt == "safetensors":
        return _write_safetensors(paths, to)
    raise ValueError(f"unknown export format {fmt!r}: one of {', '.join(FORMATS)}")


def check_dtypes(dtypes: dict[str, torch.dtype], fmt: str) -> None:
    """Raise ExportError when ``fmt`` cannot hold one of ``dtypes`` (flattened key -> dtype), before any work."""
    if fmt != "safetensors":
        return
    from safetensors.torch import _TYPES

    for key, dt in dtypes.items():
        if dt not in _TYPES.values():
            raise ExportError(f"{key} is {str(dt).removeprefix('torch.')}, which safetensors cannot hold: export it "
                              "with --format torch or dcp")


def _write_safetensors(paths: dict[Path, Any], to: str) -> Export:
    from safetensors.torch import save_file

    check_dtypes({dotted(p): v.dtype for p, v in paths.items() if isinstance(v, torch.Tensor)}, "safetensors")
    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, Any] = {}
    left_out: list[str] = []
    for p, v in paths.items():
        key = dotted(p)
        if isinstance(v, torch.Tensor):
            tensors[key] = v.contiguous()
        elif isinstance(v, bytes):
            left_out.append(key)
        else:
            values[key] = v
    path = os.path.join(to, "model.safetensors")
    metadata = {"format": "pt"}
    if values:
        metadata[VALUES_KEY] = json.dumps(values, sort_keys=True)
    save_file(tensors, path, metadata=metadata)
    notes = []
    if values:
        notes.append(f"{len(values)} non-tensor value(s) are in the file's metadata under {VALUES_KEY!r} (JSON): "
                     + _names(values))
    if left_out:
        notes.append(f"{len(left_out)} bytes value(s) left out (safetensors holds tensors only; --format torch or dcp "
                     "keeps them): " + _names(left_out))
    return Export(path, notes)


def _names(keys: Any) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:8]) + (f", … ({len(keys)} in all)" if len(keys) > 8 else "")
