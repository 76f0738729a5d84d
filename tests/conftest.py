"""Test-wide settings: Triton kernels run in the interpreter when there is no GPU.

TRITON_INTERPRET must be set before triton decorates any kernel, so it is set here, at
collection time, before any test module imports moestack.kernels.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
