"""recovery: inventory of every tier, the cost model, the restore planner and the verified fetcher. Torch-free."""

from .costs import CostModel, SourceCost, node_costs, source_name
from .fetch import (
    OpenShard,
    ShardReport,
    ShardUnavailableError,
    fetch_shard,
    fetch_shards,
    open_shard,
)
from .inventory import StepInTier, TierInventory, read_manifest, scan_tier, scan_tiers
from .planner import (
    JobNotFoundError,
    RestoreError,
    RestorePlan,
    StepNotFoundError,
    complete_steps,
    plan_restore,
    replica_nodes,
    view_ranks,
)
from .restorer import Restored, Restorer

__all__ = [
    "CostModel",
    "JobNotFoundError",
    "OpenShard",
    "RestoreError",
    "RestorePlan",
    "Restored",
    "Restorer",
    "ShardReport",
    "ShardUnavailableError",
    "SourceCost",
    "StepInTier",
    "StepNotFoundError",
    "TierInventory",
    "complete_steps",
    "fetch_shard",
    "fetch_shards",
    "node_costs",
    "open_shard",
    "plan_restore",
    "replica_nodes",
    "read_manifest",
    "scan_tier",
    "scan_tiers",
    "source_name",
    "view_ranks",
]
