"""SIGTERM stops a study's runners as Ctrl-C does.

``timeout``, a batch scheduler and systemd stop a command with SIGTERM. By default that
ends a Python process at once: a runner's run is not marked interrupted, a write is cut
short, and ``prereg run --jobs N`` ends without stopping its runners, which run in sessions
of their own (so that a terminal's Ctrl-C reaches the parent only) and would go on training
as orphans. While :func:`sigterm_as_interrupt` holds, the first SIGTERM raises
:class:`Terminated`, a ``KeyboardInterrupt``, where the process is, so everything that
cleans up after Ctrl-C (the parent stopping each runner, a run recording that it was
interrupted, an all-or-nothing write removing its temporary file) runs; further SIGTERMs are
ignored until it ends, so that clean-up is not cut short by a second one (systemd sends
SIGTERM to every process of the unit, and the parent then stops each runner again).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType


class Terminated(KeyboardInterrupt):
    """A SIGTERM, raised as Ctrl-C's KeyboardInterrupt is (its clean-up runs the same)."""


def _raise_once(signum: int, frame: FrameType | None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the clean-up this starts runs whole
    raise Terminated("stopped by SIGTERM")


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """While in the block, the first SIGTERM raises :class:`Terminated` (a
    KeyboardInterrupt) and later ones are ignored; the previous handler is put back after.
    Only the main thread may set a handler: elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, _raise_once)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
