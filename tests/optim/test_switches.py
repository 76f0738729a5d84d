"""The offloaded optimizer's auto / True / False switches (moestack.optim.switches): one rule,
worked through every case by hand."""

from __future__ import annotations

import pytest

from moestack.optim.switches import check_switch, decide


@pytest.mark.parametrize(
    ("requested", "why_not", "pays", "on"),
    [
        (False, None, True, False),
        (False, "cannot", True, False),
        (True, None, False, True),  # forced where it would not pay (CPU tests of the logic)
        ("auto", None, True, True),
        ("auto", None, False, False),
        ("auto", "cannot", True, False),
    ],
)
def test_decide_follows_the_rule(requested, why_not, pays, on) -> None:
    assert decide("pipeline", requested, why_not, pays=pays) is on


def test_forcing_a_switch_that_cannot_be_says_why() -> None:
    with pytest.raises(ValueError, match=r"^reduce_on_device=True cannot be used: one rank$"):
        decide("reduce_on_device", True, "one rank", pays=True)


@pytest.mark.parametrize("value", ["on", 1, None, "True"])
def test_a_value_that_is_no_switch_is_refused_by_name(value) -> None:
    with pytest.raises(ValueError, match=r"^pipeline=.*: use 'auto', True or False$"):
        check_switch("pipeline", value)
    with pytest.raises(ValueError, match="use 'auto', True or False"):
        decide("pipeline", value, None, pays=True)
