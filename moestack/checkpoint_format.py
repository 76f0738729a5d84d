"""The checkpoint format: its files (``model.safetensors``, ``train_state.pt``, ``meta.json``,
the rank files of :mod:`moestack.checkpoint_parts`), the structure of meta.json and its own
digest (``read_meta``, ``check_meta``), and the check of each file against the size and
sha256 meta.json recorded (``verify_file``, ``verify_checkpoint``): what the writer
(:mod:`moestack.checkpoint`) promises and every reader (:mod:`moestack.checkpoint_load`)
checks. The layout and its guarantees are described in :mod:`moestack.checkpoint`."""

from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path
from typing import Any

from moestack import checkpoint_parts
from moestack.atomic import sha256_file
from moestack.errors import MoestackError

log = logging.getLogger(__name__)

MODEL_FILE = "model.safetensors"
STATE_FILE = "train_state.pt"
META_FILE = "meta.json"
PREFIX = "step_"
TRASH_PREFIX = ".trash-"
SELF_DIGEST = "meta_sha256"  # meta.json's digest of its own other fields
FORMAT = "moestack-checkpoint"
# meta.json versions: 1 (no format/version keys, no digests), 2 (file and self digests),
# 3 (rank files under "parts").
VERSION = 3
_META_KEYS = ("format", "version", "step", "model", "sizes", "sha256", "parts", SELF_DIGEST)
FILES = (MODEL_FILE, STATE_FILE)
# A routed expert tensor of a moestack MoE layer: ``layers.<i>.moe.w1`` in moestack's model,
# ``hf.model.layers.<i>.mlp.moe.w1`` in a transformers model's run (model=hf).
EXPERT_KEY = re.compile(r"(?:.*\.)?layers\.(?P<layer>\d+)\.(?:[A-Za-z_]+\.)?moe\.(?P<w>w[12])")


def read_meta(path: Path | str) -> dict[str, Any]:
    """The checkpoint's meta.json, its structure checked and the sizes of the files it
    lists compared with the files on disk."""
    path = Path(path)
    if not path.is_dir():
        raise MoestackError(f"checkpoint {path} does not exist")
    meta_path = path / META_FILE
    try:
        meta = json.loads(meta_path.read_text())
    except FileNotFoundError:
        raise MoestackError(f"checkpoint {path} has no {META_FILE}: it is incomplete") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise MoestackError(f"{meta_path} is not valid JSON: the checkpoint is corrupt") from None
    _check_meta(meta, meta_path)
    for name, size in meta["sizes"].items():
        file = path / name
        actual = file.stat().st_size if file.exists() else None
        if actual != size:
            raise MoestackError(
                f"{file} is {'missing' if actual is None else f'{actual} bytes'}, expected {size} "
                "bytes: the checkpoint is truncated; use an older one"
            )
    return meta


def check_meta(meta: Any, where: Path | str) -> dict[str, Any]:
    """A meta.json read apart from its checkpoint (a kept run's, moestack.prereg.kept): its
    structure and its own digest checked, not the files it lists; ``where`` names it in
    errors. Returns it."""
    _check_meta(meta, Path(where))
    return meta


def meta_digest(meta: dict[str, Any]) -> str:
    fields = {k: v for k, v in meta.items() if k != SELF_DIGEST}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def _check_meta(meta: Any, meta_path: Path) -> None:
    """Refuse a meta.json that parses but does not have the structure save_checkpoint writes."""

    def bad(field: str, why: str) -> MoestackError:
        return MoestackError(f"{meta_path}: {field} {why}; the checkpoint is corrupt")

    if not isinstance(meta, dict):
        raise bad("the file", f"holds a {type(meta).__name__}, not an object")
    unknown = sorted(set(meta) - set(_META_KEYS))
    if unknown:
        raise bad(f"key {unknown[0]!r}", f"is not one of {_META_KEYS}")
    if meta.get("format", FORMAT) != FORMAT or meta.get("version", 1) not in range(1, VERSION + 1):
        raise bad("format/version", f"is {meta.get('format')!r}/{meta.get('version')!r}, not "
                  f"{FORMAT!r} 1..{VERSION} (a newer moestack wrote it, or another tool)")  # fmt: skip
    if SELF_DIGEST in meta and meta[SELF_DIGEST] != meta_digest(meta):
        raise bad(SELF_DIGEST, "does not match the other fields (changed after writing)")
    step = meta.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise bad("step", f"is {step!r}, not an integer >= 0")
    if not isinstance(meta.get("model"), dict) or not isinstance(meta["model"].get("moe"), dict):
        raise bad("model", "is missing or not an object with a moe section")
    why = checkpoint_parts.check_parts(meta.get("parts", {}))
    if why is not None:
        raise bad("parts", why)
    if meta.get("parts") and meta.get("version", 1) < 3:
        raise bad(
            "parts",
            f"appear in a version {meta.get('version', 1)} meta.json (rank files are version 3)",
        )
    files = (*FILES, *meta.get("parts", {}))
    for key, kind in (("sizes", int), ("sha256", str)):
        table = meta.get(key, {})
        if not isinstance(table, dict):
            raise bad(key, "is not an object")
        for name, value in table.items():
            if name not in files or not isinstance(value, kind) or isinstance(value, bool):
                raise bad(f"{key}[{name!r}]", f"= {value!r} is not a {kind.__name__} for one of "
                          f"{FILES} or the rank files under parts")  # fmt: skip
        unlisted = [name for name in meta.get("parts", {}) if name not in table]
        if unlisted and (key == "sizes" or meta.get("version", 1) >= 2):
            raise bad(key, f"lists no entry for the rank file {unlisted[0]!r}")
    meta.setdefault("sizes", {})


def verify_file(path: Path | str, name: str, meta: dict[str, Any]) -> None:
    """Compare file ``name`` of checkpoint ``path`` with the sha256 its meta.json recorded."""
    file = Path(path) / name
    expected = meta.get("sha256", {}).get(name)
    if expected is None:
        log.warning("%s: no checksum recorded (an older checkpoint); loaded unverified", file)
        return
    if not file.is_file():
        raise MoestackError(f"{file} is missing: the checkpoint is incomplete; use an older one")
    if sha256_file(file) != expected:
        raise MoestackError(
            f"{file} cannot be read: its sha256 differs from the one in {META_FILE} (the file "
            "changed after it was written); use an older checkpoint"
        )
    record = meta.get("parts", {}).get(name)
    if record is not None:  # a rank file holds the rank and rows meta.json names for it
        checkpoint_parts.check_rank_file(file, record)


def verify_checkpoint(path: Path | str) -> dict[str, Any]:
    """meta.json of ``path`` after checking the size and sha256 of every file; raises
    MoestackError naming the first file that fails."""
    meta = read_meta(path)
    for name in (*FILES, *meta.get("parts", {})):
        verify_file(path, name, meta)
    return meta


def verification_share(meta: dict[str, Any], rank: int, world: int) -> list[str]:
    """The files of a checkpoint that rank ``rank`` of ``world`` verifies: every file of its
    meta.json once over the ranks, the largest first, each to the rank with the fewest bytes
    so far (the lowest such rank)."""
    names = [*FILES, *meta.get("parts", {})]
    sizes = meta.get("sizes", {})
    load = [0] * world
    mine = []
    for name in sorted(names, key=lambda n: (-int(sizes.get(n, 0)), n)):
        owner = min(range(world), key=lambda r: (load[r], r))
        load[owner] += int(sizes.get(name, 0))
        if owner == rank:
            mine.append(name)
    return mine


def model_sha256(path: Path | str) -> str | None:
    """sha256 of checkpoint ``path``'s weights file, as its meta.json records it (None for a
    checkpoint older than the digests); of a checkpoint with rank files, the sha256 of the
    sorted ``name:sha256`` lines of its weights file and experts files."""
    meta = read_meta(path)
    digests = meta.get("sha256", {})
    ranks = checkpoint_parts.overlapping(meta.get("parts", {}), checkpoint_parts.EXPERTS, None)
    if not ranks or MODEL_FILE not in digests:
        return digests.get(MODEL_FILE)
    names = sorted([MODEL_FILE, *(name for name, _ in ranks)])
    lines = "".join(f"{name}:{digests[name]}\n" for name in names)
    return hashlib.sha256(lines.encode()).hexdigest()
