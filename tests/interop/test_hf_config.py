"""read_hf_config and weight_files: the fields of each family, and one-line errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from helpers.hf import FAMILIES, tiny_tokenizer  # noqa: E402

from moestack.errors import MoestackError  # noqa: E402
from moestack.interop.hf_config import (  # noqa: E402
    model_config_kwargs,
    read_hf_config,
    weight_files,
)


def _one_line_error(path, match: str) -> str:
    with pytest.raises(MoestackError, match=match) as err:
        read_hf_config(path)
    message = str(err.value)
    assert "\n" not in message
    return message


def _write_config(folder: Path, **fields) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(fields))
    return folder


@pytest.mark.parametrize("family", FAMILIES)
def test_fields_of_each_family(hf_dir, family):
    info = read_hf_config(hf_dir(family))
    eos = tiny_tokenizer().eos_token_id
    assert info["family"] == family
    assert (info["vocab_size"], info["d_model"], info["n_layers"], info["n_heads"]) == (
        320,
        32,
        2,
        4,
    )
    assert info["max_seq_len"] == 128
    assert info["moe"] == {"num_experts": 6, "top_k": 2, "d_ff": 16}
    assert info["doc_separator"] == eos
    assert info["moe_layer_ids"] == [0, 1]
    renormalize = {"qwen3_moe": True, "qwen2_moe": False, "mixtral": True, "olmoe": False}
    assert info["router"] == {"score": "softmax", "renormalize": renormalize[family]}
    assert info["shared_expert_d_ff"] == (24 if family == "qwen2_moe" else 0)
    kwargs = model_config_kwargs(info)
    assert set(kwargs) >= {"vocab_size", "d_model", "n_layers", "moe", "doc_separator"}


def test_transformers_4_spellings(tmp_path):
    """4.x configs: num_experts, a top-level rope_theta, torch_dtype, an EOS list."""
    folder = _write_config(
        tmp_path / "m",
        model_type="qwen3_moe",
        vocab_size=1000,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=8,
        max_position_embeddings=4096,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        rope_theta=1e6,
        torch_dtype="bfloat16",
        eos_token_id=[7, 8],
        mlp_only_layers=[0],
        decoder_sparse_step=1,
    )
    info = read_hf_config(folder)
    assert info["moe"] == {"num_experts": 16, "top_k": 4, "d_ff": 32}
    assert info["rope_theta"] == 1e6
    assert info["dtype"] == "bfloat16"
    assert info["doc_separator"] == 7
    assert info["moe_layer_ids"] == [1, 2, 3]


def test_eos_outside_vocabulary_means_no_separator(tmp_path, caplog):
    folder = _write_config(
        tmp_path / "m",
        model_type="olmoe",
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=64,
        num_experts=4,
        num_experts_per_tok=2,
        intermediate_size=8,
        eos_token_id=50279,
    )
    assert read_hf_config(folder)["doc_separator"] == -1
    assert "outside the vocabulary" in caplog.text


def test_missing_folder_file_and_config(tmp_path):
    _one_line_error(tmp_path / "nope", "does not exist")
    (tmp_path / "file").write_text("x")
    _one_line_error(tmp_path / "file", "is a file")
    (tmp_path / "empty").mkdir()
    message = _one_line_error(tmp_path / "empty", "config.json is missing")
    assert str(tmp_path / "empty") in message


def test_invalid_json_and_missing_keys(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    _one_line_error(bad, "not valid JSON")
    folder = _write_config(tmp_path / "m", model_type="mixtral", vocab_size=10)
    message = _one_line_error(folder, "lacks 'hidden_size'")
    assert "config.json" in message
    _one_line_error(_write_config(tmp_path / "n", vocab_size=10), "has no model_type")


def test_unsupported_family_names_it_and_the_supported_ones(tmp_path):
    message = _one_line_error(_write_config(tmp_path / "m", model_type="llama"), "'llama'")
    assert "qwen3_moe, qwen2_moe, mixtral, olmoe" in message


@pytest.mark.parametrize(
    ("family", "reason"),
    [("deepseek_v3", "group-limited top-k"), ("gpt_oss", "experts' biases")],
)
def test_unrepresentable_family_says_what_is_not_supported(tmp_path, family, reason):
    """Real configs of the family (transformers' own defaults), saved as a user has them."""
    from transformers import AutoConfig

    AutoConfig.for_model(family).save_pretrained(tmp_path / family)
    message = _one_line_error(tmp_path / family, f"'{family}' is not supported")
    assert reason in message


def test_non_silu_experts_refused(tmp_path):
    folder = _write_config(tmp_path / "m", model_type="mixtral", hidden_act="gelu")
    _one_line_error(folder, "hidden_act='gelu'")


# A Qwen3-MoE config as transformers 5 writes it (the expert count under both spellings).
_QWEN3 = dict(model_type="qwen3_moe", vocab_size=1000, hidden_size=64, num_hidden_layers=4,
              num_attention_heads=8, max_position_embeddings=4096, num_experts=16,
              num_local_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
              eos_token_id=7, mlp_only_layers=[0], decoder_sparse_step=1)  # fmt: skip


@pytest.mark.parametrize(
    ("field", "value", "shown"),
    [
        ("hidden_size", "abc", 'hidden_size="abc"'),
        ("num_hidden_layers", 2.5, "num_hidden_layers=2.5"),  # never truncated to 2
        ("num_hidden_layers", 4.0, "num_hidden_layers=4.0"),  # transformers 5 refuses it too
        ("num_experts_per_tok", [2], "num_experts_per_tok=[2]"),
        ("num_attention_heads", True, "num_attention_heads=true"),
        ("moe_intermediate_size", 0, "moe_intermediate_size=0"),
        ("num_key_value_heads", "8", 'num_key_value_heads="8"'),
        ("decoder_sparse_step", 1.5, "decoder_sparse_step=1.5"),
        ("eos_token_id", "x", 'eos_token_id="x"'),
        ("eos_token_id", [7.5], "eos_token_id entry=7.5"),
        ("mlp_only_layers", 5, "mlp_only_layers=5"),
        ("mlp_only_layers", ["0"], 'mlp_only_layers entry="0"'),
        ("rms_norm_eps", "small", 'rms_norm_eps="small"'),
    ],
)
def test_a_value_of_the_wrong_type_names_the_file_field_and_value(tmp_path, field, value, shown):
    folder = _write_config(tmp_path / "m", **{**_QWEN3, field: value})
    message = _one_line_error(folder, "is not a")
    assert message.startswith(f"{folder / 'config.json'}: {shown} is not a")


def test_expert_count_spellings_must_agree(tmp_path):
    """transformers 5 reads num_local_experts, moestack the first spelling it finds: two
    different counts would make two different models."""
    folder = _write_config(tmp_path / "m", **{**_QWEN3, "num_experts": 4, "num_local_experts": 6})
    message = _one_line_error(folder, "num_experts=4 and num_local_experts=6 disagree")
    assert str(folder / "config.json") in message
    agreeing = _write_config(tmp_path / "n", **{**_QWEN3, "num_experts": 6, "num_local_experts": 6})
    assert read_hf_config(agreeing)["moe"]["num_experts"] == 6
    one = {k: v for k, v in _QWEN3.items() if k != "num_experts"}
    assert read_hf_config(_write_config(tmp_path / "o", **one))["moe"]["num_experts"] == 16


def test_the_whole_number_fields_read_as_written(tmp_path):
    info = read_hf_config(_write_config(tmp_path / "m", **_QWEN3))
    assert (info["vocab_size"], info["d_model"], info["n_layers"], info["n_heads"]) == (
        1000, 64, 4, 8)  # fmt: skip
    assert info["moe"] == {"num_experts": 16, "top_k": 4, "d_ff": 32}
    assert (info["doc_separator"], info["moe_layer_ids"]) == (7, [1, 2, 3])


def test_weight_files(hf_dir, tmp_path):
    assert [f.name for f in weight_files(hf_dir("mixtral"))] == ["model.safetensors"]
    folder = tmp_path / "m"
    shutil.copytree(hf_dir("mixtral"), folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(MoestackError, match="holds no model weights") as err:
        weight_files(folder)
    assert str(folder) in str(err.value) and "\n" not in str(err.value)
    (folder / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(MoestackError, match="safe_serialization"):
        weight_files(folder)
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}})
    )
    with pytest.raises(MoestackError, match="missing shard files"):
        weight_files(folder)


def test_reading_a_config_imports_no_transformers():
    code = (
        "import sys; from moestack.interop.hf_config import read_hf_config; "
        "print('transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
