"""Triton kernels of moestack: grouped GEMM and fused MoE experts, plus torch references.

Importing this package never needs triton; the kernels import it at their first call and
raise a clear ImportError where it is missing. Under ``TRITON_INTERPRET=1`` (set before the
first kernel call) they run on the CPU, in float32/float16, for tests.
"""

from . import reference
from .gemm import grouped_gemm
from .megablocks_adapter import moe_experts_megablocks
from .moe import moe_experts

__all__ = ["grouped_gemm", "moe_experts", "moe_experts_megablocks", "reference"]
