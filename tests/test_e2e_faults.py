"""End to end: an agent killed mid-write, S3 outages, corrupt manifests and bad input."""

from __future__ import annotations

import mmap
import os
import threading
import time

import pytest
import torch

import ckpt
from agents.config import socket_path_for
from agents.protocol import AgentClient
from procs import agent_call, ckpt_cmd, kill9, start_agent
from recovery import scan_tier
from tiers import DiskTier, InvalidNameError, MemoryTier, keys
from tiers.s3 import S3Tier

pytestmark = pytest.mark.e2e


def _stage_raw(shm: str, job: str, step: int, nbytes: int, rank: int = 0, world: int = 1) -> bytes:
    """Hand the agent ``rank``'s shard of ``nbytes`` (a multiple of 1 MiB) as a trainer would, without torch.

    Returns the bytes handed over.
    """
    data = os.urandom(1 << 20) * (nbytes >> 20)
    with AgentClient(socket_path_for(shm)) as c:
        slot = c.call("begin", job=job, rank=rank, world=world, nbytes=nbytes)["slot"]
        with open(slot, "r+b") as f, mmap.mmap(f.fileno(), nbytes) as mm:
            mm[:] = data
        # rank r holds the r-th piece of one tensor "w" cut along its only dimension
        entries = [{"kind": "tensor", "name": "w", "dtype": "uint8", "global_shape": [world * nbytes],
                    "offsets": [rank * nbytes], "shape": [nbytes], "offset": 0, "nbytes": nbytes}]
        c.call("commit", job=job, step=step, rank=rank, world=world, slot=slot, nbytes=nbytes, entries=entries,
               save_index=step)
    return data


def _stage_ranks(homes: dict[int, str], job: str, step: int, nbytes: int, world: int) -> dict[int, bytes]:
    """Every rank ``r`` hands its shard to the agent of memory folder ``homes[r]``, all at once, as trainers
    would; the bytes each handed over."""
    data: dict[int, bytes] = {}
    errors: list[BaseException] = []

    def one(rank: int, shm: str) -> None:
        try:
            data[rank] = _stage_raw(shm, job, step, nbytes, rank=rank, world=world)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=item) for item in homes.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return data


def _wait_for_temp_file(folder: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if any(n.startswith(".tmp-") for n in os.listdir(folder)):
                return
        except FileNotFoundError:
            pass
    raise AssertionError("the disk write finished before it could be interrupted")


def test_agent_killed_mid_write_never_leaves_step_reported_complete(tmp_path):
    shm, disk = str(tmp_path / "shm"), str(tmp_path / "disk")
    agent = start_agent(shm, "--disk", disk)
    try:
        _stage_raw(shm, "big", 7, 512 << 20)
        _wait_for_temp_file(os.path.join(disk, "big", "step-7"))
        kill9(agent)
    finally:
        if agent.poll() is None:
            kill9(agent)
    inv = scan_tier(DiskTier(disk), "big")
    assert 7 not in inv.complete_steps("big")
    listed = ckpt_cmd("list", "big", "--shm", shm, "--disk", disk)
    assert listed.returncode == 0
    row = next(line for line in listed.stdout.splitlines() if line.startswith("7 "))
    assert row.split()[1:3] == ["complete", "-"] or row.split()[1:3] == ["complete", "partial"]
    # a restarted agent finds the step whole in memory and finishes the interrupted write
    agent = start_agent(shm, "--disk", disk)
    try:
        assert agent_call(shm, "wait", job="big", timeout=120)["done"]
        deadline = time.monotonic() + 60
        while 7 not in scan_tier(DiskTier(disk), "big").complete_steps("big") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert 7 in scan_tier(DiskTier(disk), "big").complete_steps("big")
        assert ckpt_cmd("verify", "big", "--shm", shm, "--disk", disk).returncode == 0
    finally:
        agent.terminate()
        agent.wait(60)


@pytest.mark.parametrize("grace", ["0", "60"])
def test_sigterm_finishes_or_cleanly_abandons_in_flight_writes_and_says_which(tmp_path, grace):
    shm, disk = str(tmp_path / "shm"), str(tmp_path / "disk")
    agent = start_agent(shm, "--disk", disk, extra_env={"CKPT_GRACE": grace})
    _stage_raw(shm, "term", 3, 512 << 20)
    _wait_for_temp_file(os.path.join(disk, "term", "step-3"))
    agent.terminate()
    assert agent.wait(120) == 0
    log = open(agent.log_path).read()
    done = scan_tier(DiskTier(disk), "term").complete_steps("term")
    if grace == "0":
        assert "writes abandoned" in log and '"term/step-3": ["disk"]' in log
        assert done == []
    else:
        assert "every write finished" in log
        assert done == [3]
        assert not [n for n in os.listdir(os.path.join(disk, "term", "step-3")) if n.startswith(".tmp-")]


def _model_state():
    torch.manual_seed(0)
    m = torch.nn.Linear(64, 64)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    return {"model": m, "optim": o}


def test_s3_down_for_a_while_upload_is_retried_then_succeeds(tmp_path, s3_bucket, s3_proxy):
    _, bucket = s3_bucket
    shm, disk = str(tmp_path / "shm"), str(tmp_path / "disk")
    agent = start_agent(shm, "--disk", disk, "--s3", f"s3://{bucket}/p", "--s3-endpoint", s3_proxy.url)
    try:
        state = _model_state()
        with ckpt.Checkpointer("outage", shm=shm, spawn=False) as ck:
            s3_proxy.down()
            threading.Timer(2.0, s3_proxy.up).start()
            ck.save(0, state).wait(timeout=120)
        s3 = S3Tier(bucket, "p", endpoint_url=s3_bucket[0])
        assert scan_tier(s3, "outage").complete_steps("outage") == [0]
    finally:
        agent.terminate()
        agent.wait(60)


def test_s3_down_for_good_raises_clear_error_while_memory_and_disk_keep_working(tmp_path, s3_bucket, s3_proxy):
    _, bucket = s3_bucket
    shm, disk = str(tmp_path / "shm"), str(tmp_path / "disk")
    agent = start_agent(shm, "--disk", disk, "--s3", f"s3://{bucket}/p", "--s3-endpoint", s3_proxy.url,
                        "--s3-every", "2", extra_env={"CKPT_S3_RETRY_DEADLINE": "3"})
    try:
        state = _model_state()
        ck = ckpt.Checkpointer("down", shm=shm, spawn=False)
        s3_proxy.down()
        ck.save(0, state)
        with pytest.raises(ckpt.CheckpointError) as err:
            ck.wait(timeout=120)
        msg = str(err.value)
        assert "s3 tier" in msg and s3_proxy.url.split("//")[1] in msg and "step 0" in msg
        ck.save(1, state)  # memory + disk only (s3_every=2): keeps working
        ck.wait(timeout=60)
        ck.close()
        for tier in (MemoryTier(shm), DiskTier(disk)):
            assert scan_tier(tier, "down").complete_steps("down") == [0, 1]
    finally:
        agent.terminate()
        agent.wait(60)


def test_restore_from_memory_does_not_touch_s3_and_an_older_step_only_in_s3_is_fetched(tmp_path, s3_bucket,
                                                                                          s3_proxy):
    """The agent knows the newest step S3 could hold: a restore that memory can serve opens no connection
    to S3 (and works through an S3 outage); a step that only S3 still holds is found there."""
    _, bucket = s3_bucket
    shm = str(tmp_path / "shm")
    agent = start_agent(shm, "--s3", f"s3://{bucket}/p", "--s3-endpoint", s3_proxy.url, "--keep-memory", "1")
    try:
        state = _model_state()
        with ckpt.Checkpointer("near", shm=shm, spawn=False) as ck:
            for step in (0, 1):
                ck.save(step, state).wait(timeout=120)
        # the agent lists S3 once more after each upload (retention): let that settle first
        before, quiet = -1, 0
        while quiet < 10:
            quiet = quiet + 1 if s3_proxy.connections == before else 0
            before = s3_proxy.connections
            time.sleep(0.1)
        s3_proxy.down()
        target = _model_state()
        with ckpt.Checkpointer("near", shm=shm, spawn=False) as ck:
            assert ck.restore(target) == 1
            assert ck.last_restore.tiers == ["memory"]
        assert s3_proxy.connections == before
        s3_proxy.up()
        with ckpt.Checkpointer("near", shm=shm, spawn=False) as ck:
            assert ck.restore(target, step=0) == 0  # memory keeps only step 1
            assert ck.last_restore.tiers == ["s3"]
        for a, b in zip(state["model"].state_dict().values(), target["model"].state_dict().values()):
            assert torch.equal(a, b)
    finally:
        agent.terminate()
        agent.wait(60)


def test_an_agent_that_never_saw_the_job_looks_in_s3(tmp_path, s3_bucket):
    """A spare node's agent, running since before the job saved anything, knows nothing of the job: its
    trainer's restore lists S3 and finds the step there (rather than starting from scratch)."""
    endpoint, bucket = s3_bucket
    s3 = ["--s3", f"s3://{bucket}/p", "--s3-endpoint", endpoint]
    spare_shm, shm = str(tmp_path / "spare" / "shm"), str(tmp_path / "node" / "shm")
    for d in ("spare", "node"):
        os.makedirs(tmp_path / d)
    spare = start_agent(spare_shm, *s3)
    agent = start_agent(shm, *s3)
    try:
        state = _model_state()
        with ckpt.Checkpointer("elsewhere", shm=shm, spawn=False) as ck:
            ck.save(3, state).wait(timeout=120)
        target = _model_state()
        with ckpt.Checkpointer("elsewhere", shm=spare_shm, spawn=False) as ck:
            assert ck.restore(target) == 3 and ck.last_restore.tiers == ["s3"]
        for a, b in zip(state["model"].state_dict().values(), target["model"].state_dict().values()):
            assert torch.equal(a, b)
    finally:
        for p in (spare, agent):
            p.terminate()
            p.wait(60)


def _saved_job(tmp_path, steps=3) -> tuple[str, str]:
    shm, disk = str(tmp_path / "shm"), str(tmp_path / "disk")
    state = _model_state()
    # the job's memory tier stays after it ends, so the tests can damage its copies there too
    with ckpt.Checkpointer("job1", shm=shm, disk=disk, keep_memory_after_close=True) as ck:
        for s in range(steps):
            ck.save(s, state)
    return shm, disk


def test_cli_unknown_job_and_step_exit_nonzero_with_one_line(tmp_path):
    shm, disk = _saved_job(tmp_path)
    for args, needle in ((["list", "nope"], "no checkpoint of job 'nope'"),
                         (["show", "job1", "--step", "99"], "step 99 of job 'job1' is not complete"),
                         (["verify", "job1", "--step", "99"], "step 99 of job 'job1' is in no tier"),
                         (["list", "../etc"], "invalid job name"),
                         (["show", "job1", "--step", "-1"], "invalid step")):
        p = ckpt_cmd(*args, "--shm", shm, "--disk", disk)
        assert p.returncode != 0, args
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], (args, p.stderr)
    p = ckpt_cmd("list", "job1", "--shm", shm, "--disk", str(tmp_path / "missing"))
    assert p.returncode == 1 and "does not exist" in p.stderr


def test_malformed_manifest_is_reported_and_restore_uses_the_newest_intact_step(tmp_path):
    shm, disk = _saved_job(tmp_path, steps=3)
    for root in (shm, disk):
        with open(os.path.join(root, "job1", "step-2", "manifest.json"), "wb") as f:
            f.write(b'{"format": "tierckpt-manifest", "version": 1, "job": "job1"')
    # the manifests were damaged behind every writer's back: the step indexes still list step 2, a scan (and
    # verify, below) reads the manifests themselves
    p = ckpt_cmd("list", "job1", "--shm", shm, "--disk", disk, "--scan")
    row = next(line for line in p.stdout.splitlines() if line.startswith("2 "))
    assert "bad manifest" in row and row.endswith("no")
    state = _model_state()
    with ckpt.Checkpointer("job1", shm=shm, disk=disk) as ck:
        assert ck.restore(state) == 1
    assert ckpt_cmd("verify", "job1", "--shm", shm, "--disk", disk).returncode == 3


def test_job_name_with_dotdot_is_refused_everywhere(tmp_path):
    with pytest.raises(InvalidNameError):
        ckpt.Checkpointer("../escape", shm=str(tmp_path / "shm"))
    with pytest.raises(InvalidNameError):
        keys.shard_key("a/../b", 1, 0)
    assert not (tmp_path / "escape").exists()
