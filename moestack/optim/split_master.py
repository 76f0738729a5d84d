"""The split master weight: fp32 master weights kept as the bf16 weights plus 16-bit
remainders, so that the fused host step writes no separate narrowed copy.

Why: the fused step reads the master weight and writes it back, then writes its bf16 copy
for the device; a byte written costs more than a byte read once the cores load the memory
system (BENCHMARKS.md, issue 20). When every parameter is bf16 and the step runs in one
process, the bf16 weights already live in memory for good: the parameters themselves on the
CPU (``direct`` mode) or the pinned staging buffer on a GPU machine (``staged`` mode). Keeping
only ``lo = bits(x) - bits(hi) << 16`` (int16) beside them holds the fp32 master exactly, in
2 bytes per parameter instead of 4, and the step reads 14 and writes 12 bytes per parameter
where torch's in-place fp32 step reads 16 and writes 12 (see
:func:`moestack.kernels.host_adamw.split_master` for the one rounding case int16 cannot hold).

Checkpoints keep the fp32 ``master`` of the ordinary layout: :func:`joined` builds it for a
save and :func:`load` splits a loaded one, so runs move freely between the two layouts.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from moestack.kernels.host_adamw import join_master, split_master
from moestack.optim.plan import ShardPlan, Unit
from moestack.optim.transfer import HostBuffers


def _units(plan: ShardPlan, pidxs: Sequence[int] | None = None) -> Iterator[Unit]:
    want = None if pidxs is None else set(pidxs)
    for k in plan.my_units:
        u = plan.units[k]
        if want is None or u.pidx in want:
            yield u


def weights(host: HostBuffers, params: Sequence[Tensor], u: Unit, direct: bool) -> Tensor:
    """The bf16 weights of unit ``u``: the parameter's own (direct) or the staging buffer's."""
    if direct:
        return params[u.pidx].data.view(-1)[u.start : u.start + u.numel]
    assert host.staging is not None
    return host.staging[u.off : u.off + u.numel]


@torch.no_grad()
def init(
    host: HostBuffers, plan: ShardPlan, params: Sequence[Tensor], pidxs: list[int], direct: bool
) -> None:
    """Start the master weights of parameters ``pidxs`` at the parameters: remainders 0, and
    in staged mode the parameters copied into the staging buffer."""
    assert host.master is not None
    for u in _units(plan, pidxs):
        host.master[u.off : u.off + u.numel].zero_()
        if not direct:
            src = params[u.pidx].detach().reshape(-1)[u.start : u.start + u.numel]
            weights(host, params, u, direct).copy_(src)


@torch.no_grad()
def joined(host: HostBuffers, plan: ShardPlan, params: Sequence[Tensor], direct: bool) -> Tensor:
    """The fp32 master weights of this rank's units, in the ordinary layout (for a save)."""
    assert host.master is not None
    out = torch.zeros(host.master.numel(), dtype=torch.float32)
    for u in _units(plan):
        lo = host.master[u.off : u.off + u.numel]
        out[u.off : u.off + u.numel] = join_master(weights(host, params, u, direct), lo)
    return out


@torch.no_grad()
def load(
    host: HostBuffers,
    plan: ShardPlan,
    params: Sequence[Tensor],
    master: Tensor,
    pidxs: list[int],
    direct: bool,
) -> None:
    """Split the loaded fp32 ``master`` (ordinary layout) of parameters ``pidxs`` into their
    bf16 weights (written to the parameters or the staging buffer) and the remainders."""
    assert host.master is not None
    for u in _units(plan, pidxs):
        x = master[u.off : u.off + u.numel]
        host.master[u.off : u.off + u.numel] = split_master(x, weights(host, params, u, direct))


def fingerprint(p: Tensor) -> tuple[int, ...]:
    """Three sums of a bf16 weight's bits (all, every 7th, every 13th from the 3rd): equal for
    the same values written back, different for other values but by rare accident."""
    bits = p.detach().reshape(-1).view(torch.int16)
    return tuple(int(b.sum(dtype=torch.int64)) for b in (bits, bits[::7], bits[3::13]))
