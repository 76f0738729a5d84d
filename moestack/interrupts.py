"""Ctrl-C in ``moestack-train``: whenever it comes, the command ends with one line and exit
status 130, and leaves nothing that was not there before or that a resume does not need.

Left to Python, SIGINT is a KeyboardInterrupt raised at whatever line runs: inside an import
(a traceback), inside a finalizer (``__del__``: the exception is printed and dropped, and the
run trains on), while hydra makes the run folder (a half-made folder stays), or during the
interpreter's exit (torch's atexit callbacks print a traceback). So the command takes SIGINT
over as it starts (``install``) and:

- *holds* it (notes it, raises nothing) while it starts up: its imports and hydra composing
  the config. It is raised at the next point where the command can stop cleanly
  (``raise_held``, ``live``): before hydra composes, or as the run's checks begin (a start
  writes nothing before they pass, ``moestack.train``);
- raises it at once while a run trains (``live``), so that the run stops where it is. One
  the run then drops (a finalizer's) is raised again by the next Ctrl-C, a few seconds on;
  one within ``AGAIN_AFTER_S`` of the first is the same keypress repeated, and waits;
- ignores every later one once the command is stopping (``stopping``, the system's
  ``SIG_IGN``, which Python keeps through its exit), so that none cuts the stop short or
  lands in an atexit callback.

Nothing here acts until ``install`` is called: Python's ``train`` and the tests keep
Python's own Ctrl-C.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

HOLD, LIVE, STOPPING = "hold", "live", "stopping"
AGAIN_AFTER_S = 2.0  # a second Ctrl-C sooner than this after the first one raised waits
INTERRUPTED = 130  # the shell's status for a process ended by Ctrl-C (128 + SIGINT)
NOTHING_WRITTEN = "moestack-train: interrupted before the run began; nothing was written"
NOTHING_KEPT = "moestack-train: interrupted before it logged a step; nothing was kept"


@dataclass
class _State:
    mode: str | None = None  # None: not installed (Python's own Ctrl-C)
    held: bool = False  # a Ctrl-C came while held, not raised yet
    raised_at: float | None = None  # when one was last raised (time.monotonic)


_state = _State()


def install() -> None:
    """Take SIGINT over for this process (the main thread of ``moestack-train``), holding
    it from now on."""
    if threading.current_thread() is not threading.main_thread():
        return
    _state.mode, _state.held, _state.raised_at = HOLD, False, None
    signal.signal(signal.SIGINT, _on_sigint)


def _on_sigint(signum: int, frame: object) -> None:
    if _state.mode == LIVE:
        now = time.monotonic()
        if _state.raised_at is None or now - _state.raised_at > AGAIN_AFTER_S:
            _state.raised_at = now
            raise KeyboardInterrupt
        return
    if _state.mode == HOLD:
        _state.held = True


def held() -> bool:
    """Whether a Ctrl-C came while held and was not raised yet."""
    return _state.held and _state.mode != STOPPING


def raise_held() -> None:
    """Raise the Ctrl-C held so far as KeyboardInterrupt (once); nothing when none came."""
    if held():
        _state.held = False
        _state.raised_at = time.monotonic()
        raise KeyboardInterrupt


@contextlib.contextmanager
def live() -> Iterator[None]:
    """Inside, Ctrl-C is raised at once (a held one first, on entry); after, it is held
    again. Nothing changes where ``install`` was not called, nor once the command stops."""
    if _state.mode in (None, STOPPING):
        yield
        return
    _state.mode = LIVE
    try:
        raise_held()
        yield
    finally:
        if _state.mode == LIVE:
            _state.mode = HOLD


def stopping() -> None:
    """The command is stopping (a Ctrl-C was taken, or an error ends it): every later
    Ctrl-C is ignored, by the system too, through the interpreter's exit."""
    if _state.mode is None:
        return
    _state.mode = STOPPING
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


# --------------------------------------------------------------------------- the line
def what_is_there(*folders: Path) -> dict[Path, set[str] | None]:
    """Each folder's entries before a start writes (None: the folder is not there; its
    ``run_paths.new_root`` is what the start will make), for :func:`discard_unused`; an
    unreadable folder is left out (nothing of it is touched)."""
    from moestack.run_paths import new_root

    there: dict[Path, set[str] | None] = {}
    for folder in dict.fromkeys(folders):
        root = new_root(folder)
        names = None if root is not None else _entries(folder)
        if root is not None or names is not None:
            there[root or folder] = names
    return there


def discard_unused(out_dir: Path, there: dict[Path, set[str] | None]) -> list[str]:
    """What a start added to the folders it wrote (``there``: :func:`what_is_there` before
    it began), removed again when its run in ``out_dir`` logged no step and wrote no
    checkpoint: a folder it made, and the entries it added to one that was there, hold only
    its own records. Returns what was removed, said for the line."""
    import shutil

    last, steps = _progress(out_dir)
    if last is not None or steps:
        return []
    said = []
    for folder, names in there.items():
        now = _entries(folder) or set()
        added = [folder] if names is None else [folder / n for n in now - names]
        added = [p for p in added if p.exists() or p.is_symlink()]
        for path in added:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        if added:
            said.append(str(folder) if names is None else f"what it added to {folder}")
    return said


def _entries(folder: Path) -> set[str] | None:
    """The names in ``folder``; None where it cannot be read."""
    try:
        return set(os.listdir(folder))
    except OSError:
        return None


def _progress(out_dir: Path) -> tuple[Path | None, list[int]]:
    """The run in ``out_dir``'s newest checkpoint (None: none) and the steps it logged."""
    from moestack import checkpoint

    last = checkpoint.latest_checkpoint(out_dir / "checkpoints")
    return last, [r["step"] for r in _metrics(out_dir) if isinstance(r.get("step"), int)]


def stopped_line(out_dir: Path, overrides: list[str], began: bool) -> str:
    """The line a start stopped by Ctrl-C ends with: the last step its run logged, its newest
    checkpoint and the command that continues from it (``overrides``: the start's). A start
    that had not ``began`` left the folder as it was (provenance.json then records nothing;
    a start that began records itself "interrupted")."""
    last, steps = _progress(out_dir)
    if not began and last is None:
        return NOTHING_WRITTEN
    at = f"after step {max(steps)} (the last one logged)" if steps else "before it logged a step"
    if not began:
        at = "before this start began (the run's folder is as it was)"
    if last is None:
        return (
            f"moestack-train: interrupted {at}; no checkpoint was written in {out_dir}, so "
            "there is nothing to resume: run the command again to start over"
        )
    return (
        f"moestack-train: interrupted {at}; the last checkpoint is {last}: continue from it "
        f"with {resume_command(overrides, out_dir)}"
    )


def _metrics(out_dir: Path) -> list[dict]:
    from moestack.metrics import read_metrics

    try:
        return read_metrics(out_dir / "metrics.jsonl")
    except OSError:
        return []


def resume_command(overrides: list[str], out_dir: Path) -> str:
    """The command line that resumes the run in ``out_dir``: the start's own overrides (a
    resumed run keeps its config, and these give it no other value), ``out_dir`` and
    ``resume=true``."""
    from moestack.distributed import launch_info

    kept = [o for o in overrides if o.lstrip("+~").partition("=")[0] not in ("out_dir", "resume")]
    words = ["moestack-train", *kept, f"out_dir={out_dir}", "resume=true"]
    if launch_info().active:
        return f"the same torchrun launch of {shlex.join(words)}"
    return shlex.join(words)
