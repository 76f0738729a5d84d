"""``moestack-train``: the hydra app over configs/ (also ``python -m moestack.train``, and
under torchrun). The training loop itself is ``moestack.trainer``; nothing imports this
module but the console entry point.

One run, one folder: hydra's run folder is ``out_dir`` when it is set (configs/train.yaml), so
``.hydra/``, ``train.log`` and everything the run writes sit together; the run also records
what produced it in ``provenance.json`` (``moestack.provenance``, with this command's line,
overrides and config choices). In a sweep (``-m``) a job that fails logs one line and
the sweep goes on; the exit status is the number of jobs that failed.

Before hydra composes anything, the overrides are checked against the config
(``moestack.overrides``: an unknown key or a value of the wrong type is one line, exit
status 2), ``out_dir`` against what it holds (a run's checkpoints without ``resume=true`` are
refused before hydra writes its record there; a name longer than the file system takes), and
a ``hydra.run.dir`` apart from it against the run it belongs to (another run's folder or
record is refused). A resume takes the run's own config.yaml, with only the fields its own
command line gives (``moestack.runs.resumed_config``). A start refused later,
before it begins (a changed config on resume, missing data, a checkpoint of another shape:
the trainer writes nothing then, ``moestack.trainer.refused_start``), leaves the folder as it
was: the lines each rank logged are cut from its log, the run's ``.hydra/`` record is put back
and what hydra added is removed (the folders it made too, and only those; a folder not known
before hydra ran, an interpolated ``out_dir``, is left as hydra left it). Ctrl-C, whenever
it comes (``moestack.interrupts``: held during the start-up, raised at once while a run
trains, ignored once the command stops), ends the command with one line naming the last step
logged, the newest checkpoint and the command that continues from it (exit status 130); a
start interrupted before it began is put back as a refused one is.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import moestack
from moestack import interrupts, locks
from moestack.errors import MoestackError
from moestack.locks import LOCK_FILE
from moestack.run_paths import (
    check_out_dir,
    check_record_dir,
    missing_folders,
    remove_made_folders,
    sigterm_deferred,
)

if TYPE_CHECKING:
    from moestack import sweep_summary
    from moestack.config import TrainConfig

# Only what is light is imported above: a Ctrl-C is held (moestack.interrupts) from the first
# line of main(), which imports torch, hydra and the trainer.

log = logging.getLogger(__name__)

_MAX_STATUS = 125  # exit statuses above are the shell's own
_jobs: list[sweep_summary.SweepJob] = []  # this process's sweep jobs, as they ended


def _check_overrides(overrides: list[str], sweep: bool = True) -> None:
    """The overrides' check (``moestack.overrides.check_overrides``), by its old name."""
    from moestack.overrides import check_overrides

    check_overrides(overrides, sweep=sweep)


def _command_line_value(argv: list[str], key: str) -> str | None:
    """The value of the command line's last ``key=`` override, unquoted (None: absent)."""
    found = None
    for arg in argv:
        name, sep, value = arg.lstrip("+~").partition("=")
        if sep and name == key:
            found = value.strip("'\"")
    return found


def _command_line_out_dir(argv: list[str]) -> Path | None:
    """The ``out_dir=`` override of the command line (None when absent or interpolated)."""
    value = _command_line_value(argv, "out_dir")
    return Path(value) if value and "${" not in value else None


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


def _command_line_resume(argv: list[str]) -> bool:
    """Whether the command line sets ``resume=true`` (the last ``resume=`` override wins)."""
    resume = False
    for arg in argv:
        key, sep, value = arg.lstrip("+~").partition("=")
        if sep and key == "resume":
            resume = value.strip("'\"").lower() == "true"
    return resume


def check_out_dir_early(argv: list[str]) -> None:
    """Refuse an ``out_dir`` that cannot hold a run, that another process trains into, or
    that holds a run's checkpoints without ``resume=true``, and a ``hydra.run.dir`` apart
    from it that is another run's, before hydra writes its own record (``.hydra/``,
    ``train.log``) there: a refused start leaves the run's as it was."""
    from moestack import checkpoint
    from moestack.runs import check_run_dir_free

    out_dir = _command_line_out_dir(argv)
    sweep = any(arg in ("-m", "--multirun") for arg in argv)
    record = _command_line_value(argv, "hydra.run.dir")
    if record and "${" not in record and not sweep:
        check_out_dir(Path(record), "hydra.run.dir")
        check_record_dir(Path(record), out_dir or Path(record))
    if out_dir is None:
        return
    check_out_dir(out_dir)
    if sweep:
        return  # a sweep's jobs hold subfolders of their own
    if os.environ.get("RANK", "0") == "0":
        check_run_dir_free(out_dir)
    if not _command_line_resume(argv) and checkpoint.latest_checkpoint(out_dir / "checkpoints"):
        raise MoestackError(
            f"{out_dir} already holds checkpoints; pass resume=true to continue it or pick "
            "another out_dir"
        )  # the words of moestack.runs.prepare_out_dir, which checks again once hydra composed


def _is_sweep(hydra_cfg: Any) -> bool:
    from hydra.types import RunMode

    return hydra_cfg.mode == RunMode.MULTIRUN


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
def _run(dict_cfg: Any, hydra_cfg: Any) -> dict[str, Any]:
    """Build the config (its overrides were checked before hydra composed them), then train
    in the run's folder; returns its summary."""
    from moestack.trainer import train

    cfg, out_dir = _run_config(dict_cfg, hydra_cfg)
    return train(cfg, out_dir, launch=launch_record(hydra_cfg))


def _run_config(dict_cfg: Any, hydra_cfg: Any) -> tuple[TrainConfig, Path]:
    """The run's config, built from hydra's (a bad value raises ValueError), and its folder.
    A resume takes the run's own config, with the fields its command line gives
    (``moestack.runs.resumed_config``: the defaults are not compared with the run's)."""
    from omegaconf import OmegaConf

    from moestack.runs import resumed_config

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dict_cfg.out_dir:
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


def _hydra_task(dict_cfg: Any, before: _FolderBefore | None = None) -> None:
    """One hydra job: a sweep's job, or the run (``before``: its ``out_dir`` as ``main``
    found it, so that a refused or interrupted start removes only what it added). A Ctrl-C
    held while hydra made the folder is raised as the job starts (``interrupts.live``)."""
    from hydra.core.hydra_config import HydraConfig

    from moestack.trainer import refused_start, train

    before = before or _FolderBefore()
    hydra_cfg = HydraConfig.get()
    if _is_sweep(hydra_cfg):
        _sweep_job(dict_cfg, hydra_cfg)
        return
    overrides, hydra_dir = list(hydra_cfg.overrides.task), Path(hydra_cfg.runtime.output_dir)
    out_dir, training = hydra_dir, False  # a config refused before train() is refused too
    try:
        with interrupts.live():
            cfg, out_dir = _run_config(dict_cfg, hydra_cfg)
            training = True
            train(cfg, out_dir, launch=launch_record(hydra_cfg))
    except KeyboardInterrupt as err:  # one line saying how to continue, not a traceback
        interrupts.stopping()
        began = training and _began(err)
        if not began:  # nothing of the run was written: nor is anything of hydra's kept
            before.put_back(hydra_dir)
        _stop_interrupted(out_dir, overrides, began)
    except (MoestackError, ValueError) as err:
        interrupts.stopping()
        log.error("error: %s", err)
        if not training or refused_start(err):  # the run wrote nothing: nor does hydra
            before.put_back(hydra_dir)
        sys.exit(2)


def _began(err: BaseException) -> bool:
    """Whether the start ``train`` was interrupted in had begun (``moestack.trainer`` marks
    what its start raised; a Ctrl-C before the start held the folder is unmarked)."""
    from moestack.trainer import _REFUSED_START

    return getattr(err, _REFUSED_START, True) is False


# --------------------------------------------------------------------------- a refused start
# What a start writes before it begins (moestack.trainer.build_run): hydra's record and log,
# and the folder's lock; the run's own files (config.yaml, provenance.json, ...) come after.
_LOG_FILE = re.compile(r"train(\.rank\d+)?\.log")  # hydra's log of the run, one a rank
_START_FILES = re.compile(r"\.hydra|" + _LOG_FILE.pattern + "|" + re.escape(LOCK_FILE))


_DATED_ROOT = "outputs"  # hydra's run folder without out_dir: outputs/<date>/<time>


@dataclass
class _FolderBefore:
    """What the run folder held before hydra wrote into it: the folder (``folder``: absolute
    and normalised, as hydra's ``runtime.output_dir``), whether it existed (if not, the
    folders hydra would make: it and those above it that were not there), the names in it,
    the files of its ``.hydra/`` record (small YAML files) and the sizes of its log files
    (hydra appends to them). Hydra's dated default folder is new (``dated``: all in it is the
    start's): only which folders above it were missing is recorded. A folder not known
    before hydra (``folder`` None and not dated: an interpolated ``out_dir``, one set other
    than on the command line) is not this start's to put back: nothing in it is touched."""

    folder: Path | None = None
    dated: bool = False
    existed: bool = False
    missing: tuple[Path, ...] = ()  # runs.missing_folders: absolute, deepest first
    names: frozenset[str] = frozenset()
    hydra_record: dict[str, bytes] = field(default_factory=dict)
    log_sizes: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of_command_line(cls, argv: list[str]) -> _FolderBefore:
        """The run folder the command line names, read before hydra: ``hydra.run.dir=``,
        else ``out_dir=`` (configs/train.yaml), else the dated default; unknown when the
        value is interpolated."""
        value = _command_line_value(argv, "hydra.run.dir") or _command_line_value(argv, "out_dir")
        if not value:  # hydra's ${now:%Y-%m-%d} (a start across midnight leaves that folder)
            today = Path(_DATED_ROOT, time.strftime("%Y-%m-%d"))
            return cls(dated=True, missing=missing_folders(today))
        return cls() if "${" in value else cls.read(Path(value))

    @classmethod
    def read(cls, out_dir: Path) -> _FolderBefore:
        folder = Path(os.path.abspath(out_dir))
        if not out_dir.is_dir():
            return cls(folder=folder, missing=missing_folders(out_dir))
        record = out_dir / ".hydra"
        files = sorted(record.iterdir()) if record.is_dir() else []
        saved = {p.name: p.read_bytes() for p in files if p.is_file()}
        names = frozenset(p.name for p in out_dir.iterdir())
        logs = {n: (out_dir / n).stat().st_size for n in names if _LOG_FILE.fullmatch(n)}
        return cls(folder=folder, existed=True, names=names, hydra_record=saved, log_sizes=logs)

    def describes(self, out_dir: Path) -> bool:
        """Whether ``out_dir`` (hydra's run folder) is the folder read before the start."""
        folder = Path(os.path.abspath(out_dir))
        if self.dated:
            return folder.parent.parent == Path(os.path.abspath(_DATED_ROOT))
        return self.folder is not None and folder == self.folder

    def put_back(self, out_dir: Path) -> None:
        """Leave ``out_dir`` as it was before a refused start: this process's log lines cut
        off, the ``.hydra/`` record put back (rank 0), and what the start added removed.
        Nothing in it is touched while another process holds the folder (it took it after
        this start was refused: its log lines, record and lock are that run's), nor when it
        is not the folder read before (``describes``). SIGTERM waits till the end."""
        if not self.describes(out_dir):
            return
        with sigterm_deferred():
            held = _held_by_another_run(out_dir / LOCK_FILE)
            self.cut_log(out_dir, truncate=not held)
            if held:
                return
            if os.environ.get("RANK", "0") == "0":
                self.restore_hydra_record(out_dir)
            _remove_refused_folder(out_dir, self)

    def cut_log(self, out_dir: Path, truncate: bool = True) -> None:
        """Cut the lines this process logged into ``out_dir``'s log file (hydra's file
        handler, closed here) back to the size the file had: hydra only appends
        (``truncate=False``: the handler closed only)."""
        folder = os.path.abspath(out_dir)
        root = logging.getLogger()
        for handler in list(root.handlers):
            if not isinstance(handler, logging.FileHandler):
                continue
            path = Path(handler.baseFilename)
            if str(path.parent) != folder or path.name not in self.log_sizes:
                continue
            root.removeHandler(handler)
            handler.close()  # flushed: nothing more lands in the file
            with contextlib.suppress(OSError):
                if truncate and path.stat().st_size >= self.log_sizes[path.name]:
                    os.truncate(path, self.log_sizes[path.name])

    def restore_hydra_record(self, out_dir: Path) -> None:
        """Put back the ``.hydra/`` record a refused start into a run's folder overwrote with
        its own (hydra writes it before the run's checks can refuse)."""
        record = out_dir / ".hydra"
        if not self.hydra_record or not record.is_dir():
            return
        for path in record.iterdir():
            if path.is_file() and path.name not in self.hydra_record:
                path.unlink()
        for name, data in self.hydra_record.items():
            (record / name).write_bytes(data)


_RANK0_LETS_GO_S = 10.0  # how long a rank > 0 waits for its rank 0 to drop the folder's lock


def _held_by_another_run(lock: Path) -> bool:
    """Whether another run holds the folder's ``lock`` now. On a rank > 0 of a torchrun
    launch the holder may be this launch's rank 0, refused too and about to let go: it is
    waited for (up to ``_RANK0_LETS_GO_S``), else that rank's own log lines would stay."""
    if os.environ.get("RANK", "0") == "0":
        return locks.is_held(lock)
    deadline = time.monotonic() + _RANK0_LETS_GO_S
    while locks.is_held(lock):
        if time.monotonic() > deadline:
            return True
        time.sleep(0.01)
    return False


def _remove_refused_folder(out_dir: Path, before: _FolderBefore) -> None:
    """A refused start leaves nothing new: what it added to ``out_dir`` (hydra's record and
    log, the lock file) is removed, and the folders it made too, each only while empty:
    ``out_dir`` and those above it that were not there before (a dated default one is new,
    ``outputs/<date>`` and ``outputs`` when they were missing). Should it have added
    anything else (a run's metrics, checkpoints), everything stays."""
    try:
        added = [p for p in out_dir.iterdir() if before.dated or p.name not in before.names]
    except OSError:
        return
    if not all(_START_FILES.fullmatch(p.name) for p in added):
        return  # a run that began: kept
    for path in added:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    if before.dated:
        remove_made_folders([Path(os.path.abspath(out_dir)), *before.missing])
    elif not before.existed:
        remove_made_folders(before.missing)


# --------------------------------------------------------------------------- Ctrl-C
def _stop_interrupted(out_dir: Path, overrides: list[str], began: bool) -> None:
    """Say where the run in ``out_dir`` stopped (rank 0 only: every rank of a torchrun launch
    gets the Ctrl-C) and exit with the shell's status for it; later Ctrl-Cs are ignored."""
    interrupts.stopping()
    if os.environ.get("RANK", "0") == "0":
        _say(interrupts.stopped_line(out_dir, overrides, began), sys.stderr)
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

    register_configs()
    app = hydra.main(config_path="pkg://moestack.configs", config_name="train", version_base="1.3")
    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.suppress(SystemExit):
        app(_hydra_task)()
    mine = f"--version : Show moestack's version and exit (hydra is {hydra.__version__})"
    sys.stdout.write(text.getvalue().replace(_HYDRAS_VERSION_FLAG, mine))


def main() -> None:
    """Console entry point of ``moestack-train``."""
    interrupts.install()  # first: a Ctrl-C is held till what the start made can be undone
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
        from moestack.overrides import check_command_line

        check_command_line(sys.argv[1:])  # before hydra: it would take a typo's '+' silently
        check_out_dir_early(sys.argv[1:])
    except MoestackError as err:
        interrupts.stopping()
        _say(f"error: {err}", sys.stderr)
        sys.exit(2)
    if os.environ.get("RANK", "0") != "0":  # one .hydra/ record a run, rank 0's: another
        # rank's would land after rank 0 put the run's back when a start is refused
        sys.argv.append("hydra.output_subdir=null")
    import hydra

    from moestack import trainer  # noqa: F401  (imported while a Ctrl-C is held)
    from moestack.config import register_configs

    before = _FolderBefore.of_command_line(sys.argv[1:])

    @functools.wraps(_hydra_task)
    def task(dict_cfg: Any) -> None:
        _hydra_task(dict_cfg, before)

    if interrupts.held():  # nothing made yet
        _stop_before_the_run()
    register_configs()
    _jobs.clear()
    app = hydra.main(config_path="pkg://moestack.configs", config_name="train", version_base="1.3")
    try:
        app(task)()
    except KeyboardInterrupt:  # outside a run (a run says where it stopped)
        _stop_before_the_run()
    status = _sweep_status() if _jobs else 0
    if interrupts.held():  # after the run ended, while hydra closed it
        interrupts.stopping()
        _say("moestack-train: interrupted after the run ended; nothing is lost", sys.stderr)
        sys.exit(interrupts.INTERRUPTED)
    if status:  # a Ctrl-C from here on, as the interpreter exits, stays held: ignored
        sys.exit(status)


if __name__ == "__main__":
    main()
