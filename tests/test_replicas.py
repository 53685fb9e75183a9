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
import subprocess
import sys

import pytest

from procs import env

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
