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
import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from moestack.errors import MoestackError
from moestack.interop.hf_experts import TensorReader, is_expert_key, key_files

log = logging.getLogger(__name__)

# Checkpoint spellings of a module path that transformers 5 renames on load (model name ->
# checkpoint name): Mixtral's sparse block is ``block_sparse_moe`` on disk, ``mlp`` in memory.
_RENAMES = ((".mlp.", ".block_sparse_moe."), (".block_sparse_moe.", ".mlp."))


# One build at a time: nn.Module.register_parameter is patched for the whole process while a
# model is built, and the patch acts only in the thread that holds this lock.
_BUILD_LOCK = threading.Lock()


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Inside the block, every parameter a module of *this thread* registers is moved to the
    meta device as it is registered (tensors created with ``torch.empty`` are never touched,
    so they cost no memory); buffers stay real, and other threads build modules as usual.
    Builds in several threads take turns; ``nn.Module.register_parameter`` is restored on
    exit."""
    with _BUILD_LOCK:
        register = nn.Module.register_parameter
        owner = threading.get_ident()

        def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
            if param is not None and not param.is_meta and threading.get_ident() == owner:
                param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            register(module, name, param)

        nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
        try:
            yield
        finally:
            nn.Module.register_parameter = register  # type: ignore[method-assign]


def _build_on_meta(folder: Path, dtype: torch.dtype) -> nn.Module:
    """transformers' model for ``folder/config.json``, its parameters on the meta device."""
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
        with parameters_on_meta():
            return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise MoestackError(f"transformers could not build the model of {folder}: {first}") from err


def _checkpoint_key(names: list[str], keys: dict[str, Path]) -> str | None:
    """The checkpoint key holding the parameter known by ``names`` (tied: several)."""
    for name in names:
        if name in keys:
            return name
        for model_part, disk_part in _RENAMES:
            if model_part in name and name.replace(model_part, disk_part) in keys:
                return name.replace(model_part, disk_part)
    return None


def _non_expert_params(hf: nn.Module) -> list[tuple[list[str], nn.Parameter]]:
    """Each distinct non-expert parameter with every name it has (tied weights: several)."""
    names_of: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, param in hf.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
        params[id(param)] = param
    return [
        (names, params[pid])
        for pid, names in names_of.items()
        if not all(is_expert_key(n) for n in names)  # routed experts: same rule as on disk
    ]


def _own_copy(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` in ``dtype`` (floating point only), in memory of its own: a tensor read from
    a memory-mapped safetensors file must not change if the file is rewritten later."""
    if tensor.is_floating_point() and tensor.dtype != dtype:
        return tensor.to(dtype)
    return tensor.clone()


def _read_into(
    hf: nn.Module, names: list[str], param: nn.Parameter, tensor: torch.Tensor, where: str
) -> None:
    """Put ``tensor`` (cast to the parameter's dtype) in place of the meta ``param`` under
    each of its ``names`` (tied weights stay one parameter), checking its shape."""
    if tuple(tensor.shape) != tuple(param.shape):
        raise MoestackError(
            f"{where} has shape {tuple(tensor.shape)}, the model built from config.json "
            f"expects {tuple(param.shape)}; the weights do not match the config"
        )
    loaded = nn.Parameter(_own_copy(tensor, param.dtype), requires_grad=param.requires_grad)
    for name in names:
        owner, _, attr = name.rpartition(".")
        setattr(hf.get_submodule(owner), attr, loaded)


def _read_buffers(hf: nn.Module, reader: TensorReader, keys: dict[str, Path]) -> set[str]:
    """Load the persistent buffers the checkpoint holds (transformers saves them with the
    weights); returns their keys."""
    used = set()
    for name, buf in hf.named_buffers():
        owner, _, attr = name.rpartition(".")
        module = hf.get_submodule(owner)
        key = _checkpoint_key([name], keys)
        if key is None or attr in module._non_persistent_buffers_set:
            continue
        tensor = reader.tensor(key)
        if tuple(tensor.shape) != tuple(buf.shape):
            raise MoestackError(
                f"{keys[key]}: buffer {key} has shape {tuple(tensor.shape)}, the model built "
                f"from config.json expects {tuple(buf.shape)}; the weights do not match the config"
            )
        setattr(module, attr, _own_copy(tensor, buf.dtype))
        used.add(key)
    return used


def load_non_expert_weights(hf: nn.Module, folder: Path) -> dict[str, int]:
    """Fill every non-expert parameter (and persistent buffer) of ``hf``, built by
    ``_build_on_meta``, from the folder's safetensors. Returns {"tensors", "bytes"} read."""
    keys = key_files(folder)
    used: set[str] = set()
    read = {"tensors": 0, "bytes": 0}
    with contextlib.ExitStack() as stack:
        reader = TensorReader(keys, stack)
        for names, param in _non_expert_params(hf):
            key = _checkpoint_key(names, keys)
            if key is None:
                raise MoestackError(
                    f"{folder}: no checkpoint tensor for parameter {names[0]} (looked for "
                    f"{' / '.join(names)}, and Mixtral's block_sparse_moe spelling); the "
                    "weights do not match config.json"
                )
            where = f"{keys[key]}: checkpoint tensor {key}"
            _read_into(hf, names, param, reader.tensor(key), where)
            used.update(k for k in (_checkpoint_key([n], keys) for n in names) if k)  # tied
            read["tensors"] += 1
            read["bytes"] += param.numel() * param.element_size()
        used |= _read_buffers(hf, reader, keys)
    unread = sorted(k for k in keys if k not in used and not is_expert_key(k))
    if unread:
        log.warning(
            "%s: %d checkpoint tensors match nothing in the model built from config.json and "
            "were not read: %s", folder, len(unread), unread,
        )  # fmt: skip
    return read


def from_pretrained_without_experts(folder: Path, dtype: torch.dtype) -> nn.Module:
    """transformers' model of ``folder`` with every weight but the routed experts loaded (see
    the module docstring), in eval mode as ``from_pretrained`` returns it."""
    hf = _build_on_meta(folder, dtype)
    read = load_non_expert_weights(hf, folder)
    log.info(
        "%s: read %d non-expert tensors (%.1f MB); routed experts left on the meta device",
        folder,
        read["tensors"],
        read["bytes"] / 1e6,
    )
    return hf.eval()
