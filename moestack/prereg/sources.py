"""Which code trained and evaluated each run of a study, against the code its lock names.

The **code hash** is the lock's (``hashing.code_files``): the sha256 of the canonical JSON
of {installed path: sha256} over every Python source file of the installed moestack package,
its kernels and telemetry folders included. A run trained by this moestack records it in its
sealed ``prereg_run.json`` (``trained_by``: the code hash, the git commit and whether the
tree had changes, for each code that started or finished it) and its evaluation in
``prereg_eval.json`` (``evaluated_by``). A run trained before runs recorded their code has
at most the trainer's ``provenance.json``, which names the commit of each start: the code
hash of a commit is computed from git's objects (:func:`code_at_commit`, the same files as
the checkout then held), so such a run is matched to its lock too, but only flagged, never
refused: nothing sealed says which code trained it.

``check_run_code`` refuses (one line naming the run, its code and the lock's) a run whose
record names code that no lock record covering the run names; every other mismatch or gap
is a flag in the report (``render_lines``) and in results.json (``code``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import moestack
from moestack import provenance as run_provenance
from moestack.errors import MoestackError
from moestack.prereg import hashing
from moestack.prereg.chain import accepted
from moestack.prereg.spec import RunSpec

TRAINED_BY = "trained_by"  # in a run's record: the code that started or finished it
EVALUATED_BY = "evaluated_by"  # in a cached evaluation: the code that computed it
RUNNING_CODE = "running_code"  # in the runner's lock record: this_code() at its start
_HEX = re.compile(r"[0-9a-f]{7,64}")  # a git object name
# The checkout's source folders and where they install (pyproject.toml's package-dir).
SOURCE_TREES = {
    "moestack": "moestack",
    "kernels": "moestack/kernels",
    "telemetry": "moestack/telemetry",
}


def this_code() -> dict[str, Any]:
    """The code this process runs: its code hash, and the git commit of the checkout
    moestack runs from with whether its tracked files had changes (None for both when it is
    installed from a wheel)."""
    state = run_provenance.git_state()
    return {
        "code_sha256": hashing.digest(hashing.code_files()),
        "git_commit": state["git_commit"],
        "git_dirty": state["git_dirty"],
    }


def trained_by(
    old: dict[str, Any] | None, now: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """A run record's ``trained_by`` with ``now`` added (the runner's code, checked against
    the lock at its start; default :func:`this_code`); ``old`` is the run's record when it
    continues under the same study hash, whose entries are kept."""
    entries = list((old or {}).get(TRAINED_BY) or [])
    now = now or this_code()
    return entries if now in entries else [*entries, now]


def _checkout() -> Path:
    return Path(moestack.__file__).resolve().parent.parent


@functools.lru_cache(maxsize=32)
def code_at_commit(commit: str, repo: str | None = None) -> str | None:
    """The code hash of ``commit``'s source files, from git's objects in ``repo`` (default
    the checkout moestack runs from); None when git or the commit is not there, or
    ``commit`` is no hex object name."""
    files = code_files_at_commit(commit, repo)
    return None if files is None else hashing.digest(files)


def code_files_at_commit(commit: str, repo: str | None = None) -> dict[str, str] | None:
    """``hashing.code_files`` as ``commit`` held them: {installed path: sha256}, from git's
    objects in the checkout holding ``repo`` (default the one moestack runs from); None when
    git or the commit is not there (or git answers what this cannot read), or ``commit`` is
    no hex object name."""
    if _HEX.fullmatch(commit) is None:  # no object name (never passed to git as an option)
        return None
    root = Path(repo) if repo else _checkout()
    try:
        listing = subprocess.run(
            ["git", "ls-tree", "--full-tree", "-r", "-z", commit, "--", *SOURCE_TREES],
            cwd=root, capture_output=True, check=True, timeout=60,
        ).stdout  # fmt: skip
        paths: dict[str, str] = {}
        for entry in filter(None, listing.split(b"\0")):
            meta, _, path = entry.decode().partition("\t")
            name = _installed(path)
            if meta.split()[1] == "blob" and name is not None:
                paths[name] = meta.split()[2]
        blobs = subprocess.run(
            ["git", "cat-file", "--batch"], cwd=root, capture_output=True, check=True,
            input="".join(f"{oid}\n" for oid in paths.values()).encode(), timeout=60,
        ).stdout  # fmt: skip
        hashes = _blob_hashes(blobs, len(paths))
    # ValueError: also a path that is not UTF-8, an answer cut short
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
    if not paths or hashes is None:
        return None
    return dict(sorted(zip(paths, hashes, strict=True)))


def _blob_hashes(batch: bytes, count: int) -> list[str] | None:
    """The sha256 of each of the ``count`` objects in ``git cat-file --batch``'s answer
    ("<oid> blob <size>\\n<bytes>\\n" each, in the order asked); None where one is not a blob
    (an object the checkout lacks answers "<oid> missing")."""
    hashes, at = [], 0
    for _ in range(count):
        head_end = batch.index(b"\n", at)
        header = batch[at:head_end].split()
        if len(header) != 3 or header[1] != b"blob":
            return None
        size = int(header[2])
        if head_end + 1 + size > len(batch):
            return None
        hashes.append(hashlib.sha256(batch[head_end + 1 : head_end + 1 + size]).hexdigest())
        at = head_end + 1 + size + 1
    return hashes


def _installed(path: str) -> str | None:
    """Where a checkout's file installs (as ``code_files`` names it); None: not source."""
    top, _, rel = path.partition("/")
    if (
        not path.endswith((".py", ".cpp"))
        or top not in SOURCE_TREES
        or "__pycache__" in rel.split("/")
    ):
        return None
    if top == "moestack" and rel.split("/")[0] in SOURCE_TREES:
        return None  # code_files takes these from the kernels and telemetry packages
    return f"{SOURCE_TREES[top]}/{rel}"


def locked_code(lock_info: dict[str, Any]) -> list[str]:
    """The code hashes of the lock records whose runs the lock accepts (``chain.accepted``:
    the newest, and those before each amendment, a code change put on record included)."""
    found = {r.get("code_sha256") for r in accepted(lock_info["history"])}
    return sorted(c for c in found if isinstance(c, str))


def _from_provenance(run_dir: Path) -> list[dict[str, Any]] | None:
    """The code of each start in the run's provenance.json, its code hash computed from
    the commit's files (None for a start whose tree had changes, or an unknown commit)."""
    try:
        starts = json.loads((run_dir / run_provenance.PROVENANCE_FILE).read_text())["starts"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    entries: list[dict[str, Any]] = []
    for start in starts if isinstance(starts, list) else []:
        commit, dirty = start.get("git_commit"), start.get("git_dirty")
        code = code_at_commit(commit) if isinstance(commit, str) and dirty is False else None
        entry = {"code_sha256": code, "git_commit": commit, "git_dirty": dirty}
        if entry not in entries:
            entries.append(entry)
    return entries or None


def check_run_code(
    item: RunSpec, record: dict[str, Any], lock_info: dict[str, Any]
) -> dict[str, Any]:
    """The code that trained the finished run ``item`` (``record``: its checked identity)
    against the lock's (``lock_info``: ``locking.verify``'s): ``source`` ("record",
    "provenance.json" or None), ``trained_by``, ``as_locked`` (None: cannot tell) and
    ``flag`` (why the report flags it; None: recorded and the lock's). Raises, in one line,
    when its sealed record names code no accepted lock record names."""
    lock = locked_code(lock_info)
    row: dict[str, Any] = {"run": item.name, "source": None, "trained_by": [], "as_locked": None}
    entries = record.get(TRAINED_BY)
    if isinstance(entries, list) and entries:
        row.update(source="record", trained_by=entries)
        other = [e.get("code_sha256") for e in entries if e.get("code_sha256") not in lock]
        if lock and other:
            raise _other_code(item, other[0], entries, lock)
        row["as_locked"] = bool(lock) or None
        row["flag"] = None if lock else "the lock names no code hash (it predates them)"
        return row
    found = _from_provenance(item.run_dir)
    if found is None:
        row["flag"] = "trained before runs recorded their code; no provenance.json names it"
        return row
    codes = [e["code_sha256"] for e in found]
    row.update(source="provenance.json", trained_by=found)
    if lock and None not in codes:
        row["as_locked"] = all(c in lock for c in codes)
    said = {True: "is the lock's", False: "is NOT the lock's", None: "cannot be compared"}
    row["flag"] = (
        "trained before runs recorded their code; the code of the commit its provenance.json "
        f"names {said[row['as_locked']]}"
    )
    return row


def _other_code(
    item: RunSpec, code: Any, entries: list[dict[str, Any]], lock: list[str]
) -> MoestackError:
    commit = next((e.get("git_commit") for e in entries if e.get("code_sha256") == code), None)
    return MoestackError(
        f"{item.run_dir / 'prereg_run.json'}: run {item.name} was trained by code sha256 "
        f"{str(code)[:12]} (commit {str(commit)[:12]}), not the {', '.join(c[:12] for c in lock)} "
        "its lock names: other code than the study registered trained it; retrain it with the "
        f"lock's code: delete {item.run_dir} and run `moestack prereg run` on the study again"
    )


def check_study_code(
    grid: Sequence[RunSpec], identities: dict[str, dict[str, Any]], lock_info: dict[str, Any]
) -> dict[str, Any]:
    """:func:`check_run_code` of every finished run: ``lock`` (the accepted code hashes)
    and ``runs`` (one row per finished run); raises at the first run of other code."""
    rows = [check_run_code(r, identities[r.name], lock_info) for r in grid if r.name in identities]
    return {"lock": locked_code(lock_info), "runs": rows}


def _short(value: Any) -> str:
    """A hash or commit, its first 12 hex digits as a code span (anything else dropped: a
    provenance.json is not sealed, and nothing it holds may make Markdown)."""
    digits = re.sub("[^0-9a-f]", "", str(value or "").lower())[:12]
    return f"`{digits}`" if digits else "unknown"


def describe(entries: Sequence[dict[str, Any]] | dict[str, Any] | None) -> str:
    """Code entries (``trained_by``'s, or one ``evaluated_by``) as text: code hash and
    commit, a tree with changes marked."""
    if not entries:
        return "not recorded"
    entries = [entries] if isinstance(entries, dict) else entries
    return "; ".join(
        f"code {_short(e.get('code_sha256'))} at commit {_short(e.get('git_commit'))}"
        + (" (with changes)" if e.get("git_dirty") else "")
        for e in entries
    )


ANSWER = {True: "yes", False: "**no**", None: "cannot tell"}  # trained by the lock's code?


def trained_text(row: dict[str, Any]) -> str:
    """A :func:`check_run_code` row's training code as text, with where it is recorded."""
    where = {"record": "prereg_run.json", "provenance.json": "provenance.json's commit"}
    return describe(row["trained_by"]) + (f" ({where[row['source']]})" if row["source"] else "")


def summary(code: dict[str, Any]) -> str:
    """One line: how many finished runs record their code and how many are flagged."""
    rows = code["runs"]
    recorded = [r for r in rows if r["source"] == "record"]
    named = [r for r in rows if r["source"] == "provenance.json"]
    none = [r for r in rows if r["source"] is None]
    parts = []
    if recorded:
        whose = "the lock's" if code["lock"] else "the lock names no code hash"
        n = f"all {len(rows)}" if len(recorded) == len(rows) else str(len(recorded))
        parts.append(f"{n} finished runs record the code that trained them ({whose})")
    if named:
        counts = [(sum(r["as_locked"] is v for r in named), said) for v, said in (
            (True, "by the lock's code"), (False, "by other code than the lock names"),
            (None, "cannot be compared"))]  # fmt: skip
        parts.append(
            f"{len(named)} finished runs trained before runs recorded their code are named by "
            f"the commit in their provenance.json ("
            + ", ".join(f"{k} of them {said}" for k, said in counts if k)
            + ")"
        )
    if none:
        parts.append(f"{len(none)} finished runs record no code (trained before runs recorded it)")
    flagged = "; flagged, not refused: no sealed record names their code" if named or none else ""
    return "- Training code: " + "; ".join(parts or ["no finished run"]) + flagged + "."


def with_evaluations(code: dict[str, Any], records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``code`` (:func:`check_study_code`'s) with each run's ``evaluated_by`` from its
    evaluation (``records``: ``analysis.collect``'s; None: evaluated before it was recorded)."""
    evaluated = {r["run"]: r.get(EVALUATED_BY) for r in records}
    rows = [{**row, EVALUATED_BY: evaluated.get(row["run"])} for row in code["runs"]]
    return {**code, "runs": rows}


def render_lines(code: dict[str, Any] | None, quote: Callable[[str], str] = str) -> list[str]:
    """The report's section: which code trained and evaluated the finished runs
    (:func:`with_evaluations`), grouped by the same code, against the code hash the lock
    names; run names go through ``quote`` (the report's ``md``)."""
    if code is None:
        return []
    lock = ", ".join(_short(c) for c in code["lock"]) or "none (a lock older than the code hash)"
    lines = ["## Code of the runs", "", summary(code), f"- The lock names code sha256 {lock}.", ""]
    groups: dict[tuple[str, str, str], list[str]] = {}
    for row in code["runs"]:
        key = (trained_text(row), ANSWER[row["as_locked"]], describe(row.get(EVALUATED_BY)))
        groups.setdefault(key, []).append(row["run"])
    lines += ["| runs | trained by | the lock's | evaluated by |", "|---|---|---|---|"]
    for (trained, ok, by), runs in groups.items():
        shown = ", ".join(quote(run) for run in runs[:6]) + (
            f" and {len(runs) - 6} more" if len(runs) > 6 else ""
        )
        lines.append(f"| {len(runs)}: {shown} | {trained} | {ok} | {by} |")
    return [*lines, ""]
