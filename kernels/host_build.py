"""Building the host kernels (C++ sources beside this file) with the system compiler, at first use.

Each host kernel is one C++ file under kernels/ (``host_adamw.cpp``, ``host_tiered.cpp``),
plain C++ with OpenMP and no torch headers, so it builds in about a second; it is shipped as
package data and loaded with ctypes after torch, resolving ``libgomp.so.1`` to the copy torch
already loaded, so it shares torch's OpenMP runtime. :func:`load_library` builds it with
:data:`FLAGS` (``-march=native``: for this CPU) and loads it.

The library is cached in ``$MOESTACK_KERNEL_CACHE``, else in ``moestack/kernels`` under
``$XDG_CACHE_HOME`` (when absolute) or ``~/.cache``, keyed by the source, the flags, the
compiler and the CPU's flags; ``$CXX`` names the compiler (default ``g++``).

Only a library this user's process built is loaded (:func:`cache_dir`, :func:`_verified`):
the cache folder must belong to this user and be writable by no one else (else the library
is built in a private temporary folder for this process, with one warning), and the
library, opened once and hashed through that descriptor, must be a file of ours alone with
the sha256 recorded next to it (``<library>.sha256``) when it was built; it is loaded through
the same descriptor. One that is not (planted, truncated, flipped, writable by others) is
rebuilt, with one logged line, before anything of it runs. Builds hold the cache folder's
lock, so processes starting together build each library once.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import fcntl
import hashlib
import logging
import os
import platform
import shlex
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from moestack import user_cache

log = logging.getLogger(__name__)

FLAGS = (
    "-O3",
    "-march=native",
    "-fopenmp",
    "-ffp-contract=off",  # no fused multiply-adds: the same roundings as torch's eager ops
    "-fno-math-errno",  # lets sqrt vectorise; IEEE results are unchanged
    "-fPIC",
    "-shared",
    "-std=c++17",
)


def source_of(name: str) -> str:
    """The text of the C++ source ``name`` shipped beside this module (package data)."""
    path = Path(__file__).with_name(name)
    try:
        return path.read_text()
    except OSError as err:
        raise RuntimeError(
            f"the kernel source {path} is missing ({err.strerror}): reinstall moestack"
        ) from None


def load_library(
    source: str, stem: str, extra_flags: Sequence[str] = ()
) -> tuple[ctypes.CDLL, Path]:
    """Build (or find in the cache) the C++ file ``source`` beside this module as
    ``<stem>_<key>.so`` and load it; the library and its path. RuntimeError if impossible.

    Only a library this user's process built is loaded: one that is missing, damaged, planted
    or that others can write is rebuilt first (:func:`_verified`). ``extra_flags`` go after
    :data:`FLAGS` (the tests build the portable loops, without the AVX-512 ones, with
    ``-mno-avx512f``)."""
    cxx = find_compiler()
    if not cxx:
        raise RuntimeError("no C++ compiler (set CXX, or install g++)")
    text = source_of(source)
    flags = (*FLAGS, *extra_flags)
    path = cache_dir() / f"{stem}_{_key(cxx, flags, text)}.so"
    fd, digest = _verified_or_built(cxx, path, flags, text, source)
    return _dlopen(fd, digest), path


def find_compiler() -> str | None:
    """The C++ compiler the kernel is built with: ``$CXX``, else ``g++`` or ``c++`` on the
    PATH; None when there is none."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def compiler_version(cxx: str) -> str:
    """The first line of ``cxx --version``, or why it could not be run."""
    try:
        proc = subprocess.run(
            [*shlex.split(cxx), "--version"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError) as err:
        return f"does not run: {type(err).__name__}: {err}"
    lines = (proc.stdout or proc.stderr).strip().splitlines()
    return lines[0] if lines else f"--version exited with {proc.returncode}"


def is_private(path: Path) -> bool:
    """Whether ``path`` is in a private folder of this process, used in place of a refused
    cache folder (it is removed when the process exits)."""
    return path.parent in _PRIVATE.values()


# ------------------------------------------------------------- the cache and what it holds
# Who may have written a file decides whether it may run in this process: the cache folder
# and each file loaded from it must belong to this user and be writable by no one else, and
# a library's bytes must have the sha256 recorded (in ``<library>.sha256``) when it was built.

_DIGEST_SUFFIX = ".sha256"
_PRIVATE: dict[Path, Path] = {}  # refused cache folder -> this process's private folder
_LOADED: dict[str, ctypes.CDLL] = {}  # sha256 -> the library loaded with those bytes


_Refused = user_cache.NotPrivate  # a cache folder or file not loaded from; says why
_ENV = "MOESTACK_KERNEL_CACHE"


def cache_folder() -> Path:
    """The cache folder the environment names (:func:`moestack.user_cache.cache_folder`):
    ``$MOESTACK_KERNEL_CACHE``, else ``moestack/kernels`` under the user's cache."""
    return user_cache.cache_folder(_ENV, "kernels")


def cache_dir() -> Path:
    """The folder libraries are built in and loaded from: :func:`cache_folder` (resolved)
    when it is this user's alone (:func:`moestack.user_cache.private_folder`), else a private
    folder of this process, with one warning naming the folder refused and why."""
    try:
        folder = cache_folder()
    except _Refused as err:
        raise RuntimeError(f"{err}: set {_ENV}") from None
    if folder in _PRIVATE:
        return _PRIVATE[folder]
    try:
        return user_cache.private_folder(folder)
    except _Refused as err:
        why = str(err)
    try:
        private = Path(tempfile.mkdtemp(prefix="moestack-kernels-"))  # 0o700, a new name
    except OSError as err:
        msg = f"kernel cache {folder} refused ({why}); no private folder: {err}"
        raise RuntimeError(msg) from None
    atexit.register(shutil.rmtree, private, True)
    _PRIVATE[folder] = private
    log.warning(
        "host kernel: kernel cache %s refused (%s; set %s to a folder only this user can "
        "write); building in %s for this process",
        folder,
        why,
        _ENV,
        private,
    )
    return private


def _open_own(path: Path) -> int:
    """``path`` opened to read, not through a symbolic link; FileNotFoundError if missing,
    _Refused unless it is a regular file that is ours alone (``user_cache.not_ours_alone``)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as err:
        why = "a symbolic link" if err.errno == errno.ELOOP else err.strerror
        raise _Refused(f"cannot open {path.name}: {why}") from None
    st = os.fstat(fd)
    problem = (
        "not a regular file" if not stat.S_ISREG(st.st_mode) else user_cache.not_ours_alone(st)
    )
    if problem:
        os.close(fd)
        raise _Refused(f"{path.name} is {problem}")
    return fd


def _sha256_of(fd: int) -> str:
    """The sha256 of the whole file open at ``fd`` (read through it, from the start)."""
    h = hashlib.sha256()
    offset = 0
    while block := os.pread(fd, 1 << 20, offset):
        h.update(block)
        offset += len(block)
    return h.hexdigest()


def _recorded_sha256(path: Path) -> str:
    """The sha256 recorded for the library ``path`` when it was built; _Refused if none."""
    record = path.with_name(path.name + _DIGEST_SUFFIX)
    try:
        fd = _open_own(record)
    except FileNotFoundError:
        raise _Refused(f"no sha256 recorded for it ({record.name} is missing)") from None
    try:
        text = os.pread(fd, 256, 0).decode("ascii", "replace").strip()
    finally:
        os.close(fd)
    if len(text) != 64 or any(c not in "0123456789abcdef" for c in text):
        raise _Refused(f"{record.name} holds no sha256")
    return text


def _verified(path: Path) -> tuple[int, str]:
    """The library ``path`` opened, checked and hashed through one descriptor (so what is
    loaded is what was checked), and its sha256. FileNotFoundError if it is missing;
    _Refused unless it is ours alone and its bytes have the sha256 recorded at build."""
    fd = _open_own(path)
    try:
        recorded = _recorded_sha256(path)
        actual = _sha256_of(fd)
        if actual != recorded:
            raise _Refused(f"its sha256 is not the one recorded when it was built ({recorded})")
    except BaseException:
        os.close(fd)
        raise
    return fd, actual


def _verified_or_built(
    cxx: str, path: Path, flags: Sequence[str], text: str, name: str
) -> tuple[int, str]:
    """:func:`_verified` of ``path``, building the library first where there is none that
    verifies (saying why, in one line, when one is there). The build holds the folder's lock:
    another process that finds the library missing or half-installed waits, then loads it."""
    try:
        return _verified(path)
    except (FileNotFoundError, _Refused):
        pass
    with _locked(path.parent):
        try:
            return _verified(path)
        except FileNotFoundError:
            pass
        except _Refused as err:
            log.warning("host kernel: not loading %s (%s); rebuilding it", path, err)
        _build(cxx, path, flags, text, name)
        try:
            return _verified(path)
        except (FileNotFoundError, _Refused) as err:
            raise RuntimeError(f"{path}: the library just built does not verify: {err}") from None


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """Hold the cache folder's build lock (``.lock`` in it) for the ``with`` block."""
    fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _dlopen(fd: int, digest: str) -> ctypes.CDLL:
    """Load the library open at ``fd`` (checked: :func:`_verified`) through the descriptor,
    ``/proc/self/fd/<fd>``: the file that was checked, not what its name points to by now.
    The descriptor stays open: the dynamic loader knows a library by the name it was loaded
    under, and a closed descriptor's number would name another library later."""
    if digest in _LOADED:  # the same bytes are loaded already
        os.close(fd)
        return _LOADED[digest]
    name = f"/proc/self/fd/{fd}"
    try:
        if not os.path.exists(name):
            raise OSError("no /proc/self/fd to load the checked library through (Linux only)")
        lib = ctypes.CDLL(name)
    except OSError as err:
        os.close(fd)
        raise RuntimeError(f"cannot load the host kernel library: {err}") from None
    _LOADED[digest] = lib
    return lib


def _build(cxx: str, path: Path, flags: Sequence[str], text: str, name: str) -> None:
    """Compile the C++ ``text`` (the source file ``name``) into ``path`` and record its sha256 in ``<path>.sha256``, each moved
    into place whole (mode 0o700 and 0o600); the caller holds the folder's lock."""
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        src = Path(tmp) / name  # the very text hashed into the library's name
        src.write_text(text)
        lib = Path(tmp) / path.name
        try:
            proc = subprocess.run(
                [*shlex.split(cxx), *flags, str(src), "-o", str(lib)],
                capture_output=True,
                text=True,
                timeout=300,
            )
        except (OSError, subprocess.SubprocessError) as err:
            raise RuntimeError(f"{cxx} failed to run: {err}") from err
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise RuntimeError(f"{cxx} exited with {proc.returncode}: {last}")
        digest = _finish(lib, 0o700)
        record = Path(tmp) / (path.name + _DIGEST_SUFFIX)
        record.write_text(digest + "\n")
        _finish(record, 0o600)
        os.replace(lib, path)
        os.replace(record, path.with_name(record.name))
        _fsync_dir(path.parent)
    log.info("host kernel: built %s (sha256 %s)", path, digest)


def _finish(path: Path, mode: int) -> str:
    """Give the new file ``path`` its mode, fsync it and return its sha256."""
    os.chmod(path, mode)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
        return _sha256_of(fd)
    finally:
        os.close(fd)


def _key(cxx: str, flags: Sequence[str], text: str) -> str:
    """A digest of what the library depends on: source, flags, compiler, CPU features."""
    h = hashlib.sha256()
    for part in (text, " ".join(flags), cxx, platform.machine(), _cpu_flags()):
        h.update(part.encode())
        h.update(b"\0")
    try:
        version = subprocess.run(
            [*shlex.split(cxx), "--version"], capture_output=True, text=True, timeout=30
        )
        h.update(version.stdout.encode())
    except (OSError, subprocess.SubprocessError):
        pass  # the build reports a missing compiler
    return h.hexdigest()[:16]


def _cpu_flags() -> str:
    """The CPU's feature flags (``-march=native`` builds for them), or "" where unknown."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _fsync_dir(path: Path) -> None:
    """fsync a directory (its entries), where the filesystem allows it. (kernels/ imports
    nothing of moestack that reaches moestack.errors, so not moestack.atomic.fsync_dir.)"""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some filesystems do not allow opening directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
