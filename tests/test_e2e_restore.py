"""End to end: real agent and trainer processes, kill -9, restore from memory, disk and S3, bit-exact."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from procs import TRAINER, ckpt_cmd, env, kill9, losses, read_events, run_trainer, start_agent

pytestmark = pytest.mark.e2e
STEPS = 8
HANG = 3


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Losses and final state of the same job run without interruption."""
    d = tmp_path_factory.mktemp("ref")
    run_trainer("--job", "ref", "--shm", str(d / "shm"), "--steps", str(STEPS), "--out", str(d / "ev"),
                "--dump", str(d / "dump"))
    return losses(read_events(str(d / "ev.0"))), torch.load(str(d / "dump.0"), weights_only=True)


def assert_same_state(a: dict, b: dict) -> None:
    assert a["params"].keys() == b["params"].keys() and a["optim"].keys() == b["optim"].keys()
    for part in ("params", "optim"):
        for k in a[part]:
            assert torch.equal(a[part][k], b[part][k]), f"{part} {k} differs"


@pytest.mark.parametrize("lost", ["trainer", "trainer-embedded-agent", "agent+shm", "agent+shm+disk"])
def test_resume_after_kill9_is_bit_exact_and_uses_fastest_surviving_tier(tmp_path, reference, s3_bucket, lost):
    """kill -9 the trainer (and for the later cases the agent, its shm, the disk); resume; compare."""
    endpoint, bucket = s3_bucket
    shm, disk = str(tmp_path / "shm"), str(tmp_path / "disk")
    tiers = ["--disk", disk, "--s3", f"s3://{bucket}/ckpt", "--s3-endpoint", endpoint]
    external = lost != "trainer-embedded-agent"
    agent = start_agent(shm, *tiers) if external else None
    args = ["--job", "gpt", "--shm", shm, *tiers, "--steps", str(STEPS), "--out", str(tmp_path / "ev"),
            "--dump", str(tmp_path / "dump")] + (["--no-spawn"] if external else [])
    trainer = run_trainer(*args, "--hang-after", str(HANG), hang=True)
    kill9(trainer)
    if lost.startswith("agent"):
        kill9(agent)
        shutil.rmtree(shm)
        if "disk" in lost:
            shutil.rmtree(disk)
        agent = start_agent(shm, *tiers)
    try:
        run_trainer(*args)
    finally:
        if agent is not None:
            agent.terminate()
            agent.wait(60)
    events = read_events(str(tmp_path / "ev.0"))
    restored = [e for e in events if "restored" in e]
    expected_tier = {"trainer": "memory", "trainer-embedded-agent": "memory", "agent+shm": "disk",
                     "agent+shm+disk": "s3"}[lost]
    assert restored == [{"restored": HANG, "tiers": [expected_tier]}]
    ref_losses, ref_state = reference
    resumed = [e for e in events if "step" in e]
    resumed = resumed[HANG + 1:]
    assert [e["step"] for e in resumed] == list(range(HANG + 1, STEPS))
    assert {e["step"]: e["loss"] for e in resumed} == {s: ref_losses[s] for s in range(HANG + 1, STEPS)}
    assert_same_state(torch.load(str(tmp_path / "dump.0"), weights_only=True), ref_state)


def test_flipped_byte_in_memory_shard_is_detected_and_disk_copy_is_read(tmp_path, reference):
    shm, disk = str(tmp_path / "shm"), str(tmp_path / "disk")
    args = ["--job", "flip", "--shm", shm, "--disk", disk, "--out", str(tmp_path / "ev")]
    # the finished run's memory tier stays, so its damaged shard is the first place the restore reads
    run_trainer(*args, "--steps", str(HANG + 1), "--keep-memory")
    shard = os.path.join(shm, "flip", f"step-{HANG}", "rank-0.shard")
    with open(shard, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0x01]))
    v = ckpt_cmd("verify", "flip", "--step", str(HANG), "--shm", shm, "--disk", disk)
    assert v.returncode == 3 and "CORRUPT" in v.stdout
    assert "memory  0     CORRUPT" in v.stdout and "disk    0     ok" in v.stdout
    run_trainer(*args, "--steps", str(STEPS))
    events = read_events(str(tmp_path / "ev.0"))
    assert [e for e in events if "restored" in e] == [{"restored": HANG, "tiers": ["disk"]}]
    ref_losses, _ = reference
    assert {e["step"]: e["loss"] for e in events if "step" in e and e["step"] > HANG} == \
        {s: ref_losses[s] for s in range(HANG + 1, STEPS)}


def test_fsdp2_two_ranks_torchrun_killed_and_resumed_bit_exact(tmp_path):
    """2-rank FSDP2 (gloo) under torchrun: kill -9 the job, restart, resume from memory; identical state."""
    shm, disk = str(tmp_path / "shm"), str(tmp_path / "disk")

    def torchrun(out: str, *extra: str, hang: bool = False):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               TRAINER, "--fsdp", "--steps", str(STEPS), "--out", out, *extra]
        if not hang:
            p = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=300)
            assert p.returncode == 0, p.stderr[-3000:]
            return p
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env(),
                                start_new_session=True)
        while True:
            line = proc.stdout.readline()
            if "STAGED" in line:
                return proc
            assert line or proc.poll() is None, "torchrun job ended before staging"

    ref = str(tmp_path / "ref")
    torchrun(ref, "--job", "ref", "--shm", str(tmp_path / "refshm"), "--dump", ref + "-dump")
    agent = start_agent(shm, "--disk", disk)
    try:
        common = ["--job", "fsdp", "--shm", shm, "--no-spawn", "--dump", str(tmp_path / "dump")]
        job = torchrun(str(tmp_path / "ev"), *common, "--hang-after", str(HANG), hang=True)
        # kill -9 the whole job: the ranks (torchrun starts each in a session of its own) and torchrun
        with open(f"/proc/{job.pid}/task/{job.pid}/children") as f:
            ranks = [int(x) for x in f.read().split()]
        for pid in ranks:
            os.kill(pid, signal.SIGKILL)
        os.killpg(job.pid, signal.SIGKILL)
        job.wait(30)
        torchrun(str(tmp_path / "ev"), *common)
    finally:
        agent.terminate()
        agent.wait(60)
    for rank in (0, 1):
        ev = read_events(f"{tmp_path / 'ev'}.{rank}")
        assert [e for e in ev if "restored" in e] == [{"restored": HANG, "tiers": ["memory"]}]
        ref_losses = losses(read_events(f"{ref}.{rank}"))
        got = {e["step"]: e["loss"] for e in ev if "step" in e and e["step"] > HANG}
        assert got == {s: ref_losses[s] for s in range(HANG + 1, STEPS)}
        assert_same_state(torch.load(f"{tmp_path / 'dump'}.{rank}", weights_only=True),
                          torch.load(f"{ref}-dump.{rank}", weights_only=True))


@pytest.mark.parametrize("saved,restored", [(4, 2), (2, 4)])
def test_restart_with_another_world_size_reshards_through_dcp_exactly(tmp_path, saved, restored):
    """Saved by ``saved`` FSDP2 ranks, restored by ``restored``: every parameter and optimizer tensor equal."""
    shm = str(tmp_path / "shm")

    def torchrun(n: int, dump: str) -> None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
               TRAINER, "--fsdp", "--gpt", "--steps", "4", "--job", "resh", "--shm", shm,
               "--out", str(tmp_path / f"ev{n}"), "--dump", dump, "--full"]
        p = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]

    torchrun(saved, str(tmp_path / "before"))
    torchrun(restored, str(tmp_path / "after"))
    for rank in range(restored):
        ev = read_events(f"{tmp_path / f'ev{restored}'}.{rank}")
        assert [e["restored"] for e in ev if "restored" in e] == [3]
        # the resharded restore reads the byte ranges it needs from the saved ranks' shards in local memory
        assert {t for e in ev if "restored" in e for t in e["tiers"]} == {"memory"}
        assert not [e for e in ev if "step" in e]  # nothing left to train: the state is exactly the saved one
        assert_same_state(torch.load(f"{tmp_path / 'after'}.{rank}", weights_only=True),
                          torch.load(f"{tmp_path / 'before'}.0", weights_only=True))


def test_resharded_restore_reads_a_shard_left_only_in_s3(tmp_path, s3_bucket):
    """Saved by 2 ranks, restored by 1: rank 1's shard is gone from memory, so the resharding restore reads
    it from S3 (which the same-world shortcut alone would not have looked at) and rank 0's from memory."""
    endpoint, bucket = s3_bucket
    shm = str(tmp_path / "shm")
    s3 = ["--s3", f"s3://{bucket}/resh", "--s3-endpoint", endpoint]

    def torchrun(n: int, dump: str) -> None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
               TRAINER, "--fsdp", "--gpt", "--steps", "4", "--job", "reshs3", "--shm", shm, *s3,
               "--out", str(tmp_path / f"ev{n}"), "--dump", dump, "--full", "--keep-memory"]
        p = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]

    # the 2-rank run's memory tier stays after it ends (--keep-memory), less the shard removed here
    torchrun(2, str(tmp_path / "before"))
    os.unlink(os.path.join(shm, "reshs3", "step-3", "rank-1.shard"))
    torchrun(1, str(tmp_path / "after"))
    ev = read_events(f"{tmp_path / 'ev1'}.0")
    restored = [e for e in ev if "restored" in e]
    assert [e["restored"] for e in restored] == [3]
    assert sorted(restored[0]["tiers"]) == ["memory", "s3"], restored
    assert_same_state(torch.load(f"{tmp_path / 'after'}.0", weights_only=True),
                      torch.load(f"{tmp_path / 'before'}.0", weights_only=True))
