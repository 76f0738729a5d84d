"""moestack.configs: the hydra configs of ``moestack-train`` (train.yaml and one folder per
config group), installed as package data.

train.yaml uses three resolvers that hydra lacks. They are registered when this package is
imported, which hydra does before it reads any file of it (``pkg://moestack.configs``), so the
app, ``hydra.compose`` and ``--cfg hydra --resolve`` all resolve them:

- ``${moestack.run_dir:OUT_DIR,DEFAULT}``: OUT_DIR when set, else DEFAULT; the run folder (and a
  sweep's folder) follows ``out_dir``, so one run keeps everything, ``.hydra/`` included.
- ``${moestack.rank_suffix:}``: "" on rank 0, ``.rank<N>`` on the other torchrun ranks, so that
  each rank logs to its own file in the shared run folder.
- ``${moestack.help:SECTION}``: the text of ``moestack-train --help`` (``configs/_help.py``).

``below_warning`` is the logging filter that keeps warnings and errors off stdout: train.yaml
sends them to stderr instead.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from omegaconf import OmegaConf


def run_dir(out_dir: Any, default: Any) -> str:
    """``out_dir`` when the user set one, else hydra's dated default."""
    return str(out_dir) if out_dir not in (None, "") else str(default)


def rank_suffix() -> str:
    """Log file suffix of this torchrun rank ("" outside torchrun and on rank 0)."""
    from moestack.distributed import launch_info

    rank = launch_info().rank
    return "" if rank == 0 else f".rank{rank}"


def _help(section: str, *, _root_: Any) -> str:
    from moestack.configs._help import render

    return render(section, _root_)


def below_warning() -> Callable[[logging.LogRecord], bool]:
    """A logging filter passing records below WARNING (the stdout handler's)."""
    return lambda record: record.levelno < logging.WARNING


OmegaConf.register_new_resolver("moestack.run_dir", run_dir, replace=True)
OmegaConf.register_new_resolver("moestack.rank_suffix", rank_suffix, replace=True)
OmegaConf.register_new_resolver("moestack.help", _help, replace=True, use_cache=False)
