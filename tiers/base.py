"""The ``Tier`` contract: a small key → bytes store that every tier implements.

Call order, for any tier::

    t = SomeTier(...)                   # cheap; may not touch the network yet
    t.put(key, data_or_path)            # any number, from several threads
    t.stat(key) / t.read_into(key, buf, offset) / t.get(key, offset, length)
    t.list(prefix)                      # keys only; temp files never listed
    t.delete(key)                       # idempotent
    t.close()                           # last; the tier is unusable after it

Rules every tier keeps (the conformance suite in ``tests/test_tier_conformance.py``
checks them):

* ``put`` is atomic: a reader sees the whole old object, the whole new one, or
  ``KeyNotFoundError`` — never a torn write. Writers of a step put every shard
  first and the manifest last; the manifest is the commit point.
* Keys are the strings made by :mod:`tiers.keys`; a tier maps them onto its
  own namespace and never lets a key escape it.
* Errors are the typed ones of :mod:`tiers.errors`: missing keys raise
  ``KeyNotFoundError``, unreachable backends ``TierUnavailableError``, a full
  tier ``TierFullError``.
* Sizes and offsets are bytes. A tier is safe to call from several threads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol, Union, runtime_checkable

__all__ = ["ObjectInfo", "Source", "Tier", "TierBase"]

#: what ``put`` accepts: bytes-like, or the path of a local file to copy from
Source = Union[bytes, bytearray, memoryview, os.PathLike, str]


@dataclass(frozen=True)
class ObjectInfo:
    """What ``stat`` says of an object: its logical size in bytes and mtime (unix seconds)."""

    key: str
    size: int
    mtime: float


@runtime_checkable
class Tier(Protocol):
    """A place that holds shards and manifests. See the module docstring."""

    name: str
    #: True when every call is answered from this host's memory (a tmpfs folder): it never waits on a device
    #: or the network, so a caller may run it inline rather than on a thread with a deadline
    in_host_memory: bool

    def put(self, key: str, src: Source) -> int:
        """Store ``src`` under ``key`` atomically; return the bytes stored."""

    def read_into(self, key: str, buf: memoryview, offset: int = 0) -> int:
        """Fill ``buf`` with the object's bytes from ``offset``; return the count (== len(buf))."""

    def get(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        """Return ``length`` bytes (to the end if None) from ``offset``."""

    def list(self, prefix: str = "") -> list[str]:
        """Keys that start with ``prefix``, sorted."""

    def delete(self, key: str) -> None:
        """Remove ``key``; no error if it is absent."""

    def stat(self, key: str) -> ObjectInfo:
        """Size and mtime of ``key``; KeyNotFoundError if absent."""

    def close(self) -> None:
        """Release connections and handles."""


class TierBase:
    """Shared defaults: ``get`` on top of ``stat`` + ``read_into``; context manager."""

    name = "tier"
    in_host_memory = False

    def get(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        if length is None:
            length = max(0, self.stat(key).size - offset)
        buf = bytearray(length)
        n = self.read_into(key, memoryview(buf), offset)
        return bytes(buf[:n])

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.describe()}>"

    def describe(self) -> str:
        """Where the tier's bytes live, for messages and tables."""
        return self.name
