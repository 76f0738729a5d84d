"""moestack.interrupts, in this process: a Ctrl-C held while the command starts up, raised at
once while a run trains (the same keypress repeated within AGAIN_AFTER_S waits, a later one
is raised again), ignored by the system once the command stops."""

from __future__ import annotations

import os
import signal
import time

import pytest

from moestack import interrupts


@pytest.fixture
def installed():
    """interrupts.install() for the test; Python's own Ctrl-C back afterwards."""
    previous = signal.getsignal(signal.SIGINT)
    interrupts.install()
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        interrupts._state = interrupts._State()


def ctrl_c() -> None:
    """SIGINT to this process; its handler runs before this returns."""
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.01)


def test_a_ctrl_c_while_held_is_raised_where_the_command_can_undo_the_start(installed):
    ctrl_c()  # held: nothing raised here
    assert interrupts.held()
    with pytest.raises(KeyboardInterrupt), interrupts.live():
        pytest.fail("the held Ctrl-C is raised on entry")
    assert not interrupts.held()
    interrupts.raise_held()  # raised once only


def test_while_live_a_ctrl_c_is_raised_and_one_dropped_is_raised_again_later(
    installed, monkeypatch
):
    now = [100.0]
    monkeypatch.setattr(interrupts.time, "monotonic", lambda: now[0])
    with interrupts.live():
        with pytest.raises(KeyboardInterrupt):
            ctrl_c()
        now[0] += interrupts.AGAIN_AFTER_S / 2
        ctrl_c()  # the same keypress repeated: not raised into the run's clean-up
        now[0] += interrupts.AGAIN_AFTER_S
        with pytest.raises(KeyboardInterrupt):  # the first was dropped: the run goes on
            ctrl_c()
    ctrl_c()  # held again after the run
    assert interrupts.held()


def test_once_stopping_every_ctrl_c_is_ignored_by_the_system(installed):
    interrupts.stopping()
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    ctrl_c()
    assert not interrupts.held()
    with interrupts.live():
        ctrl_c()  # no KeyboardInterrupt
    assert interrupts._state.mode == interrupts.STOPPING


def test_nothing_changes_where_it_was_not_installed():
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with interrupts.live():
        pass
    interrupts.stopping()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
