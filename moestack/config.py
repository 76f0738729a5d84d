"""Configuration dataclasses: one per part of the stack, every field with a default.

The defaults are the tiny CPU model and the default training run. Each dataclass checks its
own values when it is built and raises ``ValueError`` naming the field and the fix, so a bad
value fails at start-up, not deep inside a training step. They are registered as hydra
structured configs (``register_configs``) and used directly from Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MOE_IMPLS = ("auto", "triton", "torch", "megablocks")
ROUTER_SCORES = ("softmax", "sigmoid")
OPTIMIZERS = ("adamw", "offload_adamw")
DATA_SOURCES = ("stdlib", "files", "hf")
CHECKPOINTING = ("none", "moe", "block", "selective")  # model.checkpointing


# configs/model/hf.yaml's model.path until the user sets it (OmegaConf's ??? would not
# override the dataclass default in a merge, so it could not mark the field as required).
HF_PATH_REQUIRED = "<model.path=DIR is required>"


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_policy(name: str, field: str) -> None:
    """The policy names live in one registry, moestack.cache.policies (imported here, not at
    the top, because the cache package imports this module)."""
    from moestack.cache.policies import check_policy

    check_policy(name, field)


@dataclass
class RouterConfig:
    """How tokens pick experts, and the weights of the router's auxiliary losses."""

    score: str = "softmax"  # "softmax" or "sigmoid" over the router logits
    renormalize: bool = True  # rescale the top-k scores to sum to 1 per token
    load_balance: float = 0.01  # weight of the switch-style load-balance loss (0 = off)
    z_loss: float = 1e-3  # weight of the router z-loss, mean logsumexp(logits)^2 (0 = off)
    bias_update_rate: float = 0.0  # aux-loss-free balancing: bias step per update (0 = off)
    temporal: float = 0.0  # weight of the temporal-consistency locality loss (0 = off)
    window: float = 0.0  # weight of the working-set (window entropy) locality loss (0 = off)
    window_size: int = 16  # tokens per window for the working-set loss
    pin: float = 0.0  # weight of the pin-affinity locality loss (0 = off)
    pin_experts: int = 2  # how many experts per layer form the pinned set (experts 0..n-1)
    pin_share: float = 0.5  # target share of routing mass on the pinned set
    # weight of the anchor loss: KL from the routing of the router as it was when the model
    # was loaded (a pretrained model's) to the current one, per token (0 = off)
    anchor: float = 0.0

    def __post_init__(self) -> None:
        _check(
            self.score in ROUTER_SCORES,
            f"router.score={self.score!r} is unknown; use one of {ROUTER_SCORES}",
        )
        for name in (
            "load_balance", "z_loss", "bias_update_rate", "temporal", "window", "pin", "anchor"
        ):  # fmt: skip
            value = getattr(self, name)
            _check(value >= 0, f"router.{name}={value} must be >= 0 (0 turns it off)")
        _check(self.window_size >= 2, f"router.window_size={self.window_size} must be >= 2")
        _check(self.pin_experts >= 1, f"router.pin_experts={self.pin_experts} must be >= 1")
        _check(0 < self.pin_share <= 1, f"router.pin_share={self.pin_share} must be in (0, 1]")


@dataclass
class MoEConfig:
    """The expert layer: how many experts, how many per token, their width, the kernel."""

    num_experts: int = 8  # experts per MoE layer (E)
    top_k: int = 2  # experts each token is routed to (k)
    d_ff: int = 256  # hidden width of each SwiGLU expert (F)
    impl: str = "auto"  # "auto" (triton on CUDA, torch elsewhere), "triton", "torch", "megablocks"

    def __post_init__(self) -> None:
        _check(self.num_experts >= 1, f"moe.num_experts={self.num_experts} must be >= 1")
        _check(self.top_k >= 1, f"moe.top_k={self.top_k} must be >= 1")
        _check(
            self.top_k <= self.num_experts,
            f"moe.top_k={self.top_k} is larger than moe.num_experts={self.num_experts}; "
            "lower top_k or add experts",
        )
        _check(self.d_ff >= 1, f"moe.d_ff={self.d_ff} must be >= 1")
        _check(self.impl in MOE_IMPLS, f"moe.impl={self.impl!r} is unknown; use one of {MOE_IMPLS}")


@dataclass
class ModelConfig:
    """A decoder-only transformer whose every feed-forward block is an MoE layer."""

    vocab_size: int = 256  # byte-level tokens by default; byte 0 separates documents
    d_model: int = 128  # residual stream width (D)
    n_layers: int = 4  # transformer blocks, each with attention and an MoE layer
    n_heads: int = 4  # attention heads; must divide d_model
    max_seq_len: int = 256  # longest sequence the rotary tables are built for
    moe: MoEConfig = field(default_factory=MoEConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    rope_theta: float = 10000.0  # rotary embedding base
    norm_eps: float = 1e-6  # RMSNorm epsilon
    init_std: float = 0.02  # std of the normal init of every weight matrix
    tie_embeddings: bool = True  # share the token embedding with the output projection
    doc_separator: int = 0  # token that ends a document in packed sequences (-1 = none)
    # a local transformers MoE model folder (config.json, safetensors, tokenizer); "" =
    # moestack's own model. When set, its config.json fills the fields above (moe.impl and
    # the router stay yours), and the model loads with transformers, MoE blocks patched.
    path: str = ""
    # activation checkpointing: what backward recomputes instead of keeping: "none", "moe"
    # (the experts), "block" (the whole block but its router) or "selective" (norms, rotary,
    # SwiGLU, gathers; matmul and attention outputs kept). Routing is never recomputed.
    checkpointing: str = "none"

    def __post_init__(self) -> None:
        self.moe = _coerce(self.moe, MoEConfig)
        self.router = _coerce(self.router, RouterConfig)
        _check(
            self.checkpointing in CHECKPOINTING,
            f"model.checkpointing={self.checkpointing!r} is unknown; use one of {CHECKPOINTING}",
        )
        _check(
            not self.path or self.checkpointing == "none",
            f"model.checkpointing={self.checkpointing!r} applies to moestack's own model, not "
            "to a transformers one (model.path); use none",
        )
        if self.path:
            self._fill_from_transformers()
            return
        _check(self.vocab_size >= 2, f"model.vocab_size={self.vocab_size} must be >= 2")
        _check(self.d_model >= 1, f"model.d_model={self.d_model} must be >= 1")
        _check(self.n_layers >= 1, f"model.n_layers={self.n_layers} must be >= 1")
        _check(self.n_heads >= 1, f"model.n_heads={self.n_heads} must be >= 1")
        _check(
            self.d_model % self.n_heads == 0,
            f"model.n_heads={self.n_heads} does not divide model.d_model={self.d_model}",
        )
        _check(
            (self.d_model // self.n_heads) % 2 == 0,
            f"model.d_model/n_heads={self.d_model // self.n_heads} must be even for rotary "
            "embeddings",
        )
        _check(self.max_seq_len >= 1, f"model.max_seq_len={self.max_seq_len} must be >= 1")
        _check(
            self.rope_theta > 1, f"model.rope_theta={self.rope_theta} must be > 1 (10000 is usual)"
        )
        _check(self.norm_eps > 0, f"model.norm_eps={self.norm_eps} must be > 0")
        _check(self.init_std > 0, f"model.init_std={self.init_std} must be > 0 (0.02 is usual)")
        _check(
            -1 <= self.doc_separator < self.vocab_size,
            f"model.doc_separator={self.doc_separator} is outside the vocabulary "
            f"[0, {self.vocab_size}); use a token id, or -1 for none",
        )

    def _fill_from_transformers(self) -> None:
        """The architecture fields from ``path/config.json`` (read as JSON: no weights)."""
        from moestack.interop.hf_config import model_config_kwargs, read_hf_config

        _check(
            self.path != HF_PATH_REQUIRED,
            "model=hf needs model.path=DIR: a local transformers MoE model folder (config.json, "
            "safetensors weights, tokenizer files)",
        )
        # absolute, so that a run's config.yaml finds its source from any folder
        self.path = str(Path(self.path).expanduser().absolute())
        for key, value in model_config_kwargs(read_hf_config(self.path)).items():
            if key == "moe":
                value = MoEConfig(**value, impl=self.moe.impl)
            setattr(self, key, value)

    def build(self, *, experts: bool = True) -> Any:
        """The model this config describes (a ``moestack.model.RoutedLM``): moestack's
        ``MoETransformer``, or the transformers model at ``path`` with moestack MoE layers.
        Routers with an anchor loss take the built weights as their reference.

        ``experts=False`` (transformers models only) leaves the routed experts unread, as
        meta tensors, for serving them from an expert store."""
        if self.path:
            from moestack.interop.hf_model import load_hf_moe

            model = load_hf_moe(self.path, impl=self.moe.impl, router=self.router, experts=experts)
        elif not experts:
            raise ValueError(
                "experts=False reads a transformers model folder without its experts; "
                "moestack's own model without experts is loaded from a checkpoint: "
                "moestack.runs.load_run(RUN, experts=False)"
            )
        else:
            from moestack.model import MoETransformer

            model = MoETransformer(self)
        for moe in model.moe_layers:
            moe.router.reset_anchor()
        return model


@dataclass
class OptimConfig:
    """Optimizer, learning-rate schedule and gradient clipping."""

    name: str = "adamw"  # "adamw" (torch.optim.AdamW) or "offload_adamw" (host state, sharded)
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
    # dtype of the model's weights and gradients on the device: "auto" is bfloat16 for
    # offload_adamw on CUDA (its fp32 master copy lives on the host) and float32 otherwise.
    param_dtype: str = "auto"

    def __post_init__(self) -> None:
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
    max_bytes: int = 0  # cap on the corpus size in bytes (0 = all of it)

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
class CacheConfig:
    """Expert cache: capacity and policy for offloaded evaluation and for telemetry replay."""

    policy: str = "lru"  # "lru", "lfu", "static", "lru+static", "belady" (replay only)
    capacity: int = 0  # experts per layer held in fast memory, >= top_k (0 = 2 x top_k)
    capacity_bytes: int = 0  # alternatively a byte budget per layer (0 = use capacity)
    warmup: int = 1024  # static policies: requests per layer counted before pinning
    prefetch: bool = False  # predict and load the next layer's experts in the background
    store_dir: str = ""  # where the safetensors expert store lives ("" = <run dir>/experts)

    def __post_init__(self) -> None:
        _check_policy(self.policy, "cache.policy")
        _check(self.capacity >= 0, f"cache.capacity={self.capacity} must be >= 0 (0 = 2 x top_k)")
        _check(self.warmup >= 0, f"cache.warmup={self.warmup} must be >= 0")
        _check(self.capacity_bytes >= 0, f"cache.capacity_bytes={self.capacity_bytes} must be >= 0")
        _check(
            not (self.capacity and self.capacity_bytes),
            f"cache.capacity={self.capacity} and cache.capacity_bytes={self.capacity_bytes} are "
            "both set; give one of them",
        )


@dataclass
class TelemetryConfig:
    """Routing telemetry during training: which cache policies and sizes to replay."""

    enabled: bool = True  # attach telemetry to the model during training
    policies: list[str] = field(default_factory=lambda: ["lru", "static"])  # replayed policies
    capacities: list[int] = field(default_factory=list)  # cache sizes, experts/layer ([] = k, 2k)
    trace_dir: str = ""  # stream the routing trace here ("" = <run dir>/trace)

    def __post_init__(self) -> None:
        for policy in self.policies:
            _check_policy(policy, "telemetry.policies")
        for capacity in self.capacities:
            _check(capacity >= 1, f"telemetry.capacities has {capacity}; each must be >= 1")


@dataclass
class ParallelConfig:
    """How the ranks of a torchrun job share the work (docs/parallel.md)."""

    # expert-parallel degree: each group of ep ranks splits every MoE layer's experts
    # (num_experts / ep whole experts per rank) and moves tokens to them by all-to-all; the
    # world is world_size / ep data-parallel groups of ep ranks (1 = data parallel only)
    ep: int = 1


@dataclass
class TrainConfig:
    """One training run: model, data, optimizer, loop settings, logging."""

    model: ModelConfig = field(default_factory=ModelConfig)
    # The one place the router is configured (the `router` group, `router.FIELD=...`); it
    # becomes model.router, and setting model.router to something else is an error.
    router: RouterConfig = field(default_factory=RouterConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    steps: int = 300  # optimizer steps
    batch_size: int = 16  # sequences per micro-batch: the global batch, split over the ranks
    grad_accum: int = 1  # micro-batches per optimizer step
    eval_every: int = 100  # evaluate validation loss every N steps (0 = only at the end)
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
    wandb_mode: str = ""  # "" = WANDB_MODE or offline; "disabled" turns wandb off
    progress: bool = True  # show a progress bar
    # which weights train: "all", "routers" (the MoE routers only) or "routers+experts" (and
    # the routed experts); frozen weights get no gradients and no optimizer state
    trainable: str = "all"
    # compile each transformer block with torch.compile (CPU and CUDA; docs/memory.md)
    compile: bool = False

    def __post_init__(self) -> None:
        self.model = _coerce(self.model, ModelConfig)
        self.router = _coerce(self.router, RouterConfig)
        self.optim = _coerce(self.optim, OptimConfig)
        self.data = _coerce(self.data, DataConfig)
        self.cache = _coerce(self.cache, CacheConfig)
        self.telemetry = _coerce(self.telemetry, TelemetryConfig)
        self.parallel = _coerce(self.parallel, ParallelConfig)
        self.model.router = _one_router(self.router, self.model.router)
        for name in ("steps", "batch_size", "grad_accum", "eval_batches", "log_every", "keep_last"):
            value = getattr(self, name)
            _check(value >= 1, f"{name}={value} must be >= 1")
        for name in ("eval_every", "ckpt_every", "threads"):
            value = getattr(self, name)
            _check(value >= 0, f"{name}={value} must be >= 0")
        _check_expert_parallel(self.parallel.ep, self.model)
        _check(self.max_bad_steps >= 1, f"max_bad_steps={self.max_bad_steps} must be >= 1")
        _check(
            self.trainable in ("all", "routers", "routers+experts"),
            f"trainable={self.trainable!r} is unknown; use all, routers or routers+experts",
        )
        _check(
            not (self.compile and self.model.path),
            "compile=true compiles moestack's own model blocks, not a transformers model "
            "(model.path); use compile=false",
        )
        _check(
            self.device in ("auto", "cpu", "cuda"),
            f"device={self.device!r}; use 'auto', 'cpu' or 'cuda'",
        )
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
        from moestack.cache.policies import default_capacities, default_capacity

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


def _check_expert_parallel(ep: int, model: ModelConfig) -> None:
    """``parallel.ep`` must be >= 1 and split the experts evenly (a transformers model's
    expert count is known when it is loaded, and checked then)."""
    _check(ep >= 1, f"parallel.ep={ep} must be >= 1 (1 = no expert parallelism)")
    experts = model.moe.num_experts
    _check(
        bool(model.path) or experts % ep == 0,
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


def _coerce(value: Any, cls: type) -> Any:
    """Build ``cls`` from a mapping (hydra hands plain dicts to nested fields at times)."""
    if isinstance(value, cls):
        return value
    if isinstance(value, dict):
        return cls(**value)
    raise ValueError(f"expected a {cls.__name__} or a mapping, got {type(value).__name__}")


def register_configs() -> None:
    """Register the structured configs with hydra's ConfigStore (schema for train.yaml)."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(name="train_schema", node=TrainConfig)
