"""recovery: inventory of every tier, the restore planner and the verified fetcher. Torch-free."""

from .fetch import OpenShard, ShardReport, ShardUnavailableError, fetch_shard, open_shard
from .inventory import StepInTier, TierInventory, read_manifest, scan_tier, scan_tiers
from .planner import JobNotFoundError, RestorePlan, StepNotFoundError, complete_steps, plan_restore

__all__ = [
    "OpenShard", "ShardReport", "ShardUnavailableError", "fetch_shard", "open_shard", "StepInTier", "TierInventory",
    "read_manifest", "scan_tier", "scan_tiers", "JobNotFoundError", "RestorePlan",
    "StepNotFoundError", "complete_steps", "plan_restore",
]
