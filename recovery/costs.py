"""Cost model: how long reading ``nbytes`` from a source takes, learned from real transfers.

A *source* is one place a tier's bytes live, keyed by ``tier.describe()``
(``"peer 10.0.0.2:4000"``, the memory or disk folder, ``"s3://bucket/prefix at
URL"``). Each source has a latency (seconds) and a bandwidth (bytes/s); reading
``n`` bytes is estimated at ``latency + n / bandwidth``.

Until a source has been observed its values are the *priors* of its kind
(``tier.name``). They are not measurements: they are picked so that both the
latency and the bandwidth rank the kinds in the design's order, so with no
observations the order is memory < peer < disk < peer-disk < s3 (< any other kind) for
shards of every size. Real transfers replace them:

* a transfer under :data:`SMALL_BYTES` updates the latency, a larger one the
  bandwidth (``nbytes / (seconds - latency)``);
* updates are exponentially weighted (:data:`ALPHA`), and a sample counts for
  at most :data:`MAX_STEP` times the current estimate, so one outlier (a
  hiccup, a page-cache hit) cannot flip the order on its own while a lasting
  change wins after a few transfers;
* observations older than ``max_age`` seconds (7 days by default) are
  forgotten: the source goes back to its priors, and :meth:`CostModel.load`
  drops them.

The model persists as a small versioned JSON file (:meth:`CostModel.save`,
:meth:`CostModel.load`), written atomically and never pickled. A missing,
unreadable or malformed file gives the priors. Safe to share between threads.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from tiers.base import Tier

__all__ = ["ALPHA", "MAX_AGE", "MAX_STEP", "PRIORS", "SMALL_BYTES", "CostModel", "SourceCost", "source_name"]

log = logging.getLogger("tierckpt.recovery")

T = TypeVar("T")

#: kind → (latency in seconds, bandwidth in bytes/s) before any transfer is seen.
#: Ordering priors, not measurements (see the module docstring).
PRIORS: dict[str, tuple[float, float]] = {
    "memory": (20e-6, 10e9),
    "peer": (0.5e-3, 2.5e9),
    "disk": (1e-3, 1.5e9),
    "peer-disk": (1.5e-3, 1.2e9),
    "s3": (50e-3, 0.2e9),
}
#: priors of a kind not in :data:`PRIORS`: behind every known kind at any size
UNKNOWN_PRIOR: tuple[float, float] = (0.1, 0.1e9)

#: transfers smaller than this (bytes) measure latency; larger ones bandwidth
SMALL_BYTES = 256 << 10
#: weight of a new sample in the exponentially weighted estimates
ALPHA = 0.3
#: a sample counts for at most this many times the current estimate
MAX_STEP = 4.0
#: seconds after its last observation that a source's learned values are kept
MAX_AGE = 7 * 86400.0

_FORMAT = "tierckpt-costs"
_VERSION = 1
_TINY = 1e-6  # seconds: floor of a latency sample and of the time a payload took


def source_name(tier: Tier) -> str:
    """The key a tier's costs are kept under: ``tier.describe()``, else ``tier.name``."""
    describe = getattr(tier, "describe", None)
    if describe is not None:
        try:
            return str(describe())
        except Exception as e:  # noqa: BLE001 - a failing describe() must not stop a restore; the kind still tells
            log.debug("describe() of a %s tier failed: %s", getattr(tier, "name", "?"), e)
    return str(getattr(tier, "name", type(tier).__name__))


def _prior(kind: str | None) -> tuple[float, float]:
    return PRIORS.get(kind or "", UNKNOWN_PRIOR)


@dataclass
class SourceCost:
    """What has been learned of one source.

    ``latency`` (seconds) and ``bandwidth`` (bytes/s) are None until a transfer
    of that size class was seen; ``count`` is the transfers observed and
    ``updated`` the unix time of the last one.
    """

    kind: str | None = None
    latency: float | None = None
    bandwidth: float | None = None
    count: int = 0
    updated: float = 0.0

    def to_json(self) -> dict:
        return {"kind": self.kind, "latency": self.latency, "bandwidth": self.bandwidth,
                "count": self.count, "updated": self.updated}

    @classmethod
    def from_json(cls, d: object) -> SourceCost:
        """Parse one entry; ValueError if any field is missing or not a sane number."""
        if not isinstance(d, dict):
            raise ValueError("entry is not an object")  # noqa: TRY004 - one error type for a bad file
        kind = d.get("kind")
        if kind is not None and not isinstance(kind, str):
            raise ValueError("kind is not a string")
        out = cls(kind=kind)
        for name in ("latency", "bandwidth"):
            v = d.get(name)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name} is not a positive number")
            setattr(out, name, float(v))
        count, updated = d.get("count"), d.get("updated")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError("count is not an integer >= 0")
        if isinstance(updated, bool) or not isinstance(updated, (int, float)) or not math.isfinite(updated):
            raise ValueError("updated is not a time")
        out.count, out.updated = count, float(updated)
        return out


def _ewma(old: float, sample: float) -> float:
    return (1 - ALPHA) * old + ALPHA * min(sample, MAX_STEP * old)


class CostModel:
    """Per-source latency and bandwidth: priors by tier kind, refined by :meth:`observe`.

    ``max_age``: seconds after which a source's observations are forgotten.
    ``clock``: unix time source (tests pass a fake one).
    """

    def __init__(self, *, max_age: float = MAX_AGE, clock: Callable[[], float] = time.time) -> None:
        self.max_age = max_age
        self.clock = clock
        self.sources: dict[str, SourceCost] = {}
        self._lock = threading.Lock()

    # -- estimates -------------------------------------------------------------------------
    def _fresh(self, key: str) -> SourceCost | None:
        e = self.sources.get(key)
        if e is None or self.clock() - e.updated > self.max_age:
            return None
        return e

    def rates(self, tier: Tier) -> tuple[float, float]:
        """``(latency s, bandwidth bytes/s)`` the model holds for ``tier`` now."""
        lat, bw = _prior(getattr(tier, "name", None))
        key = source_name(tier)
        with self._lock:
            e = self._fresh(key)
            if e is not None:
                lat = e.latency if e.latency is not None else lat
                bw = e.bandwidth if e.bandwidth is not None else bw
        return lat, bw

    def estimate(self, tier: Tier, nbytes: int) -> float:
        """Seconds to read ``nbytes`` bytes from ``tier``: latency + nbytes / bandwidth."""
        lat, bw = self.rates(tier)
        return lat + max(0, nbytes) / bw

    def order(self, tiers: Sequence[T], nbytes: int) -> list[T]:
        """``tiers`` cheapest first for a read of ``nbytes`` bytes; ties keep the given order."""
        return sorted(tiers, key=lambda t: self.estimate(t, nbytes))  # type: ignore[arg-type]

    # -- learning --------------------------------------------------------------------------
    def observe(self, source: Tier | str, nbytes: int, seconds: float, *, kind: str | None = None) -> bool:
        """Learn from one transfer of ``nbytes`` bytes that took ``seconds``.

        ``source`` is a tier or its :func:`source_name`; ``kind`` (the tier's
        ``name``) picks the priors a new source starts from when only a name is
        given. Returns False, learning nothing, for a sample that makes no sense
        (negative bytes, seconds not a positive finite number).
        """
        if isinstance(source, str):
            key = source
        else:
            key, kind = source_name(source), getattr(source, "name", None) or kind
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0 \
                or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds <= 0:
            log.debug("cost sample for %s ignored: %r bytes in %r s", key, nbytes, seconds)
            return False
        now = self.clock()
        with self._lock:
            e = self._fresh(key)
            if e is None:
                e = self.sources[key] = SourceCost(kind=kind)
            elif kind is not None and e.kind is None:
                e.kind = kind
            plat, pbw = _prior(e.kind)
            lat = e.latency if e.latency is not None else plat
            bw = e.bandwidth if e.bandwidth is not None else pbw
            if nbytes < SMALL_BYTES:
                e.latency = _ewma(lat, max(seconds - nbytes / bw, _TINY))
            else:
                e.bandwidth = _ewma(bw, nbytes / max(seconds - lat, _TINY))
            e.count += 1
            e.updated = now
        return True

    # -- persistence -----------------------------------------------------------------------
    def to_json(self) -> dict:
        """The model as a JSON-ready dict (fresh entries only)."""
        with self._lock:
            keep = {k: e.to_json() for k in sorted(self.sources) if (e := self._fresh(k)) is not None}
        return {"format": _FORMAT, "version": _VERSION, "sources": keep}

    def save(self, path: str | os.PathLike) -> None:
        """Write the model to ``path`` atomically (a temp file in the same folder, then a rename).

        Raises OSError when the folder cannot be written.
        """
        path = os.fspath(path)
        data = json.dumps(self.to_json(), indent=1, sort_keys=True).encode() + b"\n"
        folder = os.path.dirname(os.path.abspath(path))
        tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:12]}")
        try:
            # readable by this user alone, like every file in the memory folder
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    @classmethod
    def load(cls, path: str | os.PathLike, *, max_age: float = MAX_AGE,
             clock: Callable[[], float] = time.time) -> CostModel:
        """The model saved at ``path``; the priors alone when the file is missing or unusable.

        A missing file is the first run and says nothing; an unreadable,
        malformed or newer-version file logs a warning. Malformed entries and
        entries older than ``max_age`` seconds are dropped. Never raises for
        the file's content.
        """
        model = cls(max_age=max_age, clock=clock)
        path = os.fspath(path)
        try:
            with open(path, "rb") as f:
                raw = f.read(1 << 22)
        except FileNotFoundError:
            return model
        except OSError as e:
            log.warning("cost model %s unreadable, starting from the priors: %s", path, e)
            return model
        try:
            doc = json.loads(raw)
            if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
                raise ValueError("not a tierckpt cost file")
            version = doc.get("version")
            if isinstance(version, bool) or not isinstance(version, int):
                raise ValueError("no version")  # noqa: TRY004 - one error type for a bad file
            if version > _VERSION:
                raise ValueError(f"version {version} is newer than this library's {_VERSION}")
            sources = doc.get("sources")
            if not isinstance(sources, dict):
                raise ValueError("no sources")  # noqa: TRY004 - one error type for a bad file
        except ValueError as e:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
            log.warning("cost model %s is not usable, starting from the priors: %s", path, e)
            return model
        now = clock()
        for key, entry in sources.items():
            try:
                e = SourceCost.from_json(entry)
            except ValueError as err:
                log.warning("cost model %s: entry %r dropped: %s", path, key, err)
                continue
            if now - e.updated <= max_age:
                model.sources[key] = e
        return model


#: the learned restore costs, kept beside the memory tier's objects (a dot-file: never listed as a key)
COSTS_FILE = ".costs.json"


def node_costs(shm: str, invs: Sequence[object] = ()) -> tuple[CostModel, str | None]:
    """This node's learned costs, kept in its memory folder ``shm`` (priors when none were saved or the
    folder does not exist), fed the manifest-read latencies that the inventories ``invs`` measured.

    Returns the model and the file to :meth:`CostModel.save` it to after the restore (None: no folder).
    """
    path = os.path.join(shm, COSTS_FILE) if os.path.isdir(shm) else None
    costs = CostModel.load(path) if path else CostModel()
    for inv in invs:
        latency = getattr(inv, "latency", None)
        if latency is not None:
            costs.observe(inv.tier, 0, latency)
    return costs, path
