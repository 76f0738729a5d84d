"""The exact row-tile table of a grouped GEMM, built on the device without a host sync.

The persistent kernels (``kernels/_persistent.py``) walk a list of output tiles instead of
searching the expert offsets in every program. Row tile ``i`` of the list covers the sorted
rows ``[row_start[i], min(row_start[i] + block_m, offsets[expert[i]]))`` of one expert:
every expert's rows cut into ``block_m`` chunks, experts in order, experts without rows
owning no tile. The number of tiles depends on the data, so the table is sized by its upper
bound ``cdiv(R, block_m) + E`` (each expert wastes at most one partial tile) and the count
stays on the device, as a one-element tensor that the kernel reads; entries past the count
hold zeros and are never read.

Plain torch ops (cumsum, searchsorted, gathers): no ``.item()``, so building the table
queues work on the GPU and returns at once, and one table can serve every GEMM of a layer
that uses the same ``block_m``. Importing this module needs no triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TileTable:
    """Row tiles of a grouped GEMM: ``expert_T`` and ``row_start_T`` (int32, ``capacity``
    entries each), ``count`` (int32 [1], the valid entries, on the device) and the
    ``block_m`` they were cut with."""

    expert_T: torch.Tensor
    row_start_T: torch.Tensor
    count: torch.Tensor
    block_m: int

    @property
    def capacity(self) -> int:
        """Entries allocated: ``cdiv(R, block_m) + E``, at or above ``count``."""
        return self.expert_T.numel()


def capacity(rows: int, num_experts: int, block_m: int) -> int:
    """The most row tiles ``rows`` sorted rows over ``num_experts`` experts can need."""
    return -(-rows // block_m) + num_experts


def tile_table(offsets_E: torch.Tensor, rows: int, block_m: int) -> TileTable:
    """The row-tile table of ``offsets_E`` (int32 cumulative row ends, ``offsets[-1] ==
    rows``) cut into ``block_m`` chunks, on ``offsets_E``'s device, with no host sync.

    ``rows`` is the host-side row count (the caller knows it from a tensor's shape); it only
    sizes the table. Offsets that do not end at ``rows`` give a wrong table, unchecked here
    (``_launch.assert_offsets`` checks them on the device).
    """
    if block_m <= 0:
        raise ValueError(f"block_m = {block_m} must be positive (a tile height, e.g. 64)")
    if offsets_E.dim() != 1 or offsets_E.numel() == 0:
        raise ValueError(
            f"offsets_E must be a non-empty 1-D tensor of row ends, got shape "
            f"{tuple(offsets_E.shape)}"
        )
    dev = offsets_E.device
    E = offsets_E.numel()
    ends_E = offsets_E.to(torch.int64)
    starts_E = torch.cat([ends_E.new_zeros(1), ends_E[:-1]])
    tiles_E = torch.div(ends_E - starts_E + block_m - 1, block_m, rounding_mode="floor")
    tile_end_E = torch.cumsum(tiles_E, 0)
    cap = capacity(rows, E, block_m)
    t_T = torch.arange(cap, device=dev, dtype=torch.int64)
    # The expert of tile t: the first whose cumulative tile end lies above t. An expert
    # without rows ends where the one before it ends, so no t selects it.
    expert_T = torch.searchsorted(tile_end_E, t_T, right=True)
    valid_T = expert_T < E
    expert_T = torch.where(valid_T, expert_T, 0)
    first_tile_T = tile_end_E[expert_T] - tiles_E[expert_T]
    row_start_T = starts_E[expert_T] + (t_T - first_tile_T) * block_m
    zero = torch.zeros((), dtype=torch.int64, device=dev)
    return TileTable(
        expert_T=torch.where(valid_T, expert_T, zero).to(torch.int32),
        row_start_T=torch.where(valid_T, row_start_T, zero).to(torch.int32),
        count=tile_end_E[-1:].to(torch.int32),
        block_m=block_m,
    )


class TileTables:
    """The tile tables of one set of sorted rows, built at first use, one per ``block_m``,
    and shared by every GEMM over those rows (the GEMMs of one layer call): the table is a
    few small device ops, paid once per call and tile height instead of once per GEMM.

    Nothing is built until a persistent GEMM asks, so the classic kernels pay nothing.
    Every GEMM handed one object must read the rows of ``offsets_E`` (``rows`` of them).
    """

    def __init__(self, offsets_E: torch.Tensor, rows: int) -> None:
        self.offsets_E = offsets_E
        self.rows = rows
        self._tables: dict[int, TileTable] = {}

    def get(self, block_m: int) -> TileTable:
        """The table cut with ``block_m``, built now if no GEMM asked for it before."""
        table = self._tables.get(block_m)
        if table is None:
            table = self._tables[block_m] = tile_table(self.offsets_E, self.rows, block_m)
        return table

    def built(self) -> list[int]:
        """The tile heights whose tables exist (for checks)."""
        return sorted(self._tables)
