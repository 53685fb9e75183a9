"""Canonical JSON that ends in a checksum of its own bytes: a version-2 manifest and a step index.

The checksum covers the object as serialised canonically (no spaces, keys in
the writer's order) without its ``checksum`` field, so a byte changed anywhere
is refused, even one that keeps the JSON parseable.
"""

from __future__ import annotations

import json
from typing import Any

import xxhash

__all__ = ["dumps", "checksum_of", "seal", "loads", "recompute", "verify"]


def dumps(obj: dict) -> bytes:
    """Canonical JSON bytes of ``obj``."""
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


def checksum_of(body: bytes) -> str:
    """``xxh3_64:<16 hex digits>`` of ``body``."""
    return f"xxh3_64:{xxhash.xxh3_64_hexdigest(body)}"


def seal(body: bytes) -> tuple[bytes, str]:
    """``body`` (canonical JSON of an object) with ``"checksum"`` added as its last field; and that checksum."""
    checksum = checksum_of(body)
    return body[:-1] + b',"checksum":' + json.dumps(checksum).encode() + b"}", checksum


def loads(data: bytes | memoryview, limit: int, error: type[Exception], what: str) -> Any:
    """Parse JSON of at most ``limit`` bytes, refusing NaN and infinities; raise ``error("<what>: ...")``."""
    if len(data) > limit:
        raise error(f"{what}: {len(data)} bytes is over the {limit} limit")

    def refuse(name: str) -> None:
        raise error(f"{what}: {name} is not a JSON number")

    try:
        return json.loads(bytes(data).decode("utf-8"), parse_constant=refuse)
    except error:
        raise
    except (ValueError, RecursionError) as e:  # also over-long integers
        raise error(f"{what}: not valid JSON ({e})") from e


def verify(data: bytes | memoryview, obj: dict, claimed: str, error: type[Exception], what: str) -> bool:
    """Whether ``claimed`` is the checksum ``data`` (parsed into ``obj``, its ``checksum`` field taken out)
    was sealed with.

    Bytes exactly as the writer sealed them end in ``,"checksum":<claimed>}`` after the body it hashed:
    hashing that body checks them without serialising ``obj`` again (a quarter of the parse of a large
    manifest). Any other bytes (another serialisation of the same object) are checked by re-serialising.
    """
    raw = bytes(data)
    tail = b',"checksum":' + json.dumps(claimed).encode() + b"}"
    if raw.endswith(tail) and checksum_of(raw[: -len(tail)] + b"}") == claimed:
        return True
    return recompute(obj, error, what) == claimed


def recompute(obj: dict, error: type[Exception], what: str) -> str:
    """The checksum of ``obj`` (its ``checksum`` field already taken out) as it was sealed."""
    try:
        return checksum_of(dumps(obj))
    except (ValueError, TypeError, RecursionError, OverflowError) as e:
        raise error(f"{what}: cannot be re-serialised ({e})") from e
