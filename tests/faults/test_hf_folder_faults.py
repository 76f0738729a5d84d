"""Fault injection on transformers model folders, on runs of them, and on their export:
every fault ends as one line from the command line (exit status 2, no traceback) naming
the file and the tensor (or the folder), never as a silent result.

Faults: a truncated shard, a wrongly shaped expert tensor, a shard index naming files
outside the folder, NaN expert weights (in a folder, and in a run's checkpoint re-signed so
it verifies), a folder without tokenizer files, a full disk while exporting, and a newest
checkpoint without its meta.json.
"""

from __future__ import annotations

import errno
import hashlib
import json
import shutil
import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from helpers.hf import hf_config, tiny_hf_model_dir  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from moestack import checkpoint, checkpoint_format, cli  # noqa: E402
from moestack.errors import MoestackError  # noqa: E402
from moestack.trainer import train  # noqa: E402

pytestmark = pytest.mark.faults

SMALL = ["--batches", "1", "--max-bytes", "100000"]
EXPERT = "model.layers.1.mlp.experts.2.up_proj.weight"  # a per-expert tensor of qwen3_moe


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A tiny Qwen3-MoE folder (read-only: copy it to change it)."""
    return tiny_hf_model_dir(tmp_path_factory.mktemp("hf"), "qwen3_moe")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    """A tiny Mixtral folder in several shards with an index (read-only)."""
    return tiny_hf_model_dir(tmp_path_factory.mktemp("hf"), "mixtral", max_shard_size="40KB")


@pytest.fixture(scope="module")
def run(folder, tmp_path_factory) -> Path:
    """A run of the folder's model: routers trained 2 steps, a checkpoint at each (read-only)."""
    root = tmp_path_factory.mktemp("run")
    cfg = hf_config(folder, root, steps=2, ckpt_every=1, trainable="routers+experts")
    train(cfg, root / "run")
    return root / "run"


def copy(source: Path, tmp_path: Path, name: str = "m") -> Path:
    shutil.copytree(source, tmp_path / name)
    return tmp_path / name


def refused(capsys, fault_report, kind: str, *argv: str) -> str:
    """Run ``moestack ARGV``; it must end with exit status 2 and one error line, which is
    returned (the fault is counted in the fault report)."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(list(argv))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    fault_report.add(f"transformers folder: {kind}", injected=1, refused=1)
    return lines[0]


def rewrite(file: Path, change) -> None:
    """Load the safetensors ``file``, let ``change`` edit the tensors, save it back."""
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.mark.parametrize("offload", [False, True], ids=["in memory", "offloaded"])
def test_truncated_shard_names_the_file_and_tensor(folder, tmp_path, capsys, fault_report,
                                                   offload):  # fmt: skip
    path = copy(folder, tmp_path)
    weights = path / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size - 1000)
    line = refused(capsys, fault_report, "truncated shard", "eval", str(path), *SMALL,
                   *(["--offload"] if offload else []))  # fmt: skip
    assert str(weights) in line and "truncated: tensor model.layers.1." in line


def test_truncated_second_shard_of_a_sharded_folder(sharded, tmp_path, capsys, fault_report):
    path = copy(sharded, tmp_path)
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    last = sorted(set(index.values()))[-1]
    with open(path / last, "r+b") as f:
        f.truncate((path / last).stat().st_size // 2)
    line = refused(capsys, fault_report, "truncated shard", "eval", str(path), *SMALL, "--offload")
    assert str(path / last) in line and "truncated: tensor" in line


@pytest.mark.parametrize("offload", [False, True], ids=["in memory", "offloaded"])
def test_wrongly_shaped_expert_tensor_names_the_file_and_tensor(
    folder, tmp_path, capsys, fault_report, offload
):
    path = copy(folder, tmp_path)
    rewrite(path / "model.safetensors", lambda t: t.update({EXPERT: torch.zeros(16, 31)}))
    line = refused(capsys, fault_report, "wrongly shaped expert", "eval", str(path), *SMALL,
                   *(["--offload"] if offload else []))  # fmt: skip
    assert str(path / "model.safetensors") in line and EXPERT in line
    assert "(16, 31)" in line and "(16, 32)" in line  # [d_ff, d_model] of the tiny config


@pytest.mark.parametrize("where", ["parent", "absolute"])
@pytest.mark.parametrize("offload", [False, True], ids=["in memory", "offloaded"])
def test_index_naming_files_outside_the_folder_is_refused(
    folder, tmp_path, capsys, fault_report, where, offload
):
    """The weights moved beside the folder, the index pointing at them there: following
    it would load (or write the expert store from) a file outside the folder."""
    path = copy(folder, tmp_path)
    outside = tmp_path / "outside.safetensors"
    shutil.move(path / "model.safetensors", outside)
    name = "../outside.safetensors" if where == "parent" else str(outside)
    keys = list(load_file(outside))
    index = {"metadata": {}, "weight_map": dict.fromkeys(keys, name)}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    line = refused(capsys, fault_report, "shard index leaving the folder", "eval", str(path),
                   *SMALL, *(["--offload"] if offload else []))  # fmt: skip
    assert "model.safetensors.index.json" in line and repr(name) in line and "outside" in line
    assert not (tmp_path / "m.experts").exists()  # no expert store written from it


@pytest.mark.parametrize("offload", [False, True], ids=["in memory", "offloaded"])
def test_per_expert_and_fused_experts_in_one_folder_are_refused(
    folder, tmp_path, capsys, fault_report, offload
):
    """Layer 1's experts stored twice, per expert and fused (transformers 5's in-memory
    layout), with different values: transformers' loader ends in an AttributeError, the
    offloaded path would serve one of the two (or a mix). Refused naming one of each."""
    path = copy(folder, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    E, D, F = cfg["num_local_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"]
    gen = torch.Generator().manual_seed(0)
    fused = {
        "model.layers.1.mlp.experts.gate_up_proj": torch.randn(E, 2 * F, D, generator=gen),
        "model.layers.1.mlp.experts.down_proj": torch.randn(E, D, F, generator=gen),
    }
    rewrite(path / "model.safetensors", lambda t: t.update(fused))
    line = refused(capsys, fault_report, "per-expert and fused experts in one folder", "eval",
                   str(path), *SMALL, *(["--offload"] if offload else []))  # fmt: skip
    assert str(path / "model.safetensors") in line
    assert "per expert (model.layers.1.mlp.experts.0.down_proj.weight)" in line
    assert "fused (model.layers.1.mlp.experts.down_proj)" in line
    assert not (tmp_path / "m.experts").exists()  # no expert store written from it


@pytest.mark.parametrize("offload", [False, True], ids=["in memory", "offloaded"])
def test_nan_expert_weights_in_a_folder(folder, tmp_path, capsys, fault_report, offload):
    path = copy(folder, tmp_path)

    def poison(tensors):
        tensors[EXPERT][0, 0] = float("nan")

    rewrite(path / "model.safetensors", poison)
    mode = ["--offload"] if offload else []
    line = refused(capsys, fault_report, "NaN expert weights", "eval", str(path), *SMALL, *mode)
    assert str(path) in line and "NaN/inf" in line and "--allow-nonfinite" in line
    # moestack's name of the tensor: decoder layer 1's experts, expert 2 (its up projection)
    assert ("layers.1.mlp.moe.w1" if not offload else "moe_layers.1.w1") in line
    assert "(experts [2])" in line
    # let through, the NaN reaches the loss: a non-finite loss is refused, not printed
    line = refused(capsys, fault_report, "NaN validation loss", "eval", str(path), *SMALL, *mode,
                   "--allow-nonfinite")  # fmt: skip
    assert "validation loss is nan" in line and str(path) in line


def resign(ckpt: Path) -> None:
    """Record the checkpoint's current model.safetensors in its meta.json (size, sha256,
    and meta.json's own digest), as a tool that rewrites checkpoints would: it verifies."""
    meta = json.loads((ckpt / checkpoint.META_FILE).read_text())
    weights = ckpt / checkpoint.MODEL_FILE
    meta["sizes"][checkpoint.MODEL_FILE] = weights.stat().st_size
    meta["sha256"][checkpoint.MODEL_FILE] = hashlib.sha256(weights.read_bytes()).hexdigest()
    meta[checkpoint.SELF_DIGEST] = checkpoint_format.meta_digest(meta)
    (ckpt / checkpoint.META_FILE).write_text(json.dumps(meta, indent=2))
    checkpoint.verify_checkpoint(ckpt)  # it does verify


@pytest.fixture
def nan_run(run, tmp_path) -> Path:
    """A copy of ``run`` whose newest checkpoint holds a NaN in expert 1 of MoE layer 0,
    re-signed."""
    path = copy(run, tmp_path, "run")
    ckpt = checkpoint.latest_checkpoint(path / "checkpoints")

    def poison(tensors):
        tensors["hf.model.layers.0.mlp.moe.w1"][1, 0, 0] = float("nan")

    rewrite(ckpt / checkpoint.MODEL_FILE, poison)
    resign(ckpt)
    return path


def test_nan_checkpoint_is_not_exported(nan_run, tmp_path, capsys, fault_report, caplog):
    out = tmp_path / "exported"
    line = refused(capsys, fault_report, "NaN checkpoint exported", "export", str(nan_run),
                   str(out))  # fmt: skip
    assert "step_000002" in line and "hf.model.layers.0.mlp.moe.w1 (experts [1])" in line
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    with caplog.at_level("WARNING"):
        cli.main(["export", str(nan_run), str(out), "--allow-nonfinite"])
    assert "NaN/inf" in caplog.text and (out / "config.json").is_file()


@pytest.mark.parametrize("offload", [False, True], ids=["in memory", "offloaded"])
def test_nan_checkpoint_is_not_evaluated(nan_run, capsys, fault_report, offload):
    line = refused(capsys, fault_report, "NaN checkpoint evaluated", "eval", str(nan_run),
                   *SMALL, *(["--offload"] if offload else []))  # fmt: skip
    assert "step_000002" in line and "NaN/inf" in line
    assert ("layers.0.mlp.moe.w1" if not offload else "moe_layers.0.w1") in line


def test_folder_without_tokenizer_files(folder, tmp_path, capsys, fault_report):
    path = copy(folder, tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).unlink()
    line = refused(capsys, fault_report, "no tokenizer files", "eval", str(path), *SMALL)
    assert str(path) in line and "no tokens" in line and "tokenizer.json" in line
    with pytest.raises(MoestackError, match="no usable tokenizer"):  # nor is it trained on
        train(hf_config(path, tmp_path, steps=1, ckpt_every=0), tmp_path / "run")


def full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_full_disk_while_exporting(run, tmp_path, capsys, fault_report, monkeypatch):
    import transformers.modeling_utils

    out = tmp_path / "exports" / "out"
    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full_disk)
    line = refused(capsys, fault_report, "full disk while exporting", "export", str(run),
                   str(out))  # fmt: skip
    assert f"no space left on the device of {out.parent}" in line
    assert "needs about" in line and "free" in line
    assert list(out.parent.iterdir()) == []  # the partial folder is removed


def test_full_disk_keeps_the_earlier_export(run, tmp_path, capsys, fault_report, monkeypatch):
    import transformers.modeling_utils

    out = tmp_path / "out"
    cli.main(["export", str(run), str(out)])
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full_disk)
    line = refused(capsys, fault_report, "full disk while re-exporting", "export", str(run),
                   str(out), "--overwrite")  # fmt: skip
    assert "no space left" in line
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_too_little_space_is_refused_before_writing(run, tmp_path, capsys, fault_report,
                                                    monkeypatch):  # fmt: skip
    """The export's size is known in advance: a disk with less free is refused before
    anything is written, naming the bytes needed and free."""
    import transformers.modeling_utils

    written = []
    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file",
                        lambda *a, **k: written.append(a))  # fmt: skip
    monkeypatch.setattr(shutil, "disk_usage", lambda p: types.SimpleNamespace(free=1000))
    line = refused(capsys, fault_report, "too little space to export", "export", str(run),
                   str(tmp_path / "out"))  # fmt: skip
    assert "no space left" in line and "0.0 MiB free" in line and "needs about 0.2 MiB" in line
    assert written == [] and sorted(p.name for p in tmp_path.iterdir()) == []


def test_newest_checkpoint_without_meta_is_said(run, tmp_path, capsys, caplog):
    """The newest checkpoint lost its meta.json: eval uses the older one and says so."""
    path = copy(run, tmp_path, "run")
    (path / "checkpoints" / "step_000002" / checkpoint.META_FILE).unlink()
    with caplog.at_level("WARNING"):
        cli.main(["eval", str(path), *SMALL])
    result = json.loads(capsys.readouterr().out)
    assert result["checkpoint"].endswith("step_000001")
    assert "step_000002" in caplog.text and "step_000001" in caplog.text
