"""The restore engine on its own, without torch: real memory and disk folders, a loader that reads shards into
bytes, and ranks played by threads that agree through a barrier."""

from __future__ import annotations

import os
import threading

import pytest

from recovery import CostModel, scan_tiers
from recovery.fetch import fetch_shard
from recovery.planner import RestoreError, StepNotFoundError
from recovery.restorer import Restorer
from steps import commit_steps
from tiers import keys
from tiers.disk import DiskTier
from tiers.errors import TierError
from tiers.memory import MemoryTier

JOB = "restorer-job"


def _shard(step: int, rank: int) -> bytes:
    """The bytes :func:`steps.commit_steps` writes for ``rank``'s shard of ``step`` (64 bytes)."""
    return bytes([step % 251, rank]) * 32


class _Prepared:
    def __init__(self, reports, apply) -> None:
        self.reports = reports
        self._apply = apply
        self.released = False

    def finish(self) -> None:
        apply, self._apply = self._apply, None
        if apply is not None:
            apply()
        self.release()

    def release(self) -> None:
        self._apply = None
        self.released = True


class _Loader:
    """Reads this rank's shard into bytes, verified; ``applied`` is (step, bytes) once a step is finished."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self.read: list[int] = []
        self.prepared: list[_Prepared] = []
        self.applied: tuple[int, bytes] | None = None

    def prepare(self, plan):
        self.read.append(plan.step)
        buf = bytearray(plan.manifest.shard(self.rank).size)
        report = fetch_shard(plan, self.rank, memoryview(buf))
        p = _Prepared([report], lambda: setattr(self, "applied", (plan.step, bytes(buf))))
        self.prepared.append(p)
        return p

    def prepare_resharded(self, plan):
        raise AssertionError("the same world size is never resharded")


class _Unlistable(DiskTier):
    """A disk folder that cannot be listed (a mount gone away)."""

    def list(self, prefix: str = ""):
        raise TierError("the folder is not mounted")


def _near(*tiers):
    return lambda: scan_tiers(list(tiers), JOB)


class _ThreadMin:
    """MIN over ``n`` ranks played by threads, as the all-reduce the trainer's ranks take."""

    def __init__(self, n: int) -> None:
        self.barrier = threading.Barrier(n, timeout=20)
        self.values: dict[int, int] = {}

    def of(self, rank: int):
        def agree(value: int) -> int:
            self.values[rank] = value
            self.barrier.wait()
            out = min(self.values.values())
            self.barrier.wait()  # every rank has read this round's values before the next round writes
            return out
        return agree


def test_a_fresh_start_returns_none_and_reads_nothing(tmp_path):
    loader = _Loader()
    r = Restorer(JOB, near=_near(MemoryTier(tmp_path / "mem"), DiskTier(tmp_path / "disk")))
    assert r.restore(loader) is None
    assert loader.read == [] and loader.applied is None


def test_a_damaged_newest_step_falls_back_to_the_older_one_and_says_it_passed_it_over(tmp_path):
    mem = MemoryTier(tmp_path / "mem")
    commit_steps(mem, JOB, [1, 2], world=1)
    mem.put(keys.shard_key(JOB, 2, 0), b"\xff" * 64)  # same size, wrong checksum
    loader = _Loader()
    done = Restorer(JOB, near=_near(mem)).restore(loader)
    assert done.step == 1 and loader.applied == (1, _shard(1, 0))
    assert loader.read == [2, 1] and all(p.released for p in loader.prepared)
    assert list(done.passed_over) == [2] and "could not be read intact" in done.passed_over[2]
    assert [s.tier for s in done.shards] == ["memory"] and done.unreachable == []


def test_a_step_one_rank_cannot_reach_makes_every_rank_restore_the_older_one(tmp_path):
    # rank 0's node holds its shard of steps 1 and 2, rank 1's node only of step 1
    places = [MemoryTier(tmp_path / "node0"), MemoryTier(tmp_path / "node1")]
    commit_steps(places[0], JOB, [1, 2], world=2, held=[0])
    commit_steps(places[1], JOB, [1], world=2, held=[1])
    agree = _ThreadMin(2)
    loaders = [_Loader(0), _Loader(1)]
    got: dict[int, object] = {}

    def rank(r: int) -> None:
        try:
            got[r] = Restorer(JOB, r, 2, near=_near(places[r]), agree=agree.of(r)).restore(loaders[r])
        except BaseException as e:  # noqa: BLE001 - the test thread hands it to the test
            got[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert [got[r].step for r in (0, 1)] == [1, 1], got
    assert [ld.applied for ld in loaders] == [(1, _shard(1, 0)), (1, _shard(1, 1))]
    assert loaders[0].read == [1]  # agreed before any read: step 2 is never read
    assert 2 in got[0].passed_over


def test_an_unreachable_tier_is_an_error_not_a_fresh_start(tmp_path):
    r = Restorer(JOB, near=_near(MemoryTier(tmp_path / "mem"), _Unlistable(tmp_path / "disk")))
    with pytest.raises(RestoreError, match="no step could be looked for in every tier.*not mounted"):
        r.restore(_Loader())


def test_a_missing_step_asked_for_is_step_not_found_not_a_restore_error(tmp_path):
    mem = MemoryTier(tmp_path / "mem")
    commit_steps(mem, JOB, [1], world=1)
    with pytest.raises(StepNotFoundError, match="step 5 .* is not complete in any tier") as e:
        Restorer(JOB, near=_near(mem)).restore(_Loader(), step=5)
    assert not isinstance(e.value, RestoreError)


def test_s3_is_listed_only_when_needed_and_serves_a_step_damaged_near_before_an_older_one(tmp_path):
    mem, far = MemoryTier(tmp_path / "mem"), DiskTier(tmp_path / "s3")
    commit_steps(mem, JOB, [1, 2], world=1)
    commit_steps(far, JOB, [1, 2], world=1)
    listed: list[int] = []

    def far_scan():
        listed.append(1)
        return scan_tiers([far], JOB)

    # the newest step near, and no sign of a newer one: the far tier is not listed
    done = Restorer(JOB, near=_near(mem), far=far_scan, far_may_be_newer=lambda newest: False).restore(_Loader())
    assert done.step == 2 and listed == []
    # damaged near: the same step from the far tier, not step 1
    mem.put(keys.shard_key(JOB, 2, 0), b"\xff" * 64)
    loader = _Loader()
    done = Restorer(JOB, near=_near(mem), far=far_scan, far_may_be_newer=lambda newest: False).restore(loader)
    assert done.step == 2 and listed == [1] and loader.applied == (2, _shard(2, 0))
    assert [s.source for s in done.shards] == [str(far.describe())] and not done.passed_over


def test_each_read_is_learned_and_the_step_rewound_before_it(tmp_path):
    mem = MemoryTier(tmp_path / "mem")
    commit_steps(mem, JOB, [3], world=1)
    path = str(tmp_path / "costs.json")
    model = CostModel()
    rewound: list[int] = []
    done = Restorer(JOB, near=_near(mem), costs=lambda invs: (model, path),
                    before_read=rewound.append).restore(_Loader())
    assert done.step == 3 and rewound == [3]
    assert os.path.exists(path) and model.sources


def test_agree_step_gives_the_newest_step_every_rank_holds_and_lists_s3_for_a_newer_one_only_unasked(tmp_path):
    mem, far = MemoryTier(tmp_path / "mem"), DiskTier(tmp_path / "s3")
    commit_steps(mem, JOB, [1, 2], world=1)
    commit_steps(far, JOB, [3], world=1)
    listed: list[int] = []

    def far_scan():
        listed.append(1)
        return scan_tiers([far], JOB)

    def chooser(agree=lambda v: v):
        return Restorer(JOB, near=_near(mem), far=far_scan, far_may_be_newer=lambda newest: newest < 3,
                        agree=agree, replicas=False)

    assert chooser().agree_step(2) == 2 and listed == []  # asked for a step near: no newer one looked for
    r = chooser()
    assert r.agree_step() == 3 and listed == [1] and not r.far_unlisted
    assert chooser(agree=lambda v: min(v, 1)).agree_step() == 1  # another rank holds only step 1
    assert chooser().agree_step(7) == -1
