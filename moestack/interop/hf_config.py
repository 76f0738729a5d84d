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
cannot represent, a missing key, a value of the wrong type, two spellings of the expert
count that disagree) is one ``MoestackError`` line naming the file or family. A count or
size is a JSON integer (``whole_number``; 2.5, "2" or [2] are refused, never rounded), as
transformers 5 requires too. What transformers itself refuses while reading or building a
folder's model (its own typed config fields) becomes the same kind of line
(``transformers_refusal``).
``weight_files`` and ``shard_map`` read the shard index, whose every file name must stay
inside the folder (``shard_path``): the index is read from disk, and neither the loader nor
the expert-store writer may be led to a file elsewhere.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
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
# 5.x writes Qwen3-MoE's expert count as num_local_experts, 4.x as num_experts); the
# expert count's spellings must agree where several are present (``_num_experts``).
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


@contextlib.contextmanager
def transformers_refusal(what: str) -> Iterator[None]:
    """Around transformers reading a folder or building its model: what transformers refuses
    (a file it cannot read; a config.json value of the wrong type, which transformers 5
    checks field by field with huggingface_hub's strict dataclasses) becomes one MoestackError
    line, ``what: the reason`` (the reason's first two lines: a strict-field error names the
    field on its second)."""
    from huggingface_hub.errors import StrictDataclassError

    try:
        yield
    except (OSError, ValueError, TypeError, RuntimeError, KeyError, StrictDataclassError) as err:
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        raise MoestackError(f"{what}: {' '.join(lines[:2]) or type(err).__name__}") from err


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


def whole_number(value: Any, field: str, file: Path, minimum: int | None = 1) -> int:
    """``value`` of ``field`` in ``file``, a JSON integer >= ``minimum`` (None: any): the
    one rule for the counts, sizes and token ids of a config.json. MoestackError naming the
    file, the field and the value otherwise (a float, a string, a list or a bool is never
    converted)."""
    whole = isinstance(value, int) and not isinstance(value, bool)
    if whole and (minimum is None or value >= minimum):
        return value
    wanted = "a whole number" if minimum is None else f"a whole number >= {minimum}"
    raise MoestackError(
        f"{file}: {field}={json.dumps(value)} is not {wanted}; write it as an integer "
        "(re-save the model)"
    )


def whole_numbers(value: Any, field: str, file: Path, minimum: int | None = 0) -> list[int]:
    """``value`` of ``field`` in ``file``, a JSON list of integers >= ``minimum`` (each as
    ``whole_number``); MoestackError naming the file, the field and the value otherwise."""
    if not isinstance(value, list):
        raise MoestackError(
            f"{file}: {field}={json.dumps(value)} is not a list of whole numbers; write it "
            "as one, e.g. [0, 1] (re-save the model)"
        )
    return [whole_number(item, f"{field} entry", file, minimum) for item in value]


def _number(value: Any, field: str, file: Path) -> float:
    """``value`` of ``field`` in ``file``, a JSON number; MoestackError naming them otherwise."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise MoestackError(f"{file}: {field}={json.dumps(value)} is not a number (re-save the model)")


def _get(raw: dict[str, Any], keys: tuple[str, ...], file: Path, family: str) -> tuple[str, Any]:
    """(key, value) of the first of ``keys`` present in ``raw``; MoestackError naming them
    otherwise."""
    for key in keys:
        if raw.get(key) is not None:
            return key, raw[key]
    names = " or ".join(repr(k) for k in keys)
    raise MoestackError(f"{file} lacks {names}, which model_type {family!r} needs; re-save it")


def _num_experts(raw: dict[str, Any], file: Path, family: str) -> int:
    """The routed expert count; its spellings (``_NUM_EXPERTS``) must agree where several are
    present (transformers reads one of them, moestack the first: they would disagree)."""
    given = {key: raw[key] for key in _NUM_EXPERTS if raw.get(key) is not None}
    if len(set(map(json.dumps, given.values()))) > 1:
        shown = " and ".join(f"{key}={json.dumps(value)}" for key, value in given.items())
        raise MoestackError(
            f"{file}: {shown} disagree (one expert count, written in {len(given)} fields); "
            "keep one, or set each to the number of experts the weights hold"
        )
    key, value = _get(raw, _NUM_EXPERTS, file, family)
    return whole_number(value, key, file)


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


def _moe_layer_ids(raw: dict[str, Any], family: str, n_layers: int, file: Path) -> list[int]:
    """Decoder layers with a sparse-MoE block (Qwen MoE may keep some layers dense)."""
    if family not in ("qwen2_moe", "qwen3_moe"):
        return list(range(n_layers))
    dense = set(whole_numbers(raw.get("mlp_only_layers") or [], "mlp_only_layers", file))
    step = whole_number(raw.get("decoder_sparse_step") or 1, "decoder_sparse_step", file)
    return [i for i in range(n_layers) if i not in dense and (i + 1) % step == 0]


def _doc_separator(raw: dict[str, Any], vocab_size: int, file: Path) -> int:
    """The EOS token id (the first of a list), -1 when there is none in the vocabulary."""
    eos = raw.get("eos_token_id")
    if isinstance(eos, list):
        ids = whole_numbers(eos, "eos_token_id", file, minimum=None)
        eos = ids[0] if ids else None
    if eos is None:
        return -1
    if not 0 <= whole_number(eos, "eos_token_id", file, minimum=None) < vocab_size:
        log.warning(
            "%s: eos_token_id=%s is outside the vocabulary [0, %d); documents will not be "
            "separated for the router losses",
            file,
            eos,
            vocab_size,
        )
        return -1
    return eos


def _rope_theta(raw: dict[str, Any], file: Path) -> float:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = raw.get("rope_theta") or (params.get("rope_theta") if isinstance(params, dict) else 0)
    return _number(theta or 10000.0, "rope_theta", file)


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
    _check_activation(raw, file)

    def get(*keys: str) -> int:
        key, value = _get(raw, keys, file, family)
        return whole_number(value, key, file)

    def optional(key: str, default: int) -> int:
        value = raw.get(key)
        return default if value is None else whole_number(value, key, file)

    vocab_size, d_model = get("vocab_size"), get("hidden_size")
    n_layers, n_heads = get("num_hidden_layers"), get("num_attention_heads")
    info: dict[str, Any] = {
        "family": family,
        "path": str(folder),
        "architectures": list(raw.get("architectures") or []),
        "vocab_size": vocab_size,
        "d_model": d_model,
        "n_layers": n_layers,
        "n_heads": n_heads,
        "n_kv_heads": optional("num_key_value_heads", n_heads),
        "head_dim": optional("head_dim", d_model // n_heads),
        "max_seq_len": get("max_position_embeddings"),
        "moe": {
            "num_experts": _num_experts(raw, file, family),
            "top_k": get("num_experts_per_tok"),
            "d_ff": get(*_EXPERT_WIDTH[family]),
        },
        "router": _router(raw, family),
        "shared_expert_d_ff": 0,
        "moe_layer_ids": _moe_layer_ids(raw, family, n_layers, file),
        "rope_theta": _rope_theta(raw, file),
        "norm_eps": _number(raw.get("rms_norm_eps") or 1e-6, "rms_norm_eps", file),
        "tie_embeddings": bool(raw.get("tie_word_embeddings", False)),
        "doc_separator": _doc_separator(raw, vocab_size, file),
        "dtype": raw.get("dtype") or raw.get("torch_dtype"),
        "router_jitter_noise": _number(
            raw.get("router_jitter_noise") or 0.0, "router_jitter_noise", file
        ),
    }
    if family == "qwen2_moe":
        info["shared_expert_d_ff"] = get("shared_expert_intermediate_size")
    _check_sparse(info, file)
    return info


def _check_activation(raw: dict[str, Any], file: Path) -> None:
    """Refuse experts whose activation is not SiLU: moestack's experts are SwiGLU."""
    if raw.get("hidden_act", "silu") != "silu":
        raise MoestackError(
            f"{file}: hidden_act={raw['hidden_act']!r}; moestack experts are SwiGLU (silu)"
        )


def _check_sparse(info: dict[str, Any], file: Path) -> None:
    """Refuse a config without a sparse-MoE layer, or whose top-k is not in [1, experts]."""
    if not info["moe_layer_ids"]:
        raise MoestackError(f"{file}: no decoder layer has a sparse-MoE block (mlp_only_layers)")
    moe = info["moe"]
    if not 1 <= moe["top_k"] <= moe["num_experts"]:
        raise MoestackError(
            f"{file}: num_experts_per_tok={moe['top_k']} is not in [1, {moe['num_experts']}]"
        )


def model_config_kwargs(info: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig keyword arguments in a ``read_hf_config`` result."""
    return {key: info[key] for key in MODEL_CONFIG_KEYS}
