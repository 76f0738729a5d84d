"""``moestack-train``: the hydra app over configs/ (also ``python -m moestack.train``, and
under torchrun). The training loop itself is ``moestack.trainer``; nothing imports this
module but the console entry point.

One run, one folder: hydra's run folder is ``out_dir`` when it is set (configs/train.yaml), so
``.hydra/``, ``train.log`` and everything the run writes sit together; the run also records
what produced it in ``provenance.json`` (``moestack.provenance``, with this command's line,
overrides and config choices). In a sweep (``-m``) a job that fails logs one line and
the sweep goes on; the exit status is the number of jobs that failed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import re
import shutil
import sys
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from omegaconf import OmegaConf

import moestack
from moestack import sweep_summary
from moestack.config import TrainConfig
from moestack.errors import MoestackError
from moestack.runs import LOCK_FILE, check_out_dir, check_run_dir_free
from moestack.trainer import train

log = logging.getLogger(__name__)

_MAX_STATUS = 125  # exit statuses above are the shell's own
_jobs: list[sweep_summary.SweepJob] = []  # this process's sweep jobs, as they ended


def _check_overrides(overrides: list[str]) -> None:
    """``model.router`` is filled from ``router``: an override of it would be dropped, so it
    is refused with the override to write instead. A true/false field takes only true or
    false: the config library would read ``compile=2`` (or 0) as a bool without a word."""
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        if key == "model.router" or key.startswith("model.router."):
            fix = override.lstrip("+~").replace("model.router", "router", 1)
            raise MoestackError(
                f"{override!r}: the router is configured in one place, the `router` group; "
                f"write {fix!r}"
            )
        if _field_type(TrainConfig, key) is bool and value.strip().lower() not in ("true", "false"):
            raise MoestackError(f"{override!r}: {key} is true or false, not {value!r}")


def _field_type(config: type, key: str) -> Any:
    """The type of the config field a dotted key names (None when it names none); a field
    typed Any that holds a config node (``TrainConfig.model``) is typed by that node's
    class, as the command line fills it."""
    head, _, rest = key.partition(".")
    fields = (
        {f.name: f for f in dataclasses.fields(config)} if dataclasses.is_dataclass(config) else {}
    )
    if head not in fields:
        return None
    kind = typing.get_type_hints(config)[head]
    factory = fields[head].default_factory
    if kind is Any and isinstance(factory, type) and dataclasses.is_dataclass(factory):
        kind = factory
    return _field_type(kind, rest) if rest else kind


def _command_line_out_dir(argv: list[str]) -> Path | None:
    """The ``out_dir=`` override of the command line (None when absent or interpolated)."""
    found = None
    for arg in argv:
        key, sep, value = arg.lstrip("+~").partition("=")
        if sep and key == "out_dir" and value and "${" not in value:
            found = Path(value.strip("'\""))
    return found


def torchrun_out_dir(argv: list[str], env: dict[str, str]) -> str | None:
    """The run folder every rank of a torchrun launch without ``out_dir`` agrees on, with no
    message between them: ``outputs/torchrun/<run id>`` (torchrun gives each launch an id,
    the same on every rank: a fresh one with ``--standalone``); None outside torchrun, in a
    sweep, with ``out_dir`` given, or when the launch has no id of its own."""
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    if int(env.get("WORLD_SIZE", "1")) <= 1 or _command_line_out_dir(argv) is not None:
        return None
    if any(arg in ("-m", "--multirun") for arg in argv) or run_id in ("", "none"):
        return None
    return f"outputs/torchrun/{run_id}"


def check_out_dir_early(argv: list[str]) -> None:
    """Refuse an ``out_dir`` that cannot hold a run, or that another process trains into,
    before hydra writes its own record (``.hydra/``, ``train.log``) into it."""
    out_dir = _command_line_out_dir(argv)
    if out_dir is None:
        return
    check_out_dir(out_dir)
    sweep = any(arg in ("-m", "--multirun") for arg in argv)  # its jobs hold their subfolders
    if not sweep and os.environ.get("RANK", "0") == "0":
        check_run_dir_free(out_dir)


def _is_sweep(hydra_cfg: Any) -> bool:
    from hydra.types import RunMode

    return hydra_cfg.mode == RunMode.MULTIRUN


# --------------------------------------------------------------------------- provenance
def launch_record(hydra_cfg: Any) -> dict[str, Any]:
    """How hydra started this run, for its provenance record (``moestack.provenance``): the
    command, its overrides, the chosen config group options, the sweep and job."""
    choices = OmegaConf.to_container(hydra_cfg.runtime.choices)
    sweep = None
    if _is_sweep(hydra_cfg):
        sweep = {"dir": str(hydra_cfg.sweep.dir), "job": int(hydra_cfg.job.num)}
    return {
        "command": [Path(sys.argv[0]).name, *sys.argv[1:]],
        "overrides": list(hydra_cfg.overrides.task),
        "choices": {k: v for k, v in choices.items() if not k.startswith("hydra/")},
        "sweep": sweep,
    }


# --------------------------------------------------------------------------- one run
def _run(dict_cfg: Any, hydra_cfg: Any) -> dict[str, Any]:
    """Check and build the config, then train in the run's folder; returns its summary."""
    _check_overrides(list(hydra_cfg.overrides.task))
    cfg: TrainConfig = OmegaConf.to_object(dict_cfg)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not cfg.out_dir:
        raise MoestackError(
            "under torchrun without a launch id (--rdzv-id), set out_dir=<run dir> so every "
            "rank writes one run"
        )
    multirun = _is_sweep(hydra_cfg)
    # hydra's folder is out_dir (or the dated default); a sweep job's is out_dir/<job>.
    out_dir = (
        Path(cfg.out_dir) if cfg.out_dir and not multirun else Path(hydra_cfg.runtime.output_dir)
    )
    cfg.out_dir = str(out_dir)  # config.yaml names the folder the run lives in
    return train(cfg, out_dir, launch=launch_record(hydra_cfg))


@contextlib.contextmanager
def _wandb_names(hydra_cfg: Any) -> Iterator[None]:
    """A sweep job's wandb run is named by its overrides and grouped by its sweep (unless
    WANDB_NAME / WANDB_RUN_GROUP are set); the environment is restored after the job."""
    names = {
        "WANDB_RUN_GROUP": str(hydra_cfg.sweep.dir),
        "WANDB_NAME": hydra_cfg.job.override_dirname or f"job{hydra_cfg.job.num}",
    }
    added = [key for key in names if key not in os.environ]
    os.environ.update({key: names[key] for key in added})
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def _sweep_job(dict_cfg: Any, hydra_cfg: Any) -> None:
    """One job of a sweep: its failure is logged (one line for a bad value) and counted,
    never raised, so the other jobs run."""
    overrides = list(hydra_cfg.overrides.task)
    label = f"#{hydra_cfg.job.num} ({' '.join(overrides) or 'no overrides'})"
    ended = functools.partial(
        sweep_summary.SweepJob, hydra_cfg.job.num, overrides, Path(hydra_cfg.runtime.output_dir)
    )
    try:
        with _wandb_names(hydra_cfg):
            summary = _run(dict_cfg, hydra_cfg)
    except (MoestackError, ValueError) as err:
        log.error("job %s failed: %s", label, err)
        _jobs.append(ended(str(err), None))
    except Exception as err:  # a bug or a crash: the traceback goes to the job's train.log
        log.exception("job %s failed", label)
        _jobs.append(ended(f"{type(err).__name__}: {err}", None))
    else:
        _jobs.append(ended(None, summary))


def _hydra_task(dict_cfg: Any) -> None:
    from hydra.core.hydra_config import HydraConfig

    hydra_cfg = HydraConfig.get()
    if _is_sweep(hydra_cfg):
        _sweep_job(dict_cfg, hydra_cfg)
        return
    try:
        _run(dict_cfg, hydra_cfg)
    except (MoestackError, ValueError) as err:
        log.error("error: %s", err)
        _remove_refused_folder(Path(hydra_cfg.runtime.output_dir), dated=not dict_cfg.out_dir)
        sys.exit(2)


_HYDRA_ONLY = re.compile(r"\.hydra|train(\.rank\d+)?\.log|" + re.escape(LOCK_FILE))


def _remove_refused_folder(out_dir: Path, dated: bool) -> None:
    """A refused run leaves no folder: remove ``out_dir`` when it holds nothing but what
    hydra wrote for this start (``.hydra/``, the log); and the empty ``outputs/<date>``
    above a dated default one."""
    try:
        names = [p.name for p in out_dir.iterdir()]
    except OSError:
        return
    if not all(_HYDRA_ONLY.fullmatch(name) for name in names):
        return  # a run, or the user's own files: kept
    shutil.rmtree(out_dir, ignore_errors=True)
    for parent in (out_dir.parent, out_dir.parent.parent) if dated else ():
        with contextlib.suppress(OSError):
            parent.rmdir()  # only while empty


def _say(message: str, stream: TextIO) -> None:
    """One line of the command's own output on ``stream``, through a logger of its own: after
    a sweep, hydra's handlers (a job's train.log, its stdout/stderr split) are gone."""
    out = logging.getLogger("moestack.train.console")
    out.propagate = False
    out.setLevel(logging.INFO)
    handler = logging.StreamHandler(stream)
    out.addHandler(handler)
    try:
        out.info(message)
    finally:
        out.removeHandler(handler)


def _sweep_status() -> int:
    """Print the table comparing the sweep's jobs (and write it beside them), report the
    failed jobs on stderr; returns the exit status (their number)."""
    rows = sweep_summary.rows(_jobs)
    sweep_dir = _jobs[0].out_dir.parent
    written = sweep_summary.write(sweep_dir, rows)
    _say(f"{sweep_summary.format_table(rows)}\n(also in {written})", sys.stdout)
    failed = [job for job in _jobs if job.error is not None]
    if not failed:
        _say(f"moestack-train: all {len(_jobs)} jobs finished", sys.stdout)
        return 0
    _say(f"moestack-train: {len(failed)} of {len(_jobs)} jobs failed:", sys.stderr)
    for job in failed:
        _say(f"  job #{job.num} ({' '.join(job.overrides) or 'no overrides'}): {job.error}",
             sys.stderr)  # fmt: skip
    return min(len(failed), _MAX_STATUS)


_HYDRAS_VERSION_FLAG = "--version : Show Hydra's version and exit"


def _hydra_help() -> None:
    """hydra's own help, except that ``--version`` is moestack's here (``main`` takes it
    before hydra sees it)."""
    import io

    import hydra

    from moestack.config import register_configs

    register_configs()
    app = hydra.main(config_path="pkg://moestack.configs", config_name="train", version_base="1.3")
    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.suppress(SystemExit):
        app(_hydra_task)()
    mine = f"--version : Show moestack's version and exit (hydra is {hydra.__version__})"
    sys.stdout.write(text.getvalue().replace(_HYDRAS_VERSION_FLAG, mine))


def main() -> None:
    """Console entry point of ``moestack-train``."""
    if "--version" in sys.argv[1:]:  # before hydra, whose own --version names hydra's
        _say(f"moestack {moestack.__version__}", sys.stdout)
        return
    if "--hydra-help" in sys.argv[1:]:
        _hydra_help()
        return
    shared = torchrun_out_dir(sys.argv[1:], dict(os.environ))
    if shared is not None:  # before hydra, which makes the run folder from it
        sys.argv.append(f"out_dir={shared}")
    try:
        check_out_dir_early(sys.argv[1:])
    except MoestackError as err:
        _say(f"error: {err}", sys.stderr)
        sys.exit(2)
    import hydra

    from moestack.config import register_configs

    register_configs()
    _jobs.clear()
    app = hydra.main(config_path="pkg://moestack.configs", config_name="train", version_base="1.3")
    app(_hydra_task)()
    if _jobs:
        sys.exit(_sweep_status())


if __name__ == "__main__":
    main()
