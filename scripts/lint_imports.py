"""Check the dependency rules (import-linter contracts in pyproject.toml); `make lint` runs it.

kernels/, telemetry/ and configs/ install as moestack.kernels, moestack.telemetry and
moestack.configs (pyproject's package-dir), a mapping import-linter cannot follow: it walks
the folder of the `moestack` package (and puts the working folder first on sys.path). So the
package is assembled as it installs, in a temporary folder, and checked from there. Exit status: 0 when every contract is kept.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parent.parent
MAPPED = {"kernels": "kernels", "telemetry": "telemetry", "configs": "configs"}


def assemble(into: Path) -> None:
    """Copy the package's Python files into ``into/moestack`` with the mapped folders in it."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "moestack", into / "moestack", ignore=ignore)
    for folder, name in MAPPED.items():
        shutil.copytree(ROOT / folder, into / "moestack" / name, ignore=ignore)


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="moestack-imports-") as tmp:
        assemble(Path(tmp))
        sys.path.insert(0, tmp)
        os.chdir(tmp)  # import-linter puts the working folder first on sys.path
        return lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True)


if __name__ == "__main__":
    sys.exit(main())
