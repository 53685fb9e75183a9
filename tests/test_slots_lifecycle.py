"""Staging slots and the memory tier over a job's life: leased and faulted in ahead, one agent's settings per
memory folder, freed at a clean end, and saves that ``every`` skips or ``force`` takes."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import pytest
import torch
from hypothesis import given, settings as hsettings, strategies as st

import ckpt
from agents.config import Settings, SettingsConflictError, setting_conflicts
from agents.launch import spawn_agent, wait_stopped
from agents.protocol import AgentClient
from procs import TRAINER, agent_call, env, kill9, start_agent
from tiers import keys
from tiers.disk import DiskTier
from tiers.memory import MemoryTier


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 64, generator=g)).sum().backward()
    optim.step()
    return {"model": model, "optim": optim, "pos": {"i": seed}}


def _train(state: dict) -> None:
    state["model"](torch.randn(4, 64)).sum().backward()
    state["optim"].step()
    state["optim"].zero_grad()


def _until(cond, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.02)


def _ready(path: str, nbytes: int) -> bool:
    st = os.stat(path)
    return st.st_size == nbytes and st.st_blocks * 512 >= nbytes


def _steps(tier, job: str) -> set[int]:
    return {keys.parse_key(k).step for k in tier.list(f"{job}/") if k.endswith("manifest.json")}


# ---------------------------------------------------------------------------------------- slots ahead
def test_after_the_first_save_the_ring_is_faulted_in_and_the_next_slot_leased_and_mapped(tmp_path):
    shm = str(tmp_path / "shm")
    state = _state()
    with ckpt.Checkpointer("ring", shm=shm, keep_memory=2) as ck:
        ring = ck.settings.keep_memory + 2
        folder = MemoryTier(shm).slot_dir("ring", 0)
        fut = ck.save(0, state)
        fut.wait()
        nbytes = os.path.getsize(os.path.join(folder, "slot-0"))
        # the agent sizes and faults in the whole ring in the background after the first lease
        _until(lambda: len(os.listdir(folder)) == ring
               and all(_ready(os.path.join(folder, n), nbytes) for n in os.listdir(folder)),
               f"{ring} faulted slots of {nbytes} bytes in {folder}")
        for step in range(1, 3 * ring):
            _train(state)
            # the next save's slot was leased and mapped off the training thread when the last one committed
            ck._prelease_fut.result(timeout=60)
            nxt = ck._next_slot
            assert nxt is not None and nxt[1] == nbytes
            assert ck._maps[nxt[0]][0] == nbytes
            ck.save(step, state).wait()
            assert len(os.listdir(folder)) == ring  # never more slots than the ring
        # every slot of the ring is mapped by now, each once
        assert sorted(os.path.basename(p) for p in ck._maps) == sorted(os.listdir(folder))


def test_restore_leases_and_maps_the_slot_of_the_first_save(tmp_path):
    shm, disk = str(tmp_path / "shm"), str(tmp_path / "disk")
    saved = _state(1)
    with ckpt.Checkpointer("rs", shm=shm, disk=disk) as ck:
        ck.save(4, saved).wait()
        nbytes = os.path.getsize(os.path.join(MemoryTier(shm).slot_dir("rs", 0), "slot-0"))
    state = _state(2)
    with ckpt.Checkpointer("rs", shm=shm, disk=disk) as ck:
        assert ck.restore(state) == 4
        ck._prelease_fut.result(timeout=60)
        slot, n = ck._next_slot
        assert n == nbytes and ck._maps[slot][0] == nbytes
        ck.save(5, state).wait()
        assert os.path.exists(MemoryTier(shm).path(keys.shard_key("rs", 5, 0)))
        assert os.path.samefile(MemoryTier(shm).path(keys.shard_key("rs", 5, 0)), slot)  # the save staged there


def test_a_fresh_starts_restore_leases_and_maps_the_slot_its_first_save_stages_into(tmp_path):
    shm = str(tmp_path / "shm")
    state = _state(3)
    with ckpt.Checkpointer("fresh", shm=shm) as ck:
        assert ck.restore(state) is None
        ck._prelease_fut.result(timeout=60)
        slot, n = ck._next_slot
        assert ck._maps[slot][0] == n
        ck.save(0, state).wait()
        shard = MemoryTier(shm).path(keys.shard_key("fresh", 0, 0))
        assert os.path.getsize(shard) == n and os.path.samefile(shard, slot)  # the first save staged there


def test_a_first_save_whose_values_grew_since_the_restore_stages_into_the_slot_leased_there(tmp_path):
    # torchtitan's lr schedulers' state is longer after the first step than at the restore before it
    shm = str(tmp_path / "shm")
    state = _state(3)
    state["sched"] = {"last": [0.1]}
    with ckpt.Checkpointer("grown", shm=shm) as ck:
        assert ck.restore(state) is None
        ck._prelease_fut.result(timeout=60)
        slot, n = ck._next_slot
        state["sched"] = {"last": [0.1] * 5000}  # its values now spill into the shard: the shard grows
        ck.save(0, state).wait()
        shard = MemoryTier(shm).path(keys.shard_key("grown", 0, 0))
        assert os.path.getsize(shard) != n and os.path.samefile(shard, slot)
    got = _state(4)
    got["sched"] = {"last": []}
    with ckpt.Checkpointer("grown", shm=shm) as ck:
        assert ck.restore(got) == 0
    assert got["sched"]["last"] == [0.1] * 5000


def test_a_slot_file_made_again_is_mapped_again(tmp_path):
    """A slot removed and created again under the same name (``ckpt gc`` drops free slots) is a new file: a
    mapping of the old one would stage into memory nobody reads, and the step would commit zeros."""
    with ckpt.Checkpointer("remap", shm=str(tmp_path / "shm")) as ck:
        slot = str(tmp_path / "shm" / "slot-x")
        with open(slot, "wb") as f:
            f.write(bytes(4096))
        ck._map(slot, 4096)
        os.unlink(slot)
        with open(slot, "wb") as f:
            f.write(bytes(4096))
        ck._map(slot, 4096)[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
        with open(slot, "rb") as f:
            assert f.read(4) == bytes([1, 2, 3, 4])


# ---------------------------------------------------------------------------------------- settings
def test_a_setting_the_running_node_agent_has_otherwise_is_refused(tmp_path):
    shm = str(tmp_path / "shm")
    agent = start_agent(shm, "--disk", str(tmp_path / "d1"), "--keep-memory", "3")
    try:
        with pytest.raises(SettingsConflictError) as e:
            ckpt.Checkpointer("cf", shm=shm, disk=str(tmp_path / "d2"), keep_memory=3, spawn=False)
        msg = str(e.value)
        assert "\n" not in msg and "disk=" in msg and "d1" in msg and "d2" in msg and "keep_memory" not in msg
        assert isinstance(e.value, ValueError)
        # the same values, or none, are fine: what the job did not give is the agent's
        with ckpt.Checkpointer("cf", shm=shm, disk=str(tmp_path / "d1") + "/", spawn=False) as ck:
            assert ck.settings.keep_memory == 3
        with ckpt.Checkpointer("cf", shm=shm, spawn=False) as ck:
            assert ck.settings.disk == str(tmp_path / "d1")
        assert agent.poll() is None  # a node agent is never stopped by a job
    finally:
        kill9(agent)


def test_an_idle_embedded_agent_makes_way_for_a_job_with_other_settings(tmp_path):
    shm = str(tmp_path / "shm")
    left = spawn_agent(Settings.load({"shm": shm, "disk": str(tmp_path / "d1")}, env={}), idle_exit=300)
    try:
        with ckpt.Checkpointer("mine", shm=shm, disk=str(tmp_path / "d2")) as ck:
            assert ck.settings.disk == str(tmp_path / "d2")
            ck.save(0, _state()).wait()
        assert left.wait(60) == 0
        assert _steps(DiskTier(str(tmp_path / "d2")), "mine") == {0}
    finally:
        if left.poll() is None:
            kill9(left)


def test_a_job_closing_the_agent_it_started_leaves_it_to_another_job_using_it(tmp_path):
    shm, disk = str(tmp_path / "shm"), str(tmp_path / "disk")
    first = ckpt.Checkpointer("first", shm=shm, disk=disk)
    second = ckpt.Checkpointer("second", shm=shm)  # no settings of its own: the running agent's
    try:
        assert first._started_agent and not second._started_agent
        first.save(0, _state()).wait()
        first.close()
        # the agent the first job started still serves the second
        state = _state(3)
        second.save(0, state).wait()
        assert _steps(DiskTier(disk), "second") == {0}
    finally:
        first.close()
        second.close()
    # neither job stops it now (the second did not start it): it would exit once idle
    agent_call(shm, "shutdown")
    assert wait_stopped(Settings(shm=shm), 60)


_VALUES = {"disk": st.sampled_from([None, "/nvme/a", "/nvme/b", "/nvme/a/"]),
           "s3": st.sampled_from([None, "s3://b/p", "s3://b/p/", "s3://b/q"]),
           "disk_every": st.integers(1, 3), "keep_memory": st.integers(1, 3), "compress": st.booleans(),
           "keep_memory_after_close": st.booleans(), "slot_wait": st.sampled_from([1.0, 300.0])}


def _norm(name: str, v):
    return v.rstrip("/") if isinstance(v, str) else v


@hsettings(max_examples=200, deadline=None)
@given(st.fixed_dictionaries({}, optional=_VALUES), st.fixed_dictionaries(_VALUES))
def test_conflicts_name_exactly_the_given_settings_the_agent_has_otherwise(mine, theirs):
    agent = Settings(**theirs)
    differ = setting_conflicts(mine, agent)
    expected = sorted(n for n, v in mine.items() if _norm(n, v) != _norm(n, theirs[n]))
    assert sorted(d.split("=", 1)[0] for d in differ) == expected
    for d in differ:
        assert "(the agent: " in d
    # how the agent was reached is never a conflict
    assert setting_conflicts({**mine, "socket": "/tmp/x.sock"}, agent) == differ


# ---------------------------------------------------------------------------------------- the end of a job
def test_a_clean_end_frees_the_memory_tier_once_disk_holds_the_newest_step(tmp_path, caplog):
    shm, disk = str(tmp_path / "shm"), str(tmp_path / "disk")
    state = _state()
    caplog.set_level(logging.INFO, logger="tierckpt")
    with ckpt.Checkpointer("end", shm=shm, disk=disk) as ck:
        for step in range(3):
            _train(state)
            ck.save(step, state)
    mem = MemoryTier(shm)
    assert _steps(mem, "end") == set() and mem.list("end/") == []
    assert not os.path.exists(os.path.join(shm, ".slots", "end"))
    assert 2 in _steps(DiskTier(disk), "end")
    assert any("freed end's memory tier" in r.getMessage() for r in caplog.records)
    target = _state(9)
    with ckpt.Checkpointer("end", shm=shm, disk=disk) as ck:
        assert ck.restore(target) == 2
        assert ck.last_restore.tiers == ["disk"]
    for a, b in zip(state["model"].parameters(), target["model"].parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("how", ["memory only", "newest step not on disk", "keep_memory_after_close"])
def test_the_memory_tier_stays_when_it_may_hold_the_only_copy_or_is_asked_to(tmp_path, caplog, how):
    shm, disk = str(tmp_path / "shm"), str(tmp_path / "disk")
    kw = {"memory only": {}, "newest step not on disk": {"disk": disk, "disk_every": 2},
          "keep_memory_after_close": {"disk": disk, "keep_memory_after_close": True}}[how]
    caplog.set_level(logging.INFO, logger="tierckpt")
    with ckpt.Checkpointer("stay", shm=shm, **kw) as ck:
        for step in range(2):
            ck.save(step, _state(step))
    assert _steps(MemoryTier(shm), "stay") == {0, 1}
    if how != "keep_memory_after_close":
        # the slots no kept step links to hold nothing: they are freed
        folder = MemoryTier(shm).slot_dir("stay", 0)
        assert sorted(os.stat(os.path.join(folder, n)).st_nlink for n in os.listdir(folder)) == [2, 2]
    said = [r.getMessage() for r in caplog.records if "memory tier stays" in r.getMessage()]
    assert said and {"memory only": "memory is its only tier", "newest step not on disk": "newest step 1 is only",
                     "keep_memory_after_close": "keep_memory_after_close"}[how] in said[0]


def test_a_close_after_a_failure_frees_nothing(tmp_path):
    shm = str(tmp_path / "shm")
    with pytest.raises(RuntimeError):
        with ckpt.Checkpointer("fail", shm=shm, disk=str(tmp_path / "disk")) as ck:
            ck.save(0, _state()).wait()
            ck._errors.append("a background failure")  # as a failed drain reports it
            ck.close()
    assert _steps(MemoryTier(shm), "fail") == {0}


# ---------------------------------------------------------------------------------------- every and force
def test_force_saves_a_step_every_skips_writes_it_to_every_tier_and_keeps_the_numbering(tmp_path, caplog):
    shm, disk = str(tmp_path / "shm"), str(tmp_path / "disk")
    state = _state()
    caplog.set_level(logging.INFO, logger="tierckpt")
    with ckpt.Checkpointer("force", shm=shm, disk=disk, every=10, disk_every=2, keep_disk=10) as ck:
        for step in range(14):
            _train(state)
            fut = ck.save(step, state)
            assert (fut is not None) == (step % 10 == 0)
        fut = ck.save(13, state, force=True)  # a final save: taken, and written to disk though 13 // 10 == 1
        assert fut is not None
        fut.wait()
        for step in (20, 30, 40):  # saves 2, 3, 4: disk every 2nd, as without the forced save
            ck.save(step, state).wait()
    skipped = [r for r in caplog.records if "not checkpointed: every=10" in r.getMessage()]
    assert len(skipped) == 1 and "force=True" in skipped[0].getMessage()
    assert _steps(DiskTier(disk), "force") == {0, 13, 20, 40}


def test_a_two_rank_job_that_ends_cleanly_leaves_nothing_in_memory(tmp_path):
    """torchrun, 2 FSDP2 ranks (gloo), the embedded agent: the last rank to end frees the job's memory tier;
    disk holds the newest step, and the agent (which outlives a multi-rank job until idle) holds no slot."""
    shm, disk = str(tmp_path / "shm"), str(tmp_path / "disk")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", TRAINER,
           "--fsdp", "--steps", "4", "--job", "two", "--shm", shm, "--disk", disk, "--out", str(tmp_path / "ev")]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        assert 3 in _steps(DiskTier(disk), "two")
        assert MemoryTier(shm).list("two/") == []
        assert not os.path.exists(os.path.join(shm, ".slots", "two"))
    finally:
        c = AgentClient.try_connect(Settings(shm=shm).socket_path, timeout=5)
        if c is not None:
            c.close()
            agent_call(shm, "shutdown")
            wait_stopped(Settings(shm=shm), 60)


def test_the_threads_that_lease_and_fault_slots_run_at_the_lowest_priority_and_the_trainer_does_not(tmp_path,
                                                                                                   monkeypatch):
    import threading

    from tiers.memory import background_priority

    monkeypatch.delenv("TIERCKPT_NO_NICE", raising=False)
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen: list[int] = []

    def body() -> None:
        background_priority()
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    t = threading.Thread(target=body)
    t.start()
    t.join(30)
    assert seen == [19]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before
    # the checkpointer's lease thread is one of them
    with ckpt.Checkpointer("nice", shm=str(tmp_path / "shm")) as ck:
        ck.save(1, {"w": torch.ones(4)})
        ck.wait()
        tid = ck._leaser.submit(threading.get_native_id).result(timeout=60)
        assert os.getpriority(os.PRIO_PROCESS, tid) == 19
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before
