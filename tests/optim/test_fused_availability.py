"""Whether the fused step's native kernel is available, and why not: a missing C++ compiler
(the planned fallback, a warning) told apart from a build, load or self-check that failed
where a compiler is there (an error naming the cause, never a silent "unavailable")."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers.native_kernel import native_kernel

from moestack.kernels import host_adamw, host_build
from moestack.optim import fused

BF16_COMBO = (torch.bfloat16, torch.float32, torch.bfloat16)  # bf16 weights, fp32 moments


@pytest.fixture
def fresh_backends(monkeypatch):
    """Forget which backends this process resolved, and which lines it logged."""
    monkeypatch.setattr(fused, "_STATE", {})
    monkeypatch.setattr(fused, "_WARNED", set())


def test_a_failed_build_is_an_error_not_a_missing_compiler(
    monkeypatch, caplog, tmp_path, fresh_backends
) -> None:
    """A real failed build (CXX names a compiler that does not run) is caught and named in
    the one line, logged as an error: a compiler is configured, so this is a defect."""
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    monkeypatch.setenv("MOESTACK_KERNEL_CACHE", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger="moestack.optim.fused"):
        assert fused.resolve("native", [BF16_COMBO]) is None
    (record,) = caplog.records
    assert record.levelno == logging.ERROR
    assert "no-such-c++" in record.getMessage() and "broken" in record.getMessage()
    assert fused.native_broken() and not fused.native_loads()


def test_a_failed_self_check_is_an_error_not_a_missing_compiler(
    monkeypatch, caplog, fresh_backends
) -> None:
    """A library that builds but computes something else than the formula is not used, and
    says so as an error naming the self-check (a wrong build must not train, nor pass as a
    machine without a compiler)."""
    real = native_kernel()

    def off_by_one_ulp(segs):
        real(segs)
        for s in segs:
            if s.x.dtype == torch.float32 and s.x.numel():
                s.x[0] = torch.nextafter(s.x[0], torch.tensor(float("inf")))

    monkeypatch.setattr(fused, "_STATE", {})
    monkeypatch.setattr(host_adamw, "load", lambda: off_by_one_ulp)
    with caplog.at_level(logging.WARNING, logger="moestack.optim.fused"):
        assert fused.resolve("native", [BF16_COMBO]) is None
    (record,) = caplog.records
    msg = record.getMessage()
    assert record.levelno == logging.ERROR and "self-check failed" in msg, msg
    assert "results differ from the reference formula" in msg
    assert fused.native_broken()
    assert "a broken build: report it" in fused.host_kernel_report()


def test_host_kernel_report_names_the_compiler_and_the_outcome(
    monkeypatch, tmp_path, fresh_backends
) -> None:
    """The environment check's line: the kernel loads, built by the compiler found (its
    version line); a compiler that does not run, or none at all, says why and what falls
    back."""
    native_kernel()
    line = fused.host_kernel_report()
    cxx = host_build.find_compiler()
    assert line.startswith("native host kernel: loads (") and f"compiler {cxx} (" in line
    monkeypatch.setattr(fused, "_STATE", {})
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    monkeypatch.setenv("MOESTACK_KERNEL_CACHE", str(tmp_path / "cache"))
    line = fused.host_kernel_report()
    assert line.startswith("native host kernel: unavailable (RuntimeError: ")
    assert "no-such-c++ (does not run: FileNotFoundError" in line and "serial step" in line
    assert "a broken build: report it" in line
    monkeypatch.setattr(fused, "_STATE", {})
    monkeypatch.setattr(host_build, "find_compiler", lambda: None)
    line = fused.host_kernel_report()
    assert "unavailable (RuntimeError: no C++ compiler" in line
    assert "no C++ compiler found (set CXX, or install g++)" in line and "broken" not in line
    assert not fused.native_broken()
