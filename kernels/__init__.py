"""The kernels of moestack, one op a file: Triton grouped GEMM and fused MoE experts (gemm,
moe), the torch grouped matmul's custom ops (grouped_mm), the host optimizer steps in C++
(host_adamw, host_tiered; built by host_build from the .cpp beside them), torch references.

Importing this package never needs triton; the kernels import it at their first call and
raise a clear ImportError where it is missing. Under ``TRITON_INTERPRET=1`` (set before the
first kernel call) they run on the CPU, in float32/float16, for tests.
"""

import sys

if __name__ != "moestack.kernels":
    # This folder imported as a top-level `kernels`: the repository root is on sys.path (a
    # checkout's cwd under `python -m`) ahead of site-packages, where transformers (>= 5.25
    # requires it) finds the PyPI package of that name and imports it. That package, where
    # installed, takes this name: found on sys.path without the checkout's root, loaded here
    # and left in sys.modules in this module's place. Where it is not installed, the name
    # stands for moestack.kernels (no __version__: not the PyPI package), never a second copy
    # of these modules that would register the custom ops (moestack::triton_*) again.
    import importlib
    import importlib.machinery
    import importlib.util
    import os

    _checkout = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    _elsewhere = [p for p in sys.path if os.path.realpath(p or os.curdir) != _checkout]
    _spec = importlib.machinery.PathFinder.find_spec(__name__, _elsewhere)
    if _spec is not None and _spec.loader is not None:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules[__name__] = _module
        _spec.loader.exec_module(_module)
    else:
        sys.modules[__name__] = importlib.import_module("moestack.kernels")
else:
    from . import reference
    from .gemm import grouped_gemm
    from .grouped_mm import grouped_mm_torch
    from .megablocks_adapter import moe_experts_megablocks
    from .moe import moe_experts

    __all__ = [
        "grouped_gemm",
        "grouped_mm_torch",
        "moe_experts",
        "moe_experts_megablocks",
        "reference",
    ]
