"""What "complete" means per place, and ``ckpt gc``, ``list``, ``verify`` and retention agreeing on it.

End to end: two agents on loopback stand for two nodes; each has its own memory folder and disk folder,
and both drain to one S3 prefix. A world of two ranks saves with rank 0 on node 0 and rank 1 on node 1, so
each node's memory and disk hold the step's manifest but only that node's shard (with ``--replicas 2`` the
peer's memory also holds a copy of the other's), while the S3 prefix holds both.
"""

from __future__ import annotations

import os

import pytest

from procs import agent_call, ckpt_cmd, start_agent
from recovery import fetch_shard, plan_restore, scan_tier, scan_tiers
from test_e2e_faults import _stage_raw
from test_e2e_peers import Cluster
from tiers import DiskTier, MemoryTier, keys
from tiers.checksum import checksum_bytes
from tiers.manifest import Manifest, ShardInfo
from tiers.s3 import S3Tier

JOB = "gcjob"
STEPS = (5, 10)
SIZE = 1 << 20


# ---------------------------------------------------------------------- the rule, on one folder
def _manifest(step: int, world: int, nodes: list[int]) -> Manifest:
    return Manifest(JOB, step, world, tuple(ShardInfo(r, 4, checksum_bytes(bytes([r]) * 4), node=nodes[r])
                                            for r in range(world)))


def test_a_place_is_committed_by_its_manifest_and_node_complete_by_its_nodes_shards(tmp_path):
    t = MemoryTier(tmp_path / "place")
    # world 3: ranks 0 and 1 taken by node 0, rank 2 by node 1; this is node 0's folder
    t.put(keys.shard_key(JOB, 7, 0), bytes([0]) * 4)
    t.put(keys.shard_key(JOB, 7, 1), bytes([1]) * 4)
    t.put(keys.manifest_key(JOB, 7), _manifest(7, 3, [0, 0, 1]).to_bytes())
    st = scan_tier(t, JOB).job(JOB)[7]
    assert st.committed and not st.complete
    assert st.node_complete(0) and not st.node_complete(1) and st.nodes_complete == {0}
    assert st.expected_ranks(shared=False) == [0, 1] and st.missing_ranks(shared=False) == []
    assert st.expected_ranks(shared=True) == [0, 1, 2] and st.missing_ranks(shared=True) == [2]
    assert st.missing_ranks(shared=False, node=1) == [2]  # had it been node 1's folder
    t.delete(keys.shard_key(JOB, 7, 1))
    st = scan_tier(t, JOB).job(JOB)[7]
    assert st.committed and not st.node_complete(0) and st.missing_ranks(shared=False) == [1]


def test_stale_steps_are_the_uncommitted_ones_older_than_the_newest_committed(tmp_path):
    t = MemoryTier(tmp_path / "place")
    for step in (1, 2, 3, 4):
        t.put(keys.shard_key(JOB, step, 0), bytes([0]) * 4)
    t.put(keys.manifest_key(JOB, 2), b"{not a manifest")  # present but unreadable: kept, never garbage
    t.put(keys.manifest_key(JOB, 3), _manifest(3, 2, [0, 1]).to_bytes())  # node 0's place: only rank 0 here
    inv = scan_tier(t, JOB)
    assert inv.stale_steps(JOB) == {1}  # 4 is newer than the newest committed step: maybe in flight
    assert [s for s, st in sorted(inv.job(JOB).items()) if st.committed] == [2, 3]
    t.delete(keys.manifest_key(JOB, 3))
    assert scan_tier(t, JOB).stale_steps(JOB) == set()  # no valid manifest left: nothing to measure against


# ---------------------------------------------------------------------- two nodes, end to end
class Nodes(Cluster):
    """A :class:`Cluster` whose agents also drain to their own disk folder and to one shared S3 prefix."""

    def __init__(self, root, n: int, endpoint: str, bucket: str, extra: list[str] = (), **kw) -> None:
        self.endpoint, self.bucket = endpoint, bucket
        self.s3_args = ["--s3", f"s3://{bucket}/ckpt", "--s3-endpoint", endpoint, *extra]
        super().__init__(root, n, **kw)

    def disk(self, i: int) -> str:
        return str(self.root / f"node{i}" / "disk")

    def start(self, i: int) -> None:
        os.makedirs(os.path.dirname(self.shm(i)), exist_ok=True)
        self.procs[i] = start_agent(self.shm(i), "--node-rank", str(i), *self.args, "--disk", self.disk(i),
                                    *self.s3_args)

    def s3(self) -> S3Tier:
        return S3Tier(self.bucket, "ckpt", endpoint_url=self.endpoint)

    def places(self) -> dict[str, object]:
        """Every place of the job, by a readable name."""
        out: dict[str, object] = {}
        for i in range(self.n):
            out[f"memory{i}"] = MemoryTier(self.shm(i))
            out[f"disk{i}"] = DiskTier(self.disk(i))
        out["s3"] = self.s3()
        return out

    def alone(self, place: str) -> list[str]:
        """``ckpt`` flags that show one place and nothing else (no running agent fills in the rest)."""
        nowhere = ["--socket", str(self.root / "no-agent.sock")]
        if place == "s3":
            return ["--shm", str(self.root / "no-memory"), *nowhere, *self.s3_args]
        i = int(place[-1])
        if place.startswith("memory"):
            return ["--shm", self.shm(i), *nowhere]
        return ["--shm", str(self.root / "no-memory"), *nowhere, "--disk", self.disk(i)]


def _contents(c: Nodes) -> dict[str, list[str]]:
    return {name: sorted(t.list(keys.job_prefix(JOB))) for name, t in c.places().items()}


def _save(c: Nodes, steps) -> dict:
    """Save ``steps`` of a world of 2 (rank r taken by node r) and wait until every place has them; the bytes."""
    original = {}
    for step in steps:
        for r in (0, 1):
            original[(step, r)] = _stage_raw(c.shm(r), JOB, step, SIZE, rank=r, world=2)
        for r in (0, 1):
            rep = agent_call(c.shm(r), "wait", job=JOB, step=step, timeout=120)
            assert rep["done"] and not rep["errors"], rep
    return original


@pytest.fixture
def saved(tmp_path, s3_bucket, request):
    """Steps 5 and 10 in every place; ``(nodes, bytes by (step, rank))``. ``request.param``: replicas (1)."""
    endpoint, bucket = s3_bucket
    c = Nodes(tmp_path, 2, endpoint, bucket, replicas=getattr(request, "param", 1))
    try:
        original = _save(c, STEPS)
        # every node built the manifest and wrote it last wherever it wrote its shard; the last node to finish
        # committed the step in S3
        for step in STEPS:
            for name, t in c.places().items():
                assert t.list(keys.manifest_key(JOB, step)), f"step {step} not committed in {name}"
        yield c, original
    finally:
        c.close()


def _assert_restores_bit_exact(c: Nodes, original: dict) -> None:
    """Each node's memory and disk restore that node's rank, S3 and all places together restore both."""
    places = c.places()
    cases = [([places[f"{kind}{i}"]], [i]) for kind in ("memory", "disk") for i in (0, 1)]
    cases += [([places["s3"]], [0, 1]), (list(places.values()), [0, 1])]
    for tiers, ranks in cases:
        invs = scan_tiers(tiers, JOB)
        for step in STEPS:
            plan = plan_restore(invs, JOB, step, ranks=ranks)
            for r in ranks:
                buf = bytearray(SIZE)
                fetch_shard(plan, r, memoryview(buf))
                assert bytes(buf) == original[(step, r)], (step, r, [t.name for t in tiers])


@pytest.mark.e2e
@pytest.mark.parametrize("saved", [1, 2], indirect=True, ids=["replicas1", "replicas2"])
def test_gc_deletes_no_committed_step_from_any_place_of_a_two_node_job(saved):
    c, original = saved
    before = _contents(c)
    # each node through its agent (its memory, the other's memory as a peer, its disk, S3), then each place alone
    runs = [["--shm", c.shm(0)], ["--shm", c.shm(1)]] + [c.alone(p) for p in c.places()]
    for flags in runs:
        p = ckpt_cmd("gc", JOB, *flags)
        assert p.returncode == 0, (flags, p.stderr)
        assert "removed" not in p.stdout, (flags, p.stdout)
        assert _contents(c) == before, (flags, p.stdout)
    _assert_restores_bit_exact(c, original)


@pytest.mark.e2e
def test_gc_removes_a_leftover_uncommitted_step_and_keeps_a_newer_one_in_flight(saved):
    c, original = saved
    places = c.places()
    # step 3 was cut short: shards without a manifest in node 1's memory, node 0's disk and S3
    places["memory1"].put(keys.shard_key(JOB, 3, 1), original[(5, 1)])
    places["disk0"].put(keys.shard_key(JOB, 3, 0), original[(5, 0)])
    for r in (0, 1):
        places["s3"].put(keys.shard_key(JOB, 3, r), original[(5, r)])
    # step 20 is under way: rank 0 is in node 0's memory, rank 1 has not come yet; its drain of an earlier
    # try already reached the disk and S3 (shards, no manifest)
    _stage_raw(c.shm(0), JOB, 20, SIZE, rank=0, world=2)
    places["disk0"].put(keys.shard_key(JOB, 20, 0), original[(10, 0)])
    places["s3"].put(keys.shard_key(JOB, 20, 0), original[(10, 0)])

    freed = {}
    for flags in (["--shm", c.shm(0)], c.alone("s3"), c.alone("disk0")):
        p = ckpt_cmd("gc", JOB, *flags)
        assert p.returncode == 0, (flags, p.stderr)
        freed[tuple(flags)] = p.stdout
    after = _contents(c)
    for name, names in after.items():
        assert not any("/step-3/" in k for k in names), (name, names)
        for step in STEPS:
            assert keys.manifest_key(JOB, step) in names, (name, step)
    assert keys.shard_key(JOB, 20, 0) in after["memory0"]
    assert keys.shard_key(JOB, 20, 0) in after["disk0"]
    assert keys.shard_key(JOB, 20, 0) in after["s3"]
    # what each run freed, per tier, in bytes
    out = freed[tuple(["--shm", c.shm(0)])]
    assert "removed step 3 from disk" in out and "freed 1.0 MiB in disk" in out, out
    assert "freed 1.0 MiB in peer" in out and "freed 2.0 MiB in s3" in out, out  # node 1's memory, as a peer
    _assert_restores_bit_exact(c, original)


@pytest.mark.e2e
def test_list_shows_a_node_committed_step_and_verify_finds_nothing_missing(saved):
    c, _ = saved
    p = ckpt_cmd("list", JOB, *c.alone("disk1"), check=True)
    rows = {ln.split()[0]: ln.split() for ln in p.stdout.splitlines()[2:]}
    for step in STEPS:
        assert rows[str(step)][1:3] == ["node", "1"], p.stdout  # committed, holding every shard node 1 took
    p = ckpt_cmd("list", JOB, *c.alone("s3"), check=True)
    rows = {ln.split()[0]: ln.split() for ln in p.stdout.splitlines()[2:]}
    assert all(rows[str(s)][1] == "complete" for s in STEPS), p.stdout
    p = ckpt_cmd("list", JOB, "--shm", c.shm(0), check=True)
    assert "partial" not in p.stdout, p.stdout
    for flags in (c.alone("disk0"), c.alone("memory1"), ["--shm", c.shm(0)]):
        p = ckpt_cmd("verify", JOB, *flags)
        assert p.returncode == 0, (flags, p.stdout, p.stderr)
        assert "missing" not in p.stdout, p.stdout
    # a shard a node took and then lost is a problem in that node's place, found when its agent says which node
    # the place is (alone, a place that holds none of the step's shards cannot tell whose they were)
    os.unlink(os.path.join(c.disk(0), JOB, "step-10", "rank-0.shard"))
    p = ckpt_cmd("verify", JOB, "--shm", c.shm(0))
    assert p.returncode == 3, p.stdout
    assert [ln.split() for ln in p.stdout.splitlines() if "missing" in ln] == [["10", "disk", "0", "missing"]], \
        p.stdout
    assert "step index: the step index says ranks 0 are here, the objects say none" in p.stdout, p.stdout
    # a shard lost behind every writer's back: the step index still names it (``list`` reads the index), a scan
    # finds it gone, and gc makes the index say so
    p = ckpt_cmd("list", JOB, "--shm", c.shm(0), check=True)
    assert "missing shards" not in p.stdout, p.stdout
    p = ckpt_cmd("list", JOB, "--shm", c.shm(0), "--scan", check=True)
    assert "missing shards" in p.stdout, p.stdout
    ckpt_cmd("gc", JOB, "--shm", c.shm(0), check=True)
    p = ckpt_cmd("list", JOB, "--shm", c.shm(0), check=True)
    assert "missing shards" in p.stdout and not p.stderr, (p.stdout, p.stderr)


@pytest.mark.e2e
def test_gc_of_a_named_step_refuses_to_delete_its_last_restorable_copy(saved):
    c, _ = saved
    before = _contents(c)
    for extra in (["--step", "10"], ["--all"]):
        p = ckpt_cmd("gc", JOB, *c.alone("s3"), *extra)
        assert p.returncode == 1, (extra, p.stdout, p.stderr)
        assert len(p.stderr.strip().splitlines()) == 1 and "restorable" in p.stderr, p.stderr
        assert _contents(c) == before
    # node 0's disk alone never held a restorable copy: deleting a step there is the caller's to ask
    p = ckpt_cmd("gc", JOB, *c.alone("disk0"), "--step", "5")
    assert p.returncode == 0, p.stderr
    assert not DiskTier(c.disk(0)).list(keys.step_prefix(JOB, 5))
    # deleting it from S3 as well would leave node 0's shard of step 5 only in node 0's memory: allowed only
    # when forced, since S3 holds the last copy gc can see
    p = ckpt_cmd("gc", JOB, *c.alone("s3"), "--step", "5", "--force")
    assert p.returncode == 0, p.stderr
    assert not c.s3().list(keys.step_prefix(JOB, 5))


@pytest.mark.e2e
def test_retention_counts_a_step_committed_in_a_nodes_place_holding_only_its_shards(tmp_path, s3_bucket):
    """With one step kept per place, each node's memory and disk end with the newest step, its own shard and the
    manifest, and S3 with both shards: retention counted those steps as committed and trimmed only older ones."""
    endpoint, bucket = s3_bucket
    c = Nodes(tmp_path, 2, endpoint, bucket, extra=["--keep-memory", "1", "--keep-disk", "1", "--keep-s3", "1"],
              replicas=1)
    try:
        original = _save(c, (5, 10, 15))
        places = c.places()
        # a drain's trim runs after the wait for it is answered: poll for its result
        c.wait_for(lambda: all(sorted({keys.parse_key(k).step for k in t.list(keys.job_prefix(JOB))
                                       if keys.parse_key(k) is not None}) == [15]  # layouts are not steps
                               for t in places.values()), "retention to keep only step 15 in every place")
        for name, t in places.items():
            shards = [r for r in (0, 1) if t.list(keys.shard_key(JOB, 15, r))]
            assert t.list(keys.manifest_key(JOB, 15)) and shards == ([0, 1] if name == "s3" else [int(name[-1])])
        invs = scan_tiers(list(places.values()), JOB)
        plan = plan_restore(invs, JOB)
        for r in (0, 1):
            buf = bytearray(SIZE)
            fetch_shard(plan, r, memoryview(buf))
            assert plan.step == 15 and bytes(buf) == original[(15, r)]
    finally:
        c.close()
