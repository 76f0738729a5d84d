"""The lock file's history: an append-only chain of lock records, each naming the one before.

Format 2 (docs/prereg.md)::

    {"format": 2, <the newest record's fields>, "head": <its hash>,
     "chain": [{"seq": 0, "action": "lock", ..., "prev": null, "hash": "..."},
               {"seq": 1, "action": "amend", "reason": "...", ..., "prev": <hash 0>, ...}]}

Every record's ``hash`` is the sha256 of its own canonical JSON (``hash`` left out), and
``prev`` is the hash of the record before it, so changing any field of any record, dropping
or reordering records breaks the chain. The top-level fields repeat the newest record (for
people and older readers) and must equal it. A lock written before the chain (one JSON object,
``replaces`` naming the lock it replaced) is a *legacy* lock: read as a history of its own, and
kept verbatim as record 0 (``action: legacy``) when such a lock is re-locked.

This module is pure (dicts in, dicts out); ``locking`` reads and writes the files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moestack.errors import MoestackError
from moestack.prereg.hashing import digest

FORMAT = 2
ACTIONS = ("lock", "relock", "amend")  # first lock; --force before any run; --amend REASON
# The newest record's fields repeated at the top of the lock file.
MIRROR = (
    "file", "study", "sha256", "study_sha256", "git_commit", "git_dirty", "locked_at",
    "action", "reason", "replaces", "code_sha256",
)  # fmt: skip


def entry_hash(entry: dict[str, Any]) -> str:
    return digest({k: v for k, v in entry.items() if k != "hash"})


def append(chain: list[dict[str, Any]], record: dict[str, Any]) -> list[dict[str, Any]]:
    """``chain`` with ``record`` sealed onto its end (seq, prev, hash)."""
    entry = {**record, "seq": len(chain), "prev": chain[-1]["hash"] if chain else None}
    entry["hash"] = entry_hash(entry)
    return [*chain, entry]


def from_legacy(old: dict[str, Any]) -> list[dict[str, Any]]:
    """A chain holding a legacy lock verbatim as its first record."""
    return append([], {"action": "legacy", "legacy": old})


def document(chain: list[dict[str, Any]]) -> dict[str, Any]:
    """The lock file's content for ``chain``: the newest record mirrored at the top."""
    head = chain[-1]
    doc: dict[str, Any] = {"format": FORMAT}
    doc.update({key: head[key] for key in MIRROR if key in head})
    doc["head"] = head["hash"]
    doc["chain"] = chain
    return doc


def check_legacy(doc: Any, where: Path) -> dict[str, Any]:
    """A legacy lock record (one object with the study file's sha256), or an error."""
    if not isinstance(doc, dict) or not isinstance(doc.get("sha256"), str):
        raise MoestackError(f"{where} is not a valid lock file; restore it from git")
    return doc


def check_chain(doc: dict[str, Any], where: Path) -> list[dict[str, Any]]:
    """The verified chain of a format-2 lock document; one-line error naming ``where`` if not."""

    def broken(detail: str) -> MoestackError:
        return MoestackError(
            f"{where}: the lock's hash chain does not verify ({detail}): the lock was edited by "
            f"hand; restore it from git (git checkout -- {where}) and change a locked study only "
            "with `moestack prereg lock FILE --amend REASON`"
        )

    if doc.get("format") != FORMAT:
        raise MoestackError(
            f"{where}: lock format {doc.get('format')!r} is unknown (this moestack reads "
            f"format {FORMAT} and legacy locks); upgrade moestack or restore the lock from git"
        )
    chain = doc.get("chain")
    if not isinstance(chain, list) or not chain:
        raise broken("no records")
    prev = None
    for i, entry in enumerate(chain):
        if not isinstance(entry, dict):
            raise broken(f"record {i} is not an object")
        if entry.get("seq") != i or entry.get("prev") != prev:
            raise broken(f"record {i} does not follow record {i - 1}")
        if entry.get("hash") != entry_hash(entry):
            raise broken(f"record {i} does not match its hash")
        if entry.get("action") == "legacy":
            if i != 0 or not isinstance(entry.get("legacy"), dict):
                raise broken(f"record {i}: a legacy record can only be the first")
            check_legacy(entry["legacy"], where)
        elif entry.get("action") not in ACTIONS or not isinstance(entry.get("study_sha256"), str):
            raise broken(f"record {i} is not a lock record")
        prev = entry["hash"]
    head = chain[-1]
    if head.get("action") == "legacy":
        raise broken("the newest record is a legacy one")
    if doc.get("head") != prev:
        raise broken("'head' is not the newest record's hash")
    for key in MIRROR:
        if doc.get(key) != head.get(key):
            raise broken(f"'{key}' at the top differs from the newest record's")
    return chain


def _legacy_history(old: dict[str, Any]) -> list[dict[str, Any]]:
    """A legacy lock as history: the lock it replaced (known by hash only), then itself."""
    common = {"legacy": True, "reason": None, "configs": None, "hash": None}
    out = []
    if old.get("replaces"):
        sha = old["replaces"]
        out.append({**common, "action": "lock", "sha256": sha, "study_sha256": sha})
    out.append(
        {
            **common,
            "action": "relock" if out else "lock",
            "sha256": old["sha256"],
            "study_sha256": old["sha256"],  # a legacy lock hashes the study file only
            "replaces": old.get("replaces"),
            "locked_at": old.get("locked_at"),
            "git_commit": old.get("git_commit"),
        }
    )
    return out


def history(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Every lock of a lock document (format 2 or legacy), oldest first: see ``records``."""
    return records(doc["chain"]) if "format" in doc else _numbered(_legacy_history(doc))


def records(chain: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every lock of ``chain``, oldest first, as records with ``n`` (their place), ``action``,
    ``reason``, ``sha256``, ``study_sha256``, ``locked_at``, ``legacy`` (predates the chain)."""
    out = []
    for entry in chain:
        if entry["action"] == "legacy":
            out += _legacy_history(entry["legacy"])
        else:
            keep = {k: v for k, v in entry.items() if k not in ("seq", "prev")}
            out.append({**keep, "legacy": False})
    return _numbered(out)


def _numbered(out: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**record, "n": n} for n, record in enumerate(out)]


def accepted(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records whose runs the newest lock accepts, newest first: the newest record, and
    each earlier one as long as the record after it is an amendment (a re-lock with a reason
    on record). A plain re-lock (``--force``, allowed only before any run) ends the walk."""
    out = [records[-1]]
    while out[-1]["action"] == "amend" and out[-1]["n"] > 0:
        out.append(records[out[-1]["n"] - 1])
    return out
