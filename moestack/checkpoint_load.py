"""Reading a checkpoint back: its weights into a model (whole, a rank's rows of the experts,
or all but the experts), its experts layer by layer, its optimizer state's rank files, and
its training state; every file is checked against meta.json before it is read
(:mod:`moestack.checkpoint_format`). :mod:`moestack.checkpoint` writes what these read."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch
from safetensors import safe_open
from torch import nn

from moestack import checkpoint_parts
from moestack.checkpoint_format import (
    EXPERT_KEY,
    MODEL_FILE,
    STATE_FILE,
    read_meta,
    verify_checkpoint,
    verify_file,
)
from moestack.checkpoint_parts import expert_tensor_rows, sharded_expert_rows
from moestack.errors import MoestackError
from moestack.model import ModelConfig


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
    """A routed expert tensor of a moestack MoE layer (``EXPERT_KEY``)."""
    return EXPERT_KEY.fullmatch(key) is not None


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
                if match := EXPERT_KEY.fullmatch(key):
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
