"""Check the dependency rules (import-linter contracts in pyproject.toml) and that moestack's
import graph has no circle; `make lint` runs it (`--circles`: the circle check alone).

kernels/, telemetry/ and configs/ install as moestack.kernels, moestack.telemetry and
moestack.configs (pyproject's package-dir), a mapping import-linter cannot follow: it walks
the folder of the `moestack` package (and puts the working folder first on sys.path). So the
package is assembled as it installs, in a temporary folder, and checked from there.

An import circle is a set of modules each of which imports the next, the last the first,
counting every import statement: those inside functions too (a lazy import hides a circle
from Python's import system, not from the design). Exit status: 0 when every contract is
kept and there is no circle.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import grimp
from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parent.parent
MAPPED = {"kernels": "kernels", "telemetry": "telemetry", "configs": "configs"}
PACKAGE = "moestack"


def assemble(into: Path) -> None:
    """Copy the package's Python files into ``into/moestack`` with the mapped folders in it."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "moestack", into / "moestack", ignore=ignore)
    for folder, name in MAPPED.items():
        shutil.copytree(ROOT / folder, into / "moestack" / name, ignore=ignore)


def circles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Every import circle of ``graph``: each strongly connected set of two or more modules
    (and each module that imports itself), sorted; the circles in sorted order."""
    imports = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    found = [sorted(group) for group in _strongly_connected(imports) if len(group) > 1]
    found += [[m] for m, targets in imports.items() if m in targets]
    return sorted(found)


def _strongly_connected(edges: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of ``edges`` (node -> nodes), iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(edges.get(root, ())))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            step = next(targets, None)
            if step is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    groups.append(group)
            elif step not in index:
                index[step] = low[step] = len(index)
                stack.append(step)
                on_stack.add(step)
                work.append((step, iter(edges.get(step, ()))))
            elif step in on_stack:
                low[node] = min(low[node], index[step])
    return groups


def report_circles() -> int:
    """Print every circle of the assembled package (on sys.path); 1 if there is one."""
    found = circles(grimp.build_graph(PACKAGE, cache_dir=None))
    for circle in found:
        print(f"import circle of {len(circle)} modules: {', '.join(circle)}", file=sys.stderr)
    return 1 if found else 0


def main(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="moestack-imports-") as tmp:
        assemble(Path(tmp))
        sys.path.insert(0, tmp)
        os.chdir(tmp)  # import-linter puts the working folder first on sys.path
        status = report_circles()
        if "--circles" in argv:
            return status
        return lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True) or status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
