"""The transformers workflow from the command line: export a run, evaluate the exported
folder in memory and with its experts served from disk (store read from its safetensors)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from helpers.hf import hf_config

from moestack import cli, cli_eval
from moestack.errors import MoestackError
from moestack.trainer import train

pytest.importorskip("transformers")


def run_cli(capsys, *argv: str) -> dict:
    """The JSON object the command prints (eval prints generated text after it, under
    ``"_text"`` here)."""
    cli.main(list(argv))
    out = capsys.readouterr().out
    start = out.index("{")
    result, end = json.JSONDecoder().raw_decode(out, start)
    return {**result, "_text": out[end:].strip("\n").splitlines()}


def test_export_then_eval_the_folder_in_memory_and_offloaded(hf_dir, tmp_path, capsys):
    train(hf_config(hf_dir("olmoe"), tmp_path, steps=4, ckpt_every=0), tmp_path / "run")
    out = tmp_path / "exported"
    report = run_cli(capsys, "export", str(tmp_path / "run"), str(out))
    assert report["family"] == "olmoe" and (out / "config.json").is_file()
    # the export record: what was exported, from which run and checkpoint (its weights' digest)
    record = json.loads((out / "moestack_export.json").read_text())
    ckpt = tmp_path / "run" / "checkpoints" / "step_000004"
    assert record["format"] == "moestack-export"
    assert record["run_dir"] == str((tmp_path / "run").resolve())
    assert record["checkpoint"] == str(ckpt.resolve())
    digest = hashlib.sha256((ckpt / "model.safetensors").read_bytes()).hexdigest()
    assert record["checkpoint_sha256"] == digest
    small = ["--batches", "2", "--max-bytes", "200000"]
    in_memory = run_cli(capsys, "eval", str(out), *small)
    offloaded = run_cli(capsys, "eval", str(out), *small, "--offload", "--capacity", "3",
                        "--generate", "4")  # fmt: skip
    assert offloaded["loss/val"] == in_memory["loss/val"]  # exact: same function, same data
    assert in_memory["_text"] == []  # no --generate: the metrics alone
    assert offloaded["cache/capacity"] == 3 and offloaded["cache/misses"] > 0
    assert "generation" not in offloaded  # the text is printed as text, after the metrics
    header, *text = offloaded["_text"]
    assert header == "generated (4 tokens after --prompt):"
    assert text and text[0].startswith("def ")
    store = tmp_path / "exported.experts"  # beside the model folder, not inside it
    assert (store / "index.json").is_file() and not (out / "experts").exists()


def test_a_transformers_run_evaluated_offloaded_without_loading_its_experts(
    hf_dir, tmp_path, capsys, monkeypatch
):
    """A router fine-tuning run (model=hf, anchor on): loaded without its experts it holds the
    run's weights and buffers, each read once, from the checkpoint (none from the model
    folder), and served from the store its loss is the in-memory one."""
    from moestack import meta_load
    from moestack.checkpoint import iter_expert_layers
    from moestack.runs import load_run

    folder = hf_dir("qwen2_moe")
    cfg = hf_config(folder, tmp_path, steps=4, ckpt_every=0)
    train(cfg, tmp_path / "run")
    whole = load_run(tmp_path / "run")
    read, tensor = [], meta_load.TensorReader.tensor
    monkeypatch.setattr(meta_load.TensorReader, "tensor",
                        lambda self, key: read.append((self.keys[key], key)) or tensor(self, key))  # fmt: skip
    lean = load_run(tmp_path / "run", experts=False)
    assert read and not [f for f, _ in read if Path(f).parent == Path(folder)]
    assert len({key for _, key in read}) == len(read)  # each tensor once
    got = dict(lean.model.named_parameters())
    for name, param in whole.model.named_parameters():
        if name.endswith((".moe.w1", ".moe.w2")):
            assert got[name].is_meta, name
        else:
            assert torch.equal(got[name], param), name
    buffers = dict(lean.model.named_buffers())
    for name, buf in whole.model.named_buffers():
        assert torch.equal(buffers[name], buf), name
    layers = list(iter_expert_layers(whole.checkpoint))
    assert len(layers) == len(whole.model.moe_layers) == 2
    for (w1, w2), moe in zip(layers, whole.model.moe_layers, strict=True):
        assert torch.equal(w1, moe.w1) and torch.equal(w2, moe.w2)
    small = ["--batches", "2", "--max-bytes", "200000"]
    in_memory = run_cli(capsys, "eval", str(tmp_path / "run"), *small)
    offloaded = run_cli(capsys, "eval", str(tmp_path / "run"), *small, "--offload",
                        "--capacity", "3")  # fmt: skip
    assert offloaded["loss/val"] == in_memory["loss/val"]


def test_export_refuses_a_run_of_moestacks_own_model(tmp_path):
    from helpers.runs import small_config

    train(small_config(steps=2, ckpt_every=0), tmp_path / "run")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["export", str(tmp_path / "run"), str(tmp_path / "out")])
    assert exit_info.value.code == 2
    with pytest.raises(MoestackError, match="moestack's own model"):
        cli_eval.cmd_export(cli.build_parser().parse_args(
            ["export", str(tmp_path / "run"), str(tmp_path / "out")]))  # fmt: skip


def test_a_model_folder_is_evaluated_on_the_stdlib_validation_split(hf_dir, tmp_path, capsys):
    """What `eval --help` says a model folder is evaluated on: the validation split of the
    standard library (data.source=stdlib), tokenised by the folder's tokenizer, 8 batches of
    16 windows of min(256, max_position_embeddings) tokens. The loss printed equals the one
    computed on that corpus, built here from those settings."""
    from moestack.config import DataConfig
    from moestack.data import eval_batches, load_corpus
    from moestack.evaluation import evaluate
    from moestack.interop.hf_model import load_hf_moe
    from moestack.interop.hf_tokenizer import hf_tokenizer

    folder = hf_dir("olmoe")
    text = " ".join(cli.build_parser()._subparsers._group_actions[0].choices["eval"]
                    .format_help().split())  # fmt: skip
    assert "data.source=stdlib" in text and "8 batches of 16 windows of min(256," in text
    printed = run_cli(capsys, "eval", str(folder), "--max-bytes", "200000")
    model = load_hf_moe(folder, impl="torch")
    tokenizer = hf_tokenizer(folder, model.cfg.doc_separator)
    data = DataConfig(source="stdlib", val_fraction=0.05, max_bytes=200000,
                      seq_len=min(256, model.cfg.max_seq_len))  # fmt: skip
    val = load_corpus(data, tokenizer).val
    want = evaluate(model, eval_batches(val, 16, data.seq_len, 8), torch.device("cpu"))
    assert printed["loss/val"] == pytest.approx(want["loss/val"], rel=1e-6)
