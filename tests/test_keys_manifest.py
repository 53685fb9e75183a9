"""Key naming (tiers.keys) and the manifest schema (tiers.manifest)."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiers import (
    InvalidNameError,
    JsonEntry,
    Manifest,
    ManifestError,
    ShardInfo,
    TensorChunk,
    check_job,
    check_rank,
    check_step,
    checksum_bytes,
    manifest_key,
    parse_key,
    shard_key,
    step_prefix,
)
from tiers.keys import KeyInfo, job_prefix

# -- keys -------------------------------------------------------------------------------------
BAD_JOBS = ["", "../x", "..", ".", "a/b", "/abs", "job/", "x" * 129, "a b", "job\n", "job\x00", "é", "a\\b",
            None, 5, b"job"]
GOOD_JOBS = ["gpt-small", "a", "x" * 128, "run_1.2-3", "...", ".hidden", "A.B_C-9"]


@pytest.mark.parametrize("job", BAD_JOBS)
def test_bad_job_names_are_rejected(job):
    with pytest.raises(InvalidNameError) as info:
        check_job(job)
    assert isinstance(info.value, ValueError)
    for make in (lambda: shard_key(job, 1, 0), lambda: manifest_key(job, 1), lambda: job_prefix(job)):
        with pytest.raises(InvalidNameError):
            make()


@pytest.mark.parametrize("job", GOOD_JOBS)
def test_good_job_names_are_accepted(job):
    assert check_job(job) == job
    assert shard_key(job, 3, 1) == f"{job}/step-3/rank-1.shard"
    assert manifest_key(job, 3) == f"{job}/step-3/manifest.json"
    assert step_prefix(job, 3) == f"{job}/step-3/"


@pytest.mark.parametrize("value", [-1, True, False, 1.0, "1", None, 10**18, 10**30])
def test_bad_steps_and_ranks_are_rejected(value):
    with pytest.raises(InvalidNameError):
        check_step(value)
    if value != 10**18:
        with pytest.raises(InvalidNameError):
            check_rank(value)


def test_largest_step_and_rank_still_parse():
    key = shard_key("j", 10**18 - 1, 10**9 - 1)
    assert parse_key(key) == KeyInfo("j", 10**18 - 1, 10**9 - 1)
    with pytest.raises(InvalidNameError):
        check_rank(10**9)


jobs = st.from_regex(r"\A[A-Za-z0-9._-]{1,128}\Z").filter(lambda j: j not in (".", ".."))
steps = st.integers(min_value=0, max_value=10**18 - 1)
ranks = st.integers(min_value=0, max_value=10**9 - 1)


@given(jobs, steps, ranks)
def test_parse_key_inverts_shard_key(job, step, rank):
    info = parse_key(shard_key(job, step, rank))
    assert info == KeyInfo(job, step, rank) and not info.is_manifest


@given(jobs, steps, ranks)
def test_parse_key_inverts_head_key_and_tells_it_from_the_shard(job, step, rank):
    from tiers.keys import head_key

    info = parse_key(head_key(job, step, rank))
    assert info == KeyInfo(job, step, rank, head=True) and not info.is_manifest
    assert parse_key(shard_key(job, step, rank)).head is False


@given(jobs, steps)
def test_parse_key_inverts_manifest_key(job, step):
    info = parse_key(manifest_key(job, step))
    assert info == KeyInfo(job, step, None) and info.is_manifest


JUNK_KEYS = [
    "", "job", "job/step-1", "job/step-1/", "job/step-01/manifest.json", "job/step-1/rank-01.shard",
    "job/step-/manifest.json", "job/step--1/manifest.json", "job/step-1/rank--1.shard", "job/step-1e3/manifest.json",
    "job/step-1/rank-1.shard.tmp", "job/step-1/.tmp-abc", "job/step-1/manifest.json/x", "../step-1/manifest.json",
    "./step-1/manifest.json", "a/b/step-1/manifest.json", "job/step-1\n/manifest.json", "job\n/step-1/manifest.json",
    "job/step-1/rank-0.shard\n", "job/step-1/manifest.json\n", "job/step-１/manifest.json", "job/step-1/rank-0",
    "job/step-10000000000000000000/manifest.json", "job/step-1/rank-10000000000.shard", "/job/step-1/manifest.json",
    "job/step-1/rank-1.heads", "job/step-1/rank-01.head", "job/step-1/rank-1.head.tmp", "job/step-1/head",
]


@pytest.mark.parametrize("key", JUNK_KEYS)
def test_parse_key_returns_none_for_junk(key):
    assert parse_key(key) is None


@given(st.text(max_size=200))
def test_parse_key_never_raises(key):
    info = parse_key(key)
    if info is not None:
        rebuilt = manifest_key(info.job, info.step) if info.is_manifest else shard_key(info.job, info.step, info.rank)
        assert rebuilt == key


# -- manifest ----------------------------------------------------------------------------------
def make_manifest(world: int = 2, job: str = "gpt-small", step: int = 1200) -> Manifest:
    shards = []
    for r in range(world):
        entries = (
            TensorChunk("model.w", "float32", (2 * world, 6), (2 * r, 0), (2, 6), 0, 48),
            TensorChunk("model.b", "bfloat16", (6,), (0,), (6,), 48, 12),
            TensorChunk("empty", "int64", (0, 3), (0, 0), (0, 3), 60, 0),
            JsonEntry("loader", {"epoch": 1, "pos": [r, 17], "name": "ü"}),
        )
        shards.append(ShardInfo(r, 64, checksum_bytes(bytes([r]) * 64), entries))
    return Manifest(job, step, world, tuple(shards), {"lr": 3e-4, "tags": ["a"]}, created=1700000000.25)


def test_manifest_round_trips_through_bytes():
    m = make_manifest()
    back = Manifest.from_bytes(m.to_bytes())
    assert back == m
    assert back.total_bytes == 128
    assert back.shard(1).entries[0].offsets == (2, 0)
    assert Manifest.from_bytes(memoryview(m.to_bytes()), job="gpt-small", step=1200) == m


def test_manifest_with_one_rank_and_no_entries_round_trips():
    m = Manifest("j", 0, 1, (ShardInfo(0, 0, checksum_bytes(b"")),))
    assert Manifest.from_bytes(m.to_bytes()) == m


def corrupt(path: str, value, delete: bool = False) -> bytes:
    """A valid manifest's bytes with the field at ``path`` (dot-separated) set to ``value``."""
    obj = copy.deepcopy(make_manifest().to_json())
    *parents, last = path.split(".")
    node = obj
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]
    if isinstance(node, list):
        last = int(last)
    if delete:
        del node[last]
    else:
        node[last] = value
    return json.dumps(obj).encode()


MALFORMED = {
    "not json": b"{not json",
    "not utf-8": b"\xff\xfe{}",
    "empty": b"",
    "json list": b"[]",
    "json string": b'"tierckpt-manifest"',
    "huge integer": b'{"format": "tierckpt-manifest", "version": ' + b"9" * 5000 + b"}",
    "deep nesting": b"[" * 100000 + b"]" * 100000,
    "NaN metadata": corrupt("metadata", {"x": 1}).replace(b'"x": 1', b'"x": NaN'),
    "infinite created": corrupt("created", 1.0).replace(b'"created": 1.0', b'"created": Infinity'),
    "wrong format": corrupt("format", "safetensors"),
    "no format": corrupt("format", None, delete=True),
    "newer version": corrupt("version", 2),
    "version zero": corrupt("version", 0),
    "version as text": corrupt("version", "1"),
    "version as bool": corrupt("version", True),
    "invalid job": corrupt("job", "../etc"),
    "negative step": corrupt("step", -1),
    "world above shards": corrupt("world", 3),
    "world below shards": corrupt("world", 1),
    "world zero": corrupt("world", 0),
    "shards not a list": corrupt("shards", {}),
    "shard not an object": corrupt("shards.0", 7),
    "rank out of order": corrupt("shards.1.rank", 0),
    "negative shard size": corrupt("shards.0.size", -1),
    "checksum missing": corrupt("shards.0.checksum", None, delete=True),
    "chunk past shard end": corrupt("shards.0.size", 50),
    "overlapping chunks": corrupt("shards.0.entries.1.offset", 40),
    "unknown dtype": corrupt("shards.0.entries.0.dtype", "float128"),
    "nbytes not shape times itemsize": corrupt("shards.0.entries.0.nbytes", 47),
    "negative offset": corrupt("shards.0.entries.1.offset", -12),
    "chunk outside its tensor": corrupt("shards.1.entries.0.offsets", [3, 0]),
    "shape rank mismatch": corrupt("shards.0.entries.0.shape", [2]),
    "negative dimension": corrupt("shards.0.entries.0.global_shape", [-4, 6]),
    "float dimension": corrupt("shards.0.entries.0.global_shape", [4.0, 6]),
    "unknown entry kind": corrupt("shards.0.entries.3.kind", "pickle"),
    "json entry without value": corrupt("shards.0.entries.3.value", None, delete=True),
    "repeated entry name": corrupt("shards.0.entries.1.name", "model.w"),
    "metadata not an object": corrupt("metadata", [1, 2]),
    "created as text": corrupt("created", "yesterday"),
}


@pytest.mark.parametrize("data", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_manifests_are_rejected(data):
    with pytest.raises(ManifestError):
        Manifest.from_bytes(data)


def test_newer_version_says_to_upgrade():
    with pytest.raises(ManifestError, match="upgrade"):
        Manifest.from_bytes(corrupt("version", 3))


def test_manifest_stored_under_another_job_or_step_is_rejected():
    data = make_manifest().to_bytes()
    with pytest.raises(ManifestError, match="job"):
        Manifest.from_bytes(data, job="other-job")
    with pytest.raises(ManifestError, match="step"):
        Manifest.from_bytes(data, step=1201)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=30,
)


def paths(obj, prefix=()):
    """Every path into a JSON value, as tuples of keys and indexes."""
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from paths(v, prefix + (i,))


VALID_JSON = make_manifest().to_json()
VALID_PATHS = list(paths(VALID_JSON))[1:]


def check_parse(data: bytes) -> None:
    """``from_bytes`` either refuses ``data`` with ManifestError or returns a manifest that re-serialises."""
    try:
        m = Manifest.from_bytes(data)
    except ManifestError:
        return
    assert Manifest.from_bytes(m.to_bytes()) == m


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512))
def test_random_bytes_only_raise_manifest_error(data):
    check_parse(data)


@settings(max_examples=300)
@given(json_values)
def test_random_json_only_raises_manifest_error(value):
    check_parse(json.dumps(value).encode())


@settings(max_examples=500)
@given(st.sampled_from(VALID_PATHS), json_values)
def test_manifest_with_one_field_replaced_only_raises_manifest_error(path, value):
    obj = copy.deepcopy(VALID_JSON)
    node = obj
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    check_parse(json.dumps(obj).encode())


def _with_durable() -> Manifest:
    shards = (ShardInfo(0, 4096, checksum_bytes(b"a"), (), 0, "0" * 32, (1024, checksum_bytes(b"b"), "1" * 32)),
              ShardInfo(1, 4096, checksum_bytes(b"c"), (), 1, "2" * 32))
    return Manifest("j", 3, 2, shards)


def test_a_durable_part_round_trips_and_the_shared_tiers_view_lists_it_as_the_shard():
    from tiers.manifest import durable_view

    m = _with_durable()
    back = Manifest.from_bytes(m.to_bytes(), job="j", step=3)
    assert back.shards[0].durable == (1024, checksum_bytes(b"b"), "1" * 32) and back.shards[1].durable is None
    assert "1" * 32 in back.layouts  # retention keeps the durable part's layout too
    view = durable_view(back)
    assert view.metadata["durable_of"] == back.checksum
    assert (view.shards[0].size, view.shards[0].checksum, view.shards[0].layout) == (1024, checksum_bytes(b"b"),
                                                                                     "1" * 32)
    assert view.shards[1] == back.shards[1]
    assert durable_view(back).to_bytes() == view.to_bytes()  # the same bytes from every node that builds it
    assert durable_view(view) is view  # it holds no copies of other ranks' chunks itself


@pytest.mark.parametrize("bad", [[4096, checksum_bytes(b"b"), "1" * 32], [-1, checksum_bytes(b"b"), "1" * 32],
                                 [1024, "crc:00", "1" * 32], [1024, checksum_bytes(b"b"), "../x"],
                                 [1024, checksum_bytes(b"b")], "1024", [True, checksum_bytes(b"b"), "1" * 32]])
def test_a_damaged_durable_part_is_refused_with_the_field_named(bad):
    from tiers import _sealed

    obj = _with_durable().to_json()
    obj["shards"][0]["durable"] = bad
    sealed, _ = _sealed.seal(_sealed.dumps(obj))  # sealed again: the parser, not the checksum, must refuse it
    with pytest.raises(ManifestError, match="durable"):
        Manifest.from_bytes(sealed)


def _with_unique() -> Manifest:
    shards = (ShardInfo(0, 4096, checksum_bytes(b"a"), (), 0, "0" * 32, (1024, checksum_bytes(b"b"), "1" * 32),
                        (512, checksum_bytes(b"u"), ((0, 1),))),
              ShardInfo(1, 4096, checksum_bytes(b"c"), (), 1, "2" * 32, None, (0, checksum_bytes(b""), ((0, 1),))))
    return Manifest("j", 3, 2, shards)


def test_a_unique_part_round_trips_and_stays_in_the_shared_tiers_view():
    from tiers.manifest import durable_view

    back = Manifest.from_bytes(_with_unique().to_bytes(), job="j", step=3)
    assert back.shards[0].unique == (512, checksum_bytes(b"u"), ((0, 1),))
    assert back.shards[1].unique == (0, checksum_bytes(b""), ((0, 1),))
    assert back.shards == _with_unique().shards
    # the durable part starts with the unique part: the shared tier's shard keeps it
    assert durable_view(back).shards[0].unique == back.shards[0].unique
    assert Manifest.from_bytes(durable_view(back).to_bytes()).shards == durable_view(back).shards


@pytest.mark.parametrize("bad", [
    [4097, checksum_bytes(b"u"), [[0, 1]]],  # past the shard
    [2048, checksum_bytes(b"u"), [[0, 1]]],  # past the durable part
    [-1, checksum_bytes(b"u"), [[0, 1]]], [True, checksum_bytes(b"u"), [[0, 1]]], [512, "crc:00", [[0, 1]]],
    [512, checksum_bytes(b"u"), []], [512, checksum_bytes(b"u"), [[0]]],  # no group, a group of one
    [512, checksum_bytes(b"u"), [[1, 2]]],  # without this rank, and a rank outside the world
    [512, checksum_bytes(b"u"), [[0, 0]]], [512, checksum_bytes(b"u"), [[0, True]]],
    [512, checksum_bytes(b"u"), [[0, 1.0]]], [512, checksum_bytes(b"u")], "512"])
def test_a_damaged_unique_part_is_refused_with_the_field_named(bad):
    from tiers import _sealed

    obj = _with_unique().to_json()
    obj["shards"][0]["unique"] = bad
    sealed, _ = _sealed.seal(_sealed.dumps(obj))  # sealed again: the parser, not the checksum, must refuse it
    with pytest.raises(ManifestError, match="unique"):
        Manifest.from_bytes(sealed)
