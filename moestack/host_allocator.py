"""glibc's heap in processes that must hold no more than their share: freed blocks returned.

Why: glibc serves an allocation of 128 KiB or more from a mapping of its own only until such
a block is freed; then it raises that threshold to the block's size (up to 32 MiB), and later
blocks come from its heaps, which keep what is freed for reuse instead of giving it back. A
process that builds its share of a large model, trains and checkpoints then holds the peak of
every phase's temporaries at once: 0.25 GB above its share per process at ep=4 in
scripts/bench_shards.py (BENCHMARKS.md, "Expert parallelism at scale"). Fixing the threshold
(``mallopt(M_MMAP_THRESHOLD)``, what ``MALLOC_MMAP_THRESHOLD_`` sets) keeps large blocks in
mappings of their own, unmapped when freed. The cost is a system call and fresh page faults
per large allocation, which is why moestack sets it only where the memory matters
(``parallel.host_mmap_threshold_kb``, for expert-parallel runs).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
MAX_THRESHOLD = 32 << 20  # glibc's HEAP_MAX_SIZE / 2 on 64-bit: the largest it accepts
ENV = "MALLOC_MMAP_THRESHOLD_"  # glibc's own setting: where a user set it, it is left alone


def set_mmap_threshold(nbytes: int) -> bool:
    """Give allocations of ``nbytes`` and more their own mappings, returned to the OS when
    freed; True when glibc took it. False (nothing changed) for ``nbytes <= 0``, off
    Linux, without glibc, or where ``MALLOC_MMAP_THRESHOLD_`` is set in the environment."""
    if nbytes <= 0 or not sys.platform.startswith("linux"):
        return False
    if ENV in os.environ:
        log.info("host allocator: %s=%s set in the environment, kept", ENV, os.environ[ENV])
        return False
    if not 0 < nbytes <= MAX_THRESHOLD:
        raise ValueError(f"an mmap threshold of {nbytes} bytes: give 1 to {MAX_THRESHOLD}")
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        log.info("host allocator: no glibc mallopt here; freed blocks stay with the heap")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    taken = mallopt(M_MMAP_THRESHOLD, nbytes) == 1
    if taken:
        log.info("host allocator: blocks of %d KiB and more mapped apart, freed to the OS",
                 nbytes >> 10)  # fmt: skip
    return taken
