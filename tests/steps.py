"""Committed steps written straight into a tier, many at once, for tests and benchmarks of listings."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

from recovery.inventory import StepInTier
from recovery.step_index import rebuild
from tiers import keys
from tiers.base import Tier
from tiers.checksum import checksum_bytes
from tiers.layout import Layout
from tiers.manifest import Manifest, ShardInfo

__all__ = ["commit_steps"]


def commit_steps(tier: Tier, job: str, steps: Iterable[int], world: int = 2, shard_bytes: int = 64,
                 held: Iterable[int] | None = None, threads: int = 8, index: bool = True) -> dict[int, Manifest]:
    """Write each step of ``job`` into ``tier`` as a node would: the shards of ranks ``held`` (every rank if
    None; rank r taken by node r) and an empty layout, then a version-2 manifest naming them all. With ``index``, then make the
    place's step index say so (as a rebuild from a scan would). Returns the manifests by step."""
    held = list(range(world)) if held is None else list(held)
    out: dict[int, Manifest] = {}
    empty = Layout(())  # the shards hold no tensor: every manifest names this layout, stored once as a node would
    tier.put(keys.layout_key(job, empty.digest), empty.to_bytes())

    def one(step: int) -> None:
        shards = []
        for r in range(world):
            data = bytes([step % 251, r]) * (shard_bytes // 2)
            if r in held:
                tier.put(keys.shard_key(job, step, r), data)
            shards.append(ShardInfo(r, len(data), checksum_bytes(data), node=r, layout=empty.digest))
        m = Manifest(job, step, world, tuple(shards), {"save_index": step})
        tier.put(keys.manifest_key(job, step), m.to_bytes())
        out[step] = m

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, steps))
    if index:
        rebuild(tier, job, {s: StepInTier(job, s, True, {r: m.shard(r).size for r in held}, m.created, m)
                            for s, m in out.items()})
    return out
