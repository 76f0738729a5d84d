"""Training entry point: ``moestack-train`` (hydra app over configs/) and ``train(cfg)``.

One run = one output directory holding the resolved config (config.yaml), metrics.jsonl,
checkpoints/ and a wandb offline run. ``resume=true out_dir=<run>`` continues a killed run
from its newest checkpoint; on the CPU the resumed losses equal the uninterrupted run's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from moestack import checkpoint, distributed
from moestack.config import TrainConfig
from moestack.data import BatchLoader, eval_batches, load_corpus
from moestack.errors import MoestackError
from moestack.metrics import MetricsWriter
from moestack.model import MoETransformer
from moestack.optim import apply_param_dtype, build_optimizer, clip_grad_norm

log = logging.getLogger(__name__)


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise MoestackError("device=cuda but no CUDA device is available; use device=cpu")
    return torch.device("cuda", local_rank) if name == "cuda" else torch.device(name)


def lr_factor(step: int, total_steps: int, warmup_steps: int, min_lr_ratio: float) -> float:
    """Linear warm-up to 1, then cosine decay to ``min_lr_ratio`` at ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def autocast_context(device: torch.device) -> contextlib.AbstractContextManager:
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def evaluate(
    model: MoETransformer, batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device
) -> dict[str, float]:
    """Mean validation cross-entropy over fixed batches, and its perplexity."""
    was_training = model.training
    model.eval()
    total = 0.0
    for inputs, targets in batches:
        with autocast_context(device):
            out = model(inputs.to(device), targets.to(device))
        total += out.ce_loss.item()
    model.train(was_training)
    loss = total / max(1, len(batches))
    return {"loss/val": loss, "eval/perplexity": math.exp(min(loss, 50.0))}


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def train(cfg: TrainConfig, out_dir: Path | str) -> dict[str, Any]:
    """Train ``cfg.model`` on ``cfg.data`` into ``out_dir``; returns the run summary.

    Under torchrun every rank runs this with the same config: each takes its slice of every
    global batch, and rank 0 writes metrics and checkpoints.
    """
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device_type = resolve_device(cfg.device).type
    dist_info = distributed.init_from_env(device_type)
    try:
        return _train(cfg, Path(out_dir), dist_info)
    finally:
        distributed.shutdown(dist_info)


def _train(cfg: TrainConfig, out_dir: Path, dist_info: distributed.DistInfo) -> dict[str, Any]:
    device = resolve_device(cfg.device, dist_info.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    world, rank = dist_info.world_size, dist_info.rank
    if cfg.batch_size % world:
        raise MoestackError(f"batch_size={cfg.batch_size} does not split over {world} ranks")
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt_root = out_dir / "checkpoints"

    resume_from = None
    if cfg.resume:
        resume_from = checkpoint.latest_checkpoint(ckpt_root)
        if resume_from is None:
            raise MoestackError(f"resume=true but {ckpt_root} holds no checkpoint; start a new run")
    elif checkpoint.latest_checkpoint(ckpt_root) is not None:
        raise MoestackError(
            f"{out_dir} already holds checkpoints; pass resume=true to continue it or pick another out_dir"
        )
    distributed.barrier(dist_info)  # every rank has checked out_dir before rank 0 writes
    if dist_info.is_main:
        (out_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))

    corpus = load_corpus(cfg.data)
    if cfg.model.vocab_size < 256:
        raise MoestackError(f"model.vocab_size={cfg.model.vocab_size} is below 256 byte tokens")
    torch.manual_seed(cfg.seed)
    model = MoETransformer(cfg.model).to(device)
    if resume_from is not None:
        meta = checkpoint.load_model_weights(resume_from, model, cfg.model)
    param_dtype = apply_param_dtype(model, cfg.optim, device)
    if param_dtype != torch.float32:
        log.info("model weights and gradients on %s in %s", device, param_dtype)
    # offload_adamw reduces gradients itself; torch AdamW needs DDP to do it.
    ddp = dist_info.active and cfg.optim.name == "adamw"
    forward_model = torch.nn.parallel.DistributedDataParallel(model) if ddp else model
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: lr_factor(s, cfg.steps, cfg.optim.warmup_steps, cfg.optim.min_lr_ratio),
    )
    loader = BatchLoader(corpus.train, cfg.batch_size, cfg.data.seq_len, cfg.seed)
    val_batches = eval_batches(corpus.val, cfg.batch_size, cfg.data.seq_len, cfg.eval_batches)

    start_step, bad_steps_total = 0, 0
    if resume_from is not None:
        state = checkpoint.load_train_state(resume_from)
        scheduler.load_state_dict(state["scheduler"])
        optimizer.load_state_dict(state["optimizer"])
        loader.load_state_dict(state["data"])
        _set_rng_state(state["rng"])
        start_step, bad_steps_total = meta["step"], int(state.get("bad_steps", 0))
        log.info("resumed from %s at step %d", resume_from, start_step)

    params = model.num_params()
    writer = MetricsWriter(
        out_dir,
        enabled=dist_info.is_main,
        wandb_project=cfg.wandb_project,
        wandb_mode=cfg.wandb_mode,
        wandb_config=dataclasses.asdict(cfg),
        resume_step=start_step if resume_from is not None else None,
    )
    log.info(
        "model: %.2fM parameters, %.2fM active per token",
        params["total"] / 1e6,
        params["active"] / 1e6,
    )

    def save(step: int) -> None:
        state = {
            "optimizer": optimizer.state_dict(),  # collective for a sharded optimizer
            "scheduler": scheduler.state_dict(),
            "data": loader.state_dict(),
            "rng": _rng_state(),
            "bad_steps": bad_steps_total,
        }
        if dist_info.is_main:
            checkpoint.save_checkpoint(ckpt_root, step, model, cfg.model, state, cfg.keep_last)
        distributed.barrier(dist_info)

    tokens_per_step = cfg.batch_size * cfg.grad_accum * cfg.data.seq_len
    model.train()
    interval_loss, interval_aux, interval_steps = 0.0, 0.0, 0
    consecutive_bad = 0
    last_metrics: dict[str, float] = {}
    interval_start, run_start = time.perf_counter(), time.perf_counter()
    telemetry = _attach_telemetry(cfg, model, out_dir, start_step) if dist_info.is_main else None
    progress = _progress_bar(cfg, start_step) if dist_info.is_main else None
    rows = slice(rank * cfg.batch_size // world, (rank + 1) * cfg.batch_size // world)
    try:
        for step in range(start_step, cfg.steps):
            step_loss, step_aux, finite = 0.0, 0.0, True
            for micro in range(cfg.grad_accum):
                inputs, targets = loader.next()
                inputs, targets = inputs[rows].to(device), targets[rows].to(device)
                last = micro == cfg.grad_accum - 1
                with autocast_context(device), _accumulating(forward_model, optimizer, last):
                    out = forward_model(inputs, targets)
                    # A bad loss still runs backward, so DDP ranks stay in step; the update
                    # is skipped below and the gradients dropped.
                    finite = finite and bool(torch.isfinite(out.loss))
                    (out.loss / cfg.grad_accum).backward()
                step_loss += out.ce_loss.item() / cfg.grad_accum
                step_aux += out.aux_loss.item() / cfg.grad_accum
            if dist_info.active:  # every rank must agree to skip, and logs the global mean
                finite = distributed.all_reduce_mean(float(finite), dist_info, device) == 1.0
                step_loss = distributed.all_reduce_mean(step_loss, dist_info, device)
                step_aux = distributed.all_reduce_mean(step_aux, dist_info, device)
            if not finite:
                optimizer.zero_grad(set_to_none=True)
                model.discard_router_counts()
                scheduler.step()
                bad_steps_total += 1
                consecutive_bad += 1
                log.warning(
                    "step %d: non-finite loss, step skipped (%d in a row)", step, consecutive_bad
                )
                if consecutive_bad >= cfg.max_bad_steps:
                    last = checkpoint.latest_checkpoint(ckpt_root)
                    raise MoestackError(
                        f"the loss was NaN/inf for {consecutive_bad} steps in a row (step {step}); "
                        f"the last good checkpoint is {last or 'none'}; lower optim.lr or check the data"
                    )
                continue
            consecutive_bad = 0
            grad_norm = 0.0
            if cfg.optim.grad_clip > 0:
                grad_norm = clip_grad_norm(model, optimizer, cfg.optim.grad_clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            model.update_router_biases()

            interval_loss += step_loss
            interval_aux += step_aux
            interval_steps += 1
            done = step + 1
            if progress is not None:
                progress.update(1)
            if done % cfg.log_every == 0 or done == cfg.steps:
                elapsed = time.perf_counter() - interval_start
                metrics = {
                    "loss/train": interval_loss / interval_steps,
                    "loss/aux": interval_aux / interval_steps,
                    "optim/lr": scheduler.get_last_lr()[0],
                    "optim/grad_norm": grad_norm,
                    "perf/tokens_per_s": tokens_per_step * interval_steps / max(elapsed, 1e-9),
                    "perf/bad_steps": bad_steps_total,
                }
                metrics.update({k: float(v) for k, v in out.metrics.items()})
                metrics["eval/train_perplexity"] = math.exp(min(metrics["loss/train"], 50.0))
                if cfg.eval_every and done % cfg.eval_every == 0 and done != cfg.steps:
                    with _paused(telemetry):
                        metrics.update(evaluate(model, val_batches, device))
                charts = None
                if telemetry is not None:
                    metrics.update(telemetry.interval_metrics(step=done))
                    if writer.wandb_run is not None and done % (10 * cfg.log_every) == 0:
                        charts = telemetry.wandb_charts()
                writer.log(done, metrics, extra_wandb=charts)
                last_metrics.update(metrics)
                if progress is not None:
                    progress.set_postfix(
                        loss=f"{metrics['loss/train']:.3f}",
                        tok_s=f"{metrics['perf/tokens_per_s']:.0f}",
                    )
                interval_loss, interval_aux, interval_steps = 0.0, 0.0, 0
                interval_start = time.perf_counter()
            if cfg.ckpt_every and done % cfg.ckpt_every == 0 and done != cfg.steps:
                save(done)
    finally:
        if progress is not None:
            progress.close()

    with _paused(telemetry):
        final_eval = evaluate(model, val_batches, device)
    save(cfg.steps)
    run_seconds = time.perf_counter() - run_start
    final_metrics = {**final_eval}
    writer.log(cfg.steps, final_metrics)
    if telemetry is not None:
        telemetry.close()
        _write_json(out_dir / "telemetry_summary.json", telemetry.summary())
    writer.close()
    last_metrics.update(final_metrics)

    summary = {
        "loss/train": last_metrics.get("loss/train", float("nan")),
        "loss/val": final_eval["loss/val"],
        "eval/perplexity": final_eval["eval/perplexity"],
        "perf/tokens_per_s": tokens_per_step * (cfg.steps - start_step) / max(run_seconds, 1e-9),
        "params/total": params["total"],
        "params/active": params["active"],
        "perf/bad_steps": bad_steps_total,
        "out_dir": str(out_dir),
    }
    for i in range(cfg.model.n_layers):
        key = f"router/layer{i}/imbalance"
        if key in last_metrics:
            summary[key] = last_metrics[key]
    if dist_info.is_main:
        _write_json(out_dir / "summary.json", summary)
        log.info("\n%s", format_summary(summary))
    return summary


def _attach_telemetry(cfg: TrainConfig, model: MoETransformer, out_dir: Path, start_step: int):
    """Hook the routers (rank 0 only); the trace streams to <run>/trace/from-<step>."""
    if not cfg.telemetry.enabled:
        return None
    from moestack.telemetry import attach

    trace_root = Path(cfg.telemetry.trace_dir) if cfg.telemetry.trace_dir else out_dir / "trace"
    part = trace_root / f"from-{start_step:07d}"
    if part.exists():  # left by an attempt that crashed after this checkpoint: recorded anew
        shutil.rmtree(part)
    return attach(
        model,
        policies=cfg.telemetry.policies,
        capacities=cfg.telemetry.capacities,
        trace_dir=str(part),
        max_memory_tokens=0,
    )


def _paused(telemetry: Any) -> contextlib.AbstractContextManager:
    """Evaluation batches are not training traffic: keep them out of the trace."""
    return telemetry.paused() if telemetry is not None else contextlib.nullcontext()


def _accumulating(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, last: bool
) -> contextlib.AbstractContextManager:
    """On all but the last micro-batch of a step, gradients only accumulate on the device:
    DDP skips its all-reduce and OffloadAdamW its copies to the host (their ``no_sync``)."""
    stack = contextlib.ExitStack()
    if not last:
        for owner in (model, optimizer):
            if hasattr(owner, "no_sync"):
                stack.enter_context(owner.no_sync())
    return stack


def _progress_bar(cfg: TrainConfig, start_step: int) -> Any:
    if not cfg.progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=cfg.steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def format_summary(summary: dict[str, Any]) -> str:
    """A two-column table of the run's headline numbers."""
    rows = [
        ("train loss", f"{summary['loss/train']:.4f}"),
        ("val loss", f"{summary['loss/val']:.4f}"),
        ("val perplexity", f"{summary['eval/perplexity']:.3f}"),
        ("tokens/s", f"{summary['perf/tokens_per_s']:.0f}"),
        ("params (total)", f"{summary['params/total'] / 1e6:.2f}M"),
        ("params (active/token)", f"{summary['params/active'] / 1e6:.2f}M"),
        ("skipped steps", str(summary["perf/bad_steps"])),
    ]
    rows += [
        (f"layer {key.split('/')[1][5:]} imbalance", f"{value:.2f}")
        for key, value in summary.items()
        if key.endswith("/imbalance")
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"{'metric':<{width}}  value", f"{'-' * width}  -----"]
    lines += [f"{name:<{width}}  {value}" for name, value in rows]
    return "\n".join(lines)


def _hydra_task(dict_cfg: Any) -> None:
    from hydra.core.hydra_config import HydraConfig

    try:
        cfg: TrainConfig = OmegaConf.to_object(dict_cfg)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not cfg.out_dir:
            raise MoestackError(
                "under torchrun, set out_dir=<run dir> so every rank writes one run"
            )
        train(cfg, cfg.out_dir or HydraConfig.get().runtime.output_dir)
    except (MoestackError, ValueError) as err:
        log.error("error: %s", err)
        sys.exit(2)


def main() -> None:
    """Console entry point of ``moestack-train``."""
    import hydra

    from moestack.config import register_configs

    register_configs()
    app = hydra.main(config_path="pkg://moestack.configs", config_name="train", version_base="1.3")
    app(_hydra_task)()


if __name__ == "__main__":
    main()
