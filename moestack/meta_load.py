"""A model built with its parameters on the meta device, then filled from safetensors files,
leaving out the tensors a caller skips (the routed experts, served by the expert cache).

``parameters_on_meta()`` builds without memory or random init: every parameter a module of
this thread registers becomes a meta tensor (shape and dtype only); buffers, such as rotary
tables, are built as usual. ``fill_parameters`` then puts a tensor read from the files in
place of each parameter it is not told to skip, and ``fill_buffers`` reads the persistent
buffers. A tied parameter (one object under several names) is read once and stays one
parameter. Each tensor is copied out of the memory-mapped file (cast to the parameter's
dtype), so rewriting the file later cannot change the model.

Both moestack checkpoints (``moestack.checkpoint``) and transformers model folders
(``moestack.interop.hf_without_experts``) are read this way; each says which checkpoint key
holds a parameter and which parameters are experts.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from moestack.errors import MoestackError

# One build at a time: nn.Module.register_parameter is patched for the whole process while a
# model is built, and the patch acts only in the thread that holds this lock (re-entrant: a
# build inside a build nests its patch and undoes it in order).
_BUILD_LOCK = threading.RLock()


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


class TensorReader:
    """Open safetensors files once each and read one tensor (or one slice) at a time."""

    def __init__(self, keys: dict[str, Path], stack: contextlib.ExitStack) -> None:
        self.keys = keys  # every tensor name and the file holding it
        self.stack = stack
        self.handles: dict[Path, Any] = {}

    def _handle(self, key: str) -> Any:
        file = self.keys[key]
        if file not in self.handles:
            self.handles[file] = self.stack.enter_context(
                safe_open(file, framework="pt", device="cpu")
            )
        return self.handles[file]

    def tensor(self, key: str) -> torch.Tensor:
        return self._handle(key).get_tensor(key)

    def row(self, key: str, index: int) -> torch.Tensor:
        """``tensor[index]`` without reading the rest of the tensor."""
        return self._handle(key).get_slice(key)[index]


def own_copy(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` in ``dtype`` (floating point only), in memory of its own: a tensor read from
    a memory-mapped safetensors file must not change if the file is rewritten later."""
    if tensor.is_floating_point() and tensor.dtype != dtype:
        return tensor.to(dtype)
    return tensor.clone()


def distinct_parameters(module: nn.Module) -> list[tuple[list[str], nn.Parameter]]:
    """Each distinct parameter of ``module`` with every name it has (tied: several)."""
    names_of: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
        params[id(param)] = param
    return [(names, params[pid]) for pid, names in names_of.items()]


def _put(module: nn.Module, names: list[str], param: nn.Parameter, tensor: torch.Tensor) -> None:
    """Put ``tensor`` in place of ``param`` under each of its ``names`` (one parameter)."""
    loaded = nn.Parameter(own_copy(tensor, param.dtype), requires_grad=param.requires_grad)
    for name in names:
        owner, _, attr = name.rpartition(".")
        setattr(module.get_submodule(owner), attr, loaded)


def fill_parameters(
    module: nn.Module,
    reader: TensorReader,
    find_key: Callable[[str], str | None],
    skip: Callable[[str], bool],
    source: Path,
) -> set[str]:
    """Read every parameter of ``module`` that ``skip`` does not name (by any of its names)
    from ``reader``: ``find_key(name)`` gives the checkpoint key of a parameter name, or None.
    A parameter with no key, or a tensor of another shape, is a MoestackError naming the
    parameter, ``source`` and (for a shape) the file. Returns the keys read."""
    used: set[str] = set()
    for names, param in distinct_parameters(module):
        if all(skip(n) for n in names):
            continue
        keys = [k for k in (find_key(n) for n in names) if k is not None]
        if not keys:
            raise MoestackError(
                f"{source}: no checkpoint tensor for parameter {' / '.join(names)}; the "
                "weights do not match the model's config"
            )
        tensor = reader.tensor(keys[0])
        if tuple(tensor.shape) != tuple(param.shape):
            raise MoestackError(
                f"{reader.keys[keys[0]]}: checkpoint tensor {keys[0]} has shape "
                f"{tuple(tensor.shape)}, the model built from its config expects "
                f"{tuple(param.shape)}; the weights do not match the config"
            )
        _put(module, names, param, tensor)
        used.update(keys)
    return used


def fill_buffers(
    module: nn.Module,
    reader: TensorReader,
    find_key: Callable[[str], str | None],
    source: Path,
    *,
    required: bool,
) -> set[str]:
    """Read the persistent buffers of ``module`` from ``reader`` (non-persistent ones, such as
    rotary tables, are never saved). A persistent buffer with no checkpoint key keeps the
    value it was built with, unless ``required`` or it is a meta tensor: then a
    MoestackError names it. Returns the keys read."""
    used: set[str] = set()
    for name, buf in module.named_buffers():
        owner, _, attr = name.rpartition(".")
        holder = module.get_submodule(owner)
        if attr in holder._non_persistent_buffers_set:
            continue
        key = find_key(name)
        if key is None:
            if required or buf.is_meta:
                raise MoestackError(
                    f"{source}: no checkpoint tensor for buffer {name}; the weights do not "
                    "match the model's config"
                )
            continue
        tensor = reader.tensor(key)
        if tuple(tensor.shape) != tuple(buf.shape):
            raise MoestackError(
                f"{reader.keys[key]}: buffer {key} has shape {tuple(tensor.shape)}, the model "
                f"built from its config expects {tuple(buf.shape)}; the weights do not match"
            )
        setattr(holder, attr, own_copy(tensor, buf.dtype))
        used.add(key)
    return used


def materialize(module: nn.Module) -> int:
    """Give every meta parameter and buffer of ``module`` uninitialised CPU memory (a tied
    parameter once, under all its names), for a checkpoint to fill in place. Returns the
    bytes allocated."""
    allocated = 0
    for names, param in distinct_parameters(module):
        if param.is_meta:
            _put(module, names, param, torch.empty(param.shape, dtype=param.dtype))
            allocated += param.numel() * param.element_size()
    for name, buf in list(module.named_buffers()):
        if buf.is_meta:
            owner, _, attr = name.rpartition(".")
            module.get_submodule(owner)._buffers[attr] = torch.empty(buf.shape, dtype=buf.dtype)
            allocated += buf.numel() * buf.element_size()
    return allocated


def resident_bytes(module: nn.Module) -> int:
    """Bytes held by ``module``'s distinct parameters and buffers that are not meta tensors."""
    tensors = {id(t): t for t in (*module.parameters(), *module.buffers()) if not t.is_meta}
    return sum(t.numel() * t.element_size() for t in tensors.values())
