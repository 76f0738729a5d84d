"""``moestack-train``: the hydra app over configs/ (also ``python -m moestack.train``, and
under torchrun). The training loop itself is ``moestack.trainer``; nothing imports this
module but the console entry point.

One run, one folder: hydra's run folder is ``out_dir`` when it is set (configs/train.yaml), so
``.hydra/``, ``train.log`` and everything the run writes sit together; the run also records
what produced it in ``provenance.json`` (``moestack.provenance``, with this command's line,
overrides and config choices). In a sweep (``-m``) a job that fails logs one line and
the sweep goes on; the exit status is the number of jobs that failed.

A start checks first and creates after. Before hydra composes anything, the overrides are
checked against the config (``moestack.overrides``: an unknown key or a value of the wrong
type is one line, exit status 2). A run is then composed by hydra without hydra's writes
(``moestack.hydra_run``: a ``hydra.run.dir`` apart from ``out_dir`` is checked against the
run it belongs to), and the trainer checks the rest (``out_dir`` and what it holds, the
config against the run's on resume, the data, the model, a resumed run's weights, the ranks)
before it writes anything: hydra's record and ``train.log`` come at the trainer's ``begin``
point, with the run's own files. A refused start has written nothing, so it leaves the
folder as it was. A resume takes the run's own config.yaml, with only the fields its own
command line gives (``moestack.runs.resumed_config``). Ctrl-C, whenever it comes
(``moestack.interrupts``: held during the start-up, raised at once while a run trains,
ignored once the command stops), ends the command with one line naming the last step
logged, the newest checkpoint and the command that continues from it (exit status 130).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import moestack
from moestack import interrupts
from moestack.errors import MoestackError
from moestack.run_paths import check_out_dir, check_record_dir

if TYPE_CHECKING:
    from moestack import sweep_summary
    from moestack.config import TrainConfig

# Only what is light is imported above: a Ctrl-C is held (moestack.interrupts) from the first
# line of main(), which imports torch, hydra and the trainer.

log = logging.getLogger(__name__)

_MAX_STATUS = 125  # exit statuses above are the shell's own
_jobs: list[sweep_summary.SweepJob] = []  # this process's sweep jobs, as they ended
# hydra's flags that are no plain run: hydra.main answers them (a sweep, --cfg, --help, ...)
_HYDRA_COMMANDS = ("multirun", "cfg", "info", "help", "hydra_help", "shell_completion",
                   "config_path", "config_name", "config_dir", "experimental_rerun",
                   "resolve", "package")  # fmt: skip


def torchrun_out_dir(argv: list[str], env: Mapping[str, str]) -> str | None:
    """The run folder every rank of a torchrun launch without ``out_dir`` agrees on, with no
    message between them: ``outputs/torchrun/<run id>`` (torchrun gives each launch an id,
    the same on every rank: a fresh one with ``--standalone``); None outside torchrun, in a
    sweep, with ``out_dir`` given, or when the launch has no id of its own."""
    from moestack.distributed import launch_info
    from moestack.overrides import hydra_arguments, override_value

    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    if launch_info(env).world_size <= 1 or run_id in ("", "none"):
        return None
    args = hydra_arguments(argv)
    if args is None or args.multirun or override_value(args.overrides, "out_dir") is not None:
        return None
    return f"outputs/torchrun/{run_id}"


def _plain_run(args: Any) -> bool:
    """Whether the command line is one run (no hydra command, no ``hydra.mode``)."""
    from moestack.overrides import override_value

    if any(getattr(args, name) for name in _HYDRA_COMMANDS):
        return False
    return override_value(args.overrides, "hydra.mode") is None


def _check_sweep_folder(args: Any) -> None:
    """A sweep's ``out_dir`` (its jobs' parent, which hydra makes) checked before hydra."""
    from moestack.overrides import override_value

    out_dir = override_value(args.overrides, "out_dir")
    if out_dir and "${" not in out_dir:
        check_out_dir(Path(out_dir))


def _check_record_dir(record: Path, out_dir: Path, configured: str) -> None:
    """A ``hydra.run.dir`` apart from ``out_dir`` (``configured``: the config's out_dir):
    refused when it cannot hold a record or is another run's."""
    if configured and os.path.abspath(record) == os.path.abspath(out_dir):
        return
    check_out_dir(record, "hydra.run.dir")
    check_record_dir(record, out_dir)


# --------------------------------------------------------------------------- provenance
def launch_record(hydra_cfg: Any) -> dict[str, Any]:
    """How hydra started this run, for its provenance record (``moestack.provenance``): the
    command, its overrides, the chosen config group options, the sweep and job."""
    from omegaconf import OmegaConf

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
def _run_one(overrides: list[str]) -> None:
    """One run: composed by hydra (nothing written), checked, then trained; a refusal is one
    line, exit status 2, and leaves nothing behind."""
    from hydra._internal.utils import run_and_report
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.utils import env_override

    from moestack.hydra_run import HydraRecord, HydraRun
    from moestack.trainer import Trainer

    run = run_and_report(lambda: HydraRun.compose(overrides))  # hydra's errors, as hydra says
    out_dir, trainer, there = run.record_dir, None, {}
    try:
        with interrupts.live(), env_override(run.hydra.job.env_set):
            cfg, out_dir = _run_config(run.task, run.hydra)
            _check_record_dir(Path(run.run_dir), out_dir, run.task.out_dir)
            there = interrupts.what_is_there(out_dir, Path(run.run_dir))
            trainer = Trainer(cfg, out_dir, launch_record(run.hydra), [HydraRecord(run)])
            trainer.train()
    except KeyboardInterrupt:  # one line saying how to continue, not a traceback
        began = trainer is not None and trainer.began
        _stop_interrupted(out_dir, list(run.hydra.overrides.task), began, there)
    except (MoestackError, ValueError) as err:
        interrupts.stopping()
        log.error("error: %s", err)
        sys.exit(2)
    finally:
        GlobalHydra.instance().clear()


def _run_config(dict_cfg: Any, hydra_cfg: Any) -> tuple[TrainConfig, Path]:
    """The run's config, built from hydra's (a bad value raises ValueError), and its folder.
    A resume takes the run's own config, with the fields its command line gives
    (``moestack.runs.resumed_config``: the defaults are not compared with the run's)."""
    from omegaconf import OmegaConf

    from moestack.distributed import launch_info
    from moestack.runs import resumed_config

    if launch_info().world_size > 1 and not dict_cfg.out_dir:
        raise MoestackError(
            "under torchrun without a launch id (--rdzv-id), set out_dir=<run dir> so every "
            "rank writes one run"
        )
    multirun = _is_sweep(hydra_cfg)
    # hydra's folder is out_dir (or the dated default); a sweep job's is out_dir/<job>.
    out_dir = (
        Path(dict_cfg.out_dir)
        if dict_cfg.out_dir and not multirun
        else Path(hydra_cfg.runtime.output_dir)
    )
    if dict_cfg.resume:
        cfg = resumed_config(out_dir, dict_cfg, list(hydra_cfg.overrides.task))
    else:
        cfg = OmegaConf.to_object(dict_cfg)
    cfg.out_dir = str(out_dir)  # config.yaml names the folder the run lives in
    return cfg, out_dir


def _is_sweep(hydra_cfg: Any) -> bool:
    from hydra.types import RunMode

    return hydra_cfg.mode == RunMode.MULTIRUN


# --------------------------------------------------------------------------- a sweep
def _hydra_task(dict_cfg: Any) -> None:
    """hydra.main's task: a sweep's job (or a run started with a hydra flag such as
    ``--config-name``: hydra has written its record and log then)."""
    from hydra.core.hydra_config import HydraConfig

    hydra_cfg = HydraConfig.get()
    if _is_sweep(hydra_cfg):
        _sweep_job(dict_cfg, hydra_cfg)
        return
    try:
        with interrupts.live():
            _run(dict_cfg, hydra_cfg)
    except KeyboardInterrupt:
        _stop_interrupted(Path(hydra_cfg.runtime.output_dir), list(hydra_cfg.overrides.task),
                          began=True)  # fmt: skip
    except (MoestackError, ValueError) as err:
        interrupts.stopping()
        log.error("error: %s", err)
        sys.exit(2)


def _run(dict_cfg: Any, hydra_cfg: Any) -> dict[str, Any]:
    """Build the config (its overrides were checked before hydra composed them), then train
    in the run's folder; returns its summary."""
    from moestack.trainer import train

    cfg, out_dir = _run_config(dict_cfg, hydra_cfg)
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
    from moestack import sweep_summary

    overrides = list(hydra_cfg.overrides.task)
    label = f"#{hydra_cfg.job.num} ({' '.join(overrides) or 'no overrides'})"
    ended = functools.partial(
        sweep_summary.SweepJob, hydra_cfg.job.num, overrides, Path(hydra_cfg.runtime.output_dir)
    )
    try:
        with interrupts.live(), _wandb_names(hydra_cfg):
            summary = _run(dict_cfg, hydra_cfg)
    except KeyboardInterrupt:  # Ctrl-C ends the sweep: the jobs after this one do not run
        _stop_interrupted(Path(hydra_cfg.runtime.output_dir), overrides, began=True)
    except (MoestackError, ValueError) as err:
        log.error("job %s failed: %s", label, err)
        _jobs.append(ended(str(err), None))
    except Exception as err:  # a bug or a crash: the traceback goes to the job's train.log
        log.exception("job %s failed", label)
        _jobs.append(ended(f"{type(err).__name__}: {err}", None))
    else:
        _jobs.append(ended(None, summary))


# --------------------------------------------------------------------------- Ctrl-C
def _stop_interrupted(
    out_dir: Path, overrides: list[str], began: bool, there: dict[Path, Any] | None = None
) -> None:
    """Say where the run in ``out_dir`` stopped (rank 0 only: every rank of a torchrun launch
    gets the Ctrl-C) and exit with the shell's status for it; later Ctrl-Cs are ignored. What
    a start that began added to the folders ``there`` (as they were before it), where its run
    logged no step and kept no checkpoint, is removed first (``interrupts.discard_unused``):
    nothing is left that was not there."""
    from moestack.distributed import launch_info

    interrupts.stopping()
    if launch_info().is_main:
        removed = interrupts.discard_unused(out_dir, there or {}) if began else []
        line = (
            f"{interrupts.NOTHING_KEPT} (removed: {', '.join(removed)})"
            if removed
            else interrupts.stopped_line(out_dir, overrides, began)
        )
        _say(line, sys.stderr)
    sys.exit(interrupts.INTERRUPTED)


def _stop_before_the_run() -> None:
    """A Ctrl-C held before hydra made anything: one line, the shell's status for it."""
    interrupts.stopping()
    _say(interrupts.NOTHING_WRITTEN, sys.stderr)
    sys.exit(interrupts.INTERRUPTED)


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
    from moestack import sweep_summary

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
    from moestack.hydra_run import CONFIG_NAME, CONFIG_PATH, VERSION_BASE

    register_configs()
    app = hydra.main(config_path=CONFIG_PATH, config_name=CONFIG_NAME, version_base=VERSION_BASE)
    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.suppress(SystemExit):
        app(_hydra_task)()
    mine = f"--version : Show moestack's version and exit (hydra is {hydra.__version__})"
    sys.stdout.write(text.getvalue().replace(_HYDRAS_VERSION_FLAG, mine))


def main() -> None:
    """Console entry point of ``moestack-train``."""
    interrupts.install()  # first: a Ctrl-C is held till a run can stop cleanly
    if "--version" in sys.argv[1:]:  # before hydra, whose own --version names hydra's
        _say(f"moestack {moestack.__version__}", sys.stdout)
        return
    if "--hydra-help" in sys.argv[1:]:
        _hydra_help()
        return
    shared = torchrun_out_dir(sys.argv[1:], os.environ)
    if shared is not None:  # every rank's run folder, before hydra composes out_dir
        sys.argv.append(f"out_dir={shared}")
    try:
        from moestack.overrides import check_command_line, hydra_arguments

        check_command_line(sys.argv[1:])  # before hydra: it would take a typo's '+' silently
        args = hydra_arguments(sys.argv[1:])
        one_run = args is not None and _plain_run(args)
        if args is not None and not one_run:
            _check_sweep_folder(args)
    except MoestackError as err:
        interrupts.stopping()
        _say(f"error: {err}", sys.stderr)
        sys.exit(2)
    from moestack import trainer  # noqa: F401  (imported while a Ctrl-C is held)
    from moestack.config import register_configs

    if interrupts.held():  # nothing made yet
        _stop_before_the_run()
    register_configs()
    _jobs.clear()
    try:
        if one_run:
            _run_one(args.overrides)
        else:
            _hydra_main()
    except KeyboardInterrupt:  # outside a run (a run says where it stopped)
        _stop_before_the_run()
    status = _sweep_status() if _jobs else 0
    if interrupts.held():  # after the run ended, while hydra closed it
        interrupts.stopping()
        _say("moestack-train: interrupted after the run ended; nothing is lost", sys.stderr)
        sys.exit(interrupts.INTERRUPTED)
    if status:  # a Ctrl-C from here on, as the interpreter exits, stays held: ignored
        sys.exit(status)


def _hydra_main() -> None:
    """hydra.main over the command line: a sweep, or one of hydra's commands."""
    import hydra

    from moestack.distributed import launch_info

    if not launch_info().is_main:  # one .hydra/ record a sweep job, rank 0's
        sys.argv.append("hydra.output_subdir=null")
    from moestack.hydra_run import CONFIG_NAME, CONFIG_PATH, VERSION_BASE

    app = hydra.main(config_path=CONFIG_PATH, config_name=CONFIG_NAME, version_base=VERSION_BASE)
    app(_hydra_task)()


if __name__ == "__main__":
    main()
