"""Shared tiny model folders: each family is built once per test session. (transformers is
optional: each test module here skips itself without it.)"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.hf import tiny_hf_model_dir


@pytest.fixture
def tensor_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The checkpoint keys read through ``moestack.meta_load.TensorReader.tensor`` during the
    test, in order."""
    from moestack.meta_load import TensorReader

    read: list[str] = []
    real = TensorReader.tensor

    def spy(self: TensorReader, key: str):
        read.append(key)
        return real(self, key)

    monkeypatch.setattr(TensorReader, "tensor", spy)
    return read


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``hf_dir(family)``: a saved tiny model folder of ``family`` (read-only: copy it to
    change it)."""
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = tiny_hf_model_dir(tmp_path_factory.mktemp("hf"), family)
        return built[family]

    return get
