"""export_hf / ``moestack export --dtype``: the weights are written in the source folder's
dtype by default (a bf16 model stays bf16), or in the one asked for, and config.json and
the export record say which."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("transformers")

from helpers.hf import reference_model, sample_tokens, tiny_hf_model_dir  # noqa: E402
from safetensors import safe_open  # noqa: E402

from moestack import cli, cli_eval  # noqa: E402
from moestack.interop.hf_config import weight_files  # noqa: E402
from moestack.interop.hf_export import EXPORT_DTYPES, REPORT_FILE, export_hf  # noqa: E402
from moestack.interop.hf_model import load_hf_moe  # noqa: E402


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    """A tiny Mixtral folder saved in bfloat16 (config.json ``dtype: bfloat16``)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("bf16")
    fp32 = tiny_hf_model_dir(root, "mixtral")
    out = root / "bf16"
    AutoModelForCausalLM.from_pretrained(fp32, dtype=torch.bfloat16).save_pretrained(out)
    for f in fp32.glob("tokenizer*"):
        shutil.copy(f, out)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    return out


def _saved_dtypes(folder) -> set[torch.dtype]:
    dtypes = set()
    for file in weight_files(folder):
        with safe_open(file, framework="pt") as f:
            dtypes.update(f.get_tensor(k).dtype for k in list(f.keys()))
    return dtypes


def _config_dtype(folder) -> str:
    return json.loads((folder / "config.json").read_text())["dtype"]


def _tuned(source):
    """The model of ``source`` in fp32, moved as training would, and some tokens."""
    model = load_hf_moe(source, impl="torch")
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for moe in model.moe_layers:
            for p in (moe.router.weight, moe.w1, moe.w2):
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model, sample_tokens(model.cfg.doc_separator, batch=2, seq=16)


def test_a_bf16_source_exports_bf16_with_the_logits_of_bf16_weights(bf16_dir, tmp_path):
    model, tokens = _tuned(bf16_dir)
    assert model.moe_layers[0].w1.dtype == torch.float32  # trained in fp32
    report = export_hf(model, tmp_path / "out", source_dir=bf16_dir)
    assert _saved_dtypes(tmp_path / "out") == {torch.bfloat16}
    assert _config_dtype(tmp_path / "out") == "bfloat16" == report["dtype"]
    assert json.loads((tmp_path / "out" / REPORT_FILE).read_text())["dtype"] == "bfloat16"
    assert model.moe_layers[0].w1.dtype == torch.float32  # the model keeps its own weights
    assert model.hf.lm_head.weight.dtype == torch.float32
    # the reference: the moestack model with every weight rounded to bf16, computed in fp32
    with torch.no_grad():
        fp32_logits = model(tokens).logits
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
        want = model(tokens).logits
        got = reference_model(tmp_path / "out")(input_ids=tokens).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, fp32_logits, atol=1e-5, rtol=1e-5)  # the rounding shows


def test_dtype_float32_exports_fp32_with_the_trained_logits(bf16_dir, tmp_path):
    model, tokens = _tuned(bf16_dir)
    with torch.no_grad():
        want = model(tokens).logits
    report = export_hf(model, tmp_path / "out", source_dir=bf16_dir, dtype="float32")
    assert _saved_dtypes(tmp_path / "out") == {torch.float32}
    assert _config_dtype(tmp_path / "out") == "float32" == report["dtype"]
    with torch.no_grad():
        got = reference_model(tmp_path / "out")(input_ids=tokens).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_an_fp32_source_exports_fp32_and_float16_is_asked_for(hf_dir, tmp_path):
    source = hf_dir("qwen3_moe")
    model = load_hf_moe(source, impl="torch")
    assert export_hf(model, tmp_path / "a", source_dir=source)["dtype"] == "float32"
    assert _saved_dtypes(tmp_path / "a") == {torch.float32}
    export_hf(model, tmp_path / "b", source_dir=source, dtype="float16")
    assert _saved_dtypes(tmp_path / "b") == {torch.float16}
    assert _config_dtype(tmp_path / "b") == "float16"


def test_the_cli_exports_in_the_source_dtype_or_the_one_asked_for(bf16_dir, tmp_path, capsys):
    cli.main(["export", str(bf16_dir), str(tmp_path / "same")])
    assert json.loads(capsys.readouterr().out)["dtype"] == "bfloat16"
    assert _saved_dtypes(tmp_path / "same") == {torch.bfloat16}
    size = sum(f.stat().st_size for f in weight_files(tmp_path / "same"))
    assert size <= sum(f.stat().st_size for f in weight_files(bf16_dir)) * 1.05
    cli.main(["export", str(bf16_dir), str(tmp_path / "wide"), "--dtype", "float32"])
    assert json.loads(capsys.readouterr().out)["dtype"] == "float32"
    assert _config_dtype(tmp_path / "wide") == "float32"
    assert _saved_dtypes(tmp_path / "wide") == {torch.float32}


def test_a_bad_dtype_is_refused_by_the_parser(bf16_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as err:
        cli.main(["export", str(bf16_dir), str(tmp_path / "out"), "--dtype", "fp8"])
    assert err.value.code == 2
    assert "--dtype: invalid choice: 'fp8'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert cli_eval.EXPORT_DTYPES == EXPORT_DTYPES  # the parser's choices are the library's


def test_a_bad_dtype_is_refused_by_export_hf_before_writing(hf_dir, tmp_path):
    from moestack.errors import MoestackError

    source = hf_dir("olmoe")
    with pytest.raises(MoestackError, match="export dtype 'half' is unknown"):
        export_hf(load_hf_moe(source, impl="torch"), tmp_path / "out", source_dir=source,
                  dtype="half")  # fmt: skip
    assert not (tmp_path / "out").exists()
