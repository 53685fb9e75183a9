"""A version-2 manifest parsed at every node every step: the cheap paths must refuse whatever the full checks
refuse, and accept nothing else.

* a shard row is checked in one pass (``_v2_row``), falling back to the field-by-field checks: compared here
  against those checks alone, on rows mutated at random;
* the checksum is checked on the bytes as written, falling back to re-serialising: bytes serialised another
  way are still accepted, edited ones refused;
* ``peek`` reads job and step from a manifest's first bytes: never a wrong answer for bytes that parse;
* ``ManifestCache`` returns a parse only for the very same bytes.
"""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agents.replication import SharedBody, encode_body
from tiers import manifest as manifest_mod
from tiers.errors import ManifestError
from tiers.manifest import JsonEntry, Manifest, ManifestCache, ShardInfo, peek

DIGEST = "0123456789abcdef0123456789abcdef"


def _manifest(world: int = 4, job: str = "job-a", step: int = 7) -> Manifest:
    shards = tuple(ShardInfo(r, 4096 + r, f"xxh3_64:{r:016x}", (JsonEntry("data/pos", 100 + r),), node=r // 2,
                             layout=DIGEST) for r in range(world))
    return Manifest(job, step, world, shards, {"save_index": step}, created=1_700_000_000.0)


def _full_checks_only(obj: dict, monkeypatch: pytest.MonkeyPatch) -> Manifest | ManifestError:
    with monkeypatch.context() as mp:
        mp.setattr(manifest_mod, "_v2_row", lambda s, r: None)
        try:
            return Manifest.from_json(copy.deepcopy(obj))
        except ManifestError as e:
            return e


def _both(obj: dict, monkeypatch: pytest.MonkeyPatch) -> tuple[object, object]:
    try:
        fast: object = Manifest.from_json(copy.deepcopy(obj))
    except ManifestError as e:
        fast = e
    return fast, _full_checks_only(obj, monkeypatch)


#: values near what a row holds, where a check draws its line
near_values = st.integers(min_value=-3, max_value=5) | st.sampled_from([
    DIGEST, DIGEST.upper(), DIGEST[:-1], DIGEST + "0", "", "xxh3_64:00", True, False, None, 1.0, 4096.0, 2**63,
    [], {}, [["a", 1], ["a", 2]], [["a", 1], ["b", 2]], [["a", 1]], [["a"]], [[1, 2]], [["a", 1, 2]], [("a", 1)],
    ["a", 1], [None], "values"])
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
row_fields = st.sampled_from(["rank", "size", "checksum", "layout", "node", "values", "entries", "extra"])


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                    HealthCheck.function_scoped_fixture])
@given(rank=st.integers(min_value=0, max_value=3), field=row_fields, value=near_values | near_values | json_values,
       drop=st.booleans())
def test_a_mutated_shard_row_is_judged_as_the_full_checks_judge_it(monkeypatch, rank, field, value, drop):
    obj = _manifest().to_json()
    row = obj["shards"][rank]
    if drop:
        row.pop(field, None)
    else:
        row[field] = json.loads(json.dumps(value))  # as parsed from bytes (tuples become lists)
    fast, full = _both(obj, monkeypatch)
    if isinstance(full, ManifestError):
        assert isinstance(fast, ManifestError), f"the one-pass check accepted a row the full checks refuse: {row}"
        assert str(fast) == str(full)  # and says the same about it
    else:
        assert fast == full


@pytest.mark.parametrize("field,value", [("size", -1), ("rank", 2), ("rank", True), ("node", -1), ("node", False),
                                         ("layout", DIGEST.upper()), ("checksum", 7), ("values", [["a", 1], ["a", 2]]),
                                         ("values", [["a"]]), ("values", None), ("size", 4096.0)])
def test_each_line_the_full_checks_draw_holds_in_one_pass(monkeypatch, field, value):
    obj = _manifest().to_json()
    obj["shards"][1][field] = value
    fast, full = _both(obj, monkeypatch)
    assert isinstance(full, ManifestError) and isinstance(fast, ManifestError) and str(fast) == str(full)


def test_an_untouched_manifest_is_parsed_the_same_both_ways(monkeypatch):
    obj = _manifest(64).to_json()
    fast, full = _both(obj, monkeypatch)
    assert isinstance(fast, Manifest) and fast == full


def test_bytes_serialised_another_way_are_checked_by_reserialising():
    m = _manifest()
    obj = json.loads(m.to_bytes())
    spaced = json.dumps(obj, indent=1).encode()  # same object, other bytes: the raw-bytes check cannot apply
    assert Manifest.from_bytes(spaced) == m
    obj["shards"][1]["size"] += 1
    with pytest.raises(ManifestError, match="checksum mismatch"):
        Manifest.from_bytes(json.dumps(obj, indent=1).encode())


def test_an_edit_before_an_untouched_checksum_tail_is_refused():
    data = _manifest().to_bytes()
    assert data.endswith(b'"}')
    edited = data.replace(b'"size":4097', b'"size":4098')
    assert edited != data
    with pytest.raises(ManifestError, match="checksum mismatch"):
        Manifest.from_bytes(edited)


@settings(max_examples=200, deadline=None)
@given(job=st.from_regex(r"\A[A-Za-z0-9._-]{1,128}\Z").filter(lambda j: j not in (".", "..")),
       step=st.integers(min_value=0, max_value=10**18 - 1))
def test_peek_reads_what_the_manifest_says(job, step):
    data = _manifest(2, job, step).to_bytes()
    assert peek(data) == (job, step)


@settings(max_examples=300, deadline=None)
@given(pos=st.integers(min_value=0, max_value=200), value=st.integers(min_value=1, max_value=255))
def test_peek_never_names_another_step_than_a_parse(pos, value):
    data = bytearray(_manifest(2, "job-a", 12).to_bytes())
    data[pos % len(data)] ^= value
    hint = peek(bytes(data))
    try:
        m = Manifest.from_bytes(bytes(data))
    except ManifestError:
        return
    assert hint is None or hint == (m.job, m.step)


def test_peek_gives_none_for_what_this_library_did_not_write():
    assert peek(b"{}") is None
    assert peek(json.dumps(_manifest().to_json(), indent=1).encode()) is None


def test_cache_parses_the_same_bytes_once():
    cache = ManifestCache(size=2)
    data = _manifest().to_bytes()
    first = cache.parse(data)
    assert cache.parse(bytearray(data), job="job-a", step=7) is first
    assert (cache.hits, cache.misses) == (1, 1)
    with pytest.raises(ManifestError, match="stored under"):
        cache.parse(data, job="job-b")
    with pytest.raises(ManifestError, match="stored under step 8"):
        cache.parse(data, step=8)


def test_cache_parses_changed_bytes_again_and_refuses_them():
    cache = ManifestCache()
    data = _manifest().to_bytes()
    cache.parse(data)
    with pytest.raises(ManifestError, match="checksum mismatch"):
        cache.parse(data.replace(b'["data/pos",101]', b'["data/pos",109]'))


def test_cache_keeps_the_most_recently_used():
    cache = ManifestCache(size=2)
    a, b, c = (_manifest(step=s).to_bytes() for s in (1, 2, 3))
    ma = cache.parse(a)
    cache.parse(b)
    cache.parse(a)  # a used last: b goes first
    cache.parse(c)
    assert cache.parse(a) is ma
    assert cache.misses == 3
    cache.parse(b)
    assert cache.misses == 4


def test_cache_remembers_what_its_writer_serialised():
    cache = ManifestCache()
    m = _manifest()
    data = m.to_bytes()
    cache.remember(data, m)
    assert cache.parse(data) is m and cache.misses == 0


def test_a_shared_body_is_serialised_once_and_as_any_other():
    body = SharedBody({"manifests": [_manifest(512).to_bytes().decode()], "view": {"epoch": 3, "dead": []}})
    once = body.encoded()
    assert body.encoded() is once
    assert once == encode_body(dict(body))
    assert once[1] == "application/x-tierckpt-deflate"  # large: deflated
