"""``ckpt restore --format dcp|torch|safetensors`` with ``--only`` / ``--strip-prefix``: each export read by its
real reader.

End to end: a tiny ``LlamaForCausalLM`` (random weights from a ``LlamaConfig``, no download) and its Adam
optimizer, after one training step, saved through ``ckpt.Checkpointer`` (its own agent process) to memory and
disk; the ``ckpt`` CLI run as a user runs it exports the step; then ``torch.distributed.checkpoint.load`` into a
fresh model's state dict, ``torch.load(weights_only=True)``, ``safetensors.torch.load_file`` and
``transformers``' ``from_pretrained`` read it, and every tensor is compared bit for bit.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckpt
from agents.config import socket_path_for
from ckpt._export import ExportError, _cut, dotted, entry_path, lay_out
from ckpt._flatten import _join
from procs import ckpt_cmd

import safetensors.torch as safetensors_torch  # noqa: E402
import transformers  # noqa: E402

JOB = "export"
STEP = 4


def _config():
    return transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                    tie_word_embeddings=False)


def _model(seed: int):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(_config())


def _trained(seed: int = 0):
    """A tiny Llama and its Adam optimizer after one step (so the optimizer has state)."""
    model = _model(seed)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids, labels=ids).loss.backward()
    optim.step()
    optim.zero_grad()
    return model, optim


def _flags(root) -> list[str]:
    """The CLI's view of a closed Checkpointer's tiers (no agent answers: the folders alone)."""
    return ["--shm", str(root / "shm"), "--disk", str(root / "disk"), "--socket", str(root / "no-agent.sock")]


def _save(root, job: str, state: dict) -> None:
    """Save ``state`` as step 4 of ``job`` to memory and disk, then wait for the embedded agent to exit, so the
    exports read folders that nothing changes meanwhile."""
    shm = str(root / "shm")
    with ckpt.Checkpointer(job, shm=shm, disk=str(root / "disk"), idle_exit=1) as ck:
        ck.save(STEP, state).wait()
    deadline = time.monotonic() + 120
    while os.path.exists(socket_path_for(shm)):  # the agent removes its socket last as it stops
        assert time.monotonic() < deadline, "the embedded agent did not exit within 120 s of its job's end"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``(root, model, optim)``: step 4 of {"model", "optim", "data"} saved through a Checkpointer."""
    root = tmp_path_factory.mktemp("export")
    model, optim = _trained()
    _save(root, JOB, {"model": model, "optim": optim, "data": {"pos": 123, "name": "shard-7"}})
    return root, model, optim


def _export(root, out, *args: str):
    p = ckpt_cmd("restore", JOB, "--to", str(out), *args, *_flags(root))
    assert p.returncode == 0, (args, p.stdout, p.stderr)
    return p


def _assert_same_tensors(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        g = got[k]
        assert g.dtype == w.dtype and g.shape == w.shape, k
        assert torch.equal(g.view(torch.uint8) if g.numel() else g, w.view(torch.uint8) if w.numel() else w), k


def _model_sd(model) -> dict:
    return {k: v.detach() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------- each format, its own reader
def test_safetensors_of_the_model_loads_in_transformers_from_pretrained_bit_exact(saved, tmp_path):
    root, model, _ = saved
    out = tmp_path / "hf"
    p = _export(root, out, "--format", "safetensors", "--only", "model")
    assert "Traceback" not in p.stderr
    _assert_same_tensors(safetensors_torch.load_file(str(out / "model.safetensors")), _model_sd(model))
    _config().save_pretrained(str(out))
    loaded = transformers.LlamaForCausalLM.from_pretrained(str(out))
    _assert_same_tensors(_model_sd(loaded), _model_sd(model))


def test_safetensors_of_the_whole_state_keeps_values_in_its_metadata_and_says_so(saved, tmp_path):
    root, model, optim = saved
    out = tmp_path / "all"
    p = _export(root, out, "--format", "safetensors")
    got = safetensors_torch.load_file(str(out / "model.safetensors"))
    for k, v in _model_sd(model).items():
        assert torch.equal(got[f"model.{k}"], v), k
    # the optimizer's state, keyed by parameter name as torch's state-dict helpers name it
    exp_avg = next(iter(optim.state.values()))["exp_avg"]
    assert any(torch.equal(t, exp_avg) for k, t in got.items() if k.startswith("optim.state.")
               and k.endswith(".exp_avg"))
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        meta = f.metadata()
    values = json.loads(meta["tierckpt.values"])
    assert values["data.pos"] == 123 and values["data.name"] == "shard-7", values
    assert meta["format"] == "pt"
    assert "tierckpt.values" in p.stdout and "data.pos" in p.stdout, p.stdout


def test_torch_export_loads_with_weights_only(saved, tmp_path):
    root, model, optim = saved
    _export(root, tmp_path / "t", "--format", "torch")
    got = torch.load(str(tmp_path / "t" / "checkpoint.pt"), weights_only=True)
    assert set(got) == {"model", "optim", "data"}
    _assert_same_tensors(got["model"], _model_sd(model))
    assert got["data"] == {"pos": 123, "name": "shard-7"}
    assert got["optim"]["param_groups"][0]["lr"] == optim.param_groups[0]["lr"]
    _export(root, tmp_path / "m", "--format", "torch", "--only", "model")
    got = torch.load(str(tmp_path / "m" / "checkpoint.pt"), weights_only=True)
    _assert_same_tensors(got, _model_sd(model))  # model keys at the root: load_state_dict takes it as is
    fresh = _model(1)
    fresh.load_state_dict(got)
    _assert_same_tensors(_model_sd(fresh), _model_sd(model))


def test_dcp_export_with_only_model_loads_into_a_fresh_models_state_dict(saved, tmp_path):
    """Model-only keys (``layers...``, no ``model.``) are what torchtitan's initial load and a bare
    ``dcp.load(model.state_dict())`` read."""
    import torch.distributed.checkpoint as dcp

    root, model, _ = saved
    _export(root, tmp_path / "d", "--format", "dcp", "--only", "model")
    fresh = _model(1)
    sd = fresh.state_dict()
    dcp.load(sd, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    fresh.load_state_dict(sd)
    _assert_same_tensors(_model_sd(fresh), _model_sd(model))
    # the whole state, read back into a state of the same shape
    _export(root, tmp_path / "all", "--format", "dcp")
    fresh = _model(2)
    sd = {"model": fresh.state_dict(), "data": {"pos": 0, "name": ""}}
    dcp.load(sd, checkpoint_id=str(tmp_path / "all"), no_dist=True)
    _assert_same_tensors(sd["model"], _model_sd(model))
    assert sd["data"] == {"pos": 123, "name": "shard-7"}


def test_dcp_export_with_only_model_is_read_by_torchtitans_initial_load(saved, tmp_path):
    """torchtitan's own ``CheckpointManager`` (``--checkpoint.initial_load_path``, model only) loads the export
    into a fresh model; the whole-state layout (``model.<name>``) is what it cannot read."""
    from torchtitan.components.checkpointer.dcp import CheckpointManager

    root, model, _ = saved

    def initial_load(path):
        fresh = _model(1)
        cfg = CheckpointManager.Config(enable=True, folder="run", initial_load_path=str(path),
                                       initial_load_model_only=True)
        mgr = CheckpointManager(cfg, dataloader=None, model_parts=[fresh], optimizers=None, lr_schedulers=None,
                                states={}, sd_adapter=None, base_folder=str(tmp_path / f"titan-{path.name}"))
        try:
            assert mgr.load()
        finally:
            mgr.close()
        return fresh

    _export(root, tmp_path / "whole", "--format", "dcp")
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException, match="Missing key in checkpoint state_dict"):
        initial_load(tmp_path / "whole")
    _export(root, tmp_path / "model", "--format", "dcp", "--only", "model")
    _assert_same_tensors(_model_sd(initial_load(tmp_path / "model")), _model_sd(model))


def test_chunks_of_every_rank_are_assembled_into_whole_tensors_and_values_that_differ_are_named(tmp_path):
    """Three ranks each hand the agent their piece of two tensors and their own value of ``data/pos``: each
    export holds the whole tensors, and the command says which values differed (the lowest rank's written)."""
    from procs import start_agent
    from test_cli_output import JOB as RAW_JOB, _save as save_raw

    shm = str(tmp_path / "shm")
    agent = start_agent(shm)
    try:
        shards = save_raw(shm, 2, [{"data/pos": 10, "data/epoch": 1}, {"data/pos": 11, "data/epoch": 1},
                                   {"data/pos": 12, "data/epoch": 1}], tensors=2)
        half = len(shards[0]) // 2
        want = {f"layers.{i}.weight": torch.frombuffer(bytearray(b"".join(s[i * half:(i + 1) * half]
                                                                          for s in shards)), dtype=torch.uint8)
                for i in (0, 1)}
        flags = ["--shm", shm]
        p = ckpt_cmd("restore", RAW_JOB, "--to", str(tmp_path / "s"), "--format", "safetensors", "--only", "model",
                     *flags)
        assert p.returncode == 0, p.stderr
        _assert_same_tensors(safetensors_torch.load_file(str(tmp_path / "s" / "model.safetensors")), want)
        p = ckpt_cmd("restore", RAW_JOB, "--to", str(tmp_path / "t"), "--format", "torch", *flags)
        assert p.returncode == 0, p.stderr
        got = torch.load(str(tmp_path / "t" / "checkpoint.pt"), weights_only=True)
        _assert_same_tensors(got["model"], want)
        assert got["data"] == {"pos": 10, "epoch": 1}
        assert "1 value(s) differ between ranks; the lowest rank's was written" in p.stdout, p.stdout
        assert "data/pos" in p.stdout and "data/epoch" not in p.stdout, p.stdout
    finally:
        agent.terminate()
        agent.wait(60)


# ---------------------------------------------------------------------- key layouts
def test_strip_prefix_takes_a_dotted_dcp_prefix_off_and_from_pretrained_loads_it(tmp_path):
    """Entries named by dotted DCP names (``model.model.layers.0...``, as a DCP storage plug-in writes them):
    ``--strip-prefix model.`` gives the model's own keys and keeps the entries without it."""
    model, _ = _trained(3)
    state = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    state["train_state.step"] = torch.tensor(17)
    _save(tmp_path, "dotted", state)
    out = tmp_path / "hf"
    p = ckpt_cmd("restore", "dotted", "--to", str(out), "--format", "safetensors", "--strip-prefix", "model.",
                 *_flags(tmp_path))
    assert p.returncode == 0, p.stderr
    got = safetensors_torch.load_file(str(out / "model.safetensors"))
    assert torch.equal(got.pop("train_state.step"), torch.tensor(17))
    _assert_same_tensors(got, _model_sd(model))
    # --only reads the first part of a dotted name as the top-level entry, too
    p = ckpt_cmd("restore", "dotted", "--to", str(tmp_path / "t"), "--format", "torch", "--only", "model",
                 *_flags(tmp_path))
    assert p.returncode == 0, p.stderr
    _assert_same_tensors(torch.load(str(tmp_path / "t" / "checkpoint.pt"), weights_only=True), _model_sd(model))


@pytest.mark.parametrize("flag, value", [("--only", "modle"), ("--strip-prefix", "module."), ("--only", "data.pos")])
def test_a_key_layout_that_matches_nothing_is_one_line_naming_the_entries_and_writes_nothing(saved, tmp_path,
                                                                                           flag, value):
    root, _, _ = saved
    out = tmp_path / "out"
    p = ckpt_cmd("restore", JOB, "--to", str(out), flag, value, *_flags(root))
    assert p.returncode == 1, (p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckpt: error: "), p.stderr
    assert value in lines[0] and "data, model, optim" in lines[0], lines[0]
    assert not out.exists()


def test_bytes_values_export_as_bytes_to_torch_and_dcp_and_are_left_out_of_safetensors(tmp_path):
    blob = bytes(range(256)) * 3 + b"\x00tail"
    model, _ = _trained(5)
    _save(tmp_path, "blob", {"model": model, "loader": {"dp_rank_0": blob}})
    flags = _flags(tmp_path)
    p = ckpt_cmd("restore", "blob", "--to", str(tmp_path / "t"), "--format", "torch", *flags)
    assert p.returncode == 0, p.stderr
    got = torch.load(str(tmp_path / "t" / "checkpoint.pt"), weights_only=True)
    assert type(got["loader"]["dp_rank_0"]) is bytes and got["loader"]["dp_rank_0"] == blob
    p = ckpt_cmd("restore", "blob", "--to", str(tmp_path / "d"), "--format", "dcp", *flags)
    assert p.returncode == 0, p.stderr
    import torch.distributed.checkpoint as dcp

    sd = {"loader": {"dp_rank_0": b""}}
    dcp.load(sd, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    assert sd["loader"]["dp_rank_0"] == blob
    p = ckpt_cmd("restore", "blob", "--to", str(tmp_path / "s"), "--format", "safetensors", *flags)
    assert p.returncode == 0, p.stderr
    assert "left out" in p.stdout and "loader.dp_rank_0" in p.stdout, p.stdout
    got = safetensors_torch.load_file(str(tmp_path / "s" / "model.safetensors"))
    assert not any(k.startswith("loader") for k in got)
    _assert_same_tensors({k.removeprefix("model."): v for k, v in got.items()}, _model_sd(model))


def test_values_kept_in_the_shard_and_tuples_are_exported_and_shown(tmp_path):
    """Thousands of values (an optimizer container's per-parameter hyperparameters) live in the shard, not the
    manifest: the torch export still has every one, tuples as tuples, and ``ckpt show`` says where they are."""
    hp = {f"p{i}": {"lr": 1e-3 * i, "betas": (0.9, 0.95)} for i in range(300)}
    _save(tmp_path, "many", {"w": torch.arange(4.0), "hp": hp, "pair": (1, "a")})
    flags = _flags(tmp_path)
    p = ckpt_cmd("restore", "many", "--to", str(tmp_path / "t"), "--format", "torch", *flags)
    assert p.returncode == 0, p.stderr
    got = torch.load(str(tmp_path / "t" / "checkpoint.pt"), weights_only=True)
    assert got["hp"] == hp and isinstance(got["hp"]["p5"]["betas"], tuple)
    assert got["pair"] == (1, "a") and "~values" not in got
    p = ckpt_cmd("show", "many", *flags)
    assert p.returncode == 0, p.stderr
    assert "kept in the shard" in p.stdout and "~values" not in p.stdout, p.stdout


# ---------------------------------------------------------------------- the key layout, on any names
_segments = st.one_of(st.integers(0, 40), st.text(alphabet="ab.~/_0", min_size=1, max_size=6))
_paths = st.lists(_segments, min_size=1, max_size=4).map(tuple)


def _name(path) -> str:
    name = ""
    for seg in path:
        name = _join(name, seg)
    return name


@given(_paths)
def test_entry_names_map_back_to_their_paths(path):
    assert entry_path(_name(path)) == path


@given(_paths, st.data())
def test_a_cut_takes_exactly_the_prefix_off_the_dotted_key(path, data):
    key = dotted(path)
    n = data.draw(st.integers(0, len(key)))
    got = dotted(_cut(path, n))
    # a cut on a segment's end also drops the separator after it
    assert got == key[n:] or (key[n:n + 1] == "." and got == key[n + 1:]), (path, n, got)


@settings(max_examples=200)
@given(st.dictionaries(_paths, st.integers(), min_size=1, max_size=6), st.data())
def test_strip_prefix_keeps_every_entry_and_only_drops_the_prefix(flat_paths, data):
    flat = {_name(p): v for p, v in flat_paths.items()}
    if len(flat) < len(flat_paths):
        return  # two paths with one name (an int and its string): not a state the Checkpointer writes
    prefix = data.draw(st.sampled_from(sorted(dotted(p) for p in flat_paths)))
    prefix = prefix[: data.draw(st.integers(1, len(prefix)))]
    try:
        got = lay_out(flat, strip_prefix=prefix)
    except ExportError as e:
        assert "\n" not in str(e) and prefix in str(e)
        return
    assert sorted(got.values()) == sorted(flat_paths.values())
    for p, v in flat_paths.items():
        key = dotted(p)
        want = key[len(prefix):].removeprefix(".") if key.startswith(prefix) else key
        assert any(dotted(q) in (want, key[len(prefix):]) and w == v for q, w in got.items()), (p, prefix, got)


def test_each_writer_hands_bytes_values_to_its_reader_as_bytes_or_leaves_them_out_with_a_note(tmp_path):
    """The writers alone, on entries as the CLI assembles them (a raw bytes value, tensors in a list)."""
    import torch.distributed.checkpoint as dcp

    from ckpt._export import write_export

    blob = bytes(range(256)) + b"\x00"
    flat = {"loader/dp_rank_0": blob, "model/w": torch.arange(6.0).view(2, 3), "t/~i0": torch.ones(2, dtype=torch.int8),
            "t/~i1": torch.zeros(2, dtype=torch.bfloat16), "data/pos": 5}
    write_export(lay_out(flat), "torch", str(tmp_path / "t"))
    got = torch.load(str(tmp_path / "t" / "checkpoint.pt"), weights_only=True)
    assert got["loader"]["dp_rank_0"] == blob and type(got["loader"]["dp_rank_0"]) is bytes
    assert isinstance(got["t"], list) and torch.equal(got["t"][0], flat["t/~i0"]) and got["data"] == {"pos": 5}
    write_export(lay_out(flat), "dcp", str(tmp_path / "d"))
    sd = {"loader": {"dp_rank_0": b""}, "model": {"w": torch.zeros(2, 3)},
          "t": [torch.zeros(2, dtype=torch.int8), torch.ones(2, dtype=torch.bfloat16)], "data": {"pos": 0}}
    dcp.load(sd, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    assert sd["loader"]["dp_rank_0"] == blob and sd["data"]["pos"] == 5
    _assert_same_tensors({"w": sd["model"]["w"], "0": sd["t"][0], "1": sd["t"][1]},
                         {"w": flat["model/w"], "0": flat["t/~i0"], "1": flat["t/~i1"]})
    e = write_export(lay_out(flat), "safetensors", str(tmp_path / "s"))
    assert any("left out" in n and "loader.dp_rank_0" in n for n in e.notes), e.notes
    got = safetensors_torch.load_file(e.path)
    _assert_same_tensors(got, {"model.w": flat["model/w"], "t.0": flat["t/~i0"], "t.1": flat["t/~i1"]})


def test_safetensors_refuses_a_dtype_it_cannot_hold_in_one_line(tmp_path):
    from ckpt._export import write_export

    with pytest.raises(ExportError, match=r"^z is complex128, which safetensors cannot hold: export it with"):
        write_export(lay_out({"z": torch.zeros(2, dtype=torch.complex128)}), "safetensors", str(tmp_path))


def test_safetensors_of_a_dtype_it_cannot_hold_is_refused_before_anything_is_written(tmp_path):
    _save(tmp_path, "cplx", {"z": torch.randn(3, dtype=torch.complex128), "w": torch.ones(2)})
    out = tmp_path / "out"
    p = ckpt_cmd("restore", "cplx", "--to", str(out), "--format", "safetensors", *_flags(tmp_path))
    assert p.returncode == 1 and p.stderr.strip().splitlines() == [
        "ckpt: error: z is complex128, which safetensors cannot hold: export it with --format torch or dcp"], p.stderr
    assert not out.exists()
    p = ckpt_cmd("restore", "cplx", "--to", str(out), "--format", "torch", *_flags(tmp_path))
    assert p.returncode == 0, p.stderr
