"""A script of scripts/ imported as a module for the tests of its parts."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Iterator
from types import ModuleType

from helpers.paths import SCRIPTS


@contextlib.contextmanager
def script_module(name: str) -> Iterator[ModuleType]:
    """``scripts/NAME.py`` loaded as the module ``NAME``, with scripts/ on the path (its own
    imports of sibling scripts) and itself in ``sys.modules`` (its dataclasses look
    themselves up there); both undone on exit."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(name, None)
        sys.path.remove(str(SCRIPTS))
