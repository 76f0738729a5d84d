"""The training loop: ``Trainer(cfg, out_dir).train()`` checks the start, creates the run's
files, builds the run, steps it to ``cfg.steps`` (``train_step``) and finishes it; the work
beside the loop (console, evaluation, telemetry, checkpoints) is done by callbacks it calls
at named points (``moestack.callbacks``). ``train(cfg, out_dir)`` is the same in one call.

One run = one output directory holding the resolved config (config.yaml), metrics.jsonl,
checkpoints/ and a wandb offline run. ``resume=true`` continues a killed run from its newest
checkpoint; on the CPU the resumed losses equal the uninterrupted run's. Under torchrun every
rank runs the same loop on its slice of each global batch, and rank 0 writes.

A start checks first and creates after: everything that can refuse it (the config, the
folder against ``resume``, the data, the impl, the model and a resumed run's weights) runs
before anything is written into ``out_dir``; then the ``begin`` point (the folder made and
held, hydra's record, provenance.json's record of the start, config.yaml). A refused start
leaves the folder as it was, with nothing to undo.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import errno
import logging
import math
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moestack import (
    atomic,
    checkpoint,
    distributed,
    host_allocator,
    lora,
    meta_load,
    parallel,
    provenance,
)
from moestack.cache.streaming import (
    attach_streaming,
    check_streamable,
    expert_source,
    experts_left_out,
    materialize_expert_adapters,
)
from moestack.callbacks import Callback, default_callbacks, restore
from moestack.config import TrainConfig
from moestack.data import BatchLoader, eval_batches
from moestack.device import autocast_context, move_resident, resolve_device
from moestack.errors import MoestackError
from moestack.evaluation import evaluate, perplexity
from moestack.metrics import (
    MetricsWriter,
    format_summary,
    human_count,
    latest_values,
    read_metrics,
    write_json,
)
from moestack.model import RoutedLM
from moestack.moe import check_impl
from moestack.optim import apply_param_dtype, param_cast
from moestack.run_folder import RunFolder
from moestack.run_paths import check_out_dir
from moestack.runs import check_same_config_on_every_rank, run_corpus, start_out_dir

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


def train(
    cfg: TrainConfig, out_dir: Path | str, launch: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Train ``cfg.model`` on ``cfg.data`` into ``out_dir``; returns the run summary
    (``Trainer(cfg, out_dir, launch).train()``)."""
    return Trainer(cfg, out_dir, launch).train()


def build_run(cfg: TrainConfig, out_dir: Path | str, dist_info: distributed.DistInfo) -> Trainer:
    """A trainer built in ``out_dir`` without training (its checks first, as ``train``'s):
    its model, optimizer and data ready for ``train_step``."""
    trainer = Trainer(cfg, out_dir)
    trainer.dist = dist_info
    trainer.build()
    return trainer


# What ``build`` makes, let go of once the run ended (``Trainer._let_go``).
_BUILT = ("model", "forward_model", "optimizer", "scheduler", "loader", "val_batches", "writer",
          "streaming", "device")  # fmt: skip


class Trainer:
    """One training run (``build``, ``train``, ``train_step``), with its callbacks.

    ``launch`` says how the run was started, for its provenance.json record (default: the
    process's command line; ``moestack.provenance``); ``callbacks`` are called before the
    run's own (``moestack.callbacks.default_callbacks``) at each point: ``moestack-train``'s
    writes hydra's record at ``begin``. The folder is held while the run trains: a second
    run into it is refused. ``began`` says whether the start passed its checks. Once
    ``train`` returns (or fails), what it built is let go, with the process groups."""

    def __init__(
        self,
        cfg: TrainConfig,
        out_dir: Path | str,
        launch: dict[str, Any] | None = None,
        callbacks: Sequence[Callback] = (),
    ) -> None:
        first_job = not (launch or {}).get("sweep") or launch["sweep"].get("job") == 0
        self.cfg, self.out_dir, self.launch = cfg, Path(out_dir), launch
        self.callbacks = [*callbacks, *default_callbacks(plan_table=first_job)]
        self.dist = distributed.DistInfo()
        self.state = TrainState()
        self.began = False
        self.last_metrics: dict[str, float] = {}
        self.interval_step_s = 0.0  # seconds in train_step since the last log record
        self.train_s = 0.0  # seconds in train_step since this process started
        self.eval_s = 0.0  # seconds in evaluation since this process started
        self.start_step = 0  # the step this process started (or resumed) at
        self.mesh: parallel.ExpertParallelMesh | None = None  # parallel.ep > 1
        self.exchange: parallel.ExchangeStats | None = None  # parallel.ep > 1: all-to-all
        self._folder: RunFolder | None = None
        self._start: provenance.StartRecord | None = None

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

    def call(self, point: str, *args: Any) -> None:
        """Call every callback at ``point`` (moestack.callbacks), in order."""
        for callback in self.callbacks:
            getattr(callback, point)(self, *args)

    # ----------------------------------------------------------------------- the run
    def train(self) -> dict[str, Any]:
        """Check, create, build, step to ``cfg.steps`` and finish; returns the run summary.
        ``cfg`` is resolved first (a transformers model's architecture read from its
        folder). The process groups end after the run's objects are gone (on failure too:
        the traceback's frames are cleared), so nothing keeps a group, and gloo's threads,
        alive into the interpreter's exit (``distributed.close_process_groups``)."""
        self.cfg = self.cfg.resolve()
        provenance.check_launch(self.launch)  # on every rank, before any of them starts
        check_out_dir(self.out_dir)
        if self.cfg.threads:
            torch.set_num_threads(self.cfg.threads)
        self.dist = distributed.init_from_env(resolve_device(self.cfg.device).type)
        try:
            check_same_config_on_every_rank(self.cfg, self.dist)  # before any other collective
            with self._held() as start:
                self._start = start
                self.build()
                try:
                    for step in range(self.start_step, self.cfg.steps):
                        started = time.perf_counter()
                        result = self.train_step()
                        self._step_done(step, result, time.perf_counter() - started)
                finally:
                    self.call("loop_end")
                summary = self.finish()
                # No rank tears its process group down while another still talks to it: gloo
                # aborts a rank whose peer closed the connection first (a SIGABRT at exit).
                distributed.barrier(self.dist)
            return summary
        except BaseException as err:
            traceback.clear_frames(err.__traceback__)  # the failed run's objects die here
            raise
        finally:
            self._let_go()
            distributed.shutdown(self.dist)

    def _let_go(self) -> None:
        """Drop what the run built (its model, optimizer, data, sinks, callbacks), which may
        hold a process group, before the groups end (a streamed run's cache closed: its
        prefetch threads and open store files); the summary and counters stay."""
        if getattr(self, "streaming", None) is not None:
            self.streaming.close()
        for name in _BUILT:
            self.__dict__.pop(name, None)
        self.mesh = self.exchange = None
        self.callbacks = []

    @contextlib.contextmanager
    def _held(self) -> Iterator[provenance.StartRecord]:
        """The folder held (rank 0) and the start's provenance record open, for the run; a
        run file that cannot be written ends it in one line naming the file."""
        with (
            RunFolder(self.out_dir, self.dist.is_main) as self._folder,
            provenance.recorded_start(self.out_dir, self.cfg, self.launch) as start,
        ):
            try:
                yield start
            except OSError as err:
                raise _unwritable(err, self.out_dir) from err

    def _step_done(self, step: int, result: StepResult, seconds: float) -> None:
        """After step ``step``: its time, the bad-step count, its record and the callbacks."""
        self.interval_step_s += seconds
        self.train_s += seconds
        self.state.step = done = step + 1
        if not result.finite:  # skipped, but a step of the schedules all the same
            self._check_bad_steps(step)
        self.call("step_end", result)
        recorded = result.finite and (done % self.cfg.log_every == 0 or done == self.cfg.steps)
        if recorded:
            self.log_interval(result, done)
        self.call("after_record", done, recorded)

    def begin(self) -> None:
        """The start's checks passed: make and hold the folder, call ``begin`` (hydra's
        record), record the start in provenance.json, write the run's config."""
        self.began = True  # first: a Ctrl-C as the folder is made does not say "nothing"
        if self._folder is not None:
            self._folder.create()
        else:  # build_run: no folder held
            self.out_dir.mkdir(parents=True, exist_ok=True)
        self.call("begin")
        if self._start is not None:
            self._start.begin()
        start_out_dir(self.cfg, self.out_dir, self.dist)  # a resumed run: its checkpoint fits

    # ----------------------------------------------------------------------- building
    def build(self) -> None:
        """Device, model, optimizer, scheduler, data and metrics sink of the run, from its
        config; with ``resume=true`` restored from the newest checkpoint. What can refuse
        the start comes first (``_check_start``), then ``begin`` and the run's files."""
        cfg, dist_info = self.cfg, self.dist
        self.device = device = resolve_device(cfg.device, dist_info.local_rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        parallel.check_layout(dist_info.world_size, cfg.parallel.ep)
        if cfg.parallel.ep > 1 or cfg.offload_experts != "off":  # freed blocks back to the OS
            host_allocator.set_mmap_threshold(cfg.parallel.host_mmap_threshold_kb << 10)
        cfg.check_batch_split(dist_info.world_size)
        resume_from, corpus = self._check_start()
        self.begin()  # the start is not refused: from here on it writes the run's files
        self.streaming = _to_device(self.model, cfg, device, self.out_dir)
        self.optimizer = cfg.optim.build(self.model, dist_info.world_size, self.mesh)
        self.forward_model = self.optimizer.forward_model  # the model, or its DDP wrapper
        self.scheduler = cfg.optim.build_scheduler(self.optimizer, cfg.steps)
        self.loader = BatchLoader(corpus.train, cfg.batch_size, cfg.data.seq_len, cfg.seed)
        self.val_batches = eval_batches(corpus.val, cfg.batch_size, cfg.data.seq_len,
                                        cfg.eval_batches)  # fmt: skip
        self.writer = _metrics_writer(cfg, self.out_dir, dist_info, self.start_step)
        if resume_from is not None:
            restore(self, resume_from)
        params = self.model.num_params()
        log.info("model: %s parameters, %s active per token", human_count(params["total"]),
                 human_count(params["active"]))  # fmt: skip
        log.info("batch: %s", _batch_line(cfg, dist_info.world_size))
        self.model.train()
        self.call("built")

    def _check_start(self) -> tuple[Path | None, Any]:
        """What can refuse the start, writing nothing (the folder against ``resume``, the
        data, the impl, the model and a resumed run's weights); returns the checkpoint to
        resume from and the corpus. Under torchrun every rank then learns whether all passed:
        no rank begins writing while a peer refuses."""
        cfg, dist_info = self.cfg, self.dist
        try:
            folder = self._folder or RunFolder(self.out_dir, dist_info.is_main)
            resume_from = folder.check(cfg, dist_info)
            corpus = run_corpus(cfg)
            check_impl(cfg.model.moe.impl, self.device)
            check_streamable(cfg, dist_info.world_size)
            cfg.optim.check_ranks(dist_info.world_size)
            self.model, self.mesh, self.exchange, self.start_step = _build_model(
                cfg, dist_info, resume_from
            )
        except Exception:
            distributed.refused_ranks(False, dist_info)  # the peers stop too, writing nothing
            raise
        refused = distributed.refused_ranks(True, dist_info)
        if refused:
            raise MoestackError(f"rank(s) {refused} refused the start (their error is above); "
                                "nothing was written")  # fmt: skip
        return resume_from, corpus

    # ----------------------------------------------------------------------- one step
    def train_step(self) -> StepResult:
        """One optimizer step: forward/backward over the micro-batches, the ranks' vote on a
        non-finite loss, then either skip (gradients and router counts dropped) or clip, step
        and update the router biases."""
        cfg, state = self.cfg, self.state
        loss, aux, finite = 0.0, 0.0, True
        for micro in range(cfg.grad_accum):
            out = self.forward_backward(last=micro == cfg.grad_accum - 1)
            finite = finite and bool(torch.isfinite(out.loss))
            loss += out.ce_loss.item() / cfg.grad_accum
            aux += out.aux_loss.item() / cfg.grad_accum
        if self.dist.active:  # every rank must agree to skip, and logs the global mean
            finite = distributed.all_reduce_mean(float(finite), self.dist, self.device) == 1.0
            loss = distributed.all_reduce_mean(loss, self.dist, self.device)
            aux = distributed.all_reduce_mean(aux, self.dist, self.device)
        if not finite:
            self.optimizer.zero_grad(set_to_none=True)
            self.model.discard_router_counts()
            self.scheduler.step()
            state.bad_steps += 1
            state.consecutive_bad += 1
            return StepResult(loss, aux, False, 0.0, out.metrics)
        state.consecutive_bad = 0
        grad_norm = self.optimizer.clip_grad_norm(cfg.optim.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.model.update_router_biases()
        state.interval_loss += loss
        state.interval_aux += aux
        state.interval_steps += 1
        return StepResult(loss, aux, True, grad_norm, out.metrics)

    def forward_backward(self, last: bool) -> Any:
        """Forward and backward of the next micro-batch; returns the model output.

        A bad loss still runs backward, so DDP ranks stay in step; ``train_step`` then skips
        the update and drops the gradients.
        """
        inputs, targets = self.loader.next()
        inputs, targets = inputs[self.rows].to(self.device), targets[self.rows].to(self.device)
        accumulating = contextlib.nullcontext() if last else self.optimizer.no_sync()
        with autocast_context(self.device), accumulating:
            out = self.forward_model(inputs, targets)
            self.optimizer.backward(out.loss / self.cfg.grad_accum)
        return out

    def _check_bad_steps(self, step: int) -> None:
        """Warn about a skipped step; stop the run after ``max_bad_steps`` in a row."""
        bad = self.state.consecutive_bad
        log.warning("step %d: non-finite loss, step skipped (%d in a row)", step, bad)
        if bad >= self.cfg.max_bad_steps:
            raise MoestackError(
                f"the loss was NaN/inf for {bad} steps in a row (step {step}); "
                f"{checkpoint.kept_note(self.ckpt_root)}; lower optim.lr or check the data"
            )

    # ----------------------------------------------------------------------- records
    def log_interval(self, result: StepResult, done: int) -> None:
        """Write one metrics record for the steps since the last one (the callbacks add
        theirs: an evaluation due at this step, telemetry's interval metrics), then start a
        new interval."""
        state = self.state
        elapsed = self.interval_step_s  # training throughput: evaluation and checkpoints apart
        metrics = {
            "loss/train": state.interval_loss / state.interval_steps,
            "loss/aux": state.interval_aux / state.interval_steps,
            "optim/lr": self.scheduler.get_last_lr()[0],
            "optim/grad_norm": result.grad_norm,
            "perf/tokens_per_s": self.tokens_per_step * state.interval_steps / max(elapsed, 1e-9),
            "perf/bad_steps": state.bad_steps,
        }
        metrics.update({k: float(v) for k, v in result.router_metrics.items()})
        metrics.update(self.optimizer.metrics())  # the optimizer's own (optim=tiered: per group)
        metrics["eval/train_perplexity"] = perplexity(metrics["loss/train"])
        if self.exchange is not None:
            steps, world = state.interval_steps, self.dist.world_size
            metrics.update(parallel.exchange_metrics(self.exchange, world, steps, elapsed))
        if self.streaming is not None:  # the training's own cache traffic, per step
            metrics.update(self.streaming.metrics(state.interval_steps))
        extra: dict[str, Any] = {}
        self.call("record", done, metrics, extra)
        self.writer.log(done, metrics, extra_wandb=extra.get("charts"))
        self.last_metrics.update(metrics)
        state.reset_interval()
        self.interval_step_s = 0.0

    def evaluate_in_training(self) -> dict[str, float]:
        """An evaluation between training steps. The expert exchanges it makes are not
        training traffic: the exchange counters are left as they were before it
        (mid-interval they hold the interval's training traffic so far)."""
        kept = copy.deepcopy(self.exchange)
        metrics = self.evaluate()
        if self.exchange is not None:
            for f in dataclasses.fields(self.exchange):
                setattr(self.exchange, f.name, getattr(kept, f.name))
        return metrics

    def evaluate(self) -> dict[str, float]:
        """Validation loss and perplexity, out of the routing trace (the callbacks'
        ``evaluating`` contexts); its time is counted apart from training's."""
        started = time.perf_counter()
        self.optimizer.synchronize()  # a delayed update's weights are the model's
        with contextlib.ExitStack() as stack:
            for callback in self.callbacks:
                stack.enter_context(callback.evaluating(self))
            out = evaluate(self.model, self.val_batches, self.device)
        self.eval_s += time.perf_counter() - started
        return out

    # ----------------------------------------------------------------------- the end
    def finish(self) -> dict[str, Any]:
        """Final evaluation and checkpoint (``train_end``; a start resumed from the final
        checkpoint saves nothing again), close the sinks; returns (and on rank 0 writes and
        prints) the run summary."""
        cfg = self.cfg
        final_eval = self.evaluate()
        self.call("train_end")
        if self.start_step < cfg.steps:
            self.writer.log(cfg.steps, final_eval)
        else:  # resumed from the final checkpoint: a start killed before summary.json logged it
            self._restore_last_metrics(final_eval)
        self.call("close")
        self.writer.close()
        self.last_metrics.update(final_eval)
        summary = self.summary(final_eval)
        if self.dist.is_main:
            write_json(self.out_dir / "summary.json", summary)
            log.info("\n%s", format_summary(summary))
        if not math.isfinite(final_eval["loss/val"]):  # the run did not produce a usable model
            raise MoestackError(
                f"the final validation loss is {final_eval['loss/val']} although every "
                f"checkpointed weight is finite; see {self.out_dir / 'metrics.jsonl'} for where "
                "the loss went bad"
            )
        return summary

    def _restore_last_metrics(self, final_eval: dict[str, float]) -> None:
        """A run resumed at its last step trains nothing: its last metrics are those of the
        records metrics.jsonl holds (the start that reached the end logged them), and the
        final evaluation is logged only if that start was killed before logging it."""
        path = self.out_dir / "metrics.jsonl"
        logged = read_metrics(path) if path.exists() else []
        self.last_metrics.update(latest_values(path, self.cfg.steps))
        if not any(r.get("step") == self.cfg.steps and "loss/val" in r for r in logged):
            self.writer.log(self.cfg.steps, final_eval)

    def summary(self, final_eval: dict[str, float]) -> dict[str, Any]:
        """The run's headline numbers (summary.json); the throughput is this start's training
        steps alone (evaluation and checkpoints apart, as on the progress bar)."""
        params = self.model.num_params()
        steps = self.cfg.steps - self.start_step
        summary = {
            "loss/train": self.last_metrics.get("loss/train", float("nan")),
            "loss/val": final_eval["loss/val"],
            "eval/perplexity": final_eval["eval/perplexity"],
            "perf/tokens_per_s": self.tokens_per_step * steps / max(self.train_s, 1e-9)
            if steps  # a start that trained no step: the last interval's, as logged
            else self.last_metrics.get("perf/tokens_per_s", float("nan")),
            "perf/train_s": self.train_s,
            "perf/eval_s": self.eval_s,
            "params/total": params["total"],
            "params/active": params["active"],
            "perf/bad_steps": self.state.bad_steps,
            "out_dir": str(self.out_dir),
        }
        for i in range(self.cfg.model.n_layers):
            key = f"router/layer{i}/imbalance"
            if key in self.last_metrics:
                summary[key] = self.last_metrics[key]
        return summary


def _unwritable(err: OSError, out_dir: Path) -> BaseException:
    """A full disk, a folder that became read-only or a file denied to this process (read
    or written), as one line naming the file."""
    full = atomic.out_of_space(err, out_dir, 0, str(err.filename or "the run's files"))
    if full is not None:
        return full
    if err.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        verb = "write" if err.errno == errno.EROFS else "open"
        return MoestackError(f"cannot {verb} {err.filename or out_dir}: {err.strerror}")
    return err


# --------------------------------------------------------------------------- the model
def _builds_on_meta(cfg: TrainConfig) -> bool:
    """Whether this rank builds its model's experts (and any LoRA adapters on them) on the
    meta device: under expert parallelism it materialises its own only (the backbone is
    every rank's); a run that streams its frozen experts never holds them (they go to its
    store one layer at a time, ``streaming.expert_source``), only their adapters."""
    return cfg.parallel.ep > 1 or cfg.offload_experts != "off"


def _build_model(
    cfg: TrainConfig, dist_info: distributed.DistInfo, resume_from: Path | None
) -> tuple[RoutedLM, Any, Any, int]:
    """The run's model on the host, with this rank's experts only (under expert parallelism
    no other rank's expert is ever allocated: built on meta, cut, then materialised), its
    weights drawn layout-free from ``cfg.seed`` or read from ``resume_from``; the EP mesh and
    exchange counters (None without), and the step to start at."""
    torch.manual_seed(cfg.seed)  # whatever a build draws from the global stream
    on_meta = _builds_on_meta(cfg)
    # a transformers model resumed: every weight comes from the checkpoint, none is read
    # from the folder (streamed: its experts come from the folder)
    from_checkpoint = cfg.model.is_transformers and resume_from is not None
    from_checkpoint = from_checkpoint and cfg.offload_experts == "off"
    model = cfg.model.build_for_run(
        seed=cfg.seed, experts_on_meta=on_meta, from_checkpoint=from_checkpoint
    )
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
    mesh, exchange = cfg.parallel.build(model, dist_info.world_size, dist_info.rank)
    if cfg.offload_experts != "off":  # experts left on meta: their adapters drawn alone
        materialize_expert_adapters(model, cfg.seed)
    elif on_meta:  # this rank's experts (drawn as the whole model's, or read from the folder)
        cfg.model.fill_experts(model, cfg.seed, resumed=resume_from is not None)
        lora.init_expert_adapters(model, cfg.seed)  # their adapters' rows, likewise
    if from_checkpoint:  # memory for what is still meta (this rank's share), filled below
        meta_load.materialize(model)
    # training's draws from the global stream (LoRA's dropout) start from the seed, whatever
    # the build drew (a whole build draws experts a meta one does not)
    torch.manual_seed(cfg.seed)
    start_step = 0
    if resume_from is not None:  # this rank's experts' rows only
        with experts_left_out(model) if cfg.offload_experts != "off" else contextlib.nullcontext():
            start_step = checkpoint.load_model_weights(resume_from, model, cfg.model)["step"]
    return model, mesh, exchange, start_step


def _to_device(model: RoutedLM, cfg: TrainConfig, device: torch.device, out_dir: Path) -> Any:
    """The model on ``device`` in the optimizer's parameter dtype, its frozen experts
    streamed where ``offload_experts`` asks (the StreamingState; None when off)."""
    move_resident(model, device)  # a streamed run's experts stay meta
    param_dtype = apply_param_dtype(model, cfg.optim, device)
    if param_dtype != torch.float32:
        log.info("model weights and gradients on %s in %s", device, param_dtype)
    layers = expert_source(model, cfg, param_cast(cfg.optim, device))
    return attach_streaming(model, cfg, out_dir, layers=layers)


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
