"""Read a local transformers MoE model folder's config.json into moestack's terms.

``read_hf_config(DIR)`` parses ``DIR/config.json`` with plain json (no torch, no
transformers: it runs while configs are built, before anything heavy is imported) and
returns the fields a moestack ``ModelConfig`` needs (same names: vocab_size, d_model,
n_layers, n_heads, max_seq_len, moe {num_experts, top_k, d_ff}, doc_separator, rope_theta,
norm_eps, tie_embeddings) plus what the loaders need: the family, the router's score and
renormalisation, the shared expert's width, which decoder layers are sparse.

A family is supported when its MoE block is exactly what moestack's ``MoE`` computes
(softmax or sigmoid score, top-k, optional renormalisation, optional selection bias,
bias-free SwiGLU experts), with at most a gated shared expert kept beside it. Anything
else (a missing folder, no config.json, another family, a family whose routing moestack
cannot represent, a missing key) is one ``MoestackError`` line naming the file or family.
``weight_files`` and ``shard_map`` read the shard index, whose every file name must stay
inside the folder (``shard_path``): the index is read from disk, and neither the loader nor
the expert-store writer may be led to a file elsewhere.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path, PurePosixPath
from typing import Any

from moestack.errors import MoestackError

log = logging.getLogger(__name__)

SUPPORTED_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
_OTHER_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")

# The ModelConfig fields read_hf_config fills (the rest of its dict is for the loaders).
MODEL_CONFIG_KEYS = (
    "vocab_size",
    "d_model",
    "n_layers",
    "n_heads",
    "max_seq_len",
    "moe",
    "rope_theta",
    "norm_eps",
    "tie_embeddings",
    "doc_separator",
)

# config.json spellings of each value, first found wins (transformers 4.x and 5.x differ:
# 5.x writes Qwen3-MoE's expert count as num_local_experts, 4.x as num_experts).
_NUM_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts")
_EXPERT_WIDTH = {
    "qwen3_moe": ("moe_intermediate_size",),
    "qwen2_moe": ("moe_intermediate_size",),
    "mixtral": ("intermediate_size",),
    "olmoe": ("intermediate_size",),
}


def _supported_line() -> str:
    return f"supported: {', '.join(SUPPORTED_FAMILIES)}"


def _deepseek_v3_gaps(raw: dict[str, Any]) -> list[str]:
    """What of DeepSeek-V3's router moestack's MoE cannot compute exactly."""
    gaps = []
    n_group, topk_group = raw.get("n_group", 1) or 1, raw.get("topk_group", 1) or 1
    if n_group > 1 and topk_group < n_group:
        gaps.append(f"its group-limited top-k (n_group={n_group}, topk_group={topk_group})")
    scale = raw.get("routed_scaling_factor", 1.0)
    if scale not in (None, 1, 1.0):
        gaps.append(f"its routed_scaling_factor={scale}")
    gaps.append(
        "the e_score_correction_bias it adds to its sigmoid scores at inference (moestack "
        "applies a selection bias only while router.bias_update_rate > 0)"
    )
    return gaps


def _gpt_oss_gaps(raw: dict[str, Any]) -> list[str]:
    """What of GPT-OSS's MoE block moestack's MoE cannot compute exactly."""
    limit = raw.get("swiglu_limit", "?")
    return [
        "its router's bias",
        "its experts' biases",
        f"its clamped SwiGLU variant (swiglu_limit={limit}, alpha=1.702, (up + 1) * glu) "
        "on interleaved gate/up columns",
    ]


_UNREPRESENTABLE = {"deepseek_v3": _deepseek_v3_gaps, "gpt_oss": _gpt_oss_gaps}


def check_model_dir(path: str | Path) -> Path:
    """``path`` as a Path if it is a folder holding config.json; MoestackError otherwise."""
    folder = Path(path).expanduser()
    if not folder.exists():
        raise MoestackError(
            f"model folder {folder} does not exist; pass a local transformers model folder "
            "(config.json, safetensors weights, tokenizer files)"
        )
    if not folder.is_dir():
        raise MoestackError(f"{folder} is a file, not a transformers model folder")
    if not (folder / CONFIG_FILE).is_file():
        raise MoestackError(
            f"{folder / CONFIG_FILE} is missing: {folder} is not a transformers model folder "
            "(save one with model.save_pretrained)"
        )
    return folder


def shard_path(folder: Path, name: Any, index: Path) -> Path:
    """``folder / name`` for a file name read from the shard index ``index``, once it stays
    inside ``folder``: a relative path without ``..`` whose folder resolves inside
    ``folder`` (the shard itself may be a symlink, as in a downloaded hub snapshot).
    MoestackError naming the index and the entry otherwise: the index is read from disk and
    must not lead the loader, or the expert-store writer, to files elsewhere."""
    if not isinstance(name, str) or not name or "\0" in name:
        raise MoestackError(
            f"{index}: weight_map names {name!r}, not a file name; re-save the model"
        )
    pure = PurePosixPath(name.replace("\\", "/"))
    if pure.is_absolute() or ".." in pure.parts:
        raise MoestackError(
            f"{index}: weight_map names {name!r}, a path outside {folder}; shard files must "
            "lie in the model folder (re-save the model)"
        )
    path = folder / name
    if not path.parent.resolve().is_relative_to(folder.resolve()):
        raise MoestackError(
            f"{index}: weight_map names {name!r}, whose folder resolves to "
            f"{path.parent.resolve()}, outside {folder}; shard files must lie in the model "
            "folder (re-save the model)"
        )
    return path


def shard_map(folder: Path) -> dict[str, Path] | None:
    """{tensor name: shard file} from ``folder``'s shard index (every path checked by
    ``shard_path``), None when the folder has no index (one ``model.safetensors``)."""
    index = folder / SAFETENSORS_INDEX
    if not index.is_file():
        return None
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise MoestackError(f"{index} has no weight_map; re-save the model")
    checked: dict[str, Path] = {}
    paths: dict[str, Path] = {}  # each file name checked once
    for key, name in weight_map.items():
        if not (isinstance(name, str) and name in paths):
            paths[name] = shard_path(folder, name, index)  # refuses a name that is no str
        checked[key] = paths[name]
    return checked


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of a model folder (from the shard index when there is one).

    MoestackError naming the folder when it holds no safetensors weights, or the index
    when it names a file that is missing or lies outside the folder.
    """
    folder = check_model_dir(path)
    index = folder / SAFETENSORS_INDEX
    shards = shard_map(folder)
    if shards is not None:
        files = sorted(set(shards.values()))
        missing = [str(f.relative_to(folder)) for f in files if not f.is_file()]
        if missing:
            raise MoestackError(f"{index} names missing shard files {missing}; re-save the model")
        return files
    if (folder / SAFETENSORS_FILE).is_file():
        return [folder / SAFETENSORS_FILE]
    other = [name for name in _OTHER_WEIGHTS if (folder / name).is_file()]
    hint = f" (it has {other[0]}: re-save it with safe_serialization)" if other else ""
    raise MoestackError(
        f"{folder} holds no model weights: no {SAFETENSORS_FILE} or {SAFETENSORS_INDEX}{hint}"
    )


def _read_json(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise MoestackError(
            f"{file} is not valid JSON ({err.msg} at line {err.lineno}); re-save the model"
        ) from None
    except (OSError, UnicodeDecodeError) as err:
        raise MoestackError(f"cannot read {file}: {err}") from None
    if not isinstance(data, dict):
        raise MoestackError(f"{file} holds a JSON {type(data).__name__}, not an object")
    return data


def _get(raw: dict[str, Any], keys: tuple[str, ...], file: Path, family: str) -> Any:
    """The first of ``keys`` present in ``raw``; MoestackError naming them otherwise."""
    for key in keys:
        if raw.get(key) is not None:
            return raw[key]
    names = " or ".join(repr(k) for k in keys)
    raise MoestackError(f"{file} lacks {names}, which model_type {family!r} needs; re-save it")


def _family(raw: dict[str, Any], file: Path) -> str:
    family = raw.get("model_type")
    if not family:
        raise MoestackError(f"{file} has no model_type; {_supported_line()}")
    if family in _UNREPRESENTABLE:
        gaps = "; ".join(_UNREPRESENTABLE[family](raw))
        raise MoestackError(
            f"{file}: model_type {family!r} is not supported: moestack's MoE (softmax or "
            f"sigmoid score, top-k, renormalise, selection bias, bias-free SwiGLU experts) "
            f"cannot represent exactly {gaps}; {_supported_line()}"
        )
    if family not in SUPPORTED_FAMILIES:
        raise MoestackError(
            f"{file}: model_type {family!r} is not a supported MoE family; {_supported_line()}"
        )
    return family


def _moe_layer_ids(raw: dict[str, Any], family: str, n_layers: int) -> list[int]:
    """Decoder layers with a sparse-MoE block (Qwen MoE may keep some layers dense)."""
    if family not in ("qwen2_moe", "qwen3_moe"):
        return list(range(n_layers))
    dense = set(raw.get("mlp_only_layers") or [])
    step = int(raw.get("decoder_sparse_step") or 1)
    return [i for i in range(n_layers) if i not in dense and (i + 1) % step == 0]


def _doc_separator(raw: dict[str, Any], vocab_size: int, file: Path) -> int:
    """The EOS token id (the first of a list), -1 when there is none in the vocabulary."""
    eos = raw.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if eos is None:
        return -1
    if not 0 <= int(eos) < vocab_size:
        log.warning(
            "%s: eos_token_id=%s is outside the vocabulary [0, %d); documents will not be "
            "separated for the router losses",
            file,
            eos,
            vocab_size,
        )
        return -1
    return int(eos)


def _rope_theta(raw: dict[str, Any]) -> float:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = raw.get("rope_theta") or (params.get("rope_theta") if isinstance(params, dict) else 0)
    return float(theta or 10000.0)


def _router(raw: dict[str, Any], family: str) -> dict[str, Any]:
    """The family's routing: softmax over every expert, top-k, then renormalised or not."""
    renormalize = True if family == "mixtral" else bool(raw.get("norm_topk_prob", False))
    return {"score": "softmax", "renormalize": renormalize}


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The moestack view of ``path/config.json`` (see the module docstring for the keys).

    Keys named like ModelConfig fields (``MODEL_CONFIG_KEYS``) hold those fields; besides:
    ``family`` (model_type), ``path``, ``architectures``, ``router`` {score, renormalize},
    ``shared_expert_d_ff`` (0 = none), ``moe_layer_ids`` (decoder layers with a sparse
    block), ``n_kv_heads``, ``head_dim``, ``dtype`` (the saved weights' dtype name or None),
    ``router_jitter_noise`` (Mixtral's training noise, which moestack does not apply).
    """
    folder = check_model_dir(path)
    file = folder / CONFIG_FILE
    raw = _read_json(file)
    family = _family(raw, file)
    if raw.get("hidden_act", "silu") != "silu":
        raise MoestackError(
            f"{file}: hidden_act={raw['hidden_act']!r}; moestack experts are SwiGLU (silu)"
        )

    def get(*keys: str) -> Any:
        return _get(raw, keys, file, family)

    vocab_size, d_model = int(get("vocab_size")), int(get("hidden_size"))
    n_layers, n_heads = int(get("num_hidden_layers")), int(get("num_attention_heads"))
    info: dict[str, Any] = {
        "family": family,
        "path": str(folder),
        "architectures": list(raw.get("architectures") or []),
        "vocab_size": vocab_size,
        "d_model": d_model,
        "n_layers": n_layers,
        "n_heads": n_heads,
        "n_kv_heads": int(raw.get("num_key_value_heads") or n_heads),
        "head_dim": int(raw.get("head_dim") or d_model // n_heads),
        "max_seq_len": int(get("max_position_embeddings")),
        "moe": {
            "num_experts": int(get(*_NUM_EXPERTS)),
            "top_k": int(get("num_experts_per_tok")),
            "d_ff": int(get(*_EXPERT_WIDTH[family])),
        },
        "router": _router(raw, family),
        "shared_expert_d_ff": 0,
        "moe_layer_ids": _moe_layer_ids(raw, family, n_layers),
        "rope_theta": _rope_theta(raw),
        "norm_eps": float(raw.get("rms_norm_eps") or 1e-6),
        "tie_embeddings": bool(raw.get("tie_word_embeddings", False)),
        "doc_separator": _doc_separator(raw, vocab_size, file),
        "dtype": raw.get("dtype") or raw.get("torch_dtype"),
        "router_jitter_noise": float(raw.get("router_jitter_noise") or 0.0),
    }
    if family == "qwen2_moe":
        info["shared_expert_d_ff"] = int(get("shared_expert_intermediate_size"))
    if not info["moe_layer_ids"]:
        raise MoestackError(f"{file}: no decoder layer has a sparse-MoE block (mlp_only_layers)")
    moe = info["moe"]
    if not 1 <= moe["top_k"] <= moe["num_experts"]:
        raise MoestackError(
            f"{file}: num_experts_per_tok={moe['top_k']} is not in [1, {moe['num_experts']}]"
        )
    return info


def model_config_kwargs(info: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig keyword arguments in a ``read_hf_config`` result."""
    return {key: info[key] for key in MODEL_CONFIG_KEYS}
