"""``moestack prereg``: the command line of pre-registered studies (lock, run, status, evaluate,
keep, restore, audit, analyze, power), each action a call into :mod:`moestack.prereg`; an
option given to an action it does not belong to is refused in one line."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from moestack.errors import MoestackError


def _check_prereg_options(args: argparse.Namespace) -> None:
    """Refuse an option given to a `prereg` action it does not belong to, naming both."""
    if args.action != "analyze" and args.interim:
        raise MoestackError(f"--interim belongs to `prereg analyze`, not `{args.action}`")
    if args.action not in ("analyze", "audit") and args.recheck != 1:
        raise MoestackError(
            f"--recheck belongs to `prereg analyze` and `audit`, not `{args.action}`"
        )
    if args.recheck < 0:
        raise MoestackError(f"--recheck {args.recheck}: give 0 or more runs per arm")
    if args.action not in ("run", "evaluate", "analyze") and args.jobs != 1:
        raise MoestackError(
            f"--jobs belongs to `prereg run`, `evaluate` and `analyze`, not `{args.action}`"
        )
    if args.action != "run" and args.quiet:
        raise MoestackError(f"--quiet belongs to `prereg run`, not `{args.action}`")
    if args.action != "lock" and args.force:
        raise MoestackError(f"--force belongs to `prereg lock`, not `{args.action}`")
    if args.action not in ("lock", "run") and args.amend is not None:
        raise MoestackError(f"--amend belongs to `prereg lock` and `run`, not `{args.action}`")
    if args.action not in ("keep", "restore", "audit") and args.kept:
        raise MoestackError(
            f"--kept belongs to `prereg keep`, `restore` and `audit`, not `{args.action}`"
        )
    power_opts = (args.pilot, args.half_width, args.confidence)
    if args.action != "power" and any(v is not None for v in power_opts):
        raise MoestackError(
            f"--pilot, --half-width and --confidence belong to `prereg power`, not `{args.action}`"
        )


def cmd_prereg(args: argparse.Namespace) -> None:
    from moestack import prereg

    _check_prereg_options(args)
    if args.action == "power":
        result = prereg.power(args.file, args.pilot, args.half_width, args.confidence)
        print(prereg.render_power(result))
    elif args.action == "lock":
        target = prereg.lock(
            args.file, force=args.force, amend=args.amend, out_dir=args.out or None, rules=True
        )
        print(f"{'amended' if args.amend is not None else 'locked'}: {target}")
    elif args.action == "run":
        out = args.out or None
        if args.jobs != 1:
            runs = prereg.run_jobs(args.file, out_dir=out, jobs=args.jobs,
                                   progress=not args.quiet, amend=args.amend)  # fmt: skip
        else:
            runs = prereg.run(args.file, out_dir=out, progress=not args.quiet, amend=args.amend)
        print(f"{len(runs)} runs in {runs[0].parent if runs else args.out}")
    elif args.action == "status":
        print(prereg.render_status(prereg.status(args.file, out_dir=args.out or None)))
    elif args.action == "evaluate":
        result = prereg.evaluate_finished(args.file, out_dir=args.out or None, jobs=args.jobs)
        print(prereg.render_evaluate(result))
    elif args.action in ("keep", "restore"):
        verb = prereg.keep if args.action == "keep" else prereg.restore
        kept = verb(args.file, out_dir=args.out or None, kept_dir=args.kept or None)
        print(prereg.render_kept(kept, args.action))
    elif args.action == "audit":
        if not args.out:
            raise MoestackError("prereg audit needs --out: an empty scratch folder for the runs")
        result = prereg.audit(args.file, args.out, args.kept or None, per_arm=args.recheck)
        print(prereg.render_audit(result, args.file))
    else:
        report = prereg.analyze(
            args.file, out_dir=args.out or None, report_dir=args.report or None,
            interim=args.interim, jobs=args.jobs, recheck=args.recheck,
        )  # fmt: skip
        print(Path(report).read_text())
        print(f"report: {report}")


PREREG_ACTIONS = (
    "lock",
    "run",
    "status",
    "evaluate",
    "keep",
    "restore",
    "audit",
    "analyze",
    "power",
)


def prereg_parser(verbs: Any) -> None:
    p = verbs.add_parser("prereg", help="lock, run and analyze a pre-registered study")
    p.add_argument(
        "action",
        choices=PREREG_ACTIONS,
        help="lock, run, status (runs done and left, no results), evaluate (the finished runs, "
        "ahead of the analysis; no results), keep (copy the finished, evaluated runs' records "
        "into the repository, to carry a study to another machine), restore (copy kept "
        "records back into the run folders), audit (train kept runs picked at random again in "
        "a scratch --out and compare their weights: two calls), analyze, or power (the seeds a "
        "pilot's spread needs)",
    )
    p.add_argument("file", help="a pre-registration YAML, e.g. experiments/prereg_cpu.yaml")
    p.add_argument("--out", default="", help="where the runs live (default: runs/prereg/<study>)")
    p.add_argument("--report", default="", help="analyze: report folder (default: <out>/report)")
    p.add_argument(
        "--kept",
        default="",
        help="keep, restore, audit: the folder of kept run records (default: docs/<study>/runs)",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="run: runner processes sharing the grid, one progress bar; evaluate, analyze: "
        "processes evaluating the runs (default: 1)",
    )
    p.add_argument("--quiet", action="store_true", help="run: no progress bar (default: off)")
    _prereg_lock_and_analysis_options(p)
    _prereg_power_options(p)
    p.set_defaults(func=cmd_prereg)


def _prereg_lock_and_analysis_options(p: argparse.ArgumentParser) -> None:
    """`prereg`'s options of analyze, audit and lock."""
    p.add_argument(
        "--interim",
        action="store_true",
        help="analyze: a study with unfinished runs, labelled as an interim look, not a "
        "verdict (default: refused)",
    )
    p.add_argument(
        "--recheck",
        type=int,
        default=1,
        metavar="N",
        help="analyze: evaluate again N runs per arm whose evaluation is cached, picked at "
        "random, and refuse a difference; 0: none; audit: kept runs per arm to train again "
        "(default: 1)",
    )
    p.add_argument(
        "--force", action="store_true", help="lock: re-lock before any run exists (default: off)"
    )
    p.add_argument(
        "--amend",
        metavar="REASON",
        default=None,
        help="lock: re-lock after runs exist; run: train although moestack's sources differ "
        "from the lock's; the reason is kept in the lock and the report (default: none)",
    )


def _prereg_power_options(p: argparse.ArgumentParser) -> None:
    """`prereg power`'s options."""
    p.add_argument(
        "--pilot",
        default=None,
        help="power: a pilot's results.json or study folder (default: the file's power.pilot)",
    )
    p.add_argument(
        "--half-width",
        type=float,
        default=None,
        help="power: target interval half-width, 0.005 = 0.5 pp of a relative change "
        "(default: the file's power.half_width, else 0.005)",
    )
    p.add_argument(
        "--confidence",
        type=float,
        default=None,
        help="power: two-sided confidence of that interval (default: the file's, else 0.95)",
    )
