"""Pipeline-parallel jobs (2 stages x replicas, torchrun, gloo, CPU) save, restore and reshard exactly.

The trainer is tests/pp_trainer.py: ``torch.distributed.pipelining`` (``PipelineStage`` with static shapes +
``ScheduleGPipe``, 2 microbatches) on a 2-D mesh ``("pp", "dp")``, gradients averaged within each stage's
replicas. Each stage keeps the model's own names, so its tensors are found by name at another world size.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch

from procs import HERE, env, kill_torchrun, losses, read_events, start_agent, write_secret
from s3util import free_port

pytestmark = pytest.mark.e2e
PP_TRAINER = os.path.join(HERE, "pp_trainer.py")
STEPS = 8
HANG = 4  # (a): the job is killed after this step is committed everywhere
SAVED = 3  # (b): the resharded restores start from this step


def _launch(n: int, out: str, *args: str, node: tuple[int, int] | None = None, hang: bool = False):
    """torchrun of ``n`` ranks of the PP trainer: standalone, or ``node=(node rank, port)`` of 2 nodes."""
    launch = ["--standalone"] if node is None else \
        ["--nnodes", "2", "--node-rank", str(node[0]), "--master-addr", "127.0.0.1", "--master-port", str(node[1])]
    cmd = [sys.executable, "-m", "torch.distributed.run", *launch, "--nproc-per-node", str(n), PP_TRAINER,
           "--out", out, *args]
    if hang:
        cmd += ["--hang-after", str(HANG)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE if hang else subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env=env())


def _finish(*jobs: subprocess.Popen) -> None:
    for j in jobs:
        _, err = j.communicate(timeout=300)
        # the ranks' own errors first: torchrun's summary at the end hides them
        assert j.returncode == 0, "\n".join(ln for ln in err.splitlines() if "Error" in ln)[-3000:]


def _stop(agents) -> None:
    for a in agents:
        a.terminate()
    for a in agents:
        a.wait(60)


def _assert_same_state(got: dict, want: dict, what: str) -> None:
    assert got["model"].keys() == want["model"].keys(), what
    for k in want["model"]:
        assert torch.equal(got["model"][k], want["model"][k]), f"{what}: {k} differs"
    assert got["optim"]["param_groups"] == want["optim"]["param_groups"], what
    assert got["optim"]["state"].keys() == want["optim"]["state"].keys(), what
    for i, st in want["optim"]["state"].items():
        assert st.keys() == got["optim"]["state"][i].keys(), what
        for k, v in st.items():
            assert torch.equal(got["optim"]["state"][i][k], v), f"{what}: optimizer state {i}/{k} differs"


def _progress(events: list[dict]) -> dict[int, tuple]:
    return {e["step"]: (e["loss"], e["digest"]) for e in events if "step" in e}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Per rank, the (loss, parameter digest) of every step of an uninterrupted 2 stages x 2 replicas run."""
    d = tmp_path_factory.mktemp("pp-ref")
    agent = start_agent(str(d / "shm"))
    try:
        _finish(_launch(4, str(d / "ev"), "--job", "ref", "--shm", str(d / "shm"), "--no-spawn",
                        "--steps", str(STEPS)))
    finally:
        _stop([agent])
    ref = {r: _progress(read_events(f"{d / 'ev'}.{r}")) for r in range(4)}
    # the replicas of a stage stay equal; the stages differ
    assert ref[0] == {s: (None, ref[1][s][1]) for s in range(STEPS)} and ref[2][STEPS - 1][1] == ref[3][STEPS - 1][1]
    assert ref[2][STEPS - 1][0] != ref[3][STEPS - 1][0]  # the replicas' batches differ, so their losses do
    return ref


def test_values_of_a_resharded_restore_come_from_a_rank_of_the_same_stage():
    """The bug this pins down: at a new world size a rank took its JSON values from the same rank's shard (or
    rank 0's), which in a pipeline-parallel job is another stage's: stage 1's new rank 1 got stage 0's step
    counter and optimizer parameter groups from saved rank 1."""
    from ckpt._load import values_rank

    def chunk(name: str) -> object:
        from tiers.manifest import TensorChunk

        return TensorChunk(name, "float32", (4,), (0,), (4,), 0, 16)

    def plan(names_by_rank: list[list[str]], metadata: dict | None = None):
        return types.SimpleNamespace(manifest=types.SimpleNamespace(world=len(names_by_rank),
                                                                    metadata=metadata or {}),
                                     entries=lambda r: tuple(chunk(n) for n in names_by_rank[r]))

    stage0, stage1 = ["inp.weight", "layers.0.fc.weight"], ["layers.3.fc.weight", "head.weight"]
    saved_2x2 = plan([stage0, stage0, stage1, stage1])
    assert [values_rank(saved_2x2, r, names) for r, names in enumerate([stage0, stage1])] == [0, 2]
    saved_2x1 = plan([stage0, stage1])
    assert [values_rank(saved_2x1, r, names) for r, names in enumerate([stage0, stage0, stage1, stage1])] == \
        [0, 0, 1, 1]
    # data parallel / FSDP: every shard holds every name, so the same rank's values, or rank 0's
    fsdp = plan([stage0 + stage1] * 2)
    assert [values_rank(fsdp, r, stage0 + stage1) for r in range(4)] == [0, 1, 0, 0]
    assert values_rank(fsdp, 1, []) == 1
    # the shared tier's manifest of an HSDP step lists each replicated chunk under one holder: a rank that
    # wrote any of its tensors takes its own values, a stage's rank never another stage's
    half = ["layers.0.fc.weight"], ["inp.weight"]
    hsdp = plan([half[0], half[1], half[1], half[0]], {"durable_of": "xxh3_64:0000000000000000"})
    assert [values_rank(hsdp, r, stage0) for r in range(4)] == [0, 1, 2, 3]
    pp = plan([["inp.weight"], ["layers.0.fc.weight"], ["head.weight"], ["layers.3.fc.weight"]],
              {"durable_of": "xxh3_64:0000000000000000"})
    assert [values_rank(pp, r, names) for r, names in enumerate([stage0, stage1])] == [0, 2]
    # at the same world size a rank's values are its own, even when it wrote none of its tensors to the view
    # (its replicas did): rank 1 here would otherwise take rank 0's step counter and data position
    wrote_none = plan([stage0, [], stage0, []], {"durable_of": "xxh3_64:0000000000000000"})
    assert values_rank(wrote_none, 1, stage0) == 0  # another world size: a rank of the stage that wrote them
    assert [values_rank(wrote_none, r, stage0, world=4) for r in range(4)] == [0, 1, 2, 3]


def test_two_nodes_killed_mid_run_resume_bit_exact_from_memory(tmp_path, reference):
    """Case (a): 2 simulated nodes (an agent and a shm folder each) x 2 ranks; every step saved, replicated to
    the other node; every trainer is kill -9ed after step HANG is committed; the job resumes from its nodes'
    memory, and every later step's loss and parameters equal the uninterrupted run's bit for bit."""
    ports = [free_port(), free_port()]
    peers = str(tmp_path / "peers.txt")
    with open(peers, "w") as f:
        f.write("".join(f"127.0.0.1:{p}\n" for p in ports))
    secret = write_secret(str(tmp_path / "secret"))
    shm = [str(tmp_path / f"node{n}" / "shm") for n in (0, 1)]
    agents = []
    try:
        for n in (0, 1):
            os.makedirs(os.path.dirname(shm[n]))
            agents.append(start_agent(shm[n], "--node-rank", str(n), "--peers", peers, "--secret-file", secret,
                                      "--heartbeat", "0.2", "--dead-after", "2"))
        out = str(tmp_path / "ev")

        def run(hang: bool) -> None:
            port = free_port()
            jobs = [_launch(2, out, "--job", "pp", "--shm", shm[n], "--no-spawn", "--steps", str(STEPS),
                            node=(n, port), hang=hang) for n in (0, 1)]
            if not hang:
                _finish(*jobs)
                return
            for j in jobs:
                for line in j.stdout:
                    if "STAGED" in line:
                        break
            for j in jobs:
                kill_torchrun(j)

        run(hang=True)
        run(hang=False)
    finally:
        _stop(agents)
    for rank in range(4):
        events = read_events(f"{out}.{rank}")
        restored = [e for e in events if "restored" in e]
        # each rank read its own shard, from its own node's memory
        assert len(restored) == 1 and restored[0]["restored"] == HANG, (rank, restored)
        assert restored[0]["tiers"] == ["memory"] and restored[0]["ranks"] == [rank], (rank, restored)
        i = events.index(restored[0])
        assert _progress(events[:i]) == {s: reference[rank][s] for s in range(HANG + 1)}, rank
        assert [e["step"] for e in events[i + 1:]] == list(range(HANG + 1, STEPS))
        assert _progress(events[i + 1:]) == {s: reference[rank][s] for s in range(HANG + 1, STEPS)}, rank


@pytest.mark.parametrize("saved,restored", [(2, 1), (1, 2)])
def test_restore_with_another_replica_count_is_exact_and_trains_on_identically(tmp_path, saved, restored):
    """Case (b): saved by 2 stages x ``saved`` replicas, restored by 2 stages x ``restored``: each rank gets
    its stage's parameters, optimizer state and step counter exactly as saved (by name, from a shard of its
    own stage), and the steps after it equal those of a run of the new shape started from the saved state
    loaded by plain ``load_state_dict``."""
    shm = str(tmp_path / "shm")
    agent = start_agent(shm)
    try:
        _finish(_launch(2 * saved, str(tmp_path / "ev-saved"), "--job", "pp", "--shm", shm, "--no-spawn",
                        "--steps", str(SAVED + 1), "--dump", str(tmp_path / "saved")))
        _finish(_launch(2 * restored, str(tmp_path / "ev-restored"), "--job", "pp", "--shm", shm, "--no-spawn",
                        "--steps", str(STEPS), "--dump-restored", str(tmp_path / "restored")))
        _finish(_launch(2 * restored, str(tmp_path / "ev-ref"), "--job", "ref", "--shm", shm, "--no-spawn",
                        "--steps", str(STEPS), "--init-from", str(tmp_path / "saved"), "--init-step", str(SAVED),
                        "--init-replicas", str(saved)))
    finally:
        _stop([agent])
    for rank in range(2 * restored):
        stage = rank // restored
        events = read_events(f"{tmp_path / 'ev-restored'}.{rank}")
        restored_ev = [e for e in events if "restored" in e]
        assert len(restored_ev) == 1 and restored_ev[0]["restored"] == SAVED, (rank, restored_ev)
        # the tensors are read by name from the first saved rank of the rank's own stage, from memory
        assert restored_ev[0]["tiers"] == ["memory"] and restored_ev[0]["ranks"] == [stage * saved], restored_ev
        _assert_same_state(torch.load(f"{tmp_path / 'restored'}.{rank}", weights_only=True),
                           torch.load(f"{tmp_path / 'saved'}.{stage * saved}", weights_only=True), f"rank {rank}")
        after = _progress(events)
        assert sorted(after) == list(range(SAVED + 1, STEPS))
        assert after == _progress(read_events(f"{tmp_path / 'ev-ref'}.{rank}")), rank
    ev_saved = losses(read_events(f"{tmp_path / 'ev-saved'}.{2 * saved - 1}"))
    assert sorted(ev_saved) == list(range(SAVED + 1))
