"""Build the configured optimizer for a model: one optimizer over its parameters
(``build_optimizer``), or the one the training loop holds at its parallel layout
(``build_training_optimizer``)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from moestack.optim.container import LocalOptimizer, TrainingOptimizer
from moestack.optim.expert_parallel import (
    ExpertParallelAdamW,
    ExpertParallelOffload,
    ExpertParallelTiered,
)
from moestack.optim.offload import OffloadAdamW
from moestack.optim.tiered import TieredAdamW, tiered_groups
from moestack.parallel import expert_blocks
from moestack.populations import classify

log = logging.getLogger(__name__)

# builds an optimizer over param groups, averaging over a process group (None: the default)
Maker = Callable[..., torch.optim.Optimizer]


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two named groups: weight decay on matrices (ndim >= 2), none on norms and biases."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append((name, p))
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def build_optimizer(model: torch.nn.Module, cfg: Any) -> torch.optim.Optimizer:
    """The optimizer ``cfg`` (a ``moestack.optim.config.OptimConfig``) names, over ``model``.

    ``"adamw"`` is ``torch.optim.AdamW`` (fused on the CPU when torch supports it);
    ``"offload_adamw"`` is :class:`OffloadAdamW` with the config's offload settings (under
    ``torch.distributed`` it averages the gradients itself: do not wrap the model in DDP);
    ``"tiered"`` is :class:`TieredAdamW`, its state sized per parameter population.
    """
    return _maker(cfg, model)(param_groups(model, float(cfg.weight_decay)))


def uses_ddp(name: str, world_size: int, expert_parallel: bool) -> bool:
    """Whether the optimizer ``name`` trains behind DDP at this layout: torch AdamW and
    TieredAdamW on several ranks without expert parallelism (OffloadAdamW averages its own
    gradients, and under expert parallelism the expert-parallel optimizers do)."""
    return name in ("adamw", "tiered") and world_size > 1 and not expert_parallel


def build_training_optimizer(
    model: torch.nn.Module, cfg: Any, world_size: int = 1, mesh: Any = None
) -> TrainingOptimizer:
    """The optimizer a training loop holds for ``model`` (its trainable parameters; with
    ``mesh``, a ``moestack.parallel.ExpertParallelMesh``, its experts already sharded) over
    ``world_size`` ranks: the one place that knows which optimizer does what at which layout
    (:mod:`moestack.optim.container`).

    Without expert parallelism, one optimizer over the model: torch AdamW and TieredAdamW
    behind DDP on several ranks, OffloadAdamW averaging its own gradients. Under expert
    parallelism, :class:`ExpertParallelAdamW`, the OffloadAdamW pair
    :class:`ExpertParallelOffload` or :class:`ExpertParallelTiered`.
    """
    cfg.check_ranks(world_size)
    make = _maker(cfg, model)
    groups = param_groups(model, float(cfg.weight_decay))
    if mesh is None:
        ddp = uses_ddp(cfg.name, world_size, expert_parallel=False)
        optimizer = make(groups)
        if isinstance(optimizer, OffloadAdamW):  # a pipelined step's weights, layer by layer
            optimizer.wait_per_layer(model)
        return LocalOptimizer(optimizer, model, ddp=ddp)
    if cfg.name == "tiered":  # each rank's own tensors, experts keyed by their global ids
        offsets = {n: b.lo for b in expert_blocks(model) for n, p in model.named_parameters()
                   if p is b.param}  # fmt: skip
        return ExpertParallelTiered(_tiered(groups, cfg, model, _kw(cfg), None, offsets), model)
    if cfg.name == "offload_adamw":
        return ExpertParallelOffload(groups, model, mesh, make)
    return ExpertParallelAdamW(make(groups), model)


def _maker(cfg: Any, model: torch.nn.Module) -> Maker:
    """``make(groups, process_group=None)`` for the optimizer ``cfg`` names (``model``: whose
    parameters the groups hold, for the tiered optimizer's populations)."""
    kw = _kw(cfg)
    if cfg.name == "adamw":
        return lambda groups, process_group=None: _adamw(groups, kw)
    if cfg.name == "tiered":
        return lambda groups, process_group=None: _tiered(groups, cfg, model, kw, process_group)
    if cfg.name == "offload_adamw":

        def make(groups: list[dict[str, Any]], process_group: Any = None) -> OffloadAdamW:
            return OffloadAdamW(
                groups,
                offload="cpu",  # optim.offload "auto" or "cpu" (none is refused)
                shard=cfg.shard,
                overlap=cfg.overlap,
                skip_idle_experts=cfg.skip_idle_experts,
                moment_dtype=cfg.moment_dtype,
                fused_step=cfg.fused_step,
                update_delay=cfg.update_delay,
                delay_warmup=cfg.delay_warmup,
                pipeline=cfg.pipeline,
                bucket_mb=cfg.bucket_mb,
                reduce_on_device=cfg.reduce_on_device,
                process_group=process_group,
                **kw,
            )

        return make
    raise ValueError(
        f"optim.name={cfg.name!r} is unknown; use 'adamw', 'offload_adamw' or 'tiered'"
    )


def _kw(cfg: Any) -> dict[str, Any]:
    """The Adam hyperparameters every optimizer takes from the config."""
    return {"lr": float(cfg.lr), "betas": tuple(cfg.betas), "eps": float(cfg.eps)}


def _tiered(
    groups: list[dict[str, Any]],
    cfg: Any,
    model: torch.nn.Module,
    kw: dict[str, Any],
    process_group: Any,
    expert_offsets: dict[str, int] | None = None,
) -> TieredAdamW:
    """TieredAdamW over the groups' parameters, regrouped by population; with
    ``expert_offsets`` (expert parallelism: each sharded tensor's first global expert id)
    unsharded, each rank keeping the state of the tensors it holds."""
    named = [pair for g in groups for pair in g["params"]]
    regrouped = tiered_groups(named, classify(model), cfg.policy, float(cfg.weight_decay))
    return TieredAdamW(
        regrouped,
        clip_update=float(cfg.clip_update),
        master=cfg.master,
        process_group=process_group,
        shard=expert_offsets is None,
        expert_offsets=expert_offsets,
        update_in_backward=bool(getattr(cfg, "update_in_backward", False)),
        offload=getattr(cfg, "offload", "auto") == "cpu",
        **kw,
    )


def _adamw(groups: list[dict[str, Any]], kw: dict[str, Any]) -> torch.optim.AdamW:
    """torch AdamW, fused where every parameter allows it (CPU/CUDA, float dtypes)."""
    params = [p for g in groups for _, p in g["params"]]
    fused = {p.device.type for p in params} <= {"cpu", "cuda"} and all(
        p.dtype in (torch.float32, torch.float16, torch.bfloat16) for p in params
    )
    try:
        return torch.optim.AdamW(groups, fused=fused, **kw)
    except (RuntimeError, ValueError) as err:  # pragma: no cover - old torch/odd device
        log.warning("fused AdamW unavailable (%s); using the default implementation", err)
        return torch.optim.AdamW(groups, **kw)


def device_param_dtype(cfg: Any, device: torch.device) -> torch.dtype:
    """The dtype the model's weights (and so gradients) take on ``device`` (``cfg.param_dtype``).

    ``"auto"``: bfloat16 for ``offload_adamw`` on CUDA, where the fp32 master weights live in
    host memory, so the device holds 4 bytes per parameter (weights and gradients); for
    ``tiered`` on CUDA, and with ``master="none"`` everywhere (its updates are stochastically
    rounded into bf16 weights); float32 otherwise (torch AdamW keeps the parameters as its
    master copy).
    """
    name = getattr(cfg, "param_dtype", "auto")
    if name == "auto":
        host_master = cfg.name in ("offload_adamw", "tiered") and device.type == "cuda"
        no_master = cfg.name == "tiered" and cfg.master == "none"
        return torch.bfloat16 if host_master or no_master else torch.float32
    if name not in ("float32", "bfloat16"):
        raise ValueError(f"optim.param_dtype={name!r}; use 'auto', 'float32' or 'bfloat16'")
    if name == "bfloat16" and cfg.name == "adamw":
        log.warning(
            "optim.param_dtype=bfloat16 with adamw trains without an fp32 master copy; "
            "use optim=offload_adamw for bf16 device weights with fp32 master weights"
        )
    return getattr(torch, name)


def apply_param_dtype(model: torch.nn.Module, cfg: Any, device: torch.device) -> torch.dtype:
    """Cast the model's parameters (not its buffers) to :func:`device_param_dtype`; return it.

    Buffers such as rotary tables and router biases stay in fp32. optim=tiered without a
    master copy in fp32 storage (``param_dtype=float32``) starts from weights rounded to bf16:
    the weights it keeps have bf16 precision (on the bf16 grid), computed in fp32.
    """
    cast = param_cast(cfg, device)
    if cast is not None:
        for p in model.parameters():  # meta ones (experts never read) take the dtype alone
            p.data = cast(p.data)
    return device_param_dtype(cfg, device)


def param_cast(cfg: Any, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What :func:`apply_param_dtype` does to each weight (None: nothing): also applied to
    the experts a streamed run writes to its store without ever holding them all."""
    dtype = device_param_dtype(cfg, device)
    on_bf16_grid = cfg.name == "tiered" and cfg.master == "none" and dtype == torch.float32
    if dtype == torch.float32 and not on_bf16_grid:
        return None
    narrow = torch.bfloat16 if on_bf16_grid else dtype
    return lambda t: t.to(narrow).to(dtype)
