"""moestack.telemetry: zero-surgery routing telemetry for MoE models (see docs/telemetry.md).

``attach(model)`` hooks the routers, ``Telemetry.trace`` is a ``RoutingTrace``,
``simulate`` / ``sweep`` replay a trace through the cache policies of ``moestack.cache``,
``run_telemetry`` and ``render_report`` work on their own, without a training loop.
``load_run_trace`` joins a resumed run's trace parts (``trace/from-<step>/``) in training
order, each cut before the next part's start, as one ``RoutingTrace``. ``import_trace``
writes a trace recorded by another tool as a trace folder; ``ServingEstimate`` turns a
replay's misses per token into tokens/s on a given machine.
"""

from moestack.telemetry.detect import ROUTER_DETECTORS, RouterSpec, find_routers
from moestack.telemetry.hooks import Telemetry, attach
from moestack.telemetry.replay import CacheStats, LayerStats, ServingEstimate, simulate, sweep
from moestack.telemetry.report import render_report
from moestack.telemetry.run_trace import RunTrace, TracePart, load_run_trace
from moestack.telemetry.standalone import run_telemetry, tiny_model
from moestack.telemetry.trace import RoutingTrace, TraceChunk, TraceFormatError
from moestack.telemetry.trace_import import import_trace

__all__ = [
    "ROUTER_DETECTORS",
    "CacheStats",
    "LayerStats",
    "RouterSpec",
    "RoutingTrace",
    "RunTrace",
    "ServingEstimate",
    "Telemetry",
    "TraceChunk",
    "TraceFormatError",
    "TracePart",
    "attach",
    "find_routers",
    "import_trace",
    "load_run_trace",
    "render_report",
    "run_telemetry",
    "simulate",
    "sweep",
    "tiny_model",
]
