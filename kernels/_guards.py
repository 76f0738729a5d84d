"""The one check every Triton launch makes of its tensors, shared by the launchers
(``_launch``, ``_persistent``), each of which knows how to tell whether it is interpreted."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def refuse_unlaunchable(tensors: Iterable[torch.Tensor], interpreted: bool) -> None:
    """Refuse, in one line, bf16 under the interpreter (which mishandles it) and non-CUDA
    tensors on a GPU launch."""
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
