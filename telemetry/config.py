"""``TelemetryConfig``: routing telemetry during training, which cache policies and sizes to
replay.

The ``telemetry`` section of a run's config, beside the telemetry it configures;
``TelemetryConfig.build`` hooks a training run's model (``attach``) with its trace streamed
to the run's folder. ``moestack.config`` re-exports it and nests it in ``TrainConfig``.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

from moestack.cache.policies import check_policy
from moestack.checks import check
from moestack.telemetry import run_trace
from moestack.telemetry.hooks import Telemetry, attach

log = logging.getLogger(__name__)


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
            check(capacity >= 1, f"telemetry.capacities has {capacity}; each must be >= 1")

    def build(
        self,
        model: nn.Module,
        out_dir: Path,
        start_step: int,
        tokens_per_step: int,
        interval_tokens: int,
    ) -> Telemetry | None:
        """The telemetry of a training run's ``model`` (None when off): its trace streamed
        to ``<trace_dir>/from-<start_step>`` (``trace_dir`` "" is ``out_dir/trace``), its
        meta saying where it starts and how many rows (``tokens_per_step``) a step records.
        A resumed run first replays its earlier parts, cut at ``start_step``, into the live
        caches (intervals of ``interval_tokens``), so that interval metrics and
        telemetry_summary.json cover the whole run (``moestack.telemetry.run_trace``)."""
        if not self.enabled:
            return None
        trace_root = Path(self.trace_dir) if self.trace_dir else out_dir / "trace"
        _clear_from(trace_root, start_step)
        telemetry = attach(
            model,
            policies=self.policies,
            capacities=self.capacities,
            trace_dir=str(trace_root / run_trace.part_name(start_step)),
            max_memory_tokens=0,
            meta={
                run_trace.META_START_STEP: start_step,
                run_trace.META_TOKENS_PER_STEP: tokens_per_step,
            },
        )
        try:
            history = run_trace.load_history(trace_root, start_step)
        except ValueError as err:  # a damaged earlier part must not stop the run from resuming
            log.warning("telemetry: the earlier trace cannot be replayed (%s); "
                        "telemetry_summary.json covers this start only", err)  # fmt: skip
            history = None
        if history is not None:
            telemetry.replay_history(history, interval_tokens=interval_tokens)
        return telemetry


def _clear_from(trace_root: Path, start_step: int) -> None:
    """Remove the trace parts this start records anew: those from ``start_step`` on (a part
    past it belongs to a later start this run abandons, named in a warning)."""
    for stale in run_trace.find_parts(trace_root):
        if (run_trace.part_step(stale) or 0) >= start_step:  # this start records those steps anew
            if run_trace.part_step(stale) != start_step:
                log.warning("%s: a later start this run abandons; removed", stale)
            shutil.rmtree(stale)
    part = trace_root / run_trace.part_name(start_step)
    if part.exists():  # left by an attempt that crashed after this checkpoint: recorded anew
        shutil.rmtree(part)
