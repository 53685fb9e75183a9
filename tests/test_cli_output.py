"""What the ``ckpt`` CLI prints: ``show`` with every rank's values, ``gc`` saying what it frees, and a quiet
exit when whoever reads the output goes away (``ckpt list JOB | head -1``).

End to end: a real agent process takes shards as trainers hand them over (rank by rank, over its socket), and
the CLI runs as a user runs it, its output into a real pipe.
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import subprocess
import sys
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agents.config import socket_path_for
from agents.protocol import AgentClient
from procs import agent_call, ckpt_cmd, env, start_agent
from tiers import keys
from tiers.index import read_index
from tiers.memory import MemoryTier

JOB = "out"
MIB = 1 << 20


def _stage(shm: str, step: int, rank: int, world: int, values: dict, tensors: int = 1) -> bytes:
    """Hand the agent ``rank``'s shard of ``step`` (1 MiB) with ``tensors`` uint8 entries and JSON ``values``, as a
    trainer would: rank r holds the r-th piece of each tensor. Returns the shard's bytes."""
    data = os.urandom(MIB)
    with AgentClient(socket_path_for(shm)) as c:
        slot = c.call("begin", job=JOB, rank=rank, world=world, nbytes=MIB)["slot"]
        with open(slot, "r+b") as f, mmap.mmap(f.fileno(), MIB) as mm:
            mm[:] = data
        n = MIB // tensors
        entries = [{"kind": "tensor", "name": f"model/layers.{i}.weight", "dtype": "uint8",
                    "global_shape": [world * n], "offsets": [rank * n], "shape": [n], "offset": i * n, "nbytes": n}
                   for i in range(tensors)]
        entries += [{"kind": "json", "name": name, "value": v} for name, v in values.items()]
        c.call("commit", job=JOB, step=step, rank=rank, world=world, slot=slot, nbytes=MIB, entries=entries,
               save_index=step)
    return data


def _save(shm: str, step: int, per_rank: list[dict], tensors: int = 1) -> list[bytes]:
    """Step ``step`` of a world of ``len(per_rank)`` ranks, rank r with JSON values ``per_rank[r]``; each rank's
    shard bytes."""
    shards = [_stage(shm, step, rank, len(per_rank), values, tensors) for rank, values in enumerate(per_rank)]
    rep = agent_call(shm, "wait", job=JOB, step=step, timeout=120)
    assert rep["done"] and not rep["errors"], rep
    return shards


@pytest.fixture
def agent(tmp_path):
    shm = str(tmp_path / "shm")
    proc = start_agent(shm, "--keep-memory", "4")
    try:
        yield shm
    finally:
        proc.terminate()
        proc.wait(60)


# ---------------------------------------------------------------------- show
def test_show_prints_every_ranks_values_once_when_equal_and_per_rank_when_not(agent):
    _save(agent, 3, [{"data/epoch": 2, "data/pos": 100, "data/dp_rank": 0, "data/only0": "x"},
                     {"data/epoch": 2, "data/pos": 250, "data/dp_rank": 1},
                     {"data/epoch": 2, "data/pos": 250, "data/dp_rank": 2}])
    p = ckpt_cmd("show", JOB, "--shm", agent, check=True)
    lines = p.stdout.splitlines()
    assert "data/epoch = 2" in lines, p.stdout  # the same on every rank: once
    assert "data/pos [rank 0] = 100" in lines and "data/pos [rank 1-2] = 250" in lines, p.stdout
    assert {"data/dp_rank [rank 0] = 0", "data/dp_rank [rank 1] = 1", "data/dp_rank [rank 2] = 2"} <= set(lines)
    assert 'data/only0 [rank 0] = "x"' in lines, p.stdout  # held by rank 0 alone: said so


# ---------------------------------------------------------------------- a closed pipe
def _run_into(args: list[str], pipe_w: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ckpt.cli", *args], stdout=pipe_w, stderr=subprocess.PIPE,
                            text=True, env=env())


def _assert_quiet_pipe_exit(proc: subprocess.Popen, statuses=(141,)) -> None:
    _, err = proc.communicate(timeout=120)
    assert err == "", err  # no "Broken pipe" error, no traceback, no "Exception ignored"
    assert proc.returncode in statuses, (proc.returncode, err)


@pytest.mark.parametrize("args", [["list", JOB], ["--help"], ["show", JOB]], ids=["list", "help", "show"])
def test_output_into_a_pipe_whose_reader_is_gone_exits_quietly_with_141(agent, args):
    _save(agent, 1, [{"data/pos": 1}])
    r, w = os.pipe()
    os.close(r)  # the reader went away before the first line: every write fails with EPIPE
    proc = _run_into([*args, "--shm", agent] if args != ["--help"] else args, w)
    os.close(w)
    # argparse's help is written whole or not at all, and it ignores the error: 0 is the shell's usual status
    _assert_quiet_pipe_exit(proc, (0, 141) if args == ["--help"] else (141,))


def test_show_piped_into_a_reader_that_stops_after_the_first_line_exits_quietly_with_141(agent):
    # 600 tensors: a table far larger than the pipe can hold, so the CLI is still writing when the reader stops
    _save(agent, 1, [{"data/pos": 1}], tensors=600)
    r, w = os.pipe()
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 4096)
    proc = _run_into(["show", JOB, "--shm", agent], w)
    os.close(w)
    first = b""
    while not first.endswith(b"\n"):
        got = os.read(r, 1)
        assert got, "the CLI wrote nothing"
        first += got
    assert first.startswith(b"job out  step 1"), first
    os.close(r)
    _assert_quiet_pipe_exit(proc)


# ---------------------------------------------------------------------- gc
def _files(shm: str) -> set[str]:
    """The job's files in the memory folder (objects and staging slots), by path."""
    return {os.path.join(folder, f) for top in (os.path.join(shm, JOB), os.path.join(shm, ".slots", JOB))
            for folder, _, files in os.walk(top) for f in files}


def _held(shm: str) -> tuple[int, int]:
    """(bytes of the job's files in the memory folder, each file's memory counted once; staging slot files)."""
    seen: dict[tuple[int, int], int] = {}
    slots = 0
    for top in (os.path.join(shm, JOB), os.path.join(shm, ".slots", JOB)):
        for folder, _, files in os.walk(top):
            for f in files:
                st = os.lstat(os.path.join(folder, f))
                seen[(st.st_dev, st.st_ino)] = st.st_size
                slots += f.startswith("slot-")
    return sum(seen.values()), slots


def _fmt(n: int) -> str:
    from ckpt.cli import _fmt_bytes

    return _fmt_bytes(n)


def _gc(shm: str, *args: str) -> list[str]:
    """Run ``ckpt gc JOB ARGS`` after a dry run of it, which must remove nothing and say what the run then says it
    did; the run's lines."""
    before = _files(shm)
    dry = ckpt_cmd("gc", JOB, *args, "--shm", shm, "--dry-run", check=True).stdout.splitlines()
    assert _files(shm) == before, "a dry run removed files"
    assert dry[-1].endswith(" (dry run: nothing was removed)"), dry
    real = ckpt_cmd("gc", JOB, *args, "--shm", shm, check=True).stdout.splitlines()
    said = [ln.replace("would remove ", "removed ").replace("would free ", "freed ") for ln in dry]
    said[-1] = said[-1].removesuffix(" (dry run: nothing was removed)")
    assert said == real, (dry, real)
    return real


def test_gc_all_says_how_many_steps_and_bytes_it_frees_from_the_memory_tier_slots_included(tmp_path):
    """A finished job whose memory tier kept one step: its other staging slots hold memory too (free, kept for
    reuse); gc frees those and says so, and ``gc --all`` frees and counts the rest. A dry run says the same and
    removes nothing."""
    shm = str(tmp_path / "shm")
    proc = start_agent(shm, "--keep-memory", "1")
    try:
        for step in (1, 2, 3):
            _save(shm, step, [{"data/pos": step}, {"data/pos": step}])
        memory = MemoryTier(shm)
        deadline = time.monotonic() + 60  # retention trims after the wait is answered
        while {keys.parse_key(k).step for k in memory.list(keys.job_prefix(JOB))
               if keys.parse_key(k) is not None} != {3} or set(read_index(memory, JOB).rows) != {3}:
            assert time.monotonic() < deadline, memory.list(keys.job_prefix(JOB))
            time.sleep(0.05)
        held, slots = _held(shm)
        assert held > 2 * MIB and slots > 2, (held, slots)  # more than step 3's two shards: free slots
        layouts = len(memory.list(keys.layouts_prefix(JOB)))
        # no step is stale, but the job's free slots go (the agent leases new ones when a save needs them)
        lines = _gc(shm)
        kept, kept_slots = _held(shm)
        kept_files = _files(shm)
        assert 0 < kept_slots < slots and kept < held, (kept, kept_slots)
        assert f"freed {_fmt(held - kept)} in memory ({shm}): 0 step(s), {slots - kept_slots} staging slot(s)" \
            in lines, lines
        assert f"freed {_fmt(held - kept)} in all: 0 step(s) from 1 tier(s)" in lines, lines
        lines = _gc(shm)
        assert f"nothing to free in memory ({shm})" in lines, lines
        assert _files(shm) == kept_files
        lines = _gc(shm, "--all", "--force")
        assert _held(shm) == (0, 0), "gc --all left files of the job in the memory folder"
        assert (f"freed {_fmt(kept)} in memory ({shm}): 1 step(s), {layouts} layout object(s), "
                f"{kept_slots} staging slot(s)") in lines, lines
        assert f"freed {_fmt(kept)} in all: 1 step(s) from 1 tier(s)" in lines, lines
    finally:
        proc.terminate()
        proc.wait(60)


def test_a_broken_pipe_that_is_not_the_output_is_an_error_line_not_a_quiet_exit():
    """A socket or pipe of the command's own breaking (an agent that went away mid-call) is an error to report,
    while stdout's reader is still there."""
    code = ("import sys, ckpt.cli as c\n"
            "def boom(a): raise BrokenPipeError(32, 'Broken pipe (the agent went away)')\n"
            "c.cmd_list = boom\n"
            "sys.exit(c.main(['list', 'j']))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env(), timeout=120)
    assert p.returncode == 1, (p.returncode, p.stderr)
    assert p.stderr.strip().splitlines() == ["ckpt: error: [Errno 32] Broken pipe (the agent went away)"], p.stderr


def test_gc_into_a_pipe_whose_reader_is_gone_still_finishes_its_work(agent):
    """gc prints a line per step while it removes them: a reader that went away must not stop it halfway (the
    rest of the steps kept, the step index not rewritten)."""
    _save(agent, 5000, [{"data/pos": 1}])
    memory = MemoryTier(agent)
    stale = range(600)  # shards with no manifest, older than step 5000: never to be committed; lines > 16 KiB
    for step in stale:
        memory.put(keys.shard_key(JOB, step, 0), b"x")
    r, w = os.pipe()
    os.close(r)
    proc = _run_into(["gc", JOB, "--shm", agent], w)
    os.close(w)
    _assert_quiet_pipe_exit(proc)
    left = {keys.parse_key(k).step for k in memory.list(keys.job_prefix(JOB)) if keys.parse_key(k) is not None}
    assert left == {5000}, sorted(left)[:10]


def _unranges(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


@given(st.integers(1, 12).flatmap(lambda world: st.tuples(
    st.just(world), st.dictionaries(st.integers(0, world - 1), st.sampled_from([0, 1, "a", [1, 2], None]),
                                    min_size=1))))
def test_show_value_lines_give_back_every_ranks_value(case):
    from ckpt.cli import _value_lines

    world, by_rank = case
    lines = _value_lines({"v": by_rank}, world)
    if len(lines) == 1 and lines[0].startswith("v = "):
        assert len(by_rank) == world and len({json.dumps(x) for x in by_rank.values()}) == 1, (by_rank, lines)
        assert all(json.loads(lines[0][4:]) == x for x in by_rank.values())
        return
    got = {}
    for ln in lines:
        ranks, _, value = ln.removeprefix("v [rank ").partition("] = ")
        for r in _unranges(ranks):
            assert r not in got, (by_rank, lines)
            got[r] = json.loads(value)
    assert got == by_rank, (by_rank, lines)
