"""State as training stacks hand it over: torchtitan's Stateful containers, bytes, tuples, nested Stateful.

The torchtitan state is built from torchtitan's own classes (tests/titan_state.py): ModelWrapper,
OptimizersContainer, LRSchedulersContainer, ParallelAwareDataloader (a torchdata StatefulDataLoader
whose state is pickled bytes).
"""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
from torch import nn

import ckpt
from ckpt import _guard

from titan_state import titan_state


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        return self.head(self.norm(h + self.mlp(h)))


def _model(seed: int) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM()


def _train(state: dict, it, steps: int) -> list[str]:
    """``steps`` torchtitan-style steps; the losses as exact hex strings."""
    model = state["model"].model[0]
    losses = []
    for _ in range(steps):
        batch = next(it)
        logits = model(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        state["optimizer"].step()
        state["lr_scheduler"].step()
        state["optimizer"].zero_grad()
        state["train_state"].step += 1
        state["train_state"].ntokens_seen += batch.numel()
        losses.append(float(loss).hex())
    return losses


def test_torchtitan_state_round_trips_bit_exact_and_resumes_the_same_losses(tmp_path):
    state = titan_state(_model(0))
    it = iter(state["dataloader"])
    _train(state, it, 3)
    with ckpt.Checkpointer("titan", shm=str(tmp_path / "shm")) as ck:
        ck.save(3, state).wait()
        expected = _train(state, it, 3)

        fresh = titan_state(_model(7))
        assert ck.restore(fresh) == 3
    assert fresh["train_state"].state_dict() == {"step": 3, "ntokens_seen": 3 * 2 * 9}
    assert fresh["lr_scheduler"].schedulers[0].last_epoch == 3
    assert _train(fresh, iter(fresh["dataloader"]), 3) == expected
    for (n, a), (m, b) in zip(state["model"].state_dict().items(), fresh["model"].state_dict().items()):
        assert n == m and torch.equal(a, b), n


def test_torchtitan_state_copy_overlaps_until_the_container_steps(tmp_path, monkeypatch):
    """The parameters and optimizer state inside torchtitan's containers are copied after ``save`` returns, and
    the container's next optimizer step waits for that copy: the checkpoint holds the pre-step values."""
    state = titan_state(_model(1))
    it = iter(state["dataloader"])
    _train(state, it, 2)
    inner = state["optimizer"].optimizers[0]
    release = threading.Event()
    copying = threading.Event()
    real = ckpt.Checkpointer._copy_parallel

    def held(self, buf, items):
        copying.set()
        assert release.wait(120)
        return real(self, buf, items)

    monkeypatch.setattr(ckpt.Checkpointer, "_copy_parallel", held)
    with ckpt.Checkpointer("titan-overlap", shm=str(tmp_path / "shm")) as ck:
        before = {k: v.clone() for k, v in state["model"].state_dict().items()}
        fut = ck.save(2, state)
        assert copying.wait(60)
        assert not fut.staged()  # save returned while the guarded tensors are still to be copied
        stepped = threading.Event()
        h = inner.register_step_pre_hook(lambda *a: stepped.set())  # runs after the global waiting hook
        batch = next(it)
        model = state["model"].model[0]
        nn.functional.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten()).backward()
        t = threading.Thread(target=state["optimizer"].step)
        t.start()
        assert not stepped.wait(1.0)  # the optimizer step waits for the copy
        release.set()
        assert stepped.wait(60)
        t.join(60)
        h.remove()
        fut.wait()
        assert any(not torch.equal(before[k], v) for k, v in state["model"].state_dict().items())
        fresh = titan_state(_model(9))
        assert ck.restore(fresh) == 2
    for k, v in fresh["model"].state_dict().items():
        assert torch.equal(v, before[k]), k


def test_optimizers_inside_stateful_containers_are_guarded_and_learned_from_their_steps():
    model = _model(2)
    state = titan_state(model)
    found = _guard.find_optimizers(state["optimizer"])
    assert state["optimizer"].optimizers[0] in found
    guarded = _guard.guarded_storages(found)
    from ckpt._devices import storage_key

    assert all(storage_key(p) in guarded for p in model.parameters())
    # an optimizer nobody named is learned when it steps under a registered waiter
    other = nn.Linear(3, 3)
    opt = torch.optim.SGD(other.parameters(), lr=0.1)
    reg = _guard.register_waiter(lambda: None)
    try:
        assert opt not in _guard.known_optimizers()
        other(torch.ones(1, 3)).sum().backward()
        opt.step()
        assert opt in _guard.known_optimizers()
        assert storage_key(other.weight) in _guard.guarded_storages()
    finally:
        reg.remove()


def test_a_container_named_to_learn_guards_the_optimizers_inside_it():
    # DcpStager(optimizers=[container]) learns through this: DCP hands the stager flat state dicts, so the
    # container itself is the only handle on the optimizers before they step
    model = _model(2)
    state = titan_state(model)
    inner = state["optimizer"].optimizers[0]
    from ckpt._devices import storage_key

    _guard.learn([state["optimizer"]])
    assert inner in _guard.known_optimizers()
    guarded = _guard.guarded_storages()
    assert all(storage_key(p) in guarded for p in model.parameters())
    assert all(storage_key(v) in guarded for s in inner.state.values() for v in s.values()
               if isinstance(v, torch.Tensor)) and inner.state


class Nest:
    """A Stateful holding another Stateful, a tuple with a tensor, and bytes."""

    def __init__(self, seed: int) -> None:
        self.child = Leafy(seed)
        self.pair = (torch.full((3,), float(seed)), seed)
        self.blob = bytes([seed % 256]) * (1000 + seed)

    def state_dict(self) -> dict:
        return {"child": self.child, "pair": self.pair, "blob": self.blob, "cfg": ((1, 2), [3, (4, 5)])}

    def load_state_dict(self, sd: dict) -> None:
        self.pair, self.blob, self.cfg = sd["pair"], sd["blob"], sd["cfg"]


class Leafy:
    def __init__(self, seed: int) -> None:
        self.n, self.raw = seed, bytes(range(seed % 7))

    def state_dict(self) -> dict:
        return {"n": self.n, "raw": self.raw}

    def load_state_dict(self, sd: dict) -> None:
        self.n, self.raw = sd["n"], sd["raw"]


def test_bytes_tuples_and_nested_stateful_round_trip_with_their_types(tmp_path):
    saved = {"nest": Nest(5), "blobs": [b"", b"\x00" * 3, bytearray(b"xyz")], "betas": (0.9, 0.95),
             "deep": {"t": ((1, "a"), (None, True))}, "mixed": (torch.arange(4), "k", 2.5)}
    with ckpt.Checkpointer("values", shm=str(tmp_path / "shm")) as ck:
        ck.save(0, saved).wait()
        target = {"nest": Nest(2), "blobs": [b"?", b"?", b"?"], "betas": [0.0, 0.0],
                  "deep": {"t": [[0, "b"], [1, False]]}, "mixed": (torch.zeros(4, dtype=torch.int64), "", 0.0)}
        assert ck.restore(target) == 0
    n = target["nest"]
    assert n.child.n == 5 and n.child.raw == bytes(range(5)) and n.blob == b"\x05" * 1005
    assert isinstance(n.pair, tuple) and torch.equal(n.pair[0], torch.full((3,), 5.0)) and n.pair[1] == 5
    assert n.cfg == ((1, 2), [3, (4, 5)]) and isinstance(n.cfg, tuple) and isinstance(n.cfg[1][1], tuple)
    assert target["blobs"] == [b"", b"\x00\x00\x00", b"xyz"] and all(type(b) is bytes for b in target["blobs"])
    # tuples come back as tuples, even into a state whose tuples became lists (as dcp.load leaves them)
    assert target["betas"] == (0.9, 0.95) and isinstance(target["betas"], tuple)
    assert target["deep"]["t"] == ((1, "a"), (None, True))
    assert isinstance(target["mixed"], tuple) and target["mixed"][1:] == ("k", 2.5)
    assert torch.equal(target["mixed"][0], torch.arange(4))


def test_bytes_are_kept_raw_in_the_shard_not_in_the_manifest(tmp_path):
    blob = bytes(range(256)) * 64
    with ckpt.Checkpointer("rawbytes", shm=str(tmp_path / "shm")) as ck:
        ck.save(0, {"blob": blob}).wait()
    shards = [p for p in (tmp_path / "shm").rglob("*") if p.is_file() and blob in p.read_bytes()]
    manifests = [p for p in (tmp_path / "shm").rglob("*manifest*") if p.is_file()]
    assert manifests and shards
    assert all(p not in shards for p in manifests)


def test_bytes_in_the_state_against_a_value_in_the_checkpoint_is_a_mismatch(tmp_path):
    with ckpt.Checkpointer("bytesmm", shm=str(tmp_path / "shm")) as ck:
        ck.save(0, {"x": b"abc", "y": 3}).wait()
        with pytest.raises(ckpt.StateMismatchError, match="x is a value in the state but bytes"):
            ck.restore({"x": 1, "y": 3})
        with pytest.raises(ckpt.StateMismatchError, match="y is bytes in the state"):
            ck.restore({"x": b"", "y": b""})
        with pytest.raises(ckpt.StateMismatchError, match="x is a tensor in the state"):
            ck.restore({"x": torch.zeros(3, dtype=torch.uint8), "y": 3})


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**53, 2**53), st.text(max_size=5),
                     st.floats(allow_nan=False, allow_infinity=False))
_values = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                         st.lists(inner, max_size=3).map(tuple)), max_leaves=12)


def _same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@settings(max_examples=200, deadline=None)
@given(_values)
def test_json_values_keep_their_list_and_tuple_types_through_the_manifest_encoding(v):
    import json

    from tiers.manifest import decode_value, encode_value

    assert _same(decode_value(json.loads(json.dumps(encode_value(v)))), v)


def test_a_bytes_chunk_with_a_shape_or_offsets_is_refused_by_the_manifest_parser():
    from tiers.errors import ManifestError
    from tiers.manifest import BYTES_DTYPE, TensorChunk

    TensorChunk("b", BYTES_DTYPE, (5,), (0,), (5,), 0, 5).check("x")
    for bad in [TensorChunk("b", BYTES_DTYPE, (2, 3), (0, 0), (2, 3), 0, 6),
                TensorChunk("b", BYTES_DTYPE, (6,), (1,), (5,), 0, 5),
                TensorChunk("b", BYTES_DTYPE, (6,), (0,), (5,), 0, 5)]:
        with pytest.raises(ManifestError, match="bytes value"):
            bad.check("x")


class FusedQKV(nn.Module):
    """One fused projection saved as three (wq, wk, wv) by state-dict hooks, as torchtitan's fused attention
    is: DCP's state-dict helper looks the saved names up as parameters and fails on it."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.d = d
        self.wqkv = nn.Linear(d, 3 * d, bias=False)
        self._register_state_dict_hook(FusedQKV._split)
        self._register_load_state_dict_pre_hook(FusedQKV._fuse)

    @staticmethod
    def _split(mod, sd, prefix, local_metadata):
        w = sd.pop(prefix + "wqkv.weight")
        for n, part in zip("qkv", w.split(mod.d)):
            sd[prefix + f"w{n}.weight"] = part
        return sd

    @staticmethod
    def _fuse(sd, prefix, *args):
        sd[prefix + "wqkv.weight"] = torch.cat([sd.pop(prefix + f"w{n}.weight") for n in "qkv"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wqkv(x)


def test_a_model_whose_state_dict_hooks_rename_parameters_is_saved_through_its_own_state_dict(tmp_path):
    from torch.distributed.checkpoint import state_dict as dsd

    def build(seed: int):
        torch.manual_seed(seed)
        model = nn.Sequential(FusedQKV(), nn.Linear(24, 2))
        optim = torch.optim.Adam(model.parameters(), lr=0.01)
        model(torch.randn(3, 8)).sum().backward()
        optim.step()
        return {"optim": optim, "model": model}  # the optimizer first: its model is not flattened yet

    saved = build(0)
    with pytest.raises(AttributeError):
        dsd.get_model_state_dict(saved["model"])  # what the Checkpointer no longer trips on
    with ckpt.Checkpointer("fused", shm=str(tmp_path / "shm")) as ck:
        ck.save(0, saved).wait()
        target = build(5)
        assert ck.restore(target) == 0
    for (n, a), (m, b) in zip(saved["model"].state_dict().items(), target["model"].state_dict().items()):
        assert n == m and torch.equal(a, b), n
    sa, sb = saved["optim"].state_dict()["state"], target["optim"].state_dict()["state"]
    assert all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])


@pytest.mark.parametrize("path", ["memory", "disk", "s3"])
def test_many_values_go_into_the_shard_not_the_manifest_and_come_back_from_every_tier(tmp_path, s3_bucket, path):
    """An optimizer container saves each parameter's hyperparameters as values: thousands per rank. They go
    into the rank's shard, so the manifest that every node receives stays small, and a restore through each
    tier's read path (direct reads into the tensors, or a buffer) gets them back."""
    from tiers import keys
    from tiers.manifest import SPILL_BYTES, JsonEntry, Manifest

    endpoint, bucket = s3_bucket
    groups = {f"p{i}": {"lr": 1e-3 * i, "betas": (0.9, 0.95), "name": f"layer.{i}", "fused": None} for i in range(400)}
    saved = {"w": torch.arange(10.0), "hp": groups, "step": 7}
    with ckpt.Checkpointer("spill", shm=str(tmp_path / "shm"), disk=str(tmp_path / "disk"),
                           s3=f"s3://{bucket}/ckpt", s3_endpoint=endpoint) as ck:
        ck.save(0, saved).wait()
        tiers = {t.name: t for t in ck.tiers()}
        raw = tiers["memory"].get(keys.manifest_key("spill", 0))
        m = Manifest.from_bytes(raw)
        assert [e for e in m.shard(0).entries if isinstance(e, JsonEntry)] == []  # no value in the manifest
        assert len(raw) < 4 * SPILL_BYTES
        for name in ["memory", "disk", "s3"][:["memory", "disk", "s3"].index(path)]:
            for k in tiers[name].list(keys.job_prefix("spill")):
                tiers[name].delete(k)
        target = {"w": torch.zeros(10), "hp": {k: {"lr": 0.0, "betas": [0, 0], "name": "", "fused": 1}
                                               for k in groups}, "step": 0}
        # a value of the state that the checkpoint does not have is still a mismatch, and nothing is changed
        extra = {"w": torch.zeros(10), "hp": {"p1": {"lr": 0.0, "betas": [0, 0], "name": "", "fused": 1,
                                                       "new": 3}}, "step": 0}
        with pytest.raises(ckpt.StateMismatchError, match="hp/p1/new"):
            ck.restore(extra)
        assert torch.equal(extra["w"], torch.zeros(10)) and extra["step"] == 0
        assert ck.restore(target) == 0
        assert ck.last_restore.tiers == [path]
    assert target["hp"] == groups and target["step"] == 7 and torch.equal(target["w"], saved["w"])
    assert isinstance(target["hp"]["p3"]["betas"], tuple)


def test_a_model_written_in_place_is_not_loaded_again_unless_a_load_would_change_something(tmp_path):
    """A plain module's state dict is its own tensors: the restore writes them in place and skips the
    load (its cost is all overhead). A module whose load does more (a load hook here, as FSDP registers)
    or a state dict that is not the module's own memory still goes through the load."""
    from ckpt._flatten import _loads_in_place, flatten_state
    from torch.distributed.checkpoint import state_dict as dsd

    plain = _model(0)
    assert _loads_in_place(plain, dsd.get_model_state_dict(plain))
    copied = {k: v.clone() for k, v in plain.state_dict().items()}
    assert not _loads_in_place(plain, copied)
    assert not _loads_in_place(plain, {**plain.state_dict(), "_extra_state": 3})
    assert len(flatten_state({"model": plain}, for_restore=True).appliers) == 0
    assert len(flatten_state({"model": plain}).appliers) == 1  # a save does not restore, so it keeps it

    loads: list[int] = []
    hooked = _model(1)
    hooked.head.register_load_state_dict_post_hook(lambda module, keys: loads.append(1))
    assert not _loads_in_place(hooked, dsd.get_model_state_dict(hooked))

    with ckpt.Checkpointer("inplace", shm=str(tmp_path / "shm")) as ck:
        ck.save(0, {"model": plain}).wait()
        target = _model(5)
        assert ck.restore({"model": target}) == 0
        assert ck.restore({"model": hooked}) == 0
    assert loads == [1]  # the hook ran: the hooked model was loaded
    for m in (target, hooked):
        for (n, a), (k, b) in zip(plain.state_dict().items(), m.state_dict().items()):
            assert n == k and torch.equal(a, b), n
