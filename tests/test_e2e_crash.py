"""End to end: a crash keeps the memory tier, a clean end frees it, a new run takes over a job's steps.

Real trainer processes (tests/trainer.py), real agents (embedded and ``ckpt agent``), torchrun with gloo,
``kill -9`` and torchrun's SIGTERM. Every restart must restore from memory, bit-exact, on its first try.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from procs import TRAINER, agent_call, ckpt_cmd, env, kill9, losses, read_events, run_trainer, start_agent
from test_e2e_restore import assert_same_state

pytestmark = pytest.mark.e2e
STEPS = 6
CRASH = 3


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("ref")
    run_trainer("--job", "ref", "--shm", str(d / "shm"), "--steps", str(STEPS), "--out", str(d / "ev"),
                "--dump", str(d / "dump"))
    return losses(read_events(str(d / "ev.0"))), torch.load(str(d / "dump.0"), weights_only=True)


def _failing(*args: str) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, TRAINER, *args], capture_output=True, text=True, env=env(), timeout=240)
    assert p.returncode != 0, f"the trainer was to fail:\n{p.stderr[-3000:]}"
    return p


def _stop_embedded(shm: str) -> None:
    """Stop the embedded agent a test left on ``shm`` (it keeps a crashed job's memory for an hour)."""
    try:
        pid = agent_call(shm, "status")["pid"]
        agent_call(shm, "shutdown")
    except Exception:
        return
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)


def _memory_steps(shm: str, job: str) -> list[str]:
    folder = os.path.join(shm, job)
    return sorted(d for d in os.listdir(folder) if d.startswith("step-")) if os.path.isdir(folder) else []


def _check_resumed(tmp_path, reference, tiers=("memory",)) -> None:
    events = read_events(str(tmp_path / "ev.0"))
    restored = [e for e in events if "restored" in e]
    assert restored == [{"restored": CRASH, "tiers": list(tiers)}]
    ref_losses, ref_state = reference
    after = events[events.index(restored[0]) + 1:]
    assert [e["step"] for e in after] == list(range(CRASH + 1, STEPS))
    assert losses(after) == {s: ref_losses[s] for s in range(CRASH + 1, STEPS)}
    assert losses(events[:events.index(restored[0])]) == {s: ref_losses[s] for s in range(CRASH + 1)}
    assert_same_state(torch.load(str(tmp_path / "dump.0"), weights_only=True), ref_state)


def test_exception_in_the_with_block_keeps_memory_and_the_restart_restores_from_it_bit_exact(tmp_path, reference):
    """One process leaves its ``with`` block by an exception (a CUDA OOM, say). The embedded agent keeps the
    job's memory tier and stays up; the log says so in one line; ``ckpt list`` shows the steps in memory;
    the restart restores from memory, bit-exact. Its clean end then frees memory (disk holds the step)."""
    shm, disk = str(tmp_path / "shm"), str(tmp_path / "disk")
    args = ["--job", "oom", "--shm", shm, "--disk", disk, "--steps", str(STEPS), "--out", str(tmp_path / "ev"),
            "--dump", str(tmp_path / "dump")]
    try:
        p = _failing(*args, "--raise-at", str(CRASH))
        assert "CUDA out of memory (raised by the test)" in p.stderr
        said = [ln for ln in p.stderr.splitlines() if "did not end cleanly" in ln]
        assert len(said) == 1, p.stderr[-3000:]
        kept = re.search(r"keeps steps? ([\d, ]+) \(", said[0])
        assert kept and "for 3600 s" in said[0], said
        kept = [int(x) for x in kept.group(1).split(", ")]
        assert kept[-1] == CRASH and kept == sorted(kept), said
        assert "freed" not in p.stderr
        status = agent_call(shm, "status")
        assert status["embedded"] and status["connections"] == 1  # still up for the restart; this call alone
        # an older step still being written to disk leaves memory once it is there (retention keeps 2)
        assert len(kept) == 2
        deadline = time.monotonic() + 120
        while _memory_steps(shm, "oom") != [f"step-{s}" for s in kept] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _memory_steps(shm, "oom") == [f"step-{s}" for s in kept]
        listed = ckpt_cmd("list", "oom", "--shm", shm, "--disk", disk, check=True).stdout
        row = next(ln.split() for ln in listed.splitlines() if ln.split()[:1] == [str(CRASH)])
        assert row[1] == "complete" and row[-1] == "yes", listed
        p = run_trainer(*args)
        _check_resumed(tmp_path, reference)
        assert "did not end cleanly" not in p.stderr
        # the clean end frees memory as before: disk holds the newest step
        assert _memory_steps(shm, "oom") == []
    finally:
        _stop_embedded(shm)


@pytest.mark.parametrize("agent", ["embedded-killed", "node-restarted"])
def test_the_memory_kept_after_a_crash_outlives_an_agent_restart(tmp_path, reference, agent):
    """The trainer crashes by an exception; then its agent goes too (the embedded one kill -9'd, a node agent
    stopped and started again). The new agent finds the steps in memory and the restart restores from them."""
    shm, disk = str(tmp_path / "shm"), str(tmp_path / "disk")
    node = agent == "node-restarted"
    proc = start_agent(shm, "--disk", disk) if node else None
    args = ["--job", "ag", "--shm", shm, "--disk", disk, "--steps", str(STEPS), "--out", str(tmp_path / "ev"),
            "--dump", str(tmp_path / "dump")] + (["--no-spawn"] if node else [])
    try:
        _failing(*args, "--raise-at", str(CRASH))
        if node:
            proc.terminate()
            proc.wait(60)
            proc = start_agent(shm, "--disk", disk)
        else:
            os.kill(agent_call(shm, "status")["pid"], signal.SIGKILL)
        run_trainer(*args)
        _check_resumed(tmp_path, reference)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
        _stop_embedded(shm)


@pytest.fixture(scope="module")
def reference2(tmp_path_factory):
    d = tmp_path_factory.mktemp("ref2")
    _torchrun(str(d / "ev"), "--job", "ref2", "--shm", str(d / "shm"), "--dump", str(d / "dump"))
    return {r: losses(read_events(f"{d / 'ev'}.{r}")) for r in (0, 1)}, d


def _torchrun(out: str, *args: str, restarts: int = 0) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", str(restarts), TRAINER, "--fsdp", "--steps", str(STEPS), "--out", out, *args]
    # a restarted gloo group needs a rendezvous store of its own (pytorch/pytorch#135712)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=400,
                       env=env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"))
    assert p.returncode == 0, p.stderr[-4000:]
    return p


@pytest.mark.parametrize("fate", ["exception", "sigterm"])
def test_torchrun_rank_killed_the_other_leaves_and_both_restart_from_memory(tmp_path, reference2, fate):
    """torchrun, 2 FSDP2 ranks (gloo), the embedded agent, disk: rank 1 kill -9s itself after step 3 is saved.
    Rank 0 either fails in its next collective and leaves its ``with`` block by that exception, or is
    blocked and ended by torchrun's SIGTERM. torchrun restarts both; both restore step 3 from memory on
    the first try and finish with the uninterrupted run's losses and state."""
    ref_losses, ref_dir = reference2
    shm, disk = str(tmp_path / "shm"), str(tmp_path / "disk")
    try:
        _torchrun(str(tmp_path / "ev"), "--job", "tr", "--shm", shm, "--disk", disk, "--dump", str(tmp_path / "dump"),
                  "--kill-rank", "1", "--kill-at", str(CRASH), *(["--peer-hangs"] if fate == "sigterm" else []),
                  restarts=1)
    finally:
        _stop_embedded(shm)
    for rank in (0, 1):
        events = read_events(f"{tmp_path / 'ev'}.{rank}")
        restored = [e for e in events if "restored" in e]
        assert restored == [{"restored": CRASH, "tiers": ["memory"]}], (rank, restored)
        after = events[events.index(restored[0]) + 1:]
        assert losses(after) == {s: ref_losses[rank][s] for s in range(CRASH + 1, STEPS)}, rank
        assert_same_state(torch.load(f"{tmp_path / 'dump'}.{rank}", weights_only=True),
                          torch.load(f"{ref_dir / 'dump'}.{rank}", weights_only=True))


def test_a_fresh_run_of_a_job_name_takes_over_its_steps_with_a_warning(tmp_path, reference):
    """A run ends; a second run of the same job name starts from step 0 without restoring (on purpose). It
    saves with no error; a WARNING names the earlier run's steps it drops; ``ckpt list`` shows only the
    new run's steps, and a third run resumes from the new run's newest step, bit-exact."""
    shm, disk = str(tmp_path / "shm"), str(tmp_path / "disk")
    agent = start_agent(shm, "--disk", disk, "--keep-memory", "8")  # a node agent: memory is never freed
    args = ["--job", "again", "--shm", shm, "--disk", disk, "--no-spawn", "--dump", str(tmp_path / "dump")]
    try:
        run_trainer(*args, "--steps", str(STEPS), "--out", str(tmp_path / "first"))
        args += ["--out", str(tmp_path / "ev")]
        p = run_trainer(*args, "--steps", str(CRASH + 1), "--fresh")
        warned = [ln for ln in p.stderr.splitlines() if "starts again without restoring" in ln]
        assert len(warned) == 1, p.stderr[-3000:]
        assert f"its first save is step 0" in warned[0] and f"{list(range(STEPS))} from memory" in warned[0], warned
        assert " from disk" in warned[0], warned  # the steps disk retention kept
        listed = ckpt_cmd("list", "again", "--shm", shm, "--disk", disk, check=True).stdout
        steps = sorted(int(ln.split()[0]) for ln in listed.splitlines()[1:] if ln.split()[:1] != ["step"]
                       and ln.split()[0].isdigit())
        assert steps == list(range(CRASH + 1)), listed
        run_trainer(*args, "--steps", str(STEPS))
    finally:
        agent.terminate()
        agent.wait(60)
    _check_resumed(tmp_path, reference)


def test_two_live_runs_of_one_job_on_one_node_are_refused_naming_the_other(tmp_path):
    """While a run of a job is alive, a second run of the same job on the same node is refused at connect,
    with the live run's pid and what to do; once the first is gone, the second starts."""
    shm = str(tmp_path / "shm")
    agent = start_agent(shm)
    args = ["--job", "twice", "--shm", shm, "--no-spawn", "--steps", str(STEPS)]
    first = run_trainer(*args, "--hang-after", "1", hang=True)
    try:
        p = subprocess.run([sys.executable, TRAINER, *args, "--fresh"], capture_output=True, text=True, env=env(),
                           timeout=240)
        assert p.returncode != 0
        assert f"job 'twice' is already running on this node (pid {first.pid}" in p.stderr, p.stderr[-3000:]
        assert f"Stop pid {first.pid} first" in p.stderr
        kill9(first)
        run_trainer(*args, "--fresh")
    finally:
        if first.poll() is None:
            kill9(first)
        agent.terminate()
        agent.wait(60)


LIGHTNING = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lightning_trainer.py")


def _lightning(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, LIGHTNING, *args], capture_output=True, text=True, env=env(),
                          timeout=300)


def _events(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(ln) for ln in f if ln.strip()]


def test_a_lightning_run_crashing_through_its_own_exception_path_restarts_from_memory_bit_exact(tmp_path):
    """PyTorch Lightning's Trainer.fit, a callback saving every step: an exception raised in training reaches
    Lightning's ``_call_and_handle_interrupt``, whose ``except BaseException`` calls the callback's
    ``on_exception`` (closing the Checkpointer) before it tears down and re-raises. The agent keeps the memory
    tier; the restarted fit restores from memory and trains on with the same losses and weights, bit for bit,
    as a run that never crashed."""
    shm, disk = str(tmp_path / "shm"), str(tmp_path / "disk")
    common = ["--shm", shm, "--disk", disk, "--steps", "6"]
    try:
        ref = _lightning("--job", "lref", "--out", str(tmp_path / "ref"), *common)
        assert ref.returncode == 0, ref.stderr[-3000:]
        crashed = _lightning("--job", "lit", "--out", str(tmp_path / "run"), "--raise-at", "3", *common)
        assert crashed.returncode != 0 and "CUDA out of memory (raised by the test)" in crashed.stderr
        assert "_call_and_handle_interrupt" in crashed.stderr  # Lightning's own exception path carried it
        said = [ln for ln in crashed.stderr.splitlines() if "did not end cleanly" in ln]
        assert len(said) == 1 and "keeps steps 2, 3" in said[0] and "freed" not in crashed.stderr, said
        again = _lightning("--job", "lit", "--out", str(tmp_path / "run"), *common)
        assert again.returncode == 0, again.stderr[-3000:]
        events, expected = _events(tmp_path / "run"), _events(tmp_path / "ref")
        restored = [e for e in events if "restored" in e]
        assert restored == [{"restored": 3, "tiers": ["memory"]}]
        # steps 0-3 of the run that crashed, then 4-5 after the restore: the uninterrupted run's losses
        assert [e for e in events if "step" in e] == expected
        ref_state = torch.load(str(tmp_path / "ref.pt"), weights_only=True)
        state = torch.load(str(tmp_path / "run.pt"), weights_only=True)
        assert ref_state.keys() == state.keys() and all(torch.equal(ref_state[k], state[k]) for k in state)
    finally:
        _stop_embedded(shm)
