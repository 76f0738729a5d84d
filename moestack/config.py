"""The configuration of a run: each part's config, assembled and checked together.

Each part of the stack defines its config beside the class it configures, and that config
builds its part: ``MoEConfig`` (moestack.moe), ``RouterConfig`` (moestack.router),
``ModelConfig`` (moestack.model, moestack's own model), ``HFModelConfig``
(moestack.interop.hf_model, a transformers model folder), ``CacheConfig``
(moestack.cache.expert_cache). This module re-exports them, holds the sections of the
optimizer, data, telemetry and parallelism, and assembles everything into ``TrainConfig``,
which checks the values that depend on more than one section. Every field
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
from moestack.cache.policies import check_policy, default_capacities, default_capacity
from moestack.checks import check as _check
from moestack.checks import coerce as _coerce
from moestack.errors import MoestackError
from moestack.interop.hf_model import HF_PATH_REQUIRED, HFModelConfig
from moestack.lora import LoRAConfig
from moestack.metrics import check_wandb_mode
from moestack.model import CHECKPOINTING, TRAINABLE, ModelConfig
from moestack.moe import MOE_IMPLS, MoEConfig
from moestack.populations import MASTER, POPULATIONS, PopulationConfig, population_field
from moestack.router import ROUTER_SCORES, RouterConfig

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

OPTIMIZERS = ("adamw", "offload_adamw", "tiered")
DATA_SOURCES = ("stdlib", "files", "hf")


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


@dataclass
class OptimConfig:
    """Optimizer, learning-rate schedule and gradient clipping."""

    # "adamw" (torch.optim.AdamW), "offload_adamw" (host state, sharded) or "tiered" (state
    # sized per parameter population: the fields from clip_update on; docs/optim.md)
    name: str = "adamw"
    lr: float = 3e-3  # peak learning rate
    betas: tuple[float, float] = (0.9, 0.95)  # Adam moment decay rates
    eps: float = 1e-8  # Adam epsilon
    weight_decay: float = 0.1  # decoupled weight decay on matrices (not norms or biases)
    warmup_steps: int = 30  # linear warm-up from 0 to lr
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at the last step
    grad_clip: float = 1.0  # clip gradients to this global norm (0 = off)
    offload: str = "cpu"  # offload_adamw: where state lives ("cpu")
    shard: bool = True  # offload_adamw: shard state over data-parallel ranks (ZeRO-1)
    overlap: bool = True  # offload_adamw: overlap host copies with compute
    skip_idle_experts: bool = False  # offload_adamw: skip experts that got no tokens
    moment_dtype: str = "float32"  # offload_adamw: "float32" or "bfloat16" host moments
    # offload_adamw: the one-pass host step: "auto" (the native C++ kernel, else
    # torch.compile, else the reference), "native", "compile" or "off" (the reference path)
    fused_step: str = "auto"
    # offload_adamw: 1 runs the host update of step t while step t+1 computes (whose forward
    # and backward see the weights before it: one step stale; docs/optim.md), 0 is exact
    update_delay: int = 0
    delay_warmup: int = 1  # offload_adamw with update_delay: the first steps that run exact
    # offload_adamw: step bucket by bucket as gradients land, weights back per bucket, the
    # next forward waiting per layer (docs/optim.md): "auto" (on a GPU, one process, exact
    # updates), true (also on the CPU) or false (one serial step)
    pipeline: Any = "auto"
    bucket_mb: float = 32.0  # offload_adamw with the pipeline: megabytes of gradients a bucket
    # offload_adamw, sharded over several ranks: reduce-scatter the gradients and all-gather
    # the new weights on the devices (NCCL), each rank copying only its shard to the host:
    # "auto" (on GPUs), true (also CPU parameters over gloo) or false (collectives on the host)
    reduce_on_device: Any = "auto"
    # dtype of the model's weights and gradients on the device: "auto" is bfloat16 for
    # offload_adamw and tiered on CUDA (the fp32 master copy, if any, lives elsewhere), and for
    # tiered with master=none on every device; float32 otherwise.
    param_dtype: str = "auto"
    # tiered: the RMS threshold of each matrix's update (each expert's on its own; 0 = off)
    clip_update: float = 1.0
    # tiered: "float32" keeps an fp32 master copy of bf16 weights; "none" keeps bf16 precision
    # only, each fp32 update stochastically rounded (bf16 weights; or, with
    # param_dtype=float32, on the bf16 grid in fp32 storage, for a CPU)
    master: str = "none"
    # tiered: the state of each parameter population (momentum, second_moment, weight_decay)
    experts: PopulationConfig = population_field("experts")
    routers: PopulationConfig = population_field("routers")
    embeddings: PopulationConfig = population_field("embeddings")
    backbone: PopulationConfig = population_field("backbone")
    adapters: PopulationConfig = population_field("adapters")

    def __post_init__(self) -> None:
        self._check_tiered()
        _check(
            self.name in OPTIMIZERS, f"optim.name={self.name!r} is unknown; use one of {OPTIMIZERS}"
        )
        _check(self.lr > 0, f"optim.lr={self.lr} must be > 0")
        betas = tuple(self.betas)
        _check(
            len(betas) == 2 and all(0 <= b < 1 for b in betas),
            f"optim.betas={list(betas)} must be two numbers in [0, 1)",
        )
        self.betas = (float(betas[0]), float(betas[1]))
        _check(self.eps > 0, f"optim.eps={self.eps} must be > 0")
        _check(self.weight_decay >= 0, f"optim.weight_decay={self.weight_decay} must be >= 0")
        _check(self.warmup_steps >= 0, f"optim.warmup_steps={self.warmup_steps} must be >= 0")
        _check(0 <= self.min_lr_ratio <= 1, f"optim.min_lr_ratio={self.min_lr_ratio} not in [0,1]")
        _check(self.grad_clip >= 0, f"optim.grad_clip={self.grad_clip} must be >= 0 (0 = off)")
        _check(
            self.fused_step in ("auto", "native", "compile", "off"),
            f"optim.fused_step={self.fused_step!r}; use 'auto', 'native', 'compile' or 'off'",
        )
        _check(
            self.moment_dtype in ("float32", "bfloat16"),
            f"optim.moment_dtype={self.moment_dtype!r}; use 'float32' or 'bfloat16'",
        )
        _check(
            self.param_dtype in ("auto", "float32", "bfloat16"),
            f"optim.param_dtype={self.param_dtype!r}; use 'auto', 'float32' or 'bfloat16'",
        )
        _check(
            self.update_delay in (0, 1),
            f"optim.update_delay={self.update_delay}; use 0 (exact) or 1 (one step delayed)",
        )
        _check(
            self.update_delay == 0 or self.name == "offload_adamw",
            f"optim.update_delay={self.update_delay} delays the host update of "
            f"optim=offload_adamw; optim={self.name} has none (use optim=offload_adamw)",
        )
        _check(self.delay_warmup >= 0, f"optim.delay_warmup={self.delay_warmup} must be >= 0")
        _check(
            isinstance(self.pipeline, bool) or self.pipeline == "auto",
            f"optim.pipeline={self.pipeline!r}; use auto, true or false",
        )
        _check(self.bucket_mb > 0, f"optim.bucket_mb={self.bucket_mb} must be > 0")
        _check(
            isinstance(self.reduce_on_device, bool) or self.reduce_on_device == "auto",
            f"optim.reduce_on_device={self.reduce_on_device!r}; use auto, true or false",
        )

    def policy(self, population: str) -> PopulationConfig:
        """The state policy of ``population`` (optim=tiered)."""
        return getattr(self, population)

    def _check_tiered(self) -> None:
        for population in POPULATIONS:
            setattr(self, population, _coerce(getattr(self, population), PopulationConfig))
            self.policy(population).check(population)
        _check(
            self.master in MASTER, f"optim.master={self.master!r} is unknown; use one of {MASTER}"
        )
        _check(
            self.clip_update >= 0, f"optim.clip_update={self.clip_update} must be >= 0 (0 = off)"
        )


@dataclass
class DataConfig:
    """Where training text comes from and how it is cut into sequences."""

    source: str = "stdlib"  # "stdlib" (Python's own library), "files" (paths), "hf" (a hub dataset)
    paths: list[str] = field(default_factory=list)  # source=files: .txt/.py/.md, .jsonl, .parquet
    text_field: str = "text"  # jsonl/parquet/hf: the column holding the text
    hf_name: str = ""  # source=hf: dataset name, e.g. "roneneldan/TinyStories" (needs network)
    hf_split: str = "train"  # source=hf: split to read
    val_fraction: float = 0.05  # share of documents (by hash of their name) held out
    seq_len: int = 256  # tokens per training sequence
    # cap on the corpus in whole documents (0 = all of it): each split takes documents until
    # it holds its share (validation val_fraction of it), its last document kept whole
    max_bytes: int = 0

    def __post_init__(self) -> None:
        _check(
            self.source in DATA_SOURCES,
            f"data.source={self.source!r} is unknown; use one of {DATA_SOURCES}",
        )
        _check(
            self.source != "files" or len(self.paths) > 0,
            "data.source=files needs data.paths=[...] (text, jsonl or parquet files or folders)",
        )
        _check(
            self.source != "hf" or bool(self.hf_name),
            "data.source=hf needs data.hf_name=<dataset>",
        )
        _check(0 < self.val_fraction < 1, f"data.val_fraction={self.val_fraction} not in (0, 1)")
        _check(self.seq_len >= 2, f"data.seq_len={self.seq_len} must be >= 2")
        _check(self.max_bytes >= 0, f"data.max_bytes={self.max_bytes} must be >= 0")


@dataclass
class TelemetryConfig:
    """Routing telemetry during training: which cache policies and sizes to replay."""

    enabled: bool = True  # attach telemetry to the model during training
    policies: list[str] = field(default_factory=lambda: ["lru", "static"])  # replayed policies
    capacities: list[int] = field(default_factory=list)  # cache sizes, experts/layer ([] = k, 2k)
    trace_dir: str = ""  # stream the routing trace here ("" = <run dir>/trace)

    def __post_init__(self) -> None:
        for policy in self.policies:
            check_policy(policy, "telemetry.policies")
        for capacity in self.capacities:
            _check(capacity >= 1, f"telemetry.capacities has {capacity}; each must be >= 1")


@dataclass
class ParallelConfig:
    """How the ranks of a torchrun job share the work (docs/parallel.md)."""

    # expert-parallel degree: each group of ep ranks splits every MoE layer's experts
    # (num_experts / ep whole experts per rank) and moves tokens to them by all-to-all; the
    # world is world_size / ep data-parallel groups of ep ranks (1 = data parallel only)
    ep: int = 1
    # with ep > 1, host allocations of this many KiB and more get mappings of their own,
    # returned to the OS when freed (glibc's heap keeps freed blocks: 0.25 GB a process at
    # ep=4 in BENCHMARKS.md); 0 keeps glibc's behaviour (moestack.host_allocator)
    host_mmap_threshold_kb: int = 128

    def __post_init__(self) -> None:
        _check(
            0 <= self.host_mmap_threshold_kb <= 32768,
            f"parallel.host_mmap_threshold_kb={self.host_mmap_threshold_kb}: use 0 (glibc's "
            "default) to 32768 (glibc's largest, 32 MiB)",
        )


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
            not (self.compile and isinstance(self.model, HFModelConfig)),
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
        """The loop's counts: steps, batches and intervals >= 1; cadences and threads >= 0."""
        for name in ("steps", "batch_size", "grad_accum", "eval_batches", "log_every", "keep_last"):
            value = getattr(self, name)
            _check(value >= 1, f"{name}={value} must be >= 1")
        for name in ("eval_every", "ckpt_every", "threads"):
            value = getattr(self, name)
            _check(value >= 0, f"{name}={value} must be >= 0")

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
        isinstance(model, HFModelConfig) or experts % ep == 0,
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
