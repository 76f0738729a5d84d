"""The fused host kernel's shared library is loaded only when this user's process built it.

Each test points HOME, XDG_CACHE_HOME, MOESTACK_KERNEL_CACHE and the temporary folder at
tmp_path, so the user's real cache is not touched. Libraries are damaged by writing a new
file over the cached name (a new inode): changing a library this process has loaded, in
place, would change the code it runs. Loads that the damage could crash (a truncated
library: SIGBUS inside dlopen) run in a child process.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from moestack.kernels import host_adamw, host_build
from moestack.kernels.host_adamw import Seg

pytestmark = [
    pytest.mark.faults,
    pytest.mark.skipif(
        not (os.environ.get("CXX") or shutil.which("g++")), reason="needs g++ to build"
    ),
]

ROOT = Path(__file__).resolve().parents[2]
KIND = "host kernel library"  # the surface, in the fault report's kinds
OTHER_UID = 12345
HP = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.95, "weight_decay": 0.1, "eps": 1e-8}
PLANTED = r"""
#include <cstdio>
__attribute__((constructor)) static void planted() {
  if (std::FILE* f = std::fopen("@MARKER@", "w")) std::fclose(f);
}
"""
CHILD = """
import logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(levelname)s %(message)s")
from moestack.kernels import host_adamw, host_build
if "--no-build" in sys.argv:
    def refuse(*args, **kw):
        raise AssertionError("rebuilt")
    host_build._build = refuse
print("PATH", host_adamw.load().path)
"""


@pytest.fixture(scope="module")
def golden(tmp_path_factory) -> Path:
    """A library built (and recorded) by the code under test, in a folder of its own."""
    folder = tmp_path_factory.mktemp("golden")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOESTACK_KERNEL_CACHE", str(folder / "kernels"))
        return host_adamw.load().path


@pytest.fixture
def home(monkeypatch, tmp_path) -> Path:
    """A fresh HOME, no cache variables, temporary folders under tmp_path/tmp."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("MOESTACK_KERNEL_CACHE", raising=False)
    (tmp_path / "tmp").mkdir(mode=0o700)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.setattr(host_build, "_PRIVATE", {}, raising=False)  # folders this process made
    return home


def _seed(folder: Path, golden: Path) -> Path:
    """Copy the golden library and its record into ``folder`` (made 0o700); the copy's path."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    for f in golden.parent.glob(golden.name + "*"):
        shutil.copy2(f, folder / f.name)
    return folder / golden.name


def _planted(tmp_path: Path, marker: Path) -> Path:
    """A library whose constructor creates ``marker`` when it is loaded."""
    src = tmp_path / "planted.cpp"
    src.write_text(PLANTED.replace("@MARKER@", str(marker)))
    lib = tmp_path / "planted.so"
    cxx = os.environ.get("CXX") or "g++"
    subprocess.run([cxx, "-shared", "-fPIC", str(src), "-o", str(lib)], check=True)
    return lib


def _replace(path: Path, data: bytes) -> None:
    """Write ``data`` as a new file at ``path`` (a new inode: see the module docstring)."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(data)
    os.chmod(tmp, 0o700)
    os.replace(tmp, path)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def _assert_steps_like_torch(kernel: host_adamw.NativeKernel) -> None:
    """Two steps of the kernel on small random fp32 tensors against torch.optim.AdamW."""
    gen = torch.Generator().manual_seed(11)
    n = 1000
    x, m, v = torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)
    ref = torch.nn.Parameter(x.clone())
    opt = torch.optim.AdamW(
        [ref], lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
        weight_decay=HP["weight_decay"], foreach=False,
    )  # fmt: skip
    for step in (1, 2):
        g = torch.randn(n, generator=gen)
        kernel([Seg(x, g.clone(), m, v, None, host_adamw.coefficients(HP, step))])
        ref.grad = g
        opt.step()
    state = opt.state[ref]
    torch.testing.assert_close(x, ref.detach(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(m, state["exp_avg"], rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(v, state["exp_avg_sq"], rtol=1e-5, atol=1e-10)


def _assert_recorded(path: Path) -> None:
    """The library is ours alone and its sha256 is the one recorded next to it."""
    st = os.stat(path)
    assert st.st_uid == os.geteuid() and not st.st_mode & 0o022, oct(st.st_mode)
    recorded = path.with_name(path.name + ".sha256").read_text().split()[0]
    assert recorded == hashlib.sha256(path.read_bytes()).hexdigest()


def _child(*args: str) -> subprocess.CompletedProcess:
    """host_adamw.load() in a fresh process with this process's environment; output has the
    warnings it logged and ``PATH <library>``."""
    env = {**os.environ, "TMPDIR": tempfile.gettempdir()}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-c", CHILD, *args], capture_output=True, text=True, env=env, timeout=120
    )


# ------------------------------------------------------------------------------ the tests


@pytest.mark.parametrize("record", ["none", "the real library's"])
def test_library_planted_at_the_cached_name_is_not_loaded(
    record, golden, home, tmp_path, monkeypatch, caplog, fault_report
) -> None:
    """A library at the cached name with no, or another file's, recorded sha256 is never
    dlopen'ed (its constructor does not run): the real kernel is built in its place."""
    cache = tmp_path / "cache"
    path = _seed(cache, golden)
    if record == "none":
        for f in cache.glob("*.sha256"):
            f.unlink()
    marker = tmp_path / "constructor-ran"
    planted = _planted(tmp_path, marker).read_bytes()
    _replace(path, planted)
    monkeypatch.setenv("MOESTACK_KERNEL_CACHE", str(cache))
    with caplog.at_level(logging.INFO, logger="moestack"):
        kernel = host_adamw.load()
    assert not marker.exists()
    assert kernel.path == path and path.read_bytes() != planted
    _assert_recorded(path)
    (warning,) = _warnings(caplog)
    assert str(path) in warning and "sha256" in warning and "\n" not in warning
    _assert_steps_like_torch(kernel)
    fault_report.add(f"{KIND}: planted at the cached name", injected=1, recovered=1)


def test_library_swapped_between_the_check_and_the_load_is_not_loaded(
    golden, home, tmp_path, monkeypatch, fault_report
) -> None:
    """What is loaded is the file that was checked: a library put at the cached name right
    after the check (the window between a check by name and a load by name) never runs."""
    cache = tmp_path / "cache"
    path = _seed(cache, golden)
    marker = tmp_path / "constructor-ran"
    planted = _planted(tmp_path, marker).read_bytes()
    verified = host_build._verified

    def then_swap(p: Path) -> tuple[int, str]:
        got = verified(p)
        _replace(p, planted)
        return got

    monkeypatch.setattr(host_build, "_verified", then_swap)
    monkeypatch.setattr(host_build, "_LOADED", {})  # the golden bytes are loaded: load them again
    monkeypatch.setenv("MOESTACK_KERNEL_CACHE", str(cache))
    kernel = host_adamw.load()
    assert path.read_bytes() == planted and not marker.exists()
    _assert_steps_like_torch(kernel)
    fault_report.add(f"{KIND}: swapped between the check and the load", injected=1, harmless=1)


@pytest.mark.parametrize(
    "how", ["mode 0o777", "another owner", "cannot be created", "a link to a mode 0o777 folder"]
)
def test_cache_folder_others_can_write_is_refused(
    how, golden, home, tmp_path, monkeypatch, caplog, fault_report
) -> None:
    """A cache folder that another user owns or can write (where a library may have been
    planted), or one that cannot be made, is not used: the kernel is built in a private
    folder of this process (not a predictable name under the temporary folder, which may
    have been planted too), with one warning naming the folder and why. A symbolic link is
    followed, and judged by the folder it leads to."""
    marker = tmp_path / "constructor-ran"
    planted = _planted(tmp_path, marker).read_bytes()
    # the old fallback, /tmp/moestack-kernels-<uid>, made by another user with a library in it
    predictable = Path(tempfile.gettempdir()) / f"moestack-kernels-{os.getuid()}"
    _replace(_seed(predictable, golden), planted)
    os.chmod(predictable, 0o777)
    folder = tmp_path / "shared"
    if how == "cannot be created":
        (tmp_path / "file").write_text("")
        folder = tmp_path / "file" / "kernels"
        why = "cannot"
    elif how.startswith("a link"):
        target = tmp_path / "target"
        _replace(_seed(target, golden), planted)
        os.chmod(target, 0o777)
        folder.symlink_to(target)
        why = "writable by group or others"
    else:
        _replace(_seed(folder, golden), planted)
        if how == "mode 0o777":
            os.chmod(folder, 0o777)
            why = "writable by group or others"
        else:
            if os.geteuid() != 0:
                pytest.skip("giving a folder to another user needs root")
            os.chown(folder, OTHER_UID, -1)
            why = f"owned by uid {OTHER_UID}"
    monkeypatch.setenv("MOESTACK_KERNEL_CACHE", str(folder))
    with caplog.at_level(logging.INFO, logger="moestack"):
        kernel = host_adamw.load()
        again = host_adamw.load()  # the same private folder, nothing more logged
    assert not marker.exists()
    private = kernel.path.parent
    assert private not in (folder, folder.resolve(), predictable)
    assert private.parent == Path(tempfile.gettempdir())
    st = os.lstat(private)
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
    assert stat.S_IMODE(st.st_mode) == 0o700
    (warning,) = _warnings(caplog)
    assert str(folder) in warning and why in warning and str(private) in warning
    assert again.path == kernel.path
    _assert_recorded(kernel.path)
    _assert_steps_like_torch(kernel)
    fault_report.add(f"{KIND}: cache folder unsafe or not creatable", injected=1, recovered=1)


@pytest.mark.parametrize("xdg", ["", "relative/cache"])
def test_empty_or_relative_xdg_cache_home_counts_as_unset(
    xdg, golden, home, tmp_path, monkeypatch, caplog, fault_report
) -> None:
    """XDG_CACHE_HOME that is empty or relative (invalid, says the XDG spec) is ignored: the
    cache is ~/.cache/moestack/kernels, and nothing is made in the working folder."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("XDG_CACHE_HOME", xdg)
    _seed(home / ".cache" / "moestack" / "kernels", golden)
    with caplog.at_level(logging.INFO, logger="moestack"):
        kernel = host_adamw.load()
    assert kernel.path.parent == (home / ".cache" / "moestack" / "kernels").resolve()
    assert list(work.iterdir()) == []
    assert _warnings(caplog) == []
    fault_report.add(f"{KIND}: empty or relative XDG_CACHE_HOME", injected=1, harmless=1)


def _truncated(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _flipped(data: bytes) -> bytes:
    i = len(data) // 3
    return data[:i] + bytes([data[i] ^ 0x10]) + data[i + 1 :]


@pytest.mark.parametrize("damage", ["truncated", "flipped byte", "mode 0o777", "another owner"])
def test_damaged_library_is_refused_before_loading_and_rebuilt(
    damage, golden, home, tmp_path, monkeypatch, caplog, fault_report
) -> None:
    """A cached library cut in half (dlopen of it dies of SIGBUS), with one flipped byte,
    that others can write or that another user owns is not loaded: a fresh process says why
    in one line and rebuilds it; the rebuilt kernel steps as torch's AdamW."""
    cache = tmp_path / "cache"
    path = _seed(cache, golden)
    data = path.read_bytes()
    if damage == "truncated":
        _replace(path, _truncated(data))
    elif damage == "flipped byte":
        _replace(path, _flipped(data))
    elif damage == "mode 0o777":
        os.chmod(path, 0o777)
    else:
        if os.geteuid() != 0:
            pytest.skip("giving a file to another user needs root")
        os.chown(path, OTHER_UID, -1)
    damaged = path.read_bytes(), os.stat(path).st_ino
    monkeypatch.setenv("MOESTACK_KERNEL_CACHE", str(cache))
    child = _child()
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
    lines = child.stdout.splitlines()
    assert f"PATH {path}" in lines
    (warning,) = [line for line in lines if line.startswith("WARNING")]
    assert str(path) in warning and "rebuild" in warning
    assert (path.read_bytes(), os.stat(path).st_ino) != damaged
    _assert_recorded(path)
    with caplog.at_level(logging.INFO, logger="moestack"):
        kernel = host_adamw.load()  # the rebuilt library is loaded as it is
    assert kernel.path == path and _warnings(caplog) == []
    _assert_steps_like_torch(kernel)
    fault_report.add(f"{KIND}: damaged or unsafe cached library", injected=1, recovered=1)


def test_cached_library_is_reused_by_a_fresh_process(home, tmp_path, monkeypatch) -> None:
    """The happy path: the first load builds into a 0o700 folder and records the library's
    sha256; a second process loads that same file without rebuilding or warning."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("MOESTACK_KERNEL_CACHE", str(cache))
    kernel = host_adamw.load()
    assert stat.S_IMODE(os.stat(cache).st_mode) == 0o700
    _assert_recorded(kernel.path)
    before = os.stat(kernel.path)
    child = _child("--no-build")
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.splitlines() == [f"PATH {kernel.path}"]
    after = os.stat(kernel.path)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    _assert_steps_like_torch(kernel)
