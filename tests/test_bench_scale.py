"""The scale benchmark's agents part runs end to end on a tiny cluster and leaves nothing behind."""

from __future__ import annotations

import os
import sys

import pytest

from procs import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_scale  # noqa: E402

pytestmark = pytest.mark.e2e


def test_two_agents_save_one_step_and_the_tables_have_a_row_per_n_and_figure():
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    run = bench_scale.run_agents(2, ranks_per_node=2, shard_bytes=4096, steps=1, idle_seconds=1.0,
                                 settle_seconds=0.5, step_timeout=20.0, max_seconds=25.0, log=lambda s: None)
    assert run.notes == []
    assert len(run.steps) == 1
    step = run.steps[0]
    assert step.complete and step.errors == [] and step.skipped == 0
    # node 1's two rows go up to the root (node 0) in one or two messages (coalesced when the second is
    # ready while the first is in flight); the manifest comes down to node 1 in one
    assert 1 <= step.rx_commits[0] <= 2 and step.rx_commits[1] == 1, step.rx_commits
    assert step.tx_msgs == step.rx_msgs[::-1]
    assert all(b > 0 for b in step.tx_bytes)
    assert run.false_deaths == 0 and run.answered_503 == 0 and run.refused_connections == 0

    steps = bench_scale.step_table([run]).splitlines()
    idle = bench_scale.idle_table([run], cores=os.cpu_count()).splitlines()
    assert len(steps) == 3 and steps[2].startswith("| 2 ") and "1/1" in steps[2]
    assert len(idle) == 3 and idle[2].startswith("| 2 ")
    table, _ = bench_scale.extrapolation_table([run, run])
    assert len(table.splitlines()) == 2 + len(bench_scale._figures([run]))

    left = set(os.listdir("/dev/shm")) - before if before else set()
    assert not [n for n in left if n.startswith("bench-scale-")]
    assert len(run.pids) == 2
    for pid in run.pids:  # stopped and reaped: no process left behind
        assert not os.path.exists(f"/proc/{pid}")
