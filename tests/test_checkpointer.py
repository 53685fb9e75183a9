"""The Checkpointer in one process: round trips, what a state may hold, errors raised once."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

import ckpt
from agents.config import Settings
from agents.daemon import Agent
from ckpt._flatten import flatten_state
from tiers import TierFullError
from tiers.disk import DiskTier


class Counter:
    """A DCP-style Stateful object."""

    def __init__(self) -> None:
        self.n = 0
        self.hist = torch.zeros(4)

    def state_dict(self) -> dict:
        return {"n": self.n, "hist": self.hist}

    def load_state_dict(self, sd: dict) -> None:
        self.n = sd["n"]
        self.hist = sd["hist"]


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 2))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    optim = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.9))
    model(torch.randn(4, 8, generator=g)).sum().backward()
    optim.step()
    c = Counter()
    c.n = seed
    c.hist = torch.randn(4, generator=g)
    return {
        "model": model, "optim": optim, "counter": c,
        "tensors": {
            "bf16": torch.randn(33, generator=g).to(torch.bfloat16),
            "half": torch.randn(5, 7, generator=g).half(),
            "int": torch.randint(-1000, 1000, (17,), generator=g),
            "bool": torch.rand(9, generator=g) > 0.5,
            "strided": torch.randn(6, 6, generator=g).t(),
            "scalar": torch.tensor(seed * 1.5),
            "empty": torch.empty(0, 3),
        },
        "loader": {"epoch": seed, "pos": [seed, seed + 1], "name": f"shard-{seed}", "done": False, "x": None},
    }


def _equal(a: dict, b: dict) -> None:
    for (n1, t1), (n2, t2) in zip(a["model"].state_dict().items(), b["model"].state_dict().items()):
        assert n1 == n2 and torch.equal(t1, t2), n1
    sa, sb = a["optim"].state_dict(), b["optim"].state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for k in sa["state"]:
        for kk, v in sa["state"][k].items():
            assert torch.equal(v, sb["state"][k][kk]), (k, kk)
    assert a["counter"].n == b["counter"].n and torch.equal(a["counter"].hist, b["counter"].hist)
    for k, t in a["tensors"].items():
        u = b["tensors"][k]
        assert t.dtype == u.dtype and t.shape == u.shape and torch.equal(t, u), k
    assert a["loader"] == b["loader"]


def test_round_trip_is_bit_exact_for_every_kind_of_state(tmp_path):
    saved = _state(1)
    # the memory tier outlives the job that wrote it only when asked to (by default a lower tier holding the
    # newest step frees it at the job's clean end: tests/test_slots_lifecycle.py)
    with ckpt.Checkpointer("rt", shm=str(tmp_path / "shm"), disk=str(tmp_path / "disk"),
                           keep_memory_after_close=True) as ck:
        assert ck.restore(_state(9)) is None
        fut = ck.save(5, saved)
        fut.wait()
    target = _state(2)
    with ckpt.Checkpointer("rt", shm=str(tmp_path / "shm"), disk=str(tmp_path / "disk")) as ck:
        assert ck.restore(target) == 5
        assert ck.last_restore.tiers == ["memory"]
    _equal(saved, target)


def _untrained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model and an AdamW that has not stepped."""
    g = torch.Generator().manual_seed(5)
    model = torch.nn.Linear(8, 4)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def _train(model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
    g = torch.Generator().manual_seed(6)
    for _ in range(3):
        model(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()


def test_a_fresh_start_or_a_failed_restore_leaves_an_optimizer_that_never_stepped_as_it_was(tmp_path):
    """Reading an optimizer's state through DCP's helper gives one that never stepped a state (a step with zero
    gradients: AdamW's step count 1). A fresh start, or a restore that fails, must not keep it: the job's first
    steps would then differ from the same job without checkpoints (Adam's bias correction is off by a step)."""
    plain, _ = _untrained()
    _train(plain, _)
    with ckpt.Checkpointer("fresh", shm=str(tmp_path / "shm")) as ck:
        for keep in (True, False):
            model, optim = _untrained()
            assert ck.restore({"model": model, "optim": optim}, keep_state=keep) is None
            assert not optim.state, keep
            _train(model, optim)
            assert float(optim.state[model.weight]["step"]) == 3
            assert torch.equal(model.weight, plain.weight) and torch.equal(model.bias, plain.bias)
    with ckpt.Checkpointer("other", shm=str(tmp_path / "shm2")) as ck:
        ck.save(0, {"model": torch.nn.Linear(8, 5)})  # another shape, no optimizer: the restore fails
        ck.wait()
        model, optim = _untrained()
        with pytest.raises(ckpt.StateMismatchError):
            ck.restore({"model": model, "optim": optim})
        assert not optim.state


def test_every_selects_steps_and_save_overlaps_until_optimizer_step(tmp_path):
    state = _state(3)
    model, optim = state["model"], state["optim"]
    with ckpt.Checkpointer("ev", shm=str(tmp_path / "shm"), every=3) as ck:
        assert ck.save(1, state) is None and ck.save(2, state) is None
        before = {k: v.clone() for k, v in model.state_dict().items()}
        fut = ck.save(3, state)
        assert fut is not None
        # the optimizer step waits for the copy, so the checkpoint holds the pre-step parameters
        model(torch.randn(4, 8)).sum().backward()
        optim.step()
        assert fut.staged()
        fut.wait()
        target = _state(4)
        ck.restore(target)
    for k, v in target["model"].state_dict().items():
        assert torch.equal(v, before[k]), k


def test_restore_into_mismatched_state_says_what_differs(tmp_path):
    with ckpt.Checkpointer("mm", shm=str(tmp_path / "shm")) as ck:
        ck.save(0, {"w": torch.zeros(4)})
        ck.wait()
        with pytest.raises(ckpt.StateMismatchError, match="w: the state has float32\\[5\\]"):
            ck.restore({"w": torch.zeros(5)})
        with pytest.raises(ckpt.StateMismatchError, match="has no other"):
            ck.restore({"w": torch.zeros(4), "other": torch.zeros(1)})
        with pytest.raises(ckpt.StepNotFoundError, match="step 7 of job 'mm' is not complete"):
            ck.restore({"w": torch.zeros(4)}, step=7)


def test_unsupported_values_are_refused_before_anything_is_written(tmp_path):
    with ckpt.Checkpointer("bad", shm=str(tmp_path / "shm")) as ck:
        with pytest.raises(ckpt.StateError, match="is a set"):
            ck.save(0, {"x": {1, 2}})
        with pytest.raises(ckpt.StateError, match="non-finite"):
            ck.save(0, {"x": float("nan")})
        model = torch.nn.Linear(2, 2)
        with pytest.raises(ckpt.StateError, match="put the model in the state"):
            ck.save(0, {"optim": torch.optim.SGD(model.parameters(), lr=1)})


class FullDisk(DiskTier):
    """A disk tier that is always full."""

    def put(self, key, src):
        raise TierFullError(28, f"no space left in disk tier at {self.root}: free space or lower retention (keep)")


def test_background_failure_is_raised_once_at_next_save_and_memory_keeps_working(tmp_path):
    settings = Settings.load({"shm": str(tmp_path / "shm"), "disk": str(tmp_path / "disk")}, env={})
    agent = Agent(settings)
    agent.disk = FullDisk(settings.disk)
    agent.lower = [agent.disk]
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    async def main():
        await agent.start()
        ready.set()
        await agent._stop.wait()
        await agent.stop()

    t = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    t.start()
    assert ready.wait(30)
    try:
        ck = ckpt.Checkpointer("full", shm=settings.shm, spawn=False)
        state = {"w": torch.arange(10.0)}
        ck.save(0, state).wait_staged()
        # the next slot, leased ahead on a background thread once the disk failed, leaves the error to the
        # training thread: taken by that lease, it could miss the wait() below (it did, 1 CI run in a few)
        deadline = time.monotonic() + 120
        while not agent.book._errors.get("full") and time.monotonic() < deadline:
            time.sleep(0.02)
        ck._prelease_fut.result(120)
        with ck._lock:
            ahead, ck._next_slot = ck._next_slot, None
        if ahead is not None:
            ck._lease_client.call("release", slot=ahead[0])
        ck._prelease(ck._planner.plan(flatten_state(state), False).total)
        assert agent.book._errors.get("full") and not ck._errors
        with pytest.raises(ckpt.CheckpointError, match="no space left in disk tier"):
            ck.wait()
        ck.wait()  # raised once, not again
        state["w"] += 1
        ck.save(1, state)
        with pytest.raises(ckpt.CheckpointError, match="step 1 could not be written to the disk tier"):
            ck.close()
        target = {"w": torch.zeros(10)}
        ck2 = ckpt.Checkpointer("full", shm=settings.shm, spawn=False)
        assert ck2.restore(target) == 1 and ck2.last_restore.tiers == ["memory"]
        assert torch.equal(target["w"], torch.arange(10.0) + 1)
        try:
            ck2.close()
        except ckpt.CheckpointError:
            pass
    finally:
        loop.call_soon_threadsafe(agent._stop.set)
        t.join(30)


def test_back_to_back_saves_never_deadlock_on_the_next_slot_lease(tmp_path, monkeypatch):
    """With a ring of two slots, saves that follow each other at once always get a slot, never skip."""
    monkeypatch.setenv("CKPT_SLOT_WAIT", "3")
    state = _state(5)
    model, optim = state["model"], state["optim"]
    with ckpt.Checkpointer("b2b", shm=str(tmp_path / "shm"), keep_memory=1) as ck:
        for step in range(12):
            if step % 2:
                model(torch.randn(4, 8)).sum().backward()
                optim.step()
            fut = ck.save(step, state)  # on even steps right after the previous save was staged
            assert fut is not None, ck.skipped
            fut.wait_staged()
        ck.wait()
        assert ck.skipped == []
        assert ck.latest_step() == 11


@pytest.mark.parametrize("env,warns", [
    ({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "3"}, True),
    ({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "3",
      "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}, False),
    ({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "0"}, False),
    ({}, False),
])
def test_restartable_torchrun_launch_without_fresh_store_per_attempt_is_warned_about(monkeypatch, env, warns):
    import warnings

    from ckpt.checkpointer import _warn_restart_store

    for k in ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_MAX_RESTARTS", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _warn_restart_store(0)
    hits = [w for w in seen if "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in str(w.message)]
    assert len(hits) == (1 if warns else 0)


def test_saves_after_resuming_from_an_older_step_replace_the_failed_runs_later_steps(tmp_path):
    """A job resumed from step 1 retakes steps 2 and 3: the agent drops what the earlier run left of them,
    and the next restore finds the new run's bytes, not the old ones."""
    from procs import start_agent

    shm = str(tmp_path / "shm")
    agent = start_agent(shm, "--keep-memory", "5")  # one node agent outlives both runs, as in a real job
    try:
        with ckpt.Checkpointer("rw", shm=shm, spawn=False) as ck:
            for step in (1, 2, 3):
                ck.save(step, {"w": torch.full((4,), float(step))})
            ck.wait()
        with ckpt.Checkpointer("rw", shm=shm, spawn=False) as ck:
            state = {"w": torch.zeros(4)}
            assert ck.restore(state, step=1) == 1 and torch.equal(state["w"], torch.full((4,), 1.0))
            for step in (2, 3):
                ck.save(step, {"w": torch.full((4,), 10.0 + step)})
            ck.wait()
            assert ck.restore(state) == 3
            assert torch.equal(state["w"], torch.full((4,), 13.0))
    finally:
        agent.terminate()
        agent.wait(60)
