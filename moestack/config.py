"""The configuration of a run: each part's config, assembled and checked together.

Each part of the stack defines its config beside the class it configures, and that config
builds its part: ``MoEConfig`` (moestack.moe), ``RouterConfig`` (moestack.router),
``ModelConfig`` (moestack.model, moestack's own model), ``HFModelConfig``
(moestack.interop.hf_model, a transformers model folder), ``CacheConfig``
(moestack.cache.expert_cache), ``LoRAConfig`` (moestack.lora), ``OptimConfig``
(moestack.optim.config), ``DataConfig`` (moestack.data), ``TelemetryConfig``
(moestack.telemetry.config) and ``ParallelConfig`` (moestack.parallel.config). This module
re-exports them and assembles them into ``TrainConfig``, which nests them and checks the
values that depend on more than one section. Every field
has a default (the tiny CPU model and the default training run); a bad value raises
``ValueError`` naming the field and the fix when the config is built, so it fails at
start-up, not deep inside a training step. Nothing here reads a file or builds a model; a
transformers model's architecture is read from its folder by ``TrainConfig.resolve``, where a
run is built. The dataclasses are registered as hydra structured configs
(``register_configs``) and used directly from Python. Nothing this module imports imports it.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from moestack.cache.expert_cache import CacheConfig
from moestack.cache.policies import default_capacities, default_capacity
from moestack.checks import check as _check
from moestack.checks import coerce as _coerce
from moestack.data import DATA_SOURCES, DataConfig
from moestack.errors import MoestackError
from moestack.interop.hf_model import HF_PATH_REQUIRED, HFModelConfig
from moestack.lora import LoRAConfig
from moestack.model import CHECKPOINTING, TRAINABLE, ModelConfig
from moestack.moe import MOE_IMPLS, MoEConfig
from moestack.optim.config import OPTIMIZERS, OptimConfig
from moestack.parallel.config import ParallelConfig
from moestack.router import ROUTER_SCORES, RouterConfig
from moestack.telemetry.config import TelemetryConfig
from moestack.wandb_run import check_wandb_mode

__all__ = [
    "CHECKPOINTING",
    "DATA_SOURCES",
    "HF_PATH_REQUIRED",
    "MOE_IMPLS",
    "OPTIMIZERS",
    "ROUTER_SCORES",
    "CacheConfig",
    "DataConfig",
    "HFModelConfig",
    "LoRAConfig",
    "ModelConfig",
    "ModelSchema",
    "MoEConfig",
    "OptimConfig",
    "ParallelConfig",
    "RouterConfig",
    "TelemetryConfig",
    "TrainConfig",
    "register_configs",
    "to_yaml",
]


@dataclass
class ModelSchema(ModelConfig):
    """The model: moestack's own decoder-only MoE transformer, or a transformers folder (path).

    The ``model`` node as the command line and a run's config.yaml write it: every field of
    moestack's ``ModelConfig`` and ``path``. Hydra's config library cannot hold a union of
    two config classes in one node, and the ``model`` group files (configs/model/*.yaml) set
    the fields of one node, so this node is the one they fill; ``TrainConfig`` makes it the
    explicit choice (``choose``): a ``ModelConfig``, or with ``path`` set an ``HFModelConfig``
    (``model=hf model.path=DIR``). Its values are checked there, by the chosen config.
    """

    # a local transformers MoE model folder (config.json, safetensors, tokenizer); "" =
    # moestack's own model. When set, its config.json fills the fields above (moe.impl and
    # the router stay yours), and the model loads with transformers, MoE blocks patched.
    path: str = ""

    def __post_init__(self) -> None:
        self.moe = _coerce(self.moe, MoEConfig)
        self.router = _coerce(self.router, RouterConfig)

    def choose(self) -> ModelChoice:
        """The config this node describes: moestack's model, or (``path`` set) a
        transformers folder, whose architecture its ``resolve`` reads from config.json."""
        if self.path:
            return HFModelConfig(
                path=self.path,
                moe=MoEConfig(impl=self.moe.impl),
                router=self.router,
                checkpointing=self.checkpointing,
            )
        names = [f.name for f in dataclasses.fields(ModelConfig)]
        return ModelConfig(**{name: getattr(self, name) for name in names})

    @classmethod
    def of(cls, model: ModelChoice) -> ModelSchema:
        """The node that ``choose`` turns back into ``model`` (a transformers model's
        architecture as read, when it has been)."""
        if isinstance(model, ModelConfig):
            return cls(**dataclasses.asdict(model))
        known = {k: v for k, v in dataclasses.asdict(model).items() if v is not None}
        return cls(**known)


ModelChoice = ModelConfig | HFModelConfig  # what TrainConfig.model holds once built


def choose_model(value: Any) -> ModelChoice:
    """``value`` as the explicit model config: a ModelConfig or HFModelConfig as it is, a
    ModelSchema (or a mapping of its fields) made into one (``ModelSchema.choose``)."""
    if isinstance(value, HFModelConfig) or type(value) is ModelConfig:
        return value
    return _coerce(value, ModelSchema).choose()


# offload_experts: where a run's frozen experts live (moestack.cache.streaming)
OFFLOAD_EXPERTS = ("off", "host", "disk")
STREAMABLE_TRAINABLE = ("routers", "lora", "routers+lora")  # the trainable= it runs with


@dataclass
class TrainConfig:
    """One training run: model, data, optimizer, loop settings, logging."""

    # moestack's model (ModelConfig) or a transformers folder (HFModelConfig) once built; the
    # command line fills a ModelSchema here (typed Any: one node cannot hold either class)
    model: Any = field(default_factory=ModelSchema)
    # The one place the router is configured (the `router` group, `router.FIELD=...`); it
    # becomes model.router, and setting model.router to something else is an error.
    router: RouterConfig = field(default_factory=RouterConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # the adapters of trainable=lora
    steps: int = 300  # optimizer steps
    batch_size: int = 16  # sequences per micro-batch: the global batch, split over the ranks
    grad_accum: int = 1  # micro-batches per optimizer step
    # evaluate validation loss every N steps (0 = only at the end), whatever log_every is:
    # in the step's metrics record when it is a log step, else in a record of its own
    eval_every: int = 100
    eval_batches: int = 8  # validation batches per evaluation
    log_every: int = 10  # write metrics every N steps
    ckpt_every: int = 100  # checkpoint every N steps (0 = only at the end)
    keep_last: int = 2  # checkpoints kept on disk
    max_bad_steps: int = 5  # consecutive NaN/inf losses before the run stops
    seed: int = 0  # seeds the model init and the data order
    device: str = "auto"  # "auto" (cuda if present), "cpu", "cuda"
    threads: int = 0  # torch CPU threads (0 = torch's default)
    resume: bool = False  # continue from the newest checkpoint in out_dir
    out_dir: str = ""  # run directory ("" = hydra's output dir, or ./runs/<time> from Python)
    wandb_project: str = ""  # wandb project ("" = $WANDB_PROJECT, else "moestack")
    wandb_mode: str = ""  # "" = WANDB_MODE or offline; "online", "offline"; "disabled" = off
    progress: bool = True  # show a progress bar
    # which weights train: "all", "routers" (the MoE routers only), "routers+experts" (and
    # the routed experts), "lora" (low-rank adapters, see lora.*) or "routers+lora"; frozen
    # weights get no gradients and no optimizer state
    trainable: str = "all"
    # compile each transformer block with torch.compile (CPU and CUDA; docs/memory.md)
    compile: bool = False
    # frozen experts streamed through the expert cache (cache.*) instead of held in memory:
    # "off", "host" (all in host memory, the cache's slots on the device) or "disk" (read
    # from the expert store as the cache misses); with trainable=routers, lora or
    # routers+lora only (docs/cache.md, "Training with streamed experts")
    offload_experts: str = "off"

    def __post_init__(self) -> None:
        self.model = choose_model(self.model)
        self.router = _coerce(self.router, RouterConfig)
        self.optim = _coerce(self.optim, OptimConfig)
        self.data = _coerce(self.data, DataConfig)
        self.cache = _coerce(self.cache, CacheConfig)
        self.telemetry = _coerce(self.telemetry, TelemetryConfig)
        self.parallel = _coerce(self.parallel, ParallelConfig)
        self.lora = _coerce(self.lora, LoRAConfig)
        self.model.router = _one_router(self.router, self.model.router)
        self._check_counts()
        _check_expert_parallel(self.parallel.ep, self.model)
        _check(self.max_bad_steps >= 1, f"max_bad_steps={self.max_bad_steps} must be >= 1")
        _check(
            self.trainable in TRAINABLE,
            f"trainable={self.trainable!r} is unknown; use one of {', '.join(TRAINABLE)}",
        )
        _check(
            not (self.trainable.endswith("lora") and self.model.moe.impl == "megablocks"),
            "trainable=lora runs the experts' adapters with moe.impl=torch or triton; "
            "megablocks has no low-rank term: use moe.impl=auto",
        )
        _check(
            not (self.compile and self.model.is_transformers),
            "compile=true compiles moestack's own model blocks, not a transformers model "
            "(model.path); use compile=false",
        )
        self._check_offload_experts()
        _check(
            self.device in ("auto", "cpu", "cuda"),
            f"device={self.device!r}; use 'auto', 'cpu' or 'cuda'",
        )
        check_wandb_mode(self.wandb_mode)
        # A transformers model's sizes are known once it is resolved (``resolve``): the
        # checks and defaults that need them wait until then.
        if self.model.resolved:
            _check(
                self.data.seq_len <= self.model.max_seq_len,
                f"data.seq_len={self.data.seq_len} exceeds model.max_seq_len="
                f"{self.model.max_seq_len}; shorten the sequences or raise max_seq_len",
            )
        _check(
            self.router.window == 0 or self.router.window_size <= self.data.seq_len,
            f"router.window_size={self.router.window_size} exceeds data.seq_len="
            f"{self.data.seq_len}; shorten the window or lengthen the sequences",
        )
        if self.model.resolved:
            experts = self.model.moe.num_experts
            _check(
                self.router.pin == 0 or self.router.pin_experts <= experts,
                f"router.pin_experts={self.router.pin_experts} exceeds model.moe.num_experts="
                f"{experts}; pin at most {experts} experts (lower router.pin_experts)",
            )
            self._cache_sizes()
            if self.trainable.endswith("lora"):
                self.lora.check_fits(self.model.d_model, self.model.moe.d_ff)

    def _check_counts(self) -> None:
        """The loop's counts: steps, batches and intervals >= 1; cadences and threads >= 0;
        one micro-batch a step where the optimizer steps in backward."""
        for name in ("steps", "batch_size", "grad_accum", "eval_batches", "log_every", "keep_last"):
            value = getattr(self, name)
            _check(value >= 1, f"{name}={value} must be >= 1")
        for name in ("eval_every", "ckpt_every", "threads"):
            value = getattr(self, name)
            _check(value >= 0, f"{name}={value} must be >= 0")
        _check(
            not self.optim.update_in_backward or self.grad_accum == 1,
            f"optim.update_in_backward=true steps in each backward, so it takes one micro-batch "
            f"a step, not grad_accum={self.grad_accum}: set grad_accum=1 (a larger batch_size)",
        )

    def _check_offload_experts(self) -> None:
        """``offload_experts`` streams experts that do not train, on one process's model."""
        _check(
            self.offload_experts in OFFLOAD_EXPERTS,
            f"offload_experts={self.offload_experts!r} is unknown; use one of "
            f"{', '.join(OFFLOAD_EXPERTS)}",
        )
        if self.offload_experts == "off":
            return
        _check(
            self.trainable in STREAMABLE_TRAINABLE,
            f"offload_experts={self.offload_experts} streams frozen experts, but "
            f"trainable={self.trainable} trains them; use trainable=routers, lora or "
            "routers+lora (or offload_experts=off)",
        )
        _check(
            self.parallel.ep == 1,
            f"offload_experts={self.offload_experts} runs with parallel.ep=1 (each rank "
            f"streams every expert), not parallel.ep={self.parallel.ep}",
        )
        _check(
            not self.compile,
            f"offload_experts={self.offload_experts} loads experts inside each MoE layer, "
            "which torch.compile cannot trace; use compile=false",
        )
        _check(
            self.cache.policy != "belady",
            f"offload_experts={self.offload_experts} streams through a live cache; "
            "cache.policy=belady is the offline bound (replay only): use lru, lfu, static "
            "or lru+static",
        )

    def _cache_sizes(self) -> None:
        """The cache sizes the model's top_k sets when none are given, and their check."""
        top_k = self.model.moe.top_k
        if self.cache.capacity == 0 and self.cache.capacity_bytes == 0:
            self.cache.capacity = default_capacity(top_k)
        if not self.telemetry.capacities:
            self.telemetry.capacities = list(default_capacities(top_k))
        _check(
            self.cache.capacity_bytes > 0 or self.cache.capacity >= self.model.moe.top_k,
            f"cache.capacity={self.cache.capacity} is smaller than moe.top_k="
            f"{self.model.moe.top_k}: one token would not fit",
        )

    def check_batch_split(self, ranks: int) -> None:
        """Refuse ``ranks`` that do not split ``batch_size`` (the global batch: each rank
        takes an equal share of every batch), naming batch sizes that do; the one rule of
        training and of ``moestack plan``."""
        if self.batch_size % ranks:
            lower = self.batch_size // ranks * ranks
            sizes = f"{lower} or {lower + ranks}" if lower else f"{ranks}"
            raise MoestackError(
                f"batch_size={self.batch_size} does not split over {ranks} ranks: each rank "
                f"takes an equal share of the global batch; use a multiple of {ranks}, "
                f"such as batch_size={sizes}"
            )

    def resolve(self) -> TrainConfig:
        """This run's config with its model resolved: a transformers model's architecture
        read from its folder's config.json (``HFModelConfig.resolve``), then every check
        and default that needs the model's sizes. Called where a run is built (training,
        loading a run); the config itself stays as it was."""
        resolved = copy.deepcopy(self)
        return dataclasses.replace(resolved, model=resolved.model.resolve())


def _check_expert_parallel(ep: int, model: ModelChoice) -> None:
    """``parallel.ep`` must be >= 1 and split the experts evenly (a transformers model's
    expert count is known when it is loaded, and checked then)."""
    _check(ep >= 1, f"parallel.ep={ep} must be >= 1 (1 = no expert parallelism)")
    experts = model.moe.num_experts
    _check(
        model.is_transformers or experts % ep == 0,
        f"parallel.ep={ep} does not divide model.moe.num_experts={experts}: every rank "
        "holds the same number of whole experts; choose an ep that divides it",
    )


def _one_router(router: RouterConfig, model_router: RouterConfig) -> RouterConfig:
    """``router`` for the model; ``model.router`` may only be left alone or repeat it (as a
    saved config.yaml does), so two router settings can never disagree."""
    if model_router not in (router, RouterConfig()):
        raise ValueError(
            f"model.router={model_router} differs from router={router}; the router is set in "
            "one place: use router=NAME and router.FIELD=VALUE, not model.router"
        )
    return router


def to_yaml(cfg: TrainConfig) -> str:
    """A run's config.yaml: ``cfg`` as the command line writes it (its model as a
    ``ModelSchema`` node), so that loading it (``ModelSchema.choose``) gives ``cfg`` back."""
    from omegaconf import OmegaConf

    node = OmegaConf.structured(cfg)
    node.model = OmegaConf.structured(ModelSchema.of(cfg.model))
    return OmegaConf.to_yaml(node)


def register_configs() -> None:
    """Register the structured configs with hydra's ConfigStore (schema for train.yaml)."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(name="train_schema", node=TrainConfig)
