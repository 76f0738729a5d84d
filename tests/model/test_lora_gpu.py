"""LoRA on the experts on a CUDA device (scripts/gpu_check.sh, kernel_tests phase): both expert
paths with adapters against the float64 reference of tests/model/test_lora.py, on every edge
case, and lora.base_dtype's half-precision experts with fp32 adapters, in bf16 too (which
the Triton interpreter cannot run: on the CPU only fp16 is checked)."""

from __future__ import annotations

import pytest
import torch
from helpers.lora import CASES, check_against_reference, check_half_precision_base

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("case", list(CASES))
def test_adapters_on_cuda_match_the_float64_reference(impl: str, case: str):
    check_against_reference(impl, torch.float32, case, device="cuda")


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("base_dtype", [torch.bfloat16, torch.float16])
def test_half_precision_experts_with_fp32_adapters_on_cuda(impl: str, base_dtype: torch.dtype):
    check_half_precision_base(impl, base_dtype, device="cuda")
