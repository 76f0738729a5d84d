"""The memory plan of a training run: bytes per device and per host, before anything runs.

``plan_memory(cfg, ranks)`` builds the model on the meta device (no allocation) and lists,
with the formula behind each figure: weights, gradients, optimizer state (torch AdamW on the
device; OffloadAdamW's flat host buffers, sharded ZeRO-1 style over ``ranks``) and the
activations one micro-batch keeps for backward under ``model.checkpointing``. With expert
parallelism (``parallel.ep``) each rank holds ``num_experts / ep`` experts of every layer, and
OffloadAdamW shards the experts' state over their data-parallel group (``ranks / ep``).
``moestack plan`` prints it; the training run logs it at start (and on CUDA the measured
peak beside it). How the activation formulas were derived, and how well they match a real
run, is in docs/memory.md.
"""

from __future__ import annotations

import gc
import logging
import math
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from moestack.config import HFModelConfig, TrainConfig
from moestack.errors import MoestackError
from moestack.optim.factory import device_param_dtype, param_groups
from moestack.optim.plan import DEFAULT_EXPERT_PATTERN, build_plan, expert_flags
from moestack.parallel import check_layout

log = logging.getLogger(__name__)

_XFER_CHUNK = 1 << 24  # OffloadAdamW's device scratch for dtype changes: at most this many fp32


@dataclass
class Line:
    """One figure of the plan: where it lives, what it is, its bytes and how they follow."""

    where: str  # "device" or "host"
    what: str
    bytes: int
    formula: str


@dataclass
class MemoryPlan:
    """Lines of bytes per device (per rank) and per host (per rank), plus notes."""

    device: str  # the device type the plan is for ("cpu" or "cuda")
    ranks: int
    lines: list[Line] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def total(self, where: str) -> int:
        return sum(line.bytes for line in self.lines if line.where == where)

    def line(self, what: str) -> Line:
        """The line whose ``what`` starts with ``what``."""
        return next(line for line in self.lines if line.what.startswith(what))

    def format(self) -> str:
        """A table: where, what, MiB, formula; then the totals and the notes."""
        rows = [(ln.where, ln.what, f"{ln.bytes / 2**20:.2f}", ln.formula) for ln in self.lines]
        for where in ("device", "host"):
            rows.append((where, "total", f"{self.total(where) / 2**20:.2f}", ""))
        widths = [max(len(r[i]) for r in rows + [("where", "what", "MiB", "")]) for i in range(3)]
        head = f"{'where':<{widths[0]}}  {'what':<{widths[1]}}  {'MiB':>{widths[2]}}  formula"
        out = [head, "-" * len(head)]
        out += [f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c:>{widths[2]}}  {d}" for a, b, c, d in rows]
        return "\n".join(out + [f"note: {n}" for n in self.notes])


def _mib(n: float) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e5 else str(int(n))


def plan_memory(cfg: TrainConfig, ranks: int = 1, device: str = "") -> MemoryPlan:
    """The memory plan of ``cfg`` trained over ``ranks`` data-parallel ranks on ``device``
    ("cpu" or "cuda"; default: the run's, ``auto`` being cuda when one is present)."""
    if isinstance(cfg.model, HFModelConfig):
        raise MoestackError("the memory plan covers moestack's own models, not model.path ones")
    if ranks < 1:
        raise MoestackError(f"--ranks {ranks} must be >= 1")
    kind = device or cfg.device
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    ep = cfg.parallel.ep
    check_layout(ranks, ep, cfg.model.moe.num_experts)
    with torch.device("meta"):
        model = cfg.model.build()
    model.set_trainable(cfg.trainable)
    experts = _keep_local_experts(model, ep)
    plan = MemoryPlan(device=kind, ranks=ranks)
    pdtype = device_param_dtype(cfg.optim, torch.device(kind))
    _weights_and_grads(plan, model, pdtype)
    if cfg.optim.name == "adamw":
        _adamw_lines(plan, model, pdtype, ep)
    elif ep == 1:
        _offload_lines(plan, cfg, model, pdtype, _named(cfg, model, lambda n: True), ranks)
    else:
        replicated = _named(cfg, model, lambda n: n not in experts)
        _offload_lines(plan, cfg, model, pdtype, replicated, ranks, " (replicated)")
        sharded = _named(cfg, model, lambda n: n in experts)
        _offload_lines(plan, cfg, model, pdtype, sharded, ranks // ep, " (experts)")
    _activation_lines(plan, cfg)
    if ep > 1:
        plan.notes.append(
            f"parallel.ep={ep}: each rank holds {cfg.model.moe.num_experts // ep} of "
            f"{cfg.model.moe.num_experts} experts per layer; activations assume balanced "
            "routing (a rank's experts see k rows per token on average; ep/load_imbalance "
            "in a run's metrics scales their share)"
        )
    if ranks > 1:
        plan.notes.append(
            f"per rank; a host running R of the {ranks} ranks holds R x the host lines"
        )
    return plan


def _keep_local_experts(model: torch.nn.Module, ep: int) -> set[str]:
    """Cut each MoE layer's meta ``w1``/``w2`` to one EP rank's experts; their names."""
    names = set()
    for i, moe in enumerate(model.moe_layers):
        if ep > 1:
            local = moe.w1.shape[0] // ep
            for name in ("w1", "w2"):
                whole = getattr(moe, name)
                part = torch.nn.Parameter(whole[:local], requires_grad=whole.requires_grad)
                setattr(moe, name, part)
        names.update(f"layers.{i}.moe.{name}" for name in ("w1", "w2"))
    return names


def _named(cfg: TrainConfig, model: torch.nn.Module, keep: Any) -> list[tuple[int, str, Any]]:
    """``(param group, name, tensor)`` of the trained parameters whose name ``keep`` takes."""
    groups = param_groups(model, cfg.optim.weight_decay)
    return [(gi, n, p) for gi, g in enumerate(groups) for n, p in g["params"] if keep(n)]


def _weights_and_grads(plan: MemoryPlan, model: torch.nn.Module, pdtype: torch.dtype) -> None:
    size = pdtype.itemsize
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    trained = sum(p.numel() for p in params if p.requires_grad)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    plan.lines.append(
        Line(
            "device",
            "weights",
            total * size + buffers,
            f"{_mib(total)} params x {size} B ({pdtype}) + {buffers} B buffers",
        )
    )
    plan.lines.append(
        Line("device", "gradients", trained * size, f"{_mib(trained)} trained params x {size} B")
    )


def _adamw_lines(
    plan: MemoryPlan, model: torch.nn.Module, pdtype: torch.dtype, ep: int = 1
) -> None:
    """torch AdamW: exp_avg and exp_avg_sq in the parameter dtype, a float32 step per tensor;
    under DDP also the gradient buckets (a second copy of the gradients); under expert
    parallelism, whose gradients are averaged in one flat buffer per group, that buffer."""
    trained = [p for p in model.parameters() if p.requires_grad]
    numel, size = sum(p.numel() for p in trained), pdtype.itemsize
    plan.lines.append(
        Line(
            "device",
            "optimizer state (adamw)",
            2 * numel * size + 4 * len(trained),
            f"2 moments x {_mib(numel)} x {size} B + 4 B step x {len(trained)} "
            "tensors; replicated on every rank" + (" (experts: this rank's)" if ep > 1 else ""),
        )
    )
    if ep > 1:
        plan.lines.append(
            Line("device", "gradient all-reduce buffer", numel * size, f"{_mib(numel)} x {size} B")
        )
    elif plan.ranks > 1:
        plan.lines.append(
            Line("device", "DDP gradient buckets", numel * size, f"{_mib(numel)} x {size} B")
        )


def _offload_lines(
    plan: MemoryPlan,
    cfg: TrainConfig,
    model: torch.nn.Module,
    pdtype: torch.dtype,
    named: list[tuple[int, str, Any]],
    ranks: int,
    label: str = "",
) -> None:
    """OffloadAdamW's host buffers (moestack.optim.transfer.alloc_host_buffers) for the
    largest shard of ``named`` over ``ranks``, and its device scratch for dtype changes."""
    if not named:
        return
    group_of = [gi for gi, _, _ in named]
    shapes = [tuple(p.shape) for _, _, p in named]
    is_expert = expert_flags(
        [p for _, _, p in named], [n for _, n, _ in named], None, DEFAULT_EXPERT_PATTERN
    )
    shards = ranks if (cfg.optim.shard and ranks > 1) else 1
    splan = build_plan(shapes, group_of, is_expert, shards, 0)
    size = splan.stride if shards > 1 else splan.total
    moment = 2 if cfg.optim.moment_dtype == "bfloat16" else 4
    where = f"sharded over {shards} ranks (largest shard)" if shards > 1 else "not sharded"
    plan.lines.append(
        Line(
            "host",
            "optimizer moments" + label,
            2 * moment * size,
            f"2 x {_mib(size)} x {moment} B, {where}",
        )
    )
    on_cpu = plan.device == "cpu"
    in_place = plan.ranks == 1 and on_cpu and pdtype == torch.float32
    if in_place:
        plan.notes.append(
            "offload_adamw on one CPU process with fp32 weights steps them in "
            "place: no master copy, no gradient buffers"
        )
        return
    # one process, bf16 weights, the native kernel: the master is the bf16 weights (the
    # parameters or the staging buffer) plus 2-byte remainders (moestack.optim.split_master)
    split = cfg.optim.fused_step in ("auto", "native") and plan.ranks == 1
    split = split and pdtype == torch.bfloat16
    if split:
        plan.lines.append(
            Line(
                "host",
                "optimizer master weights, low halves" + label,
                2 * size,
                f"{_mib(size)} x 2 B (their bf16 halves are the weights; 4 B without a C++ "
                "compiler)",
            )
        )
    else:
        plan.lines.append(
            Line("host", "optimizer master weights" + label, 4 * size, f"{_mib(size)} x 4 B")
        )
    fused = cfg.optim.fused_step != "off"
    direct = fused and plan.ranks == 1 and on_cpu
    if not direct:
        comm = shards * splan.stride + splan.stride if shards > 1 else splan.total
        formula = (
            f"({shards} x {_mib(splan.stride)} + {_mib(splan.stride)}) x 4 B"
            if shards > 1
            else f"{_mib(splan.total)} x 4 B"
        )
        plan.lines.append(Line("host", "gradient pack buffers" + label, 4 * comm, formula))
    if fused and plan.ranks == 1 and not on_cpu and pdtype == torch.bfloat16:
        plan.lines.append(
            Line("host", "weight staging (bf16)" + label, 2 * size, f"{_mib(size)} x 2 B")
        )
    if pdtype != torch.float32:
        largest = min(max(math.prod(s) for s in shapes), _XFER_CHUNK)
        plan.lines.append(
            Line(
                "device",
                "offload dtype scratch" + label,
                4 * largest,
                f"min(largest param {_mib(largest)}, 2^24) x 4 B",
            )
        )


def activation_bytes_per_token(cfg: TrainConfig, act_bytes: int) -> tuple[int, int, str]:
    """``(per layer, head, formula)``: bytes one token keeps for backward in each block and
    in the embedding/norm/logits/loss, for ``model.checkpointing`` and the torch expert
    impl (counted from the tensors autograd and the checkpoints hold; docs/memory.md)."""
    m = cfg.model
    d, f, k, e, h, v = (
        m.d_model,
        m.moe.d_ff,
        m.moe.top_k,
        m.moe.num_experts,
        m.n_heads,
        m.vocab_size,
    )
    b = act_bytes
    router = 4 * (2 * e + 2 * k + 4)  # fp32 logits, scores, weights, renormalisation sums
    per_layer = {
        "none": (
            b * (13 * d + 3 * k * d + 4 * k * f) + 4 * (h + 2) + router + 8 * 3 * k,
            f"{b}x(13D + 3kD + 4kF) + 4x(H + 2) + router 4x(2E + 2k + 4) + 8x3k",
        ),
        "moe": (
            b * 13 * d + 4 * (h + 2) + router + 8 * k,
            f"{b}x13D + 4x(H + 2) + router 4x(2E + 2k + 4) + 8k",
        ),
        "block": (b * 2 * d + router + 8 * k, f"{b}x2D + router 4x(2E + 2k + 4) + 8k"),
        "selective": (
            b * (8 * d + k * d + 2 * k * f) + 4 * h + router + 8 * k,
            f"{b}x(8D + kD + 2kF) + 4H + router 4x(2E + 2k + 4) + 8k",
        ),
    }[m.checkpointing]
    head = b * (3 * d + 2 * v) + 4 + 8
    formula = f"{per_layer[1]} per layer; head {b}x(3D + 2V) + 12"
    return per_layer[0], head, formula


def _activation_lines(plan: MemoryPlan, cfg: TrainConfig) -> None:
    act = 2 if plan.device == "cuda" else 4  # bf16 autocast on CUDA, fp32 on the CPU
    per_layer, head, formula = activation_bytes_per_token(cfg, act)
    tokens = max(1, cfg.batch_size // plan.ranks) * cfg.data.seq_len
    n = cfg.model.n_layers
    plan.lines.append(
        Line(
            "device",
            f"activations (checkpointing={cfg.model.checkpointing})",
            tokens * (n * per_layer + head),
            f"{tokens} tokens/micro-batch x ({n} layers x {per_layer} + {head}) B: {formula}",
        )
    )
    if act == 2:
        plan.notes.append("activations on CUDA assume bf16 autocast (router math stays fp32)")


def log_plan(
    cfg: TrainConfig, ranks: int, device: torch.device, table: bool = True
) -> MemoryPlan | None:
    """Log the plan at the start of a run (none for a transformers model): its table, or
    with ``table=False`` (a sweep's later jobs) its totals in one line."""
    if isinstance(cfg.model, HFModelConfig):
        return None
    plan = plan_memory(cfg, ranks, device.type)
    if table:
        log.info("memory plan (per rank):\n%s", plan.format())
    else:
        log.info("memory plan (per rank): device %.2f MiB, host %.2f MiB (`moestack plan` for "
                 "the table)", plan.total("device") / 2**20, plan.total("host") / 2**20)  # fmt: skip
    return plan


def log_peak(plan: MemoryPlan | None, device: torch.device) -> None:
    """On CUDA, the measured peak beside the plan's device total (after the first step)."""
    if plan is None or device.type != "cuda":
        return
    peak = torch.cuda.max_memory_allocated(device)
    log.info(
        "memory: device peak %.2f MiB measured after step 1, %.2f MiB planned",
        peak / 2**20,
        plan.total("device") / 2**20,
    )


# ------------------------------------------------------------------ measuring a real forward
class _LiveStorages(TorchDispatchMode):
    """Records the storage of every tensor an op returns, weakly, with its byte size."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, tuple[weakref.ref, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                self.refs[id(storage)] = (weakref.ref(storage), storage.nbytes())
        return out


def measure_activations(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> int:
    """Bytes a training forward leaves alive for backward: every storage an op of the
    forward created that is still held once it returns (saved tensors, checkpoint inputs,
    selective checkpointing's cache, the logits), parameters and buffers left out. Counts
    what ``saved_tensors_hooks`` sees plus what checkpoints hold outside it."""
    own = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    with _LiveStorages() as live:
        out = model(tokens, targets=targets)
    gc.collect()
    alive: dict[int, int] = {}
    for ref, nbytes in live.refs.values():
        storage = ref()
        if storage is not None and storage.data_ptr() not in own:
            alive[storage.data_ptr()] = nbytes
    del out
    return sum(alive.values())


def saved_tensor_bytes(model: torch.nn.Module, *inputs: torch.Tensor) -> int:
    """Bytes of distinct non-parameter storages autograd saves in one forward
    ``model(*inputs)``, seen through ``torch.autograd.graph.saved_tensors_hooks`` (without
    checkpointing: what it keeps)."""
    own = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*inputs)
    return sum(storages.values())
