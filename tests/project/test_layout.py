"""The tests' own layout: each test module sits in the folder of the code it tests (none flat
in tests/ but those waiting to move), no test module imports another (what they share lives
in tests/helpers/ or a conftest.py), and no two test modules share a file name (pytest's
prepend import mode names a module by its file name)."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

from helpers.paths import REPO

TESTS = REPO / "tests"
# Flat until the multi-process tests are settled; then tests/train/ and tests/scripts/.
WAITING_TO_MOVE: set[str] = set()  # flat test modules allowed for now: none


def all_test_modules(tests: Path) -> list[Path]:
    """Every test module under ``tests``."""
    return sorted(tests.rglob("test_*.py"))


def imported_names(path: Path) -> set[str]:
    """Every dotted name ``path`` imports, at any depth of its code: the module of each
    import statement and each name a ``from`` import takes from it."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def imports_of_test_modules(tests: Path) -> list[str]:
    """Each import of a test module by a test module, as 'FILE imports NAME'."""
    stems = {path.stem for path in all_test_modules(tests)}
    found = []
    for path in all_test_modules(tests):
        modules = set()
        for name in imported_names(path):
            parts = name.split(".")
            at = next((i for i, part in enumerate(parts) if part in stems), None)
            if at is not None:
                modules.add(".".join(parts[: at + 1]))
        found += [f"{path.relative_to(tests)} imports {module}" for module in sorted(modules)]
    return found


def flat_test_modules(tests: Path) -> list[str]:
    """The test modules directly in ``tests``, but those waiting to move."""
    return sorted(p.name for p in tests.glob("test_*.py") if p.name not in WAITING_TO_MOVE)


def shared_file_names(tests: Path) -> list[str]:
    """The file names that more than one test module has."""
    counts = Counter(path.name for path in all_test_modules(tests))
    return sorted(name for name, count in counts.items() if count > 1)


def test_no_test_module_imports_another() -> None:
    found = imports_of_test_modules(TESTS)
    assert not found, "move what they share into tests/helpers/: " + "; ".join(found)


def test_test_modules_sit_in_the_folder_of_what_they_test() -> None:
    flat = flat_test_modules(TESTS)
    assert not flat, f"move into the tests/ folder of the code they test: {flat}"
    assert sorted(TESTS.glob("helpers/test_*.py")) == []  # helpers are never collected


def test_no_two_test_modules_share_a_file_name() -> None:
    assert shared_file_names(TESTS) == []
