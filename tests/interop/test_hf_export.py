"""export_hf: a transformers folder that from_pretrained loads with moestack's logits."""

from __future__ import annotations

import json
import logging

import pytest
import torch

pytest.importorskip("transformers")

from helpers.hf import FAMILIES, reference_model, sample_tokens  # noqa: E402
from safetensors import safe_open  # noqa: E402

from moestack.config import RouterConfig  # noqa: E402
from moestack.errors import MoestackError  # noqa: E402
from moestack.interop.hf_config import weight_files  # noqa: E402
from moestack.interop.hf_export import REPORT_FILE, export_hf  # noqa: E402
from moestack.interop.hf_model import load_hf_moe  # noqa: E402


def _keys(folder) -> set[str]:
    keys: set[str] = set()
    for file in weight_files(folder):
        with safe_open(file, framework="pt") as f:
            keys.update(f.keys())
    return keys


def _tune(model) -> None:
    """Stand-in for training: move every router and expert (and a shared expert)."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for moe in model.moe_layers:
            for p in (moe.router.weight, moe.w1, moe.w2):
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
        for block in model.blocks:
            if block.shared_expert is not None:
                block.shared_expert.down_proj.weight.mul_(1.5)


@pytest.mark.parametrize("family", FAMILIES)
def test_export_reloads_with_moestack_logits(hf_dir, tmp_path, family):
    source = hf_dir(family)
    model = load_hf_moe(source, impl="torch")
    _tune(model)
    tokens = sample_tokens(model.cfg.doc_separator, batch=2, seq=16)
    with torch.no_grad():
        ours = model(tokens).logits
    report = export_hf(model, tmp_path / "out", source_dir=source)

    exported = reference_model(tmp_path / "out")
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=tokens).logits, ours, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(model(tokens).logits, ours, atol=0, rtol=0)  # still patched
    assert _keys(tmp_path / "out") == _keys(source)  # the family's own key layout
    assert report["family"] == family
    assert report["expert_bias_dropped"] == {} and report["expert_bias_folded"] == {}
    assert {"config.json", "tokenizer.json", REPORT_FILE} <= set(report["files"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary folder left
    for p in model._patched:  # the originals hold no second copy of the weights
        assert p.original.gate.weight.numel() == 0


def test_exported_tokenizer_encodes_as_the_source(hf_dir, tmp_path):
    from transformers import AutoTokenizer

    source = hf_dir("olmoe")
    export_hf(load_hf_moe(source, impl="torch"), tmp_path / "out", source_dir=source)
    text = "def forward(self, x): the quick brown fox"
    want = AutoTokenizer.from_pretrained(source, local_files_only=True)(text)["input_ids"]
    got = AutoTokenizer.from_pretrained(tmp_path / "out", local_files_only=True)(text)
    assert got["input_ids"] == want


def test_expert_bias_is_reported_as_dropped(hf_dir, tmp_path, caplog):
    source = hf_dir("qwen3_moe")
    model = load_hf_moe(source, impl="torch", router=RouterConfig(bias_update_rate=0.01))
    with torch.no_grad():
        model.moe_layers[1].router.expert_bias.copy_(torch.tensor([0.0, 0.3, -0.5, 0, 0, 0]))
    with caplog.at_level(logging.WARNING):
        report = export_hf(model, tmp_path / "out", source_dir=source)
    assert report["expert_bias_dropped"] == {1: 0.5}
    assert "expert_bias" in caplog.text and "layer 1: 0.5" in caplog.text
    saved = json.loads((tmp_path / "out" / REPORT_FILE).read_text())
    assert saved["expert_bias_dropped"] == {"1": 0.5}


def test_existing_folder_refused_unless_overwrite(hf_dir, tmp_path):
    source = hf_dir("mixtral")
    model = load_hf_moe(source, impl="torch")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(MoestackError, match="exists and is not empty"):
        export_hf(model, tmp_path / "busy", source_dir=source, overwrite=True)
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"
    export_hf(model, tmp_path / "out", source_dir=source)
    with pytest.raises(MoestackError, match="overwrite=True"):
        export_hf(model, tmp_path / "out", source_dir=source)
    _tune(model)
    export_hf(model, tmp_path / "out", source_dir=source, overwrite=True)
    tokens = sample_tokens(model.cfg.doc_separator)
    with torch.no_grad():
        got = reference_model(tmp_path / "out")(input_ids=tokens).logits
        torch.testing.assert_close(got, model(tokens).logits, atol=1e-5, rtol=1e-5)
    with pytest.raises(MoestackError, match="is the source model folder"):
        export_hf(model, source, source_dir=source, overwrite=True)


def test_failed_export_leaves_nothing_and_the_model_intact(hf_dir, tmp_path, monkeypatch):
    source = hf_dir("qwen2_moe")
    model = load_hf_moe(source, impl="torch")
    tokens = sample_tokens(model.cfg.doc_separator)
    with torch.no_grad():
        before = model(tokens).logits

    def boom(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(model.hf, "save_pretrained", boom)
    with pytest.raises(MoestackError, match="no space left"):
        export_hf(model, tmp_path / "out", source_dir=source)
    assert list(tmp_path.iterdir()) == []
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, before, atol=0, rtol=0)


def test_export_record_names_the_source_absolutely_with_its_config_digest(
    hf_dir, tmp_path, monkeypatch
):
    """Run from the folder above the source, with relative paths: the record still names the
    source (and the export) by absolute path, and the source's config.json by its sha256."""
    import hashlib
    import shutil

    shutil.copytree(hf_dir("olmoe"), tmp_path / "src")
    monkeypatch.chdir(tmp_path)
    export_hf(load_hf_moe("src", impl="torch"), "out", source_dir="src")
    record = json.loads((tmp_path / "out" / REPORT_FILE).read_text())
    assert record["source_dir"] == str((tmp_path / "src").resolve())
    assert record["out_dir"] == str((tmp_path / "out").resolve())
    want = hashlib.sha256((tmp_path / "src" / "config.json").read_bytes()).hexdigest()
    assert record["source_config_sha256"] == want


def test_every_key_of_the_export_record_is_documented(hf_dir, tmp_path):
    """docs/hf.md names each key of moestack_export.json, and of the printed report."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "hf.md").read_text()
    section = doc[doc.index("### `moestack_export.json`") :]
    report = export_hf(load_hf_moe(hf_dir("olmoe"), impl="torch"), tmp_path / "out",
                       source_dir=hf_dir("olmoe"))  # fmt: skip
    record = json.loads((tmp_path / "out" / REPORT_FILE).read_text())
    missing = [key for key in {*record, *report} if f"| `{key}` |" not in section]
    assert not missing, f"docs/hf.md does not describe {missing}"
