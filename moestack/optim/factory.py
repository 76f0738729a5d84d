"""Build the configured optimizer for a model, and clip gradients the way it needs."""

from __future__ import annotations

import logging
from typing import Any

import torch

from moestack.optim.expert_parallel import ExpertParallelOffload
from moestack.optim.offload import OffloadAdamW

log = logging.getLogger(__name__)


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


def build_optimizer(model: torch.nn.Module, cfg: Any, mesh: Any = None) -> torch.optim.Optimizer:
    """The optimizer ``cfg`` (a ``moestack.config.OptimConfig``) names, over ``model``.

    ``"adamw"`` is ``torch.optim.AdamW`` (fused on the CPU when torch supports it);
    ``"offload_adamw"`` is :class:`OffloadAdamW` with the config's offload settings. With
    ``offload_adamw`` under ``torch.distributed``, do not wrap the model in DDP. Under
    expert parallelism (``mesh``, a ``moestack.parallel.ExpertParallelMesh``; the model's
    experts already sharded) ``offload_adamw`` is a pair that keeps each rank's experts'
    state over their own group (:class:`ExpertParallelOffload`).
    """
    groups = param_groups(model, float(cfg.weight_decay))
    kw = {"lr": float(cfg.lr), "betas": tuple(cfg.betas), "eps": float(cfg.eps)}
    if cfg.name == "adamw":
        devices = {p.device.type for g in groups for _, p in g["params"]}
        fused = devices <= {"cpu", "cuda"} and all(
            p.dtype in (torch.float32, torch.float16, torch.bfloat16)
            for g in groups
            for _, p in g["params"]
        )
        try:
            return torch.optim.AdamW(groups, fused=fused, **kw)
        except (RuntimeError, ValueError) as err:  # pragma: no cover - old torch/odd device
            log.warning("fused AdamW unavailable (%s); using the default implementation", err)
            return torch.optim.AdamW(groups, **kw)
    if cfg.name == "offload_adamw":

        def make(groups: list[dict[str, Any]], process_group: Any = None) -> OffloadAdamW:
            return OffloadAdamW(
                groups,
                offload=cfg.offload,
                shard=cfg.shard,
                overlap=cfg.overlap,
                skip_idle_experts=cfg.skip_idle_experts,
                moment_dtype=cfg.moment_dtype,
                fused_step=cfg.fused_step,
                process_group=process_group,
                **kw,
            )

        return make(groups) if mesh is None else ExpertParallelOffload(groups, model, mesh, make)
    raise ValueError(f"optim.name={cfg.name!r} is unknown; use 'adamw' or 'offload_adamw'")


def device_param_dtype(cfg: Any, device: torch.device) -> torch.dtype:
    """The dtype the model's weights (and so gradients) take on ``device`` (``cfg.param_dtype``).

    ``"auto"``: bfloat16 for ``offload_adamw`` on CUDA, where the fp32 master weights live in
    host memory, so the device holds 4 bytes per parameter (weights and gradients); float32
    otherwise (torch AdamW keeps the parameters as its master copy).
    """
    name = getattr(cfg, "param_dtype", "auto")
    if name == "auto":
        offloaded = cfg.name == "offload_adamw" and device.type == "cuda"
        return torch.bfloat16 if offloaded else torch.float32
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

    Buffers such as rotary tables and router biases stay in fp32.
    """
    dtype = device_param_dtype(cfg, device)
    if dtype != torch.float32:
        for p in model.parameters():
            p.data = p.data.to(dtype)
    return dtype


def clip_grad_norm(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, max_norm: float
) -> float:
    """Clip gradients to a global 2-norm; the optimizer's own clip when it has one.

    Returns the norm before clipping. With :class:`OffloadAdamW` the norm is taken over the
    reduced gradients of all ranks; otherwise it is ``torch.nn.utils.clip_grad_norm_``.
    """
    own = getattr(optimizer, "clip_grad_norm_", None)
    if callable(own):
        return float(own(max_norm))
    params = [p for p in model.parameters() if p.grad is not None]
    return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
