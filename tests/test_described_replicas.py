"""Replication the job describes where no DTensor placement says it: ``Checkpointer(replicated=...)``.

A DDP model and its optimizer, or a pipeline stage kept by several data-parallel replicas, are plain tensors
that every replica holds bit for bit. Described, they are written to disk and S3 once for the group (by an
owner dealt as for DTensor replicas, :mod:`ckpt._replicas`), and a rank that lost its node restores them from
a replica's memory. The end-to-end tests run real jobs under torchrun (gloo): ``DistributedDataParallel``
(tests/mesh_job.py ``--mode ddp``) and ``torch.distributed.pipelining`` (tests/pp_trainer.py ``--describe``).
"""

from __future__ import annotations

import json
import os
import shutil
import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckpt
from ckpt._flatten import flatten_state
from ckpt._replicas import Replicas, described
from ckpt._shard_plan import ShardPlanner
from tiers.manifest import encode_group


# ---------------------------------------------------------------- the description, refused when it is wrong


def test_a_description_names_sorted_holders_per_escaped_key_and_drops_a_group_of_one():
    want = {"model": Replicas((1, 3), 0, 0, ("described", (1, 3))),
            "optim": Replicas((1, 3), 0, 0, ("described", (1, 3))),
            "a~1b": Replicas((0, 1), 1, 0, ("described", (0, 1)))}
    # the holders are the same whatever order each rank gives them in
    assert described({"model": [3, 1], "optim": (1, 3), "a/b": range(0, 2), "alone": [1]}, 1, 4) == want
    assert described({"model": [1, 3], "optim": [3, 1], "a/b": [1, 0], "alone": [1]}, 1, 4) == want
    assert described(None, 0, 4) == {} and described({}, 0, 4) == {}
    assert described({"model": [0, 2]}, 2, 4)["model"].index == 1


def test_a_2d_mesh_is_refused_and_a_1d_one_gives_its_ranks():
    mesh_2d = types.SimpleNamespace(mesh=torch.arange(4).reshape(2, 2), mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match=r"2-D device mesh \('dp', 'tp'\).*mesh\['dp'\]"):
        described({"model": mesh_2d}, 0, 4)
    mesh_1d = types.SimpleNamespace(mesh=torch.tensor([1, 3]), mesh_dim_names=("dp",))
    assert described({"model": mesh_1d}, 3, 4)["model"].holders == (1, 3)


@pytest.mark.parametrize("replicated,match", [
    ({"model": [0, 1]}, r"does not include this rank \(2\).*data-parallel group"),
    ({"model": [2, 4]}, r"ranks \[4\] outside the job's world of 4"),
    ({"model": [2, 2, 3]}, "names a rank twice"),
    ({"model": [2, True]}, "global ranks"),
    ({"model": "dp"}, "is a str: give a process group"),
    ({"": [2, 3]}, "top-level key"),
    ({1: [2, 3]}, "top-level key"),
    ([("model", [2, 3])], "must be a dict"),
])
def test_a_wrong_description_is_refused_with_what_is_wrong(replicated, match):
    with pytest.raises(ValueError, match=match):
        described(replicated, 2, 4)


def test_a_wrong_description_is_refused_before_an_agent_is_looked_for(tmp_path):
    # with no agent and spawn=False, a description checked later would fail as "no agent" instead
    with pytest.raises(ValueError, match="outside the job's world of 1"):
        ckpt.Checkpointer("d", shm=str(tmp_path / "shm"), spawn=False, replicated={"model": [0, 1]})


def test_a_described_key_the_state_does_not_hold_is_refused_at_save_and_nothing_is_written(tmp_path):
    shm = tmp_path / "shm"
    with ckpt.Checkpointer("d", shm=str(shm), replicated={"model": [0], "optimizer": [0]}) as ck:
        with pytest.raises(ckpt.StateError, match=r"\['optimizer'\].*describe keys of the state"):
            ck.save(0, {"model": {"w": torch.ones(3)}, "optim": {}})
        assert ck.restore({"model": {"w": torch.ones(3)}, "optim": {}}) is None


# ---------------------------------------------------------------- the layout: each described tensor once


def _state(rank: int) -> dict:
    g = torch.Generator().manual_seed(5)
    return {"model": {f"w{i}": torch.randn(64 * (i + 1), generator=g) for i in range(5)},
            "optim": {"step": torch.tensor(3.0), "m": torch.randn(100, generator=g)},
            "rng": torch.full((16,), float(rank))}  # each rank's own


def _names(layout, lo: int, hi: int) -> set[str]:
    """The names of the chunks of some bytes laid out from ``lo`` to ``hi``."""
    return {c.name for c in layout.chunks if lo <= c.offset < hi and c.nbytes}


@pytest.mark.parametrize("world", [2, 3])
def test_each_described_tensor_is_in_exactly_one_holders_durable_part_and_owners_are_balanced(world):
    """Every holder lays out the same owners alone: each described tensor is in exactly one rank's durable
    part, the per-rank tensor in every rank's unique part, and no owner holds more than the biggest tensor
    above another."""
    plans = []
    for r in range(world):
        holders = described({"model": range(world), "optim": list(range(world))}, r, world)
        plans.append(ShardPlanner(holders).plan(flatten_state(_state(r)), False))
    durable: dict[str, list[int]] = {}
    owned = []
    for r, p in enumerate(plans):
        unique = p.unique[0]
        assert p.unique[1] == [encode_group(tuple(range(world)))]
        assert _names(p.layout, 0, unique) == {"rng"}  # only what no other rank holds
        mine = _names(p.layout, unique, p.durable)
        for n in mine:
            durable.setdefault(n, []).append(r)
        owned.append(sum(c.nbytes for c in p.layout.chunks if unique <= c.offset < p.durable))
        # the whole state is in the shard all the same (memory keeps what each rank holds)
        assert {c.name for c in p.layout.chunks} == {c.name for c in plans[0].layout.chunks}
    every = {n for n in _names(plans[0].layout, 0, plans[0].total) if n != "rng"}
    assert set(durable) == every and all(len(v) == 1 for v in durable.values()), durable
    assert max(owned) - min(owned) <= 64 * 5 * 4


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_any_grouping_of_ranks_writes_each_described_tensor_once_per_group_and_overlaps_nothing(data):
    """Random worlds split into replica groups (singletons included), random tensor sizes and dtypes: in each
    group every described tensor is in exactly one member's durable part, each member's unique part holds
    only its own tensor, a rank alone keeps everything in its durable part, and no two chunks overlap."""
    world = data.draw(st.integers(2, 6), label="world")
    group_of = data.draw(st.lists(st.integers(0, 2), min_size=world, max_size=world), label="groups")
    sizes = data.draw(st.lists(st.tuples(st.integers(0, 300), st.sampled_from([torch.float32, torch.int64,
                                                                               torch.bfloat16])),
                               min_size=1, max_size=8), label="tensors")
    members = {g: [r for r in range(world) if group_of[r] == g] for g in set(group_of)}

    def state(rank: int) -> dict:
        return {"model": {f"t{i}": torch.full((n,), i, dtype=dt) for i, (n, dt) in enumerate(sizes)},
                "own": torch.full((3,), float(rank))}

    plans = {r: ShardPlanner(described({"model": members[group_of[r]]}, r, world)).plan(
        flatten_state(state(r)), False) for r in range(world)}
    described_names = {f"model/t{i}" for i, (n, _) in enumerate(sizes) if n}
    for g, ranks in members.items():
        writers: dict[str, list[int]] = {}
        for r in ranks:
            p = plans[r]
            chunks = sorted((c for c in p.layout.chunks if c.nbytes), key=lambda c: c.offset)
            assert all(a.offset + a.nbytes <= b.offset for a, b in zip(chunks, chunks[1:]))
            assert chunks[-1].offset + chunks[-1].nbytes <= p.total
            if len(ranks) == 1 or not described_names:
                assert p.unique is None and p.durable == p.total
                continue
            assert p.unique[1] == [encode_group(tuple(ranks))]
            assert _names(p.layout, 0, p.unique[0]) == {"own"}
            for n in _names(p.layout, p.unique[0], p.durable):
                writers.setdefault(n, []).append(r)
        if len(ranks) > 1 and described_names:
            assert set(writers) == described_names and all(len(w) == 1 for w in writers.values()), writers


def test_without_a_description_plain_tensors_stay_each_ranks_own():
    p = ShardPlanner().plan(flatten_state(_state(0)), False)
    assert p.unique is None and p.durable == p.total


# ---------------------------------------------------------------- DDP on two nodes (tests/mesh_job.py --mode ddp)


@pytest.mark.e2e
def test_ddp_on_two_nodes_writes_each_tensor_once_and_a_lost_node_restores_from_its_replicas_memory(tmp_path,
                                                                                                    s3_bucket):
    """DDP on 4 ranks of 2 nodes, model and optimizer described as replicated on every rank: the ranks' copies
    really are identical (checked against their bytes); disk and S3 hold the unique bytes once (a quarter of
    what memory holds), split evenly between the nodes. Node 0 is then lost (agent ``kill -9``, memory and
    disk gone): its ranks restore from node 1's memory (their heads and a replica's shard), bit-exact, with
    their own values and tensor, reading no disk and no S3. Last, 2 ranks on one node restore from S3 alone."""
    from procs import kill9
    from test_replicas import (_assert_restored, _check_holders_hold_identical_bytes_and_agree_on_one_owner,
                               _dumps, _lose_node0, _Nodes, _run_nodes, _s3_shards)

    nodes = _Nodes(tmp_path, s3_bucket, disk=True)
    shms, agent = nodes.shms, nodes.agent
    procs = [agent(0), agent(1)]
    saved = str(tmp_path / "saved")
    try:
        _run_nodes(shms, saved, "--steps", "3", mode="ddp")
        rows = [json.loads(open(f"{saved}.{r}").read()) for r in range(4)]
        _check_holders_hold_identical_bytes_and_agree_on_one_owner(rows)
        for row in rows:
            for c in row["chunks"]:
                want = [row["rank"]] if c["name"].startswith("progress/") else [0, 1, 2, 3]
                assert c["holders"] == want, (row["rank"], c["name"], c["holders"])
        memory = {row["rank"]: row["shard_size"] for row in rows}
        durable = {row["rank"]: row["durable"] for row in rows}
        unique = sum(c["nbytes"] for row in rows for c in row["chunks"] if c["owner"] == row["rank"])
        s3 = _s3_shards(nodes.endpoint, nodes.bucket, 2)
        assert s3 == durable, (s3, durable)
        assert unique <= sum(s3.values()) <= unique + 4 * 4096, (unique, s3)  # alignment, per shard
        assert sum(s3.values()) < 0.3 * sum(memory.values()), (s3, memory)
        per_node = [s3[0] + s3[1], s3[2] + s3[3]]
        biggest = max(c["nbytes"] for row in rows for c in row["chunks"])
        assert abs(per_node[0] - per_node[1]) <= 2 * biggest, per_node
        on_disk = {r: os.path.getsize(os.path.join(nodes.disks[r // 2], "dedup", "step-2", f"rank-{r}.shard"))
                   for r in range(4)}
        assert on_disk == durable, (on_disk, durable)
        _lose_node0(procs, shms, agent)
        again = str(tmp_path / "again")
        _run_nodes(shms, again, "--restore-only", mode="ddp")
    finally:
        for p in procs:
            kill9(p)
    _assert_restored(saved, again, 4, from_replicas={0, 1})
    before = _dumps(saved, range(4))
    nodes.restore_from_s3(str(tmp_path / "half"), before, 1, "ddp")


# ---------------------------------------------------------------- pipeline stages (tests/pp_trainer.py --describe)


@pytest.mark.e2e
def test_pipeline_stages_described_are_written_once_to_disk_and_restore_from_it_at_either_replica_count(tmp_path):
    """2 stages x 2 replicas, each stage's model and optimizer described as held by its replicas: the disk
    holds each stage once (the two replicas' durable parts together about half of what memory holds). With
    memory lost, the same 2 x 2 job restores from disk, each rank its own stage's state exactly as saved and
    its own step counter; then 2 stages x 1 replica restore from disk too. Each state equals what the saving
    run dumped with plain ``state_dict``."""
    from procs import read_events, start_agent
    from test_pipeline_parallel import SAVED, _assert_same_state, _finish, _launch, _stop

    from tiers.keys import manifest_key
    from tiers.manifest import Manifest

    shm, disk = str(tmp_path / "shm"), str(tmp_path / "disk")

    def agent():
        return start_agent(shm, "--disk", disk, "--disk-every", "1")

    a = agent()
    try:
        _finish(_launch(4, str(tmp_path / "ev-saved"), "--job", "pp", "--shm", shm, "--no-spawn", "--describe",
                        "--steps", str(SAVED + 1), "--dump", str(tmp_path / "saved")))
        m = Manifest.from_bytes(open(os.path.join(shm, *manifest_key("pp", SAVED).split("/")), "rb").read())
    finally:
        _stop([a])
    step_dir = os.path.join(disk, "pp", f"step-{SAVED}")
    on_disk = {r: os.path.getsize(os.path.join(step_dir, f"rank-{r}.shard")) for r in range(4)}
    for stage in (0, 1):
        pair = (2 * stage, 2 * stage + 1)
        assert all(m.shard(r).unique[2] == (pair,) for r in pair), [m.shard(r).unique for r in pair]
        assert all(on_disk[r] == m.shard(r).durable[0] for r in pair), (on_disk, m.shard(pair[0]).durable)
        # the stage once, split between its replicas (plus each one's own few bytes and alignment)
        assert sum(on_disk[r] for r in pair) < 0.6 * sum(m.shard(r).size for r in pair), (on_disk, m.shards)
        assert all(on_disk[r] < 0.75 * m.shard(r).size for r in pair), (on_disk, m.shards)

    for replicas in (2, 1):
        shutil.rmtree(shm, ignore_errors=True)  # memory lost; the disk kept
        a = agent()
        out, dumped = str(tmp_path / f"ev-{replicas}"), str(tmp_path / f"restored-{replicas}")
        try:
            _finish(_launch(2 * replicas, out, "--job", "pp", "--shm", shm, "--no-spawn", "--describe",
                            "--steps", str(SAVED + 1), "--dump-restored", dumped))
        finally:
            _stop([a])
        for rank in range(2 * replicas):
            stage = rank // replicas
            ev = [e for e in read_events(f"{out}.{rank}") if "restored" in e]
            assert len(ev) == 1 and ev[0]["restored"] == SAVED and set(ev[0]["tiers"]) == {"disk"}, (rank, ev)
            # from the shards of its own stage's replicas (one of them wrote each tensor), never another stage's
            assert set(ev[0]["ranks"]) <= {2 * stage, 2 * stage + 1}, (rank, ev)
            _assert_same_state(torch.load(f"{dumped}.{rank}", weights_only=True),
                               torch.load(f"{tmp_path / 'saved'}.{stage * 2 + rank % replicas}", weights_only=True),
                               f"{replicas} replicas, rank {rank}")


# ---------------------------------------------------------------- ranks that describe differently


def test_ranks_naming_different_holder_groups_are_refused_with_who_disagrees():
    from agents.stepbook import check_groups

    check_groups({})
    check_groups({0: ((0, 1),), 1: ((0, 1), (1, 3)), 3: ((1, 3),)})  # agree: nothing said
    with pytest.raises(ValueError, match=r"rank 0 names the holders \[0, 1, 2, 3\], but rank 1 names none"):
        check_groups({0: ((0, 1, 2, 3),), 2: ((0, 1, 2, 3),), 3: ((0, 1, 2, 3),)})
    with pytest.raises(ValueError, match=r"rank 0 names the holders \[0, 1\], but rank 1 names \[\[1, 2\]\]"):
        check_groups({0: ((0, 1),), 1: ((1, 2),), 2: ((1, 2),)})
    # a DDP world of 2,048 ranks is checked in one pass over its rows, not pairwise
    world = tuple(range(2048))
    check_groups({r: (tuple(world),) for r in world})


@pytest.mark.e2e
def test_a_description_given_on_one_rank_only_commits_no_step_and_says_why(tmp_path):
    """DDP on 2 ranks, rank 0 alone describing the model and optimizer as replicated: rank 0 would leave the
    tensors it deals to rank 1 to rank 1, which writes its own copy of all of them anyway; rather than a step
    whose slow tiers hold what the ranks did not agree on, no step commits and the job is told who disagrees."""
    import subprocess
    import sys

    from procs import env

    job = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mesh_job.py")
    shm = tmp_path / "shm"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", job,
           "--mode", "ddp", "--job", "half", "--shm", str(shm), "--steps", "3", "--out", str(tmp_path / "o"),
           "--describe-on", "0"]
    p = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=600)
    assert p.returncode != 0
    assert "ranks disagree on who holds copies" in p.stderr and "rank 1 names none" in p.stderr, p.stderr[-3000:]
    assert not list(shm.glob("half/step-*/manifest*")), list(shm.rglob("*"))


# ---------------------------------------------------------------- holder groups in the manifest, at any world


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_a_group_round_trips_through_its_encoding_whatever_its_ranks(data):
    world = data.draw(st.integers(2, 64))
    g = tuple(data.draw(st.lists(st.integers(0, world - 1), min_size=2, max_size=world, unique=True)))
    if data.draw(st.booleans()):  # evenly spaced, as DDP worlds and replica groups are
        first, step = data.draw(st.integers(0, world - 2)), data.draw(st.integers(1, world))
        g = tuple(range(first, world, step))
        if len(g) < 2:
            return
    rank = data.draw(st.sampled_from(g))
    from tiers.manifest import decode_group

    enc = encode_group(g)
    assert isinstance(enc, dict) == (len(g) > 3 and g == tuple(range(g[0], g[-1] + 1, g[1] - g[0]))
                                     and g[1] > g[0])
    assert decode_group(json.loads(json.dumps(enc)), rank, world) == g


@pytest.mark.parametrize("v,match", [
    ({"first": 0, "step": 1}, "list of ranks or"),
    ({"first": 0, "step": 1, "count": 4, "x": 1}, "list of ranks or"),
    ({"first": 0, "step": True, "count": 4}, "list of ranks or"),
    ({"first": 0, "step": 0, "count": 4}, "2 or more distinct ranks"),
    ({"first": 0, "step": 1, "count": 1}, "2 or more distinct ranks"),
    ({"first": -1, "step": 1, "count": 4}, "2 or more distinct ranks"),
    ({"first": 2, "step": 2, "count": 4}, "2 or more distinct ranks"),  # up to rank 8: outside the world
    ({"first": 0, "step": 2, "count": 4}, "the rank it is given for"),  # 0, 2, 4, 6: not rank 3
    ([3, 3], "2 or more distinct ranks"),
    ([0, 1], "rank 3 among them"),
])
def test_a_malformed_group_is_refused_saying_what_is_wrong(v, match):
    from tiers.manifest import decode_group

    assert decode_group({"first": 1, "step": 2, "count": 4}, 3, 8) == (1, 3, 5, 7)  # the last rank of the world
    with pytest.raises(ValueError, match=match):
        decode_group(v, 3, 8)


def test_a_ddp_worlds_manifest_grows_with_the_world_not_its_square():
    """Every rank of a 4,096-rank DDP step names the whole world as its holders: listed, the manifest held
    16.8 million ranks (80 MB); encoded, each row names it in a few bytes, and the parsed rows share one
    tuple."""
    from tiers.manifest import Manifest, ShardInfo

    s = "xxh3_64:" + "0" * 16
    world = tuple(range(4096))
    m = Manifest("j", 1, 4096, tuple(ShardInfo(r, 1 << 20, s, (), r // 8, "1" * 32, (1000, s, "2" * 32),
                                               (64, s, (world,))) for r in range(4096)), {})
    data = m.to_bytes()
    assert len(data) < 300 * 4096, len(data)
    back = Manifest.from_bytes(data)
    assert back.shard(4095).unique[2] == (world,) and back.shard(0).unique[2][0] is back.shard(4095).unique[2][0]
