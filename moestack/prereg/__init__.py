"""Pre-registered experiments: lock the hypotheses, run the grid, report pass/fail.

A pre-registration file (YAML, ``experiments/<study>.yaml``, format in docs/prereg.md)
names the study, the training settings shared by every run (model, data, budget), the arms
(one list of hydra overrides per router loss and weight), the seeds, the analysis (final
checkpoint, the evaluation batches, cache policies and capacities, how seeds combine) and the
hypotheses (metric, comparison against the baseline arm, threshold).

Three steps, each a function the ``moestack prereg`` verbs call:

- ``lock(path)`` writes ``<file>.lock.json`` before any run: the study hash (the file and the
  config files its runs load), git commit and UTC time, appended to the lock's hash chain. A
  re-lock needs ``force`` before any run exists and ``amend=REASON`` after (reported).
- ``run(path, out_dir)`` checks the lock, then trains every arm x seed with
  ``moestack.trainer.train``, each config composed by hydra from configs/ (``compose`` with the
  same overrides ``moestack-train`` takes, one run after another). A run whose directory
  holds ``summary.json`` is skipped; one with a checkpoint resumes from it. A runner claims
  each run before training it (``claim.json``), so several runners over the same folder (one
  per core or machine) share the grid. Each run records the study hash it was trained under,
  the code that trained it (code hash and git commit) and, when it finishes, its identity:
  arm, seed and the sha256 of its final checkpoint's weights (``prereg_run.json``, sealed).
  SIGTERM stops it (and its runners, ``run_jobs``) as Ctrl-C does (``signals``).
- ``analyze(path, out_dir)`` refuses a file whose hash differs from the lock, runs trained
  under a study hash the lock does not cover, and a run folder whose identity or final
  checkpoint is not the run's (``provenance.check_identity``), and a run whose record names
  other code than its lock (``sources.check_run_code``; a run trained before runs recorded
  their code is flagged in the report instead); evaluates each run's final
  checkpoint (perplexity over the pre-registered validation batches; the routing of the same
  batches, recorded with telemetry in eval mode, replayed through LRU and static-pin caches)
  and writes report.md, results.json and two PNGs. Each evaluation is cached in the run's
  folder, sealed with the run's identity and the weights it scored; a cache edited without
  its digest is refused, and a few cached runs per arm, picked at random, are evaluated
  again and must match (``recheck``). Every string the report quotes is escaped by one
  function, ``md``.

Seeds combine by pairing: arm and baseline with the same seed share the initialisation and
the data order, so each hypothesis's comparison is computed per seed and the seeds give its
mean and a two-sided t confidence interval.

Layout: ``spec`` (the file format: one dataclass per part of the file, each checking
itself), ``compose`` (hydra composition of a run's config), ``hashing`` (the study hash:
the file and its config files), ``chain`` (the lock history's hash chain), ``locking``
(lock and verify), ``provenance`` (the study hash each run was trained under, and its
identity), ``sources`` (which code trained and evaluated each run, against the lock's),
``signals`` (SIGTERM as Ctrl-C), ``records`` (sealed JSON records, written atomically), ``kept`` (finished runs' records
carried in the repository from one machine to the next), ``runner`` (the grid and
the resumable runner), ``stats`` (the statistics: Student's t, seed means and intervals,
the paired comparison, one-sided tests and bounds, Holm's correction; imports nothing of
the package), ``analysis`` (per-run evaluation and the paired-seed verdicts), ``decision``
(the decision rules: one-sided non-inferiority/superiority with Holm's correction,
verdicts), ``power`` (the seeds a pilot's spread needs), ``status`` (runs finished, running
and left, no results), ``evaluate`` (finished runs evaluated ahead of the analysis, no
results) and ``report`` (markdown, figures, ``analyze``).
Everything public is re-exported here.
"""

from __future__ import annotations

import logging

from moestack.prereg.analysis import EVAL_FILE, analysis_key, collect, evaluate_run
from moestack.prereg.compose import check_overrides, compose_config, config_choices
from moestack.prereg.decision import ONE_SIDED, check_rules
from moestack.prereg.evaluate import evaluate_finished
from moestack.prereg.evaluate import render as render_evaluate
from moestack.prereg.fields import (
    CACHE_STATS,
    COMPARISONS,
    CORRECTIONS,
    DECISIONS,
    OPS,
    REQUIRES,
    RESERVED_KEYS,
    SCALAR_METRICS,
)
from moestack.prereg.hashing import Fingerprint, config_files, fingerprint
from moestack.prereg.jobs import run_jobs
from moestack.prereg.kept import (
    KEPT_FILES,
    KeepResult,
    audit,
    default_kept_dir,
    keep,
    render_audit,
    restore,
)
from moestack.prereg.kept import render as render_kept
from moestack.prereg.locking import LOCK_SUFFIX, lock, lock_path, sha256_file, verify
from moestack.prereg.markdown import md
from moestack.prereg.parts import Analysis, Budget, Hypothesis, Power, Runs
from moestack.prereg.power import load_pilot, power, seeds_needed
from moestack.prereg.power import render as render_power
from moestack.prereg.provenance import (
    KEPT_META,
    RUN_FILE,
    check_identities,
    check_identity,
    check_run,
    is_kept,
    read_run_record,
    write_run_record,
)
from moestack.prereg.report import analyze, render_markdown
from moestack.prereg.report_plots import plot_capacity, plot_scatter
from moestack.prereg.runner import (
    CLAIM_FILE,
    SUMMARY_FILE,
    check_runs,
    claim,
    claimed,
    default_out_dir,
    is_finished,
    plan,
    release,
    run,
)
from moestack.prereg.signals import Terminated, sigterm_as_interrupt
from moestack.prereg.sources import check_run_code, check_study_code, code_at_commit, this_code
from moestack.prereg.spec import Prereg, RunSpec, load, parse
from moestack.prereg.stats import half_width, holm, mean_ci, t_quantile, t_sf
from moestack.prereg.status import render as render_status
from moestack.prereg.status import status
from moestack.prereg.verdicts import evaluate_hypotheses

log = logging.getLogger(__name__)

__all__ = [
    "CACHE_STATS",
    "CLAIM_FILE",
    "COMPARISONS",
    "CORRECTIONS",
    "DECISIONS",
    "EVAL_FILE",
    "KEPT_FILES",
    "KEPT_META",
    "LOCK_SUFFIX",
    "ONE_SIDED",
    "OPS",
    "REQUIRES",
    "RESERVED_KEYS",
    "RUN_FILE",
    "SCALAR_METRICS",
    "SUMMARY_FILE",
    "Terminated",
    "Analysis",
    "Budget",
    "Fingerprint",
    "Hypothesis",
    "KeepResult",
    "Power",
    "Prereg",
    "Runs",
    "RunSpec",
    "analysis_key",
    "analyze",
    "audit",
    "evaluate_finished",
    "check_identities",
    "check_identity",
    "check_overrides",
    "check_rules",
    "check_run",
    "check_run_code",
    "check_runs",
    "check_study_code",
    "claim",
    "claimed",
    "code_at_commit",
    "collect",
    "compose_config",
    "config_choices",
    "config_files",
    "default_kept_dir",
    "default_out_dir",
    "evaluate_hypotheses",
    "evaluate_run",
    "is_kept",
    "keep",
    "fingerprint",
    "half_width",
    "holm",
    "is_finished",
    "load",
    "load_pilot",
    "lock",
    "lock_path",
    "md",
    "mean_ci",
    "parse",
    "plan",
    "plot_capacity",
    "plot_scatter",
    "power",
    "read_run_record",
    "render_audit",
    "render_markdown",
    "render_evaluate",
    "render_kept",
    "render_power",
    "release",
    "restore",
    "render_status",
    "run",
    "run_jobs",
    "seeds_needed",
    "sha256_file",
    "sigterm_as_interrupt",
    "status",
    "t_quantile",
    "t_sf",
    "this_code",
    "verify",
    "write_run_record",
]
