"""Restoring a rank from the job's own replicas (``ShardInfo.unique``, ``recovery.planner.ReplicaRoute``), in
one process against real memory folders: what the planner chooses, and every way the pieces can be wrong.

Rank 0 and rank 1 are data-parallel replicas of a tensor ``w``; each also has a tensor and a value of its own.
Rank 0's own shard is lost; node 1's memory holds rank 1's shard and a copy of rank 0's head. The end-to-end
test (a node lost under HSDP, real processes) is in ``tests/test_replicas.py``.
"""

from __future__ import annotations

import os

import pytest
import torch

from ckpt._load import ShardLoader, StateMismatchError
from recovery import scan_tiers
from recovery.fetch import ShardUnavailableError
from recovery.planner import StepNotFoundError, complete_steps, plan_restore, replica_nodes, view_ranks
from tiers import keys
from tiers.checksum import checksum_bytes
from tiers.disk import DiskTier
from tiers.layout import Layout
from tiers.manifest import JsonEntry, Manifest, ShardInfo, TensorChunk
from tiers.memory import MemoryTier

JOB, STEP = "rep", 4
W = torch.arange(64, dtype=torch.float32)  # the replicated tensor: identical on both ranks


def _own(rank: int) -> torch.Tensor:
    return torch.full((16,), float(rank + 1), dtype=torch.float32)


def _shard(rank: int, w: torch.Tensor = W, wname: str = "w") -> tuple[bytes, Layout, int]:
    """(bytes, layout, unique bytes): the rank's own tensor first (its unique part), then ``w``."""
    own = _own(rank).numpy().tobytes()
    rep = w.numpy().tobytes()
    chunks = (TensorChunk("own", "float32", (16,), (0,), (16,), 0, len(own)),
              TensorChunk(wname, "float32", tuple(w.shape), (0,), tuple(w.shape), 4096, len(rep)))
    data = own + bytes(4096 - len(own)) + rep
    return data, Layout(chunks), 4096


def _write(tier, job: str, rank: int, data: bytes, layout: Layout) -> None:
    tier.put(keys.shard_key(job, STEP, rank), data)
    tier.put(keys.layout_key(job, layout.digest), layout.to_bytes())


@pytest.fixture
def places(tmp_path):
    """(node 0's memory: empty but for the manifest, node 1's memory, node 0's disk, the manifest)."""
    mem0, mem1 = MemoryTier(str(tmp_path / "m0")), MemoryTier(str(tmp_path / "m1"))
    disk0 = DiskTier(str(tmp_path / "d0"))
    rows = []
    for r in (0, 1):
        data, layout, n = _shard(r)
        rows.append(ShardInfo(r, len(data), checksum_bytes(data), (JsonEntry("pos", 100 + r),), r, layout.digest,
                              None, (n, checksum_bytes(data[:n]), ((0, 1),))))
        _write(disk0 if r == 0 else mem1, JOB, r, data, layout)
        if r == 0:
            mem1.put(keys.head_key(JOB, STEP, 0), data[:n])
            mem1.put(keys.layout_key(JOB, layout.digest), layout.to_bytes())
    m = Manifest(JOB, STEP, 2, tuple(rows))
    for t in (mem0, mem1, disk0):
        t.put(keys.manifest_key(JOB, STEP), m.to_bytes())
    return mem0, mem1, disk0, m


def _load(plan, state):
    return ShardLoader(0, True, [], lambda device_type: None).load(plan, state)


def _state():
    return {"own": torch.zeros(16), "w": torch.zeros(64), "pos": -1}


def test_a_rank_whose_shard_is_only_on_disk_is_planned_from_memory_and_restored_exactly(places):
    mem0, mem1, disk0, m = places
    invs = scan_tiers([mem0, mem1, disk0], JOB)
    plan = plan_restore(invs, JOB, None, [0], replicas=True)
    assert plan.step == STEP and 0 in plan.replicas and 0 not in plan.sources
    assert plan.replicas[0].holders == [1] and [t.name for t in plan.sources[1]] == ["memory"]
    state = _state()
    report = _load(plan, state)
    assert report.tier == "replicas"
    assert torch.equal(state["own"], _own(0)) and torch.equal(state["w"], W) and state["pos"] == 100
    # without the replicas route the same step comes from the disk
    plain = plan_restore(invs, JOB, None, [0])
    assert not plain.replicas and [t.name for t in plain.sources[0]] == ["disk"]


def test_without_disk_the_step_is_complete_only_through_the_replicas(places):
    mem0, mem1, _, _ = places
    invs = scan_tiers([mem0, mem1], JOB)
    assert complete_steps(invs, JOB, [0]) == [] and complete_steps(invs, JOB, [0], replicas=True) == [STEP]
    with pytest.raises(StepNotFoundError):
        plan_restore(invs, JOB, STEP, [0])


def test_the_replicas_nodes_are_looked_in_only_for_a_rank_whose_shard_is_in_no_memory(places):
    """A rank's node lost its memory: its replicas' nodes (by ``ShardInfo.node``) are the ones to list, even
    when the places listed so far (its own memory and disk) do not include them; a rank whose shard is in
    memory, or that holds nothing replicated, needs no other node."""
    mem0, mem1, disk0, m = places
    assert replica_nodes(scan_tiers([mem0, disk0], JOB), JOB, 0) == {1}
    assert replica_nodes(scan_tiers([mem0, mem1, disk0], JOB), JOB, 1) == set()  # rank 1's shard: node 1
    mem0.put(keys.shard_key(JOB, STEP, 0), disk0.get(keys.shard_key(JOB, STEP, 0)))
    assert replica_nodes(scan_tiers([mem0, disk0], JOB), JOB, 0) == set()
    mem0.put(keys.shard_key(JOB, STEP, 0), b"cut short")  # a copy of the wrong size is no copy
    assert replica_nodes(scan_tiers([mem0, disk0], JOB), JOB, 0) == {1}
    alone = Manifest(JOB, STEP + 1, 2, tuple(ShardInfo(r.rank, r.size, r.checksum, r.entries, r.node, r.layout)
                                             for r in m.shards))
    t = MemoryTier(str(mem0.root) + "-alone")
    t.put(keys.manifest_key(JOB, STEP + 1), alone.to_bytes())
    assert replica_nodes(scan_tiers([t], JOB), JOB, 0) == set()  # no replicated chunk: nothing to look for
    # only steps newer than the newest this rank's memory holds: an older step on disk alone needs no listing
    older = Manifest(JOB, STEP - 1, 2, m.shards)
    disk0.put(keys.manifest_key(JOB, STEP - 1), older.to_bytes())
    mem0.put(keys.shard_key(JOB, STEP, 0), disk0.get(keys.shard_key(JOB, STEP, 0)))
    assert replica_nodes(scan_tiers([mem0, disk0], JOB), JOB, 0) == set()


def test_a_view_restore_reads_the_ranks_holding_its_chunks_and_refuses_a_plan_that_leaves_a_tensor_unread(
        tmp_path):
    """A shared tier's view of the step (each chunk once): rank 0 wrote the first half of ``w``, rank 1 the
    second, each its own tensor under the same name. Rank 1 plans its own part and its holder group's
    (``view_ranks``), no other rank's, and gets all of ``w``, its own ``own`` (not rank 0's, listed first) and
    its own values. A plan of its own part alone leaves half of ``w`` unread: DCP's partial load would skip it
    without a word, so it is refused before anything is written."""
    t = MemoryTier(str(tmp_path / "view"))
    half = W.numpy().tobytes()[:128], W.numpy().tobytes()[128:]
    parts = {}
    for r in (0, 1):
        own = _own(r).numpy().tobytes()
        parts[r] = (own + bytes(4096 - 64) + half[r],
                    Layout((TensorChunk("own", "float32", (16,), (0,), (16,), 0, 64),
                            TensorChunk("w", "float32", (64,), (32 * r,), (32,), 4096, 128))))
    rows = []
    for r, (data, layout) in parts.items():
        _write(t, JOB, r, data, layout)
        rows.append(ShardInfo(r, len(data), checksum_bytes(data), (JsonEntry("pos", 100 + r),), r, layout.digest,
                              None, (64, checksum_bytes(data[:64]), ((0, 1),))))
    m = Manifest(JOB, STEP, 2, tuple(rows), {"durable_of": "xxh3_64:0000000000000000"})
    t.put(keys.manifest_key(JOB, STEP), m.to_bytes())
    invs = scan_tiers([t], JOB)
    loader = ShardLoader(1, True, [], lambda device_type: None)
    assert view_ranks(m, 1) == [0, 1]
    state = _state()
    loader.load_resharded(plan_restore(invs, JOB, STEP, view_ranks(m, 1)), state, world=2)
    assert torch.equal(state["own"], _own(1)) and torch.equal(state["w"], W) and state["pos"] == 101
    state = _state()
    with pytest.raises(ShardUnavailableError, match=r"shards planned for rank 1 \(1\) do not hold all of w"):
        loader.load_resharded(plan_restore(invs, JOB, STEP, [1]), state, world=2)
    assert not state["own"].any() and not state["w"].any() and state["pos"] == -1


def test_no_head_anywhere_means_no_route(places):
    mem0, mem1, _, _ = places
    mem1.delete(keys.head_key(JOB, STEP, 0))
    invs = scan_tiers([mem0, mem1], JOB)
    assert complete_steps(invs, JOB, [0], replicas=True) == []


def test_a_damaged_head_is_refused_and_the_state_is_left_as_it_was(places):
    mem0, mem1, _, _ = places
    path = mem1.path(keys.head_key(JOB, STEP, 0))
    with open(path, "r+b") as f:
        f.seek(5)
        b = f.read(1)
        f.seek(5)
        f.write(bytes([b[0] ^ 0x40]))
    plan = plan_restore(scan_tiers([mem0, mem1], JOB), JOB, STEP, [0], replicas=True)
    state = _state()
    with pytest.raises(ShardUnavailableError, match="unique part"):
        _load(plan, state)
    assert torch.equal(state["own"], torch.zeros(16)) and torch.equal(state["w"], torch.zeros(64))


def test_a_damaged_replica_shard_is_refused(places):
    mem0, mem1, _, _ = places
    path = mem1.path(keys.shard_key(JOB, STEP, 1))
    with open(path, "r+b") as f:
        f.seek(4096 + 10)
        f.write(b"\xff")
    plan = plan_restore(scan_tiers([mem0, mem1], JOB), JOB, STEP, [0], replicas=True)
    with pytest.raises(ShardUnavailableError):
        _load(plan, _state())


@pytest.mark.parametrize("what", ["name", "shape"])
def test_a_replica_that_holds_another_tensor_is_never_used_for_it(tmp_path, what):
    """The holder's chunk after its unique part must be the same tensor, offsets, shape and dtype: a holder
    whose chunk differs (another name, another shape) gives nothing, and the restore says which is missing."""
    mem0, mem1 = MemoryTier(str(tmp_path / "m0")), MemoryTier(str(tmp_path / "m1"))
    d0, l0, n0 = _shard(0)
    d1, l1, n1 = _shard(1, w=W[:32] if what == "shape" else W, wname="other" if what == "name" else "w")
    rows = (ShardInfo(0, len(d0), checksum_bytes(d0), (JsonEntry("pos", 1),), 0, l0.digest, None,
                      (n0, checksum_bytes(d0[:n0]), ((0, 1),))),
            ShardInfo(1, len(d1), checksum_bytes(d1), (JsonEntry("pos", 2),), 1, l1.digest, None,
                      (n1, checksum_bytes(d1[:n1]), ((0, 1),))))
    m = Manifest(JOB, STEP, 2, rows)
    _write(mem1, JOB, 1, d1, l1)
    mem1.put(keys.head_key(JOB, STEP, 0), d0[:n0])
    mem1.put(keys.layout_key(JOB, l0.digest), l0.to_bytes())
    mem1.put(keys.manifest_key(JOB, STEP), m.to_bytes())
    plan = plan_restore(scan_tiers([mem0, mem1], JOB), JOB, STEP, [0], replicas=True)
    state = _state()
    with pytest.raises(ShardUnavailableError, match="w held by none"):
        _load(plan, state)
    assert torch.equal(state["w"], torch.zeros(64))


def test_a_state_that_does_not_match_is_refused_before_anything_is_written(places):
    mem0, mem1, _, _ = places
    plan = plan_restore(scan_tiers([mem0, mem1], JOB), JOB, STEP, [0], replicas=True)
    state = {"own": torch.zeros(16), "w": torch.zeros(65), "pos": -1}
    with pytest.raises(StateMismatchError):
        _load(plan, state)
    assert torch.equal(state["own"], torch.zeros(16))


def test_heads_are_listed_apart_from_shards_and_counted_in_a_steps_bytes(places):
    _, mem1, _, _ = places
    inv = scan_tiers([mem1], JOB)[0]
    st = inv.job(JOB)[STEP]
    assert set(st.shards) == {1} and st.heads == {0: 4096}
    assert st.nbytes == st.shards[1] + 4096
    assert os.path.exists(mem1.path(keys.head_key(JOB, STEP, 0)))


def test_verify_checks_a_head_against_the_manifest(places, capsys):
    from ckpt.cli import main

    _, mem1, _, _ = places
    assert main(["verify", JOB, "--step", str(STEP), "--shm", mem1.root]) == 0
    out = capsys.readouterr().out
    assert any(line.split()[2:4] == ["0", "(head)"] and line.split()[-1] == "ok" for line in out.splitlines()), out
    path = mem1.path(keys.head_key(JOB, STEP, 0))
    with open(path, "r+b") as f:
        f.write(b"\x01")
    assert main(["verify", JOB, "--step", str(STEP), "--shm", mem1.root]) != 0
    out = capsys.readouterr().out
    assert any("(head)" in line and "CORRUPT" in line for line in out.splitlines()), out


def test_the_agent_refuses_a_unique_part_that_ends_inside_a_chunk(tmp_path):
    from agents.layouts import LayoutBook
    from agents.protocol import RequestError

    book = LayoutBook(MemoryTier(str(tmp_path / "m")), 60.0)
    _, layout, n = _shard(0)
    book.check_boundary(0, layout, n, "unique")  # between the own tensor and the replicated one
    book.check_boundary(0, layout, n, "unique")  # remembered: the same answer
    with pytest.raises(RequestError, match="cuts the chunk 'own'"):
        book.check_boundary(0, layout, 10, "unique")
    with pytest.raises(RequestError, match="cuts the chunk 'w'"):
        book.check_boundary(0, layout, n + 8, "unique")
