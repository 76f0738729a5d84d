"""The one check every Triton launch makes of its tensors, shared by the launchers
(``_launch``, ``_persistent``), each of which knows how to tell whether it is interpreted."""

from __future__ import annotations

import functools
import importlib.metadata
from collections.abc import Iterable

import torch

# The first triton whose interpreter runs under numpy >= 2.4 (3.4-3.6 call int() on
# one-element arrays, which numpy 2.4 refuses; 3.7.1 and 3.8.0 pass the kernel tests).
_INTERPRETER_NUMPY_FIX = (3, 7)


def refuse_unlaunchable(tensors: Iterable[torch.Tensor], interpreted: bool) -> None:
    """Refuse, in one line, bf16 under the interpreter (which mishandles it) and non-CUDA
    tensors on a GPU launch."""
    if interpreted:
        _refuse_broken_interpreter()
    for t in tensors:
        if interpreted:
            if t.dtype == torch.bfloat16:
                raise TypeError(
                    "bfloat16 is not supported under TRITON_INTERPRET=1 (the interpreter "
                    "mishandles it); use float32/float16 on the CPU or a CUDA device"
                )
        elif t.device.type != "cuda":
            raise RuntimeError(
                f"Triton kernels need CUDA tensors (got {t.device}); set TRITON_INTERPRET=1 "
                "before the first kernel call to run them on the CPU (slow, for tests)"
            )


def interpreter_conflict(triton_version: str, numpy_version: str) -> str | None:
    """Why triton ``triton_version``'s interpreter cannot run under numpy ``numpy_version``
    (None: it can)."""
    if _major_minor(triton_version) >= _INTERPRETER_NUMPY_FIX:
        return None
    if _major_minor(numpy_version) < (2, 4):
        return None
    return (
        f"triton {triton_version}'s interpreter (TRITON_INTERPRET=1) fails under numpy "
        f"{numpy_version} (it converts 1-element arrays to scalars, which numpy 2.4 refuses); "
        "install 'numpy<2.4' or triton>=3.7"
    )


@functools.cache
def _refuse_broken_interpreter() -> None:
    """Refuse, once per process, an interpreter that would fail inside every kernel."""
    import triton

    why = interpreter_conflict(triton.__version__, importlib.metadata.version("numpy"))
    if why is not None:
        raise RuntimeError(why)


def _major_minor(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as '3.6.0' or '2.4.0rc1'."""
    parts = version.split(".")
    return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)
