"""A study locked before locks held the code hash pinned its git commit only: its code is that
commit's sources, read from git (``sources.code_files_at_commit``), and ``prereg run`` refuses other
sources as it does for a lock with the code hash (``locking.check_code``)."""

from __future__ import annotations

import hashlib
import logging
import shutil
import subprocess
from pathlib import Path

import pytest

from moestack.errors import MoestackError
from moestack.prereg import hashing, locking, sources

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")

FIRST = {
    "moestack/a.py": b"x = 1\r\nraw = b'\\x00'\n",  # bytes as stored: CR LF kept
    "moestack/sub/b.py": b"y = 2\n",
    "moestack/__pycache__/c.py": b"skipped\n",
    "moestack/kernels/copy.py": b"an installed layout's copy: skipped\n",
    "moestack/notes.md": b"not code\n",
    "kernels/k.py": b"k = 3\n",
    "kernels/host.cpp": b"int f() { return 4; }\n",
    "telemetry/t.py": b"t = 5\n",
    "scripts/s.py": b"not in the package\n",
}
PACKAGE = {  # FIRST's code, as the installed package's paths
    "moestack/a.py": "moestack/a.py",
    "moestack/sub/b.py": "moestack/sub/b.py",
    "kernels/k.py": "moestack/kernels/k.py",
    "kernels/host.cpp": "moestack/kernels/host.cpp",
    "telemetry/t.py": "moestack/telemetry/t.py",
}


def git(repo: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", "-c", "core.autocrlf=false",
         *args], cwd=repo, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return done.stdout.strip()


def commit(repo: Path, files: dict[str, bytes], message: str) -> str:
    for name, data in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_bytes(data)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD")


@pytest.fixture
def repo(tmp_path: Path) -> tuple[Path, str, str]:
    """A checkout with two commits: FIRST, then moestack/a.py edited and a file added."""
    repo = tmp_path / "checkout"
    repo.mkdir()
    git(repo, "init", "-q")
    first = commit(repo, FIRST, "first")
    second = commit(repo, {"moestack/a.py": b"x = 10\n", "telemetry/u.py": b"u = 6\n"}, "second")
    (repo / "experiments").mkdir()
    return repo, first, second


def test_the_code_of_a_commit_is_read_from_git(repo):
    root, first, second = repo
    want = {PACKAGE[n]: hashlib.sha256(FIRST[n]).hexdigest() for n in PACKAGE}
    assert sources.code_files_at_commit(first, str(root / "experiments")) == dict(
        sorted(want.items())
    )
    later = sources.code_files_at_commit(second, str(root))
    assert later["moestack/a.py"] == hashlib.sha256(b"x = 10\n").hexdigest()
    assert later["moestack/telemetry/u.py"] == hashlib.sha256(b"u = 6\n").hexdigest()
    assert hashing.changed_files(want, later) == ["moestack/a.py", "moestack/telemetry/u.py"]
    assert sources.code_files_at_commit("0" * 40, str(root)) is None  # a commit the checkout lacks
    outside = root.parent / "no_git"
    outside.mkdir()
    assert sources.code_files_at_commit(first, str(outside)) is None


def test_a_lock_before_the_code_hash_refuses_other_sources(repo, monkeypatch, caplog):
    """Its commit's sources run; others are refused, naming the files and the commit; where
    git cannot show the commit (or the lock names none), the run goes on with a warning."""
    root, first, _ = repo
    study = root / "experiments" / "study.yaml"
    head = {"git_commit": first, "action": "lock"}  # no "code": locked before the code hash
    at_first = sources.code_files_at_commit(first, str(root))
    monkeypatch.setattr(hashing, "code_files", lambda: at_first)
    assert locking.check_code(study, head) is head
    monkeypatch.setattr(hashing, "code_files", lambda: {**at_first, "moestack/a.py": "0" * 64})
    with pytest.raises(MoestackError, match=rf"moestack/a\.py\).*a checkout of {first[:12]} "):
        locking.check_code(study, head)
    with caplog.at_level(logging.WARNING):
        for unknown in ({"git_commit": "1" * 40}, {"git_commit": "unknown"}, {}):
            assert locking.check_code(study, unknown) is unknown
    assert caplog.text.count("the code is not checked") == 3


def test_git_answers_it_cannot_read_give_none():
    """``git cat-file --batch`` answers "<oid> missing" for an object the checkout lacks (a
    partial clone offline): no code, not a traceback; an answer cut short likewise."""
    whole = b"1a blob 3\nabc\n2b blob 0\n\n"
    want = [hashlib.sha256(b"abc").hexdigest(), hashlib.sha256(b"").hexdigest()]
    assert sources._blob_hashes(whole, 2) == want
    assert sources._blob_hashes(b"1a blob 3\nabc\n2b missing\n", 2) is None
    assert sources._blob_hashes(b"1a blob 30\nabc\n", 1) is None
    with pytest.raises(ValueError):  # no header at all: code_files_at_commit returns None
        sources._blob_hashes(b"", 1)
