"""The import graph of moestack (kernels, telemetry and configs included) has no circle,
lazy imports counted: ``scripts/lint_imports.py --circles``, part of ``make lint``."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import grimp
from helpers.paths import REPO, SCRIPTS

SCRIPT = SCRIPTS / "lint_imports.py"


def _lint_imports():
    spec = importlib.util.spec_from_file_location("lint_imports", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _graph(*imports: tuple[str, str]) -> grimp.ImportGraph:
    graph = grimp.ImportGraph()
    for importer, imported in imports:
        graph.add_import(importer=importer, imported=imported)
    return graph


def test_a_circle_is_found_and_named_by_its_modules():
    # p.a -> p.b -> p.c -> p.a is a circle (the last import may be a lazy one: it counts);
    # p.d only imports into it, p.e imports itself.
    graph = _graph(
        ("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.d", "p.a"), ("p.e", "p.e"),
        ("p.d", "p.e"),
    )  # fmt: skip
    assert _lint_imports().circles(graph) == [["p.a", "p.b", "p.c"], ["p.e"]]


def test_a_graph_without_a_circle_has_none():
    graph = _graph(("p.a", "p.b"), ("p.a", "p.c"), ("p.b", "p.c"), ("p.d", "p.a"))
    assert _lint_imports().circles(graph) == []


def test_moestack_has_no_import_circle():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--circles"],
        capture_output=True, text=True, cwd=REPO, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
