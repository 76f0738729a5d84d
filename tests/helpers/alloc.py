"""The peak bytes of tensors a block of code allocates and still holds at once (CPU), counted
from every operator's outputs: a new storage adds its bytes until it is freed."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class PeakAllocated(TorchDispatchMode):
    """``with PeakAllocated() as m: ...``, then ``m.peak``: the most bytes of storages made
    inside the block that were alive at once (inputs' storages and views are not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        inputs = {a.untyped_storage().data_ptr() for a in tree_flatten((args, kwargs or {}))[0]
                  if isinstance(a, torch.Tensor)}  # fmt: skip
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in inputs or ptr in self._seen or storage.nbytes() == 0:
                continue
            self._seen.add(ptr)
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, storage.nbytes(), ptr)
        return out

    def _freed(self, nbytes: int, ptr: int) -> None:
        self.live -= nbytes
        self._seen.discard(ptr)
