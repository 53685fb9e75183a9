"""The restore benchmarks run from the project's install and print their tables (figures are not checked)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from procs import ROOT, env

pytestmark = pytest.mark.e2e


def test_profile_restore_prints_every_phase_for_memory_and_disk(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "profile_restore.py"), "--size-gib", "0.01",
                        "--runs", "2", "--shm", str(tmp_path)], capture_output=True, text=True, env=env(), timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = {ln.split("|")[1].strip(): ln for ln in p.stdout.splitlines() if ln.startswith("| ") and "---" not in ln}
    for what in ("verify (read + xxh3)", "finish (preadv into the tensors + state dicts)",
                 "restore from the tier, total", "preadv, 2 threads", "copy between two warm tensors (bound)"):
        assert what in rows, p.stdout
    assert "restore from memory:" in p.stdout and not os.listdir(tmp_path)  # its folders are removed
