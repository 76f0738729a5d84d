"""Checkpoints: model weights as safetensors, training state beside them, written atomically.

Layout of one checkpoint, ``<run>/checkpoints/step_000200/``:

    model.safetensors   model weights (shared tensors such as tied embeddings stored once)
    train_state.pt      optimizer, scheduler, RNG and data-loader state (plain tensors and
                        numbers only, loaded with ``torch.load(weights_only=True)``)
    meta.json           format, version, step, model config, size and sha256 of each file,
                        and a digest of its own fields (written last)

Under expert parallelism each rank also writes the experts it holds, weights and optimizer
state, into files of its own (``rank00001.experts.safetensors``, ``rank00001.optim.pt``;
:mod:`moestack.checkpoint_parts`), and ``model.safetensors`` holds the other tensors: no rank
gathers another's experts, and a reader at any layout reads the rows it needs.

A checkpoint is written into a temporary folder (``.step_...``), every file fsynced, then
renamed into place (the folder and its files get the modes the umask gives the run's other
files: readable by all under a umask of 022), so a crash never leaves a half-written
checkpoint that looks complete; only the newest ``keep_last`` are kept, and an old one is
renamed to ``.trash-...`` before it is deleted, so a kill mid-prune leaves nothing that
looks like a checkpoint. A save that replaces a checkpoint of the same step renames the old
copy to ``.trash-...``, the new one into place, and only then deletes the old.
``clean_partial`` removes such leftovers at the next start, and renames a complete
``.trash-step_N`` back when ``step_N`` is missing. Loading checks sizes and sha256 of each
file it reads (older checkpoints without digests load with a warning), so flipped bytes are
refused naming the file; ``newest_verified`` finds the newest checkpoint whose files all verify."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch
from safetensors import safe_open
from torch import nn

from moestack import atomic, checkpoint_parts
from moestack.atomic import fsync_file as _fsync
from moestack.atomic import sha256_file
from moestack.checkpoint_parts import Part, expert_tensor_rows, sharded_expert_rows
from moestack.errors import MoestackError
from moestack.evaluation import is_finite
from moestack.model import ModelConfig

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
_FILES = (MODEL_FILE, STATE_FILE)
# A routed expert tensor of a moestack MoE layer: ``layers.<i>.moe.w1`` in moestack's model,
# ``hf.model.layers.<i>.mlp.moe.w1`` in a transformers model's run (model=hf).
_EXPERT_KEY = re.compile(r"(?:.*\.)?layers\.(?P<layer>\d+)\.(?:[A-Za-z_]+\.)?moe\.(?P<w>w[12])")


def save_checkpoint(
    ckpt_root: Path | str,
    step: int,
    model: nn.Module,
    model_cfg: ModelConfig,
    train_state: dict[str, Any],
    keep_last: int = 2,
    *,
    folder: Path | None = None,
    parts: list[Part] | tuple[Part, ...] = (),
) -> Path:
    """Write checkpoint ``step`` under ``ckpt_root`` atomically; prune all but ``keep_last``.

    The digests are taken from the files as written (read back from the page cache right
    after writing, a small cost beside the write), so ``meta.json`` vouches for the bytes on
    disk, not for the tensors in memory. A full disk is one MoestackError naming the folder
    and the space needed; the partial checkpoint is removed, the older ones stay.

    ``folder`` (from :func:`new_folder`) already holds the rank files ``parts`` other ranks
    wrote (expert parallelism); the weights file then leaves out the tensors they hold.
    """
    ckpt_root = Path(ckpt_root)
    final = ckpt_root / f"{PREFIX}{step:06d}"
    replaced: Path | None = None  # the old copy of this step, renamed aside until replaced
    try:
        tmp = folder if folder is not None else new_folder(ckpt_root, step)
    except OSError as err:
        raise _full_or(err, ckpt_root, model, train_state, final) from None
    try:
        if any(part.kind == checkpoint_parts.EXPERTS for part in parts):
            shared = checkpoint_parts.shared_tensors(model, sharded_expert_rows(model))
            checkpoint_parts.write_safetensors(tmp / MODEL_FILE, shared)
        else:
            safetensors.torch.save_model(model, str(tmp / MODEL_FILE))
            os.chmod(tmp / MODEL_FILE, 0o666 & ~_umask())  # safetensors writes it 0600
        torch.save(train_state, tmp / STATE_FILE)
        meta = {
            "format": FORMAT,
            "version": VERSION if parts else 2,  # readable by moestack before rank files
            "step": step,
            "model": dataclasses.asdict(model_cfg),
            "sizes": {name: (tmp / name).stat().st_size for name in _FILES},
            "sha256": {name: sha256_file(tmp / name) for name in _FILES},
        }
        if parts:
            meta["sizes"].update({part.name: part.size for part in parts})
            meta["sha256"].update({part.name: part.sha256 for part in parts})
            meta["parts"] = {part.name: part.record() for part in parts}
        meta[SELF_DIGEST] = _meta_digest(meta)
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2))
        for name in (*_FILES, META_FILE):
            _fsync(tmp / name)
        replaced = _to_trash(final) if final.exists() else None
        os.rename(tmp, final)
        _fsync(ckpt_root)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if replaced is not None and not final.exists():
            os.rename(replaced, final)  # the old copy back: the new one never took its place
        raise _full_or(err, ckpt_root, model, train_state, final) from None
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)  # only now: the new copy is in place
    for old in list_checkpoints(ckpt_root)[:-keep_last]:
        _remove(old)
    return final


def new_folder(ckpt_root: Path | str, step: int) -> Path:
    """A new temporary folder for checkpoint ``step`` under ``ckpt_root``, into which ranks
    write their files before :func:`save_checkpoint` commits it (``clean_partial`` removes
    it if the save never finishes)."""
    ckpt_root = Path(ckpt_root)
    ckpt_root.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=f".{PREFIX}{step:06d}.", dir=ckpt_root))
    os.chmod(folder, 0o777 & ~_umask())  # mkdtemp's 0700 would hide the checkpoint
    return folder


def _umask() -> int:
    """This process's umask: a checkpoint's folder and files get the modes ``mkdir`` and
    ``open`` give the run's other files (0755 and 0644 under a umask of 022). Read from
    /proc where Linux reports it, else set and put back."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _full_or(
    err: BaseException, ckpt_root: Path, model: nn.Module, train_state: Any, final: Path
) -> BaseException:
    """The one-line error if ``err`` is a full disk (the space a checkpoint needs: its
    tensors' bytes), else ``err`` itself."""
    needed = _tensor_bytes(model.state_dict()) + _tensor_bytes(train_state)
    full = atomic.out_of_space(err, ckpt_root, needed, f"checkpoint {final.name}")
    if full is None:
        return err
    return MoestackError(f"{full}; {kept_note(ckpt_root)}")


def kept_note(ckpt_root: Path | str) -> str:
    """What a run that stopped with an error can continue from, for its message: the newest
    checkpoint under ``ckpt_root``, or that there is none (then resuming is no advice)."""
    last = latest_checkpoint(ckpt_root)
    if last is None:
        return "no checkpoint was written before it, so there is none to resume from"
    return f"the last checkpoint, {last}, is kept: resume=true continues from it"


def _tensor_bytes(tree: Any) -> int:
    """Bytes of the tensors in a nest of dicts, lists and tuples."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(_tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_tensor_bytes(v) for v in tree)
    return 0


def _to_trash(path: Path) -> Path:
    """Rename a checkpoint folder out of sight (atomic) to ``.trash-<name>``; returns it."""
    trash = path.with_name(f"{TRASH_PREFIX}{path.name}")
    shutil.rmtree(trash, ignore_errors=True)
    os.rename(path, trash)
    return trash


def _remove(path: Path) -> None:
    """Delete a checkpoint folder: first renamed out of sight (atomic), then removed."""
    shutil.rmtree(_to_trash(path), ignore_errors=True)


def clean_partial(ckpt_root: Path | str) -> list[Path]:
    """Remove what a killed save or prune left under ``ckpt_root``: temporary ``.step_*``
    folders, ``.trash-*`` folders and ``step_*`` folders without meta.json. Returns them.

    A ``.trash-step_N`` holding a complete checkpoint (meta.json) while ``step_N`` is missing
    is renamed back first: a save replacing step N was killed before its new copy took the
    old one's place, and the old copy may be the only one left."""
    ckpt_root = Path(ckpt_root)
    if not ckpt_root.is_dir():
        return []
    for trash in ckpt_root.glob(f"{TRASH_PREFIX}{PREFIX}*"):
        original = trash.with_name(trash.name[len(TRASH_PREFIX) :])
        if (trash / META_FILE).is_file() and not original.exists():
            os.rename(trash, original)
            log.warning("restored %s, set aside by a save that did not finish", original)
    leftovers = [
        p
        for p in ckpt_root.iterdir()
        if p.is_dir()
        and (
            p.name.startswith((f".{PREFIX}", TRASH_PREFIX))
            or (p.name.startswith(PREFIX) and not (p / META_FILE).is_file())
        )
    ]
    for path in leftovers:
        shutil.rmtree(path, ignore_errors=True)
    if leftovers:
        log.info("removed %d partial checkpoint folder(s) under %s", len(leftovers), ckpt_root)
    return leftovers


def list_checkpoints(ckpt_root: Path | str) -> list[Path]:
    """Complete checkpoints under ``ckpt_root``, oldest first (temporary folders ignored)."""
    ckpt_root = Path(ckpt_root)
    if not ckpt_root.is_dir():
        return []
    found = [
        p for p in ckpt_root.iterdir() if p.name.startswith(PREFIX) and (p / META_FILE).is_file()
    ]
    return sorted(found, key=lambda p: p.name)


def incomplete_checkpoints(ckpt_root: Path | str) -> list[Path]:
    """``step_*`` folders without meta.json, oldest first: a save that never finished, or a
    checkpoint whose meta.json was deleted (:func:`list_checkpoints` leaves them out)."""
    ckpt_root = Path(ckpt_root)
    if not ckpt_root.is_dir():
        return []
    found = [p for p in ckpt_root.iterdir() if p.name.startswith(PREFIX) and p.is_dir()]
    return sorted((p for p in found if not (p / META_FILE).is_file()), key=lambda p: p.name)


def latest_checkpoint(ckpt_root: Path | str) -> Path | None:
    found = list_checkpoints(ckpt_root)
    return found[-1] if found else None


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


def _meta_digest(meta: dict[str, Any]) -> str:
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
    if SELF_DIGEST in meta and meta[SELF_DIGEST] != _meta_digest(meta):
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
    files = (*_FILES, *meta.get("parts", {}))
    for key, kind in (("sizes", int), ("sha256", str)):
        table = meta.get(key, {})
        if not isinstance(table, dict):
            raise bad(key, "is not an object")
        for name, value in table.items():
            if name not in files or not isinstance(value, kind) or isinstance(value, bool):
                raise bad(f"{key}[{name!r}]", f"= {value!r} is not a {kind.__name__} for one of "
                          f"{_FILES} or the rank files under parts")  # fmt: skip
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
    for name in (*_FILES, *meta.get("parts", {})):
        verify_file(path, name, meta)
    return meta


def newest_verified(
    ckpt_root: Path | str,
    rank: int = 0,
    world: int = 1,
    gather: Callable[[str | None], list[str | None]] | None = None,
) -> Path | None:
    """The newest checkpoint under ``ckpt_root`` whose files all verify; every newer one
    that fails is named in a warning (training then falls back to the one returned).

    With ``world`` ranks (every one calls this; ``gather`` returns every rank's value of one
    object) each file is verified once, by one rank (:func:`verification_share`), and a
    checkpoint counts when every rank's share verifies: no rank reads all the files."""
    for path in reversed(list_checkpoints(ckpt_root)):
        problem = _share_problem(path, rank, world)
        problems = [problem] if gather is None else gather(problem)
        failed = [p for p in problems if p is not None]
        if failed:
            log.warning("skipping checkpoint %s: %s", path.name, "; ".join(dict.fromkeys(failed)))
            continue
        return path
    return None


def verification_share(meta: dict[str, Any], rank: int, world: int) -> list[str]:
    """The files of a checkpoint that rank ``rank`` of ``world`` verifies: every file of its
    meta.json once over the ranks, the largest first, each to the rank with the fewest bytes
    so far (the lowest such rank)."""
    names = [*_FILES, *meta.get("parts", {})]
    sizes = meta.get("sizes", {})
    load = [0] * world
    mine = []
    for name in sorted(names, key=lambda n: (-int(sizes.get(n, 0)), n)):
        owner = min(range(world), key=lambda r: (load[r], r))
        load[owner] += int(sizes.get(name, 0))
        if owner == rank:
            mine.append(name)
    return mine


def _share_problem(path: Path, rank: int, world: int) -> str | None:
    """Why rank ``rank``'s share of checkpoint ``path`` does not verify (None: it does)."""
    try:
        meta = read_meta(path)
        for name in verification_share(meta, rank, world):
            verify_file(path, name, meta)
    except MoestackError as err:
        return str(err)
    return None


def check_model_config(meta: dict[str, Any], model_cfg: ModelConfig, path: Path | str) -> None:
    """Refuse a checkpoint whose model shape differs from ``model_cfg``, naming the field."""
    saved = meta.get("model", {})
    current = dataclasses.asdict(model_cfg)
    for section, keys in (
        (None, ("vocab_size", "d_model", "n_layers", "n_heads", "tie_embeddings")),
        ("moe", ("num_experts", "top_k", "d_ff")),
    ):
        for key in keys:
            old = saved.get(section, {}).get(key) if section else saved.get(key)
            new = current[section][key] if section else current[key]
            if old != new:
                field = f"model.{section}.{key}" if section else f"model.{key}"
                raise MoestackError(
                    f"checkpoint {path} was trained with {field}={old}, this model has {new}; "
                    "use the checkpoint's model config"
                )


def load_model_weights(
    path: Path | str, model: nn.Module, model_cfg: ModelConfig
) -> dict[str, Any]:
    """Load the weights of checkpoint ``path`` into ``model``; returns its meta. A model
    whose experts are cut to a rank's (expert parallelism) reads those rows only. Each
    tensor's shape is checked first: a mismatch is one line naming the tensor and the
    config field that differs (another lora.rank), not a damaged file."""
    path = Path(path)
    meta = read_meta(path)
    check_model_config(meta, model_cfg, path)
    verify_file(path, MODEL_FILE, meta)
    if checkpoint_parts.overlapping(meta.get("parts", {}), checkpoint_parts.EXPERTS, None):
        _load_from_rank_files(path, meta, model)
        return meta
    _load_with_expert_rows(path / MODEL_FILE, model, sharded_expert_rows(model))
    return meta


@torch.no_grad()
def _load_with_expert_rows(
    file: Path,
    model: nn.Module,
    rows: dict[str, tuple[int, int]],
    elsewhere: frozenset[str] = frozenset(),
) -> None:
    """Read ``file`` into ``model`` in place, each sharded expert tensor's rows only (the
    file holds whole experts; no other rank's rows are read into memory); the tensors named
    in ``elsewhere`` are not in it (the rank files of the checkpoint hold them)."""
    tensors = model.state_dict(keep_vars=True)
    try:
        with safe_open(file, framework="pt", device="cpu") as f:
            keys = set(f.keys())  # noqa: SIM118 (safe_open is no dict)
            for name, tensor in tensors.items():
                if name in elsewhere:
                    continue
                if name not in keys:
                    if name.endswith("lm_head.weight"):  # tied: stored once
                        continue
                    raise MoestackError(
                        f"{file} does not match the model (missing {name}); use the "
                        "checkpoint's model config"
                    )
                lo_hi = rows.get(name)
                value = f.get_slice(name)[lo_hi[0] : lo_hi[1]] if lo_hi else f.get_tensor(name)
                if tuple(value.shape) != tuple(tensor.shape):
                    field = "lora.rank" if "lora_" in name else "model config"
                    raise MoestackError(
                        f"{file}: {name} has shape {tuple(value.shape)}, the model expects "
                        f"{tuple(tensor.shape)} ({field}?); use the checkpoint's {field}"
                    )
                tensor.copy_(value)
    except (safetensors.SafetensorError, OSError) as err:
        raise MoestackError(f"{file}: cannot be read ({err})") from None
    unexpected = sorted(keys - set(tensors))
    if unexpected:
        raise MoestackError(
            f"{file} does not match the model (unexpected {unexpected[:3]}); use the "
            "checkpoint's model config"
        )


def _load_from_rank_files(path: Path, meta: dict[str, Any], model: nn.Module) -> None:
    """Load a checkpoint written with rank files into ``model`` (any layout: its expert
    tensors hold whole experts or a block): the shared tensors from the weights file, each
    expert tensor's rows from the rank files that hold them (those files verified only)."""
    wanted = expert_tensor_rows(model)
    _load_with_expert_rows(path / MODEL_FILE, model, {}, frozenset(wanted))
    if not wanted:
        return
    block = checkpoint_parts.block_of(wanted)
    files = _covering(path, meta, checkpoint_parts.EXPERTS, block)
    tensors = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, (lo, hi) in files:
            a, b = max(block[0], lo), min(block[1], hi)
            for key, tensor in _read_rows(path / name, wanted, a - lo, b - lo):
                tensors[key][a - block[0] : b - block[0]].copy_(tensor)


def _covering(
    path: Path, meta: dict[str, Any], kind: str, block: tuple[int, int]
) -> list[tuple[str, tuple[int, int]]]:
    """The rank files of ``kind`` holding experts ``block``, verified; a MoestackError names
    the experts none holds."""
    files = checkpoint_parts.overlapping(meta.get("parts", {}), kind, block)
    covered = block[0]
    for _, (lo, hi) in files:
        if lo > covered:
            break
        covered = max(covered, hi)
    if covered < block[1]:
        raise MoestackError(
            f"checkpoint {path}: no rank file holds the {kind} state of experts "
            f"{covered}..{block[1] - 1}; the checkpoint is incomplete, use an older one"
        )
    for name, _ in files:
        verify_file(path, name, meta)
    return files


def _read_rows(
    file: Path, names: Iterable[str], a: int, b: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Rows ``[a, b)`` of each tensor ``names`` of a rank's experts file."""
    try:
        with safe_open(file, framework="pt", device="cpu") as f:
            keys = set(f.keys())  # noqa: SIM118 (safe_open is no dict)
            for name in names:
                if name not in keys:
                    raise MoestackError(
                        f"{file} holds no {name}; the checkpoint does not match the model "
                        "(use the checkpoint's model config)"
                    )
                yield name, f.get_slice(name)[a:b]
    except (safetensors.SafetensorError, OSError) as err:
        raise MoestackError(f"{file}: cannot be read ({err})") from None


def load_optimizer_parts(path: Path | str, block: tuple[int, int] | None) -> list[dict[str, Any]]:
    """The optimizer parts of checkpoint ``path`` holding experts ``block`` (None: all), and
    every shard part of the replicated state, each verified and memory-mapped (only what the
    optimizer copies out is read); [] for a checkpoint without rank files."""
    path = Path(path)
    meta = read_meta(path)
    parts = meta.get("parts", {})
    if not checkpoint_parts.overlapping(parts, checkpoint_parts.OPTIMIZER, None):
        return []
    if block is None:
        block = (
            0,
            max(
                rows[1]
                for _, rows in checkpoint_parts.overlapping(parts, checkpoint_parts.EXPERTS, None)
            ),
        )
    out = []
    shards = checkpoint_parts.overlapping(parts, checkpoint_parts.SHARD, None)
    for name, _ in shards:  # every rank's shard of the replicated state: each reader needs it
        verify_file(path, name, meta)
    for name, _ in [*_covering(path, meta, checkpoint_parts.OPTIMIZER, block), *shards]:
        try:
            out.append(torch.load(path / name, map_location="cpu", weights_only=True, mmap=True))
        except Exception as err:  # truncated zip, foreign pickle
            raise MoestackError(
                f"{path / name} cannot be read ({err}); use an older checkpoint"
            ) from None
    return out


def _expert_key(key: str) -> bool:
    """A routed expert tensor of a moestack MoE layer (``_EXPERT_KEY``)."""
    return _EXPERT_KEY.fullmatch(key) is not None


def load_model_weights_without_experts(
    path: Path | str, model: nn.Module, model_cfg: ModelConfig
) -> dict[str, Any]:
    """``load_model_weights`` for a model built under ``meta_load.parameters_on_meta``: every
    weight and persistent buffer but the MoE layers' ``w1``/``w2`` read (copies), the experts
    left meta, for serving them from an expert store. Returns the checkpoint's meta."""
    from moestack.meta_load import TensorReader, fill_buffers, fill_parameters

    path = Path(path)
    meta = read_meta(path)
    check_model_config(meta, model_cfg, path)
    verify_file(path, MODEL_FILE, meta)
    file = path / MODEL_FILE
    try:
        with safe_open(file, framework="pt", device="cpu") as f:
            keys = dict.fromkeys(f.keys(), file)  # safe_open is no dict
    except (safetensors.SafetensorError, OSError) as err:
        raise MoestackError(f"{file}: cannot be read ({err})") from None
    with contextlib.ExitStack() as stack:
        reader = TensorReader(keys, stack)

        def find(name: str) -> str | None:  # moestack saves a tensor under its own name
            return name if name in keys else None

        used = fill_parameters(model, reader, find, _expert_key, file)
        used |= fill_buffers(model, reader, find, file, required=True)
    unexpected = sorted(k for k in keys if k not in used and not _expert_key(k))
    if unexpected:
        raise MoestackError(
            f"{file} does not match the model (unexpected {unexpected[:3]}); use the "
            "checkpoint's model config"
        )
    return meta


def iter_expert_layers(
    path: Path | str, dtype: torch.dtype | None = None, *, verify: bool = True
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(w1 [E, D, 2F], w2 [E, F, D])`` of each MoE layer of checkpoint ``path``, in layer
    order, one layer read at a time (``ExpertStore.write_layers``), in ``dtype`` if given
    (the model's: a bf16 checkpoint serves an fp32 model's experts in fp32, as loading it
    whole would). ``verify=False`` skips the file's sha256 check for a caller that has just
    checked it (a large checkpoint is then read once, not twice)."""
    path = Path(path)
    meta = read_meta(path)
    if verify:
        verify_file(path, MODEL_FILE, meta)
    files = [path / MODEL_FILE]
    ranks = checkpoint_parts.overlapping(meta.get("parts", {}), checkpoint_parts.EXPERTS, None)
    if ranks:  # every rank file's block of each layer, joined in expert order
        whole = (0, max(rows[1] for _, rows in ranks))
        files = [path / name for name, _ in _covering(path, meta, checkpoint_parts.EXPERTS, whole)]
    try:
        with contextlib.ExitStack() as stack:
            opened = [
                stack.enter_context(safe_open(f, framework="pt", device="cpu")) for f in files
            ]
            keys: dict[int, dict[str, str]] = {}  # decoder layer -> {"w1": key, "w2": key}
            for key in opened[0].keys():  # noqa: SIM118 (safe_open is no dict)
                if match := _EXPERT_KEY.fullmatch(key):
                    keys.setdefault(int(match["layer"]), {})[match["w"]] = key
            for layer in sorted(keys):  # the order of model.moe_layers
                w1, w2 = (
                    torch.cat([f.get_tensor(keys[layer][n]) for f in opened]) for n in ("w1", "w2")
                )
                yield (w1, w2) if dtype is None else (w1.to(dtype), w2.to(dtype))
    except (safetensors.SafetensorError, OSError) as err:
        raise MoestackError(
            f"{path}: cannot read the experts ({err}); the checkpoint is damaged, use another"
        ) from None


def read_weights(path: Path | str) -> dict[str, torch.Tensor]:
    """Every tensor of checkpoint ``path``'s weights, whole: a checkpoint written with rank
    files has its expert tensors joined from them in expert order (all files verified)."""
    path = Path(path)
    meta = verify_checkpoint(path)
    try:
        tensors = safetensors.torch.load_file(path / MODEL_FILE)
        ranks = checkpoint_parts.overlapping(meta.get("parts", {}), checkpoint_parts.EXPERTS, None)
        blocks = [safetensors.torch.load_file(path / name) for name, _ in ranks]
    except (safetensors.SafetensorError, OSError) as err:
        raise MoestackError(f"{path}: cannot read the weights ({err})") from None
    for name in blocks[0] if blocks else ():
        tensors[name] = torch.cat([block[name] for block in blocks])
    return tensors


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


def load_train_state(path: Path | str) -> dict[str, Any]:
    """The optimizer/scheduler/RNG/data state saved beside the weights (no pickled code)."""
    file = Path(path) / STATE_FILE
    verify_file(path, STATE_FILE, read_meta(path))
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise MoestackError(f"{file} is missing: the checkpoint is incomplete") from None
    except Exception as err:  # truncated zip, foreign pickle
        raise MoestackError(f"{file} cannot be read ({err}); use an older checkpoint") from None


def first_non_finite(tree: Any, where: str) -> str | None:
    """Name of the first floating-point tensor in ``tree`` (nested dicts/lists) with NaN/inf."""
    if isinstance(tree, torch.Tensor):
        if tree.is_floating_point() and not is_finite(tree):
            return where
        return None
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(
        tree, (list, tuple)) else ()  # fmt: skip
    for key, value in items:
        found = first_non_finite(value, f"{where} {key}" if where else str(key))
        if found:
            return found
    return None


def rng_state() -> dict[str, Any]:
    """The global torch (and CUDA) RNG state, saved in checkpoints for exact resume."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``rng_state`` saved."""
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
