"""What an export killed midway leaves beside OUT, and how the next export to OUT cleans it
up: the writer's ``.OUT.tmp-PID`` and ``.OUT.old-PID`` folders of processes no longer alive
are removed, an ``.old`` whose OUT is missing (a kill between the two renames of
``--overwrite``) is put back first; and every file of an export (or adapter export) is
flushed to disk before the folder is renamed into place."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.faults import dead_pid

pytest.importorskip("transformers")

from moestack.config import LoRAConfig  # noqa: E402
from moestack.errors import MoestackError  # noqa: E402
from moestack.interop.hf_adapter import export_adapter  # noqa: E402
from moestack.interop.hf_export import REPORT_FILE, export_hf  # noqa: E402
from moestack.interop.hf_model import load_hf_moe  # noqa: E402
from moestack.lora import add_adapters  # noqa: E402

# Export the source folder over OUT (--overwrite), the process killing itself (SIGKILL: no
# cleanup runs) right after the old OUT was renamed aside, before the new one is moved in.
_KILLED_BETWEEN_RENAMES = """
import os, signal, sys
from pathlib import Path
from moestack.interop.hf_export import export_hf
from moestack.interop.hf_model import load_hf_moe

source, out = sys.argv[1], Path(sys.argv[2])
model = load_hf_moe(source, impl="torch")
rename = os.rename

def rename_then_die(src, dst):
    rename(src, dst)
    if Path(src) == out:
        os.kill(os.getpid(), signal.SIGKILL)

os.rename = rename_then_die
export_hf(model, out, source_dir=source, overwrite=True)
"""


def _contents(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_a_kill_between_the_renames_of_overwrite_gives_out_back(hf_dir, tmp_path):
    source = hf_dir("qwen3_moe")
    model = load_hf_moe(source, impl="torch")
    out = tmp_path / "out"
    export_hf(model, out, source_dir=source)
    before = _contents(out)
    child = subprocess.Popen([sys.executable, "-c", _KILLED_BETWEEN_RENAMES, str(source), str(out)],
                             stderr=subprocess.PIPE, text=True)  # fmt: skip
    _, err = child.communicate()
    assert child.returncode == -signal.SIGKILL, err[-2000:]
    left = sorted(p.name for p in tmp_path.iterdir())  # the old export aside, the new one too
    assert left == [f".out.old-{child.pid}", f".out.tmp-{child.pid}"]
    # the next export puts the earlier export back first: OUT exists, so it needs --overwrite
    with pytest.raises(MoestackError, match="exists and is not empty"):
        export_hf(model, out, source_dir=source)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert _contents(out) == before
    export_hf(model, out, source_dir=source, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_leftovers_of_dead_writers_are_removed_and_live_ones_kept(hf_dir, tmp_path):
    source = hf_dir("mixtral")
    model = load_hf_moe(source, impl="torch")
    out = tmp_path / "out"
    export_hf(model, out, source_dir=source)
    dead, live = dead_pid(), os.getppid()  # the parent: alive, another process than ours
    names = [f".out.tmp-{dead}", f".out.old-{dead}", f".out.tmp-{live}", f".other.tmp-{dead}"]
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"partial")
    export_hf(model, out, source_dir=source, overwrite=True)
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert kept == sorted(["out", f".out.tmp-{live}", f".other.tmp-{dead}"])
    assert (out / REPORT_FILE).is_file()


def test_an_old_copy_is_put_back_only_where_out_is_missing(hf_dir, tmp_path):
    """A dead writer's ``.old`` beside an existing OUT is stale (OUT is newer): removed."""
    source = hf_dir("olmoe")
    model = load_hf_moe(source, impl="torch")
    export_hf(model, tmp_path / "earlier", source_dir=source)
    dead = dead_pid()
    os.rename(tmp_path / "earlier", tmp_path / f".out.old-{dead}")
    export_hf(model, tmp_path / "out2", source_dir=source)  # another OUT: not touched
    assert (tmp_path / f".out.old-{dead}").is_dir()
    with pytest.raises(MoestackError, match="exists and is not empty"):
        export_hf(model, tmp_path / "out", source_dir=source)
    assert (tmp_path / "out" / REPORT_FILE).is_file()
    (tmp_path / f".out.old-{dead}").mkdir()  # a second, stale copy: OUT is there now
    export_hf(model, tmp_path / "out", source_dir=source, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "out2"]


@pytest.mark.parametrize("kind", ["model", "adapter"])
def test_every_file_is_flushed_before_the_folder_is_moved_in(hf_dir, tmp_path, monkeypatch, kind):
    source = hf_dir("qwen3_moe")
    model = load_hf_moe(source, impl="torch")
    out = tmp_path / "out"
    flushed, renamed = [], []
    fsync, rename = os.fsync, os.rename

    def spy_fsync(fd):
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        if path.is_file() and not renamed:
            flushed.append(path.name)
        return fsync(fd)

    def spy_rename(src, dst):
        if Path(dst) == out:
            renamed.append(dst)
        return rename(src, dst)

    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(os, "rename", spy_rename)
    if kind == "model":
        export_hf(model, out, source_dir=source)
    else:
        add_adapters(model, LoRAConfig(rank=2, targets="both"), seed=0)
        export_adapter(model, out, source_dir=source, rank=2, alpha=4.0, routers=False)
    assert renamed and len(os.listdir(out)) >= 2
    assert sorted(set(flushed)) == sorted(os.listdir(out))
