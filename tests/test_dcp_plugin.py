"""The DCP storage plug-in: dcp.save / dcp.async_save / dcp.load through the node agent.

One process for round trips, checkpoint ids, the overlap, damaged shards and the fallbacks; the
end-to-end test trains a Hugging Face LlamaForCausalLM with FSDP2 on 2 ranks (torchrun, gloo), kills it
with kill -9 and resumes it with dcp.load (tests/dcp_hf_trainer.py).
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings, strategies as st
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

import ckpt
from ckpt._dcp import step_of
from tiers.keys import MAX_STEP
from procs import HERE, ckpt_cmd, env, flip_byte, losses, read_events, start_agent, write_secret

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@dataclasses.dataclass
class Cursor:
    """A plain object in the state (DCP pickles it)."""

    epoch: int
    files: list


def _tensors(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "f32": torch.randn(7, 5, generator=g),
        "bf16": torch.randn(33, generator=g).to(torch.bfloat16),
        "int": torch.randint(-1000, 1000, (17,), generator=g),
        "bool": torch.rand(9, generator=g) > 0.5,
        "strided": torch.randn(6, 4, generator=g).t(),
        "scalar": torch.tensor(seed * 1.5),
        "empty": torch.empty(0, 3),
        "nested": {"deeper": {"w": torch.randn(3, 3, generator=g)}, "list": [torch.randn(2, generator=g)]},
    }


def _state(seed: int) -> dict:
    return {"t": _tensors(seed), "blob": bytes(range(seed % 7, 200)), "pair": (seed, "x"),
            "cursor": Cursor(seed, [f"f{seed}", None]), "n": seed, "meta": {"name": f"run-{seed}", "done": False}}


def _assert_equal(got: dict, want: dict) -> None:
    def walk(a, b, path):
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
        elif isinstance(b, dict):
            assert a.keys() == b.keys(), path
            for k in b:
                walk(a[k], b[k], f"{path}.{k}")
        elif isinstance(b, list) and any(isinstance(x, torch.Tensor) for x in b):
            for i, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{path}.{i}")
        else:
            assert type(a) is type(b) and a == b, (path, a, b)

    walk(got, want, "")


def _count_leases(w: ckpt.DcpWriter) -> list:
    calls: list = []
    orig = w._lease

    def lease(nbytes: int) -> str:
        calls.append(nbytes)
        return orig(nbytes)

    w._lease = lease
    return calls


@pytest.mark.parametrize("how", ["save", "async_save"])
def test_round_trip_through_the_agent_is_bit_exact_and_keeps_bytes_tuples_and_objects(tmp_path, how):
    saved = _state(3)
    with ckpt.DcpWriter("rt", shm=str(tmp_path / "shm")) as w:
        leases = _count_leases(w)
        if how == "save":
            dcp.save(saved, storage_writer=w, checkpoint_id=4)
        else:
            dcp.async_save(saved, storage_writer=w, async_stager=ckpt.DcpStager(w), checkpoint_id=4).result()
        # one slot per save: with the stager the tensors are written where it staged them, never copied again
        assert len(leases) == 1
        w.wait()
        target = _state(8)
        reader = w.reader(rewind=False)
        dcp.load(target, storage_reader=reader)
        assert reader.loaded_step == 4 and [r.tier for r in reader.reports] == ["memory"]
    _assert_equal(target, saved)


class _GrowingState:
    """Small when the stager sizes it, large when it is copied for DCP to serialise: the room the stager
    reserved is too small."""

    calls = 0

    def __reduce__(self):
        _GrowingState.calls += 1
        return (bytes, (b"x" * (16 if _GrowingState.calls % 2 else 65536),))


def test_values_larger_than_the_reserved_room_go_to_a_fresh_slot_without_starving_the_ring(tmp_path, monkeypatch):
    # a fallback that leased its fresh slot while holding the staged one ran the ring (keep_memory + 1 slots)
    # dry after keep_memory saves and waited for a slot forever
    monkeypatch.setenv("CKPT_SLOT_WAIT", "20")
    with ckpt.DcpWriter("grow", shm=str(tmp_path / "shm"), keep_memory=1) as w:
        stager = ckpt.DcpStager(w)
        leases = _count_leases(w)
        for step in range(4):
            sd = {"w": torch.full((64,), float(step)), "v": _GrowingState()}
            dcp.async_save(sd, storage_writer=w, async_stager=stager, checkpoint_id=step).result()
        assert len(leases) == 8  # the staged slot, then a fresh one that fits
        w.wait()
        target = {"w": torch.zeros(64), "v": b""}
        dcp.load(target, storage_reader=w.reader(rewind=False))
    assert torch.equal(target["w"], torch.full((64,), 3.0))
    assert target["v"] == b"x" * 65536


def test_a_large_value_dcp_pickles_is_warned_about_once_naming_it_and_its_size(tmp_path, caplog):
    """A non-tensor value over 1 MiB (an optimizer state put into a metadata value by mistake) is pickled
    by DCP on every save: the first save says so, naming the key and its size; later saves do not repeat
    it, and a small value is never named."""
    big = {"lists": [float(i) for i in range(200_000)]}  # about 2 MiB pickled
    with ckpt.DcpWriter("big", shm=str(tmp_path / "shm")) as w:
        with caplog.at_level(logging.WARNING, logger="tierckpt"):
            for step in (1, 2):
                dcp.save({"w": torch.ones(8), "meta": big, "small": {"epoch": 3}}, storage_writer=w,
                         checkpoint_id=step)
            w.wait()
        target = {"w": torch.zeros(8), "meta": {"lists": None}, "small": {"epoch": None}}
        dcp.load(target, storage_reader=w.reader(rewind=False))
    said = [r.getMessage() for r in caplog.records if "DCP pickles it" in r.getMessage()]
    assert len(said) == 1, said
    assert "'meta.lists'" in said[0] and " MiB at step 1" in said[0] and "small" not in said[0].split("DCP")[0]
    size = float(said[0].split("every save: ")[1].split(" MiB")[0])
    assert 1.0 < size < 4.0, said[0]
    assert target["meta"] == big and target["small"] == {"epoch": 3}


@pytest.mark.parametrize("cid,step", [(7, 7), ("7", 7), ("step-7", 7), ("/ckpt/job/step-7/", 7),
                                      (os.path.join("dump", "checkpoint", "step-12"), 12)])
def test_checkpoint_id_names_the_step(tmp_path, cid, step):
    with ckpt.DcpWriter("ids", shm=str(tmp_path / "shm")) as w:
        assert ckpt.DcpWriter.validate_checkpoint_id(cid) and ckpt.DcpReader.validate_checkpoint_id(cid)
        dcp.save({"x": torch.arange(4)}, storage_writer=w, checkpoint_id=cid)
        w.wait()
        assert w.reader(rewind=False).latest_step() == step
        got = {"x": torch.zeros(4, dtype=torch.int64)}
        dcp.load(got, storage_reader=w.reader(rewind=False), checkpoint_id=cid)
        assert torch.equal(got["x"], torch.arange(4))


@pytest.mark.parametrize("cid", ["latest", "step-x", "/ckpt/step-3/model", -1, 1.5, True, ""])
def test_checkpoint_id_that_names_no_step_is_refused_with_what_is_accepted(cid):
    assert not ckpt.DcpWriter.validate_checkpoint_id(cid)
    with pytest.raises(ValueError, match="names no step|invalid step"):
        step_of(cid)


def test_a_save_without_checkpoint_id_is_refused_even_after_one_with_an_id(tmp_path):
    with ckpt.DcpWriter("noid", shm=str(tmp_path / "shm")) as w:
        dcp.save({"x": torch.ones(2)}, storage_writer=w, checkpoint_id=1)
        for _ in range(2):  # not step 1 again: each save names its own step
            with pytest.raises(CheckpointException, match="no step to save: pass checkpoint_id"):
                dcp.save({"x": torch.ones(2)}, storage_writer=w)
        with pytest.raises(ValueError, match="names no step"):
            dcp.save({"x": torch.ones(2)}, storage_writer=w, checkpoint_id="latest")


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.integers(min_value=0, max_value=2**40), st.text(max_size=20)),
       st.sampled_from(["", "step-", "step_"]), st.sampled_from(["", "/a/b/", "a/"]))
def test_checkpoint_id_parses_exactly_its_step_or_says_why_not(value, prefix, folder):
    cid = f"{folder}{prefix}{value}"
    text = str(value)
    if text.isascii() and text.isdigit() and int(text) <= MAX_STEP:
        assert step_of(cid) == int(text)
    else:
        try:
            got = step_of(cid)
        except ValueError as e:
            assert "names no step" in str(e) or "invalid step" in str(e)
        else:  # text that is itself a path ending in a step
            assert cid.rstrip("/").endswith(str(got))


def test_unknown_step_and_job_raise_step_not_found(tmp_path):
    shm = str(tmp_path / "shm")
    with ckpt.DcpWriter("known", shm=shm) as w:
        dcp.save({"x": torch.ones(3)}, storage_writer=w, checkpoint_id=1)
        w.wait()
        with pytest.raises(ckpt.StepNotFoundError, match="step 9 of job 'known' is not complete"):
            dcp.load({"x": torch.zeros(3)}, storage_reader=w.reader(rewind=False), checkpoint_id=9)
        with ckpt.Checkpointer("other", shm=shm) as ck:
            other = ckpt.DcpReader(checkpointer=ck, rewind=False)
            assert other.latest_step() is None
            with pytest.raises(CheckpointException) as e:
                dcp.load({"x": torch.zeros(3)}, storage_reader=other)  # no id: met inside DCP's plan, wrapped
        assert "job 'other' has no step complete" in str(e.value)


def test_damaged_memory_shard_is_read_from_disk_and_with_no_intact_copy_load_fails_cleanly(tmp_path):
    shm, disk = str(tmp_path / "shm"), str(tmp_path / "disk")
    saved = {"w": torch.randn(256), "blob": b"position-17"}
    with ckpt.DcpWriter("dmg", shm=shm, disk=disk) as w:
        dcp.save(saved, storage_writer=w, checkpoint_id=2)
        w.wait()
        mem = os.path.join(shm, "dmg", "step-2", "rank-0.shard")
        [on_disk] = glob.glob(os.path.join(disk, "**", "rank-0.shard*"), recursive=True)
        flip_byte(mem, 100)
        got = {"w": torch.zeros(256), "blob": b""}
        reader = w.reader(rewind=False)
        dcp.load(got, storage_reader=reader)
        assert torch.equal(got["w"], saved["w"]) and got["blob"] == saved["blob"]
        assert [r.tier for r in reader.reports] == ["disk"]
        flip_byte(on_disk, 100 if not on_disk.endswith(("zst", "lz4")) else 10)
        before = {"w": torch.full((256,), 5.0), "blob": b"old"}
        with pytest.raises(CheckpointException) as e:
            dcp.load(before, storage_reader=w.reader(rewind=False), checkpoint_id=2)
        [err] = e.value.failures.values()
        err = err[0] if isinstance(err, tuple) else err  # DCP keeps (exception, traceback)
        assert isinstance(err, ckpt.RestoreError) and "could not be read intact from any tier" in str(err)
        assert before["blob"] == b"old"  # no value handed over from an unverified shard


def test_step_saved_through_the_plugin_is_listed_and_verified_by_the_cli(tmp_path):
    shm = str(tmp_path / "shm")
    with ckpt.DcpWriter("cli", shm=shm) as w:
        dcp.save({"model": {"w": torch.randn(8, 8)}, "loader": b"\x00" * 10}, storage_writer=w,
                 checkpoint_id="out/step-5")
        w.wait()
        v = ckpt_cmd("verify", "cli", "--step", "5", "--shm", shm)
    assert v.returncode == 0, v.stdout + v.stderr
    assert "ok" in v.stdout


# ------------------------------------------------------------------ the overlap, torchtitan-shaped state
class ModelWrapper(Stateful):
    """As torchtitan's: the model parts' state dict, flat."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict:
        return self.model.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.model.load_state_dict(sd)


class OptimizersContainer(Stateful):
    """As torchtitan's: optimizers behind one step() and one state dict."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))]

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self) -> None:
        for o in self.optimizers:
            o.zero_grad()

    def state_dict(self) -> dict:
        return {"opt0": self.optimizers[0].state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        self.optimizers[0].load_state_dict(sd["opt0"])


class Schedulers(Stateful):
    def __init__(self, optims: OptimizersContainer) -> None:
        self.scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (s + 1)) for o in optims.optimizers]

    def step(self) -> None:
        for s in self.scheds:
            s.step()

    def state_dict(self) -> dict:
        return self.scheds[0].state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.scheds[0].load_state_dict(sd)


class DataLoader(Stateful):
    def __init__(self) -> None:
        self.pos = 0

    def state_dict(self) -> dict:
        return {"dp_rank_0": f"pos={self.pos}".encode()}  # bytes, as torchtitan's

    def load_state_dict(self, sd: dict) -> None:
        self.pos = int(sd["dp_rank_0"].decode().split("=")[1])


class TrainState(Stateful):
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": torch.tensor(self.step, dtype=torch.int32)}

    def load_state_dict(self, sd: dict) -> None:
        self.step = int(sd["step"])


def _titan_state(seed: int, kind: str = "shaped") -> tuple[dict, torch.nn.Module, Any]:
    """torchtitan's checkpoint state: our look-alikes (``shaped``), or torchtitan's own ModelWrapper and
    OptimizersContainer (``torchtitan``)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8))
    if kind == "torchtitan":
        from torchtitan.components.checkpoint import ModelWrapper as TitanModelWrapper
        from torchtitan.components.optimizer import OptimizersContainer as TitanOptimizers
        from torchtitan.components.optimizer.optimizer import ParamGroupConfig

        group = ParamGroupConfig(pattern=".*", optimizer_name="AdamW",
                                 optimizer_kwargs={"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1})
        optims = TitanOptimizers(TitanOptimizers.Config(implementation="for-loop", param_groups=[group]),
                                 model_parts=[model])
        wrapper: Stateful = TitanModelWrapper(model)
    else:
        optims = OptimizersContainer(model)
        wrapper = ModelWrapper(model)
    state = {"model": wrapper, "optimizer": optims, "lr_scheduler": Schedulers(optims),
             "dataloader": DataLoader(), "train_state": TrainState()}
    return state, model, optims


def _train_step(model: torch.nn.Module, optims: Any, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    model(torch.randn(16, 64, generator=g)).square().mean().backward()
    optims.step()
    optims.zero_grad()


@pytest.mark.parametrize("kind", ["shaped", "torchtitan"])
def test_async_save_copy_overlaps_and_the_optimizer_step_waits_for_it_torchtitan_state(tmp_path, kind):
    state, model, optims = _titan_state(0, kind)
    with ckpt.DcpWriter("titan", shm=str(tmp_path / "shm")) as w:
        stager = ckpt.DcpStager(w)
        _train_step(model, optims, 0)  # the optimizer has stepped: its tensors are copied in the background
        state["dataloader"].pos, state["train_state"].step = 17, 1
        release, copying, waiting = threading.Event(), threading.Event(), threading.Event()
        ck = w.ck
        copy_parallel, wait_guarded = ck._copy_parallel, ck._wait_guarded

        def blocked_copy(buf, items):
            if items:
                copying.set()
                assert release.wait(120)
            copy_parallel(buf, items)

        def noted_wait(*a):
            waiting.set()
            wait_guarded(*a)

        ck._copy_parallel, ck._wait_guarded = blocked_copy, noted_wait
        ck._hook.remove()  # the hook calls the bound method it was given: register the noted one
        ck._hook = None
        ck._install_hook()
        try:
            before = {k: v.clone() for k, v in model.state_dict().items()}
            inner = optims.optimizers[0]
            opt_before = [{k: v.clone() for k, v in inner.state[p].items()} for p in model.parameters()]
            fut = dcp.async_save(state, storage_writer=w, async_stager=stager, checkpoint_id=1)
            # save returned while the parameters and optimizer state are still being copied
            assert copying.wait(60)
            assert not fut.done()
            stepped = threading.Event()

            def step() -> None:
                _train_step(model, optims, 1)
                stepped.set()

            t = threading.Thread(target=step)
            t.start()
            assert waiting.wait(60)  # the optimizer step reached the hook ...
            t.join(2)  # (time enough for a step that did not wait to end: this test would then fail below)
            assert not stepped.is_set()  # ... and waits there: no parameter has changed
            for k, v in model.state_dict().items():
                assert torch.equal(v, before[k]), k
            release.set()
            t.join(120)
            assert stepped.is_set()
            fut.result(120)
        finally:
            release.set()  # a failed check must not leave the copy (and close) waiting
        assert any(not torch.equal(v, before[k]) for k, v in model.state_dict().items())
        w.wait()
        restored, m2, o2 = _titan_state(5, kind)
        _train_step(m2, o2, 9)  # optimizer state to load into
        dcp.load(restored, storage_reader=w.reader(rewind=False))
    # the checkpoint holds the parameters as they were when save was called, not the next step's
    for k, v in m2.state_dict().items():
        assert torch.equal(v, before[k]), k
    for p, want in zip(m2.parameters(), opt_before):
        got = o2.optimizers[0].state[p]
        for k, v in want.items():
            assert torch.equal(got[k], v), k
    assert restored["dataloader"].pos == 17 and restored["train_state"].step == 1
    assert restored["optimizer"].optimizers[0].param_groups[0]["betas"] == (0.9, 0.95)


# ------------------------------------------------------------------ end to end: transformers + FSDP2 + torchrun
HF_TRAINER = os.path.join(HERE, "dcp_hf_trainer.py")
STEPS, HANG = 6, 2


@pytest.mark.e2e
def test_hf_llama_fsdp2_async_save_kill9_and_dcp_load_resume_bit_exact(tmp_path):
    """A transformers LlamaForCausalLM, FSDP2 on 2 ranks (torchrun, gloo), dcp.async_save every step through the
    plug-in; the job is killed with kill -9 after a committed step and resumed with dcp.load: the same losses
    and final state as an uninterrupted run, and the final step loads on 1 rank (resharded) exactly."""
    shm = str(tmp_path / "shm")

    def torchrun(out: str, *extra: str, hang: bool = False):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", HF_TRAINER,
               "--steps", str(STEPS), "--out", out, *extra]
        if not hang:
            p = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=600)
            assert p.returncode == 0, p.stderr[-3000:]
            return p
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env(),
                                start_new_session=True)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if "SAVED" in line:
                return proc
            assert line or proc.poll() is None, "torchrun job ended before its save"
        proc.kill()
        raise AssertionError("the job did not save in time")

    ref = str(tmp_path / "ref")
    torchrun(ref, "--job", "ref", "--shm", str(tmp_path / "refshm"), "--dump", ref + "-dump")
    agent = start_agent(shm)
    try:
        common = ["--job", "llama", "--shm", shm, "--no-spawn", "--dump", str(tmp_path / "dump")]
        job = torchrun(str(tmp_path / "ev"), *common, "--hang-after", str(HANG), hang=True)
        with open(f"/proc/{job.pid}/task/{job.pid}/children") as f:
            ranks = [int(x) for x in f.read().split()]
        for pid in ranks:
            os.kill(pid, signal.SIGKILL)
        os.killpg(job.pid, signal.SIGKILL)
        job.wait(30)
        torchrun(str(tmp_path / "ev"), *common)
        one = subprocess.run([sys.executable, HF_TRAINER, "--job", "llama", "--shm", shm, "--no-spawn", "--load-only",
                              "--out", str(tmp_path / "one"), "--dump", str(tmp_path / "one-dump")],
                             capture_output=True, text=True, env=env(), timeout=600)
        assert one.returncode == 0, one.stderr[-3000:]
    finally:
        agent.terminate()
        agent.wait(60)
    for rank in (0, 1):
        ev = read_events(f"{tmp_path / 'ev'}.{rank}")
        assert [e for e in ev if "restored" in e] == [{"restored": HANG, "tiers": ["memory"]}]
        ref_losses = losses(read_events(f"{ref}.{rank}"))
        assert len(ref_losses) == STEPS
        got = {e["step"]: e["loss"] for e in ev if "step" in e and e["step"] > HANG}
        assert got == {s: ref_losses[s] for s in range(HANG + 1, STEPS)}
        # one slot per save: every byte went where the stager put it (no fresh slot, no second copy)
        assert [e for e in ev if "saves" in e] == [{"saves": STEPS - HANG - 1, "leases": STEPS - HANG - 1}]
    want = torch.load(ref + "-dump", weights_only=True)
    for dump in (tmp_path / "dump", tmp_path / "one-dump"):
        got = torch.load(str(dump), weights_only=True)
        assert got.keys() == want.keys() and any(k.startswith("optim/") for k in want)
        for k in want:
            assert torch.equal(got[k], want[k]), f"{dump.name}: {k} differs"
    assert [e["restored"] for e in read_events(f"{tmp_path / 'one'}.0") if "restored" in e] == [STEPS - 1]


@pytest.mark.e2e
def test_rank_with_an_empty_plan_after_dedup_still_commits_so_the_step_completes(tmp_path):
    """A state replicated on 2 ranks: DCP's dedup writes it on one rank; the other commits an empty shard, the
    step's manifest is built, and both ranks load it (through dcp.save and through dcp.async_save + stager)."""
    shm = str(tmp_path / "shm")
    agent = start_agent(shm)
    try:
        p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            os.path.join(HERE, "dcp_dedup_job.py"), "--job", "dedup", "--shm", shm],
                           capture_output=True, text=True, env=env(), timeout=600)
    finally:
        agent.terminate()
        agent.wait(60)
    assert p.returncode == 0, p.stderr[-3000:]
    loaded = sorted(line.rsplit(" ", 1)[0] for line in p.stdout.splitlines() if line.startswith("LOADED"))
    assert loaded == [f"LOADED {s} {r} True" for s in (1, 2) for r in (0, 1)]
    for step in (1, 2):
        folder = os.path.join(shm, "dedup", f"step-{step}")
        assert os.path.exists(os.path.join(folder, "manifest.json"))
        assert sorted(os.listdir(folder)) == ["manifest.json", "rank-0.shard", "rank-1.shard"]
    # step 1 (no stager): one rank wrote the tensor, the other an empty shard
    sizes = sorted(os.path.getsize(os.path.join(shm, "dedup", "step-1", f"rank-{r}.shard")) for r in (0, 1))
    assert sizes[0] == 0 and sizes[1] >= 40


def test_closing_the_writer_right_after_async_save_commits_the_save_first(tmp_path):
    # closing shut the Checkpointer down under DCP's upload thread, which was still writing: the save failed
    shm = str(tmp_path / "shm")
    for step in range(3):
        model = torch.nn.Linear(256, 256)
        sd = {"m": model.state_dict(), "blob": b"y" * 50_000}
        w = ckpt.DcpWriter("closing", shm=shm)
        fut = dcp.async_save(sd, storage_writer=w, async_stager=ckpt.DcpStager(w), checkpoint_id=step)
        w.close()
        fut.result(120)
        with ckpt.DcpReader("closing", shm=shm, rewind=False) as r:
            got = {"m": torch.nn.Linear(256, 256).state_dict(), "blob": b""}
            dcp.load(got, storage_reader=r, checkpoint_id=step)
        assert torch.equal(got["m"]["weight"], sd["m"]["weight"]) and got["blob"] == sd["blob"]


def test_step_saved_through_the_plugin_reaches_s3_and_loads_from_it_alone(tmp_path, s3_bucket):
    endpoint, bucket = s3_bucket
    s3 = dict(s3=f"s3://{bucket}/ckpt", s3_endpoint=endpoint)
    saved = {"model": {"w": torch.randn(32, 16), "b": torch.randn(16)}, "loader": b"\x01\x02", "epoch": (3, "a")}
    with ckpt.DcpWriter("tos3", shm=str(tmp_path / "shm"), **s3) as w:
        dcp.save(saved, storage_writer=w, checkpoint_id="run/checkpoint/step-11")
        w.wait()  # written to S3, manifest last
    # another node: nothing in its memory, only S3 holds the step
    with ckpt.DcpReader("tos3", shm=str(tmp_path / "other"), **s3) as r:
        assert r.latest_step() == 11
        got = {"model": {"w": torch.zeros(32, 16), "b": torch.zeros(16)}, "loader": b"", "epoch": None}
        dcp.load(got, storage_reader=r)
        assert [x.tier for x in r.reports] == ["s3"]
    _assert_equal(got, saved)


@pytest.mark.e2e
def test_load_reads_the_shard_another_node_wrote_from_that_nodes_memory(tmp_path):
    """Two nodes (an agent each, no peer copies: --replicas 1), one rank on each. DCP's dedup has each rank
    write one of two replicated tensors, so each rank's load needs the other node's shard: it is read from
    that node's memory over the peer protocol."""
    from s3util import free_port

    peers, secret = str(tmp_path / "peers.txt"), write_secret(str(tmp_path / "secret"))
    ports = [free_port(), free_port()]
    with open(peers, "w") as f:
        f.write("".join(f"127.0.0.1:{p}\n" for p in ports))
    shms = [str(tmp_path / f"node{n}" / "shm") for n in (0, 1)]
    agents = []
    try:
        for n in (0, 1):
            os.makedirs(os.path.dirname(shms[n]))
            agents.append(start_agent(shms[n], "--node-rank", str(n), "--peers", peers, "--secret-file", secret,
                                      "--replicas", "1", "--heartbeat", "0.2", "--dead-after", "3"))
        port = free_port()
        jobs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
                                  "1", "--node-rank", str(n), "--master-addr", "127.0.0.1", "--master-port", str(port),
                                  os.path.join(HERE, "dcp_dedup_job.py"), "--job", "twonodes", "--shm", shms[n],
                                  "--two"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
                for n in (0, 1)]
        outs = [j.communicate(timeout=600) for j in jobs]
    finally:
        for a in agents:
            a.terminate()
        for a in agents:
            a.wait(60)
    for j, (out, err) in zip(jobs, outs):
        assert j.returncode == 0, err[-3000:]
    loaded = sorted(line for out, _ in outs for line in out.splitlines() if line.startswith("LOADED"))
    # every load read both shards: its own node's memory, and the other node's over the peer protocol
    assert loaded == [f"LOADED {s} {r} True memory,peer" for s in (1, 2) for r in (0, 1)]
    for n in (0, 1):  # no peer copies: each node's memory holds only its own rank's shard
        assert sorted(os.listdir(os.path.join(shms[n], "twonodes", "step-1"))) == ["manifest.json",
                                                                                   f"rank-{n}.shard"]
