"""A transformers MoE causal LM whose sparse-MoE blocks are moestack ``MoE`` layers.

``load_hf_moe(DIR)`` loads a local model folder with transformers (``local_files_only``: no
network), then replaces every sparse-MoE block with an ``HFMoEBlock``: the routed experts
and router as a moestack ``MoE`` holding the same weights (``moe_from_hf``), and, for
Qwen2-MoE, the shared expert and its sigmoid gate kept beside it. The block returns what
the transformers block returns (one tensor), so the decoder layers are untouched, and the
patched model computes the same logits as transformers' own (tested per family in fp32).

``HFMoEModel`` is a ``RoutedLM``: the training loop, router losses, telemetry, the expert
cache and OffloadAdamW see its ``moe_layers`` as they see a ``MoETransformer``'s. Tokens
are split into documents at the EOS token, and each MoE layer gets the document ids, so
the locality losses never pair tokens of different documents. The original blocks are
kept outside the module tree (their routed weights released) for ``export_hf``.

``HFModelConfig`` is the config of such a model (``model=hf model.path=DIR``), beside the
model it builds: the folder, ``moe.impl``, the router's loss weights; its ``resolve`` step
reads the architecture from the folder's config.json, called where a run is built (training,
loading a run), never while the config itself is built.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from moestack.checks import check, coerce
from moestack.errors import MoestackError
from moestack.interop.hf import family_router_config, moe_from_hf
from moestack.interop.hf_config import model_config_kwargs, read_hf_config, transformers_refusal
from moestack.interop.hf_experts import check_weights, fill_expert_rows
from moestack.interop.hf_without_experts import from_pretrained_without_experts
from moestack.model import ModelOutput, RoutedLM, check_checkpointing
from moestack.moe import MoE, MoEConfig
from moestack.router import RouterConfig

if TYPE_CHECKING:
    from moestack.data import Tokenizer

log = logging.getLogger(__name__)

# configs/model/hf.yaml's model.path until the user sets it (OmegaConf's ??? would not
# override the dataclass default in a merge, so it could not mark the field as required).
HF_PATH_REQUIRED = "<model.path=DIR is required>"

# what the memory plan says of a transformers model's figures (its notes)
HF_NOTES = (
    "model.path: weights, gradients and optimizer state are those of the model transformers "
    "builds from config.json (no weight file read), in the run's dtype",
    "model.path: the activation line is moestack's block formula at the folder's sizes "
    "(D, F, k, E, H, V), an estimate: transformers' attention (grouped KV heads, head_dim) "
    "and any dense MLP layer keep other amounts",
)


@dataclass
class HFModelConfig:
    """A local transformers MoE model folder, loaded with moestack MoE layers (model=hf)."""

    # the folder (config.json, safetensors weights, tokenizer files), made absolute so that a
    # run's config.yaml finds it from any folder
    path: str = HF_PATH_REQUIRED
    moe: MoEConfig = field(default_factory=MoEConfig)  # impl is yours, the sizes config.json's
    router: RouterConfig = field(default_factory=RouterConfig)  # loss weights (score: family's)
    checkpointing: str = "none"  # activation checkpointing is moestack's own model's: none
    # The architecture, from config.json (``resolve``); None until it is read.
    vocab_size: int | None = None
    d_model: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    max_seq_len: int | None = None
    rope_theta: float | None = None
    norm_eps: float | None = None
    tie_embeddings: bool | None = None
    doc_separator: int | None = None  # the EOS token, which ends a document (-1 = none)

    def __post_init__(self) -> None:
        self.moe = coerce(self.moe, MoEConfig)
        self.router = coerce(self.router, RouterConfig)
        check_checkpointing(self.checkpointing)
        check(
            self.checkpointing == "none",
            f"model.checkpointing={self.checkpointing!r} applies to moestack's own model, not "
            "to a transformers one (model.path); use none",
        )
        check(
            self.path not in ("", HF_PATH_REQUIRED),
            "model=hf needs model.path=DIR: a local transformers MoE model folder (config.json, "
            "safetensors weights, tokenizer files)",
        )
        self.path = str(Path(self.path).expanduser().absolute())

    @property
    def resolved(self) -> bool:
        """Whether the architecture has been read from config.json (``resolve``)."""
        return self.d_model is not None

    def resolve(self) -> HFModelConfig:
        """This config with the architecture fields read from ``path/config.json`` (plain
        JSON: no weights, no transformers); ``moe.impl`` and the router stay as they are.
        MoestackError in one line for a folder moestack cannot load."""
        return self.with_info(read_hf_config(self.path))

    def with_info(self, info: dict[str, Any]) -> HFModelConfig:
        """This config filled from a ``read_hf_config`` result."""
        fields = model_config_kwargs(info)
        moe = MoEConfig(**fields.pop("moe"), impl=self.moe.impl)
        return dataclasses.replace(self, moe=moe, **fields)

    def build(self, *, experts: bool = True, weights: bool = True) -> HFMoEModel:
        """The transformers model at ``path`` with moestack MoE layers (``load_hf_moe``);
        routers with an anchor loss take the loaded weights as their reference.
        ``experts=False`` leaves the routed experts unread, as meta tensors, for serving
        them from an expert store; ``weights=False`` (with ``experts=False``) reads no
        weight of the folder at all: every parameter stays meta, for filling from a run's
        checkpoint (``runs.load_run``)."""
        model = load_hf_moe(self.path, impl=self.moe.impl, router=self.router,
                            experts=experts, weights=weights)  # fmt: skip
        if weights:
            model.reset_anchors()
        return model

    # What a caller asks of the model's config instead of its type (ModelConfig's answers
    # are moestack's own model's).
    is_transformers = True  # a transformers model folder
    plan_notes = HF_NOTES  # what the memory plan says of its figures

    @property
    def pretrained_path(self) -> str:
        """The folder its weights and tokenizer come from (``path``)."""
        return self.path

    def describe(self) -> str:
        """The model in a few words, for a report's header: the folder and its sizes."""
        size = f"{self.n_layers}x{self.d_model}"
        return f"hf {self.path} ({size}, {self.moe.num_experts} experts, top-{self.moe.top_k})"

    def tokenizer(self) -> Tokenizer:
        """The folder's own tokenizer, the EOS token between documents (resolved config)."""
        from moestack.interop.hf_tokenizer import hf_tokenizer

        return hf_tokenizer(self.path, self.doc_separator)

    @property
    def store_shape(self) -> None:
        """None: an expert store of a folder's experts is not checked against this config
        (its ``n_layers`` counts every decoder layer, dense ones too)."""
        return None

    def build_for_run(
        self, *, seed: int, experts_on_meta: bool, from_checkpoint: bool
    ) -> HFMoEModel:
        """The training run's model: read from the folder (``experts_on_meta``: the routed
        experts left for ``fill_experts``), or nothing read (``from_checkpoint``: every
        weight comes from the run's checkpoint). ``seed``: nothing is drawn."""
        if from_checkpoint:
            return self.build_for_checkpoint()
        return self.build(experts=not experts_on_meta)

    def fill_experts(self, model: HFMoEModel, seed: int, *, resumed: bool) -> None:
        """This rank's experts of a model built with ``experts_on_meta``, read from the
        folder (their rows alone); nothing for a ``resumed`` run, whose checkpoint holds
        them."""
        if not resumed:
            fill_expert_rows(model, self.path)

    def build_for_checkpoint(self) -> HFMoEModel:
        """The model with every parameter on the meta device, no weight read, for a
        checkpoint to fill (``moestack.runs.load_run``)."""
        return self.build(experts=False, weights=False)

    def build_for_plan(self) -> HFMoEModel:
        """The model as ``build`` makes it for training (fp32, moestack MoE layers running
        ``moe.impl``, the router's losses), every parameter on the meta device, from
        config.json alone (no weight file, nor tokenizer file, is opened: a folder holding
        only config.json is planned, as accelerate's estimate-memory does from a config).
        Buffers (rotary tables, router counters) are real and small."""
        info = read_hf_config(self.path)
        hf = from_pretrained_without_experts(Path(info["path"]), torch.float32, read=False)
        patched = patch_sparse_blocks(hf, impl=self.moe.impl, router=self.router)
        router = family_router_config(info["router"]["renormalize"], self.router)
        return HFMoEModel(hf, hf_model_config(info, self.moe.impl, router), info, patched)


def document_ids(tokens_BS: torch.Tensor, separator: int) -> torch.Tensor | None:
    """Document index of each token: a separator (EOS) token ends its document; None when
    the model has no separator (``separator < 0``). Same rule as MoETransformer's."""
    if separator < 0:
        return None
    is_sep_BS = (tokens_BS == separator).long()
    return torch.cumsum(is_sep_BS, dim=1) - is_sep_BS


class HFMoEBlock(nn.Module):
    """Stands in for one transformers sparse-MoE block: ``forward(hidden [B, S, D]) ->
    [B, S, D]``, the routed part computed by ``moe`` (a moestack MoE), plus the shared
    expert scaled by ``sigmoid(shared_expert_gate(x))`` where the family has one.

    ``segment_ids`` is set by ``HFMoEModel.forward`` before each pass (the decoder layer
    calls the block with the hidden states only); ids of another shape are ignored, so a
    direct call of the transformers model (generation) still works.
    """

    def __init__(
        self,
        moe: MoE,
        shared_expert: nn.Module | None = None,
        shared_expert_gate: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.moe = moe
        self.shared_expert = shared_expert
        self.shared_expert_gate = shared_expert_gate
        self.segment_ids: torch.Tensor | None = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        segment_ids = self.segment_ids
        if segment_ids is not None and segment_ids.shape != hidden_states.shape[:-1]:
            segment_ids = None
        out = self.moe(hidden_states, segment_ids)
        if self.shared_expert is not None:
            shared = self.shared_expert(hidden_states)
            if self.shared_expert_gate is not None:
                shared = F.sigmoid(self.shared_expert_gate(hidden_states)) * shared
            out = out + shared
        return out


@dataclasses.dataclass
class _Patched:
    """Where one original block lived (for export): parent module, attribute, the block."""

    parent: nn.Module
    name: str
    original: nn.Module
    wrapper: HFMoEBlock


_ATTENTION_MODULES = ("self_attn", "attn", "attention")  # a decoder layer's attention, by name


class HFMoEModel(RoutedLM):
    """A transformers MoE causal LM with moestack MoE layers: ``forward(tokens [B, S],
    targets=None) -> ModelOutput``.

    ``hf`` is the patched transformers model (save or generate with it as usual), ``cfg``
    its HFModelConfig (resolved), ``info`` the ``read_hf_config`` dict, ``source_dir`` the
    folder it was loaded from.
    """

    def __init__(
        self, hf: nn.Module, cfg: HFModelConfig, info: dict[str, Any], patched: list[_Patched]
    ) -> None:
        super().__init__()
        self.hf = hf
        self.cfg = cfg
        self.info = info
        self.source_dir = Path(info["path"])
        self._patched = patched  # a plain list: the originals stay outside the module tree

    @property
    def moe_layers(self) -> list[MoE]:
        """The MoE layers in decoder-layer order (sparse layers only)."""
        return [p.wrapper.moe for p in self._patched]

    @property
    def blocks(self) -> list[HFMoEBlock]:
        """The blocks standing in for the transformers sparse-MoE blocks, in layer order."""
        return [p.wrapper for p in self._patched]

    def attention_projections(self) -> list[tuple[str, nn.Linear]]:
        """Every ``nn.Linear`` directly inside a decoder layer's attention module
        (``self_attn``: q/k/v/o_proj, and a family's own, such as q_a_proj)."""
        return [
            (name, module)
            for name, module in self.named_modules()
            if isinstance(module, nn.Linear)
            and name.rpartition(".")[0].rpartition(".")[2] in _ATTENTION_MODULES
        ]

    def segment_ids(self, tokens_BS: torch.Tensor) -> torch.Tensor | None:
        """Document index of each token (documents end at the EOS token)."""
        return document_ids(tokens_BS, self.cfg.doc_separator)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> ModelOutput:
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
        segment_ids_BS = self.segment_ids(tokens)
        for block in self.blocks:
            block.segment_ids = segment_ids_BS
        out = self.hf(input_ids=tokens, use_cache=False, output_router_logits=False)
        return self.lm_output(out.logits, targets)


def _is_sparse_block(module: nn.Module) -> bool:
    """A transformers sparse-MoE block: a ``gate`` (router) and ``experts`` submodule."""
    return isinstance(getattr(module, "gate", None), nn.Module) and isinstance(
        getattr(module, "experts", None), nn.Module
    )


def _sparse_blocks(hf: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, block) of every sparse-MoE block, in module (= layer) order."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in hf.named_modules():
        if _is_sparse_block(module) and not any(name.startswith(f + ".") for f, _ in found):
            found.append((name, module))
    return found


def release_routed_weights(block: nn.Module) -> None:
    """Free the router and routed-expert tensors of an original block (the MoE holds copies),
    keeping each Parameter object and its dtype so ``export_hf`` can refill it."""
    for sub in (block.gate, block.experts):
        for param in sub.parameters():
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)


def _wrap(block: nn.Module, impl: str, router: RouterConfig | None) -> HFMoEBlock:
    """An HFMoEBlock computing ``block``'s function, its shared expert (if any) shared."""
    moe = moe_from_hf(block, impl=impl, allow_shared_expert=True, router=router)
    shared = getattr(block, "shared_expert", None)
    return HFMoEBlock(moe, shared, getattr(block, "shared_expert_gate", None))


def patch_sparse_blocks(
    hf: nn.Module, impl: str = "auto", router: RouterConfig | None = None
) -> list[_Patched]:
    """Replace every sparse-MoE block of ``hf`` in place by an HFMoEBlock; the originals
    (with their routed weights released) are returned for export."""
    patched = []
    for name, block in _sparse_blocks(hf):
        parent_name, _, attr = name.rpartition(".")
        parent = hf.get_submodule(parent_name)
        wrapper = _wrap(block, impl, router)
        setattr(parent, attr, wrapper)
        release_routed_weights(block)
        patched.append(_Patched(parent, attr, block, wrapper))
    return patched


def hf_model_config(info: dict[str, Any], impl: str, router: RouterConfig) -> HFModelConfig:
    """The config of the loaded model: its architecture from config.json (``info``, read
    once), ``moe.impl`` and ``router`` as the MoE layers run them (score and renormalisation
    the family's)."""
    cfg = HFModelConfig(path=info["path"], moe=MoEConfig(impl=impl), router=router)
    return cfg.with_info(info)


def _import_transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise MoestackError(
            "loading a transformers model needs the transformers package: "
            "pip install 'transformers>=5'"
        ) from None
    return transformers


def _from_pretrained(folder: Path, dtype: torch.dtype) -> nn.Module:
    """transformers' own model from ``folder``, offline; its failure as one line."""
    transformers = _import_transformers()
    with transformers_refusal(f"transformers could not load {folder}"):
        return transformers.AutoModelForCausalLM.from_pretrained(
            folder, local_files_only=True, dtype=dtype
        )


def load_hf_moe(
    path: str | Path,
    *,
    impl: str = "auto",
    router: RouterConfig | None = None,
    dtype: torch.dtype = torch.float32,
    experts: bool = True,
    weights: bool = True,
) -> HFMoEModel:
    """Load the transformers MoE model in ``path`` with moestack MoE layers (see the module
    docstring). ``router`` gives the router losses' weights (None: all off); the score and
    renormalisation are always the family's. In eval mode, as transformers loads it.

    ``experts=False`` reads every weight but the routed experts, whose MoE ``w1``/``w2``
    stay meta tensors (no memory): for serving them from an expert store
    (``moestack.interop.hf_without_experts``); such a model only runs offloaded.

    The folder's weights are checked from their headers first (``check_weights``): a
    truncated shard, a wrongly shaped expert tensor or a shard index leaving the folder is
    one MoestackError naming the file and the tensor, whichever way the model is read."""
    info = read_hf_config(path)
    folder = Path(info["path"])
    check_weights(folder)  # headers whole, experts shaped as config.json says: one line if not
    if info["router_jitter_noise"] > 0:
        log.warning(
            "%s: router_jitter_noise=%s is not applied by moestack's MoE; training differs "
            "from transformers' Mixtral there (inference is the same)",
            folder,
            info["router_jitter_noise"],
        )
    if experts and not weights:
        raise ValueError("weights=False reads no weight, the experts neither: pass experts=False")
    if experts:
        hf = _from_pretrained(folder, dtype)
    else:
        _import_transformers()
        hf = from_pretrained_without_experts(folder, dtype, read=weights)
    patched = patch_sparse_blocks(hf, impl=impl, router=router)
    if len(patched) != len(info["moe_layer_ids"]):
        raise MoestackError(
            f"{folder}: found {len(patched)} sparse-MoE blocks in the loaded model, config.json "
            f"says {len(info['moe_layer_ids'])}; this transformers version's layout is unknown"
        )
    router_cfg = family_router_config(info["router"]["renormalize"], router)
    model = HFMoEModel(hf, hf_model_config(info, impl, router_cfg), info, patched)
    model.eval()
    log.info(
        "loaded %s (%s): %d MoE layers of %d experts, top-%d",
        folder,
        info["family"],
        len(patched),
        info["moe"]["num_experts"],
        info["moe"]["top_k"],
    )
    return model
