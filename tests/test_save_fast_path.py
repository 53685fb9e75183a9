"""What a save remembers from the last one, attacked: names of a dict's entries, the shard's layout, the values'
JSON, and the slot leased ahead. Each remembered thing must give way as soon as the state differs, so a save
never writes stale data or puts bytes where the layout does not say they are."""

from __future__ import annotations

import pytest
import torch

import ckpt
from ckpt._flatten import StateError, flatten_state


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
