"""Triton kernels of moestack: grouped GEMM and fused MoE experts, plus torch references.

Importing this package never needs triton; the kernels import it at their first call and
raise a clear ImportError where it is missing. Under ``TRITON_INTERPRET=1`` (set before the
first kernel call) they run on the CPU, in float32/float16, for tests.
"""

import sys

if __name__ != "moestack.kernels":
    # This folder imported as a top-level `kernels`: the repository root is on sys.path (a
    # checkout's cwd under `python -m`) and a library probed for the PyPI package of that
    # name (transformers imports it to read its version). A second copy of these modules
    # would register the custom ops (moestack::triton_*) again, pointing them at itself; so
    # the name stands for moestack.kernels instead (no __version__: not the PyPI package).
    import importlib

    sys.modules[__name__] = importlib.import_module("moestack.kernels")
else:
    from . import reference
    from .gemm import grouped_gemm
    from .megablocks_adapter import moe_experts_megablocks
    from .moe import moe_experts

    __all__ = ["grouped_gemm", "moe_experts", "moe_experts_megablocks", "reference"]
