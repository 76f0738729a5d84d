"""Data-parallel plumbing for torchrun: process-group set-up, rank info, reductions.

``torchrun --nproc-per-node N -m moestack.train ...`` sets WORLD_SIZE/RANK/LOCAL_RANK; one
process without them is a world of one and nothing here talks to anybody.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

# Imported before any process group exists, on purpose: its collectives default their group
# to ``group.WORLD`` as it is when the module is first imported, and torch imports it lazily
# (the first optimizer built imports torch._dynamo, which imports it). Imported after
# init_process_group, it would hold the default group for the life of the process, and that
# group's gloo threads would outlive it (see close_process_groups).
if dist.is_available():
    import torch.distributed.nn  # noqa: F401

log = logging.getLogger(__name__)

# The name gloo's worker threads run under (ProcessGroupGloo's run loop; Linux shows it in
# /proc/self/task/*/comm). They are joined only when the group's last reference is dropped.
GLOO_WORKER_THREAD = "pt_gloo_runloop"
# How long the threads of a destroyed group get to leave /proc once joined.
THREADS_GONE_WITHIN_S = 2.0


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1


def launch_info(env: Mapping[str, str] | None = None) -> DistInfo:
    """This process's place in its torchrun launch, as torchrun's environment (``env``,
    default ``os.environ``) says, before any process group exists: the one place that reads
    RANK, WORLD_SIZE and LOCAL_RANK (a world of one without them)."""
    env = os.environ if env is None else env
    world_size = int(env.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return DistInfo()
    return DistInfo(int(env.get("RANK", "0")), world_size, int(env.get("LOCAL_RANK", "0")))


def init_from_env(device_type: str) -> DistInfo:
    """Join the process group torchrun describes in the environment (gloo on CPU)."""
    info = launch_info()
    if not info.active:
        return info
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend=backend)
    return info


def all_reduce_mean(value: float, info: DistInfo, device: torch.device) -> float:
    """The mean of a Python number over ranks (itself in a world of one)."""
    if not info.active:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item()) / info.world_size


def gather_objects(value: Any, info: DistInfo) -> list[Any]:
    """``value`` of every rank, in rank order (picklable values; a world of one: [value]).
    Object collectives go through gloo even beside NCCL (the "cpu" backend of the group)."""
    if not info.active:
        return [value]
    values: list[Any] = [None] * info.world_size
    dist.all_gather_object(values, value)
    return values


def refused_ranks(passed: bool, info: DistInfo) -> list[int]:
    """The ranks whose start did not pass its checks; every rank calls it, a refused one
    before it raises (a world of one: [] or [0] without a collective)."""
    return [rank for rank, ok in enumerate(gather_objects(passed, info)) if not ok]


def barrier(info: DistInfo) -> None:
    if info.active:
        dist.barrier()


def shutdown(info: DistInfo) -> None:
    """End this rank's process groups (see :func:`close_process_groups`); warn when a gloo
    worker thread outlives them."""
    if not info.active:
        return
    left = close_process_groups()
    if left:
        log.warning(
            "rank %d: %d gloo worker thread(s) still run after the process groups were "
            "destroyed: something still references a group, and the exit may abort",
            info.rank,
            left,
        )


def close_process_groups() -> int:
    """Destroy every process group, then collect the objects that still referenced one (an
    optimizer, a mesh, often in a reference cycle), so that gloo joins its worker threads
    while Python runs. A worker thread left running into the interpreter's exit frees the
    tensors of finished collectives there, and freeing a Python-owned tensor then takes the
    GIL of a finalizing interpreter: the thread is unwound and the process aborts
    ("terminate called without an active exception"), at random, after a successful run.
    Returns how many gloo worker threads still run (0: every group is gone)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
    deadline = time.monotonic() + THREADS_GONE_WITHIN_S
    while (left := gloo_worker_threads()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return left


def gloo_worker_threads() -> int:
    """How many threads of this process are gloo worker threads (0 without /proc)."""
    count = 0
    tasks = Path("/proc/self/task")
    for task in tasks.iterdir() if tasks.is_dir() else ():
        try:
            name = (task / "comm").read_text().strip()
        except OSError:  # a thread that ended while it was listed
            continue
        count += name == GLOO_WORKER_THREAD
    return count
