"""The work beside the training loop, as callbacks the ``Trainer`` calls at named points (as
OLMo-core's trainer does): the console (memory plan, progress bar), evaluation, routing
telemetry and checkpoints. The loop itself (``moestack.trainer``) only steps, logs its own
interval record and asks each callback in turn.

The points, in the order a run meets them:

- ``begin``: every check of the start passed; the run's files may be written from now on
  (a start refused before this point has written nothing);
- ``built``: the run is built (and a resumed one restored), before its first step;
- ``step_end(result)``: an optimizer step is done (``trainer.state.step`` counts it), before
  its metrics record;
- ``record(done, metrics, extra)``: a training record is being written after step ``done``:
  add to ``metrics`` (and ``extra["charts"]``, wandb-only);
- ``after_record(done, recorded)``: after the step's record (``recorded``: one was written);
- ``saving(step)``: a checkpoint is about to be written; ``evaluating()``: a context the
  evaluation runs in;
- ``loop_end``: the loop ended, however; ``train_end``: after the final evaluation, the final
  checkpoint; ``close``: the run's sinks close.

``trainer`` is the ``moestack.trainer.Trainer`` calling (typed ``Any`` here: this module is
imported by the trainer, never the other way round).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from moestack import checkpoint, checkpoint_parts, distributed, memory_plan
from moestack.config import TrainConfig
from moestack.errors import MoestackError
from moestack.model import RoutedLM

log = logging.getLogger(__name__)


class Callback:
    """A part of the run beside the loop; every point does nothing unless overridden."""

    def begin(self, trainer: Any) -> None:
        """The start's checks passed: from here on the run's files are written."""

    def built(self, trainer: Any) -> None:
        """The run is built (restored on resume), before its first step."""

    def step_end(self, trainer: Any, result: Any) -> None:
        """An optimizer step is done (``result``: its StepResult), before its record."""

    def record(self, trainer: Any, done: int, metrics: dict[str, float], extra: dict) -> None:
        """A training record is written after step ``done``: add to ``metrics``."""

    def after_record(self, trainer: Any, done: int, recorded: bool) -> None:
        """After step ``done`` and its record (``recorded``: a training record was written)."""

    def saving(self, trainer: Any, step: int) -> None:
        """A checkpoint at ``step`` is about to be written."""

    def evaluating(self, trainer: Any) -> contextlib.AbstractContextManager:
        """The context an evaluation runs in."""
        return contextlib.nullcontext()

    def loop_end(self, trainer: Any) -> None:
        """The loop ended (finished or failed)."""

    def train_end(self, trainer: Any) -> None:
        """After the final evaluation: the final checkpoint."""

    def close(self, trainer: Any) -> None:
        """The run ends: its sinks close."""


def default_callbacks(plan_table: bool = True) -> list[Callback]:
    """The run's own callbacks, in the order they are called (evaluation before telemetry:
    a record holds the evaluation, then telemetry's interval metrics; evaluation before the
    checkpoint, as the checkpoint saves the RNG state after it). ``plan_table=False`` logs
    the memory plan's totals only (a sweep's later jobs)."""
    return [Console(plan_table), Evaluation(), Telemetry(), Checkpointer()]


# --------------------------------------------------------------------------- console
class Console(Callback):
    """The memory plan and the peak after the first step (rank 0), and the progress bar."""

    def __init__(self, plan_table: bool = True) -> None:
        self.plan_table = plan_table
        self.plan: Any = None
        self.bar: Any = None

    def built(self, trainer: Any) -> None:
        if not trainer.dist.is_main:
            return
        cfg = trainer.cfg
        self.plan = memory_plan.log_plan(cfg, trainer.dist.world_size, trainer.device,
                                         self.plan_table, trainer.model)  # fmt: skip
        self.bar = _progress_bar(cfg, trainer.start_step)

    def step_end(self, trainer: Any, result: Any) -> None:
        if trainer.state.step == trainer.start_step + 1:
            memory_plan.log_peak(self.plan, trainer.device)
        if self.bar is not None:
            self.bar.update(1)

    def record(self, trainer: Any, done: int, metrics: dict[str, float], extra: dict) -> None:
        if self.bar is not None:
            self.bar.set_postfix(
                loss=f"{metrics['loss/train']:.3f}", tok_s=f"{metrics['perf/tokens_per_s']:.0f}"
            )

    def loop_end(self, trainer: Any) -> None:
        if self.bar is not None:
            self.bar.close()


def _progress_bar(cfg: TrainConfig, start_step: int) -> Any:
    if not cfg.progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=cfg.steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)


# --------------------------------------------------------------------------- evaluation
class Evaluation(Callback):
    """Every ``eval_every`` steps (the last step's evaluation is the trainer's final one):
    in the step's training record, or a record of its own on a step that writes none."""

    def record(self, trainer: Any, done: int, metrics: dict[str, float], extra: dict) -> None:
        if evaluation_due(trainer.cfg, done):
            metrics.update(trainer.evaluate_in_training())

    def after_record(self, trainer: Any, done: int, recorded: bool) -> None:
        if evaluation_due(trainer.cfg, done) and not recorded:
            metrics = trainer.evaluate_in_training()
            trainer.writer.log(done, metrics)
            trainer.last_metrics.update(metrics)


def evaluation_due(cfg: TrainConfig, done: int) -> bool:
    """Whether the loop evaluates after step ``done``: every ``eval_every`` steps, on its
    own schedule (log steps or not); the last step's evaluation is the final one."""
    return bool(cfg.eval_every) and done % cfg.eval_every == 0 and done != cfg.steps


# --------------------------------------------------------------------------- telemetry
class Telemetry(Callback):
    """Routing telemetry on rank 0 (``telemetry.enabled``): hooked on the routers once the run
    is built, its interval metrics in each training record (its wandb charts every tenth),
    its trace flushed before each checkpoint, paused while evaluating, closed at the end
    with telemetry_summary.json."""

    def __init__(self) -> None:
        self.telemetry: Any = None

    def built(self, trainer: Any) -> None:
        if trainer.dist.is_main:
            self.telemetry = attach_telemetry(trainer.cfg, trainer.model, trainer.out_dir,
                                              trainer.start_step)  # fmt: skip

    def record(self, trainer: Any, done: int, metrics: dict[str, float], extra: dict) -> None:
        if self.telemetry is None:
            return
        metrics.update(self.telemetry.interval_metrics(step=done))
        if trainer.writer.wandb_run is not None and done % (10 * trainer.cfg.log_every) == 0:
            extra["charts"] = self.telemetry.wandb_charts()

    def saving(self, trainer: Any, step: int) -> None:
        if self.telemetry is not None:  # the trace on disk covers what a checkpoint covers
            self.telemetry.flush()

    def evaluating(self, trainer: Any) -> contextlib.AbstractContextManager:
        """Evaluation batches are not training traffic: kept out of the trace."""
        return (
            self.telemetry.paused() if self.telemetry is not None else super().evaluating(trainer)
        )

    def close(self, trainer: Any) -> None:
        if self.telemetry is not None:
            from moestack.metrics import write_json

            self.telemetry.close()
            write_json(trainer.out_dir / "telemetry_summary.json", self.telemetry.summary())


def attach_telemetry(cfg: TrainConfig, model: RoutedLM, out_dir: Path, start_step: int) -> Any:
    """Hook the routers (rank 0 only) as ``cfg.telemetry`` says (``TelemetryConfig.build``:
    the trace streams to <run>/trace/from-<step>; a resumed run first replays its earlier
    parts), a step recording rank 0's rows."""
    dist = torch.distributed
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    per_step = cfg.batch_size // world * cfg.grad_accum * cfg.data.seq_len  # rank 0's rows
    return cfg.telemetry.build(model, out_dir, start_step, per_step, cfg.log_every * per_step)


# --------------------------------------------------------------------------- checkpoints
class Checkpointer(Callback):
    """Every ``ckpt_every`` steps (the last step's checkpoint is the final one), and the
    final one (a start resumed from the final checkpoint saves nothing again)."""

    def after_record(self, trainer: Any, done: int, recorded: bool) -> None:
        cfg = trainer.cfg
        if cfg.ckpt_every and done % cfg.ckpt_every == 0 and done != cfg.steps:
            save(trainer, done)

    def train_end(self, trainer: Any) -> None:
        if trainer.start_step < trainer.cfg.steps:
            save(trainer, trainer.cfg.steps)


def save(trainer: Any, step: int) -> None:
    """Checkpoint the run at ``step`` (every rank takes part: the optimizer may be sharded).

    Weights or optimizer state with NaN/inf are never saved (a finite loss does not rule
    them out): the run stops naming the tensor and the last checkpoint, which stays. The
    routing trace is flushed first (``saving``), before the checkpoint is written, so a
    resumed run's trace holds every step its checkpoint holds wherever the kill came. Under
    expert parallelism every rank writes its own experts (weights and optimizer state) and
    its shard of the replicated optimizer state into files of its own
    (moestack.checkpoint_parts): nothing is gathered."""
    run = trainer
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
    run.call("saving", step)
    if run.mesh is not None:
        _save_with_rank_files(run, step, state, own)
    elif run.dist.is_main:
        checkpoint.save_checkpoint(
            run.ckpt_root, step, run.model, run.cfg.model, state, run.cfg.keep_last
        )
    distributed.barrier(run.dist)


def _save_with_rank_files(run: Any, step: int, state: dict[str, Any], own: Any) -> None:
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
    run: Any, what: str, work: Callable[[], Any], cleanup: str | None = None
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


def _refuse_non_finite(run: Any, step: int, optimizer_state: Any) -> None:
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


def restore(run: Any, path: Path) -> None:
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
