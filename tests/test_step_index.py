"""The step index: ``ckpt list`` reads one object per tier, writers keep it in step with the manifests, and a
damaged one is reported and never trusted."""

from __future__ import annotations

import json
import logging
import os
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from procs import agent_call, ckpt_cmd, ckpt_counting_opens, start_agent
from recovery import scan_tier
from recovery.step_index import list_places, manifest_intact, note_commit, note_delete, rebuild, rows_of
from s3util import server_log_size, server_requests, start_moto_server, stop_moto_server
from steps import commit_steps
from test_e2e_faults import _stage_raw
from tiers import DiskTier, MemoryTier, keys
from tiers.errors import ConditionalWriteUnsupportedError, StepIndexError
from tiers.index import StepIndex, read_index
from tiers.manifest import Manifest
from tiers.s3 import S3Tier

JOB = "idxjob"


@pytest.fixture(scope="module")
def counted_s3(fake_aws_env):
    """``(server process, endpoint)``: a moto server of this module's own, so its request log counts only ours."""
    proc, url = start_moto_server()
    try:
        yield proc, url
    finally:
        stop_moto_server(proc)


def _bucket(url: str, name: str) -> str:
    import boto3

    boto3.client("s3", endpoint_url=url, region_name="us-east-1").create_bucket(Bucket=name)
    return name


def _rows(stdout: str) -> dict[str, list[str]]:
    return {ln.split()[0]: ln.split() for ln in stdout.splitlines()[2:] if ln.strip()}


def _without_age(stdout: str) -> list[list[str]]:
    """The table's rows without the age column (two runs a second apart differ there)."""
    lines = stdout.splitlines()
    return [ln.split()[:-2] + ln.split()[-1:] for ln in lines[2:] if ln.strip()]


# ---------------------------------------------------------------------- reading: one object per tier
@pytest.mark.e2e
def test_list_of_a_thousand_steps_reads_one_object_per_tier_on_disk_and_in_s3(tmp_path, counted_s3):
    proc, url = counted_s3
    bucket = _bucket(url, "idx-thousand")
    disk = DiskTier(tmp_path / "disk", durable=False)
    s3 = S3Tier(bucket, "ckpt", endpoint_url=url)
    nowhere = ["--shm", str(tmp_path / "no-memory"), "--socket", str(tmp_path / "no-agent.sock")]
    reads = {}
    for n in (10, 1000):
        job = f"{JOB}-{n}"
        commit_steps(disk, job, range(n), held=[0], threads=4)  # node 0's disk: its own rank's shards
        commit_steps(s3, job, range(n), threads=16)  # the shared prefix: every shard
        p, opened = ckpt_counting_opens("list", job, *nowhere, "--disk", disk.root)
        assert p.returncode == 0 and not p.stderr, p.stderr
        rows = _rows(p.stdout)
        assert sorted(int(s) for s in rows) == list(range(n))
        # node 0's place holds node 0's shard of each step; alone it restores nothing
        assert all(r[1:3] == ["node", "0"] and r[-1] == "no" for r in rows.values()), p.stdout
        start = server_log_size(proc)
        p = ckpt_cmd("list", job, *nowhere, "--s3", f"s3://{bucket}/ckpt", "--s3-endpoint", url)
        requests = server_requests(proc, start)
        assert p.returncode == 0 and not p.stderr, p.stderr
        rows = _rows(p.stdout)
        assert sorted(int(s) for s in rows) == list(range(n))
        assert all(r[1] == "complete" and r[-1] == "yes" for r in rows.values()), p.stdout
        reads[n] = (opened, requests)
    assert reads[1000] == reads[10], reads  # does not grow with the steps
    assert reads[1000][0] == {"manifests": 0, "indexes": 1}  # node 0's disk: no step restorable, none checked
    # S3: its index, and the manifest of the newest restorable step, checked to be whole
    assert "LIST" not in reads[1000][1] and reads[1000][1].get("GET", 0) == 2, reads
    s3.close()


def test_list_scan_reads_every_manifest_and_agrees_with_the_index(tmp_path):
    disk = DiskTier(tmp_path / "disk", durable=False)
    commit_steps(disk, JOB, range(20), held=[1])
    nowhere = ["--shm", str(tmp_path / "no-memory"), "--socket", str(tmp_path / "no-agent.sock"), "--disk", disk.root]
    by_index, opened = ckpt_counting_opens("list", JOB, *nowhere)
    by_scan, scanned = ckpt_counting_opens("list", JOB, *nowhere, "--scan")
    assert opened == {"manifests": 0, "indexes": 1} and scanned == {"manifests": 20, "indexes": 0}
    assert _without_age(by_index.stdout) == _without_age(by_scan.stdout) and not by_index.stderr


# ---------------------------------------------------------------------- writing
def test_the_first_writer_makes_the_index_from_a_scan_naming_every_committed_step(tmp_path):
    disk = DiskTier(tmp_path / "disk", durable=False)
    ms = commit_steps(disk, JOB, range(5), index=False)  # committed before any index was kept
    more = commit_steps(disk, JOB, [5], index=False)
    note_commit(disk, more[5])
    idx = read_index(disk, JOB)
    assert sorted(idx.rows) == [0, 1, 2, 3, 4, 5]
    assert idx.rows == rows_of(scan_tier(disk, JOB).job(JOB))
    assert idx.rows[3].manifest == ms[3].checksum and idx.rows[3].complete


def test_a_row_never_outlives_its_manifest(tmp_path):
    disk = DiskTier(tmp_path / "disk", durable=False)
    ms = commit_steps(disk, JOB, range(3))
    # a writer adds a row whose manifest another writer deleted meanwhile: the row is taken out again
    disk.delete(keys.manifest_key(JOB, 1))
    note_commit(disk, ms[1])
    assert sorted(read_index(disk, JOB).rows) == [0, 2]
    note_delete(disk, JOB, 2)
    assert sorted(read_index(disk, JOB).rows) == [0]


def test_concurrent_writers_of_one_s3_index_lose_no_row(s3_bucket):
    endpoint, bucket = s3_bucket
    s3 = S3Tier(bucket, "ckpt", endpoint_url=endpoint)
    ms = commit_steps(s3, JOB, range(48), index=False)
    rebuild(s3, JOB, {})  # an index that names none of them yet: each writer below adds its own rows
    assert read_index(s3, JOB).rows == {}
    start = threading.Barrier(8)
    errors = []

    def writer(w: int) -> None:
        try:
            start.wait()
            for step in range(w, 48, 8):
                note_commit(s3, ms[step])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    idx = read_index(s3, JOB)
    assert sorted(idx.rows) == list(range(48))
    assert idx.rows == rows_of(scan_tier(s3, JOB).job(JOB))
    s3.close()


class _NoConditionalWrites(S3Tier):
    """An S3 store that refuses If-Match / If-None-Match, as some S3-compatible stores do."""

    def put_if(self, key, data, etag):
        raise ConditionalWriteUnsupportedError(f"{self.describe()} refuses conditional writes (501 NotImplemented)")


def test_a_store_refusing_conditional_writes_is_left_without_an_index_and_listed_by_scan(s3_bucket, caplog):
    endpoint, bucket = s3_bucket
    s3 = S3Tier(bucket, "ckpt", endpoint_url=endpoint)
    commit_steps(s3, JOB, range(3))
    assert sorted(read_index(s3, JOB).rows) == [0, 1, 2]
    refusing = _NoConditionalWrites(bucket, "ckpt", endpoint_url=endpoint)
    more = commit_steps(refusing, JOB, [3, 4], index=False)
    with caplog.at_level(logging.WARNING, logger="tierckpt.index"):
        note_commit(refusing, more[3])
        note_commit(refusing, more[4])
    assert read_index(s3, JOB) is None  # not left behind naming steps 0-2 only
    said = [r for r in caplog.records if "refuses conditional writes" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    (place,) = list_places([s3], JOB)
    assert place.source == "scan" and "no step index" in place.note and sorted(place.steps) == [0, 1, 2, 3, 4]
    s3.close()
    refusing.close()


# ---------------------------------------------------------------------- a damaged index
_DAMAGE_DIR: dict[str, object] = {}


def _damage_place(tmp_path_factory) -> tuple[DiskTier, bytes]:
    if not _DAMAGE_DIR:
        disk = DiskTier(tmp_path_factory.mktemp("damaged"), durable=False)
        commit_steps(disk, JOB, [1, 2, 3, 5, 8], held=[0])
        disk.put(keys.shard_key(JOB, 13, 0), b"in flight")  # not committed: never listed as anything more
        _DAMAGE_DIR.update(disk=disk, good=disk.get(keys.index_key(JOB)))
    return _DAMAGE_DIR["disk"], _DAMAGE_DIR["good"]


_mutations = st.one_of(
    st.tuples(st.just("truncate"), st.integers(0, 10_000)),
    st.tuples(st.just("flip"), st.integers(0, 10_000), st.integers(1, 255)),
    st.tuples(st.just("insert"), st.integers(0, 10_000), st.binary(min_size=1, max_size=8)),
    st.tuples(st.just("replace"), st.binary(max_size=400)),
    st.tuples(st.just("number"), st.integers(0, 10_000), st.sampled_from([b"0", b"9", b"-1", b"1e400", b"NaN"])),
)


def _mutate(good: bytes, m: tuple) -> bytes:
    kind = m[0]
    if kind == "replace":
        return m[1]
    i = m[1] % len(good)
    if kind == "truncate":
        return good[:i]
    if kind == "flip":
        return good[:i] + bytes([good[i] ^ m[2]]) + good[i + 1:]
    if kind == "insert":
        return good[:i] + m[2] + good[i:]
    # a digit of some number replaced: still JSON, perhaps still a plausible index
    digits = [j for j, c in enumerate(good) if chr(c).isdigit()]
    j = digits[i % len(digits)]
    return good[:j] + m[2] + good[j + 1:]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutation=_mutations)
def test_a_damaged_index_is_reported_and_the_place_scanned_never_trusted(tmp_path_factory, mutation):
    disk, good = _damage_place(tmp_path_factory)
    bad = _mutate(good, mutation)
    with open(disk.path(keys.index_key(JOB)), "wb") as f:
        f.write(bad)
    try:
        parsed = StepIndex.from_bytes(bad, JOB)
    except StepIndexError:
        parsed = None
    (place,) = list_places([disk], JOB)
    truth = rows_of(scan_tier(disk, JOB).job(JOB))
    if parsed is not None:
        # only a change that leaves the same index (spaces JSON ignores) is read as one
        assert parsed.rows == truth and place.source == "index"
    else:
        assert place.source == "scan" and place.note and "step index" in place.note
        assert {s: ps.row for s, ps in place.steps.items() if ps.row is not None} == truth
        assert not place.steps[13].committed and place.steps[13].row is None


def test_list_says_when_an_index_is_damaged_and_shows_what_a_scan_finds(tmp_path):
    disk = DiskTier(tmp_path / "disk", durable=False)
    commit_steps(disk, JOB, range(4))
    with open(disk.path(keys.index_key(JOB)), "r+b") as f:
        f.seek(40)
        f.write(b"#")
    nowhere = ["--shm", str(tmp_path / "no-memory"), "--socket", str(tmp_path / "no-agent.sock"), "--disk", disk.root]
    p = ckpt_cmd("list", JOB, *nowhere, check=True)
    assert "step index is damaged" in p.stderr and "read every manifest" in p.stderr, p.stderr
    assert _without_age(p.stdout) == _without_age(ckpt_cmd("list", JOB, *nowhere, "--scan", check=True).stdout)
    p = ckpt_cmd("verify", JOB, *nowhere)
    assert p.returncode == 0 and "step index unusable" in p.stdout, p.stdout
    ckpt_cmd("gc", JOB, *nowhere, check=True)  # rewrites it
    p = ckpt_cmd("list", JOB, *nowhere, check=True)
    assert not p.stderr and len(_rows(p.stdout)) == 4


# ---------------------------------------------------------------------- damaged manifests behind a whole index
def _cut(tier, step: int) -> None:
    key = keys.manifest_key(JOB, step)
    data = tier.get(key)
    tier.put(key, data[: len(data) // 2])


def test_list_never_calls_a_step_restorable_whose_every_manifest_is_cut(tmp_path):
    """The index still names the step; its manifests are cut in half in every place. ``ckpt list`` checks the
    newest restorable step's manifests, shows the damage, and moves on to the next newest."""
    memory, disk = MemoryTier(tmp_path / "shm"), DiskTier(tmp_path / "disk", durable=False)
    for tier in (memory, disk):
        commit_steps(tier, JOB, range(4))
    where = ["--shm", memory.root, "--socket", str(tmp_path / "no-agent.sock"), "--disk", disk.root]
    rows = _rows(ckpt_cmd("list", JOB, *where, check=True).stdout)
    assert [rows[str(s)][-1] for s in range(4)] == ["yes"] * 4
    for tier in (memory, disk):
        _cut(tier, 3)
    rows = _rows(ckpt_cmd("list", JOB, *where, check=True).stdout)
    assert rows["3"][1:5] == ["bad", "manifest", "bad", "manifest"] and rows["3"][-1] == "no", rows
    assert rows["2"][-1] == "yes", rows
    # every step's manifests cut: none is restorable, as restore() finds
    for step in range(3):
        for tier in (memory, disk):
            _cut(tier, step)
    rows = _rows(ckpt_cmd("list", JOB, *where, check=True).stdout)
    assert [rows[str(s)][-1] for s in range(4)] == ["no"] * 4, rows


def test_list_counts_a_step_whose_manifest_is_whole_in_another_place(tmp_path):
    memory, disk = MemoryTier(tmp_path / "shm"), DiskTier(tmp_path / "disk", durable=False)
    for tier in (memory, disk):
        commit_steps(tier, JOB, range(2))
    _cut(memory, 1)
    where = ["--shm", memory.root, "--socket", str(tmp_path / "no-agent.sock"), "--disk", disk.root]
    rows = _rows(ckpt_cmd("list", JOB, *where, check=True).stdout)
    assert rows["1"][1:3] == ["bad", "manifest"] and rows["1"][3] == "complete" and rows["1"][-1] == "yes", rows


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutation=_mutations)
def test_a_manifest_is_intact_only_as_it_was_written(tmp_path_factory, mutation):
    disk, _ = _damage_place(tmp_path_factory)
    key = keys.manifest_key(JOB, 8)
    good = _DAMAGE_DIR.setdefault("manifest", disk.get(key))
    claimed = Manifest.from_bytes(good, job=JOB, step=8).checksum  # what the place's index row names
    bad = _mutate(good, mutation)
    other = tmp_path_factory.mktemp("m")
    tier = DiskTier(other, durable=False)
    tier.put(key, bad)
    try:  # only a change JSON ignores (spaces) leaves the manifest that was sealed
        same = json.loads(bad) == json.loads(good)
    except ValueError:
        same = False
    assert manifest_intact(tier, JOB, 8, claimed) == same


# ---------------------------------------------------------------------- a real agent
@pytest.mark.e2e
def test_an_agent_keeps_memory_disk_and_s3_indexes_in_step_with_its_commits_and_trims(tmp_path, s3_bucket):
    endpoint, bucket = s3_bucket
    shm, disk = str(tmp_path / "shm"), str(tmp_path / "disk")
    args = ["--disk", disk, "--s3", f"s3://{bucket}/ckpt", "--s3-endpoint", endpoint, "--keep-memory", "2",
            "--keep-disk", "3", "--keep-s3", "4", "--s3-every", "2"]
    places = {"memory": MemoryTier(shm), "disk": DiskTier(disk), "s3": S3Tier(bucket, "ckpt", endpoint_url=endpoint)}
    kept = {"memory": [9, 10], "disk": [8, 9, 10], "s3": [4, 6, 8, 10]}

    def committed(name: str) -> list[int]:
        return sorted(rows_of(scan_tier(places[name], JOB).job(JOB)))

    agent = start_agent(shm, *args)
    try:
        for step in range(1, 11):
            _stage_raw(shm, JOB, step, 1 << 20)
            rep = agent_call(shm, "wait", job=JOB, step=step, timeout=120)
            assert rep["done"] and not rep["errors"], rep
        deadline = time.monotonic() + 60
        while any(committed(n) != kept[n] for n in places) and time.monotonic() < deadline:
            time.sleep(0.2)
        for name, t in places.items():
            assert committed(name) == kept[name], name
            assert read_index(t, JOB).rows == rows_of(scan_tier(t, JOB).job(JOB)), name
        listed = ckpt_cmd("list", JOB, "--shm", shm, check=True)
        scanned = ckpt_cmd("list", JOB, "--shm", shm, "--scan", check=True)
        assert not listed.stderr, listed.stderr
        assert _without_age(listed.stdout) == _without_age(scanned.stdout), (listed.stdout, scanned.stdout)
        assert ckpt_cmd("verify", JOB, "--shm", shm).returncode == 0
        # an agent that starts makes its indexes say what its places hold, whatever happened while it was down
        agent.terminate()
        agent.wait(60)
        os.unlink(places["disk"].path(keys.index_key(JOB)))
        places["memory"].delete(keys.manifest_key(JOB, 9))  # a step lost behind its back
        agent = start_agent(shm, *args)
        for name, t in places.items():
            assert read_index(t, JOB).rows == rows_of(scan_tier(t, JOB).job(JOB)), name
        assert 9 not in read_index(places["memory"], JOB).rows
    finally:
        agent.terminate()
        agent.wait(60)
        places["s3"].close()
