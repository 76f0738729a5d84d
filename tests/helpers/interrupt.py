"""Ctrl-C sent to ``moestack-train`` at chosen moments: from inside the process, at the instant
named (deterministic, whatever the machine's load), or from outside once the run logged a
step. What each returns is the finished process, its stderr captured."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# The command run with a Ctrl-C planted at ``MOMENT`` (sys.argv[1]); the rest of sys.argv is
# moestack-train's. Moments:
#   import-finalizer  while main() imports hydra, from inside a finalizer (``__del__``), where
#                     Python prints a KeyboardInterrupt and drops it;
#   torch-import      as torch starts to import (the heaviest import of a start; before the
#                     package loaded its names lazily, it ran before main() took Ctrl-C over);
#   checks-passed     right after every check of the start passed, before it writes its first
#                     file (the trainer's begin), and a second one while the interpreter exits
#                     (an atexit callback);
#   folder-made       right after the start made its run folder (the trainer's begin, first
#                     thing).
_PLANTED = r"""
import atexit, builtins, gc, os, signal, sys, time
moment = sys.argv.pop(1)

def ctrl_c():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)  # the handler runs here, at the next line Python executes

if moment == "checks-passed":
    atexit.register(ctrl_c)  # runs last, after moestack's and torch's: the second Ctrl-C

    import moestack.trainer as trainer
    real_begin = trainer.Trainer.begin
    def begin(self):
        trainer.Trainer.begin = real_begin
        ctrl_c()
        return real_begin(self)
    trainer.Trainer.begin = begin

if moment == "folder-made":
    import moestack.run_folder as run_folder
    real_create = run_folder.RunFolder.create
    def create(self):
        real_create(self)
        ctrl_c()
    run_folder.RunFolder.create = create

if moment == "import-finalizer":
    class Finalized:
        def __del__(self):
            ctrl_c()

    real_import = builtins.__import__
    def importing(name, *args, **kwargs):
        if name == "hydra" or name.startswith("hydra."):
            builtins.__import__ = real_import
            Finalized()
            gc.collect()
        return real_import(name, *args, **kwargs)
    builtins.__import__ = importing

if moment == "torch-import":
    real_import = builtins.__import__
    def importing(name, *args, **kwargs):
        if name == "torch":
            builtins.__import__ = real_import
            ctrl_c()
        return real_import(name, *args, **kwargs)
    builtins.__import__ = importing

sys.argv[0] = "moestack-train"
from moestack.train import main
main()
"""


def planted(moment: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``moestack-train ARGS`` in ``cwd`` with a Ctrl-C at ``moment`` (see ``_PLANTED``)."""
    return subprocess.run(
        [sys.executable, "-c", _PLANTED, moment, *args],
        capture_output=True, text=True, cwd=cwd, timeout=300,
        env={**os.environ, "WANDB_MODE": "disabled"},
    )  # fmt: skip


def after_step(
    out: Path, *args: str, at_step: int, cwd: Path, again_after_s: float | None = None
) -> subprocess.CompletedProcess:
    """Start ``moestack-train ARGS`` (its metrics in ``out``) and send it SIGINT, what Ctrl-C
    sends, once ``out``/metrics.jsonl holds step ``at_step``; with ``again_after_s`` a second
    one that long after the first. The finished process."""
    env = {**os.environ, "WANDB_MODE": "disabled"}
    command = [sys.executable, "-m", "moestack.train", *args]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=cwd)  # fmt: skip
    try:
        while not logged(out / "metrics.jsonl", at_step):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        if again_after_s is not None:
            time.sleep(again_after_s)
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def logged(metrics: Path, step: int) -> bool:
    """Whether ``metrics`` holds a record of step ``step`` or later."""
    try:
        return any(json.loads(line).get("step", 0) >= step for line in metrics.open())
    except (OSError, ValueError):
        return False
