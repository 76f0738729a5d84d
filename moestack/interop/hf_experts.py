"""Read a transformers MoE model folder's routed experts one at a time, in moestack layout.

``iter_hf_experts(DIR)`` yields ``(layer, expert, {"w1": [D, 2F], "w2": [F, D]})`` for every
routed expert: ``layer`` is the MoE layer's position among the sparse layers (0..n-1, the
order of ``HFMoEModel.moe_layers`` and of an expert store), ``w1`` the gate projection in
its first F columns and the up projection in the last F, ``w2`` the down projection. Each
tensor is read from the safetensors files on its own (``safe_open`` slices of memory-mapped
files), so an expert store can be written from a model far larger than memory.

Checkpoint layouts read (one model may be sharded, with model.safetensors.index.json):
per-expert ``...layers.L.mlp.experts.E.{gate,up,down}_proj.weight`` (what transformers
4.x and 5.x write for Qwen2/3-MoE and OLMoE), Mixtral's ``...block_sparse_moe.experts.E.
{w1,w3,w2}.weight``, and the fused 5.x in-memory layout ``...experts.gate_up_proj [E, 2F,
D]`` / ``experts.down_proj [E, D, F]``.

``check_weights(DIR)`` runs before any tensor is read (by ``iter_hf_experts`` and by
``load_hf_moe``): the safetensors headers must be whole (``hf_weights.folder_tensors``: a
truncated shard names its file and tensor; the shard index may not leave the folder), the
experts stored in one layout (a folder holding both per-expert and fused tensors is
refused, naming one of each) and each routed-expert tensor must have the shape config.json
implies, else one MoestackError naming the file and the tensor.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from moestack.errors import MoestackError
from moestack.interop.hf_config import read_hf_config
from moestack.interop.hf_weights import TensorHeader, folder_tensors
from moestack.meta_load import TensorReader

_EXPERT_KEY = re.compile(r"^(?:.*\.)?layers\.(\d+)\.[A-Za-z_]+\.experts\.(.+)$")
_FUSED = ("gate_up_proj", "down_proj")
_PER_EXPERT = re.compile(r"^(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_ROLE = {
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
    "w1": "gate",  # Mixtral
    "w3": "up",
    "w2": "down",
}


def key_files(folder: Path) -> dict[str, Path]:
    """Every tensor name of the checkpoint and the file holding it (the headers checked:
    ``hf_weights.folder_tensors``)."""
    return {key: header.file for key, header in folder_tensors(folder).items()}


def _expected_shape(
    suffix: str, num_experts: int, d_model: int, d_ff: int
) -> tuple[int, ...] | None:
    """The shape config.json implies for an expert tensor (its key after ``experts.``)."""
    fused = {"gate_up_proj": (num_experts, 2 * d_ff, d_model),
             "down_proj": (num_experts, d_model, d_ff)}  # fmt: skip
    name = suffix.removesuffix(".weight")
    if name in fused:
        return fused[name]
    match = _PER_EXPERT.match(suffix)
    if match is None:
        return None
    return (d_model, d_ff) if _ROLE[match.group(2)] == "down" else (d_ff, d_model)


def check_expert_shapes(info: dict[str, Any], tensors: dict[str, TensorHeader]) -> None:
    """Refuse a routed-expert tensor whose shape is not the one config.json implies, naming
    its file and key, before any of it is read (per-expert gate/up ``[F, D]``, down ``[D,
    F]``; fused gate_up ``[E, 2F, D]``, down ``[E, D, F]``)."""
    moe = info["moe"]
    for key, header in tensors.items():
        match = _EXPERT_KEY.match(key)
        if match is None:
            continue
        want = _expected_shape(match.group(2), moe["num_experts"], info["d_model"], moe["d_ff"])
        if want is not None and header.shape != want:
            raise MoestackError(
                f"{header.file}: expert tensor {key} has shape {header.shape}, config.json "
                f"(hidden_size={info['d_model']}, expert width {moe['d_ff']}, "
                f"{moe['num_experts']} experts) implies {want}; the weights do not match the "
                "config (re-save the model)"
            )


def check_one_layout(tensors: dict[str, TensorHeader]) -> None:
    """Refuse a folder whose routed experts are stored both per expert (``experts.N.
    gate_proj``...) and fused (``experts.gate_up_proj`` / ``down_proj``), naming a tensor
    of each: transformers' loader fails on such a folder, and a reader taking one layout
    would serve it while the other, with other values, is what someone else reads."""
    layouts: dict[str, dict[int, str]] = {"per_expert": {}, "fused": {}}  # layer -> a key
    for key in sorted(tensors):
        match = _EXPERT_KEY.match(key)
        if match is None:
            continue
        fused = match.group(2).removesuffix(".weight") in _FUSED
        if fused or _PER_EXPERT.match(match.group(2)):
            layouts["fused" if fused else "per_expert"].setdefault(int(match.group(1)), key)
    if layouts["per_expert"] and layouts["fused"]:
        both = sorted(set(layouts["per_expert"]) & set(layouts["fused"]))  # same layer first
        per, fused = (
            (layouts["per_expert"][both[0]], layouts["fused"][both[0]])
            if both
            else (min(layouts["per_expert"].values()), min(layouts["fused"].values()))
        )
        files = dict.fromkeys(str(tensors[k].file) for k in (per, fused))
        raise MoestackError(
            f"{' and '.join(files)}: the experts are stored twice, per expert ({per}) and "
            f"fused ({fused}); which one is read would depend on the reader: keep one "
            "layout (re-save the model, or delete the other tensors)"
        )


def check_weights(path: str | Path) -> dict[str, Path]:
    """The model folder's {tensor name: file}, once its safetensors headers are whole, its
    experts are stored in one layout (``check_one_layout``) and its expert tensors have the
    shapes config.json implies (MoestackError naming the file and the tensor otherwise).
    Reads headers only: run before any weight is read."""
    info = read_hf_config(path)
    tensors = folder_tensors(Path(info["path"]))
    check_one_layout(tensors)
    check_expert_shapes(info, tensors)
    return {key: header.file for key, header in tensors.items()}


def is_expert_key(key: str) -> bool:
    """A routed expert's tensor (``...layers.L.<block>.experts.<rest>``), in any layout."""
    return _EXPERT_KEY.match(key) is not None


def _expert_keys(keys: dict[str, Path]) -> dict[int, dict[str, str]]:
    """{decoder layer: {key suffix after 'experts.': full key}} of the routed experts."""
    layers: dict[int, dict[str, str]] = {}
    for key in keys:
        match = _EXPERT_KEY.match(key)
        if match:
            layers.setdefault(int(match.group(1)), {})[match.group(2)] = key
    return layers


def _layer_plan(
    suffixes: dict[str, str], num_experts: int, layer: int, folder: Path
) -> dict[str, Any]:
    """How one layer is stored: {"fused": {gate_up, down}} or {"per_expert": [{gate, up,
    down}, ...]}; MoestackError naming the layer and the missing tensor otherwise."""
    fused = {name: suffixes.get(name) or suffixes.get(f"{name}.weight") for name in _FUSED}
    if all(fused.values()):
        return {"fused": fused}
    experts: list[dict[str, str]] = [{} for _ in range(num_experts)]
    for suffix, key in suffixes.items():
        match = _PER_EXPERT.match(suffix)
        if match and int(match.group(1)) < num_experts:
            experts[int(match.group(1))][_ROLE[match.group(2)]] = key
    for e, roles in enumerate(experts):
        missing = {"gate", "up", "down"} - set(roles)
        if missing:
            raise MoestackError(
                f"{folder}: layer {layer} expert {e} has no {'/'.join(sorted(missing))} "
                "projection in the checkpoint (expected experts.N.gate_proj/up_proj/down_proj, "
                "w1/w3/w2, or fused experts.gate_up_proj/down_proj)"
            )
    return {"per_expert": experts}


def _check_shapes(w1: torch.Tensor, w2: torch.Tensor, d_model: int, d_ff: int, where: str) -> None:
    if tuple(w1.shape) != (d_model, 2 * d_ff) or tuple(w2.shape) != (d_ff, d_model):
        raise MoestackError(
            f"{where}: expert weights are w1 {tuple(w1.shape)} / w2 {tuple(w2.shape)}, "
            f"config.json says [{d_model}, {2 * d_ff}] / [{d_ff}, {d_model}]"
        )


def _read_expert(reader: TensorReader, plan: dict[str, Any], e: int) -> dict[str, torch.Tensor]:
    """Expert ``e`` of one layer as {"w1": [D, 2F], "w2": [F, D]}."""
    if "fused" in plan:
        gate_up_2FD = reader.row(plan["fused"]["gate_up_proj"], e)
        down_DF = reader.row(plan["fused"]["down_proj"], e)
        return {"w1": gate_up_2FD.t().contiguous(), "w2": down_DF.t().contiguous()}
    keys = plan["per_expert"][e]
    gate_FD, up_FD = reader.tensor(keys["gate"]), reader.tensor(keys["up"])
    w1 = torch.cat([gate_FD.t(), up_FD.t()], dim=1).contiguous()
    return {"w1": w1, "w2": reader.tensor(keys["down"]).t().contiguous()}


def iter_hf_experts(
    path: str | Path, experts: range | None = None
) -> Iterator[tuple[int, int, dict[str, torch.Tensor]]]:
    """Yield ``(layer, expert, {"w1", "w2"})`` for every routed expert of the model folder
    ``path`` (or the ``experts`` ids only: only their bytes are read), layer by layer,
    expert by expert (see the module docstring)."""
    info = read_hf_config(path)
    folder = Path(info["path"])
    keys = check_weights(folder)
    layers = _expert_keys(keys)
    want = info["moe_layer_ids"]
    if sorted(layers) != want:
        raise MoestackError(
            f"{folder}: the checkpoint has routed experts in decoder layers {sorted(layers)}, "
            f"config.json implies {want}; the weights do not match the config"
        )
    num_experts, d_ff = info["moe"]["num_experts"], info["moe"]["d_ff"]
    for layer, decoder_layer in enumerate(want):
        plan = _layer_plan(layers[decoder_layer], num_experts, decoder_layer, folder)
        # the files opened (memory-mapped) for one layer, closed before the next: a mapping
        # keeps the pages read through it resident, which would add up to the whole folder
        with contextlib.ExitStack() as stack:
            reader = TensorReader(keys, stack)
            for e in range(num_experts) if experts is None else experts:
                tensors = _read_expert(reader, plan, e)
                where = f"{folder}: layer {decoder_layer} expert {e}"
                _check_shapes(tensors["w1"], tensors["w2"], info["d_model"], d_ff, where)
                yield layer, e, tensors


def iter_hf_expert_layers(
    path: str | Path, dtype: torch.dtype | None = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(w1 [E, D, 2F], w2 [E, F, D])`` per MoE layer, in layer order, filled from
    ``iter_hf_experts``: one layer in memory at a time (``ExpertStore.write_layers``), in
    ``dtype`` if given (else the checkpoint's)."""
    num_experts = read_hf_config(path)["moe"]["num_experts"]
    w1_EDF = w2_EFD = None
    for _layer, expert, weights in iter_hf_experts(path):
        if expert == 0:
            if w1_EDF is not None:
                yield w1_EDF, w2_EFD
                w1_EDF = w2_EFD = None  # freed before the next layer is allocated
            as_dtype = dtype or weights["w1"].dtype  # the copies below cast into it
            w1_EDF = weights["w1"].new_empty((num_experts, *weights["w1"].shape), dtype=as_dtype)
            w2_EFD = weights["w2"].new_empty((num_experts, *weights["w2"].shape), dtype=as_dtype)
        w1_EDF[expert] = weights["w1"]
        w2_EFD[expert] = weights["w2"]
    if w1_EDF is not None:
        yield w1_EDF, w2_EFD


@torch.no_grad()
def fill_expert_rows(model: Any, path: str | Path) -> None:
    """Read into each MoE layer of ``model`` (``model.moe_layers``) the experts it holds,
    rows ``expert_offset`` onwards (expert parallelism: a rank's block), from the model
    folder ``path``; no other expert is read."""
    layers = model.moe_layers
    held = {(moe.expert_offset, moe.w1.shape[0]) for moe in layers}
    if len(held) != 1:
        raise ValueError(f"the MoE layers hold different experts {sorted(held)}")
    lo, count = held.pop()
    for layer, e, tensors in iter_hf_experts(path, range(lo, lo + count)):
        layers[layer].w1[e - lo].copy_(tensors["w1"])
        layers[layer].w2[e - lo].copy_(tensors["w2"])
