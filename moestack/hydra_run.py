"""One ``moestack-train`` run through hydra, with nothing written before the start's checks.

``hydra.main`` makes the run folder, opens ``train.log`` and writes its ``.hydra/`` record
before the task runs, so a start refused by its checks would leave them behind. A run (not a
sweep, nor ``--cfg``/``--help``/``--info``) is composed here as ``hydra.main`` composes it
(the same search path, overrides, ``hydra.mode=RUN``, hydra's own logging, its config
singleton and ``hydra.runtime.output_dir``), and nothing more until the trainer's ``begin``
point (``HydraRecord``): then the record folder is made, hydra's ``.hydra/`` record written
(rank 0, as ``run_job`` writes it) and ``train.log`` opened, holding every line logged since
the start (``HeldLog``). A refused start drops them: there is nothing to undo.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from moestack.callbacks import Callback

CONFIG_PATH = "pkg://moestack.configs"
CONFIG_NAME = "train"
VERSION_BASE = "1.3"  # as moestack.train's hydra.main
TASK_NAME = "train"  # hydra's job name: train.log, as hydra.main names it from moestack.train


class HeldLog(logging.FileHandler):
    """hydra's log file of the run (``train.log``, ``train.rank<N>.log``), not opened until
    ``write_held``: the records logged before are held, then written in order (their time
    stamps as logged). Dropped unreleased, it never makes the file."""

    def __init__(self, filename: str, mode: str = "a", encoding: str | None = None,
                 delay: bool = True, errors: str | None = None) -> None:  # fmt: skip
        super().__init__(filename, mode, encoding, delay=True, errors=errors)
        self.held: list[logging.LogRecord] | None = []

    def emit(self, record: logging.LogRecord) -> None:
        if self.held is not None:
            self.held.append(record)
            return
        super().emit(record)

    def write_held(self) -> None:
        """Open the file, write the held records, and write through from now on."""
        held, self.held = self.held or [], None
        for record in held:
            super().emit(record)


@dataclass
class HydraRun:
    """hydra's composed config of one run (``config``, its ``hydra`` node included), the
    job's config without it (``task``) and the folder of hydra's record and log."""

    config: DictConfig
    task: DictConfig
    run_dir: str  # hydra.run.dir, resolved as written (relative to the working folder)

    @classmethod
    def compose(cls, overrides: Sequence[str]) -> HydraRun:
        """Compose the run as ``hydra.main`` would, configure hydra's logging with the log
        file held, and set hydra's config singleton (``HydraConfig.get()``); writes nothing."""
        from hydra import version
        from hydra._internal.hydra import Hydra
        from hydra._internal.utils import create_automatic_config_search_path
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        version.setbase(VERSION_BASE)
        search = create_automatic_config_search_path(None, "moestack.train", CONFIG_PATH)
        app = Hydra.create_main_hydra2(task_name=TASK_NAME, config_search_path=search)
        overrides = list(overrides)
        if app.get_mode(config_name=CONFIG_NAME, overrides=overrides) is None:
            overrides.append("hydra.mode=RUN")  # as hydra.main's _run_app adds it
        config = app.compose_config(
            CONFIG_NAME, overrides, run_mode=RunMode.RUN, with_log_configuration=True
        )
        HydraConfig.instance().set_config(config)
        run_dir = str(OmegaConf.select(config, "hydra.run.dir"))
        with read_write(config.hydra.runtime), open_dict(config.hydra.runtime):
            config.hydra.runtime.output_dir = os.path.abspath(run_dir)
        HydraConfig.instance().set_config(config)
        task = copy.deepcopy(config)
        with read_write(task), open_dict(task):
            del task["hydra"]
        _configure_held_logging(config)
        return cls(config, task, run_dir)

    @property
    def hydra(self) -> DictConfig:
        """The ``hydra`` node (``HydraConfig.get()``)."""
        return self.config.hydra

    @property
    def record_dir(self) -> Path:
        """The folder of hydra's record and log, absolute: ``hydra.run.dir`` (``out_dir``,
        unless set apart from it, or the dated default)."""
        return Path(self.config.hydra.runtime.output_dir)


def _configure_held_logging(config: DictConfig) -> None:
    """hydra's job logging (``hydra.job_logging``), its log files held (``HeldLog``)."""
    from hydra.core.utils import configure_log

    conf = OmegaConf.to_container(config.hydra.job_logging, resolve=True)
    for handler in (conf or {}).get("handlers", {}).values():
        if handler.get("class") == "logging.FileHandler":
            handler["class"] = f"{__name__}.HeldLog"
    configure_log(OmegaConf.create(conf), config.hydra.verbose)


class HydraRecord(Callback):
    """At ``begin`` (the start's checks passed): hydra's record folder made, its ``.hydra/``
    record written (rank 0; none with ``hydra.output_subdir=null``) and the held log lines
    written to ``train.log``."""

    def __init__(self, run: HydraRun) -> None:
        self.run = run

    def begin(self, trainer: Any) -> None:
        from hydra.core.hydra_config import HydraConfig
        from hydra.core.utils import _save_config

        hydra = self.run.hydra
        self.run.record_dir.mkdir(parents=True, exist_ok=True)
        if trainer.dist.is_main and hydra.output_subdir is not None:
            folder = self.run.record_dir / str(hydra.output_subdir)
            _save_config(self.run.task, "config.yaml", folder)
            _save_config(copy.deepcopy(HydraConfig.instance().cfg), "hydra.yaml", folder)
            _save_config(hydra.overrides.task, "overrides.yaml", folder)
        for handler in logging.getLogger().handlers:
            if isinstance(handler, HeldLog):
                handler.write_held()
