"""Fault injection on the folders written aside (``moestack.atomic``): where OUT is a symbolic
link, replacing it renames the link to ``.OUT.old-PID``; the link must go with the replaced
folder (it was left beside OUT, and the next writer's ``recover_dir`` skipped links). Links
named as a killed writer's leftovers are removed as its folders are, never followed (what they
point to stays), or put back as OUT where the kill came between the two renames."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from helpers.faults import dead_pid

from moestack import atomic

pytestmark = pytest.mark.faults


def written(tmp: Path, text: str) -> Path:
    (tmp / "data.txt").write_text(text)
    return tmp


def beside(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir())


def test_replacing_a_linked_out_leaves_no_old_link(tmp_path, fault_report):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "data.txt").write_text("before")
    out = tmp_path / "work" / "OUT"
    out.parent.mkdir()
    out.symlink_to(target, target_is_directory=True)
    atomic.install_dir(written(atomic.temp_dir(out), "after"), out)
    assert beside(out) == ["OUT"], beside(out)
    assert not out.is_symlink() and (out / "data.txt").read_text() == "after"
    assert (target / "data.txt").read_text() == "before"  # the link's folder stays untouched
    fault_report.add("aside links: replaced OUT a symbolic link", injected=1, recovered=1)


def test_a_dangling_link_at_out_is_replaced(tmp_path, fault_report):
    out = tmp_path / "OUT"
    out.symlink_to(tmp_path / "gone", target_is_directory=True)
    atomic.install_dir(written(atomic.temp_dir(out), "new"), out)
    assert beside(out) == ["OUT"] and (out / "data.txt").read_text() == "new"
    fault_report.add("aside links: replaced OUT a symbolic link", injected=1, recovered=1)


@pytest.mark.parametrize("kind", ["tmp", "old"])
def test_a_killed_writers_links_are_removed_not_followed(tmp_path, fault_report, kind):
    target = tmp_path / "kept"
    target.mkdir()
    (target / "data.txt").write_text("keep me")
    out = tmp_path / "OUT"
    out.mkdir()
    (out / "data.txt").write_text("current")
    left = tmp_path / f".OUT.{kind}-{dead_pid()}"
    left.symlink_to(target, target_is_directory=True)
    dangling = tmp_path / f".OUT.{kind}-{dead_pid()}"
    dangling.symlink_to(tmp_path / "gone")
    atomic.recover_dir(out)
    assert beside(out) == ["OUT", "kept"], beside(out)
    assert (target / "data.txt").read_text() == "keep me"
    assert (out / "data.txt").read_text() == "current"
    fault_report.add("aside links: a killed writer's link", injected=2, recovered=2)


def test_a_killed_replace_of_a_link_puts_the_link_back(tmp_path, fault_report):
    """Killed between the renames while replacing a linked OUT: OUT missing, the link aside
    as a dead process's ``.OUT.old-PID``: the link is put back as OUT."""
    target = tmp_path / "elsewhere"
    target.mkdir()
    out = tmp_path / "OUT"
    (tmp_path / f".OUT.old-{dead_pid()}").symlink_to(target, target_is_directory=True)
    atomic.recover_dir(out)
    assert out.is_symlink() and out.resolve() == target.resolve()
    assert beside(out) == ["OUT", "elsewhere"]
    fault_report.add("aside links: a killed writer's link", injected=1, recovered=1)


def test_a_link_at_this_processs_temp_name_is_replaced(tmp_path, fault_report):
    """A link left at ``.OUT.tmp-PID`` by an earlier process that had this PID: the new
    temporary folder takes its place (was FileExistsError)."""
    target = tmp_path / "elsewhere"
    target.mkdir()
    out = tmp_path / "OUT"
    tmp = tmp_path / f".OUT.tmp-{os.getpid()}"
    tmp.symlink_to(target, target_is_directory=True)
    made = atomic.temp_dir(out)
    assert made == tmp and made.is_dir() and not made.is_symlink()
    assert list(target.iterdir()) == []
    fault_report.add("aside links: a killed writer's link", injected=1, recovered=1)


def test_a_trace_imported_into_a_linked_empty_folder_leaves_no_link(tmp_path, fault_report):
    """The import's OUT, an empty folder reached through a link, is replaced whole: nothing is
    left beside it, then or at the next import."""
    from moestack.telemetry import import_trace

    ids = (np.arange(2 * 50 * 2) % 8).reshape(2, 50, 2).astype(np.int16)
    meta = json.dumps({"num_experts": 8, "top_k": 2})
    src = tmp_path / "t.npz"
    np.savez(src, experts=ids, meta=np.array(meta))
    (tmp_path / "empty").mkdir()
    out = tmp_path / "runs" / "trace"
    out.parent.mkdir()
    out.symlink_to(tmp_path / "empty", target_is_directory=True)
    import_trace(src, out)
    assert beside(out) == ["trace"] and not out.is_symlink()
    assert import_trace(src, tmp_path / "runs" / "again").num_tokens == 50
    assert beside(out) == ["again", "trace"]
    fault_report.add("aside links: replaced OUT a symbolic link", injected=1, recovered=1)


def test_a_file_at_this_processs_temp_name_is_replaced(tmp_path, fault_report):
    out = tmp_path / "OUT"
    tmp = tmp_path / f".OUT.tmp-{os.getpid()}"
    tmp.write_text("left by an earlier process with this PID")
    made = atomic.temp_dir(out)
    assert made == tmp and made.is_dir() and list(made.iterdir()) == []
    fault_report.add("aside links: a killed writer's link", injected=1, recovered=1)
