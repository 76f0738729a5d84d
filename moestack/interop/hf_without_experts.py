"""A transformers MoE model from a local folder with every weight loaded but the routed experts.

Serving a model from the expert cache should never need the whole model in memory: its
routed experts are most of its weights, and the expert store serves them from disk.
``from_pretrained_without_experts(DIR, dtype)`` builds transformers' own model from
``DIR/config.json`` with every parameter on the meta device (no memory, no random init;
buffers such as rotary tables are built as usual), then reads each non-expert tensor from
the folder's safetensors into its parameter (a copy: the file may be rewritten later). The
routed experts stay meta tensors, shape and dtype only: a moestack MoE layer holding them
raises if it is run without an expert cache serving them. Peak host memory is the non-expert
weights plus one tensor being read.

Checkpoint keys are matched to parameter names as transformers writes them: the same name,
or Mixtral's ``block_sparse_moe`` where the model says ``mlp`` (transformers 5 renames it on
load). Tied parameters (``tie_word_embeddings``) are one parameter under two names and are
read once. Persistent buffers found in the checkpoint are read too. A parameter with no
checkpoint tensor, or a tensor of another shape, is an error naming the key (and its file);
checkpoint tensors that match nothing are listed in a warning.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from pathlib import Path

import torch
from torch import nn

from moestack.interop.hf_config import transformers_refusal
from moestack.interop.hf_experts import is_expert_key, key_files
from moestack.meta_load import (
    TensorReader,
    fill_buffers,
    fill_parameters,
    parameters_on_meta,
    resident_bytes,
)

log = logging.getLogger(__name__)

# Checkpoint spellings of a module path that transformers 5 renames on load (model name ->
# checkpoint name): Mixtral's sparse block is ``block_sparse_moe`` on disk, ``mlp`` in memory.
_RENAMES = ((".mlp.", ".block_sparse_moe."), (".block_sparse_moe.", ".mlp."))


def _build_on_meta(folder: Path, dtype: torch.dtype) -> nn.Module:
    """transformers' model for ``folder/config.json``, its parameters on the meta device."""
    import transformers

    with transformers_refusal(f"transformers could not build the model of {folder}"):
        config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
        with parameters_on_meta():
            return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)


def _checkpoint_key(name: str, keys: dict[str, Path]) -> str | None:
    """The checkpoint key holding parameter (or buffer) ``name``: the same name, or its
    Mixtral ``block_sparse_moe`` spelling."""
    if name in keys:
        return name
    for model_part, disk_part in _RENAMES:
        if model_part in name and name.replace(model_part, disk_part) in keys:
            return name.replace(model_part, disk_part)
    return None


def load_non_expert_weights(hf: nn.Module, folder: Path) -> dict[str, int]:
    """Fill every non-expert parameter (and persistent buffer) of ``hf``, built by
    ``_build_on_meta``, from the folder's safetensors. Returns {"tensors", "bytes"} read."""
    keys = key_files(folder)
    with contextlib.ExitStack() as stack:
        reader = TensorReader(keys, stack)
        find = functools.partial(_checkpoint_key, keys=keys)
        used = fill_parameters(hf, reader, find, is_expert_key, folder)
        used |= fill_buffers(hf, reader, find, folder, required=False)
    unread = sorted(k for k in keys if k not in used and not is_expert_key(k))
    if unread:
        log.warning(
            "%s: %d checkpoint tensors match nothing in the model built from config.json and "
            "were not read: %s", folder, len(unread), unread,
        )  # fmt: skip
    return {"tensors": len(used), "bytes": resident_bytes(hf)}


def from_pretrained_without_experts(
    folder: Path, dtype: torch.dtype, *, read: bool = True
) -> nn.Module:
    """transformers' model of ``folder`` with every weight but the routed experts loaded (see
    the module docstring), in eval mode as ``from_pretrained`` returns it; ``read=False``
    reads none of them (every parameter stays meta: a caller fills them from elsewhere, a
    run's checkpoint)."""
    hf = _build_on_meta(folder, dtype)
    if not read:
        return hf.eval()
    read = load_non_expert_weights(hf, folder)
    log.info(
        "%s: read %d checkpoint tensors (the model now holds %.1f MB); routed experts left "
        "on the meta device",
        folder,
        read["tensors"],
        read["bytes"] / 1e6,
    )
    return hf.eval()
