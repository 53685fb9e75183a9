"""Two simulated nodes x 2 ranks (FSDP2, gloo, torchrun), two agents on loopback, memory + peer + disk + S3.

Each node is a torchrun of 2 ranks with its own agent and shm folder. Every step is checkpointed to memory
and the peer, every 5th save to disk, every 10th to S3. After each kind of loss the job resumes from the
fastest place that still holds a complete step, and its losses match an uninterrupted run bit for bit.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from procs import TRAINER, env, kill9, kill_torchrun, losses, read_events, start_agent, write_secret
from s3util import free_port

pytestmark = pytest.mark.e2e
STEPS = 14
HANG = 12
NPROC = 2


def _torchrun(node: int, port: int, out: str, *args: str, hang: bool = False, restarts: int = 0):
    if restarts:
        # the elastic launch recipe of the README: c10d rendezvous, so a failure on one node restarts every
        # node's ranks; torch's shared rendezvous store hands restarted gloo/NCCL groups the previous
        # attempt's addresses (pytorch/pytorch#135712), hence TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
        launch = ["--max-restarts", str(restarts), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                  "--rdzv-id", "mission"]
    else:
        launch = ["--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(NPROC), *launch,
           TRAINER, "--fsdp", "--gpt", "--steps", str(STEPS), "--out", out, *args]
    if hang:
        cmd += ["--hang-after", str(HANG)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE if hang else subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"))


class TwoNodes:
    def __init__(self, root, s3_endpoint: str, bucket: str) -> None:
        self.root = root
        self.ports = [free_port(), free_port()]
        self.peers = str(root / "peers.txt")
        with open(self.peers, "w") as f:
            f.write("".join(f"127.0.0.1:{p}\n" for p in self.ports))
        self.secret = write_secret(str(root / "secret"))
        self.s3 = ["--s3", f"s3://{bucket}/ckpt", "--s3-endpoint", s3_endpoint]
        self.agents: dict[int, subprocess.Popen] = {}
        for n in (0, 1):
            self.start_agent(n)

    def shm(self, n: int) -> str:
        return str(self.root / f"node{n}" / "shm")

    def disk(self, n: int) -> str:
        return str(self.root / f"node{n}" / "disk")

    def start_agent(self, n: int) -> None:
        os.makedirs(os.path.dirname(self.shm(n)), exist_ok=True)
        self.agents[n] = start_agent(self.shm(n), "--node-rank", str(n), "--peers", self.peers,
                                     "--secret-file", self.secret, "--disk", self.disk(n), "--disk-every", "5",
                                     *self.s3, "--s3-every", "10", "--heartbeat", "0.2", "--dead-after", "2")

    def lose_memory(self, n: int) -> None:
        kill9(self.agents.pop(n))
        shutil.rmtree(self.shm(n))

    def run(self, out: str, *args: str, hang: bool = False, restarts: int = 0) -> None:
        port = free_port()
        jobs = [_torchrun(n, port, out, "--job", "mission", "--shm", self.shm(n), "--no-spawn", *args, hang=hang,
                          restarts=restarts)
                for n in (0, 1)]
        if hang:
            for j in jobs:
                for line in j.stdout:
                    if "STAGED" in line:
                        break
            for j in jobs:
                kill_torchrun(j)
            return
        for j in jobs:
            _, err = j.communicate(timeout=300)
            # the ranks' own errors first: torchrun's summary at the end hides them
            assert j.returncode == 0, "\n".join(ln for ln in err.splitlines() if "Error" in ln)[-3000:]

    def close(self) -> None:
        for a in self.agents.values():
            a.terminate()
        for a in self.agents.values():
            a.wait(60)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("mission-ref")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(2 * NPROC),
           TRAINER, "--fsdp", "--gpt", "--steps", str(STEPS), "--out", str(d / "ev"), "--job", "ref",
           "--shm", str(d / "shm")]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return {r: losses(read_events(f"{d / 'ev'}.{r}")) for r in range(2 * NPROC)}


@pytest.mark.parametrize("lost,step,tiers", [
    # node 1 comes back empty: its agent pulls its ranks' shards from node 0's memory at start (warm
    # restore), and its ranks wait for that and read their own node's memory
    ("node1", HANG, {r: "memory" for r in range(4)}),
    ("all-memory", 10, {r: "disk" for r in range(4)}),
    ("memory+disk", 10, {r: "s3" for r in range(4)}),
])
def test_two_nodes_resume_bit_exact_from_fastest_surviving_tier(tmp_path, s3_bucket, reference, lost, step, tiers):
    endpoint, bucket = s3_bucket
    c = TwoNodes(tmp_path, endpoint, bucket)
    out = str(tmp_path / "ev")
    try:
        c.run(out, hang=True)
        if lost == "node1":
            c.lose_memory(1)
            c.start_agent(1)  # the replacement node: same place in the peer list, empty memory
        else:
            for n in (0, 1):
                c.lose_memory(n)
                if lost == "memory+disk":
                    shutil.rmtree(c.disk(n))
            for n in (0, 1):
                c.start_agent(n)
        c.run(out)
    finally:
        c.close()
    for rank in range(4):
        events = read_events(f"{out}.{rank}")
        restored = [e for e in events if "restored" in e]
        want = tiers[rank] if isinstance(tiers[rank], tuple) else (tiers[rank],)
        assert len(restored) == 1 and restored[0]["restored"] == step, (rank, restored)
        assert len(restored[0]["tiers"]) == 1 and restored[0]["tiers"][0] in want, (rank, restored)
        after = events[events.index(restored[0]) + 1:]
        assert [e["step"] for e in after] == list(range(step + 1, STEPS))
        assert {e["step"]: e["loss"] for e in after} == {s: reference[rank][s] for s in range(step + 1, STEPS)}



def test_rank_killed_torchrun_restarts_every_rank_and_they_resume_from_local_memory(tmp_path, s3_bucket, reference):
    """Case (a): rank 1 kill -9s itself after step 7 is saved; torchrun (--max-restarts 1) restarts all four
    ranks, each restores step 7 from its own node's memory before its first step, and the run finishes
    with the uninterrupted run's losses."""
    endpoint, bucket = s3_bucket
    c = TwoNodes(tmp_path, endpoint, bucket)
    out = str(tmp_path / "ev")
    try:
        c.run(out, "--kill-rank", "1", "--kill-at", "7", restarts=1)
    finally:
        c.close()
    for rank in range(4):
        events = read_events(f"{out}.{rank}")
        restored = [e for e in events if "restored" in e]
        assert restored == [{"restored": 7, "tiers": ["memory"]}], (rank, restored)
        i = events.index(restored[0])
        before, after = losses(events[:i]), events[i + 1:]
        assert before == {s: reference[rank][s] for s in range(8)}, rank
        assert [e["step"] for e in after] == list(range(8, STEPS))
        assert {e["step"]: e["loss"] for e in after} == {s: reference[rank][s] for s in range(8, STEPS)}
