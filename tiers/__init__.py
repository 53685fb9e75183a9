"""tiers: keys, the manifest schema and byte stores (memory, disk, s3, peer).

Imports nothing of ours and never imports torch.
"""

from .base import ObjectInfo, Tier, TierBase
from .checksum import checksum_bytes, checksum_file
from .disk import DiskTier
from .errors import (
    ChecksumMismatchError,
    InvalidNameError,
    KeyNotFoundError,
    ManifestError,
    TierError,
    TierFullError,
    TierUnavailableError,
)
from .keys import check_job, check_rank, check_step, manifest_key, parse_key, shard_key, step_prefix
from .manifest import JsonEntry, Manifest, ShardInfo, TensorChunk
from .memory import MemoryTier, default_shm_root

__all__ = [
    "ObjectInfo", "Tier", "TierBase", "checksum_bytes", "checksum_file", "DiskTier", "MemoryTier",
    "default_shm_root", "ChecksumMismatchError", "InvalidNameError", "KeyNotFoundError",
    "ManifestError", "TierError", "TierFullError", "TierUnavailableError", "check_job", "check_rank",
    "check_step", "manifest_key", "parse_key", "shard_key", "step_prefix", "JsonEntry", "Manifest",
    "ShardInfo", "TensorChunk", "open_s3",
]


def open_s3(url: str, **kw):
    """Open the S3 tier for ``s3://bucket/prefix`` (imported lazily: boto3 is slow to import)."""
    from .s3 import S3Tier

    return S3Tier.from_url(url, **kw)
