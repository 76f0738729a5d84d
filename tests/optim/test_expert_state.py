"""Joining a checkpoint's optimizer parts (moestack.optim.expert_state.merge) from pieces
built by hand: OffloadAdamW's ZeRO shards of a flat parameter joined in element order, a
missing piece (in the middle, at the end) refused naming the elements and the parameter,
and torch AdamW's expert rows cut to the rows a reader holds."""

from __future__ import annotations

import pytest
import torch

from moestack.optim import state_format
from moestack.optim.expert_state import adamw_part, merge, offload_part, shard_part

GEN = torch.Generator().manual_seed(0)
FLAT = {"exp_avg": torch.randn(10, generator=GEN), "exp_avg_sq": torch.rand(10, generator=GEN)}


def piece(a: int, b: int) -> dict:
    entry = {key: value[a:b].clone() for key, value in FLAT.items()}
    return {"elements": [a, b], "step": torch.tensor(7.0), **entry}


def common() -> dict:
    return {"format": state_format.FORMAT, "state": {"bias": {"step": 1}}, "param_groups": []}


def test_shard_pieces_join_in_element_order_whatever_the_part_order() -> None:
    parts = [shard_part({"w": piece(6, 10)}), shard_part({"w": piece(0, 3)}),
             shard_part({"w": piece(3, 6)}), offload_part({"e/expert0": {"step": 2}})]  # fmt: skip
    state = merge(common(), parts, numel_of=lambda name: 10)["state"]
    for key, value in FLAT.items():
        assert torch.equal(state["w"][key], value)
    assert state["w"]["step"] == 7.0 and "elements" not in state["w"]
    assert state["bias"] == {"step": 1} and state["e/expert0"] == {"step": 2}


@pytest.mark.parametrize(
    ("pieces", "missing"), [([(0, 3), (6, 10)], "3..5"), ([(0, 3), (3, 6)], "6..9")]
)
def test_a_missing_shard_piece_is_refused_naming_it(pieces, missing) -> None:
    parts = [shard_part({"w": piece(a, b)}) for a, b in pieces]
    with pytest.raises(ValueError, match=rf"do not hold elements {missing} of 'w'.*missing"):
        merge(common(), parts, numel_of=lambda name: 10)


def test_adamw_expert_rows_are_cut_to_the_rows_a_reader_holds() -> None:
    whole = torch.randn(6, 3, generator=GEN)  # 6 experts, their state rows

    def entry(lo: int, hi: int) -> dict:
        return {"step": torch.tensor(4.0), "exp_avg": whole[lo:hi].clone(),
                "exp_avg_sq": whole[lo:hi].square()}  # fmt: skip

    parts = [adamw_part({"w1": entry(0, 4)}, {"w1": (0, 4)}),
             adamw_part({"w1": entry(4, 6)}, {"w1": (4, 6)})]  # fmt: skip
    state = merge({"state": {}, "param_groups": []}, parts, ["router", "w1"],
                  rows_of=lambda name: (2, 5))["state"]  # fmt: skip
    assert torch.equal(state[1]["exp_avg"], whole[2:5])
    assert torch.equal(state[1]["exp_avg_sq"], whole[2:5].square())
    with pytest.raises(ValueError, match="experts 4..6 of 'w1'"):
        merge({"state": {}}, parts[:1], ["router", "w1"], rows_of=lambda name: (2, 7))
