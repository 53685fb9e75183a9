"""Restore integrity: never wrong data, never a silent fresh start, a failed restore changes nothing.

Adversarial: manifests and layouts mutated field by field and byte by byte
(hypothesis) and read by every reader (``Checkpointer.restore``, ``ckpt
verify/show/list/restore``); bytes flipped in a shard and in a manifest in each
tier with intact copies below; S3 down when only S3 holds the step; a
misaligned chunk offset on every read path. Real agents (the Checkpointer's
embedded agent process) and a real S3 server (moto over HTTP).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckpt
from ckpt.cli import main as cli_main
from recovery.fetch import ShardUnavailableError
from recovery.planner import RestoreError, StepNotFoundError
from tiers import keys
from tiers.layout import Layout
from tiers.manifest import Manifest, TensorChunk

JOB = "integrity"


def _state(seed: int) -> dict:
    """A small training state: a model and its optimizer (with a scalar ``step`` tensor), plain tensors and
    JSON values."""
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(3, 4, generator=g)).sum().backward()
    optim.step()
    return {"model": model, "optim": optim,
            "t": {"i": torch.randint(-1000, 1000, (5,), generator=g), "h": torch.randn(3, generator=g).half()},
            "data": {"pos": 123 + seed, "epoch": seed}}


def _snapshot(state: dict) -> dict:
    """Every tensor and value of ``state``, copied (to compare a state before and after)."""
    out = {f"model.{k}": v.detach().clone() for k, v in state["model"].state_dict().items()}
    for pid, s in state["optim"].state_dict()["state"].items():
        for k, v in s.items():
            out[f"optim.{pid}.{k}"] = v.detach().clone() if torch.is_tensor(v) else v
    out.update({f"t.{k}": v.clone() for k, v in state["t"].items()})
    out["data"] = dict(state["data"])
    return out


def _same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if torch.is_tensor(x):
            if not (torch.is_tensor(y) and x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


def _tiers(ck: ckpt.Checkpointer) -> dict:
    return {t.name: t for t in ck.tiers()}


def _flip(data: bytes, at: int) -> bytes:
    b = bytearray(data)
    b[at] ^= 0x40
    return bytes(b)


@contextlib.contextmanager
def _saved(tmp_path, *, disk=True, s3=None, steps=(1, 2), every_tier=True, **kw):
    """A Checkpointer (its own embedded agent) that saved ``_state(step)`` at each of ``steps`` and waited until
    every tier holds them; yields ``(ck, {step: snapshot})``."""
    extra = {}
    if s3 is not None:
        endpoint, bucket = s3
        extra = dict(s3=f"s3://{bucket}/ckpt", s3_endpoint=endpoint)
    ck = ckpt.Checkpointer(JOB, shm=str(tmp_path / "shm"), disk=str(tmp_path / "disk") if disk else None,
                           keep_memory=4, keep_disk=4, keep_s3=4, **extra, **kw)
    try:
        saved = {}
        for step in steps:
            state = _state(step)
            ck.save(step, state).wait()
            saved[step] = _snapshot(state)
        yield ck, saved
    finally:
        ck.close()


def _restore(ck, step=None):
    """Restore into a fresh state (seed 99); return (what restore returned, its snapshot, the state)."""
    state = _state(99)
    got = ck.restore(state, step)
    return got, _snapshot(state)


def _cli(*args: str) -> tuple[int, str]:
    """The ``ckpt`` CLI in this process: (exit status, stdout + stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli_main(list(args))
        except SystemExit as e:  # argparse
            rc = int(e.code or 0)
    return rc, out.getvalue() + err.getvalue()


def _cli_flags(ck) -> list[str]:
    s = ck.settings
    flags = ["--shm", s.shm]
    if s.disk:
        flags += ["--disk", s.disk]
    if s.s3:
        flags += ["--s3", s.s3, "--s3-endpoint", s.s3_endpoint]
    return flags


def _one_line_error(rc: int, text: str) -> None:
    assert rc != 0, text
    assert "Traceback" not in text, text
    errors = [ln for ln in text.splitlines() if ln.startswith("ckpt: error:")]
    assert len(errors) == 1, text


# ---------------------------------------------------------------- manifest and layout mutations (hypothesis)

def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


def _set(obj, path, value):
    obj = json.loads(json.dumps(obj))
    if not path:
        return value
    node = obj
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return obj


def _near(v):
    """Values a damaged field might hold instead of ``v``."""
    base = st.sampled_from([None, True, False, 0, 1, -1, 2, 2**63, 1e300, "", "x", [], {},
                            "xxh3_64:0000000000000000", "../etc", [0], [1, 2]])
    if isinstance(v, bool):
        return base
    if isinstance(v, int):
        return st.one_of(base, st.integers(v - 3, v + 3).filter(lambda x: x != v), st.just(float(v)))
    if isinstance(v, float):
        return st.one_of(base, st.floats(allow_nan=False, allow_infinity=False).filter(lambda x: x != v))
    if isinstance(v, str):
        return st.one_of(base, st.text(max_size=40).filter(lambda x: x != v),
                         st.just(v[:-1] + ("0" if v[-1:] != "0" else "1")))
    return base


@st.composite
def _manifest_mutation(draw, data: bytes):
    """A damaged copy of a manifest's bytes: a raw byte edited, or one field changed (its own checksum kept)."""
    if draw(st.booleans()):
        at = draw(st.integers(0, len(data) - 1))
        new = draw(st.integers(0, 255).filter(lambda b: b != data[at]))
        return data[:at] + bytes([new]) + data[at + 1:], f"byte {at} -> {new}"
    obj = json.loads(data)
    path = draw(st.sampled_from([p for p in _paths(obj) if p]))
    node = obj
    for p in path:
        node = node[p]
    value = draw(_near(node))
    out = json.dumps(_set(obj, path, value), separators=(",", ":")).encode()
    return out, f"{'.'.join(map(str, path))} = {value!r}"


@pytest.fixture(scope="module")
def one_step(tmp_path_factory, moto_server):
    """A Checkpointer holding step 3 in memory, on disk and in S3, for the mutation tests (one agent for all)."""
    import boto3

    d = tmp_path_factory.mktemp("mut")
    bucket = f"mut-{random.getrandbits(40):x}"
    boto3.client("s3", endpoint_url=moto_server, region_name="us-east-1").create_bucket(Bucket=bucket)
    with _saved(d, steps=(3,), s3=(moto_server, bucket)) as (ck, saved):
        yield ck, saved[3], d


def _put_everywhere(ck, key: str, data: bytes | None) -> dict:
    """Put ``data`` under ``key`` in every tier of ``ck`` (None: the bytes given back); the old bytes by tier."""
    old = {}
    for name, tier in _tiers(ck).items():
        old[name] = tier.get(key)
        tier.put(key, data)
    return old


def _readers_agree(ck, want: dict, tmp_path, accepted: bool, what: str, listed: bool = True) -> None:
    """Every reader gives exact data or a clear error; never wrong data, never a fresh start."""
    try:
        got, snap = _restore(ck)
    except (RestoreError, StepNotFoundError) as e:
        assert "\n" not in str(e) and "step 3" in str(e), (what, e)
        assert not accepted, (what, e)
    else:
        assert got == 3, (what, got)  # never None: the step was committed
        assert _same(snap, want), what
    flags = _cli_flags(ck)
    rc, text = _cli("verify", JOB, *flags)
    assert "Traceback" not in text, (what, text)
    assert (rc == 0) == accepted, (what, text)
    # a plain listing reads each tier's step index, written at commit: a manifest damaged since then shows
    # only when the manifests are read (--scan), as verify and restore read them
    rc, text = _cli("list", JOB, *flags)
    assert rc == 0 and "Traceback" not in text, (what, text)
    rc, text = _cli("list", JOB, "--scan", *flags)
    assert rc == 0 and "Traceback" not in text, (what, text)
    row = [ln.split() for ln in text.splitlines() if ln.split()[:1] == ["3"]]
    assert row and (not listed or row[0][-1] == ("yes" if accepted else "no")), (what, text)
    rc, text = _cli("show", JOB, "--step", "3", *flags)
    if accepted:
        assert rc == 0, (what, text)
    else:
        _one_line_error(rc, text)
    out = tmp_path / f"out-{random.getrandbits(32)}"
    rc, text = _cli("restore", JOB, "--step", "3", "--to", str(out), "--format", "torch", *flags)
    if accepted:
        assert rc == 0, (what, text)
        dumped = torch.load(str(out / "checkpoint.pt"), weights_only=True)
        assert dumped["data"]["pos"] == want["data"]["pos"] and torch.equal(dumped["t"]["i"], want["t.i"])
    else:
        _one_line_error(rc, text)


def _every_field_damaged(data: bytes):
    obj = json.loads(data)
    for path in _paths(obj):
        if not path or path == ("checksum",):
            continue
        node = obj
        for p in path:
            node = node[p]
        yield path, next(w for w in (None, "x", -1, 1e300, [], {}) if not (type(w) is type(node) and w == node))
        if isinstance(node, (int, float)) and not isinstance(node, bool):
            yield path, node + 1


def test_every_field_of_a_manifest_changed_is_refused_by_the_parser(one_step):
    """Each field of a real manifest, changed (its own checksum kept as written): always refused."""
    ck, _, _ = one_step
    orig = _tiers(ck)["memory"].get(keys.manifest_key(JOB, 3))
    n = 0
    for path, wrong in _every_field_damaged(orig):
        bad = json.dumps(_set(json.loads(orig), path, wrong), separators=(",", ":")).encode()
        with pytest.raises(ValueError):
            Manifest.from_bytes(bad, job=JOB, step=3)
            pytest.fail(f"{path} = {wrong!r} was accepted")
        n += 1
    assert n > 50


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_mutated_manifest_in_every_tier_gives_exact_data_or_a_clear_error(one_step, data):
    ck, want, tmp = one_step
    key = keys.manifest_key(JOB, 3)
    orig = _tiers(ck)["memory"].get(key)
    bad, what = data.draw(_manifest_mutation(orig))
    try:
        parsed = Manifest.from_bytes(bad, job=JOB, step=3)
    except ValueError:
        accepted = False
    else:
        # a mutation may be accepted only when it changes nothing a reader uses
        assert parsed == Manifest.from_bytes(orig), what
        accepted = True
    _put_everywhere(ck, key, bad)
    try:
        _readers_agree(ck, want, tmp, accepted, what)
    finally:
        _put_everywhere(ck, key, orig)


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_mutated_layout_in_every_tier_gives_exact_data_or_a_clear_error(one_step, data):
    ck, want, tmp = one_step
    m = Manifest.from_bytes(_tiers(ck)["memory"].get(keys.manifest_key(JOB, 3)))
    key = keys.layout_key(JOB, m.shard(0).layout)
    orig = _tiers(ck)["memory"].get(key)
    at = data.draw(st.integers(0, len(orig) - 1))
    bad = _flip(orig, at)
    try:  # the object's digest covers what it says, not how it is stored (Parquet's leading magic is unread)
        accepted = Layout.from_bytes(bad, m.shard(0).layout) is not None
    except ValueError:
        accepted = False
    _put_everywhere(ck, key, bad)
    try:
        # listings read manifests only, never layouts (one per rank): the restorable column cannot see this
        _readers_agree(ck, want, tmp, accepted, f"layout byte {at}", listed=False)
    finally:
        _put_everywhere(ck, key, orig)


def test_sealed_manifest_edited_to_claim_version_1_is_refused(one_step):
    ck, _, _ = one_step
    orig = _tiers(ck)["memory"].get(keys.manifest_key(JOB, 3))
    assert b'"version":2' in orig
    with pytest.raises(ValueError, match="checksum"):
        Manifest.from_bytes(orig.replace(b'"version":2', b'"version":1'))
    # a version-1 manifest is sealed when written, and a field edited in it is refused
    m = Manifest.from_bytes(orig)
    lay = Layout.from_bytes(_tiers(ck)["memory"].get(keys.layout_key(JOB, m.shard(0).layout)))
    import dataclasses

    v1 = dataclasses.replace(m, shards=(dataclasses.replace(m.shard(0), layout="",
                                                            entries=lay.chunks + m.shard(0).entries),), version=0)
    raw = v1.to_bytes()
    assert Manifest.from_bytes(raw) == v1
    pos = json.loads(raw)["shards"][0]["entries"]
    edited = raw.replace(json.dumps(pos[-1], separators=(",", ":")).encode(),
                         json.dumps({**pos[-1], "value": 124}, separators=(",", ":")).encode())
    assert edited != raw
    with pytest.raises(ValueError, match="checksum"):
        Manifest.from_bytes(edited)


# ---------------------------------------------------------------- damaged copies in each tier

ORDER = ["memory", "disk", "s3"]


@pytest.mark.parametrize("what", ["shard", "manifest"])
@pytest.mark.parametrize("lowest_damaged", ["memory", "disk"])
def test_damaged_copy_falls_back_to_the_same_step_in_the_intact_tier_below(tmp_path, s3_bucket, what,
                                                                            lowest_damaged):
    """A byte flipped in the newest step's shard (or manifest) in every tier down to ``lowest_damaged``: the
    newest step is restored, exactly, from the first intact tier below (S3 included)."""
    with _saved(tmp_path, s3=s3_bucket) as (ck, saved):
        tiers = _tiers(ck)
        key = keys.shard_key(JOB, 2, 0) if what == "shard" else keys.manifest_key(JOB, 2)
        damaged = ORDER[:ORDER.index(lowest_damaged) + 1]
        for name in damaged:
            data = tiers[name].get(key)
            tiers[name].put(key, _flip(data, len(data) // 2))
        got, snap = _restore(ck)
        assert got == 2
        assert _same(snap, saved[2])
        if what == "shard":  # a damaged manifest costs only the manifest: the shards above are intact
            assert ck.last_restore.shards[0].tier == ORDER[len(damaged)], ck.last_restore
        assert not ck.last_restore.passed_over


def test_another_valid_manifest_in_the_cheapest_tier_does_not_hide_the_intact_copy_below(tmp_path, s3_bucket):
    """Memory holds a manifest of step 2 that parses (another save's: other shard checksums); disk and S3 hold
    the one the shards were saved with. The restore tries the next tier's manifest and restores step 2."""
    import dataclasses

    with _saved(tmp_path, s3=s3_bucket) as (ck, saved):
        mem = _tiers(ck)["memory"]
        m = Manifest.from_bytes(mem.get(keys.manifest_key(JOB, 2)))
        other = dataclasses.replace(m, shards=(dataclasses.replace(m.shard(0), checksum="xxh3_64:" + "0" * 16),))
        mem.put(keys.manifest_key(JOB, 2), other.to_bytes())
        got, snap = _restore(ck)
        assert got == 2 and _same(snap, saved[2])
        assert not ck.last_restore.passed_over


def test_newest_step_damaged_everywhere_falls_back_to_the_older_one_with_a_warning(tmp_path, s3_bucket, caplog):
    with _saved(tmp_path, s3=s3_bucket) as (ck, saved):
        key = keys.shard_key(JOB, 2, 0)
        for name, tier in _tiers(ck).items():
            data = tier.get(key)
            tier.put(key, _flip(data, 0))
        with caplog.at_level(logging.WARNING, logger="tierckpt"):
            got, snap = _restore(ck)
        assert got == 1 and _same(snap, saved[1])
        assert 2 in ck.last_restore.passed_over
        assert any("newer step(s) 2" in r.getMessage() for r in caplog.records)
        # asked for by number, the damaged step is an error naming it and every tier tried, never None
        with pytest.raises(RestoreError, match=r"step 2 .*memory.*disk.*s3"):
            _restore(ck, 2)


def test_damaged_manifest_in_every_tier_is_an_error_not_a_fresh_start(tmp_path):
    with _saved(tmp_path, steps=(1,)) as (ck, _):
        key = keys.manifest_key(JOB, 1)
        for tier in _tiers(ck).values():
            data = tier.get(key)
            tier.put(key, data.replace(b'"world":1', b'"world":2'))
        with pytest.raises(RestoreError, match=r"step 1 .*checksum"):
            _restore(ck)


def test_s3_down_at_restore_when_only_s3_holds_the_step_is_an_error(tmp_path, s3_proxy):
    bucket = f"b{random.getrandbits(40):x}"
    import boto3

    boto3.client("s3", endpoint_url=s3_proxy.url, region_name="us-east-1").create_bucket(Bucket=bucket)
    with _saved(tmp_path / "a", disk=False, s3=(s3_proxy.url, bucket), steps=(1,)):
        pass
    s3_proxy.down()
    # a new node: nothing in its memory, no disk; S3 holds the step and cannot be reached
    with ckpt.Checkpointer(JOB, shm=str(tmp_path / "b" / "shm"), s3=f"s3://{bucket}/ckpt",
                           s3_endpoint=s3_proxy.url) as ck:
        ck.settings.s3_retry_deadline = 2.0
        with pytest.raises(RestoreError, match="s3.*unreachable|unreachable.*s3|s3 .*:"):
            ck.restore(_state(99))
        s3_proxy.up()
        got, snap = _restore(ck)
        assert got == 1


def test_failed_restore_leaves_the_tensors_untouched(tmp_path):
    with _saved(tmp_path, steps=(1,)) as (ck, _):
        key = keys.shard_key(JOB, 1, 0)
        for tier in _tiers(ck).values():
            data = tier.get(key)
            tier.put(key, _flip(data, len(data) - 1))  # the last byte: every tensor before it is read first
        state = _state(7)
        before = _snapshot(state)
        with pytest.raises(RestoreError, match="step 1"):
            ck.restore(state)
        assert _same(_snapshot(state), before)


def test_keep_state_false_skips_the_copy_and_still_fails_clearly(tmp_path):
    """The failure is a RestoreError naming the step, never None or wrong data kept. Memory and disk are local
    files, verified before a byte is copied in, so the state is left as it was even without the copy."""
    with _saved(tmp_path, steps=(1,)) as (ck, _):
        key = keys.shard_key(JOB, 1, 0)
        for tier in _tiers(ck).values():
            data = tier.get(key)
            tier.put(key, _flip(data, len(data) - 1))
        state = _state(7)
        before = _snapshot(state)
        with pytest.raises(RestoreError, match="step 1"):
            ck.restore(state, keep_state=False)
        assert _same(_snapshot(state), before)


@pytest.mark.parametrize("damaged", [(), ("memory",), ("memory", "disk")])
def test_a_restore_from_local_files_never_copies_the_state_to_put_it_back(tmp_path, monkeypatch, damaged):
    """Memory and disk shards are hashed before anything is written, so the restore takes no copy of the
    state's tensors (Kept.take), whether it succeeds from the first place, from the next one, or fails; and a
    failed one leaves the state as it was."""
    from ckpt import _load

    taken = []
    monkeypatch.setattr(_load.Kept, "take", lambda self: taken.append(1))
    with _saved(tmp_path, steps=(1,)) as (ck, saved):
        key = keys.shard_key(JOB, 1, 0)
        tiers = _tiers(ck)
        for name in damaged:
            data = tiers[name].get(key)
            tiers[name].put(key, _flip(data, len(data) // 2))
        state = _state(7)
        before = _snapshot(state)
        if len(damaged) == len(tiers):
            with pytest.raises(RestoreError, match="step 1"):
                ck.restore(state)
            assert _same(_snapshot(state), before)
        else:
            assert ck.restore(state) == 1
            assert ck.last_restore.tiers == ["disk" if damaged else "memory"]
            assert _same(_snapshot(state), saved[1])
    assert taken == []


class _Ranged:
    """A place that reads byte ranges into the caller's buffers and has no local file (a peer's shape), over a
    memory tier's bytes; ``damage`` flips a byte of what it sends."""

    name = "peer"

    def __init__(self, tier, damage: int | None = None) -> None:
        self.tier, self.damage, self.reads = tier, damage, 0

    def describe(self) -> str:
        return "ranged test place"

    def read_ranges(self, key: str, pieces) -> int:
        self.reads += 1
        at = pieces[0][0]
        n = sum(len(v) for _, v in pieces)
        data = bytearray(self.tier.get(key, at, n))
        if self.damage is not None and at <= self.damage < at + n:
            data[self.damage - at] ^= 0x40
        for off, v in pieces:
            v[:] = data[off - at: off - at + len(v)]
        return n


@pytest.mark.parametrize("damaged", [False, True])
def test_a_ranged_read_through_a_staging_buffer_writes_nothing_before_it_is_verified(tmp_path, damaged):
    """A peer's ranged reads go to the staging buffer the caller gives (the next save's slot), hashed as
    they land, and reach the tensors only at finish: the tensors are untouched after prepare, a damaged copy
    is refused with nothing written, and no copy of the state is asked for (``before_write`` never runs)."""
    from recovery import plan_restore, scan_tiers

    with _saved(tmp_path, steps=(1,), disk=False) as (ck, saved):
        mem = _tiers(ck)["memory"]
        size = len(mem.get(keys.shard_key(JOB, 1, 0)))
        plan = plan_restore(scan_tiers([mem], JOB), JOB)
        place = _Ranged(mem, damage=size - 1 if damaged else None)
        plan.sources[0] = [place]
        state = _state(7)
        before = _snapshot(state)
        kept, staged = [], []

        def stage(n: int) -> memoryview:
            staged.append(bytearray(n))
            return memoryview(staged[-1])

        if damaged:
            with pytest.raises(ShardUnavailableError, match="checksum"):
                ck._loader.prepare(plan, state, lambda: kept.append(1), stage=stage)
        else:
            prepared = ck._loader.prepare(plan, state, lambda: kept.append(1), stage=stage)
            assert _same(_snapshot(state), before)  # read and verified, nothing applied yet
            assert bytes(staged[0]) == mem.get(keys.shard_key(JOB, 1, 0))
            prepared.finish()
            assert _same(_snapshot(state), saved[1])
        assert place.reads >= 1 and len(staged) == 1 and kept == []
        if damaged:
            assert _same(_snapshot(state), before)


def test_a_shard_rewritten_between_its_check_and_its_copy_fails_the_restore(tmp_path):
    """A local shard is verified, then copied into the tensors at finish. A shard whose file is written in
    between (no agent does so to a committed step) must not be loaded as if verified: finish raises."""
    from recovery import plan_restore, scan_tiers

    with _saved(tmp_path, steps=(1,)) as (ck, saved):
        memory = _tiers(ck)["memory"]
        plan = plan_restore(scan_tiers([memory], JOB), JOB, 1)
        state = _state(7)
        prepared = ck._loader.prepare(plan, state)
        before = _snapshot(state)
        assert _same(before, _snapshot(_state(7)))  # prepared: verified, nothing written yet
        path = memory.local_file(keys.shard_key(JOB, 1, 0))
        with open(path, "r+b") as f:  # the same inode, other bytes
            first = f.read(1)
            f.seek(0)
            f.write(bytes([first[0] ^ 1]))
        with pytest.raises(ShardUnavailableError, match="changed while"):
            prepared.finish()
        # and an unchanged file loads the step, bit-exact
        with open(path, "r+b") as f:
            f.write(first)
        state = _state(7)
        assert ck.restore(state) == 1 and _same(_snapshot(state), saved[1])


# ---------------------------------------------------------------- misaligned offsets, absurd shapes

def _rewrite_layout(ck, step: int, change) -> None:
    """Give ``step`` a layout changed by ``change(chunks) -> chunks`` in every tier (as a buggy writer would:
    the layout under its own digest, the manifest sealed again over it)."""
    import dataclasses

    tiers = _tiers(ck)
    m = Manifest.from_bytes(tiers["memory"].get(keys.manifest_key(JOB, step)))
    lay = Layout.from_bytes(tiers["memory"].get(keys.layout_key(JOB, m.shard(0).layout)))
    new = Layout(tuple(change(list(lay.chunks))))
    m2 = dataclasses.replace(m, shards=(dataclasses.replace(m.shard(0), layout=new.digest),))
    for tier in tiers.values():
        tier.put(keys.layout_key(JOB, new.digest), new.to_bytes())
        tier.put(keys.manifest_key(JOB, step), m2.to_bytes())


def _misalign(chunks: list[TensorChunk]) -> list[TensorChunk]:
    import dataclasses

    # the optimizer's scalar ``step`` (float32, 4 bytes) moved 2 bytes on: inside the alignment padding
    i = next(i for i, c in enumerate(chunks) if c.name.endswith("/step"))
    chunks[i] = dataclasses.replace(chunks[i], offset=chunks[i].offset + 2)
    return chunks


@pytest.mark.parametrize("path", ["memory", "disk", "s3"])
def test_misaligned_offset_is_a_clear_error_on_every_path(tmp_path, s3_bucket, path):
    with _saved(tmp_path, s3=s3_bucket, steps=(1,)) as (ck, _):
        _rewrite_layout(ck, 1, _misalign)
        tiers = _tiers(ck)
        for name in ORDER[:ORDER.index(path)]:  # the tiers above are gone: the read goes through ``path``
            for k in tiers[name].list(keys.job_prefix(JOB)):
                tiers[name].delete(k)
        state = _state(5)
        before = _snapshot(state)
        with pytest.raises(RestoreError, match="not a multiple"):
            ck.restore(state)
        assert _same(_snapshot(state), before)
        flags = _cli_flags(ck)
        for cmd in (["show", JOB], ["restore", JOB, "--to", str(tmp_path / "out")]):
            rc, text = _cli(*cmd, *flags)
            _one_line_error(rc, text)
            assert "not a multiple" in text


def test_huge_global_shape_is_a_one_line_error_in_ckpt_restore(tmp_path):
    import dataclasses

    with _saved(tmp_path, steps=(1,)) as (ck, _):
        def huge(chunks):
            i = next(i for i, c in enumerate(chunks) if c.name == "t/i")
            c = chunks[i]
            chunks[i] = dataclasses.replace(c, global_shape=(2**45,), offsets=(0,), shape=c.shape)
            return chunks

        _rewrite_layout(ck, 1, huge)
        rc, text = _cli("restore", JOB, "--to", str(tmp_path / "out"), *_cli_flags(ck))
        _one_line_error(rc, text)
        assert "t/i" in text


def test_created_out_of_range_is_a_one_line_error_in_ckpt_show(one_step):
    ck, _, _ = one_step
    key = keys.manifest_key(JOB, 3)
    orig = _tiers(ck)["memory"].get(key)
    obj = json.loads(orig)
    obj.pop("checksum")
    body = json.dumps(obj, separators=(",", ":")).replace('"created":' + json.dumps(obj["created"]),
                                                          '"created":1e400').encode()
    from tiers import _sealed

    _put_everywhere(ck, key, _sealed.seal(body)[0])
    try:
        rc, text = _cli("show", JOB, "--step", "3", *_cli_flags(ck))
        _one_line_error(rc, text)
    finally:
        _put_everywhere(ck, key, orig)


def test_agent_memory_full_reaches_the_user_as_checkpoint_error(tmp_path):
    with ckpt.Checkpointer(JOB, shm=str(tmp_path / "shm")) as ck:
        # 4 TiB of logical bytes over a 4-byte storage: more than the memory folder can hold
        state = {"big": torch.zeros(1).expand(1 << 40)}
        with pytest.raises(ckpt.CheckpointError, match="agent"):
            ck.save(1, state)
