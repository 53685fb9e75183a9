"""The cost model, the planner's use of it, the parallel fetcher and the inventory's timeout and latencies."""

from __future__ import annotations

import json
import logging
import os
import random
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recovery import (
    CostModel,
    ShardUnavailableError,
    SourceCost,
    fetch_shards,
    plan_restore,
    scan_tier,
    scan_tiers,
)
from recovery.costs import MAX_AGE, PRIORS
from tiers import (
    DiskTier,
    JsonEntry,
    Manifest,
    MemoryTier,
    ShardInfo,
    TensorChunk,
    keys,
)
from tiers.base import ObjectInfo, TierBase
from tiers.checksum import checksum_bytes
from tiers.errors import KeyNotFoundError, TierError, TierUnavailableError

GB = 1e9
MiB = 1 << 20


# -- a fault-injecting in-memory tier ----------------------------------------------------------
class DictTier(TierBase):
    """Objects in a dict. ``delay`` s per shard read; ``corrupt``/``broken`` keys read flipped or fail."""

    def __init__(self, kind: str = "disk", where: str = "/fake/a", *, delay: float = 0.0) -> None:
        self.name = kind
        self.where = where
        self.delay = delay
        self.objs: dict[str, bytes] = {}
        self.corrupt: set[str] = set()
        self.broken: set[str] = set()
        self.reads = 0
        self.active = 0
        self.peak_active = 0
        self._lock = threading.Lock()

    def describe(self) -> str:
        return self.where

    def put(self, key: str, src) -> int:
        self.objs[key] = bytes(src)
        return len(self.objs[key])

    def read_into(self, key: str, buf: memoryview, offset: int = 0) -> int:
        with self._lock:
            self.reads += 1
            self.active += 1
            self.peak_active = max(self.peak_active, self.active)
        try:
            if self.delay and key.endswith(".shard"):
                time.sleep(self.delay)
            if key in self.broken:
                raise TierUnavailableError(f"{key}: {self.where} is down")
            self.stat(key)  # KeyNotFoundError when absent
            data = self.objs[key]
            if key in self.corrupt:
                data = bytes([data[0] ^ 0xFF]) + data[1:]
            buf = memoryview(buf).cast("B")
            buf[:] = data[offset: offset + len(buf)]
            return len(buf)
        finally:
            with self._lock:
                self.active -= 1

    def list(self, prefix: str = "") -> list[str]:
        return sorted(k for k in self.objs if k.startswith(prefix))

    def delete(self, key: str) -> None:
        self.objs.pop(key, None)

    def stat(self, key: str) -> ObjectInfo:
        if key not in self.objs:
            raise KeyNotFoundError(f"{key} is not in {self.where}")
        return ObjectInfo(key, len(self.objs[key]), 0.0)


class HungTier(DictTier):
    """A tier whose list() does not answer until ``release`` is set (a dead peer without a timeout)."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.release = threading.Event()

    def list(self, prefix: str = "") -> list[str]:
        self.release.wait(60)
        return super().list(prefix)


def put_step(tiers, job: str, step: int, shards: list[bytes]) -> Manifest:
    """Put every shard, then the manifest, into each tier: a complete step as a saver leaves it."""
    m = Manifest(job, step, len(shards),
                 tuple(ShardInfo(r, len(d), checksum_bytes(d)) for r, d in enumerate(shards)))
    for t in tiers:
        for r, d in enumerate(shards):
            t.put(keys.shard_key(job, step, r), d)
        t.put(keys.manifest_key(job, step), m.to_bytes())
    return m


def shard_bytes(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


# -- the cost model ----------------------------------------------------------------------------
SIZES = [0, 1, 4096, 256 << 10, MiB, 64 * MiB, 1 << 30, 10 << 30, 100 << 30]


@pytest.mark.parametrize("nbytes", SIZES)
def test_priors_order_memory_peer_disk_peer_disk_s3_then_unknown_for_any_size(nbytes):
    kinds = ["s3", "zfs", "peer-disk", "disk", "peer", "memory"]
    tiers = [DictTier(k, f"/{k}") for k in kinds]
    got = CostModel().order(tiers, nbytes)
    assert [t.name for t in got] == ["memory", "peer", "disk", "peer-disk", "s3", "zfs"]


_rate = st.tuples(st.floats(1e-7, 10.0), st.floats(1e3, 1e12))


@settings(max_examples=60, deadline=None)
@given(rates=st.lists(_rate, min_size=1, max_size=6), nbytes=st.integers(0, 1 << 40))
def test_order_is_a_stable_sort_by_estimate(rates, nbytes):
    costs = CostModel()
    tiers = []
    for i, (lat, bw) in enumerate(rates):
        tiers.append(DictTier("disk", f"/t{i}"))
        costs.sources[f"/t{i}"] = SourceCost("disk", lat, bw, 1, time.time())
    got = costs.order(tiers, nbytes)
    assert sorted(got, key=id) == sorted(tiers, key=id)
    keyed = [(costs.estimate(t, nbytes), tiers.index(t)) for t in got]
    assert keyed == sorted(keyed)


def test_estimate_is_latency_plus_bytes_over_bandwidth():
    lat, bw = PRIORS["s3"]
    assert CostModel().estimate(DictTier("s3", "s3://b"), 10**9) == pytest.approx(lat + 10**9 / bw)


def test_slow_observed_peer_ranks_behind_fast_peer_and_then_behind_disk():
    fast, slow, disk = DictTier("peer", "peer 10.0.0.1:4000"), DictTier("peer", "peer 10.0.0.2:4000"), \
        DictTier("disk", "/nvme")
    costs = CostModel()
    n = 1 << 30
    assert costs.order([slow, fast, disk], n) == [slow, fast, disk]  # equal priors: the given order
    costs.observe(slow, n, n / (0.5 * GB))
    assert costs.order([slow, fast, disk], n) == [fast, slow, disk]
    for _ in range(10):
        costs.observe(slow, n, n / (0.5 * GB))
    assert costs.order([slow, fast, disk], n) == [fast, disk, slow]
    lat, bw = costs.rates(slow)
    assert 0.4 * GB < bw < 0.7 * GB and lat == PRIORS["peer"][0]


def test_one_outlier_does_not_flip_the_order():
    peer, disk, memory = DictTier("peer", "peer h:1"), DictTier("disk", "/nvme"), DictTier("memory", "/dev/shm/x")
    costs = CostModel()
    n = 256 * MiB
    for _ in range(10):
        costs.observe(peer, n, n / (2.5 * GB))
        costs.observe(disk, n, n / (1.5 * GB))
    costs.observe(peer, n, 100 * n / (2.5 * GB))  # one transfer a hundred times slower
    assert costs.order([disk, peer], n) == [peer, disk]
    costs.observe(memory, 4096, 1.0)  # one small read that stalled for a second
    assert costs.order([disk, peer, memory], 4096) == [memory, peer, disk]
    # a lasting change wins after a few transfers
    for _ in range(8):
        costs.observe(peer, n, 100 * n / (2.5 * GB))
    assert costs.order([disk, peer], n) == [disk, peer]


@pytest.mark.parametrize("nbytes,seconds", [(1, 0.0), (1, -1.0), (1, float("nan")), (1, float("inf")),
                                            (-1, 1.0), (1.5, 1.0), (True, 1.0), (1, None)])
def test_nonsense_observations_are_rejected(nbytes, seconds):
    costs = CostModel()
    assert costs.observe(DictTier(), nbytes, seconds) is False
    assert costs.sources == {}


def test_small_transfers_teach_latency_and_large_ones_bandwidth():
    t = DictTier("disk", "/nvme")
    costs = CostModel()
    costs.observe(t, 4096, 0.01)
    lat, bw = costs.rates(t)
    assert lat > PRIORS["disk"][0] and bw == PRIORS["disk"][1]
    costs.observe(t, 1 << 30, 10.0)
    lat2, bw2 = costs.rates(t)
    assert lat2 == lat and bw2 < PRIORS["disk"][1]
    assert costs.sources["/nvme"].count == 2 and costs.sources["/nvme"].kind == "disk"


def test_observe_by_name_starts_from_the_given_kind():
    costs = CostModel()
    costs.observe("peer 10.0.0.9:4000", 1 << 30, 1.0, kind="peer")
    e = costs.sources["peer 10.0.0.9:4000"]
    assert e.kind == "peer" and e.bandwidth == pytest.approx(0.7 * PRIORS["peer"][1] + 0.3 * (1 << 30) / (1.0 - PRIORS["peer"][0]))


def test_costs_round_trip_through_a_json_file(tmp_path):
    path = tmp_path / "costs.json"
    costs = CostModel()
    a, b = DictTier("peer", "peer h:1"), DictTier("s3", "s3://bucket/p at http://x")
    costs.observe(a, 1 << 30, 2.0)
    costs.observe(b, 100, 0.2)
    costs.save(path)
    assert os.listdir(tmp_path) == ["costs.json"]  # no temp file left behind
    doc = json.loads(path.read_text())
    assert doc["format"] == "tierckpt-costs" and doc["version"] == 1 and set(doc["sources"]) == {"peer h:1", b.where}
    again = CostModel.load(path)
    for t in (a, b):
        assert again.rates(t) == costs.rates(t)
    assert again.sources["peer h:1"].count == 1


@pytest.mark.parametrize("content", [b"\x80\x81 not json", b"[1, 2]", b'{"format": "other", "version": 1}',
                                     b'{"format": "tierckpt-costs", "version": 99, "sources": {}}',
                                     b'{"format": "tierckpt-costs", "version": 1, "sources": []}'])
def test_a_corrupt_costs_file_gives_the_priors_with_a_warning(tmp_path, caplog, content):
    path = tmp_path / "costs.json"
    path.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="tierckpt.recovery"):
        costs = CostModel.load(path)
    assert costs.sources == {}
    assert any("starting from the priors" in r.getMessage() for r in caplog.records)
    t = DictTier("disk", "/nvme")
    assert costs.rates(t) == PRIORS["disk"]


def test_a_bad_entry_is_dropped_and_the_rest_kept(tmp_path, caplog):
    now = time.time()
    good = {"kind": "disk", "latency": 0.002, "bandwidth": 3e9, "count": 3, "updated": now}
    bad = {"kind": "disk", "latency": -1, "bandwidth": 3e9, "count": 3, "updated": now}
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"format": "tierckpt-costs", "version": 1, "sources": {"/a": good, "/b": bad}}))
    with caplog.at_level(logging.WARNING, logger="tierckpt.recovery"):
        costs = CostModel.load(path)
    assert set(costs.sources) == {"/a"} and costs.sources["/a"].bandwidth == 3e9
    assert any("'/b' dropped" in r.getMessage() for r in caplog.records)


def test_a_missing_costs_file_gives_the_priors_silently(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="tierckpt.recovery"):
        costs = CostModel.load(tmp_path / "nope.json")
    assert costs.sources == {} and not caplog.records


def test_observations_older_than_max_age_are_forgotten(tmp_path):
    now = [1_000_000.0]
    costs = CostModel(clock=lambda: now[0])
    t = DictTier("disk", "/nvme")
    costs.observe(t, 1 << 30, 10.0)
    assert costs.rates(t) != PRIORS["disk"]
    costs.save(tmp_path / "c.json")
    now[0] += MAX_AGE + 1
    assert costs.rates(t) == PRIORS["disk"]
    assert CostModel.load(tmp_path / "c.json", clock=lambda: now[0]).sources == {}
    # a stale source starts again from its priors, not from the old values
    costs.observe(t, 1 << 30, (1 << 30) / PRIORS["disk"][1] + PRIORS["disk"][0])
    assert costs.rates(t)[1] == pytest.approx(PRIORS["disk"][1])


# -- the planner with costs ----------------------------------------------------------------------
def test_planner_orders_each_shard_by_its_own_estimate():
    # x answers at once but is slow; y is slow to answer but fast: small shards from x, big ones from y
    x, y = DictTier("disk", "/x"), DictTier("disk", "/y")
    put_step([x, y], "j", 3, [shard_bytes(1024, 0), shard_bytes(4 * MiB, 1)])
    invs = [scan_tier(x, "j"), scan_tier(y, "j")]
    plain = plan_restore(invs, "j")
    assert plain.sources == {0: [x, y], 1: [x, y]} and plain.estimates == {}
    costs = CostModel()
    now = time.time()
    costs.sources["/x"] = SourceCost("disk", latency=10e-6, bandwidth=0.1 * GB, count=5, updated=now)
    costs.sources["/y"] = SourceCost("disk", latency=5e-3, bandwidth=10 * GB, count=5, updated=now)
    plan = plan_restore(invs, "j", costs=costs)
    assert plan.sources == {0: [x, y], 1: [y, x]}
    assert plan.estimates[0] == pytest.approx(10e-6 + 1024 / (0.1 * GB))
    assert plan.estimates[1] == pytest.approx(5e-3 + 4 * MiB / (10 * GB))


def test_planner_with_priors_puts_memory_before_disk_whatever_the_inventory_order():
    mem, disk = DictTier("memory", "/dev/shm/m"), DictTier("disk", "/nvme")
    put_step([mem, disk], "j", 1, [shard_bytes(100, 0)])
    plan = plan_restore([scan_tier(disk, "j"), scan_tier(mem, "j")], "j", costs=CostModel())
    assert plan.sources[0] == [mem, disk]


# -- fetch_shards ---------------------------------------------------------------------------------
def _collect():
    got: dict[int, bytes] = {}

    def on_shard(rank, view, report):
        got[rank] = bytes(view)

    return got, on_shard


def test_fetch_shards_reads_in_parallel_and_verifies_every_shard():
    a = DictTier("disk", "/a", delay=0.05)
    data = [shard_bytes(1000 * (r + 1), r) for r in range(8)]
    put_step([a], "j", 1, data)
    plan = plan_restore([scan_tier(a, "j")], "j")
    got, on_shard = _collect()
    reports = fetch_shards(plan, range(8), bytearray, on_shard, max_bytes=1 << 30, workers=4)
    assert got == dict(enumerate(data))
    assert [r.rank for r in reports] == list(range(8))
    assert all(r.source == "/a" and r.tier == "disk" and not r.failures for r in reports)
    assert a.peak_active >= 2  # shards overlapped


def test_fetch_shards_never_holds_more_than_max_bytes_and_an_oversize_shard_goes_alone():
    a = DictTier("disk", "/a", delay=0.01)
    sizes = [300, 200, 500, 100, 1500, 400, 250, 50, 600, 10, 0, 350]
    data = [shard_bytes(n, r) for r, n in enumerate(sizes)]
    put_step([a], "j", 1, data)
    plan = plan_restore([scan_tier(a, "j")], "j")
    max_bytes = 600
    live: list[int] = []
    peaks: list[list[int]] = []

    def alloc(n):
        live.append(n)
        peaks.append(list(live))
        return bytearray(n)

    def on_shard(rank, view, report):
        assert bytes(view) == data[rank]
        live.remove(sizes[rank])

    reports = fetch_shards(plan, range(len(sizes)), alloc, on_shard, max_bytes=max_bytes, workers=3)
    assert len(reports) == len(sizes) and live == []
    for snapshot in peaks:
        assert sum(snapshot) <= max_bytes or snapshot == [1500], snapshot
        assert len(snapshot) <= 3
    assert [1500] in peaks


def test_corrupt_copy_in_first_tier_falls_back_to_the_next_and_the_report_says_so():
    a, b = DictTier("memory", "/dev/shm/a"), DictTier("disk", "/nvme/b")
    data = [shard_bytes(5000, r) for r in range(3)]
    put_step([a, b], "j", 1, data)
    a.corrupt.add(keys.shard_key("j", 1, 1))
    plan = plan_restore([scan_tier(a, "j"), scan_tier(b, "j")], "j", costs=CostModel())
    got, on_shard = _collect()
    reports = fetch_shards(plan, [0, 1, 2], bytearray, on_shard, max_bytes=MiB)
    assert got == dict(enumerate(data))
    assert [r.source for r in reports] == ["/dev/shm/a", "/nvme/b", "/dev/shm/a"]
    (failure,) = reports[1].failures
    assert failure.startswith("memory /dev/shm/a:") and "checksum" in failure


def test_error_in_every_tier_raises_shard_unavailable_after_the_other_fetches_stop():
    a, b = DictTier("disk", "/a", delay=0.02), DictTier("disk", "/b", delay=0.02)
    data = [shard_bytes(2000, r) for r in range(6)]
    put_step([a, b], "j", 1, data)
    a.broken.add(keys.shard_key("j", 1, 2))
    b.corrupt.add(keys.shard_key("j", 1, 2))
    plan = plan_restore([scan_tier(a, "j"), scan_tier(b, "j")], "j")
    seen = []
    with pytest.raises(ShardUnavailableError) as ei:
        fetch_shards(plan, range(6), bytearray, lambda r, v, rep: seen.append(r), max_bytes=MiB, workers=2)
    msg = str(ei.value)
    assert "shard 2" in msg and "/a is down" in msg and "disk /b:" in msg and "checksum" in msg
    assert isinstance(ei.value, ValueError) and isinstance(ei.value, OSError)
    assert a.active == 0 and b.active == 0  # nothing still reading when the error arrives
    assert 2 not in seen


def test_an_error_in_on_shard_stops_the_fetch_and_is_raised_as_is():
    a = DictTier("disk", "/a", delay=0.01)
    put_step([a], "j", 1, [shard_bytes(100, r) for r in range(6)])
    plan = plan_restore([scan_tier(a, "j")], "j")

    def on_shard(rank, view, report):
        raise KeyError("consumer failed")

    with pytest.raises(KeyError, match="consumer failed"):
        fetch_shards(plan, range(6), bytearray, on_shard, max_bytes=MiB, workers=2)
    assert a.active == 0 and a.reads == 1 + 2  # the manifest, then the two shards already under way


def test_fetch_shards_feeds_every_report_to_the_cost_model():
    a = DictTier("peer", "peer h:1")
    put_step([a], "j", 1, [shard_bytes(1 << 19, r) for r in range(3)])
    plan = plan_restore([scan_tier(a, "j")], "j")
    costs = CostModel()
    fetch_shards(plan, range(3), bytearray, lambda r, v, rep: None, max_bytes=MiB, costs=costs)
    e = costs.sources["peer h:1"]
    assert e.kind == "peer" and e.count == 3 and e.bandwidth is not None


def test_fetch_shards_refuses_a_bound_of_zero():
    a = DictTier()
    put_step([a], "j", 1, [b"x"])
    plan = plan_restore([scan_tier(a, "j")], "j")
    with pytest.raises(ValueError, match="max_bytes"):
        fetch_shards(plan, [0], bytearray, lambda *x: None, max_bytes=0)


# -- inventory --------------------------------------------------------------------------------------
def test_a_listing_only_scan_reads_no_manifest_and_agrees_with_a_full_scan_on_what_retention_needs():
    t = DictTier("disk", "/d")
    for step in (3, 5, 8):
        put_step([t], "j", step, [b"ab", b"cd"])
    t.put(keys.shard_key("j", 4, 0), b"ab")  # a step that never committed here, older than committed ones
    t.put(keys.shard_key("j", 9, 0), b"ab")  # one that may still be in flight
    full = scan_tier(t, "j", with_sizes=False)
    reads = t.reads
    assert reads >= 3  # the full scan read the three manifests
    listed = scan_tier(t, "j", with_sizes=False, manifests=False)
    assert t.reads == reads  # no manifest read
    for inv in (full, listed):
        assert sorted(s for s, st in inv.job("j").items() if st.committed) == [3, 5, 8]
        assert inv.stale_steps("j") == {4}
    assert all(st.manifest is None for st in listed.job("j").values())


def test_scan_tiers_returns_after_the_timeout_when_tiers_hang_and_keeps_the_others():
    good = DictTier("disk", "/good")
    put_step([good], "j", 4, [b"abc", b"defg"])
    hung = [HungTier("peer", "peer 10.0.0.7:4000"), HungTier("s3", "s3://b")]
    try:
        t0 = time.monotonic()
        invs = scan_tiers([hung[0], good, hung[1]], "j", timeout=0.5)
        took = time.monotonic() - t0
    finally:
        for h in hung:
            h.release.set()
    # the hung tiers never answer until released: returning at all shows the timeout worked
    assert took < 0.5 + 30.0
    assert [i.tier for i in invs] == [hung[0], good, hung[1]]
    for i in (invs[0], invs[2]):
        assert isinstance(i.error, TimeoutError) and "did not answer within 0.5 s" in str(i.error)
        assert i.steps == {}
    assert invs[1].error is None and invs[1].complete_steps("j") == [4]


def test_scan_records_the_latency_of_manifest_reads():
    a, empty = DictTier("disk", "/a"), DictTier("disk", "/e")
    put_step([a], "j", 1, [b"x"])
    put_step([a], "j", 2, [b"y"])
    inv = scan_tier(a)
    assert inv.latency is not None and 0 < inv.latency < 1.0
    assert scan_tier(empty).latency is None


def test_a_tier_error_during_the_scan_is_still_reported_not_raised():
    class Down(DictTier):
        def list(self, prefix=""):
            raise TierError("unreachable")

    (inv,) = scan_tiers([Down()], "j", timeout=5)
    assert isinstance(inv.error, TierError)


# -- end to end, real folder tiers -----------------------------------------------------------------
def test_learned_costs_pick_the_faster_of_two_disk_folders(tmp_path):
    slow, fast = DiskTier(tmp_path / "slow", durable=False), DiskTier(tmp_path / "fast", durable=False)
    data = [shard_bytes(3 * MiB, r) for r in range(2)]
    put_step([slow, fast], "j", 7, data)
    invs = scan_tiers([slow, fast], "j")
    assert all(i.latency is not None for i in invs)

    # without a model (or with the priors alone) the given order stands
    assert plan_restore(invs, "j").sources[0] == [slow, fast]
    assert plan_restore(invs, "j", costs=CostModel()).sources[0][0] is slow

    # transfers as a slow and a fast folder would report them, saved and loaded as a new process would
    costs = CostModel()
    for _ in range(5):
        assert costs.observe(slow, 64 * MiB, 64 * MiB / (0.2 * GB))
        assert costs.observe(fast, 64 * MiB, 64 * MiB / (3 * GB))
    costs.save(tmp_path / "costs.json")
    costs = CostModel.load(tmp_path / "costs.json")

    plan = plan_restore(invs, "j", costs=costs)
    assert plan.sources == {0: [fast, slow], 1: [fast, slow]}
    got, on_shard = _collect()
    reports = fetch_shards(plan, [0, 1], bytearray, on_shard, max_bytes=4 * MiB, costs=costs)
    assert got == dict(enumerate(data))
    assert [r.source for r in reports] == [fast.root, fast.root] and all(r.tier == "disk" for r in reports)
    assert costs.sources[fast.root].count == 7


def test_memory_folder_is_preferred_over_disk_and_a_corrupt_memory_copy_falls_back(tmp_path):
    mem, disk = MemoryTier(tmp_path / "shm"), DiskTier(tmp_path / "disk", durable=False)
    data = [shard_bytes(MiB, r) for r in range(3)]
    put_step([mem, disk], "j", 1, data)
    with open(mem.path(keys.shard_key("j", 1, 2)), "r+b") as f:
        f.write(b"\0" * 16)
    plan = plan_restore(scan_tiers([disk, mem], "j"), "j", costs=CostModel())
    assert all(src == [mem, disk] for src in plan.sources.values())
    got, on_shard = _collect()
    reports = fetch_shards(plan, range(3), bytearray, on_shard, max_bytes=MiB)
    assert got == dict(enumerate(data))
    assert [r.tier for r in reports] == ["memory", "memory", "disk"]
    assert reports[2].source == disk.root and reports[2].failures[0].startswith(f"memory {mem.root}:")


# -- the CLI ------------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_cli_restore_fetches_in_parallel_shows_each_source_and_keeps_learned_costs(tmp_path):
    import torch
    from procs import ckpt_cmd

    shm, disk = str(tmp_path / "shm"), str(tmp_path / "disk")
    mem, dsk = MemoryTier(shm), DiskTier(disk, durable=False)
    full = torch.arange(6 * 1000, dtype=torch.float32).reshape(6, 1000)
    shards = []
    for r in range(3):
        part = full[2 * r: 2 * r + 2].contiguous()
        data = part.numpy().tobytes()
        entries = (TensorChunk("model/w", "float32", (6, 1000), (2 * r, 0), (2, 1000), 0, len(data)),
                   JsonEntry("loader/pos", r))
        shards.append((data, entries))
    m = Manifest("cj", 9, 3, tuple(ShardInfo(r, len(d), checksum_bytes(d), e) for r, (d, e) in enumerate(shards)))
    for t in (mem, dsk):
        for r, (d, _) in enumerate(shards):
            t.put(keys.shard_key("cj", 9, r), d)
        t.put(keys.manifest_key("cj", 9), m.to_bytes())
    with open(mem.path(keys.shard_key("cj", 9, 1)), "r+b") as f:
        f.write(b"\xff" * 8)

    out = tmp_path / "out"
    p = ckpt_cmd("restore", "cj", "--shm", shm, "--disk", disk, "--to", str(out), "--format", "torch",
                 "--max-memory", "10KiB")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].split() == ["rank", "tier", "source", "size", "seconds", "estimated", "GB/s"]
    rows = {int(line.split()[0]): line.split() for line in lines[2:5]}
    assert rows[0][1:3] == ["memory", mem.root] and rows[2][1:3] == ["memory", mem.root]
    assert rows[1][1:3] == ["disk", dsk.root]
    assert all(float(r[6]) > 0 for r in rows.values())  # (size is two words) the model's estimate for each shard's first place
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    assert torch.equal(state["model"]["w"], full) and state["loader"]["pos"] == 0

    learned = json.loads((tmp_path / "shm" / ".costs.json").read_text())
    assert {mem.root, dsk.root} <= set(learned["sources"])
    assert all(not k.startswith(".") for k in mem.list())  # the costs file is never taken for a key

    p = ckpt_cmd("restore", "cj", "--shm", shm, "--disk", disk, "--to", str(out), "--max-memory", "0")
    assert p.returncode == 2 and "not a positive size" in p.stderr
