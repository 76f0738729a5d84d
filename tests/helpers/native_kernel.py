"""The fused step's native kernel for the tests that need it: they skip only where no C++
compiler exists; where one does, a kernel that does not build, load or pass its bitwise
self-check fails them, naming why (a broken build must not pass as "unavailable")."""

from __future__ import annotations

import pytest

from moestack.kernels import host_adamw, host_build
from moestack.optim import fused


def native_kernel() -> host_adamw.Kernel:
    """The native kernel; skips without a C++ compiler, fails naming the reason when one is
    there and the kernel is unavailable."""
    cxx = host_build.find_compiler()
    if not cxx:
        pytest.skip("no C++ compiler for the native kernel")
    kernel, why = fused.resolve_why("native", host_adamw.ALL_COMBOS)
    assert kernel is not None, (
        f"the C++ compiler {cxx} is there, yet the native kernel is not: {why}"
    )
    return kernel
