"""Which ranks hold identical bytes (ckpt._replicas), checked against the bytes themselves.

Real 4-rank torchrun jobs (gloo) on a 2-D mesh, HSDP and FSDP + TP (tests/mesh_job.py): every rank
reports, for every tensor chunk it checkpoints, the holders and owner it computed alone, and a
checksum of the chunk's bytes. The promise that dedup of the slow tiers rests on: ranks named
holders of a chunk really hold identical bytes of it, and all of them name the same single owner.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys

import pytest

from procs import env, flip_byte, kill_torchrun
from s3util import free_port

pytestmark = pytest.mark.e2e
JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mesh_job.py")


def _run(tmp_path, mode: str) -> list[dict]:
    out = str(tmp_path / mode)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", JOB,
           "--mode", mode, "--job", f"mesh-{mode}", "--shm", str(tmp_path / "shm"), "--steps", "3", "--out", out]
    p = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return [json.loads(open(f"{out}.{r}").read()) for r in range(4)]


def _by_key(rows: list[dict]) -> dict[tuple, dict[int, dict]]:
    out: dict[tuple, dict[int, dict]] = collections.defaultdict(dict)
    for row in rows:
        for c in row["chunks"]:
            out[(c["name"], tuple(c["offsets"]), tuple(c["shape"]))][row["rank"]] = c
    return out


def _check_holders_hold_identical_bytes_and_agree_on_one_owner(rows: list[dict]) -> None:
    chunks = _by_key(rows)
    for key, by_rank in chunks.items():
        for rank, c in by_rank.items():
            assert rank in c["holders"], (key, rank, c["holders"])
            for h in c["holders"]:
                assert h in by_rank, f"{key}: rank {rank} names rank {h} a holder, but it holds no such chunk"
                assert by_rank[h]["sum"] == c["sum"], f"{key}: rank {h} holds other bytes than rank {rank}"
                assert by_rank[h]["holders"] == c["holders"] and by_rank[h]["owner"] == c["owner"], \
                    f"{key}: ranks {rank} and {h} disagree on holders or owner"
            assert c["owner"] in c["holders"]


def test_hsdp_replica_groups_hold_identical_shards_and_each_writes_half(tmp_path):
    rows = _run(tmp_path, "hsdp")
    _check_holders_hold_identical_bytes_and_agree_on_one_owner(rows)
    chunks = _by_key(rows)
    for key, by_rank in chunks.items():
        for rank, c in by_rank.items():
            if c["dtensor"]:
                # mesh (replicate=2, shard=2): rank r's replica is r +- 2, on the other replica group
                assert sorted(c["holders"]) == sorted({rank, rank ^ 2}), (key, rank, c["holders"])
            else:
                assert c["holders"] == [rank]  # the optimizer's step counters: plain tensors, each rank's own
    owned = {row["rank"]: sum(c["nbytes"] for c in row["chunks"] if c["owner"] == row["rank"]) for row in rows}
    held = {row["rank"]: sum(c["nbytes"] for c in row["chunks"]) for row in rows}
    biggest = max(c["nbytes"] for row in rows for c in row["chunks"])
    # the two replica groups (ranks 0, 1 and ranks 2, 3) split every shard's bytes evenly
    for r in (0, 1):
        assert abs(owned[r] - owned[r + 2]) <= biggest
        assert owned[r] + owned[r + 2] - held[r] == sum(
            c["nbytes"] for c in rows[r + 2]["chunks"] if not c["dtensor"])
    # what today's shards hold: every replica's copy, twice the unique bytes (plain counters aside)
    assert 1.9 < sum(held.values()) / sum(owned.values()) <= 2.0
    assert all(row["shard_size"] >= held[row["rank"]] for row in rows)


def test_fsdp_tp_replicated_norms_and_biases_are_named_for_their_tp_pair_only(tmp_path):
    rows = _run(tmp_path, "fsdp_tp")
    _check_holders_hold_identical_bytes_and_agree_on_one_owner(rows)
    shared = set()
    for row in rows:
        for c in row["chunks"]:
            if len(c["holders"]) > 1:
                shared.add(c["name"].split("/")[-1] if "state" not in c["name"] else c["name"].split("/")[-2])
                # mesh (dp=2, tp=2): the tp pair of rank r is r ^ 1
                assert sorted(c["holders"]) == sorted({row["rank"], row["rank"] ^ 1}), (c["name"], c["holders"])
    # sequence-parallel norms and the row-wise layer's bias are replicated over tp; column- and row-wise
    # weights are split over tp and hold no copy
    assert {"blocks.0.norm.weight", "blocks.0.norm.bias", "blocks.0.down.bias"} <= shared
    assert not {"blocks.0.up.weight", "blocks.0.down.weight"} & shared


# ---------------------------------------------------------------- the shared tier holds every chunk once
def _torchrun(n: int, nnodes: int, port: int, shm: str, out: str, *args: str, mode: str = "hsdp",
              per_node: int = 2) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--node-rank", str(n),
           "--nproc-per-node", str(per_node), "--master-addr", "127.0.0.1", "--master-port", str(port), JOB,
           "--mode", mode, "--job", "dedup", "--shm", shm, "--no-spawn", "--out", out, *args]
    # stderr to a file: torchrun's workers keep it open after torchrun itself is gone; a session of its own for
    # kill_torchrun
    with open(f"{out}.node{n}.err", "w") as err:
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env(), start_new_session=True)


_NODES_DEADLINE = float(os.environ.get("TIERCKPT_TEST_NODES_DEADLINE", 600))


def _run_nodes(shms: list[str], out: str, *args: str, mode: str = "hsdp", check: bool = True,
               per_node: int = 2) -> list[str]:
    """Run the job on ``len(shms)`` nodes of ``per_node`` ranks; return each node's stderr (with ``check``, all
    exited 0)."""
    port = free_port()
    jobs = [_torchrun(n, len(shms), port, shm, out, *args, mode=mode, per_node=per_node)
            for n, shm in enumerate(shms)]

    def err(n: int) -> str:
        with open(f"{out}.node{n}.err") as f:
            return f.read()

    for n, j in enumerate(jobs):
        try:
            j.wait(timeout=_NODES_DEADLINE)
        except subprocess.TimeoutExpired:  # a hang: every node's log says where
            for k in jobs:
                kill_torchrun(k)
            raise AssertionError("\n".join(f"--- node {i} ---\n{err(i)[-8000:]}" for i in range(len(jobs)))) from None
        e = err(n)
        assert j.returncode == 0 or not check, \
            "\n".join(ln for ln in e.splitlines() if "Error" in ln)[-3000:] or e[-3000:]
    return [err(n) for n in range(len(jobs))]


def _s3_shards(endpoint: str, bucket: str, step: int) -> dict[int, int]:
    import boto3

    c = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    try:
        objs = c.list_objects_v2(Bucket=bucket, Prefix=f"ckpt/dedup/step-{step}/").get("Contents", [])
    finally:
        c.close()
    return {int(o["Key"].rsplit("rank-", 1)[1].split(".")[0]): o["Size"] for o in objs if o["Key"].endswith(".shard")}


def _dumps(out: str, ranks: range) -> dict[int, dict]:
    import torch

    return {r: torch.load(f"{out}.dump.{r}", weights_only=True) for r in ranks}


def _same(a: dict, b: dict) -> None:
    import torch

    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _own_values(rank: int) -> list:
    """What ``tests/mesh_job.py`` reports of a rank's own values and plain tensor once it has them back."""
    return [rank, f"rank-{rank}", [float(rank)] * 2]


def _lose_node0(procs: list, shms: list[str], agent) -> None:
    """Node 0 is lost (``kill -9`` of its agent) with its memory and disk; a new agent takes its place, empty."""
    from procs import kill9

    kill9(procs[0])
    shutil.rmtree(os.path.dirname(shms[0]))
    procs[0] = agent(0)


def _assert_restored(saved: str, again: str, world: int, from_replicas: set[int]) -> None:
    """Every rank restored step 2 as saved, bit-exact, with its own values (from its head, for those restored
    from replicas): the ranks ``from_replicas`` from their replicas' memory, the others from their own."""
    before, after = _dumps(saved, range(world)), _dumps(again, range(world))
    for r in range(world):
        row = json.loads(open(f"{again}.{r}").read())
        assert row["restored"] == 2, row
        assert set(row["tiers"]) == ({"replicas"} if r in from_replicas else {"memory"}), row
        assert row["progress"] == _own_values(r), row
        _same(before[r], after[r])


class _Nodes:
    """Simulated nodes (``nodes``, two by default) for one job: a memory folder (and a disk folder, with
    ``disk``; holding whole shards with ``disk_whole``) each, a signed peer list on loopback, S3 on moto (none
    when ``s3_bucket`` is None); ``agent(n)`` starts node ``n``'s agent (``alone``: without peers)."""

    def __init__(self, tmp_path, s3_bucket, disk: bool, disk_whole: bool = False, nodes: int = 2) -> None:
        from procs import write_secret

        self.endpoint, self.bucket = s3_bucket or (None, None)
        self.peers = tmp_path / "peers.txt"
        self.peers.write_text("".join(f"127.0.0.1:{free_port()}\n" for _ in range(nodes)))
        self.secret = write_secret(str(tmp_path / "secret"))
        self.shms = [str(tmp_path / f"node{n}" / "shm") for n in range(nodes)]
        self.disks = [str(tmp_path / f"node{n}" / "disk") for n in range(nodes)] if disk else None
        self.disk_whole = disk_whole

    def agent(self, n: int, alone: bool = False):
        from procs import start_agent

        os.makedirs(os.path.dirname(self.shms[n]), exist_ok=True)
        disk = ["--disk", self.disks[n], "--disk-every", "1"] if self.disks else []
        if self.disk_whole:
            disk.append("--disk-whole")
        s3 = ["--s3", f"s3://{self.bucket}/ckpt", "--s3-endpoint", self.endpoint, "--s3-every", "1"] \
            if self.bucket else []
        return start_agent(self.shms[n], "--node-rank", str(n), *([] if alone else ["--peers", str(self.peers)]),
                           "--secret-file", self.secret, *disk, *s3)

    def run(self, out: str, *args: str, count: int = 2, alone: bool = False, mode: str = "hsdp",
            check: bool = True) -> list[str]:
        """Start the first ``count`` nodes' agents, run the job on those nodes (``_run_nodes``), kill the agents;
        return each node's stderr."""
        from procs import kill9

        procs = [self.agent(n, alone=alone) for n in range(count)]
        try:
            return _run_nodes(self.shms[:count], out, *args, mode=mode, check=check)
        finally:
            for p in procs:
                kill9(p)

    def restore_from_s3(self, out: str, before: dict, count: int, mode: str) -> None:
        """Both nodes' folders wiped, ``count`` nodes' ranks restore the newest step (2) from S3 alone and
        match ``before`` bit for bit (with 2 ranks, one replica group: rank 0's whole tensors); with every node
        back, each rank gets its own values."""
        for n in range(count):
            shutil.rmtree(os.path.dirname(self.shms[n]), ignore_errors=True)
        self.run(out, "--restore-only", count=count, alone=count == 1, mode=mode)
        for r in range(2 * count):
            row = json.loads(open(f"{out}.{r}").read())
            assert row["restored"] == 2 and set(row["tiers"]) == {"s3"}, row
            if count == 2:
                assert row["progress"] == _own_values(r), row  # its own values, not its replica's
            _same(before[r if count == 2 else 0], _dumps(out, [r])[r])


def test_hsdp_on_two_nodes_writes_each_chunk_once_to_disk_and_s3_and_restores_from_each_bit_exact(tmp_path,
                                                                                                  s3_bucket):
    nodes = _Nodes(tmp_path, s3_bucket, disk=True)
    endpoint, bucket, shms, disks = nodes.endpoint, nodes.bucket, nodes.shms, nodes.disks

    saved = str(tmp_path / "saved")
    nodes.run(saved, "--steps", "3")
    rows = [json.loads(open(f"{saved}.{r}").read()) for r in range(4)]
    memory = {row["rank"]: row["shard_size"] for row in rows}
    durable = {row["rank"]: row["durable"] if row["durable"] is not None else row["shard_size"] for row in rows}
    unique = sum(c["nbytes"] for row in rows for c in row["chunks"] if c["owner"] == row["rank"])
    s3 = _s3_shards(endpoint, bucket, 2)
    # S3 holds each rank's durable part: every chunk once, about half of what the four ranks hold
    assert s3 == durable, (s3, durable)
    assert all(durable[r] < memory[r] for r in range(4))
    assert unique <= sum(s3.values()) <= unique + 4 * 4096  # alignment of each chunk, per shard
    assert sum(s3.values()) < 0.55 * sum(memory.values())
    per_node = [s3[0] + s3[1], s3[2] + s3[3]]
    assert abs(per_node[0] - per_node[1]) <= max(c["nbytes"] for row in rows for c in row["chunks"])
    # the job's disks hold every chunk once too: each node's disk holds its ranks' durable parts, so the
    # bytes written to disk per step are the unique bytes, split evenly between the nodes (a step the drain
    # passed over for a newer one is not there at all)
    for step in (2,):
        on_disk = {r: os.path.getsize(os.path.join(disks[r // 2], "dedup", f"step-{step}", f"rank-{r}.shard"))
                   for r in range(4)}
        assert on_disk == durable, (step, on_disk, durable)
        for n in (0, 1):
            assert sorted(f for f in os.listdir(os.path.join(disks[n], "dedup", f"step-{step}"))
                          if f.endswith(".shard")) == [f"rank-{r}.shard" for r in (2 * n, 2 * n + 1)]
    before = _dumps(saved, range(4))

    # both nodes restart with their memory gone and their disks kept (a reboot): each rank reads its durable
    # part from its own disk and its replica's chunks from the other node's disk, bit-exact, not from S3
    for n in (0, 1):
        shutil.rmtree(shms[n])
    again = str(tmp_path / "from-disk")
    nodes.run(again, "--restore-only")
    for r in range(4):
        row = json.loads(open(f"{again}.{r}").read())
        assert row["restored"] == 2 and set(row["tiers"]) == {"disk", "peer-disk"}, row
        assert row["progress"] == _own_values(r), row
        _same(before[r], _dumps(again, [r])[r])

    # every node loses memory and disk: the ranks restore from S3, each chunk from the rank that wrote it;
    # then one replica group on one node (2 ranks, world 4 -> 2), from S3 again
    nodes.restore_from_s3(str(tmp_path / "again"), before, 2, "hsdp")
    nodes.restore_from_s3(str(tmp_path / "half"), before, 1, "hsdp")

    # the CLI reads the shared tier's manifest as any other: verify, and an export of whole tensors
    from procs import ckpt_cmd

    s3 = ["--s3", f"s3://{bucket}/ckpt", "--s3-endpoint", endpoint]
    v = ckpt_cmd("verify", "dedup", "--step", "2", "--shm", str(tmp_path / "none"), *s3, timeout=300)
    assert v.returncode == 0, v.stdout + v.stderr
    x = ckpt_cmd("restore", "dedup", "--step", "2", "--to", str(tmp_path / "export"), "--format", "torch",
                 "--shm", str(tmp_path / "none"), *s3, timeout=300)
    assert x.returncode == 0, x.stdout + x.stderr
    import torch

    exported = torch.load(str(tmp_path / "export" / "checkpoint.pt"), weights_only=True)
    for name, t in before[0].items():
        if name.startswith("param/"):
            assert torch.equal(exported["model"][name[len("param/"):]], t), name


def test_a_damaged_or_lost_part_on_another_nodes_disk_is_read_from_s3_never_from_an_older_step(tmp_path,
                                                                                                s3_bucket):
    """HSDP 2 x 2, each chunk once across the two nodes' disks, S3 holding the same. Both nodes restart without
    their memory, and the last byte of rank 2's durable part on node 1's disk is flipped: a chunk rank 0 reads
    from there. Every rank still restores step 2 bit-exact; ranks 0 and 2 read what the damaged part held from
    S3, ranks 1 and 3 only the disks. Then node 1's disk is gone too (a replaced drive): node 1's ranks find
    nothing near and node 0's cannot complete the step from the disks; all of them restore step 2 from S3 (and
    node 0's disk), never step 1, which every tier also holds."""
    from tiers.keys import manifest_key
    from tiers.manifest import Manifest

    nodes = _Nodes(tmp_path, s3_bucket, disk=True)
    shms, disks = nodes.shms, nodes.disks
    saved = str(tmp_path / "saved")
    nodes.run(saved, "--steps", "3")
    before = _dumps(saved, range(4))
    view = Manifest.from_bytes(open(os.path.join(disks[1], *manifest_key("dedup", 2).split("/")), "rb").read())
    assert "durable_of" in view.metadata
    part = os.path.join(disks[1], "dedup", "step-2", "rank-2.shard")
    assert os.path.getsize(part) == view.shard(2).size
    flip_byte(part, view.shard(2).size - 1)

    def restore(out: str) -> list[dict]:
        for n in (0, 1):
            shutil.rmtree(shms[n], ignore_errors=True)
        nodes.run(out, "--restore-only")
        rows = [json.loads(open(f"{out}.{r}").read()) for r in range(4)]
        for r, row in enumerate(rows):
            assert row["restored"] == 2 and row["progress"] == _own_values(r), row
            _same(before[r], _dumps(out, [r])[r])
        return rows

    rows = restore(str(tmp_path / "damaged"))
    for r in (0, 2):
        assert "s3" in rows[r]["tiers"] and set(rows[r]["tiers"]) <= {"disk", "peer-disk", "s3"}, rows[r]
    for r in (1, 3):
        assert set(rows[r]["tiers"]) == {"disk", "peer-disk"}, rows[r]

    shutil.rmtree(disks[1])
    rows = restore(str(tmp_path / "drive-replaced"))
    for r in (2, 3):
        assert set(rows[r]["tiers"]) == {"s3"}, rows[r]
    for r in (0, 1):
        assert "s3" in rows[r]["tiers"] and set(rows[r]["tiers"]) <= {"disk", "s3"}, rows[r]


def test_a_step_one_node_cannot_reach_fails_on_every_rank_with_the_reason_and_none_waits(tmp_path):
    """FSDP + TP on two nodes (no chunk of one node's ranks is held by the other's), memory and peers only,
    steps 1 and 2 kept. Step 1 of node 1's ranks is lost from every memory; restore(step=1) then fails on every
    rank: node 1's ranks say what of the step is where, node 0's that another rank cannot reach it.
    None of them waits for the others (a rank that raised alone would leave the rest in a collective until the
    process group's timeout), and a restore of the newest step still works. Before that, agents started
    without a peer list are refused with what to do: no node could ever commit a step."""
    from procs import kill9

    nodes = _Nodes(tmp_path, None, disk=False)
    shms = nodes.shms
    errs = nodes.run(str(tmp_path / "alone"), "--steps", "1", mode="fsdp_tp", check=False, alone=True)
    for e in errs:
        assert "has no peer list: no node could commit a step" in e and "--peers FILE" in e, e[-3000:]

    nodes.run(str(tmp_path / "saved"), "--steps", "3", mode="fsdp_tp")
    shutil.rmtree(os.path.join(shms[1], "dedup", "step-1"))
    held = os.listdir(os.path.join(shms[0], "dedup", "step-1"))
    # node 0 held node 1's copies: rank 2's shard, and rank 3's head (the rest of it is rank 2's TP norms)
    assert {"rank-2.shard", "rank-3.head"} <= set(held), held
    for name in held:
        if name.startswith(("rank-2.", "rank-3.")):
            os.remove(os.path.join(shms[0], "dedup", "step-1", name))
    procs = [nodes.agent(0), nodes.agent(1)]
    try:
        errs = _run_nodes(shms, str(tmp_path / "one"), "--restore-only", "--restore-step", "1", mode="fsdp_tp",
                          check=False)
        _run_nodes(shms, str(tmp_path / "two"), "--restore-only", mode="fsdp_tp")
    finally:
        for p in procs:
            kill9(p)
    assert "step 1 of job 'dedup' could not be restored intact" in errs[1], errs[1][-3000:]
    assert "step 1 of job 'dedup' cannot be restored: another rank cannot reach it" in errs[0], errs[0][-3000:]
    for r in range(4):
        assert not os.path.exists(f"{tmp_path / 'one'}.{r}")  # no rank went on as if restored
        assert json.loads(open(f"{tmp_path / 'two'}.{r}").read())["restored"] == 2


# ---------------------------------------------------------------- the job's own replicas as memory redundancy
def test_hsdp_node_lost_restores_from_its_replicas_memory_and_peers_hold_only_unique_parts(tmp_path, s3_bucket):
    """HSDP 2 x 2 on two nodes, two copies asked for in memory (the default): the data-parallel replica on the
    other node already is the second copy of every DTensor chunk, so a peer receives only each shard's unique
    part (the optimizer's step counts, the rank's values). Node 0 then loses its agent (kill -9), memory and
    disk: its ranks restore from node 1's memory (their heads and their replicas' shards), bit-exact, with
    their own values, reading no disk and no S3 although both hold the step."""
    from procs import kill9

    nodes = _Nodes(tmp_path, s3_bucket, disk=True)
    shms, agent = nodes.shms, nodes.agent

    procs = [agent(0), agent(1)]
    saved = str(tmp_path / "saved")
    try:
        _run_nodes(shms, saved, "--steps", "3")
        from tiers.keys import manifest_key
        from tiers.manifest import Manifest

        m = Manifest.from_bytes(open(os.path.join(shms[1], *manifest_key("dedup", 2).split("/")), "rb").read())
        for r in range(4):
            u = m.shard(r).unique
            assert u is not None and u[0] < 0.2 * m.shard(r).size, (r, u, m.shard(r).size)
            assert u[2] == (((r % 2, r % 2 + 2)),), u  # the replica group across the nodes
        # each node holds the other's ranks' unique parts only (every step after the first, whose commit
        # told the agents where the ranks are)
        for n, other in ((0, (2, 3)), (1, (0, 1))):
            for step in (1, 2):
                folder = os.path.join(shms[n], "dedup", f"step-{step}")
                held = sorted(os.listdir(folder))
                for r in other:
                    assert f"rank-{r}.head" in held and f"rank-{r}.shard" not in held, (n, step, held)
                    assert os.path.getsize(os.path.join(folder, f"rank-{r}.head")) == m.shard(r).unique[0]

        # node 0 is lost with its memory and disk; a new agent takes its place, empty
        _lose_node0(procs, shms, agent)
        again = str(tmp_path / "again")
        _run_nodes(shms, again, "--restore-only")
    finally:
        for p in procs:
            kill9(p)
    _assert_restored(saved, again, 4, from_replicas={0, 1})


def test_hsdp_on_four_nodes_restores_a_lost_node_from_the_replica_node_that_is_not_its_placement_partner(
        tmp_path):
    """HSDP 2 x 2 on four nodes of one rank each, memory only (no disk, no S3): rank 0's data-parallel replica
    (rank 2) runs on node 2, while the placement puts node 0's copies on node 1 (groups {0, 1}, {2, 3}). Node 1
    therefore holds rank 0's unique part and node 2 the rest of its state. Node 0 is lost with its memory: rank
    0 restores from node 1's head and node 2's replica, bit-exact, and the other ranks from their own memory;
    no disk or S3 exists to fall back on."""
    from procs import kill9

    nodes = _Nodes(tmp_path, None, disk=False, nodes=4)
    shms = nodes.shms
    procs = [nodes.agent(n) for n in range(4)]
    saved, again = str(tmp_path / "saved"), str(tmp_path / "again")
    try:
        _run_nodes(shms, saved, "--steps", "3", per_node=1)
        folder = os.path.join(shms[1], "dedup", "step-2")
        held = sorted(os.listdir(folder))
        assert "rank-0.head" in held and "rank-0.shard" not in held, held
        assert "rank-2.shard" in os.listdir(os.path.join(shms[2], "dedup", "step-2"))
        _lose_node0(procs, shms, nodes.agent)
        _run_nodes(shms, again, "--restore-only", per_node=1)
    finally:
        for p in procs:
            kill9(p)
    _assert_restored(saved, again, 4, from_replicas={0})


def test_hsdp_on_four_nodes_reboots_from_the_disks_listing_only_the_nodes_that_hold_its_chunks(tmp_path):
    """HSDP 2 x 2 on four nodes of one rank, disks, no S3: the job's disks hold each chunk once, so rank r's
    replicated chunks are on node r's disk or on its replica's node's ((r + 2) % 4). After a reboot (every
    memory gone, the disks kept) each rank restores bit-exact from those two disks, and lists no other node's:
    each agent counts the disk listings it answered, by the node that asked."""
    from procs import kill9
    from test_wire import counter, metrics

    nodes = _Nodes(tmp_path, None, disk=True, nodes=4)
    procs = [nodes.agent(n) for n in range(4)]
    saved, again = str(tmp_path / "saved"), str(tmp_path / "again")
    try:
        _run_nodes(nodes.shms, saved, "--steps", "3", per_node=1)
        for p in procs:
            kill9(p)
        for shm in nodes.shms:
            shutil.rmtree(shm)
        procs = [nodes.agent(n) for n in range(4)]
        _run_nodes(nodes.shms, again, "--restore-only", per_node=1)
        addrs = nodes.peers.read_text().split()
        listed = {n: [counter(metrics(addr), "tierckpt_peer_sender_requests_total", node=str(s), route="disk-list")
                      for s in range(4)] for n, addr in enumerate(addrs)}
    finally:
        for p in procs:
            kill9(p)
    for n in range(4):
        assert [bool(c) for c in listed[n]] == [s == (n + 2) % 4 for s in range(4)], listed
    before, after = _dumps(saved, range(4)), _dumps(again, range(4))
    for r in range(4):
        row = json.loads(open(f"{again}.{r}").read())
        assert row["restored"] == 2 and set(row["tiers"]) <= {"disk", "peer-disk"}, row
        assert row["progress"] == _own_values(r), row
        _same(before[r], after[r])


def test_a_restore_that_fails_on_one_rank_leaves_every_ranks_state_as_it_was(tmp_path):
    """Two ranks on one node, memory only; rank 1's shard of every step saved is damaged. Rank 0 reads each
    step intact, rank 1 none: the restore fails on both, and rank 0's state is as it was before, its
    parameters, its optimizer (no state yet: none applied), its values and its own tensor, although it read
    every step whole. A rank's read is applied only once every rank has read the same step."""
    shm, saved, again = str(tmp_path / "shm"), str(tmp_path / "saved"), str(tmp_path / "again")
    base = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", JOB,
            "--mode", "hsdp", "--replicas", "1", "--job", "alone", "--shm", shm]
    p = subprocess.run(base + ["--steps", "3", "--out", saved], env=env(), capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    damaged = 0
    for step in range(3):
        path = os.path.join(shm, "alone", f"step-{step}", "rank-1.shard")
        if os.path.exists(path):
            flip_byte(path, os.path.getsize(path) - 1)
            damaged += 1
    assert damaged, os.listdir(os.path.join(shm, "alone"))
    p = subprocess.run(base + ["--restore-only", "--restore-may-fail", "--out", again], env=env(),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    import torch

    for r in (0, 1):
        row = json.loads(open(f"{again}.{r}").read())
        assert "could not be restored" in row.get("error", ""), row
        assert row["progress"] == [-1, "", [-1.0, -1.0]], row
        before = torch.load(f"{again}.before.{r}", weights_only=True)
        after = torch.load(f"{again}.dump.{r}", weights_only=True)
        _same(before, after)


def test_fsdp_tp_writes_tp_replicated_tensors_once_to_s3_and_restores_resharded(tmp_path, s3_bucket):
    """2-D FSDP + TP on 4 ranks over two nodes (a TP pair per node): the norms and the row-wise bias, whole on
    both TP ranks, reach S3 once; every rank's S3 shard is its durable part. The TP pair shares a node, so its
    replicas are no second copy in memory: the pair's lead rank sends its whole shard to the other node and its
    partner only its unique part. Node 1 lost: rank 2 restores from its copy on node 0, rank 3 from its head and
    rank 2's shard there. From S3 alone the job restores bit-exact at 4 ranks and resharded at 2 (dp 1 x tp 2).
    The agents keep whole shards on disk (``--disk-whole``): there, TP-replicated tensors are on both ranks'."""
    from procs import kill9

    nodes = _Nodes(tmp_path, s3_bucket, disk=True, disk_whole=True)
    endpoint, bucket, shms, agent = nodes.endpoint, nodes.bucket, nodes.shms, nodes.agent

    procs = [agent(0), agent(1)]
    saved, lost = str(tmp_path / "saved"), str(tmp_path / "lost")
    try:
        _run_nodes(shms, saved, "--steps", "3", mode="fsdp_tp")
        rows = [json.loads(open(f"{saved}.{r}").read()) for r in range(4)]
        s3 = _s3_shards(endpoint, bucket, 2)
        durable = {row["rank"]: row["durable"] if row["durable"] is not None else row["shard_size"] for row in rows}
        assert s3 == durable, (s3, durable)
        on_disk = {r: os.path.getsize(os.path.join(nodes.disks[r // 2], "dedup", "step-2", f"rank-{r}.shard"))
                   for r in range(4)}
        assert on_disk == {row["rank"]: row["shard_size"] for row in rows}, on_disk
        assert sum(on_disk.values()) > sum(durable.values())
        shared = [c for row in rows for c in row["chunks"] if len(c["holders"]) > 1]
        assert shared and all(set(c["holders"]) in ({0, 1}, {2, 3}) for c in shared)
        written = sum(c["nbytes"] for row in rows for c in row["chunks"] if c["owner"] == row["rank"])
        held = sum(c["nbytes"] for row in rows for c in row["chunks"])
        assert written < held
        assert written <= sum(s3.values()) <= written + 8 * 4096  # alignment and values, per shard
        for n, (lead, mate) in ((0, (2, 3)), (1, (0, 1))):
            names = os.listdir(os.path.join(shms[n], "dedup", "step-2"))
            assert f"rank-{lead}.shard" in names and f"rank-{mate}.head" in names, names
            assert f"rank-{mate}.shard" not in names, names

        kill9(procs[1])
        shutil.rmtree(os.path.dirname(shms[1]))
        procs[1] = agent(1)
        _run_nodes(shms, lost, "--restore-only", mode="fsdp_tp")
    finally:
        for p in procs:
            kill9(p)
    before = _dumps(saved, range(4))
    # rank 2's whole shard is on node 0: the new agent pulls it into its memory before the restore (warm
    # restore) or the rank reads it from the peer; rank 3 has only its head there
    expect = {0: [{"memory"}], 1: [{"memory"}], 2: [{"memory"}, {"peer"}], 3: [{"replicas"}]}
    for r in range(4):
        row = json.loads(open(f"{lost}.{r}").read())
        assert row["restored"] == 2 and set(row["tiers"]) in expect[r], row
        assert row["progress"] == _own_values(r), row
        _same(before[r], _dumps(lost, [r])[r])

    nodes.restore_from_s3(str(tmp_path / "again"), before, 2, "fsdp_tp")
    nodes.restore_from_s3(str(tmp_path / "half"), before, 1, "fsdp_tp")
