"""Device adapters: which adapter serves which device type, what each one does with CPU tensors, and the
order the Checkpointer drives them in (a fake adapter stands in for a device this machine lacks).

The CUDA adapter's pinning, side stream and non-blocking copies need a GPU: the tests marked ``cuda`` run only
where one is available; here its bookkeeping runs against a stand-in for the CUDA runtime.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time

import pytest
import torch

import ckpt
from ckpt import _devices
from ckpt._devices import CpuAdapter, GenericAdapter, Staging, make_adapter, register_adapter, storage_key
from ckpt._devices.cuda import CudaAdapter

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _state(seed: int, device: str = "cpu") -> dict:
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 2))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    model.to(device)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 8, generator=g).to(device)).sum().backward()
    optim.step()
    return {"model": model, "optim": optim,
            "tensors": {"strided": torch.randn(6, 6, generator=g).t().to(device),
                        "bf16": torch.randn(33, generator=g).to(torch.bfloat16).to(device)}}


def _snapshot(state: dict) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v.cpu().clone() for k, v in state["model"].state_dict().items()}
    for i, s in state["optim"].state_dict()["state"].items():
        out.update({f"optim/{i}/{k}": v.cpu().clone() for k, v in s.items()})
    out.update({f"tensors/{k}": v.cpu().clone() for k, v in state["tensors"].items()})
    return out


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def _slot(items) -> tuple[torch.Tensor, list]:
    """A host buffer with room for ``items`` (tensors), and their (tensor, offset, nbytes) at 64-byte offsets."""
    out, off = [], 0
    for t in items:
        n = t.numel() * t.element_size()
        out.append((t, off, n))
        off = (off + n + 63) // 64 * 64
    return torch.zeros(max(off, 1), dtype=torch.uint8), out


# -- registry ---------------------------------------------------------------------------
def test_each_device_type_gets_its_adapter_and_unknown_types_the_generic_one(monkeypatch):
    assert type(make_adapter("cpu")) is CpuAdapter
    assert type(make_adapter("cuda")) is CudaAdapter
    assert type(make_adapter("privateuseone")) is GenericAdapter
    assert type(make_adapter("neuron")) is GenericAdapter
    monkeypatch.setattr(_devices, "_FACTORIES", dict(_devices._FACTORIES))  # the registration ends with the test
    register_adapter("neuron", CpuAdapter)
    assert type(make_adapter("neuron")) is CpuAdapter


def test_cpu_and_cuda_tensors_never_import_torch_xla():
    import subprocess
    import sys

    code = ("import sys, torch, ckpt._devices as d; from ckpt._flatten import flatten_state; "
            "m = torch.nn.Linear(2, 2); o = torch.optim.SGD(m.parameters()); d.make_adapter('cuda'); "
            "flatten_state({'m': m, 'o': o}, for_restore=True); d.storage_key(torch.zeros(1)); "
            "assert 'torch_xla' not in sys.modules")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


def test_storage_key_matches_a_parameter_with_its_state_dict_entry_only():
    m = torch.nn.Linear(3, 3)
    sd = m.state_dict()
    assert storage_key(m.weight) == storage_key(sd["weight"]) == storage_key(m.weight.detach())
    assert storage_key(m.weight) != storage_key(m.bias)
    assert storage_key(m.weight) != storage_key(m.weight.clone())


# -- cpu and generic ----------------------------------------------------------------------
def test_cpu_adapter_leaves_the_copies_to_the_checkpointer_and_restores_exactly():
    a, b = torch.randn(5), torch.arange(12).reshape(3, 4)
    buf, items = _slot([a, b])
    st = CpuAdapter().stage(items[:1], items[1:], buf)
    assert st.now == items[:1] and st.later == items[1:] and st.done is None
    target = torch.zeros(4, 3).t()  # strided: restored through a host buffer
    host = CpuAdapter().host_empty((3, 4), torch.float32)
    host.copy_(torch.arange(12.0).reshape(3, 4))
    CpuAdapter().restore([(target, host)])
    assert torch.equal(target, torch.arange(12.0).reshape(3, 4))


def test_generic_adapter_copies_every_tensor_to_the_host_at_once_and_keeps_the_layout():
    tensors = [torch.randn(7), torch.randn(4, 4).t(), torch.randint(0, 9, (3,)), torch.zeros(0)]
    buf, items = _slot(tensors)
    st = GenericAdapter().stage(items[:2], items[2:], buf)
    # all of them are host copies now, so all may go to the slot in the background
    assert st.now == [] and st.done is None
    assert [(off, n) for _, off, n in st.later] == [(off, n) for _, off, n in items]
    ckpt.Checkpointer._copy(buf, st.later)
    for (t, off, n) in items:
        if n:
            assert torch.equal(buf[off:off + n].view(t.dtype).view(t.shape), t)
    back = [torch.empty_like(t) for t in tensors]
    GenericAdapter().restore(list(zip(back, tensors)))
    assert all(torch.equal(x, y) for x, y in zip(back, tensors))


# -- cuda, without a GPU --------------------------------------------------------------------
class FakeCudart:
    """Records cudaHostRegister / cudaHostUnregister; ``fail`` makes registration return an error."""

    def __init__(self, fail: int = 0) -> None:
        self.calls: list[tuple] = []
        self.fail = fail

    def cudaHostRegister(self, ptr: int, n: int, flags: int) -> int:
        self.calls.append(("register", ptr, n, flags))
        return self.fail

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr))
        return 0

    def cudaGetLastError(self) -> int:
        self.calls.append(("get_last_error",))
        return 0


def test_cuda_adapter_pins_each_slot_once_and_unpins_it_before_it_is_unmapped():
    rt = FakeCudart()
    ad = CudaAdapter(cudart=rt, pin=True)
    a, b = torch.zeros(4096, dtype=torch.uint8), torch.zeros(100, dtype=torch.uint8)
    for _ in range(3):
        ad.prepare_host(a)
    ad.prepare_host(b)
    assert rt.calls == [("register", a.data_ptr(), 4096, 1), ("register", b.data_ptr(), 100, 1)]
    assert ad.pinned(a) and ad.pinned(b)
    ad.release_host(a)
    ad.release_host(a)
    ad.release_host(torch.zeros(3, dtype=torch.uint8))  # never pinned: nothing to undo
    assert rt.calls[2:] == [("unregister", a.data_ptr())] and not ad.pinned(a)


def test_cuda_adapter_keeps_working_unpinned_when_registration_fails(caplog):
    rt = FakeCudart(fail=712)
    ad = CudaAdapter(cudart=rt, pin=True)
    buf = torch.zeros(64, dtype=torch.uint8)
    ad.prepare_host(buf)
    assert not ad.pinned(buf) and "cudaError 712" in caplog.text
    ad.release_host(buf)
    # the failed call's error is reset at once: left as the runtime's last error, torch raises it after the
    # next kernel launch on this thread
    assert [c[0] for c in rt.calls] == ["register", "get_last_error"]
    caplog.clear()
    ad.prepare_host(torch.zeros(32, dtype=torch.uint8))
    assert "could not pin" not in caplog.text  # said once


def test_cuda_adapter_without_cuda_pins_nothing_and_restores_host_tensors():
    ad = CudaAdapter(cudart=FakeCudart(), pin=False)
    buf = torch.zeros(64, dtype=torch.uint8)
    ad.prepare_host(buf)
    assert not ad.pinned(buf) and ad._cudart.calls == []
    host = ad.host_empty((2, 3), torch.float64)
    assert not host.is_pinned()
    host.copy_(torch.arange(6.0).reshape(2, 3))
    dst = torch.zeros(3, 2).t()
    ad.restore([(dst, host)])
    assert torch.equal(dst, host)


# -- the Checkpointer drives adapters ------------------------------------------------------------
class GateAdapter(CpuAdapter):
    """Stands in for an asynchronous device: ``stage`` snapshots the tensors (as a DMA engine would read
    them) and its copies "land" only when the test opens ``gate``."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.events: list[str] = []
        self.staged: list[tuple[int, int]] = []
        self.restored: list[torch.Tensor] = []

    def prepare_host(self, buf):
        self.events.append("prepare")

    def release_host(self, buf):
        self.events.append("release")

    def stage(self, now, later, buf):
        self.staged.append((len(now), len(later)))
        self.events.append("stage")
        pending = [(t.clone(), off, n) for t, off, n in now + later]

        def done():
            self.gate.wait(30)
            ckpt.Checkpointer._copy(buf, pending)
            self.events.append("done")

        return Staging([], [], done)

    def restore(self, pairs):
        self.restored += [t for t, _ in pairs]
        super().restore(pairs)


def test_save_returns_before_the_device_copies_land_and_the_optimizer_step_waits_for_them(tmp_path, monkeypatch):
    gate = GateAdapter()
    monkeypatch.setitem(_devices._FACTORIES, "cpu", lambda: gate)
    state = _state(0)
    snap = _snapshot(state)
    with ckpt.Checkpointer("gate", shm=str(tmp_path / "shm")) as ck:
        fut = ck.save(1, state)
        assert gate.events == ["prepare", "stage"]
        # every tensor of the step in one call; the BatchNorm buffers and plain tensors must be read at once
        assert gate.staged[0] == (5, len(snap) - 5)
        assert not fut.staged()
        # the next step changes everything in place; the snapshot must not see it
        with torch.no_grad():
            for p in state["model"].parameters():
                p.add_(1)
        stepped = threading.Thread(target=state["optim"].step)
        stepped.start()
        time.sleep(0.3)
        assert stepped.is_alive() and not fut.staged()  # the pre-hook holds the optimizer
        gate.gate.set()
        stepped.join(10)
        assert not stepped.is_alive() and fut.staged()
        fut.wait()
        # (the ring's next slots are prepared on the leaser thread once the save is in)
        assert [e for e in gate.events if e != "prepare"][-1] == "done"
        fresh = _state(1)
        assert ck.restore(fresh) == 1
        _assert_same(_snapshot(fresh), snap)
        # the strided tensor was read into a host buffer and handed to the adapter
        assert any(t is fresh["tensors"]["strided"] for t in gate.restored)
    assert gate.events[-1] == "release"


class PrepareRecorder(CpuAdapter):
    """Records the slots ``prepare_host`` saw (by data_ptr), and on which thread."""

    def __init__(self) -> None:
        self.prepared: dict[int, str] = {}

    def prepare_host(self, buf):
        self.prepared.setdefault(buf.data_ptr(), threading.current_thread().name)


def test_ring_slots_mapped_ahead_are_prepared_before_a_save_uses_them(tmp_path, monkeypatch):
    rec = PrepareRecorder()
    monkeypatch.setitem(_devices._FACTORIES, "cpu", lambda: rec)
    state = _state(0)
    with ckpt.Checkpointer("ahead", shm=str(tmp_path / "shm")) as ck:
        ck.save(1, state).wait()
        ck._leaser.submit(lambda: None).result()  # the ring's other slots are mapped by now
        slots = [buf for _, _, buf in ck._maps.values() if buf is not None]
        assert len(slots) >= 2
        # every mapped slot is prepared (pinned, on CUDA) already; all but the first save's, off the training thread
        assert all(b.data_ptr() in rec.prepared for b in slots)
        ahead = [rec.prepared[b.data_ptr()] for b in slots]
        assert sum(name.startswith("tierckpt-lease") for name in ahead) == len(slots) - 1
        for step in (2, 3, 4):
            ck.save(step, state).wait()
        assert all(b.data_ptr() in rec.prepared for _, _, b in ck._maps.values() if b is not None)


# -- cuda, for real ------------------------------------------------------------------------------
@pytest.fixture
def tmpfs(tmp_path):
    """A memory folder on tmpfs (/dev/shm) where there is one: on an H200 machine, registering a slot under
    /tmp, on a disk, failed (cudaError 1), one on /dev/shm never did."""
    if not os.path.isdir("/dev/shm"):
        yield str(tmp_path / "shm")
        return
    d = tempfile.mkdtemp(dir="/dev/shm", prefix="tierckpt-test-")
    try:
        yield os.path.join(d, "shm")
    finally:
        shutil.rmtree(d, ignore_errors=True)


@cuda
def test_cuda_state_is_staged_through_a_pinned_slot_on_a_side_stream_and_restored_exactly(tmpfs):
    state = _state(0, "cuda")
    snap = _snapshot(state)
    with ckpt.Checkpointer("cuda", shm=tmpfs) as ck:
        fut = ck.save(1, state)
        # the next step's kernels change buffers in place at once: the compute stream waits for their copies
        with torch.no_grad():
            state["model"][1].running_mean.add_(1)
            state["tensors"]["bf16"].mul_(2)
        fut.wait()
        slots = [buf for _, _, buf in ck._maps.values() if buf is not None]
        assert slots and all(ck._devices["cuda"].pinned(b) and b.is_pinned() for b in slots)
        fresh = _state(1, "cuda")
        assert ck.restore(fresh) == 1
    assert all(p.is_cuda for p in fresh["model"].parameters()) and fresh["tensors"]["strided"].is_cuda
    _assert_same(_snapshot(fresh), snap)


@cuda
def test_agent_started_by_a_process_that_initialised_cuda_is_a_new_program_without_cuda(tmpfs):
    torch.zeros(1, device="cuda")  # the CUDA context exists before the agent is started
    state = _state(0, "cuda")
    snap = _snapshot(state)
    with ckpt.Checkpointer("cuda-spawn", shm=tmpfs) as ck:
        assert ck._started_agent
        pid = ck._client.call("hello")["pid"]
        with open(f"/proc/{pid}/maps") as f:
            maps = f.read()
        # exec'd, not forked: no CUDA driver and no torch in the agent
        assert "libcuda" not in maps and "libtorch" not in maps
        ck.save(1, state).wait()
        fresh = _state(1, "cuda")
        assert ck.restore(fresh) == 1
        cuda_ad = ck._devices["cuda"]
    _assert_same(_snapshot(fresh), snap)
    assert not cuda_ad._registered  # every slot unpinned before it was unmapped


@cuda
def test_cuda_optimizer_step_right_after_save_changes_nothing_in_the_checkpoint(tmpfs):
    torch.manual_seed(0)
    # big enough that the device-to-host copies are still running when the optimizer step is queued
    model = torch.nn.Sequential(*(torch.nn.Linear(2048, 2048) for _ in range(8))).cuda()
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    x = torch.randn(64, 2048, device="cuda")
    model(x).square().mean().backward()
    optim.step()
    state = {"model": model, "optim": optim}
    with ckpt.Checkpointer("cuda-race", shm=tmpfs) as ck:
        for step in range(3):
            want = {k: v.cpu().clone() for k, v in model.state_dict().items()}
            fut = ck.save(step, state)
            model(x).square().mean().backward()
            optim.step()  # waits for the copies: the checkpoint holds the parameters from before it
            optim.zero_grad()
            fut.wait()
            fresh = torch.nn.Sequential(*(torch.nn.Linear(2048, 2048) for _ in range(8))).cuda()
            fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=0.1)
            fresh(x).sum().backward()
            fresh_optim.step()
            assert ck.restore({"model": fresh, "optim": fresh_optim}, step=step) == step
            got = {k: v.cpu() for k, v in fresh.state_dict().items()}
            _assert_same(got, want)


class RefusingCudart:
    """The real CUDA runtime, except that registration is asked for 0 bytes: it fails as a refused pin does,
    and leaves the runtime's last error set, as a refusal does."""

    def __init__(self) -> None:
        self.rt = torch.cuda.cudart()

    def cudaHostRegister(self, ptr: int, n: int, flags: int):
        return self.rt.cudaHostRegister(ptr, 0, flags)

    def cudaHostUnregister(self, ptr: int):
        return self.rt.cudaHostUnregister(ptr)


@cuda
def test_cuda_saves_stay_exact_and_training_goes_on_when_the_slot_cannot_be_pinned(tmp_path, monkeypatch):
    monkeypatch.setitem(_devices._FACTORIES, "cuda", lambda: CudaAdapter(cudart=RefusingCudart(), pin=True))
    state = _state(0, "cuda")
    snap = _snapshot(state)
    with ckpt.Checkpointer("cuda-unpinned", shm=str(tmp_path / "shm")) as ck:
        for step in (1, 2):  # the second save stages into slots the leaser thread failed to pin
            fut = ck.save(step, state)
            # kernel launches on the training thread right after the failed registration
            with torch.no_grad():
                state["model"][1].running_mean.add_(1)
            state["model"](torch.randn(4, 8, device="cuda")).sum().backward()
            fut.wait()
        slots = [buf for _, _, buf in ck._maps.values() if buf is not None]
        assert slots and not any(ck._devices["cuda"].pinned(b) for b in slots)
        fresh = _state(1, "cuda")
        assert ck.restore(fresh, step=1) == 1
    _assert_same(_snapshot(fresh), snap)
