"""A start refused on two torchrun ranks (gloo, on the CPU) leaves the run folder as it was,
byte for byte: no rank writes before every check passed (no line in train.log on rank 0 or
train.rank1.log on rank 1, no ``.hydra/`` record), and a new folder, with the folders above it,
is never made."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from helpers.cli import TINY_ARGS
from helpers.multiprocess import run_launch

from moestack import checkpoint

TINY = [*TINY_ARGS, "telemetry=off", "wandb_mode=disabled"]


def torchrun(tmp_path: Path, out_dir: Path, *args: str):
    """``torchrun --standalone --nproc-per-node=2 -m moestack.train`` of the tiny run into
    ``out_dir``, in ``tmp_path``; the finished launch."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                "--standalone", "-m", "moestack.train"]  # fmt: skip
    return run_launch(
        [*launcher, *TINY, *args, f"out_dir={out_dir}"],
        f"moestack.train on 2 ranks into {out_dir.name} ({' '.join(args)})",
        cwd=tmp_path,
    )


def tree_of(folder: Path) -> dict[str, bytes | None]:
    """Every path under ``folder``, relative: a file's bytes, None for a folder."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() if p.is_file() else None
            for p in sorted(folder.rglob("*"))}  # fmt: skip


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny run trained by two ranks, its checkpoint written at the end."""
    folder = tmp_path_factory.mktemp("finished")
    done = torchrun(folder, folder / "run")
    assert done.returncode == 0, done.stderr[-3000:]
    assert checkpoint.latest_checkpoint(folder / "run" / "checkpoints") is not None
    assert (folder / "run" / "train.rank1.log").is_file()
    return folder / "run"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["model.d_model=64"], "changed config (model.d_model 32 -> 64)"),  # in the group
        (["model.moe.top_k=8"], "top_k"),  # refused as hydra's config, before any group
    ],
    ids=["changed-config", "bad-value"],
)
def test_a_resume_refused_on_two_ranks_leaves_every_ranks_files_as_they_were(
    finished, tmp_path, args, says
):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    before = tree_of(run)
    done = torchrun(tmp_path, run, *args, "resume=true")
    assert done.returncode != 0
    assert says in done.stderr, done.stderr[-3000:]
    assert tree_of(run) == before  # train.log, train.rank1.log and .hydra/ included


def test_a_start_refused_on_two_ranks_leaves_no_new_folder(tmp_path):
    """Nothing to resume in a new nested folder: neither it nor the folders above it that
    the start made are left; a folder above that was there (tmp_path/keep) stays."""
    (tmp_path / "keep").mkdir()
    done = torchrun(tmp_path, tmp_path / "keep" / "a" / "b" / "run", "resume=true")
    assert done.returncode != 0
    assert "holds no checkpoint" in done.stderr, done.stderr[-3000:]
    assert tree_of(tmp_path / "keep") == {}
