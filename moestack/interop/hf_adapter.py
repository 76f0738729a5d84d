"""Write the LoRA adapters of a transformers run alone: ``moestack export RUN OUT --adapter``.

Where the installed peft can hold adapters on expert tensors (``LoraConfig(
target_parameters=...)``, peft >= 0.17, for the transformers 5 layout whose experts are
``gate_up_proj [E, 2F, D]`` and ``down_proj [E, D, F]``), OUT is a peft adapter folder:
``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(SOURCE), OUT)`` gives the
trained model's logits. moestack's expert adapter ``w1 + s * A1 @ B1`` (``A1 [E, D, r]``,
``B1 [E, r, 2F]``) is, in the transformers orientation ``gate_up_proj[e] = w1[e]^T``, the
update ``s * B1[e]^T @ A1[e]^T``, which peft stores as ``lora_A.weight [E r, D]`` (expert e's
rows ``A1[e]^T``) and ``lora_B.weight [2F, r E]`` (column ``i E + e`` is row i of
``B1[e]``, transposed); likewise for ``down_proj``. Attention adapters are peft's own LoRA on
the projection modules (same ``lora_A [r, in]``, ``lora_B [out, r]``), and routers trained
with them (``trainable=routers+lora``) are saved whole (``modules_to_save``).

The peft model is built on the meta device (the base weights are never read), filled with
the adapters, and saved by peft itself. Without a peft that can (or for a layout it cannot
hold), OUT holds ``moestack_adapter.safetensors`` in moestack's names and the record says why.
Either way OUT carries the export record (``moestack_export.json``, ``kind: adapter``), so
``--overwrite`` treats it as any export. peft refuses dropout on expert tensors; dropout acts
only in training, so the adapter is saved with ``lora_dropout=0`` and gives the same logits.
The adapter tensors (and routers saved whole) are written in the export's ``dtype``, as a
model export's weights are (``hf_export.export_dtype``: by default the source config's).
"""

from __future__ import annotations

import importlib.metadata
import inspect
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import nn

from moestack.atomic import install_dir, temp_dir
from moestack.errors import MoestackError
from moestack.interop.hf_export import (
    REPORT_FILE,
    dtype_name,
    expert_bias_report,
    export_dtype,
    export_record,
    export_target,
    warn_dropped,
)
from moestack.interop.hf_model import HFMoEModel
from moestack.lora import adapter_parameters, has_adapters

log = logging.getLogger(__name__)

PEFT_NEEDED = "peft>=0.17 (LoraConfig.target_parameters)"  # what a peft folder of experts needs
MOESTACK_ADAPTER_FILE = "moestack_adapter.safetensors"  # moestack names, when peft cannot


def export_adapter(
    model: HFMoEModel,
    out_dir: str | Path,
    *,
    source_dir: str | Path,
    rank: int,
    alpha: float,
    routers: bool,
    overwrite: bool = False,
    run_dir: str | Path | None = None,
    checkpoint: str | Path | None = None,
    dtype: str = "source",
) -> dict[str, Any]:
    """Write ``model``'s adapters (rank ``rank``, scale ``alpha / rank``; ``routers``: the
    routers trained too), in ``dtype`` (as ``export_hf``'s), as a peft adapter folder, or as
    moestack safetensors where peft cannot hold them; returns the report, also written as
    the export record."""
    source, out = export_target(out_dir, source_dir, run_dir, overwrite)
    as_dtype = export_dtype(dtype, source)
    if not has_adapters(model):
        raise MoestackError(
            f"{run_dir or 'the model'} has no LoRA adapters (trainable=lora or routers+lora "
            "adds them); export the whole model without --adapter"
        )
    why_not = _why_peft_cannot(model)
    report: dict[str, Any] = {
        **export_record(model, out, source, run_dir, checkpoint),
        "kind": "adapter",
        "dtype": dtype_name(as_dtype),
        "adapter_format": "moestack" if why_not else "peft",
        "peft_unavailable": why_not,
        # a peft adapter (or moestack's) has no place for the routers' selection bias either
        "expert_bias_dropped": expert_bias_report(model),
        "expert_bias_folded": {},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir(out)
    try:
        if why_not:
            _write_moestack_adapter(model, tmp, rank, alpha, as_dtype)
        else:
            _write_peft_adapter(model, source, tmp, rank, alpha, routers, as_dtype)
        (tmp / REPORT_FILE).write_text(json.dumps(report, indent=1) + "\n")
        report["files"] = sorted(f.name for f in tmp.iterdir())
        for f in tmp.iterdir():
            f.chmod(0o644)
        install_dir(tmp, out)  # every file flushed to disk, then renamed into place
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed export leaves nothing behind
        raise
    if why_not:
        log.warning("wrote the adapter in moestack's names, not as a peft folder: %s", why_not)
    warn_dropped(report["expert_bias_dropped"])
    return report


def _why_peft_cannot(model: HFMoEModel) -> str | None:
    """None when the installed peft can hold every adapter of ``model``, else why not."""
    try:
        version = importlib.metadata.version("peft")
        from peft import LoraConfig
    except ImportError:
        return f"peft is not installed; a peft adapter of expert tensors needs {PEFT_NEEDED}"
    if "target_parameters" not in inspect.signature(LoraConfig).parameters:
        return f"the installed peft {version} cannot adapt expert tensors; it needs {PEFT_NEEDED}"
    if _expert_adapters(model) and not all(
        hasattr(p.original.experts, "gate_up_proj") for p in model._patched
    ):
        return "this family's experts are one module per expert (the transformers 4 layout)"
    return None


def _expert_adapters(model: HFMoEModel) -> bool:
    return any(moe.expert_adapters() is not None for moe in model.moe_layers)


def _write_moestack_adapter(
    model: HFMoEModel, folder: Path, rank: int, alpha: float, dtype: torch.dtype
) -> None:
    tensors = {name: p.detach().to(dtype).contiguous() for name, p in adapter_parameters(model)}
    safetensors.torch.save_file(tensors, folder / MOESTACK_ADAPTER_FILE,
                                metadata={"rank": str(rank), "alpha": str(alpha)})  # fmt: skip


def _block_paths(model: HFMoEModel) -> list[str]:
    """The transformers name of each sparse-MoE block, in MoE layer order."""
    names = {id(m): n for n, m in model.hf.named_modules()}
    return [f"{names[id(p.parent)]}.{p.name}".lstrip(".") for p in model._patched]


def _write_peft_adapter(
    model: HFMoEModel,
    source: Path,
    folder: Path,
    rank: int,
    alpha: float,
    routers: bool,
    dtype: torch.dtype,
) -> None:
    """Build the peft model of ``source`` on meta, fill its adapters, let peft save it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    blocks = _block_paths(model)
    adapted = [i for i, moe in enumerate(model.moe_layers) if moe.expert_adapters() is not None]
    attention = {
        name.removeprefix("hf."): linear
        for name, linear in model.attention_projections()
        if getattr(linear, "lora_A", None) is not None
    }
    params = [f"{blocks[i]}.experts.{w}" for i in adapted for w in ("gate_up_proj", "down_proj")]
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=0.0,
        target_modules=sorted(attention) or None,
        target_parameters=params or None,
        modules_to_save=[f"{b}.gate" for b in blocks] if routers else None,
        bias="none",
    )
    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source))
    peft_model = get_peft_model(base, config)
    filled = _fill(peft_model, model, blocks, attention, routers, dtype)
    expected = 2 * len(adapted) + len(attention) + (len(blocks) if routers else 0)
    if filled != expected:
        raise RuntimeError(f"filled {filled} peft adapters of {expected}: the layout changed")
    peft_model.save_pretrained(folder)


def _fill(
    peft_model: nn.Module,
    model: HFMoEModel,
    blocks: list[str],
    attention: dict[str, nn.Linear],
    routers: bool,
    dtype: torch.dtype,
) -> int:
    """Put moestack's adapters (and routers) into ``peft_model``'s, as ``dtype``; returns
    how many."""
    moe_of = {path: moe for path, moe in zip(blocks, model.moe_layers, strict=True)}
    filled = 0
    for name, module in peft_model.named_modules():
        path = _base_path(name)
        lora_a = getattr(module, "lora_A", None)
        if isinstance(lora_a, nn.ModuleDict) and "default" in lora_a:
            param_name = getattr(module, "parameter_name", None)
            if param_name is not None:  # a wrapped expert tensor
                moe = moe_of[path.removesuffix(".experts")]
                a, b = _peft_expert_factors(moe, param_name)
            elif path in attention:
                a, b = attention[path].lora_A, attention[path].lora_B
            else:
                continue
            _set(lora_a["default"], a, dtype)
            _set(module.lora_B["default"], b, dtype)
            filled += 1
        elif routers and hasattr(module, "modules_to_save") and path.endswith(".gate"):
            moe = moe_of[path.removesuffix(".gate")]
            _set(module.modules_to_save["default"], moe.router.weight, dtype)
            filled += 1
    return filled


def _base_path(peft_name: str) -> str:
    """A peft module's name as the base model names it (no wrapper segments)."""
    parts = [p for p in peft_name.split(".") if p not in ("base_layer",)]
    return ".".join(parts).removeprefix("base_model.model.")


def _peft_expert_factors(moe: nn.Module, param_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """peft's (lora_A.weight [E r, in], lora_B.weight [out, r E]) of one expert tensor."""
    a, b = {
        "gate_up_proj": (moe.lora_w1_A, moe.lora_w1_B),
        "down_proj": (moe.lora_w2_A, moe.lora_w2_B),
    }[param_name]
    num_experts, d_in, r = a.shape
    lora_a = a.detach().transpose(1, 2).reshape(num_experts * r, d_in)
    lora_b = b.detach().permute(2, 1, 0).reshape(b.shape[2], r * num_experts)
    return lora_a, lora_b


def _set(linear: nn.Module, value: torch.Tensor, dtype: torch.dtype) -> None:
    """``linear.weight`` becomes a real ``dtype`` tensor holding ``value`` (it was built on
    meta)."""
    want = tuple(linear.weight.shape)
    if tuple(value.shape) != want:
        raise RuntimeError(f"adapter of shape {tuple(value.shape)} where peft holds {want}")
    linear.weight = nn.Parameter(value.detach().to(dtype).contiguous().clone())
