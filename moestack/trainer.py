"""The training loop: ``train(cfg, out_dir)`` = ``build_run`` -> ``train_step`` x steps ->
``finish_run``.

One run = one output directory holding the resolved config (config.yaml), metrics.jsonl,
checkpoints/ and a wandb offline run. ``resume=true`` continues a killed run from its newest
checkpoint; on the CPU the resumed losses equal the uninterrupted run's. Under torchrun every
rank runs the same loop on its slice of each global batch, and rank 0 writes.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import errno
import logging
import math
import os
import shutil
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moestack import (
    atomic,
    checkpoint,
    checkpoint_parts,
    distributed,
    host_allocator,
    lora,
    memory_plan,
    meta_load,
    parallel,
    provenance,
)
from moestack.cache.streaming import attach_streaming, experts_left_out
from moestack.config import TrainConfig
from moestack.data import BatchLoader, eval_batches
from moestack.errors import MoestackError
from moestack.evaluation import autocast_context, evaluate, perplexity, resolve_device
from moestack.interop.hf_experts import fill_expert_rows
from moestack.metrics import (
    MetricsWriter,
    format_summary,
    human_count,
    latest_values,
    read_metrics,
)
from moestack.model import ModelConfig, RoutedLM
from moestack.moe import check_impl
from moestack.optim import TrainingOptimizer, apply_param_dtype, build_training_optimizer
from moestack.runs import (
    LOCK_FILE,
    FolderInUse,
    check_out_dir,
    check_same_config_on_every_rank,
    holding_run_dir,
    missing_folders,
    prepare_out_dir,
    remove_made_folders,
    run_corpus,
    sigterm_deferred,
    start_out_dir,
    write_json,
)

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    """The loop's own counters, saved in every checkpoint beside the optimizer's state."""

    step: int = 0  # optimizer steps taken, skipped ones included (the next step's index)
    bad_steps: int = 0  # steps skipped for a non-finite loss over the whole run
    consecutive_bad: int = 0  # ... in a row up to now; the run stops at max_bad_steps
    interval_loss: float = 0.0  # sum of step losses since the last log record
    interval_aux: float = 0.0  # sum of step router losses since the last log record
    interval_steps: int = 0  # good steps since the last log record

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for f in dataclasses.fields(self):
            if f.name in state:
                setattr(self, f.name, type(f.default)(state[f.name]))

    def reset_interval(self) -> None:
        self.interval_loss, self.interval_aux, self.interval_steps = 0.0, 0.0, 0


@dataclass
class StepResult:
    """What one optimizer step reports back to the loop."""

    loss: float  # mean cross-entropy over the step's micro-batches (and ranks)
    aux: float  # mean weighted router losses, likewise
    finite: bool  # False: a rank saw NaN/inf, the update was skipped
    grad_norm: float  # global gradient norm before clipping (0 when clipping is off)
    router_metrics: dict[str, torch.Tensor]  # the last micro-batch's per-layer router metrics


@dataclass
class Run:
    """Everything one training run holds, built once from its config by ``build_run``."""

    cfg: TrainConfig
    out_dir: Path
    dist: distributed.DistInfo
    device: torch.device
    model: RoutedLM
    forward_model: nn.Module  # the model, or its DDP wrapper (optimizer.forward_model)
    optimizer: TrainingOptimizer  # the same methods at every layout (moestack.optim)
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loader: BatchLoader
    val_batches: list[tuple[torch.Tensor, torch.Tensor]]
    writer: MetricsWriter
    telemetry: Any  # moestack.telemetry.Telemetry on rank 0 when enabled, else None
    state: TrainState
    start_step: int  # the step this process started (or resumed) at
    mesh: parallel.ExpertParallelMesh | None = None  # parallel.ep > 1: this rank's place
    exchange: parallel.ExchangeStats | None = None  # parallel.ep > 1: all-to-all counters
    streaming: Any = None  # offload_experts: moestack.cache.streaming.StreamingState
    last_metrics: dict[str, float] = field(default_factory=dict)
    interval_step_s: float = 0.0  # seconds in train_step since the last log record
    train_s: float = 0.0  # seconds in train_step since this process started
    eval_s: float = 0.0  # seconds in evaluation since this process started

    @property
    def ckpt_root(self) -> Path:
        return self.out_dir / "checkpoints"

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.batch_size * self.cfg.grad_accum * self.cfg.data.seq_len

    @property
    def rows(self) -> slice:
        """This rank's rows of every global batch."""
        world, rank, batch = self.dist.world_size, self.dist.rank, self.cfg.batch_size
        return slice(rank * batch // world, (rank + 1) * batch // world)


# --------------------------------------------------------------------------- the loop
def train(
    cfg: TrainConfig, out_dir: Path | str, launch: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Train ``cfg.model`` on ``cfg.data`` into ``out_dir``; returns the run summary.

    Each start (new or resumed) is recorded in ``<out_dir>/provenance.json`` with ``launch``
    (how it was started; default: the process's command line), see ``moestack.provenance``.
    The folder is held while the run trains: a second run into it is refused. ``cfg`` is
    resolved first (``TrainConfig.resolve``: a transformers model's architecture read from
    its folder), before anything is written.

    A start refused before it begins (``build_run``'s ``begin``: its config, data, checkpoint
    and model checked) writes nothing into ``out_dir``: no record, no config, and the lock
    file or folders it made (``out_dir`` and those above it) are removed again; the error it
    raises is marked (``refused_start``).
    """
    out_dir = Path(out_dir)
    made = missing_folders(out_dir), _not_there(out_dir / LOCK_FILE)
    try:
        cfg = cfg.resolve()
        provenance.check_launch(launch)  # on every rank, before any of them starts
        check_out_dir(out_dir)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        first_job = not (launch or {}).get("sweep") or launch["sweep"].get("job") == 0
        with _holding(out_dir):
            return _train_held(cfg, out_dir, launch, first_job, made)
    except Exception as err:
        if not hasattr(err, _REFUSED_START):  # refused before the folder was held: by
            # another process holding it, nothing here is this start's to undo
            setattr(err, _REFUSED_START, not isinstance(err, FolderInUse))
        raise


_REFUSED_START = "moestack_refused_start"  # set by ``train`` on the errors it raises


def refused_start(err: BaseException) -> bool:
    """Whether ``err`` ended a start of ``train`` before it began: the run's folder holds
    what it held before (``moestack-train`` then puts back what hydra wrote there too)."""
    return bool(getattr(err, _REFUSED_START, False))


def _train_held(
    cfg: TrainConfig,
    out_dir: Path,
    launch: dict[str, Any] | None,
    first_job: bool,
    made: tuple[tuple[Path, ...], bool],
) -> dict[str, Any]:
    """The start, in the folder this process holds, recorded in provenance.json once it
    begins. Its error says whether it was refused before it began; then what it made (the
    folders, the lock file: ``made``) is removed, while the folder is still held."""
    start: provenance.StartRecord | None = None
    try:
        with provenance.recorded_start(out_dir, cfg, launch) as start:
            try:
                return _train(cfg, out_dir, start.begin, plan_table=first_job)
            except OSError as err:  # a run file that cannot be written: one line
                raise _unwritable(err, out_dir) from err
    except BaseException as err:  # Ctrl-C before the start began leaves nothing either
        refused = start is None or not start.begun
        setattr(err, _REFUSED_START, refused)
        if refused and os.environ.get("RANK", "0") == "0":
            with sigterm_deferred():  # torchrun's SIGTERM, once another rank fails, waits
                _remove_made(out_dir, *made)
        raise


def _not_there(path: Path) -> bool:
    with contextlib.suppress(OSError):
        return not path.exists() and not path.is_symlink()
    return False  # cannot tell: kept


def _remove_made(out_dir: Path, folders_made: tuple[Path, ...], lock_made: bool) -> None:
    """Remove what a refused start made: the folder's lock file, and the folders (``out_dir``
    and the ones above it that were not there; nothing else is written before a start
    begins), each only while empty."""
    if lock_made:
        with contextlib.suppress(OSError):
            (out_dir / LOCK_FILE).unlink(missing_ok=True)
    remove_made_folders(folders_made)


def _unwritable(err: OSError, out_dir: Path) -> BaseException:
    """A full disk or a folder that became read-only, as one line naming the file."""
    full = atomic.out_of_space(err, out_dir, 0, str(err.filename or "the run's files"))
    if full is not None:
        return full
    if err.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return MoestackError(f"cannot write {err.filename or out_dir}: {err.strerror}")
    return err


def _holding(out_dir: Path) -> contextlib.AbstractContextManager:
    """Rank 0 holds the run folder for the run (before the process group exists: torchrun's
    RANK); the other ranks write into the folder rank 0 holds."""
    return (
        holding_run_dir(out_dir) if os.environ.get("RANK", "0") == "0" else contextlib.nullcontext()
    )


def _train(
    cfg: TrainConfig,
    out_dir: Path,
    begin: Callable[[], None] | None = None,
    plan_table: bool = True,
) -> dict[str, Any]:
    """The run itself: build it, step to ``cfg.steps`` (checkpointing, logging), finish.
    ``begin`` is called once the start's checks passed (``build_run``); ``plan_table=False``
    logs the memory plan's totals only (a sweep's later jobs).

    The process groups are ended after the run's objects are gone (on failure too: the
    traceback's frames are cleared), so nothing keeps a group, and gloo's threads, alive
    into the interpreter's exit (see ``distributed.close_process_groups``)."""
    dist_info = distributed.init_from_env(resolve_device(cfg.device).type)
    try:
        check_same_config_on_every_rank(cfg, dist_info)  # before any other collective
        summary = _build_and_step(cfg, out_dir, dist_info, begin, plan_table)
        # No rank tears its process group down while another still talks to it: gloo aborts
        # a rank whose peer closed the connection first (seen as a SIGABRT at exit).
        distributed.barrier(dist_info)
        return summary
    except BaseException as err:
        traceback.clear_frames(err.__traceback__)  # the failed run's objects die here
        raise
    finally:
        distributed.shutdown(dist_info)


def _build_and_step(
    cfg: TrainConfig,
    out_dir: Path,
    dist_info: distributed.DistInfo,
    begin: Callable[[], None] | None,
    plan_table: bool,
) -> dict[str, Any]:
    """Build the run, step it to ``cfg.steps`` and finish it: its summary."""
    run = build_run(cfg, out_dir, dist_info, begin)
    plan = (
        memory_plan.log_plan(cfg, dist_info.world_size, run.device, plan_table, run.model)
        if dist_info.is_main
        else None
    )
    progress = _progress_bar(cfg, run.start_step) if dist_info.is_main else None
    try:
        for step in range(run.start_step, cfg.steps):
            started = time.perf_counter()
            result = train_step(run)
            seconds = time.perf_counter() - started
            run.interval_step_s += seconds
            run.train_s += seconds
            run.state.step = done = step + 1
            if step == run.start_step:
                memory_plan.log_peak(plan, run.device)
            if not result.finite:  # skipped, but a step of the schedules all the same
                _check_bad_steps(run, step)
            if progress is not None:
                progress.update(1)
            evaluating = _evaluation_due(cfg, done)
            if result.finite and (done % cfg.log_every == 0 or done == cfg.steps):
                log_interval(run, result, done, progress, evaluating)
            elif evaluating:  # not a log step (or a skipped one): a record of its own
                log_evaluation(run, done)
            if cfg.ckpt_every and done % cfg.ckpt_every == 0 and done != cfg.steps:
                save(run, done)
    finally:
        if progress is not None:
            progress.close()
    return finish_run(run)


def train_step(run: Run) -> StepResult:
    """One optimizer step: forward/backward over the micro-batches, the ranks' vote on a
    non-finite loss, then either skip (gradients and router counts dropped) or clip, step
    and update the router biases."""
    cfg, state = run.cfg, run.state
    loss, aux, finite = 0.0, 0.0, True
    for micro in range(cfg.grad_accum):
        out = forward_backward(run, last=micro == cfg.grad_accum - 1)
        finite = finite and bool(torch.isfinite(out.loss))
        loss += out.ce_loss.item() / cfg.grad_accum
        aux += out.aux_loss.item() / cfg.grad_accum
    if run.dist.active:  # every rank must agree to skip, and logs the global mean
        finite = distributed.all_reduce_mean(float(finite), run.dist, run.device) == 1.0
        loss = distributed.all_reduce_mean(loss, run.dist, run.device)
        aux = distributed.all_reduce_mean(aux, run.dist, run.device)
    if not finite:
        run.optimizer.zero_grad(set_to_none=True)
        run.model.discard_router_counts()
        run.scheduler.step()
        state.bad_steps += 1
        state.consecutive_bad += 1
        return StepResult(loss, aux, False, 0.0, out.metrics)
    state.consecutive_bad = 0
    grad_norm = run.optimizer.clip_grad_norm(cfg.optim.grad_clip)
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.model.update_router_biases()
    state.interval_loss += loss
    state.interval_aux += aux
    state.interval_steps += 1
    return StepResult(loss, aux, True, grad_norm, out.metrics)


def forward_backward(run: Run, last: bool) -> Any:
    """Forward and backward of the next micro-batch; returns the model output.

    A bad loss still runs backward, so DDP ranks stay in step; ``train_step`` then skips
    the update and drops the gradients.
    """
    inputs, targets = run.loader.next()
    inputs, targets = inputs[run.rows].to(run.device), targets[run.rows].to(run.device)
    accumulating = contextlib.nullcontext() if last else run.optimizer.no_sync()
    with autocast_context(run.device), accumulating:
        out = run.forward_model(inputs, targets)
        (out.loss / run.cfg.grad_accum).backward()
    return out


def _check_bad_steps(run: Run, step: int) -> None:
    """Warn about a skipped step; stop the run after ``max_bad_steps`` in a row."""
    bad = run.state.consecutive_bad
    log.warning("step %d: non-finite loss, step skipped (%d in a row)", step, bad)
    if bad >= run.cfg.max_bad_steps:
        raise MoestackError(
            f"the loss was NaN/inf for {bad} steps in a row (step {step}); "
            f"{checkpoint.kept_note(run.ckpt_root)}; lower optim.lr or check the data"
        )


def _evaluation_due(cfg: TrainConfig, done: int) -> bool:
    """Whether the loop evaluates after step ``done``: every ``eval_every`` steps, on its
    own schedule (log steps or not); the last step's evaluation is ``finish_run``'s."""
    return bool(cfg.eval_every) and done % cfg.eval_every == 0 and done != cfg.steps


def log_interval(
    run: Run, result: StepResult, done: int, progress: Any, evaluating: bool = False
) -> None:
    """Write one metrics record for the steps since the last one (plus, with
    ``evaluating``, the evaluation of this step, and telemetry's interval metrics), then
    start a new interval."""
    cfg, state = run.cfg, run.state
    elapsed = run.interval_step_s  # training throughput: evaluation and checkpoints apart
    metrics = {
        "loss/train": state.interval_loss / state.interval_steps,
        "loss/aux": state.interval_aux / state.interval_steps,
        "optim/lr": run.scheduler.get_last_lr()[0],
        "optim/grad_norm": result.grad_norm,
        "perf/tokens_per_s": run.tokens_per_step * state.interval_steps / max(elapsed, 1e-9),
        "perf/bad_steps": state.bad_steps,
    }
    metrics.update({k: float(v) for k, v in result.router_metrics.items()})
    metrics.update(run.optimizer.metrics())  # the optimizer's own (optim=tiered: per population)
    metrics["eval/train_perplexity"] = perplexity(metrics["loss/train"])
    if run.exchange is not None:
        steps = state.interval_steps
        metrics.update(parallel.exchange_metrics(run.exchange, run.dist.world_size, steps, elapsed))
    if run.streaming is not None:  # the training's own cache traffic, per step
        metrics.update(run.streaming.metrics(state.interval_steps))
    if evaluating:
        metrics.update(_evaluate_in_training(run))
    charts = None
    if run.telemetry is not None:
        metrics.update(run.telemetry.interval_metrics(step=done))
        if run.writer.wandb_run is not None and done % (10 * cfg.log_every) == 0:
            charts = run.telemetry.wandb_charts()
    run.writer.log(done, metrics, extra_wandb=charts)
    run.last_metrics.update(metrics)
    if progress is not None:
        progress.set_postfix(
            loss=f"{metrics['loss/train']:.3f}", tok_s=f"{metrics['perf/tokens_per_s']:.0f}"
        )
    state.reset_interval()
    run.interval_step_s = 0.0


def log_evaluation(run: Run, done: int) -> None:
    """Evaluate after step ``done`` and write it as a record of its own (``eval_every`` on a
    step that writes no training record)."""
    metrics = _evaluate_in_training(run)
    run.writer.log(done, metrics)
    run.last_metrics.update(metrics)


def _evaluate_in_training(run: Run) -> dict[str, float]:
    """An evaluation between training steps. The expert exchanges it makes are not training
    traffic: the exchange counters are left as they were before it (mid-interval they hold
    the interval's training traffic so far)."""
    kept = copy.deepcopy(run.exchange)
    metrics = _evaluate(run)
    if run.exchange is not None:
        for f in dataclasses.fields(run.exchange):
            setattr(run.exchange, f.name, getattr(kept, f.name))
    return metrics


def _evaluate(run: Run) -> dict[str, float]:
    """Validation loss and perplexity, out of the routing trace; its time is counted apart
    from training's."""
    started = time.perf_counter()
    run.optimizer.synchronize()  # a delayed update's weights are the model's
    with _paused(run.telemetry):
        out = evaluate(run.model, run.val_batches, run.device)
    run.eval_s += time.perf_counter() - started
    return out


def finish_run(run: Run) -> dict[str, Any]:
    """Final evaluation and checkpoint (a start resumed from the final checkpoint saves
    nothing again), close the sinks; returns (and on rank 0 writes and prints) the run
    summary."""
    cfg = run.cfg
    final_eval = _evaluate(run)
    if run.start_step < cfg.steps:
        save(run, cfg.steps)
        run.writer.log(cfg.steps, final_eval)
    else:  # resumed from the final checkpoint: a start killed before summary.json logged it
        _restore_last_metrics(run, final_eval)
    if run.telemetry is not None:
        run.telemetry.close()
        write_json(run.out_dir / "telemetry_summary.json", run.telemetry.summary())
    run.writer.close()
    run.last_metrics.update(final_eval)
    summary = run_summary(run, final_eval)
    if run.dist.is_main:
        write_json(run.out_dir / "summary.json", summary)
        log.info("\n%s", format_summary(summary))
    if not math.isfinite(final_eval["loss/val"]):  # the run did not produce a usable model
        raise MoestackError(
            f"the final validation loss is {final_eval['loss/val']} although every checkpointed "
            f"weight is finite; see {run.out_dir / 'metrics.jsonl'} for where the loss went bad"
        )
    return summary


def _restore_last_metrics(run: Run, final_eval: dict[str, float]) -> None:
    """A run resumed at its last step trains nothing: its last metrics are those of the
    records metrics.jsonl holds (the start that reached the end logged them), and the final
    evaluation is logged only if that start was killed before logging it."""
    path = run.out_dir / "metrics.jsonl"
    logged = read_metrics(path) if path.exists() else []
    run.last_metrics.update(latest_values(path, run.cfg.steps))
    if not any(r.get("step") == run.cfg.steps and "loss/val" in r for r in logged):
        run.writer.log(run.cfg.steps, final_eval)


def run_summary(run: Run, final_eval: dict[str, float]) -> dict[str, Any]:
    """The run's headline numbers (summary.json); the throughput is this start's training
    steps alone (evaluation and checkpoints apart, as on the progress bar)."""
    params = run.model.num_params()
    steps = run.cfg.steps - run.start_step
    summary = {
        "loss/train": run.last_metrics.get("loss/train", float("nan")),
        "loss/val": final_eval["loss/val"],
        "eval/perplexity": final_eval["eval/perplexity"],
        "perf/tokens_per_s": run.tokens_per_step * steps / max(run.train_s, 1e-9)
        if steps  # a start that trained no step: the last interval's, as logged
        else run.last_metrics.get("perf/tokens_per_s", float("nan")),
        "perf/train_s": run.train_s,
        "perf/eval_s": run.eval_s,
        "params/total": params["total"],
        "params/active": params["active"],
        "perf/bad_steps": run.state.bad_steps,
        "out_dir": str(run.out_dir),
    }
    for i in range(run.cfg.model.n_layers):
        key = f"router/layer{i}/imbalance"
        if key in run.last_metrics:
            summary[key] = run.last_metrics[key]
    return summary


# --------------------------------------------------------------------------- building a run
def _builds_on_meta(cfg: TrainConfig) -> bool:
    """Whether this rank builds its model's experts (and any LoRA adapters on them) on the
    meta device and materialises its own only (the backbone is every rank's): any model
    under expert parallelism."""
    return cfg.parallel.ep > 1


def _build_model(
    cfg: TrainConfig, dist_info: distributed.DistInfo, resume_from: Path | None
) -> tuple[RoutedLM, Any, Any, int]:
    """The run's model on the host, with this rank's experts only (under expert parallelism
    no other rank's expert is ever allocated: built on meta, cut, then materialised), its
    weights drawn layout-free from ``cfg.seed`` or read from ``resume_from``; the EP mesh and
    exchange counters (None without), and the step to start at."""
    torch.manual_seed(cfg.seed)  # whatever a build draws from the global stream
    on_meta = _builds_on_meta(cfg)
    hf_resume = not isinstance(cfg.model, ModelConfig) and resume_from is not None
    hf_resume = hf_resume and cfg.offload_experts == "off"  # streamed: experts from the folder
    if isinstance(cfg.model, ModelConfig):
        model = cfg.model.build(seed=cfg.seed, experts_on_meta=on_meta)
    elif hf_resume:  # every weight comes from the checkpoint: none is read from the folder
        model = cfg.model.build(experts=False, weights=False)
    else:  # a transformers folder: on meta, its experts are read once the rank has its own
        model = cfg.model.build(experts=not on_meta)
    lora.add_adapters_for(model, cfg.trainable, cfg.lora, cfg.seed)
    if cfg.trainable in lora.LORA_TRAINABLE:  # the adapters' scale alpha / rank, stated
        log.info("%s", cfg.lora.describe())
    if cfg.compile:  # the blocks compile at the first step, after the move to the device
        model.compile_blocks()
        log.info("compile=true: the blocks compile during the first step (a minute or more)")
    if cfg.trainable != "all":
        trained = model.set_trainable(cfg.trainable)
        log.info("trainable=%s: %s parameters train, the rest is frozen",
                 cfg.trainable, human_count(trained))  # fmt: skip
    mesh, exchange = parallel.expert_parallel(model, dist_info.world_size, dist_info.rank,
                                              cfg.parallel.ep)  # fmt: skip
    if on_meta and isinstance(cfg.model, ModelConfig):  # drawn as the whole model's would be
        model.init_experts(cfg.seed)
    elif on_meta and resume_from is None:  # this rank's experts' bytes alone
        fill_expert_rows(model, cfg.model.path)
    if on_meta:  # their adapters' rows, drawn as the whole build draws them
        lora.init_expert_adapters(model, cfg.seed)
    if hf_resume:  # memory for what is still meta (this rank's share), filled below
        meta_load.materialize(model)
    # training's draws from the global stream (LoRA's dropout) start from the seed, whatever
    # the build drew (a whole build draws experts a meta one does not)
    torch.manual_seed(cfg.seed)
    start_step = 0
    if resume_from is not None:  # this rank's experts' rows only
        with experts_left_out(model) if cfg.offload_experts != "off" else contextlib.nullcontext():
            start_step = checkpoint.load_model_weights(resume_from, model, cfg.model)["step"]
    return model, mesh, exchange, start_step


def build_run(
    cfg: TrainConfig,
    out_dir: Path,
    dist_info: distributed.DistInfo,
    begin: Callable[[], None] | None = None,
) -> Run:
    """Device, model, optimizer, scheduler, data, metrics sink and telemetry of a run, from
    its config; with ``resume=true`` restored from the newest checkpoint.

    Everything that can refuse the start comes first and writes nothing into ``out_dir``
    (the folder against ``resume``, the config against the run's, the data, the impl, the
    model and a resumed run's weights); then ``begin()`` (``train`` records the start) and
    the run's files: its config, metrics, wandb run and trace."""
    device = resolve_device(cfg.device, dist_info.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    parallel.check_layout(dist_info.world_size, cfg.parallel.ep)
    if cfg.parallel.ep > 1 or cfg.offload_experts != "off":  # freed blocks back to the OS
        host_allocator.set_mmap_threshold(cfg.parallel.host_mmap_threshold_kb << 10)
    cfg.check_batch_split(dist_info.world_size)
    resume_from = prepare_out_dir(cfg, out_dir, dist_info)
    corpus = run_corpus(cfg)
    check_impl(cfg.model.moe.impl, device)
    model, mesh, exchange, start_step = _build_model(cfg, dist_info, resume_from)
    if begin is not None:  # the start is not refused: from here on it writes the run's files
        begin()
    start_out_dir(cfg, out_dir, dist_info)  # a resumed run's: its checkpoint fits this config
    streaming = _to_device(model, cfg, device, out_dir)
    optimizer = build_training_optimizer(model, cfg.optim, dist_info.world_size, mesh)
    run = Run(
        cfg=cfg,
        out_dir=out_dir,
        dist=dist_info,
        device=device,
        model=model,
        forward_model=optimizer.forward_model,
        optimizer=optimizer,
        scheduler=_lr_scheduler(optimizer, cfg),
        loader=BatchLoader(corpus.train, cfg.batch_size, cfg.data.seq_len, cfg.seed),
        val_batches=eval_batches(corpus.val, cfg.batch_size, cfg.data.seq_len, cfg.eval_batches),
        writer=_metrics_writer(cfg, out_dir, dist_info, start_step),
        telemetry=None,
        state=TrainState(),
        start_step=start_step,
        mesh=mesh,
        exchange=exchange,
        streaming=streaming,
    )
    if resume_from is not None:
        restore(run, resume_from)
    params = model.num_params()
    log.info("model: %s parameters, %s active per token", human_count(params["total"]),
             human_count(params["active"]))  # fmt: skip
    log.info("batch: %s", _batch_line(cfg, dist_info.world_size))
    model.train()
    if dist_info.is_main:
        run.telemetry = _attach_telemetry(cfg, model, out_dir, run.start_step)
    return run


def _to_device(model: RoutedLM, cfg: TrainConfig, device: torch.device, out_dir: Path) -> Any:
    """The model on ``device`` in the optimizer's parameter dtype, its frozen experts
    streamed where ``offload_experts`` asks (the StreamingState; None when off)."""
    model.to(device)
    param_dtype = apply_param_dtype(model, cfg.optim, device)
    if param_dtype != torch.float32:
        log.info("model weights and gradients on %s in %s", device, param_dtype)
    return attach_streaming(model, cfg, out_dir)


def _metrics_writer(
    cfg: TrainConfig, out_dir: Path, dist_info: distributed.DistInfo, start_step: int
) -> MetricsWriter:
    """metrics.jsonl and wandb, on rank 0; a resumed run drops what a killed attempt logged
    past ``start_step``."""
    return MetricsWriter(
        out_dir,
        enabled=dist_info.is_main,
        wandb_project=cfg.wandb_project,
        wandb_mode=cfg.wandb_mode,
        wandb_config=dataclasses.asdict(cfg),
        resume_step=start_step,
    )


def _batch_line(cfg: TrainConfig, world_size: int) -> str:
    """batch_size is the global batch (all ranks together), split over the ranks."""
    per_rank = f", {cfg.batch_size // world_size} per rank over {world_size} ranks"
    return (
        f"{cfg.batch_size} sequences of {cfg.data.seq_len} tokens per micro-batch, the global "
        f"batch{per_rank if world_size > 1 else ''}; x {cfg.grad_accum} micro-batches a step"
    )


def lr_factor(step: int, total_steps: int, warmup_steps: int, min_lr_ratio: float) -> float:
    """Linear warm-up to 1, then cosine decay to ``min_lr_ratio`` at ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def _lr_scheduler(
    optimizer: torch.optim.Optimizer, cfg: TrainConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: lr_factor(s, cfg.steps, cfg.optim.warmup_steps, cfg.optim.min_lr_ratio),
    )


# --------------------------------------------------------------------------- checkpoints
def save(run: Run, step: int) -> None:
    """Checkpoint the run at ``step`` (every rank takes part: the optimizer may be sharded).

    Weights or optimizer state with NaN/inf are never saved (a finite loss does not rule
    them out): the run stops naming the tensor and the last checkpoint, which stays. The
    routing trace is flushed first, before the checkpoint is written, so a resumed run's
    trace holds every step its checkpoint holds wherever the kill came. Under expert
    parallelism every rank writes its own experts (weights and optimizer state) and its
    shard of the replicated optimizer state into files of its own
    (moestack.checkpoint_parts): nothing is gathered."""
    run.optimizer.synchronize()  # the weights saved are those of every update made
    common, own = run.optimizer.sharded_state_dict() if run.mesh else (None, [])
    state = {
        "optimizer": common if run.mesh else run.optimizer.state_dict(),  # collective
        "scheduler": run.scheduler.state_dict(),
        "data": run.loader.state_dict(),
        "rng": checkpoint.rng_state(),
        "train": run.state.state_dict(),
        "bad_steps": run.state.bad_steps,  # read by checkpoints written before "train"
    }
    _refuse_non_finite(run, step, [state["optimizer"], own])
    if run.telemetry is not None:  # first: the trace on disk covers what a checkpoint covers
        run.telemetry.flush()
    if run.mesh is not None:
        _save_with_rank_files(run, step, state, own)
    elif run.dist.is_main:
        checkpoint.save_checkpoint(
            run.ckpt_root, step, run.model, run.cfg.model, state, run.cfg.keep_last
        )
    distributed.barrier(run.dist)


def _save_with_rank_files(run: Run, step: int, state: dict[str, Any], own: Any) -> None:
    """Expert parallelism's checkpoint: rank 0 opens a temporary folder, every rank writes
    its files into it, rank 0 commits it with their sizes and digests. A rank that fails is
    named on every rank (none waits for it), and the folder is removed."""
    folder = _on_every_rank(run, "create the checkpoint folder", lambda: str(
        checkpoint.new_folder(run.ckpt_root, step)) if run.dist.is_main else None)[0]  # fmt: skip
    first_replica = run.mesh is not None and run.mesh.dp_rank == 0
    written = _on_every_rank(run, "write its files", lambda: checkpoint_parts.write_rank_files(
        Path(folder), run.dist.rank, run.model, first_replica, own), cleanup=folder)  # fmt: skip
    parts = [part for files in written for part in files]
    _on_every_rank(run, "commit the checkpoint", lambda: checkpoint.save_checkpoint(
        run.ckpt_root, step, run.model, run.cfg.model, state, run.cfg.keep_last,
        folder=Path(folder), parts=parts) if run.dist.is_main else None)  # fmt: skip


def _on_every_rank(
    run: Run, what: str, work: Callable[[], Any], cleanup: str | None = None
) -> list[Any]:
    """``work()`` on every rank, then every rank's result (collective); when any rank
    failed, every rank raises the first failure (its rank named) and rank 0 removes
    ``cleanup``; the last checkpoint stays."""
    try:
        result, error = work(), None
    except Exception as err:  # reported to every rank, none left waiting
        result, error = None, f"rank {run.dist.rank} could not {what}: {err}"
    outcomes = distributed.gather_objects((result, error), run.dist)
    errors = [e for _, e in outcomes if e is not None]
    if errors:
        if cleanup is not None and run.dist.is_main:
            shutil.rmtree(cleanup, ignore_errors=True)
        raise MoestackError(f"{errors[0]}; {checkpoint.kept_note(run.ckpt_root)}")
    return [r for r, _ in outcomes]


def _refuse_non_finite(run: Run, step: int, optimizer_state: Any) -> None:
    bad = checkpoint.first_non_finite(
        run.model.state_dict(), "weight"
    ) or checkpoint.first_non_finite(optimizer_state, "optimizer state")
    clean = bad is None
    if run.dist.active:  # every rank stops together
        clean = distributed.all_reduce_mean(float(clean), run.dist, run.device) == 1.0
    if not clean:
        raise MoestackError(
            f"step {step}: {bad or 'another rank'} holds NaN/inf although the loss was finite; "
            f"not checkpointed; {checkpoint.kept_note(run.ckpt_root)}; lower optim.lr (or "
            "optim.grad_clip)"
        )


def restore(run: Run, path: Path) -> None:
    """Load optimizer, scheduler, data, RNG and loop state from checkpoint ``path`` (the
    model weights, and with them ``run.start_step``, were loaded before the optimizer was
    built)."""
    state = checkpoint.load_train_state(path)
    run.scheduler.load_state_dict(state["scheduler"])
    rows = checkpoint_parts.expert_tensor_rows(run.model)
    block = checkpoint_parts.block_of(rows) if rows else None
    parts = checkpoint.load_optimizer_parts(path, block)  # the rank files of this rank's experts
    run.optimizer.load_sharded_state_dict(state["optimizer"], parts)  # saved at any layout
    run.loader.load_state_dict(state["data"])
    checkpoint.set_rng_state(state["rng"])
    run.state.load_state_dict(state.get("train", {"bad_steps": state.get("bad_steps", 0)}))
    run.state.step = run.start_step
    log.info("resumed from %s at step %d", path, run.start_step)


# --------------------------------------------------------------------------- small helpers
def _attach_telemetry(cfg: TrainConfig, model: RoutedLM, out_dir: Path, start_step: int):
    """Hook the routers (rank 0 only); the trace streams to <run>/trace/from-<step>, its meta
    saying where it starts and how many rows a step records. A resumed run first replays its
    earlier parts, cut at this step, into the live caches, so that interval metrics and
    telemetry_summary.json cover the whole run (moestack.telemetry.run_trace)."""
    if not cfg.telemetry.enabled:
        return None
    from moestack.telemetry import attach, run_trace

    trace_root = Path(cfg.telemetry.trace_dir) if cfg.telemetry.trace_dir else out_dir / "trace"
    for stale in run_trace.find_parts(trace_root):
        if (run_trace.part_step(stale) or 0) >= start_step:  # this start records those steps anew
            if run_trace.part_step(stale) != start_step:
                log.warning("%s: a later start this run abandons; removed", stale)
            shutil.rmtree(stale)
    part = trace_root / run_trace.part_name(start_step)
    if part.exists():  # left by an attempt that crashed after this checkpoint: recorded anew
        shutil.rmtree(part)
    dist = torch.distributed
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    per_step = cfg.batch_size // world * cfg.grad_accum * cfg.data.seq_len  # rank 0's rows
    telemetry = attach(
        model,
        policies=cfg.telemetry.policies,
        capacities=cfg.telemetry.capacities,
        trace_dir=str(part),
        max_memory_tokens=0,
        meta={run_trace.META_START_STEP: start_step, run_trace.META_TOKENS_PER_STEP: per_step},
    )
    try:
        history = run_trace.load_history(trace_root, start_step)
    except ValueError as err:  # a damaged earlier part must not stop the run from resuming
        log.warning("telemetry: the earlier trace cannot be replayed (%s); "
                    "telemetry_summary.json covers this start only", err)  # fmt: skip
        history = None
    if history is not None:
        telemetry.replay_history(history, interval_tokens=cfg.log_every * per_step)
    return telemetry


def _paused(telemetry: Any) -> contextlib.AbstractContextManager:
    """Evaluation batches are not training traffic: keep them out of the trace."""
    return telemetry.paused() if telemetry is not None else contextlib.nullcontext()


def _progress_bar(cfg: TrainConfig, start_step: int) -> Any:
    if not cfg.progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=cfg.steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)
