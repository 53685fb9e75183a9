"""Layouts stored once by digest, version-2 manifests that carry their own checksum, and the chunk table."""

from __future__ import annotations

import glob
import json
import mmap
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckpt
from agents.config import socket_path_for
from agents.protocol import AgentClient, AgentError
from procs import start_agent
from tiers import keys
from tiers.errors import ManifestError
from tiers.layout import Layout, chunk_table_bytes, read_chunk_table
from tiers.manifest import JsonEntry, Manifest, ShardInfo, TensorChunk


def _layout(rank: int, world: int = 4, n: int = 6) -> Layout:
    chunks, off = [], 0
    for i in range(n):
        rows = 8 * world
        nbytes = 8 * 16 * 4
        chunks.append(TensorChunk(f"model.layers.{i}.weight", "float32", (rows, 16), (rank * 8, 0), (8, 16),
                                  off, nbytes))
        off += nbytes
    return Layout(tuple(chunks))


def _manifest(world: int = 4) -> Manifest:
    shards = tuple(ShardInfo(r, _layout(r, world).end, f"xxh3_64:{r:016x}",
                             (JsonEntry("data/pos", 100 + r),), node=r // 2, layout=_layout(r, world).digest)
                   for r in range(world))
    return Manifest("job", 7, world, shards, {"save_index": 7}, created=1_700_000_000.0)


def test_layout_round_trips_through_its_stored_form_and_names_itself():
    lay = _layout(1)
    back = Layout.from_bytes(lay.to_bytes(), lay.digest)
    assert back == lay and back.digest == lay.digest and len(lay.digest) == 32


def test_layout_stored_under_another_digest_is_refused():
    with pytest.raises(ManifestError, match="damaged or replaced"):
        Layout.from_bytes(_layout(1).to_bytes(), _layout(2).digest)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pos=st.integers(min_value=0), value=st.integers(min_value=1, max_value=255))
def test_a_flipped_byte_in_a_layout_object_gives_the_same_layout_or_an_error(pos, value):
    lay = _layout(2)
    data = bytearray(lay.to_bytes())
    data[pos % len(data)] ^= value
    try:
        back = Layout.from_bytes(bytes(data), lay.digest)
    except ManifestError:
        return
    assert back == lay  # a byte the reader never looks at (padding, statistics): same content


def test_manifest_v2_names_layouts_and_carries_its_own_checksum():
    m = _manifest()
    data = m.to_bytes()
    obj = json.loads(data)
    assert obj["version"] == 2 and obj["checksum"].startswith("xxh3_64:")
    assert all("entries" not in s and len(s["layout"]) == 32 for s in obj["shards"])
    back = Manifest.from_bytes(data)
    assert back == m and back.layouts == {_layout(r).digest for r in range(4)}


@settings(max_examples=300, deadline=None)
@given(pos=st.integers(min_value=0), value=st.integers(min_value=1, max_value=255))
def test_any_byte_edited_in_a_v2_manifest_is_refused_or_changes_nothing(pos, value):
    """An edit that keeps the JSON valid (a moved offset, a changed value) is refused by the checksum."""
    m = _manifest()
    data = bytearray(m.to_bytes())
    data[pos % len(data)] ^= value
    try:
        back = Manifest.from_bytes(bytes(data))
    except ManifestError:
        return
    assert back == m


def test_manifest_value_edited_keeping_it_parseable_is_refused():
    data = _manifest().to_bytes()
    edited = data.replace(b'["data/pos",101]', b'["data/pos",102]')
    assert edited != data
    with pytest.raises(ManifestError, match="checksum mismatch"):
        Manifest.from_bytes(edited)


def test_manifest_size_does_not_grow_with_the_model():
    """1,024 ranks: the step's manifest holds rows of a few dozen bytes, whatever each rank's layout weighs."""
    world = 1024
    lay = _layout(0, n=3000)
    shards = tuple(ShardInfo(r, lay.end, f"xxh3_64:{r:016x}", (), node=r // 8, layout=lay.digest)
                   for r in range(world))
    data = Manifest("big", 1, world, shards, created=1.0).to_bytes()
    assert len(data) < 160 * world
    assert len(json.dumps(lay.to_json())) > 100 * len(data) / world


def test_chunk_table_reads_only_the_rows_asked_for():
    layouts = {r: _layout(r) for r in range(4)}
    data = chunk_table_bytes(layouts)
    assert read_chunk_table(data) == layouts
    assert read_chunk_table(data, ranks=[2]) == {2: layouts[2]}
    one = read_chunk_table(data, names=["model.layers.3.weight"])
    assert sorted(one) == [0, 1, 2, 3] and all(len(v.chunks) == 1 for v in one.values())


def _layout_files(root: str, job: str) -> list[str]:
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(root, job, "layouts", "*.layout")))


def test_checkpointer_sends_a_layout_once_and_again_only_when_it_changes(tmp_path):
    shm, disk = str(tmp_path / "shm"), str(tmp_path / "disk")
    state = {"w": torch.arange(12.0), "b": torch.ones(3), "pos": 0}
    with ckpt.Checkpointer("lay", shm=shm, disk=disk, keep_memory=8) as ck:
        for step in range(3):
            state["pos"] = step
            ck.save(step, state).wait()
        sent_first = ck._layout_sent
        assert _layout_files(shm, "lay") == [f"{sent_first}.layout"]
        state["extra"] = torch.zeros(5, dtype=torch.int64)
        state["pos"] = 3
        ck.save(3, state).wait()
        assert ck._layout_sent != sent_first
        assert _layout_files(shm, "lay") == sorted([f"{sent_first}.layout", f"{ck._layout_sent}.layout"])
        assert _layout_files(disk, "lay") == _layout_files(shm, "lay")
        for step in range(4):
            m = Manifest.from_bytes(open(os.path.join(shm, "lay", f"step-{step}", "manifest.json"), "rb").read())
            assert m.version == 2 and m.layouts == {sent_first if step < 3 else ck._layout_sent}
            assert m.shard(0).entries == (JsonEntry("pos", step),)
    for step, names in ((1, ["w", "b", "pos"]), (3, ["w", "b", "pos", "extra"])):
        target = {"w": torch.zeros(12), "b": torch.zeros(3), "pos": -1}
        if "extra" in names:
            target["extra"] = torch.ones(5, dtype=torch.int64)
        with ckpt.Checkpointer("lay", shm=shm, disk=disk, keep_memory=8) as ck:
            assert ck.restore(target, step=step) == step
        assert torch.equal(target["w"], torch.arange(12.0)) and target["pos"] == step
        if "extra" in names:
            assert torch.equal(target["extra"], torch.zeros(5, dtype=torch.int64))


def stop_agent(proc) -> None:
    proc.terminate()
    proc.wait(60)


def _stage(c: AgentClient, job: str, step: int, nbytes: int, **commit) -> dict:
    slot = c.call("begin", job=job, rank=0, world=1, nbytes=nbytes)["slot"]
    with open(slot, "r+b") as f, mmap.mmap(f.fileno(), nbytes) as mm:
        mm[:] = os.urandom(nbytes)
    try:
        return c.call("commit", job=job, step=step, rank=0, world=1, slot=slot, nbytes=nbytes, save_index=step,
                      **commit)
    except AgentError:
        c.call("release", slot=slot)
        raise


def _entries(nbytes: int, name: str = "w") -> list[dict]:
    return [TensorChunk(name, "uint8", (nbytes,), (0,), (nbytes,), 0, nbytes).to_json()]


def test_commit_naming_a_layout_the_agent_does_not_hold_asks_for_its_entries(tmp_path):
    shm = str(tmp_path / "shm")
    agent = start_agent(shm)
    try:
        lay = Layout.from_json(_entries(4096))
        with AgentClient(socket_path_for(shm)) as c:
            with pytest.raises(AgentError) as err:
                _stage(c, "u", 1, 4096, layout=lay.digest)
            assert err.value.kind == "UnknownLayoutError"
            _stage(c, "u", 1, 4096, layout=lay.digest, entries=_entries(4096))
            _stage(c, "u", 2, 4096, layout=lay.digest, values=[["pos", 2]])  # known now: the digest suffices
            with pytest.raises(AgentError, match="digest"):
                _stage(c, "u", 3, 4096, layout="0" * 32, entries=_entries(4096))
            with pytest.raises(AgentError, match="past the shard"):
                _stage(c, "u", 3, 4096, entries=_entries(8192))
            c.call("wait", job="u", timeout=60)
        m = Manifest.from_bytes(open(os.path.join(shm, "u", "step-2", "manifest.json"), "rb").read())
        assert m.shard(0).layout == lay.digest and m.shard(0).entries == (JsonEntry("pos", 2),)
    finally:
        stop_agent(agent)
    # a restarted agent finds the layout in its memory folder: the digest still suffices
    agent = start_agent(shm)
    try:
        with AgentClient(socket_path_for(shm)) as c:
            _stage(c, "u", 3, 4096, layout=lay.digest)
    finally:
        stop_agent(agent)


def test_layouts_no_retained_step_names_are_removed_after_the_grace(tmp_path):
    shm, disk = str(tmp_path / "shm"), str(tmp_path / "disk")
    agent = start_agent(shm, "--disk", disk, "--keep-memory", "1", "--keep-disk", "1",
                        extra_env={"CKPT_LAYOUT_GRACE": "0"})
    try:
        old, new = Layout.from_json(_entries(4096, "a")), Layout.from_json(_entries(4096, "b"))
        with AgentClient(socket_path_for(shm)) as c:
            _stage(c, "g", 1, 4096, entries=_entries(4096, "a"))
            c.call("wait", job="g", timeout=60)
            for step in (2, 3):
                _stage(c, "g", step, 4096, entries=_entries(4096, "b"))
                c.call("wait", job="g", timeout=60)
        for root in (shm, disk):
            assert _layout_files(root, "g") == [f"{new.digest}.layout"], root
        assert old.digest not in new.digest
    finally:
        stop_agent(agent)


def test_restore_reads_a_layout_from_the_next_tier_when_the_first_copy_is_damaged(tmp_path):
    shm, disk = str(tmp_path / "shm"), str(tmp_path / "disk")
    state = {"w": torch.arange(64.0)}
    # the job's memory tier stays after each run, so its damaged copy is there to fall back from
    with ckpt.Checkpointer("dl", shm=shm, disk=disk, keep_memory_after_close=True) as ck:
        ck.save(4, state).wait()
        digest = ck._layout_sent
    path = os.path.join(shm, keys.layout_key("dl", digest))
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])  # cut short
    target = {"w": torch.zeros(64)}
    with ckpt.Checkpointer("dl", shm=shm, disk=disk, keep_memory_after_close=True) as ck:
        assert ck.restore(target) == 4
    assert torch.equal(target["w"], state["w"])
    os.unlink(os.path.join(disk, keys.layout_key("dl", digest)))
    with ckpt.Checkpointer("dl", shm=shm, disk=disk) as ck:
        with pytest.raises(ckpt.StepNotFoundError, match="layout"):
            ck.restore({"w": torch.zeros(64)})
