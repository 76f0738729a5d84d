"""The wheel: built from a copy of the source without setuptools warnings, it carries every
config and the pre-registered studies with their locks, and installed into a fresh venv it
runs ``moestack-train --cfg job``. Offline: no build isolation, no index, no dependencies
fetched (the fresh venv reuses this one's packages through a .pth file)."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from helpers.paths import REPO

import moestack

SOURCES = ["pyproject.toml", "README.md", "LICENSE", "moestack", "kernels", "telemetry"]
SOURCES += ["configs", "experiments"]


def run(*args: str | Path, cwd: Path | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # no checkout on the path
    done = subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, cwd=cwd, timeout=180, env=env
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """(the wheel, pip's build log) from a copy of the sources (the checkout stays clean)."""
    tmp = tmp_path_factory.mktemp("build")
    src = tmp / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc")
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore)
        else:
            src.mkdir(exist_ok=True)
            shutil.copy2(path, src / name)
    log = run(
        sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation",
        "--no-index", "-w", tmp / "dist", src,
    )  # fmt: skip
    (found,) = (tmp / "dist").glob("moestack-*.whl")
    return found, log


def test_the_build_log_has_no_setuptools_warnings_about_configs(wheel):
    _, log = wheel
    assert "absent from the `packages` configuration" not in log
    assert "would be ignored" not in log
    warnings = [line for line in log.splitlines() if "Warning" in line]
    assert not [w for w in warnings if "configs" in w or "experiments" in w], warnings


def test_the_wheel_carries_configs_studies_locks_and_the_license(wheel):
    path, _ = wheel
    with zipfile.ZipFile(path) as whl:
        names = set(whl.namelist())
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(whl.read(info).decode())
    for group in ("model", "router", "optim", "data", "cache", "telemetry"):
        assert any(n.startswith(f"moestack/configs/{group}/") for n in names), group
    assert "moestack/configs/train.yaml" in names
    assert not any(n.startswith("moestack/configs/experiment") for n in names)
    for name in ("prereg_cpu.yaml", "prereg_cpu.yaml.lock.json", "prereg_137m.yaml"):
        assert f"moestack/experiments/{name}" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert meta["Version"] == moestack.__version__
    assert meta["License-Expression"] == "Apache-2.0"
    requires = meta.get_all("Requires-Dist")
    assert not [r for r in requires if r.startswith("triton") and "extra ==" not in r]
    assert any(r.lower().startswith("pyyaml") for r in requires)
    assert any(r.startswith("torch>=") for r in requires)


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory):
    """A fresh venv with the wheel installed; its other packages come from this venv."""
    root = tmp_path_factory.mktemp("venv") / "env"
    run(sys.executable, "-m", "venv", "--without-pip", root)
    python = root / "bin" / "python"
    purelib = run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    (Path(purelib.strip()) / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run(
        sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
        wheel[0],
    )  # fmt: skip
    return root


def test_the_installed_wheel_composes_a_run(venv, tmp_path):
    where = run(
        venv / "bin" / "python", "-c", "import moestack; print(moestack.__file__)", cwd=tmp_path
    )
    assert where.strip().startswith(str(venv))  # the wheel's copy, not the checkout
    out = run(venv / "bin" / "moestack-train", "--cfg", "job", "model=small", cwd=tmp_path)
    assert "d_model: 256" in out and "steps: 300" in out
    assert run(venv / "bin" / "moestack", "--version").strip() == f"moestack {moestack.__version__}"


def test_the_installed_study_verifies_against_its_lock(venv, tmp_path):
    script = (
        "import json, moestack.experiments as e; from pathlib import Path; "
        "from moestack import prereg; "
        "r = prereg.verify(Path(e.__file__).parent / 'prereg_cpu.yaml'); "
        "print(json.dumps({'study': r['study'], 'path': r['path']}))"
    )
    record = json.loads(run(venv / "bin" / "python", "-c", script, cwd=tmp_path).splitlines()[-1])
    assert record["study"] == "prereg_cpu" and record["path"].startswith(str(venv))
