"""Kept runs: a study's finished runs carried from one machine to the next as their records.

A study of many CPU hours is trained in pieces, on machines that keep nothing but the
repository. A run's checkpoint (tens of MB) does not belong in git; its records (a few KB)
do: what it was trained under and its identity (``prereg_run.json``), its evaluation
(``prereg_eval.json``), its summary, config and overrides, and its final
checkpoint's ``meta.json`` (which names the weights' sha256, sealed by its own digest).

- ``keep`` copies them from the finished, evaluated run folders into the study's folder of
  kept runs (default ``docs/<study>/runs/<run>/``), to be committed as runs finish;
- ``restore`` copies them back into the run folders of the next machine, where the runner
  skips the run (it has ``summary.json``) and ``provenance.check_identity`` accepts it
  without a checkpoint: the record's weights sha256 must be the one the kept ``meta.json``
  names, and the evaluation must be the kept one (a kept run cannot be evaluated again).

What a kept run cannot show is its weights, so the audit that re-evaluates a run from its
checkpoint (``analysis.recheck``) cannot reach it; training is bitwise repeatable on one
machine kind (CPU, torch, threads; ``KEPT_MACHINE`` records it), so the audit of a kept run
is to train it again and compare the final weights' sha256 with its record: ``audit_prepare`` lays out a scratch study folder in
which only runs picked at random are left to train (by the lock's runner), and
``audit_compare`` compares what they end with.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any, NamedTuple

from moestack.atomic import install_dir, recover_dir, temp_dir
from moestack.errors import MoestackError
from moestack.prereg.analysis import EVAL_FILE, analysis_key, cached_evaluation, metric_names
from moestack.prereg.locking import verify
from moestack.prereg.provenance import (
    KEPT_META,
    RUN_FILE,
    SUMMARY_FILE,
    check_identity,
    check_run,
    final_checkpoint,
    is_kept,
)
from moestack.prereg.records import write_json
from moestack.prereg.runner import claimed, is_finished, plan
from moestack.prereg.sources import ANSWER, EVALUATED_BY, check_run_code, describe, trained_text
from moestack.prereg.spec import Prereg, RunSpec, load
from moestack.provenance import PROVENANCE_FILE

log = logging.getLogger(__name__)

__all__ = [
    "AUDIT_FILE", "KEPT_FILES", "KeepResult", "audit", "audit_compare", "audit_prepare", "default_kept_dir", "keep",
    "render", "render_audit", "restore",
]  # fmt: skip

# A run's records that are kept, besides its final checkpoint's meta.json (KEPT_META); the
# first three must exist, the rest are kept when the run has them (provenance.json: each
# start's commit, which names the code of a run trained before run records named it). Not
# its training curve (metrics.jsonl, about 100 KB a run): the analysis does not read it.
KEPT_FILES = (RUN_FILE, EVAL_FILE, SUMMARY_FILE, "prereg_overrides.json", "config.yaml",
              PROVENANCE_FILE)  # fmt: skip
# The machine a kept run was trained on (where ``keep`` found its checkpoint): training is
# bitwise repeatable only on the same CPU kind and torch (docs/prereg.md).
KEPT_MACHINE = "kept_machine.json"
_REQUIRED = KEPT_FILES[:3]


class KeepResult(NamedTuple):
    """What ``keep`` or ``restore`` did, run names only (no metric)."""

    done: list[str]  # kept (or restored) now
    already: list[str]  # kept (or restored) before, unchanged
    waiting: list[str]  # finished but not evaluated yet (keep), or not kept (restore)
    where: Path  # the folder of kept runs


def default_kept_dir(spec: Prereg) -> Path:
    return Path("docs") / spec.study / "runs"


def keep(
    path: Path | str, out_dir: Path | str | None = None, kept_dir: Path | str | None = None
) -> KeepResult:
    """Copy the records of every finished and evaluated run of the study into ``kept_dir``
    (default docs/<study>/runs), each run checked first as ``analyze`` checks it (the lock
    covers it, its identity is its own checkpoint's, the code its record names is the
    lock's, its evaluation is sealed, of those weights and under the study's analysis
    settings). A run kept before is replaced only by
    the records of the same weights (a newer evaluation); records of other weights are
    refused. Each run's folder is written whole or not at all."""
    spec, lock_info = load(path), verify(path)
    where = Path(kept_dir) if kept_dir else default_kept_dir(spec)
    key, names = analysis_key(spec), metric_names(spec.analysis)
    done: list[str] = []
    already: list[str] = []
    waiting: list[str] = []
    for item in plan(spec, out_dir):
        if not is_finished(item.run_dir) or claimed(item.run_dir):
            continue
        check_run(item.run_dir, lock_info)
        identity = check_identity(item, spec.study)
        check_run_code(item, identity, lock_info)
        if cached_evaluation(item.run_dir, key, identity, names) is None:
            waiting.append(item.name)
            continue
        files = _records_of(item)
        target = where / item.name
        recover_dir(target)  # a killed keep's leftovers, never to be committed beside it
        if _same_files(target, files):
            already.append(item.name)
            continue
        _refuse_other_weights(target, identity, item)
        _install(target, files)
        done.append(item.name)
    return KeepResult(done, already, waiting, where)


def restore(
    path: Path | str, out_dir: Path | str | None = None, kept_dir: Path | str | None = None
) -> KeepResult:
    """Copy the kept records of every run the study registers back into its run folder
    (``out_dir``, default runs/prereg/<study>), so that the runner skips it and the analysis
    takes its kept evaluation. A run folder that holds the same run finished is left alone; a
    folder holding an unfinished run (or another run's records) is refused, naming it. Each
    restored run is checked as ``analyze`` checks a finished one (lock, identity, its sealed
    evaluation under the study's analysis settings); a kept run that fails is removed again
    and refused, naming its kept files. Only the kept files (``KEPT_FILES``, ``KEPT_META``)
    are copied."""
    spec, lock_info = load(path), verify(path)
    where = Path(kept_dir) if kept_dir else default_kept_dir(spec)
    if not where.is_dir():
        raise MoestackError(f"{where} does not exist: no kept runs of {spec.study} to restore")
    key, names = analysis_key(spec), metric_names(spec.analysis)
    done: list[str] = []
    already: list[str] = []
    waiting: list[str] = []
    for item in plan(spec, out_dir):
        source = where / item.name
        if not source.is_dir():
            waiting.append(item.name)
            continue
        if is_finished(item.run_dir):
            _check_same_run(item, source, spec.study)
            already.append(item.name)
            continue
        if item.run_dir.exists() and any(item.run_dir.iterdir()):
            raise MoestackError(
                f"{item.run_dir} holds an unfinished run, and {source} keeps it finished "
                f"elsewhere: delete {item.run_dir} to restore the kept run, or delete "
                f"{source} to train it here"
            )
        recover_dir(item.run_dir)
        _install(item.run_dir, _kept_files(source))
        try:
            check_run(item.run_dir, lock_info)
            identity = check_identity(item, spec.study)
            check_run_code(item, identity, lock_info)
            if cached_evaluation(item.run_dir, key, identity, names) is None:
                raise MoestackError(
                    f"{source / EVAL_FILE} is no sealed evaluation under the study's analysis "
                    f"settings (key {key}): a kept run cannot be evaluated again; train it "
                    f"here (delete {source})"
                )
        except MoestackError as err:  # named where the records are kept: fixed there
            shutil.rmtree(item.run_dir, ignore_errors=True)
            raise MoestackError(str(err).replace(str(item.run_dir), str(source))) from None
        done.append(item.name)
    unknown = sorted({p.name for p in where.iterdir()} - {r.name for r in plan(spec, out_dir)})
    if unknown:
        log.warning("%s: %s are not runs of %s; left alone", where, unknown, spec.study)
    return KeepResult(done, already, waiting, where)


def render(result: KeepResult, verb: str) -> str:
    """One line per outcome, run names only."""
    done = "kept" if verb == "keep" else "restored"
    lines = [f"{len(result.done)} runs {done} now ({result.where})"]
    if result.already:
        lines.append(f"{len(result.already)} {done} before, unchanged")
    if result.waiting:
        why = "finished, not evaluated yet (run `moestack prereg evaluate` first)"
        if verb != "keep":
            why = "not kept (to train here)"
        lines.append(f"{len(result.waiting)} {why}: {', '.join(result.waiting)}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- the steps
def _records_of(item: RunSpec) -> dict[str, bytes]:
    """The run's kept files by name: KEPT_FILES it has, and its final checkpoint's
    meta.json with the checkpoint's name (KEPT_META)."""
    files = {name: (item.run_dir / name).read_bytes() for name in KEPT_FILES
             if (item.run_dir / name).is_file()}  # fmt: skip
    missing = [name for name in _REQUIRED if name not in files]
    if missing:
        raise MoestackError(f"{item.run_dir} has no {', '.join(missing)}: nothing to keep")
    if is_kept(item.run_dir):  # restored here from kept records: keep them as they are
        for name in (KEPT_META, KEPT_MACHINE):
            if (item.run_dir / name).is_file():
                files[name] = (item.run_dir / name).read_bytes()
        return files
    ckpt, _, _ = final_checkpoint(item.run_dir)
    from moestack.checkpoint import META_FILE

    meta = json.loads((ckpt / META_FILE).read_text())
    kept = {"checkpoint": ckpt.name, "meta": meta}
    files[KEPT_META] = (json.dumps(kept, indent=2) + "\n").encode()
    files[KEPT_MACHINE] = (json.dumps(machine(), indent=2) + "\n").encode()
    return files


def machine() -> dict[str, str]:
    """This machine's kind as far as float results go: the CPU (vendor, family, model), the
    vector instructions torch dispatches to, and the torch version."""
    import platform

    import torch

    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("vendor_id", "cpu family", "model", "model name") and key not in fields:
                fields[key] = value.strip()
    except OSError:
        pass
    cpu = " / ".join(fields.get(k, "?") for k in ("model name", "cpu family", "model"))
    return {
        "cpu": cpu if fields else platform.processor() or platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
    }


def _kept_files(source: Path) -> dict[str, bytes]:
    """The kept files of a run's kept folder by name; refused, naming the folder, without
    the records a finished run needs."""
    names = (*KEPT_FILES, KEPT_META, KEPT_MACHINE)
    files = {name: (source / name).read_bytes() for name in names if (source / name).is_file()}
    missing = [name for name in (*_REQUIRED, KEPT_META) if name not in files]
    if missing:
        raise MoestackError(f"{source} has no {', '.join(missing)}: not a kept run's records")
    return files


def _same_files(target: Path, files: dict[str, bytes]) -> bool:
    if not target.is_dir():
        return False
    present = {p.name for p in target.iterdir() if p.is_file()}
    return present == set(files) and all((target / n).read_bytes() == b for n, b in files.items())


def _refuse_other_weights(target: Path, identity: dict[str, Any], item: RunSpec) -> None:
    """Refuse to replace kept records of other weights than the run's (a retrained run,
    or another run's folder)."""
    path = target / RUN_FILE
    if not path.is_file():
        return
    old = _kept_weights(target)
    if old != identity["model_sha256"]:
        raise MoestackError(
            f"{path} keeps run {item.name} with weights sha256 {str(old)[:12]}"
            f", {item.run_dir} holds {identity['model_sha256'][:12]}: the run was trained "
            f"again; delete {target} to keep the new one"
        )


def _check_same_run(item: RunSpec, source: Path, study: str) -> None:
    """A finished run folder and its kept records must name the same weights."""
    here = check_identity(item, study)["model_sha256"]
    kept = _kept_weights(source)
    if kept != here:
        raise MoestackError(
            f"{item.run_dir} holds run {item.name} with weights sha256 {here[:12]}, "
            f"{source} keeps {str(kept)[:12]}: two trainings of one run; delete one of them"
        )


def _install(target: Path, files: dict[str, bytes]) -> None:
    """Write ``files`` into a fresh folder beside ``target`` and move it into place
    (``atomic.install_dir``, from ``atomic.temp_dir``): a kill leaves the old folder or the
    new one, never half, and what it left beside them ``atomic.recover_dir`` cleans up."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir(target)
    try:
        for name, data in files.items():
            with open(tmp / name, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        install_dir(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# --------------------------------------------------------------------------- the audit
def audit_prepare(
    path: Path | str,
    scratch: Path | str,
    kept_dir: Path | str | None = None,
    per_arm: int = 1,
    *,
    rng: random.Random | None = None,
) -> list[str]:
    """Pick ``per_arm`` kept runs of each arm at random (``rng``, default seeded from
    os.urandom) and lay out ``scratch`` as a study folder in which only they are left to
    train: every other kept run restored. The lock's runner (``prereg run FILE --out
    SCRATCH``) then trains exactly the picks from scratch, and ``audit_compare`` compares
    their weights with their kept records. Returns the picked run names."""
    spec = load(path)
    where = Path(kept_dir) if kept_dir else default_kept_dir(spec)
    scratch = Path(scratch)
    if scratch.exists() and any(scratch.iterdir()):
        raise MoestackError(f"{scratch} is not empty: give an empty folder for the audit")
    rng = rng or random.Random(os.urandom(32))
    grid = plan(spec, scratch)
    kept = [item for item in grid if (where / item.name).is_dir()]
    if len(kept) < len(grid):
        missing = [item.name for item in grid if item not in kept]
        raise MoestackError(
            f"{where} keeps {len(kept)} of the {len(grid)} runs of {spec.study} (not "
            f"{', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): audit once every "
            "run is kept, or the runner would train the missing ones too in the scratch folder"
        )
    picks = []
    for arm in spec.arms:
        mine = [item.name for item in kept if item.arm == arm]
        picks += rng.sample(mine, min(per_arm, len(mine)))
    restore(path, scratch, where)
    for name in picks:
        shutil.rmtree(scratch / "runs" / name)
    return picks


def audit_compare(
    path: Path | str, scratch: Path | str, picks: list[str], kept_dir: Path | str | None = None
) -> list[dict[str, Any]]:
    """Each picked run trained again in ``scratch`` against its kept record: ``run``,
    ``kept`` and ``retrained`` weights sha256, ``outcome`` and, where the run trained again
    is evaluated (``prereg evaluate FILE --out SCRATCH``), the relative ``differences`` of
    its metrics from the kept evaluation, and ``code`` (``sources.check_run_code``: the code
    that trained it again against the lock's) and ``evaluated_by`` (the code that evaluated
    it again; None: not evaluated, or by a moestack older than the record). On the machine
    kind the run was kept from
    (``kept_machine.json``: CPU, the instructions torch uses, torch) the weights must be the
    same bits ("matched"); otherwise training is not bitwise repeatable and the row says so
    ("other machine") with the metric differences to read. Raises, naming the kept record,
    when a run was not trained, or ends with other weights on the same machine kind: its
    kept records are not what this training gives."""
    spec, lock_info = load(path), verify(path)
    where = Path(kept_dir) if kept_dir else default_kept_dir(spec)
    items = {item.name: item for item in plan(spec, scratch)}
    here = machine()
    rows = []
    for name in picks:
        item = items[name]
        if not is_finished(item.run_dir):
            raise MoestackError(f"{item.run_dir}: the audit's run {name} was not trained")
        identity = check_identity(item, spec.study)
        again = identity["model_sha256"]
        record = where / name / RUN_FILE
        kept = _kept_weights(where / name)
        then = _read_json(where / name / KEPT_MACHINE)
        same_kind = then == here
        if again != kept and same_kind:
            raise MoestackError(
                f"{record}: run {name} trained again ends with weights sha256 {again[:12]}, its "
                f"kept record names {str(kept)[:12]}, on the machine kind it was kept from: "
                "the kept records are not this training's (edited, or trained under other code "
                "or settings); retrain the run"
            )
        outcome = "matched" if again == kept else "other machine"
        row = {"run": name, "kept": kept, "retrained": again, "outcome": outcome}
        row["differences"] = _differences(where / name / EVAL_FILE, item.run_dir / EVAL_FILE)
        row["kept_machine"], row["machine"] = then, here
        row["code"] = check_run_code(item, identity, lock_info)  # which code trained it again
        row["evaluated_by"] = (_read_json(item.run_dir / EVAL_FILE) or {}).get(EVALUATED_BY)
        rows.append(row)
    return rows


def _kept_weights(folder: Path) -> str | None:
    """The weights sha256 a kept run's record names (None: no readable record)."""
    record = _read_json(folder / RUN_FILE)
    return record.get("model_sha256") if isinstance(record, dict) else None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _differences(kept: Path, again: Path) -> dict[str, float] | None:
    """Relative differences of the retrained run's metrics from the kept ones, for the
    metrics both evaluations hold (None: the retrained run is not evaluated)."""
    old, new = _read_json(kept), _read_json(again)
    if not isinstance(old, dict) or not isinstance(new, dict):
        return None
    a, b = old.get("metrics", {}), new.get("metrics", {})
    return {k: b[k] / a[k] - 1.0 for k in sorted(set(a) & set(b)) if a[k]}


AUDIT_FILE = "audit_picks.json"  # in the scratch folder: the runs audit_prepare picked


def audit(
    path: Path | str,
    scratch: Path | str,
    kept_dir: Path | str | None = None,
    per_arm: int = 1,
) -> dict[str, Any]:
    """The audit of kept runs in two calls over one scratch folder: the first picks the runs
    (``audit_prepare``, the picks recorded in ``scratch/audit_picks.json``) and returns
    ``rows`` None: train them with the lock's code (``prereg run FILE --out SCRATCH``); the
    second compares what they ended with (``audit_compare``) and returns its rows."""
    scratch = Path(scratch)
    picks_file = scratch / AUDIT_FILE
    if not picks_file.is_file():
        picks = audit_prepare(path, scratch, kept_dir, per_arm)
        write_json(picks_file, {"picks": picks})
        return {"picks": picks, "rows": None, "scratch": str(scratch)}
    picks = json.loads(picks_file.read_text())["picks"]
    rows = audit_compare(path, scratch, picks, kept_dir)
    return {"picks": picks, "rows": rows, "scratch": str(scratch)}


def render_audit(result: dict[str, Any], path: Path | str) -> str:
    if result["rows"] is None:
        return (
            f"picked {len(result['picks'])} kept runs to train again: {', '.join(result['picks'])}"
            f"\ntrain them with the lock's code: moestack prereg run {path} --out "
            f"{result['scratch']}; then run this again to compare their weights"
        )
    lines = []
    for r in result["rows"]:
        if r["outcome"] == "matched":
            lines.append(f"{r['run']}: weights sha256 {r['retrained'][:12]}, the kept ones")
            continue
        diff = r["differences"] or {}
        said = (
            f"perplexity differs by {diff['perplexity']:+.2%}"
            if "perplexity" in diff
            else "evaluate the scratch folder to compare its metrics"
        )
        lines.append(
            f"{r['run']}: trained on another machine kind (kept: {r['kept_machine']}; here: "
            f"{r['machine']}), where training is not bitwise repeatable; {said}"
        )
    for r in result["rows"]:
        code = r.get("code") or {"trained_by": [], "source": None, "as_locked": None}
        lines.append(
            f"{r['run']}: trained again by {trained_text(code)}, the lock's code: "
            f"{ANSWER[code['as_locked']].strip('*')}; evaluated by {describe(r.get('evaluated_by'))}"
        )
    same = sum(r["outcome"] == "matched" for r in result["rows"])
    lines.append(f"{len(result['rows'])} kept runs trained again, {same} to the kept bits")
    return "\n".join(lines)
