"""Bad input around transformers model folders refused in one line: shard indexes leaving the
folder, exports that would replace what is no export, non-finite weights and losses,
tokenizers that encode nothing, and command-line values out of range."""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from helpers.hf import hf_config, reference_model, sample_tokens  # noqa: E402
from helpers.runs import killed_at  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from moestack import cli  # noqa: E402
from moestack.errors import MoestackError  # noqa: E402
from moestack.evaluation import (  # noqa: E402
    check_finite_loss,
    check_finite_weights,
    finite_expert_layers,
)
from moestack.interop.hf_config import weight_files  # noqa: E402
from moestack.interop.hf_experts import iter_hf_experts, key_files  # noqa: E402
from moestack.interop.hf_export import REPORT_FILE, export_hf  # noqa: E402
from moestack.interop.hf_model import load_hf_moe  # noqa: E402
from moestack.interop.hf_tokenizer import hf_tokenizer  # noqa: E402
from moestack.trainer import train  # noqa: E402

INDEX = "model.safetensors.index.json"


def copy(source: Path, tmp_path: Path, name: str = "m") -> Path:
    shutil.copytree(source, tmp_path / name)
    return tmp_path / name


def write_index(folder: Path, keys: list[str], name: object) -> None:
    (folder / INDEX).write_text(json.dumps({"weight_map": dict.fromkeys(keys, name)}))


# -- shard indexes ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../outside.safetensors", "sub/../../outside.safetensors"])
def test_index_entries_leaving_the_folder_are_refused(hf_dir, tmp_path, name):
    """Both the loader (weight_files) and the expert-store writer (key_files, read by
    iter_hf_experts) refuse the entry, though the file it names exists and would load."""
    path = copy(hf_dir("olmoe"), tmp_path)
    outside = tmp_path / "outside.safetensors"
    shutil.move(path / "model.safetensors", outside)
    write_index(path, list(load_file(outside)), name)
    for read in (weight_files, key_files, lambda p: list(iter_hf_experts(p))):
        with pytest.raises(MoestackError, match="outside") as err:
            read(path)
        assert INDEX in str(err.value) and repr(name) in str(err.value)
    with pytest.raises(MoestackError, match="outside"):
        load_hf_moe(path, impl="torch")


def test_absolute_and_non_string_index_entries_are_refused(hf_dir, tmp_path):
    path = copy(hf_dir("olmoe"), tmp_path)
    keys = list(load_file(path / "model.safetensors"))
    write_index(path, keys, str((path / "model.safetensors").resolve()))  # inside, but absolute
    with pytest.raises(MoestackError, match="a path outside"):
        key_files(path)
    write_index(path, keys, ["model.safetensors"])
    with pytest.raises(MoestackError, match="not a file name"):
        key_files(path)


def test_a_symlinked_folder_in_the_index_cannot_lead_out(hf_dir, tmp_path):
    path = copy(hf_dir("olmoe"), tmp_path)
    (tmp_path / "elsewhere").mkdir()
    shutil.move(path / "model.safetensors", tmp_path / "elsewhere" / "model.safetensors")
    (path / "sub").symlink_to(tmp_path / "elsewhere")
    write_index(path, list(load_file(tmp_path / "elsewhere" / "model.safetensors")),
                "sub/model.safetensors")  # fmt: skip
    with pytest.raises(MoestackError, match="resolves to"):
        key_files(path)


def test_symlinked_shards_of_a_hub_snapshot_still_load(hf_dir, tmp_path):
    """A downloaded snapshot links each file to a blob outside its folder: the index's names
    are inside the folder, so it loads."""
    path = copy(hf_dir("olmoe"), tmp_path)
    (tmp_path / "blobs").mkdir()
    blob = tmp_path / "blobs" / "0123abcd"
    shutil.move(path / "model.safetensors", blob)
    (path / "model-00001-of-00001.safetensors").symlink_to(blob)
    write_index(path, list(load_file(blob)), "model-00001-of-00001.safetensors")
    assert len(list(iter_hf_experts(path))) == 2 * 6


def test_index_placing_a_tensor_in_a_file_without_it(hf_dir, tmp_path):
    path = copy(hf_dir("olmoe"), tmp_path)
    keys = list(load_file(path / "model.safetensors"))
    write_index(path, [*keys, "model.extra.weight"], "model.safetensors")
    with pytest.raises(
        MoestackError, match="places tensor model.extra.weight in model.safetensors"
    ):
        key_files(path)


# -- export: what --overwrite may replace ----------------------------------------------------


def test_overwrite_replaces_no_folder_without_an_export_record(hf_dir, tmp_path):
    """A downloaded model folder (config.json, weights, no export record) stays untouched."""
    source = hf_dir("qwen3_moe")
    model = load_hf_moe(source, impl="torch")
    other = copy(source, tmp_path, "downloaded")
    before = {p.name: p.read_bytes() for p in other.iterdir()}
    with pytest.raises(MoestackError, match=f"holds no {REPORT_FILE}"):
        export_hf(model, other, source_dir=source, overwrite=True)
    assert {p.name: p.read_bytes() for p in other.iterdir()} == before


def test_overwrite_never_replaces_a_folder_above_the_run_or_the_source(hf_dir, tmp_path):
    source = hf_dir("qwen3_moe")
    model = load_hf_moe(source, impl="torch")
    export_hf(model, tmp_path / "earlier", source_dir=source)  # carries a record
    with pytest.raises(MoestackError, match="is a folder above the run folder"):
        export_hf(model, tmp_path / "earlier", source_dir=source, overwrite=True,
                  run_dir=tmp_path / "earlier" / "runs" / "r1")  # fmt: skip
    with pytest.raises(MoestackError, match="is the run folder"):
        export_hf(model, tmp_path / "earlier", source_dir=source, overwrite=True,
                  run_dir=tmp_path / "earlier")  # fmt: skip
    nested = copy(source, tmp_path / "earlier", "src")  # a source inside an earlier export
    with pytest.raises(MoestackError, match="is a folder above the source model folder"):
        export_hf(model, tmp_path / "earlier", source_dir=nested, overwrite=True)
    assert (tmp_path / "earlier" / REPORT_FILE).is_file() and (nested / "config.json").is_file()


def test_export_over_a_folder_holding_the_run_is_refused(hf_dir, tmp_path, capsys):
    """``moestack export RUN DIR --overwrite`` where DIR holds the run (and a config.json):
    replacing DIR would delete the run."""
    outer = copy(hf_dir("qwen3_moe"), tmp_path, "outer")  # a model folder, not the source
    run = outer / "run"
    train(hf_config(hf_dir("qwen3_moe"), tmp_path, steps=1, ckpt_every=0), run)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["export", str(run), str(outer), "--overwrite"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert f"export folder {outer} is " in err
    assert (run / "config.yaml").is_file() and (run / "checkpoints" / "step_000001").is_dir()


def test_a_failed_overwrite_keeps_the_earlier_export(hf_dir, tmp_path, monkeypatch):
    source = hf_dir("mixtral")
    model = load_hf_moe(source, impl="torch")
    export_hf(model, tmp_path / "out", source_dir=source)
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}

    def boom(*args, **kwargs):
        raise RuntimeError("killed halfway")

    monkeypatch.setattr(model.hf, "save_pretrained", boom)
    with pytest.raises(RuntimeError, match="killed halfway"):
        export_hf(model, tmp_path / "out", source_dir=source, overwrite=True)
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_an_export_folder_under_a_file_is_one_line(hf_dir, tmp_path):
    source = hf_dir("qwen3_moe")
    model = load_hf_moe(source, impl="torch")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(MoestackError) as err:
        export_hf(model, tmp_path / "afile" / "sub" / "out", source_dir=source)
    assert str(err.value) == (
        f"export folder {tmp_path / 'afile' / 'sub' / 'out'} lies under {tmp_path / 'afile'}, "
        "which is a file; choose a folder path"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


# -- non-finite weights and losses -----------------------------------------------------------


def test_export_refuses_nan_expert_weights_naming_them(hf_dir, tmp_path, caplog):
    source = hf_dir("olmoe")
    model = load_hf_moe(source, impl="torch")
    with torch.no_grad():
        model.moe_layers[1].w2[3, 0, 0] = float("inf")
        model.moe_layers[1].w2[5, 1, 1] = float("nan")
    with pytest.raises(MoestackError, match="--allow-nonfinite") as err:
        export_hf(model, tmp_path / "out", source_dir=source)
    assert "hf.model.layers.1.mlp.moe.w2 (experts [3, 5])" in str(err.value)
    assert "1 tensor(s)" in str(err.value) and list(tmp_path.iterdir()) == []
    with caplog.at_level(logging.WARNING):
        export_hf(model, tmp_path / "out", source_dir=source, allow_nonfinite=True)
    assert "moe.w2 (experts [3, 5])" in caplog.text and (tmp_path / "out" / "config.json").is_file()


def test_non_finite_listing_names_the_first_five_then_counts():
    named = [(f"t{i}", torch.tensor([1.0, math.nan if i % 2 else math.inf])) for i in range(7)]
    named.insert(3, ("fine", torch.ones(3)))
    named.insert(4, ("ids", torch.tensor([1, 2])))  # integers hold no NaN
    with pytest.raises(MoestackError) as err:
        check_finite_weights(named, "checkpoint X")
    assert "checkpoint X holds NaN/inf values in 7 tensor(s): t0, t1, t2, t3, t4 and 2 more" in (
        str(err.value)
    )
    check_finite_weights([("fine", torch.ones(3)), ("meta", torch.empty(2, device="meta"))], "X")


def test_expert_layers_are_checked_as_they_stream():
    good = (torch.zeros(4, 2, 6), torch.zeros(4, 3, 2))
    bad = (torch.zeros(4, 2, 6), torch.zeros(4, 3, 2))
    bad[1][2, 0, 0] = math.nan
    layers = finite_expert_layers(iter([good, bad]), "folder F")
    w1, w2 = next(layers)  # layer 0 passes before layer 1 is read
    assert w1 is good[0] and w2 is good[1]
    with pytest.raises(MoestackError, match=r"moe_layers\.1\.w2 \(experts \[2\]\)"):
        next(layers)


@pytest.mark.parametrize("loss", [math.nan, math.inf])
def test_a_non_finite_validation_loss_is_refused(loss):
    with pytest.raises(MoestackError, match=f"validation loss is {loss}"):
        check_finite_loss({"loss/val": loss, "eval/perplexity": loss}, "checkpoint X")
    check_finite_loss({"loss/val": 2.5}, "checkpoint X")


# -- tokenizers ------------------------------------------------------------------------------


def test_folder_without_tokenizer_files_is_refused(hf_dir, tmp_path):
    path = copy(hf_dir("olmoe"), tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).unlink()
    with pytest.raises(MoestackError, match="encodes to no tokens") as err:
        hf_tokenizer(path, 0)
    assert str(path) in str(err.value) and "tokenizer.json" in str(err.value)


def test_tokenizer_that_decodes_to_nothing_is_refused(hf_dir, tmp_path):
    """Every word an unknown token: tokens come out, but none of the text survives."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = copy(hf_dir("olmoe"), tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).unlink()
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<pad>": 1}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(path)
    with pytest.raises(MoestackError, match="decodes to nothing"):
        hf_tokenizer(path, 0)


def test_a_working_tokenizer_passes_the_probe(hf_dir):
    tokenizer = hf_tokenizer(hf_dir("olmoe"), 0)
    assert len(tokenizer.encode(["def forward(self, x):"])[0]) > 0


# -- command-line values ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "option, value",
    [
        ("--generate", "-5"),
        ("--batches", "-1"),
        ("--max-bytes", "-100"),
        ("--warmup", "-1"),
        ("--warmup", "0.1"),
        ("--capacity", "-2"),
        ("--capacity-bytes", "-1"),
        ("--cache-aware-bias", "nan"),
        ("--cache-aware-bias", "inf"),
        ("--cache-aware-bias", "-0.5"),
    ],
)
def test_eval_refuses_values_out_of_range_naming_the_option(tmp_path, capsys, option, value):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["eval", str(tmp_path), f"{option}={value}"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert f"error: argument {option}: '{value}'" in err and "Traceback" not in err


def test_eval_values_in_range_and_defaults():
    parse = cli.build_parser().parse_args
    args = parse(["eval", "R", "--warmup", "0", "--max-bytes", "0", "--cache-aware-bias", "0.5",
                  "--generate", "3", "--batches", "2"])  # fmt: skip
    assert (args.warmup, args.max_bytes, args.cache_aware_bias) == (0, 0, 0.5)
    assert (args.generate, args.batches, args.allow_nonfinite) == (3, 2, False)
    defaults = parse(["eval", "R"])
    assert defaults.warmup is None and defaults.max_bytes is None  # the run's own settings
    assert parse(["export", "R", "O", "--allow-nonfinite"]).allow_nonfinite


def test_patched_model_still_runs_after_the_checks(hf_dir):
    """The header checks read no tensor: a loaded model computes as before, its logits
    those of transformers' own model of the folder."""
    path = hf_dir("olmoe")
    model = load_hf_moe(path, impl="torch")
    tokens = sample_tokens(model.cfg.doc_separator)
    with torch.no_grad():
        out = model(tokens)
        want = reference_model(path)(input_ids=tokens).logits
    torch.testing.assert_close(out.logits, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("experts", [True, False])
def test_a_config_value_transformers_refuses_is_one_line(hf_dir, tmp_path, experts):
    """A field moestack does not read, of the wrong type: transformers 5 refuses it (its strict
    config fields), and the refusal is one line naming the folder and the field."""
    folder = copy(hf_dir("qwen3_moe"), tmp_path)
    raw = json.loads((folder / "config.json").read_text())
    raw["attention_bias"] = "no"
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(MoestackError, match=f"transformers could not .*{folder}") as err:
        load_hf_moe(folder, impl="torch", experts=experts)
    assert "'attention_bias' expected bool" in str(err.value) and "\n" not in str(err.value)


def test_a_relative_model_path_is_recorded_absolute(tmp_path, hf_dir, monkeypatch):
    """A run's config.yaml names its source folder absolute, so export and eval find it from
    any folder."""
    from moestack.config import HFModelConfig

    source = hf_dir("qwen3_moe")
    monkeypatch.chdir(source.parent)
    cfg = HFModelConfig(path=source.name)
    assert cfg.path == str(source)


# -- resuming a run of a folder ------------------------------------------------------------


def test_resume_refuses_a_source_folder_whose_config_changed(hf_dir, tmp_path):
    """A field moestack does not read (attention_dropout: transformers' attention in train
    mode) keeps every shape, so only the recorded digest of config.json can notice it."""
    source = copy(hf_dir("mixtral"), tmp_path)
    out = tmp_path / "run"
    with killed_at(13):
        train(hf_config(source, tmp_path), out)
    original = (source / "config.json").read_bytes()
    raw = json.loads(original)
    raw["attention_dropout"] = 0.5
    (source / "config.json").write_text(json.dumps(raw))
    with pytest.raises(MoestackError, match=r"config.json in model.path=.* changed since the run"):
        train(hf_config(source, tmp_path, resume=True), out)
    (source / "config.json").write_bytes(original)  # the folder as it was: the run resumes
    train(hf_config(source, tmp_path, resume=True), out)
    assert [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if "loss/train" in r][-1] == 20  # fmt: skip


def test_export_and_eval_refuse_a_run_whose_source_folder_changed(hf_dir, tmp_path, capsys):
    """The run's checkpoints hold its weights, its source folder the routing and tokenizer:
    a flipped norm_topk_prob (same shapes) would export and evaluate another model."""
    from moestack.runs import load_run

    source = copy(hf_dir("qwen3_moe"), tmp_path)
    run, out = tmp_path / "run", tmp_path / "out"
    train(hf_config(source, tmp_path, steps=2, ckpt_every=0), run)
    tokens = sample_tokens(eos_id=1)
    with torch.no_grad():
        trained = load_run(run).model(tokens).logits
    as_trained = {name: (source / name).read_bytes()
                  for name in ("config.json", "tokenizer_config.json")}  # fmt: skip
    raw = json.loads(as_trained["config.json"])
    raw["norm_topk_prob"] = not raw["norm_topk_prob"]
    (source / "config.json").write_text(json.dumps(raw))
    (source / "tokenizer_config.json").write_text(
        as_trained["tokenizer_config.json"].decode().replace("<pad>", "<PAD>"))  # fmt: skip
    changed = f"config.json, tokenizer_config.json in model.path={source} changed since the run"
    capsys.readouterr()  # training's progress
    for argv in (["export", str(run), str(out)], ["eval", str(run), "--batches", "1"]):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(argv)
        err = capsys.readouterr().err.strip()
        assert exit_info.value.code == 2 and "\n" not in err
        assert (
            f"{changed} {run} trained ({run / 'source_model.json'}); put the folder back as "
            "it was, or train a new run of the changed folder" in err
        )
    assert not out.exists()
    for name, data in as_trained.items():  # the folder as the run trained on it
        (source / name).write_bytes(data)
    cli.main(["export", str(run), str(out)])
    capsys.readouterr()
    got = reference_model(out)(input_ids=tokens).logits.detach()
    torch.testing.assert_close(got, trained, rtol=1e-5, atol=1e-5)
