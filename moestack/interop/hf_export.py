"""Write an ``HFMoEModel`` back as a transformers model folder.

``export_hf(model, OUT, source_dir=DIR)`` puts the moestack MoE weights back into the
original transformers blocks (kept aside by ``load_hf_moe``), swaps those blocks into the
model for the time of ``save_pretrained`` (so config.json and the safetensors keys are the
family's own, exactly as transformers writes them), copies the tokenizer files from DIR,
and moves the folder into place atomically (a temporary sibling folder, fsynced, renamed).
``AutoModelForCausalLM.from_pretrained(OUT)`` then gives the moestack model's logits.

The aux-loss-free ``expert_bias`` of a router has no transformers equivalent in the
supported families (their routers have no selection bias), so it cannot be folded: every
layer with a nonzero bias is listed in the report (max |bias|), in ``moestack_export.json``
beside the weights, and in a logged warning; never dropped silently.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moestack.atomic import fsync_dir, install_dir
from moestack.errors import MoestackError
from moestack.interop.hf_config import check_model_dir
from moestack.interop.hf_model import HFMoEModel, release_routed_weights
from moestack.moe import MoE

log = logging.getLogger(__name__)

REPORT_FILE = "moestack_export.json"
_TOKENIZER_PATTERNS = (
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "*.model",
    "*.tiktoken",
    "chat_template*",
)


def _refill(block: nn.Module, moe: MoE) -> None:
    """Put ``moe``'s router and expert weights into the original ``block`` (either layout)."""
    w1, w2 = moe.w1.detach(), moe.w2.detach()
    block.gate.weight.data = moe.router.weight.detach().clone()
    experts = block.experts
    if hasattr(experts, "gate_up_proj"):  # transformers 5.x: [E, 2F, D] and [E, D, F]
        experts.gate_up_proj.data = w1.transpose(1, 2).contiguous()
        experts.down_proj.data = w2.transpose(1, 2).contiguous()
        return
    d_ff = w2.shape[1]
    for e, expert in enumerate(experts):  # 4.x: one MLP per expert (Mixtral: w1/w3/w2)
        if hasattr(expert, "gate_proj"):
            gate, up, down = expert.gate_proj, expert.up_proj, expert.down_proj
        else:
            gate, up, down = expert.w1, expert.w3, expert.w2
        gate.weight.data = w1[e, :, :d_ff].t().contiguous()
        up.weight.data = w1[e, :, d_ff:].t().contiguous()
        down.weight.data = w2[e].t().contiguous()


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


def expert_bias_report(model: HFMoEModel) -> dict[int, float]:
    """Max |expert_bias| of every MoE layer whose router has a nonzero selection bias."""
    out = {}
    for i, moe in enumerate(model.moe_layers):
        peak = float(moe.router.expert_bias.detach().abs().max())
        if peak > 0:
            out[i] = peak
    return out


def _check_target(out: Path, source: Path, overwrite: bool) -> None:
    """``out`` may be missing or empty; an existing model folder only with ``overwrite``."""
    if out.resolve() == source.resolve():
        raise MoestackError(f"export folder {out} is the source model folder; choose another")
    if not out.exists():
        return
    if not out.is_dir():
        raise MoestackError(f"export folder {out} is a file; choose a folder path")
    if any(out.iterdir()) and not (overwrite and (out / "config.json").is_file()):
        raise MoestackError(
            f"export folder {out} exists and is not empty; choose a new folder, or pass "
            "overwrite=True to replace an earlier export (only a model folder is replaced)"
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
    names = sorted(
        {f.name for pattern in _TOKENIZER_PATTERNS for f in source.glob(pattern) if f.is_file()}
    )
    if not names:
        log.warning("%s has no tokenizer files; the export has none either", source)
    for name in names:
        shutil.copy2(source / name, into / name)
    return names


def _fsync_tree(root: Path) -> None:
    """Flush every file under ``root`` and the folders holding them to disk."""
    for folder, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(folder))


def _warn_dropped(dropped: dict[int, float]) -> None:
    if dropped:
        layers = ", ".join(f"layer {i}: {b:.3g}" for i, b in dropped.items())
        log.warning(
            "the routers' aux-loss-free expert_bias has no transformers equivalent in this "
            "family and is not in the export (max |bias| per layer: %s); the exported model "
            "routes as moestack does with router.bias_update_rate=0",
            layers,
        )


def export_hf(
    model: HFMoEModel,
    out_dir: str | Path,
    *,
    source_dir: str | Path,
    overwrite: bool = False,
    max_shard_size: str | int = "5GB",
) -> dict[str, Any]:
    """Write ``model`` as a transformers model folder ``out_dir`` (see the module docstring),
    with the tokenizer files of ``source_dir``. Returns the report: ``out_dir``, ``family``,
    ``files`` (what the folder holds), ``tokenizer_files``, ``expert_bias_dropped``
    ({MoE layer: max |bias|}) and ``expert_bias_folded`` (empty: no supported family has a
    place for it)."""
    source = check_model_dir(source_dir)
    out = Path(out_dir).expanduser()
    _check_target(out, source, overwrite)
    _check_in_memory(model)
    dropped = expert_bias_report(model)
    report: dict[str, Any] = {
        "out_dir": str(out),
        "family": model.info["family"],
        "source_dir": str(source),
        "expert_bias_dropped": dropped,
        "expert_bias_folded": {},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp's 0o700 would make the export private
        with torch.no_grad(), original_blocks(model) as hf:
            hf.save_pretrained(tmp, max_shard_size=max_shard_size)
        report["tokenizer_files"] = _copy_tokenizer(source, tmp)
        (tmp / REPORT_FILE).write_text(json.dumps(report, indent=1) + "\n")
        report["files"] = sorted(f.name for f in tmp.iterdir())
        _fsync_tree(tmp)
        install_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _warn_dropped(dropped)
    log.info("exported %s model to %s", model.info["family"], out)
    return report
