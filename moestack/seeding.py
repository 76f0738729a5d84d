"""Random initialisation that does not depend on the layout: a generator per tensor.

Why: a model built whole and one whose experts are spread over ranks must start from the same
weights, and a rank that builds only its own experts (on the meta device, then materialised)
cannot draw them from one global stream in build order. So every tensor is drawn from a
generator seeded by (seed, its name), and each routed expert from one seeded by (seed, its
layer's name, its expert id): which process draws a tensor, and what else it draws, changes
nothing. Draws run on the CPU in fp32 (the same numbers on any device and in any dtype).
"""

from __future__ import annotations

import hashlib

import torch


def generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator seeded by (``seed``, ``name``) alone."""
    digest = hashlib.sha256(f"{int(seed)}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


@torch.no_grad()
def normal_(tensor: torch.Tensor, std: float, gen: torch.Generator) -> None:
    """Fill ``tensor`` with Normal(0, ``std``) draws of ``gen`` (drawn in fp32 on the CPU);
    a meta tensor is left as it is (it is drawn when it is materialised)."""
    if tensor.is_meta:
        return
    values = torch.empty(tensor.shape, dtype=torch.float32, device="cpu")
    values.normal_(0.0, std, generator=gen)
    tensor.copy_(values)


def draw_seed() -> int:
    """A seed drawn from torch's global generator: ``torch.manual_seed(s)`` before a build
    without an explicit seed still fixes its weights."""
    return int(torch.randint(0, 2**62, (1,), device="cpu").item())
