"""Write an ``HFMoEModel`` back as a transformers model folder.

``export_hf(model, OUT, source_dir=DIR)`` puts the moestack MoE weights back into the
original transformers blocks (kept aside by ``load_hf_moe``), swaps those blocks into the
model for the time of ``save_pretrained`` (so config.json and the safetensors keys are the
family's own, exactly as transformers writes them), copies the tokenizer files from DIR,
and moves the folder into place atomically (a sibling folder ``.OUT.tmp-PID``, fsynced,
renamed; ``moestack.atomic``: the leftovers of an export killed midway are cleaned up by the
next export to the same OUT).
``AutoModelForCausalLM.from_pretrained(OUT)`` then gives the moestack model's logits.

The weights are written in one dtype (``dtype``): by default (``"source"``) the one the
source folder's config.json declares (``dtype``, or ``torch_dtype`` on older configs;
float32 when it declares none), so a bf16 model fine-tuned in fp32 is exported bf16;
``"float32"``, ``"bfloat16"`` or ``"float16"`` choose. The cast copies live only while
``save_pretrained`` runs (the model keeps its own weights), and config.json says the dtype
as transformers writes it.

The aux-loss-free ``expert_bias`` of a router has no transformers equivalent in the
supported families (their routers have no selection bias), so it cannot be folded: every
layer with a nonzero bias is listed in the report (max |bias|), in ``moestack_export.json``
beside the weights, and in a logged warning; never dropped silently.

``moestack_export.json`` is also the export record (format ``moestack-export``: the run,
the checkpoint and its sha256): ``overwrite`` replaces only a folder carrying one, never
the source model folder, the run or a folder above either, and the old export is swapped
out only once the new one is complete. Weights holding NaN/inf are refused, naming the
tensors (``allow_nonfinite`` warns instead); a disk without room for the export (its size
is the tensors' bytes plus the tokenizer files) is one line naming the folder, the bytes
needed and free, before or while writing, the partial folder removed.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moestack.atomic import install_dir, out_of_space, recover_dir, temp_dir
from moestack.checkpoint import sha256_file
from moestack.errors import MoestackError
from moestack.evaluation import check_finite_weights, model_tensors
from moestack.interop.hf_config import CONFIG_FILE, check_model_dir
from moestack.interop.hf_model import HFMoEModel, release_routed_weights
from moestack.interop.hf_tokenizer import tokenizer_files
from moestack.lora import has_adapters
from moestack.moe import MoE

log = logging.getLogger(__name__)

REPORT_FILE = "moestack_export.json"  # the export record: what was exported, from where
EXPORT_FORMAT = "moestack-export"  # its format key: --overwrite replaces only such a folder
EXPORT_DTYPES = ("source", "float32", "bfloat16", "float16")  # export --dtype choices
_WEIGHT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def export_dtype(name: str, source: Path) -> torch.dtype:
    """The dtype an export writes: ``name``, or for ``"source"`` the one ``source``'s
    config.json declares (``dtype``, ``torch_dtype`` on older configs; float32 if none)."""
    if name not in EXPORT_DTYPES:
        raise MoestackError(f"export dtype {name!r} is unknown; use one of {EXPORT_DTYPES}")
    if name != "source":
        return _WEIGHT_DTYPES[name]
    raw = json.loads((source / CONFIG_FILE).read_text())
    declared = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    if declared not in _WEIGHT_DTYPES:
        raise MoestackError(
            f"{source / CONFIG_FILE} declares dtype {declared!r}, which an export cannot "
            f"write; choose one with --dtype (dtype=) {tuple(_WEIGHT_DTYPES)}"
        )
    return _WEIGHT_DTYPES[declared]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``, as transformers writes it in config.json."""
    return str(dtype).removeprefix("torch.")


@contextlib.contextmanager
def cast_weights(module: nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """``module``'s floating parameters and buffers hold ``dtype`` copies inside the block
    (a tensor shared under two names is cast once); the originals are back on exit."""
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        for t in itertools.chain(module.parameters(), module.buffers()):
            if t.is_floating_point() and t.dtype != dtype:
                kept.append((t, t.data))
                t.data = t.data.to(dtype)
        yield
    finally:
        for t, data in kept:
            t.data = data


def _refill(block: nn.Module, moe: MoE) -> None:
    """Put ``moe``'s router and expert weights into the original ``block`` (either layout)."""
    w1, w2 = moe.w1.detach(), moe.w2.detach()
    _put(block.gate, "weight", moe.router.weight.detach().clone())
    experts = block.experts
    if hasattr(experts, "gate_up_proj"):  # transformers 5.x: [E, 2F, D] and [E, D, F]
        _put(experts, "gate_up_proj", w1.transpose(1, 2).contiguous())
        _put(experts, "down_proj", w2.transpose(1, 2).contiguous())
        return
    d_ff = w2.shape[1]
    for e, expert in enumerate(experts):  # 4.x: one MLP per expert (Mixtral: w1/w3/w2)
        if hasattr(expert, "gate_proj"):
            gate, up, down = expert.gate_proj, expert.up_proj, expert.down_proj
        else:
            gate, up, down = expert.w1, expert.w3, expert.w2
        _put(gate, "weight", w1[e, :, :d_ff].t().contiguous())
        _put(up, "weight", w1[e, :, d_ff:].t().contiguous())
        _put(down, "weight", w2[e].t().contiguous())


def _put(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """``value`` as ``module``'s parameter ``name``: a new Parameter where the old one is on
    meta (a model built with nothing read, as a streamed run's is), whose data cannot be
    swapped for a host tensor; otherwise its data replaced."""
    param = getattr(module, name)
    if param.is_meta:
        setattr(module, name, nn.Parameter(value, requires_grad=False))
    else:
        param.data = value


@contextlib.contextmanager
def original_blocks(model: HFMoEModel) -> Iterator[nn.Module]:
    """``model.hf`` with its original transformers blocks in place, holding the current
    MoE weights; the moestack blocks are back (and the copies freed) on exit."""
    patched = model._patched
    try:
        for p in patched:
            _refill(p.original, p.wrapper.moe)
            setattr(p.parent, p.name, p.original)
        yield model.hf
    finally:
        for p in patched:
            setattr(p.parent, p.name, p.wrapper)
            release_routed_weights(p.original)


@contextlib.contextmanager
def _kept_config_dtype(hf: nn.Module) -> Iterator[None]:
    """``save_pretrained`` sets ``hf.config.dtype`` to what it writes; put it back after."""
    before = getattr(hf.config, "dtype", None)
    try:
        yield
    finally:
        hf.config.dtype = before


def expert_bias_report(model: HFMoEModel) -> dict[int, float]:
    """Max |expert_bias| of every MoE layer whose router has a nonzero selection bias."""
    out = {}
    for i, moe in enumerate(model.moe_layers):
        peak = float(moe.router.expert_bias.detach().abs().max())
        if peak > 0:
            out[i] = peak
    return out


def is_export(folder: Path) -> bool:
    """``folder`` carries moestack's export record (``moestack_export.json``, a JSON object
    of format ``EXPORT_FORMAT``; records written before the format key have the report's
    ``family`` and ``expert_bias_dropped``): it is an earlier export."""
    try:
        record = json.loads((folder / REPORT_FILE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    if not isinstance(record, dict):
        return False
    if "format" in record:
        return record["format"] == EXPORT_FORMAT
    return {"family", "expert_bias_dropped"} <= set(record)


def _check_not_kept(out: Path, keep: dict[str, Path]) -> None:
    """Refuse an ``out`` that is one of the folders in ``keep`` ({what: folder}: the
    source model folder, the run) or a folder above one: replacing it would delete it."""
    target = out.resolve()
    for what, folder in keep.items():
        held = folder.resolve()
        if held == target or held.is_relative_to(target):
            where = "" if held == target else "a folder above "
            raise MoestackError(
                f"export folder {out} is {where}the {what} {folder}; choose another folder"
            )


def _check_under_folders(out: Path) -> None:
    """Refuse an ``out`` below a file (it could never be created)."""
    existing = out.absolute().parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise MoestackError(
            f"export folder {out} lies under {existing}, which is a file; choose a folder path"
        )


def check_export_target(out: Path, keep: dict[str, Path], overwrite: bool) -> None:
    """``out`` may be missing or empty; an existing export only with ``overwrite``. Never
    the source model folder, the run, a folder above either, or a path under a file."""
    _check_not_kept(out, keep)
    _check_under_folders(out)
    if not out.exists():
        return
    if not out.is_dir():
        raise MoestackError(f"export folder {out} is a file; choose a folder path")
    if not any(out.iterdir()):
        return
    if not overwrite:
        raise MoestackError(
            f"export folder {out} exists and is not empty; choose a new folder, or pass "
            "--overwrite (overwrite=True) to replace an earlier export"
        )
    if not is_export(out):
        raise MoestackError(
            f"export folder {out} exists and is not empty, and holds no {REPORT_FILE}: it is "
            "not an earlier moestack export, so it is not replaced; choose a new folder"
        )


def _check_in_memory(model: HFMoEModel) -> None:
    for i, moe in enumerate(model.moe_layers):
        if moe.w1.is_meta or moe.w2.is_meta:
            raise MoestackError(
                f"MoE layer {i}'s experts are offloaded (meta tensors); export needs the "
                "model with its experts in memory"
            )


def _copy_tokenizer(source: Path, into: Path) -> list[str]:
    """Copy the tokenizer files of ``source`` into ``into``; the names copied."""
    names = tokenizer_files(source)
    if not names:
        log.warning("%s has no tokenizer files; the export has none either", source)
    for name in names:
        shutil.copy2(source / name, into / name)
    return names


def warn_dropped(dropped: dict[int, float]) -> None:
    """Log the layers whose aux-loss-free bias an export could not keep (none: nothing)."""
    if dropped:
        layers = ", ".join(f"layer {i}: {b:.3g}" for i, b in dropped.items())
        log.warning(
            "the routers' aux-loss-free expert_bias has no transformers equivalent in this "
            "family and is not in the export (max |bias| per layer: %s); the exported model "
            "routes as moestack does with router.bias_update_rate=0",
            layers,
        )


def _export_bytes(hf: nn.Module, source: Path, names: list[str]) -> int:
    """Bytes the export writes, known before writing: every tensor of ``hf``'s state dict
    (a tensor shared under two names once) and the tokenizer files copied."""
    tensors = {(t.untyped_storage().data_ptr(), t.storage_offset(), t.shape): t
               for t in hf.state_dict().values()}  # fmt: skip
    weights = sum(t.numel() * t.element_size() for t in tensors.values())
    return weights + sum((source / name).stat().st_size for name in names)


def export_target(
    out_dir: str | Path, source_dir: str | Path, run_dir: str | Path | None, overwrite: bool
) -> tuple[Path, Path]:
    """``(source, out)``: the checked source model folder and an ``out_dir`` an export may
    write (``check_export_target``: never the source, the run or a folder above them),
    once what an export killed midway left beside it is cleaned up (``recover_dir``: an
    earlier export it had moved aside is put back, so ``overwrite`` is still needed)."""
    source = check_model_dir(source_dir)
    out = Path(out_dir).expanduser()
    keep = {"source model folder": source}
    if run_dir is not None:
        keep["run folder"] = Path(run_dir)
    recover_dir(out)
    check_export_target(out, keep, overwrite)
    return source, out


def export_record(
    model: HFMoEModel,
    out: Path,
    source: Path,
    run_dir: str | Path | None,
    checkpoint: str | Path | None,
) -> dict[str, Any]:
    """The fields every export record holds (a model's or an adapter's): its format, where
    it went, the family, the source folder and its config's sha256, the run and checkpoint."""
    return {
        "format": EXPORT_FORMAT,
        "out_dir": str(out.resolve()),
        "family": model.info["family"],
        "source_dir": str(source.resolve()),
        "source_config_sha256": sha256_file(source / CONFIG_FILE),
        "run_dir": None if run_dir is None else str(Path(run_dir).resolve()),
        "checkpoint": None if checkpoint is None else str(Path(checkpoint).resolve()),
    }


def _check_exportable(
    model: HFMoEModel, out: Path, checkpoint: str | Path | None, allow_nonfinite: bool
) -> None:
    """Refuse a model a transformers folder cannot hold as it is: one with LoRA adapters,
    one with experts not in memory, one whose weights hold NaN/inf (unless allowed)."""
    if has_adapters(model):
        raise MoestackError(
            "the model carries LoRA adapters, which a transformers folder has no place for: "
            "merge them first (moestack.lora.merge_adapters, as `moestack export` does) or "
            "write them alone (`moestack export --adapter`)"
        )
    _check_in_memory(model)
    what = f"checkpoint {checkpoint}" if checkpoint is not None else f"the model to export to {out}"
    check_finite_weights(model_tensors(model), what, allow=allow_nonfinite)


def _remove_partial(err: BaseException, tmp: Path, out: Path, needed: int) -> None:
    """After a failed export: its temporary folder removed (a failed export leaves nothing
    behind), and a full disk raised as one line naming the bytes ``needed``."""
    shutil.rmtree(tmp, ignore_errors=True)
    full = out_of_space(err, out.parent, needed, f"the export {out} (partial files removed)")
    if full is not None:
        raise full from None


def _save_weights(
    model: HFMoEModel,
    tmp: Path,
    source: Path,
    as_dtype: torch.dtype,
    max_shard_size: str | int,
    needed: list[int],
) -> None:
    """The model's original blocks saved into ``tmp`` by transformers, in ``as_dtype`` (its
    config.json's dtype following), once the disk has room for the export; ``needed[0]``
    is set to the export's bytes as soon as they are known."""
    with (
        torch.no_grad(),
        original_blocks(model) as hf,
        _kept_config_dtype(hf),
        cast_weights(hf, as_dtype),  # config.json's dtype follows the weights'
    ):
        needed[0] = _export_bytes(hf, source, tokenizer_files(source))
        if shutil.disk_usage(tmp).free < needed[0]:  # known to fail: refused before writing
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp))
        hf.save_pretrained(tmp, max_shard_size=max_shard_size)


def export_hf(
    model: HFMoEModel,
    out_dir: str | Path,
    *,
    source_dir: str | Path,
    overwrite: bool = False,
    max_shard_size: str | int = "5GB",
    run_dir: str | Path | None = None,
    checkpoint: str | Path | None = None,
    checkpoint_sha256: str | None = None,
    allow_nonfinite: bool = False,
    dtype: str = "source",
) -> dict[str, Any]:
    """Write ``model`` as a transformers model folder ``out_dir`` (see the module docstring),
    its weights in ``dtype`` (``EXPORT_DTYPES``; ``"source"``: the source config's), with the
    tokenizer files of ``source_dir``. Returns the report, also written as the
    export record ``moestack_export.json``: ``format``, ``out_dir`` and ``source_dir``
    (absolute), ``source_config_sha256`` (of the source's config.json), ``family``,
    ``dtype`` (the weights' dtype name, as in config.json),
    ``run_dir``, ``checkpoint`` and ``checkpoint_sha256`` (what was exported, None when not
    given), ``tokenizer_files``, ``expert_bias_dropped`` ({MoE layer: max |bias|}) and
    ``expert_bias_folded`` (the layers whose bias went into the exported routers: always
    empty, no supported family has a place for it); the report alone adds ``files`` (what
    the folder holds). docs/hf.md describes each key.

    Refused, in one MoestackError line, before anything is written: an ``out_dir`` that is
    the source folder, ``run_dir`` or a folder above either; an existing non-empty
    ``out_dir`` unless ``overwrite`` and it carries an export record (it is then replaced
    whole, only once the new export is complete); weights holding NaN/inf, naming them,
    unless ``allow_nonfinite``; a disk without room for the export (the bytes needed and
    free), also when it fills up while writing (the partial folder removed)."""
    source, out = export_target(out_dir, source_dir, run_dir, overwrite)
    as_dtype = export_dtype(dtype, source)
    _check_exportable(model, out, checkpoint, allow_nonfinite)
    dropped = expert_bias_report(model)
    report: dict[str, Any] = {
        **export_record(model, out, source, run_dir, checkpoint),
        "checkpoint_sha256": checkpoint_sha256,
        "dtype": dtype_name(as_dtype),
        "expert_bias_dropped": dropped,
        "expert_bias_folded": {},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    needed = [0]  # the export's bytes, once known (named by a full disk's error)
    tmp = temp_dir(out)
    try:
        _save_weights(model, tmp, source, as_dtype, max_shard_size, needed)
        report["tokenizer_files"] = _copy_tokenizer(source, tmp)
        (tmp / REPORT_FILE).write_text(json.dumps(report, indent=1) + "\n")
        report["files"] = sorted(f.name for f in tmp.iterdir())
        install_dir(tmp, out)  # every file flushed to disk, then renamed into place
    except BaseException as err:
        _remove_partial(err, tmp, out, needed[0])
        raise
    warn_dropped(dropped)
    log.info("exported %s model to %s", model.info["family"], out)
    return report
