"""Sealed JSON records in a run's folder: a digest of their own fields, written atomically.

A run's identity (``prereg_run.json``) and its cached evaluation (``prereg_eval.json``) each
carry the sha256 of their other fields (canonical JSON, ``hashing.digest``), as a
checkpoint's meta.json carries ``meta_sha256``: an edit that does not recompute it is
evident. It is no signature (anyone can recompute it), so what a seal cannot catch is left
to the checks that recompute from the checkpoint (``analysis.recheck``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from moestack.atomic import write_text
from moestack.prereg.hashing import digest


def _digest_of(record: dict[str, Any], field: str) -> str:
    """The digest of ``record`` without ``field``, over its JSON form (what is read back)."""
    fields = {k: v for k, v in record.items() if k != field}
    return digest(json.loads(json.dumps(fields)))


def seal(record: dict[str, Any], field: str) -> dict[str, Any]:
    """``record`` with ``field`` set to the digest of its other fields."""
    return {**record, field: _digest_of(record, field)}


def is_sealed(record: dict[str, Any], field: str) -> bool:
    """Whether ``record`` carries ``field`` and it matches the other fields."""
    return isinstance(record.get(field), str) and record[field] == _digest_of(record, field)


def write_json(path: Path, record: dict[str, Any]) -> Path:
    """Write ``record`` to ``path`` all or nothing (:func:`moestack.atomic.write_text`)."""
    path = Path(path)
    write_text(path, json.dumps(record, indent=2) + "\n")
    return path


def write_sealed(path: Path, record: dict[str, Any], field: str) -> dict[str, Any]:
    """Seal ``record`` (``field``) and write it atomically; returns the sealed record."""
    sealed = seal(record, field)
    write_json(path, sealed)
    return sealed
