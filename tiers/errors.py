"""Typed errors shared by every tier and by the parts above them.

Each subclasses a built-in so callers can catch broadly, and each message says
what happened and what to do about it.
"""

from __future__ import annotations

__all__ = [
    "TierError",
    "KeyNotFoundError",
    "TierUnavailableError",
    "TierFullError",
    "ChecksumMismatchError",
    "ManifestError",
    "InvalidNameError",
    "StepIndexError",
    "ConditionFailedError",
    "ConditionalWriteUnsupportedError",
]


class TierError(OSError):
    """A tier could not complete an operation."""


class KeyNotFoundError(TierError, FileNotFoundError):
    """The key is not present in the tier."""


class TierUnavailableError(TierError, ConnectionError):
    """The tier cannot be reached (S3 outage, dead peer, unmounted disk)."""


class TierFullError(TierError):
    """The tier has no room left for the object (ENOSPC, quota)."""


class ChecksumMismatchError(TierError, ValueError):
    """Bytes read back do not match the checksum recorded in the manifest."""


class ManifestError(ValueError):
    """A manifest is malformed, of an unknown version, or inconsistent."""


class InvalidNameError(ValueError):
    """A job name, step or rank is not acceptable as part of a key."""


class StepIndexError(ValueError):
    """A step index is malformed, damaged, too large or of an unknown version: read the manifests instead."""


class ConditionFailedError(TierError):
    """A conditional write lost: the object changed (or appeared) since it was read. Read it again and retry."""


class ConditionalWriteUnsupportedError(TierError):
    """The store refuses conditional writes (``If-Match`` / ``If-None-Match``)."""
