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
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import nn

from moestack import atomic, checkpoint_parts
from moestack.atomic import fsync_file as _fsync
from moestack.atomic import sha256_file
from moestack.checkpoint_format import (
    FILES,
    FORMAT,
    META_FILE,
    MODEL_FILE,
    PREFIX,
    SELF_DIGEST,
    STATE_FILE,
    TRASH_PREFIX,
    VERSION,
    check_meta,
    meta_digest,
    model_sha256,
    read_meta,
    verification_share,
    verify_checkpoint,
    verify_file,
)
from moestack.checkpoint_load import (
    check_model_config,
    iter_expert_layers,
    load_model_weights,
    load_model_weights_without_experts,
    load_optimizer_parts,
    load_train_state,
    read_weights,
)
from moestack.checkpoint_parts import Part, sharded_expert_rows
from moestack.errors import MoestackError
from moestack.evaluation import is_finite
from moestack.model import ModelConfig

log = logging.getLogger(__name__)

# The public names of checkpoints: writing here, the format and its checks from
# checkpoint_format, reading back from checkpoint_load.
__all__ = [
    "META_FILE",
    "MODEL_FILE",
    "STATE_FILE",
    "check_meta",
    "check_model_config",
    "clean_partial",
    "first_non_finite",
    "incomplete_checkpoints",
    "iter_expert_layers",
    "kept_note",
    "latest_checkpoint",
    "list_checkpoints",
    "load_model_weights",
    "load_model_weights_without_experts",
    "load_optimizer_parts",
    "load_train_state",
    "model_sha256",
    "new_folder",
    "newest_verified",
    "read_meta",
    "read_weights",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
    "verification_share",
    "verify_checkpoint",
    "verify_file",
]


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
        _write_files(tmp, model, train_state, parts)
        meta = _meta(tmp, step, model_cfg, parts)
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2))
        for name in (*FILES, META_FILE):
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


def _write_files(
    tmp: Path, model: nn.Module, train_state: dict[str, Any], parts: Sequence[Part]
) -> None:
    """The weights file (without the experts the rank files ``parts`` hold) and the training
    state, into the checkpoint's temporary folder ``tmp``."""
    if any(part.kind == checkpoint_parts.EXPERTS for part in parts):
        shared = checkpoint_parts.shared_tensors(model, sharded_expert_rows(model))
        checkpoint_parts.write_safetensors(tmp / MODEL_FILE, shared)
    else:
        safetensors.torch.save_model(model, str(tmp / MODEL_FILE))
        os.chmod(tmp / MODEL_FILE, 0o666 & ~_umask())  # safetensors writes it 0600
    torch.save(train_state, tmp / STATE_FILE)


def _meta(tmp: Path, step: int, model_cfg: ModelConfig, parts: Sequence[Part]) -> dict[str, Any]:
    """meta.json of the files written into ``tmp``: their sizes and sha256 (the rank files'
    as their writers recorded them), the model config, and its own digest last."""
    meta = {
        "format": FORMAT,
        "version": VERSION if parts else 2,  # readable by moestack before rank files
        "step": step,
        "model": dataclasses.asdict(model_cfg),
        "sizes": {name: (tmp / name).stat().st_size for name in FILES},
        "sha256": {name: sha256_file(tmp / name) for name in FILES},
    }
    if parts:
        meta["sizes"].update({part.name: part.size for part in parts})
        meta["sha256"].update({part.name: part.sha256 for part in parts})
        meta["parts"] = {part.name: part.record() for part in parts}
    meta[SELF_DIGEST] = meta_digest(meta)
    return meta


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


def _share_problem(path: Path, rank: int, world: int) -> str | None:
    """Why rank ``rank``'s share of checkpoint ``path`` does not verify (None: it does)."""
    try:
        meta = read_meta(path)
        for name in verification_share(meta, rank, world):
            verify_file(path, name, meta)
    except MoestackError as err:
        return str(err)
    return None


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
