"""The one place that spells a key.

Layout, identical in every tier (memory folder, disk folder, S3 prefix, peer)::

    <job>/step-<N>/rank-<R>.shard     the bytes one rank saved at step N
    <job>/step-<N>/rank-<R>.head      a peer's copy of that shard's first bytes only: what no other
                                      rank holds (``ShardInfo.unique``), when the job's own replicas
                                      hold the rest on enough nodes
    <job>/step-<N>/manifest.json      the step's index; written last (commit point)
    <job>/layouts/<digest>.layout     one rank's chunk list (Parquet), stored once and
                                      shared by every step (and rank) that saved it
    <job>/index.json                  the job's step index in this place: one row per step
                                      committed here (see :mod:`tiers.index`); two parts, so
                                      never taken for a step's key

Keys use ``/`` as separator in every tier; a tier maps them onto its own
namespace (a path below its root folder, an object name below its prefix).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import InvalidNameError

__all__ = [
    "JOB_RE",
    "MANIFEST_NAME",
    "KeyInfo",
    "check_job",
    "check_step",
    "check_rank",
    "job_prefix",
    "step_prefix",
    "shard_key",
    "head_key",
    "manifest_key",
    "parse_key",
    "layout_key",
    "layouts_prefix",
    "parse_layout_key",
    "check_digest",
    "DIGEST_RE",
    "INDEX_NAME",
    "index_key",
    "parse_index_key",
]

JOB_RE = re.compile(r"^[A-Za-z0-9._-]{1,128}\Z")
MANIFEST_NAME = "manifest.json"
INDEX_NAME = "index.json"
#: the largest step and rank a key can carry (what ``parse_key`` reads back)
MAX_STEP = 10**18 - 1
MAX_RANK = 10**9 - 1
_STEP_DIR_RE = re.compile(r"^step-(0|[1-9][0-9]{0,17})\Z")
_SHARD_RE = re.compile(r"^rank-(0|[1-9][0-9]{0,8})\.(shard|head)\Z")
LAYOUTS_DIR = "layouts"
_DIGEST_RE = re.compile(r"^[0-9a-f]{32}\Z")
#: matches a layout digest (what :func:`check_digest` accepts)
DIGEST_RE = _DIGEST_RE
_LAYOUT_RE = re.compile(r"^([0-9a-f]{32})\.layout\Z")


def check_job(job: str) -> str:
    """Return ``job`` if it is a valid job name, else raise InvalidNameError."""
    if not isinstance(job, str) or not JOB_RE.match(job) or job in (".", ".."):
        raise InvalidNameError(
            f"invalid job name {job!r}: use 1-128 characters from A-Z a-z 0-9 . _ - "
            "(no slashes, not '.' or '..')"
        )
    return job


def check_step(step: int) -> int:
    """Return ``step`` if it is an int in [0, MAX_STEP], else raise InvalidNameError."""
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise InvalidNameError(f"invalid step {step!r}: a step is an integer from 0 to {MAX_STEP}")
    return step


def check_rank(rank: int) -> int:
    """Return ``rank`` if it is an int in [0, MAX_RANK], else raise InvalidNameError."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank <= MAX_RANK:
        raise InvalidNameError(f"invalid rank {rank!r}: a rank is an integer from 0 to {MAX_RANK}")
    return rank


def job_prefix(job: str) -> str:
    """Prefix under which everything of ``job`` lives, ending in ``/``."""
    return f"{check_job(job)}/"


def step_prefix(job: str, step: int) -> str:
    """Prefix of one step's objects, ending in ``/``."""
    return f"{check_job(job)}/step-{check_step(step)}/"


def shard_key(job: str, step: int, rank: int) -> str:
    """Key of the shard that ``rank`` saved at ``step``."""
    return f"{step_prefix(job, step)}rank-{check_rank(rank)}.shard"


def head_key(job: str, step: int, rank: int) -> str:
    """A copy of the first ``ShardInfo.unique`` bytes of ``rank``'s shard (see the module docstring)."""
    return f"{step_prefix(job, step)}rank-{check_rank(rank)}.head"


def manifest_key(job: str, step: int) -> str:
    """Key of the step's manifest (the commit point)."""
    return f"{step_prefix(job, step)}{MANIFEST_NAME}"


def check_digest(digest: str) -> str:
    """Return ``digest`` if it is a layout digest (32 lowercase hex digits), else raise InvalidNameError."""
    if not isinstance(digest, str) or not _DIGEST_RE.match(digest):
        raise InvalidNameError(f"invalid layout digest {digest!r}: expected 32 lowercase hex digits")
    return digest


def layouts_prefix(job: str) -> str:
    """Prefix of the job's layout objects, ending in ``/``."""
    return f"{check_job(job)}/{LAYOUTS_DIR}/"


def layout_key(job: str, digest: str) -> str:
    """Key of the layout object with content digest ``digest``."""
    return f"{layouts_prefix(job)}{check_digest(digest)}.layout"


def parse_layout_key(key: str) -> tuple[str, str] | None:
    """``(job, digest)`` for a layout key; None for anything else."""
    parts = key.split("/")
    if len(parts) != 3 or parts[1] != LAYOUTS_DIR:
        return None
    job, _, name = parts
    if not JOB_RE.match(job) or job in (".", ".."):
        return None
    m = _LAYOUT_RE.match(name)
    return (job, m.group(1)) if m else None


def index_key(job: str) -> str:
    """Key of the job's step index in a place."""
    return f"{job_prefix(job)}{INDEX_NAME}"


def parse_index_key(key: str) -> str | None:
    """The job whose step index ``key`` names; None for anything else."""
    parts = key.split("/")
    if len(parts) != 2 or parts[1] != INDEX_NAME or not JOB_RE.match(parts[0]) or parts[0] in (".", ".."):
        return None
    return parts[0]


@dataclass(frozen=True)
class KeyInfo:
    """What a key names: a shard (``rank`` set), the head of one (``head`` too) or a manifest (``rank`` None)."""

    job: str
    step: int
    rank: int | None
    head: bool = False

    @property
    def is_manifest(self) -> bool:
        return self.rank is None


def parse_key(key: str) -> KeyInfo | None:
    """Parse a key of the layout above; None for anything else (temp files, junk)."""
    parts = key.split("/")
    if len(parts) != 3:
        return None
    job, step_dir, name = parts
    if not JOB_RE.match(job) or job in (".", ".."):
        return None
    m = _STEP_DIR_RE.match(step_dir)
    if not m:
        return None
    step = int(m.group(1))
    if name == MANIFEST_NAME:
        return KeyInfo(job, step, None)
    m = _SHARD_RE.match(name)
    if not m:
        return None
    return KeyInfo(job, step, int(m.group(1)), m.group(2) == "head")
