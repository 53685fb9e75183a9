"""What a save remembers from the last one, attacked: names of a dict's entries, the shard's layout, the values'
JSON, and the slot leased ahead. Each remembered thing must give way as soon as the state differs, so a save
never writes stale data or puts bytes where the layout does not say they are."""

from __future__ import annotations

import errno
import math
import os
import threading

import pytest
import torch

import ckpt
from ckpt._flatten import StateError, flatten_state
from ckpt._shard_plan import ShardPlanner
from procs import agent_call
from tiers import keys
from tiers.errors import TierFullError
from tiers.manifest import VALUES_NAME, decode_value, parse_spilled
from tiers.memory import MemoryTier


def _names(state: dict) -> dict[str, object]:
    return {leaf.name: (leaf.tensor if leaf.tensor is not None else leaf.value) for leaf in flatten_state(state).leaves}


# ------------------------------------------------------------------------------------------- flattening
def test_names_follow_a_dicts_keys_when_they_change_between_flattens():
    t = torch.arange(3.0)
    assert _names({"a": {"x": t, "y": 1}}) == {"a/x": t, "a/y": 1}
    got = _names({"a": {"y": 2, "x": t}})  # the same keys in another order
    assert list(got) == ["a/y", "a/x"] and got["a/y"] == 2
    assert _names({"a": {"x": t, "z/w": 3}}) == {"a/x": t, "a/z~1w": 3}
    assert _names({"a": {"x": t}}) == {"a/x": t}


def test_int_and_str_keys_name_entries_apart_and_a_bool_key_is_refused_after_either():
    assert list(_names({"a": {"1": 5}})) == ["a/1"]
    assert list(_names({"a": {1: 5}})) == ["a/~i1"]
    assert list(_names({"a": {"1": 5}})) == ["a/1"]
    with pytest.raises(StateError, match="is a bool"):
        flatten_state({"a": {True: 5}})
    with pytest.raises(StateError, match="is a float"):
        flatten_state({"a": {1.0: 5}})


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_float_in_a_dict_is_refused_with_its_name(bad):
    with pytest.raises(StateError, match="a/lr is .*non-finite"):
        flatten_state({"a": {"x": torch.zeros(1), "lr": bad}})


def test_subclasses_of_scalars_and_tensors_take_the_general_path_and_keep_their_value():
    class Flag(int):
        pass

    p = torch.nn.Parameter(torch.ones(2))
    got = _names({"a": {"f": Flag(3), "p": p, "s": "x", "n": None, "b": False}})
    assert got["a/f"] == 3 and got["a/p"] is p and got["a/s"] == "x" and got["a/n"] is None and got["a/b"] is False


# ------------------------------------------------------------------------------------------- shard layout
def _staged(plan) -> torch.Tensor:
    """The slot as the Checkpointer fills it from ``plan``'s copies."""
    buf = torch.zeros(plan.total, dtype=torch.uint8)
    for src, off, n, _ in plan.copies:
        if n:
            buf[off:off + n].view(src.dtype).view(src.shape).copy_(src)
    return buf


def _same_value(a, b) -> bool:
    """Equal, of the same types all the way down, with the same sign of zero."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    return a == b


def _check(plan, state: dict) -> None:
    """Every chunk of the layout holds exactly its leaf's current bytes, every value is its current value, and
    nothing of the state is left out."""
    buf = _staged(plan)
    leaves = {leaf.name: leaf for leaf in flatten_state(state).leaves}
    chunks = {c.name: c for c in plan.layout.chunks}
    assert plan.total >= plan.layout.end
    values = {n: decode_value(v) for n, v in plan.values}
    for name, c in chunks.items():
        raw = buf[c.offset:c.offset + c.nbytes]
        if name == VALUES_NAME:
            assert not plan.values
            values = {e.name: decode_value(e.value) for e in parse_spilled(bytes(raw))}
        elif c.dtype == "bytes":
            assert bytes(raw) == leaves[name].value, name
        else:
            t = leaves[name].tensor
            assert c.dtype == str(t.dtype).removeprefix("torch.") and c.shape == tuple(t.shape), name
            assert torch.equal(raw.view(t.dtype).view(t.shape), t), name
    want = {n: leaf.value for n, leaf in leaves.items() if leaf.tensor is None and not isinstance(leaf.value, bytes)}
    assert values.keys() == want.keys()
    for n, v in want.items():
        assert _same_value(values[n], v if not isinstance(v, tuple) else v), (n, values[n], v)
    assert {n for n in chunks if n != VALUES_NAME} == {n for n, leaf in leaves.items()
                                                        if leaf.tensor is not None or isinstance(leaf.value, bytes)}


def test_the_layout_is_kept_while_the_state_keeps_its_shape_and_laid_out_again_when_anything_changes():
    pl = ShardPlanner()
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(4, 3, generator=g), "b": torch.zeros(3, dtype=torch.float16), "blob": b"abc",
             "lr": 0.1, "betas": (0.9, 0.95), "hist": [1, 2]}
    first = pl.plan(flatten_state(state), True)
    _check(first, state)
    state["w"].add_(1.0)  # new bytes, same shape: the same layout, the new bytes copied
    again = pl.plan(flatten_state(state), True)
    assert again.layout is first.layout and again.total == first.total
    _check(again, state)
    changes = [
        ("b", torch.zeros(3, dtype=torch.float32)),  # dtype
        ("w", torch.randn(3, 4, generator=g)),  # shape, same number of elements
        ("w", torch.randn(3, 5, generator=g)),  # shape and size
        ("extra", torch.ones(2, dtype=torch.int64)),  # a key added
        ("b", b"now bytes"),  # a tensor replaced by bytes under its name
        ("blob", b"longer bytes than before"),  # bytes of another length
        ("blob", torch.arange(4)),  # bytes replaced by a tensor
        ("lr", torch.tensor(0.5)),  # a value replaced by a tensor
    ]
    last = again.layout
    for key, new in changes:
        state[key] = new
        plan = pl.plan(flatten_state(state), True)
        assert plan.layout != last, key
        _check(plan, state)
        last = plan.layout
    reordered = dict(reversed(list(state.items())))  # the same leaves in another order
    plan = pl.plan(flatten_state(reordered), True)
    assert [c.name for c in plan.layout.chunks] != [c.name for c in last.chunks]
    _check(plan, reordered)
    del reordered["extra"]  # a key removed
    plan = pl.plan(flatten_state(reordered), True)
    assert "extra" not in {c.name for c in plan.layout.chunks}
    _check(plan, reordered)


@pytest.mark.parametrize("many", [False, True], ids=["values-in-manifest", "values-in-shard"])
def test_values_changed_between_saves_are_the_ones_saved_never_the_last_saves(many):
    pl = ShardPlanner()
    hist = [1.0, 2.0]
    state = {"w": torch.ones(2), "lr": 0.0, "betas": (1, 0.95), "hist": hist, "name": "a", "flag": True}
    if many:  # an optimizer container's per-parameter hyperparameters: their JSON goes into the shard
        state["group"] = {f"p{i}.lr": 1e-3 for i in range(400)}
    plan = pl.plan(flatten_state(state), True)
    assert (plan.values == []) is many
    _check(plan, state)
    edits = [
        lambda: state.__setitem__("lr", -0.0),  # equal to 0.0, another JSON
        lambda: state.__setitem__("betas", (True, 0.95)),  # equal to (1, 0.95), another JSON
        lambda: hist.append(3.0),  # the same list object, changed in place
        lambda: hist.__setitem__(0, 1),  # 1.0 -> 1, equal and the same object
        lambda: state.__setitem__("name", "b"),
        lambda: state.__setitem__("flag", 1),  # True -> 1
        lambda: state.__setitem__("lr", 0.5),
    ]
    if many:
        edits.append(lambda: state["group"].__setitem__("p7.lr", 2e-3))
    for edit in edits:
        edit()
        _check(pl.plan(flatten_state(state), True), state)


def test_values_in_the_shard_that_grow_a_little_keep_the_layout_and_the_slot_size():
    pl = ShardPlanner()
    state = {"w": torch.ones(8), "sched": {"last_lr": [0.1] * 1500}}
    first = pl.plan(flatten_state(state), True)
    assert first.values == []  # in the shard
    _check(first, state)
    state["sched"]["step"] = 1  # an lr scheduler's state after its first step: a few bytes more
    grown = pl.plan(flatten_state(state), True)
    assert grown.layout is first.layout and grown.total == first.total
    _check(grown, state)
    state["sched"]["last_lr"] = [0.123456789] * 4000  # outgrows the room
    big = pl.plan(flatten_state(state), True)
    assert big.total > first.total
    _check(big, state)
    state["sched"]["last_lr"] = [0.1] * 1500  # shrinks below half of it
    small = pl.plan(flatten_state(state), True)
    assert small.total < big.total
    _check(small, state)


def test_a_checkpointer_restores_each_steps_own_values_and_tensors_after_changes_between_saves(tmp_path):
    hist = [0.5]
    state = {"w": torch.zeros(4), "lr": 0.0, "betas": (1, 2), "hist": hist,
             "group": {f"p{i}": 1e-3 for i in range(300)}}
    saved = {}
    with ckpt.Checkpointer("vals", shm=str(tmp_path / "shm"), keep_memory=5) as ck:
        for step in range(5):
            state["w"].fill_(step)
            if step == 1:
                state["lr"] = -0.0
            if step == 2:
                state["betas"] = (True, 2)
                hist.append(1.5)
            if step == 3:
                state["w"] = torch.zeros(2, 2)  # another shape
                state["group"]["p3"] = 7.0
            if step == 4:
                state["extra"] = b"raw"
            ck.save(step, state).wait()
            saved[step] = {k: (v.clone() if isinstance(v, torch.Tensor) else
                               ({**v} if isinstance(v, dict) else (list(v) if isinstance(v, list) else v)))
                           for k, v in state.items()}
    with ckpt.Checkpointer("vals", shm=str(tmp_path / "shm"), keep_memory=5) as ck:
        for step, want in reversed(saved.items()):  # newest first: a restore drops the steps after its own
            got = {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else
                       ({k2: 0.0 for k2 in v} if isinstance(v, dict) else
                        ([] if isinstance(v, list) else (b"" if isinstance(v, bytes) else None))))
                   for k, v in want.items()}
            got["betas"] = (0, 0)
            assert ck.restore(got, step=step) == step
            for k, v in want.items():
                if isinstance(v, torch.Tensor):
                    assert torch.equal(got[k], v), (step, k)
                elif isinstance(v, dict):
                    assert all(_same_value(got[k][k2], x) for k2, x in v.items()), (step, k)
                else:
                    assert _same_value(got[k], v), (step, k, got[k], v)


# ------------------------------------------------------------------------------------------- slots
def test_populating_a_mapping_ahead_never_changes_the_bytes_of_the_slot(tmp_path):
    """The leaser maps the ring's other slots ahead, and those hold retained steps: faulting their page tables
    in must not write them."""
    import mmap

    from ckpt.checkpointer import _populate

    path = tmp_path / "slot"
    data = os.urandom(3 << 20)
    path.write_bytes(data)
    with open(path, "r+b") as f:
        mm = mmap.mmap(f.fileno(), len(data), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    buf = torch.frombuffer(mm, dtype=torch.uint8)
    _populate(buf.data_ptr(), len(data))
    assert bytes(mm[:]) == data
    del buf
    mm.close()
    assert path.read_bytes() == data


def _model_state(seed: int = 0) -> dict:
    from test_slots_lifecycle import _state  # the same small model and optimizer as the slot tests

    return _state(seed)


def _gated_lease(ck, gate: threading.Event) -> threading.Event:
    """Hold the Checkpointer's leases ahead until ``gate`` is set (a slot the agent is still faulting in);
    the event returned is set once a held lease went on."""
    lease = ck._prelease
    went_on = threading.Event()

    def held(nbytes: int, ring: bool = True) -> None:
        gate.wait(120)
        went_on.set()
        lease(nbytes, ring)

    ck._prelease = held
    return went_on


def _restored(shm: str, job: str, step: int, seed: int) -> dict:
    state = _model_state(seed)
    with ckpt.Checkpointer(job, shm=shm) as ck:
        assert ck.restore(state, step=step) == step
    return state


def _equal(a: dict, b: dict) -> bool:
    sa, sb = a["model"].state_dict(), b["model"].state_dict()
    oa, ob = a["optim"].state_dict()["state"], b["optim"].state_dict()["state"]
    return all(torch.equal(sa[k], sb[k]) for k in sa) and all(
        torch.equal(oa[i][k], ob[i][k]) for i in oa for k in oa[i]) and a["pos"] == b["pos"]


def test_a_save_takes_a_slot_the_agent_only_sized_rather_than_wait_for_the_one_being_faulted_in(tmp_path,
                                                                                                 monkeypatch):
    shm = str(tmp_path / "shm")
    state = _model_state(1)
    allocated: list[tuple[str, list]] = []
    allocate = ckpt.Checkpointer._allocate
    monkeypatch.setattr(ckpt.Checkpointer, "_allocate",
                        staticmethod(lambda slot, spans: (allocated.append((slot, spans)), allocate(slot, spans))))
    gate = threading.Event()
    with ckpt.Checkpointer("nowait", shm=shm) as ck:
        went_on = _gated_lease(ck, gate)
        assert ck.restore(state) is None  # a fresh start leases the first save's slot ahead: held at the gate
        fut = ck.save(0, state)
        returned_first = not went_on.is_set()
        gate.set()
        fut.wait()
        assert returned_first  # the save did not wait for the slot leased ahead
        shard0 = MemoryTier(shm).path(keys.shard_key("nowait", 0, 0))
        nbytes = os.path.getsize(shard0)
        # the slot was leased only sized: the background copy allocated all of it before writing
        assert [spans for slot, spans in allocated if os.path.samefile(slot, shard0)] == [[(0, nbytes)]]
        assert os.stat(shard0).st_blocks * 512 >= nbytes
        # the slot leased ahead was not lost: the next save stages into it
        ck._prelease_fut.result(timeout=120)
        ahead, n = ck._next_slot
        assert n == nbytes
        _train(state)
        ck.save(1, state).wait()
        assert os.path.samefile(MemoryTier(shm).path(keys.shard_key("nowait", 1, 0)), ahead)
        ck._prelease_fut.result(timeout=120)
        assert agent_call(shm, "status")["leased_slots"] == 1  # only the next save's: no lease left behind
        folder = MemoryTier(shm).slot_dir("nowait", 0)
        assert len(os.listdir(folder)) <= ck.settings.keep_memory + 2
        saved = {k: v for k, v in state.items()}
        ck.wait()
    assert _equal(_restored(shm, "nowait", 1, 9), saved)


def _train(state: dict) -> None:
    state["model"](torch.randn(4, 64)).sum().backward()
    state["optim"].step()
    state["optim"].zero_grad()


@pytest.mark.parametrize("overlap", [True, False], ids=["copied-in-background", "copied-before-return"])
def test_no_memory_for_a_sized_only_slot_is_a_checkpoint_error_and_the_slot_goes_back(tmp_path, monkeypatch,
                                                                                      overlap):
    shm = str(tmp_path / "shm")
    state = _model_state(2)

    def full(slot: str, spans: list) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with ckpt.Checkpointer("full", shm=shm, overlap=overlap) as ck:
        with monkeypatch.context() as m:
            m.setattr(ckpt.Checkpointer, "_allocate", staticmethod(full))
            with pytest.raises(ckpt.CheckpointError, match="no host memory|staging failed"):
                ck.save(0, state)  # a fresh job: no slot leased ahead, one only sized
                ck.wait()
        assert not ck.skipped
        assert agent_call(shm, "status")["leased_slots"] == 0  # the slot went back
        ck.save(1, state).wait()
    assert _equal(_restored(shm, "full", 1, 8), state)


def test_an_agent_sizes_a_slot_without_faulting_it_in_when_asked_and_refuses_one_it_has_no_room_for(tmp_path,
                                                                                                   monkeypatch):
    tier = MemoryTier(str(tmp_path / "shm"))
    path = tier.new_slot_path("j", 0, 0)
    assert tier.prepare_slot(path, 8 << 20, fault=False) is False
    st = os.stat(path)
    assert st.st_size == 8 << 20 and st.st_blocks * 512 < 8 << 20
    assert tier.prepare_slot(path, 8 << 20) is True  # faulted in when asked
    assert os.stat(path).st_blocks * 512 >= 8 << 20
    assert tier.prepare_slot(path, 8 << 20, fault=False) is True  # backed already: nothing to do

    class Vfs:
        f_bavail, f_frsize = 1, 4096

    monkeypatch.setattr(os, "fstatvfs", lambda fd: Vfs())
    with pytest.raises(TierFullError):
        tier.prepare_slot(tier.new_slot_path("j", 0, 1), 8 << 20, fault=False)
