"""The memory plan of a training run: bytes per device and per host, before anything runs.

``plan_memory(cfg, ranks)`` builds the model on the meta device (no allocation), or takes the
run's model, and lists, with the formula behind each figure: weights, gradients, optimizer
state (torch AdamW on the device; OffloadAdamW's flat host buffers, sharded ZeRO-1 style over
``ranks``) and the activations one micro-batch keeps for backward under
``model.checkpointing``. With expert parallelism (``parallel.ep``) each rank holds
``num_experts / ep`` experts of every layer, and OffloadAdamW shards the experts' state over
their data-parallel group (``ranks / ep``). The optimizer state is what the optimizers' own
plans say they allocate (:func:`moestack.optim.offload_plan.plan_offload`,
:func:`moestack.optim.plan.adamw_state_bytes`): no placement rule is written here.
``moestack plan`` prints it; the training run logs it at start (and on CUDA the measured
peak beside it). How the activation formulas were derived, and how well they match a real
run, is in docs/memory.md.
"""

from __future__ import annotations

import gc
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from moestack.config import TrainConfig
from moestack.errors import MoestackError
from moestack.lora import add_adapters_for
from moestack.optim.factory import device_param_dtype, param_groups, uses_ddp
from moestack.optim.offload_plan import OffloadPlan, plan_offload
from moestack.optim.plan import DEFAULT_EXPERT_PATTERN, ParamSpec, adamw_state_bytes, expert_flags
from moestack.optim.tiered_backward import held_gradient_numel
from moestack.optim.tiered_bytes import plan_rows
from moestack.optim.update import parse_moment_dtype
from moestack.parallel import ExpertParallelMesh, check_layout, expert_params, shard_experts
from moestack.populations import classify

log = logging.getLogger(__name__)


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


def plan_memory(
    cfg: TrainConfig, ranks: int = 1, device: str = "", model: torch.nn.Module | None = None
) -> MemoryPlan:
    """The memory plan of ``cfg`` trained over ``ranks`` data-parallel ranks on ``device``
    ("cpu" or "cuda"; default: the run's, ``auto`` being cuda when one is present).
    ``model``: the run's model as built (trainable parameters set, this rank's experts under
    ``parallel.ep``), read for its shapes only; without it one is built on the meta device."""
    if not cfg.model.resolved:  # a folder's sizes from config.json (plain JSON, no weights)
        cfg = cfg.resolve()
    if ranks < 1:
        raise MoestackError(f"--ranks {ranks} must be >= 1")
    cfg.check_batch_split(ranks)  # a layout training refuses has no plan
    cfg.optim.check_ranks(ranks)
    kind = device or cfg.device
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    ep = cfg.parallel.ep
    check_layout(ranks, ep, cfg.model.moe.num_experts)
    if model is None:
        model = _meta_model(cfg, ranks)
    experts = _expert_names(model)
    plan = MemoryPlan(device=kind, ranks=ranks)
    pdtype = device_param_dtype(cfg.optim, torch.device(kind))
    _weights_and_grads(plan, model, pdtype, cfg.optim.update_in_backward, cfg.compile)
    _streamed_lines(plan, cfg, model, pdtype, ranks)
    _optimizer_lines(plan, cfg, model, pdtype, experts)
    _activation_lines(plan, cfg)
    plan.notes.extend(cfg.model.plan_notes)
    if cfg.trainable != "all":
        plan.notes.append(
            f"trainable={cfg.trainable}: weights and their optimizer state as trained; the "
            "activations are a full fine-tune's (frozen layers keep less, selective "
            "checkpointing with adapters a little more: docs/memory.md)"
        )
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


def _optimizer_lines(
    plan: MemoryPlan, cfg: TrainConfig, model: torch.nn.Module, pdtype: torch.dtype,
    experts: set[str],
) -> None:  # fmt: skip
    """The optimizer's state and buffers, as ``cfg.optim`` allocates them for the trained
    parameters (under ``parallel.ep`` the replicated ones and this rank's ``experts``
    apart): the one place that maps an optimizer to its plan lines. An optimizer gets a
    branch here that calls its own plan (``adamw_state_bytes``, ``plan_offload``); one
    without a branch is named in a note, its lines missing (a run still starts)."""
    name, ep, ranks = cfg.optim.name, cfg.parallel.ep, plan.ranks
    if name == "adamw":
        _adamw_lines(plan, model, pdtype, ep)
    elif name == "offload_adamw" and ep == 1:
        _offload_lines(plan, cfg, pdtype, _named(cfg, model, lambda n: True), ranks)
    elif name == "tiered":
        _tiered_lines(plan, cfg, model, pdtype)
    elif name == "offload_adamw":
        replicated = _named(cfg, model, lambda n: n not in experts)
        _offload_lines(plan, cfg, pdtype, replicated, ranks, " (replicated)")
        sharded = _named(cfg, model, lambda n: n in experts)
        _offload_lines(plan, cfg, pdtype, sharded, ranks // ep, " (experts)")
    else:  # never a silent zero: the table says what it leaves out
        plan.notes.append(f"optim={name}: its optimizer state is not in this plan yet")


def _meta_model(cfg: TrainConfig, ranks: int) -> torch.nn.Module:
    """The run's model on the meta device (nothing allocated): trainable as ``cfg`` says and,
    under ``parallel.ep``, cut to one rank's experts as the run cuts them. A transformers
    folder's model is built from its config.json alone (``HFModelConfig.build_for_plan``)."""
    model = cfg.model.build_for_plan()
    add_adapters_for(model, cfg.trainable, cfg.lora, cfg.seed)  # meta, as the weights are
    model.set_trainable(cfg.trainable)
    if cfg.parallel.ep > 1:  # rank 0's place in the mesh; no process group is needed
        mesh = ExpertParallelMesh(ranks, cfg.parallel.ep, 0, 0, None, None)
        shard_experts(model, mesh)
    return model


def _expert_names(model: torch.nn.Module) -> set[str]:
    """Names of the model's expert-parallel (sharded) expert tensors."""
    sharded = expert_params(model)
    return {n for n, p in model.named_parameters() if id(p) in sharded}


def _named(cfg: TrainConfig, model: torch.nn.Module, keep: Any) -> list[tuple[int, str, Any]]:
    """``(param group, name, tensor)`` of the trained parameters whose name ``keep`` takes."""
    groups = param_groups(model, cfg.optim.weight_decay)
    return [(gi, n, p) for gi, g in enumerate(groups) for n, p in g["params"] if keep(n)]


def _specs(tensors: Any, device: str, dtype: torch.dtype) -> list[ParamSpec]:
    """The specs the run's parameters of ``tensors``' shapes will have on ``device``."""
    return [ParamSpec(tuple(p.shape), device, dtype) for p in tensors]


def _weights_and_grads(
    plan: MemoryPlan,
    model: torch.nn.Module,
    pdtype: torch.dtype,
    in_backward: bool,
    compiled: bool,
) -> None:
    """Every parameter in the device dtype plus the buffers; a gradient per trained one, or
    with ``optim.update_in_backward`` those held at once (``held_gradient_numel``).

    In float32 a parameter keeps the dtype the model was built with (``lora.base_dtype``
    holds frozen weights in bfloat16); a lower device dtype casts every parameter to it
    (``apply_param_dtype``)."""
    size = pdtype.itemsize
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    trained = sum(p.numel() for p in params if p.requires_grad)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    keep = pdtype == torch.float32
    weight_bytes = sum(p.numel() * (p.element_size() if keep else size) for p in params)
    narrow = sum(p.numel() for p in params if keep and p.element_size() != size)
    how = f"{_mib(total)} params x {size} B ({pdtype})"
    if narrow:
        how = (
            f"{_mib(total - narrow)} params x {size} B ({pdtype}) + {_mib(narrow)} frozen "
            "params in their own dtype (lora.base_dtype)"
        )
    plan.lines.append(
        Line("device", "weights", weight_bytes + buffers, f"{how} + {buffers} B buffers")
    )
    held, how = trained, "trained params"
    if in_backward:
        unit = "compiled block" if compiled else "module"
        held = held_gradient_numel(model, compiled=compiled)
        how = (f"params of the largest {unit} + tied ones (optim.update_in_backward: each "
               "gradient freed at its update)")  # fmt: skip
    plan.lines.append(Line("device", "gradients", held * size, f"{_mib(held)} {how} x {size} B"))


def _streamed_lines(
    plan: MemoryPlan, cfg: TrainConfig, model: torch.nn.Module, pdtype: torch.dtype, ranks: int
) -> None:
    """``offload_experts``: the routed experts leave the device weights for the expert store;
    the cache's slots, one layer's working set and (``host``) the host tier hold them
    (``moestack.cache.streaming.stream_plan``)."""
    from moestack.cache.streaming import stream_plan

    moe = model.moe_layers[0]
    size = moe.w1.element_size() if pdtype == torch.float32 else pdtype.itemsize
    expert_bytes = (moe.w1[0].numel() + moe.w2[0].numel()) * size
    tokens = cfg.batch_size // ranks * cfg.data.seq_len
    streamed = stream_plan(cfg, expert_bytes, tokens, plan.device == "cuda")
    if streamed is None:
        return
    weights = plan.line("weights")
    weights.bytes -= streamed.experts
    weights.formula += f" - {streamed.experts} B routed experts (in the store)"
    plan.lines.append(Line("device", "expert cache slots", streamed.slots,
                           f"n_layers x cache.capacity + top_k (+ top_k prefetch) slots of "
                           f"{expert_bytes} B"))  # fmt: skip
    plan.lines.append(
        Line(
            "device",
            "expert working set",
            streamed.working_set,
            "one layer's experts beyond the free slots, while it computes",
        )
    )
    if streamed.host:
        plan.lines.append(
            Line("host", "expert host tier", streamed.host, "every expert (offload_experts=host)")
        )


def _tiered_lines(
    plan: MemoryPlan, cfg: TrainConfig, model: torch.nn.Module, pdtype: torch.dtype
) -> None:
    """optim=tiered's own plan (:func:`moestack.optim.tiered_bytes.plan_rows`: its state per
    population on the most loaded rank, what a step allocates) on the device beside the
    weights; under expert parallelism or DDP the gradients' exchange buffer."""
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    ranks = plan.ranks if cfg.parallel.ep == 1 else 1  # under EP: the tensors a rank holds
    offload = cfg.optim.offload == "cpu" and plan.device != "cpu"
    cpu = plan.device == "cpu"
    for row in plan_rows(trained, classify(model), cfg.optim, pdtype, ranks, offload, cpu):
        plan.lines.append(Line(*row))
    numel, size = sum(p.numel() for _, p in trained), pdtype.itemsize
    exchange = "gradient all-reduce buffer" if cfg.parallel.ep > 1 else "DDP gradient buckets"
    if cfg.parallel.ep > 1 or uses_ddp("tiered", ranks, expert_parallel=False):
        plan.lines.append(Line("device", exchange, numel * size, f"{_mib(numel)} x {size} B"))


def _adamw_lines(
    plan: MemoryPlan, model: torch.nn.Module, pdtype: torch.dtype, ep: int = 1
) -> None:
    """torch AdamW's state (:func:`moestack.optim.plan.adamw_state_bytes`); under DDP also
    the gradient buckets (a second copy of the gradients); under expert parallelism, whose
    gradients are averaged in one flat buffer per group, that buffer."""
    trained = [p for p in model.parameters() if p.requires_grad]
    numel, size = sum(p.numel() for p in trained), pdtype.itemsize
    state = adamw_state_bytes(_specs(trained, plan.device, pdtype))
    plan.lines.append(
        Line(
            "device",
            "optimizer state (adamw)",
            sum(state.values()),
            f"2 moments x {_mib(numel)} x {size} B + 4 B step x {len(trained)} "
            "tensors; replicated on every rank" + (" (experts: this rank's)" if ep > 1 else ""),
        )
    )
    if ep > 1:
        plan.lines.append(
            Line("device", "gradient all-reduce buffer", numel * size, f"{_mib(numel)} x {size} B")
        )
    elif uses_ddp("adamw", plan.ranks, expert_parallel=False):
        plan.lines.append(
            Line("device", "DDP gradient buckets", numel * size, f"{_mib(numel)} x {size} B")
        )


def _offload_lines(
    plan: MemoryPlan,
    cfg: TrainConfig,
    pdtype: torch.dtype,
    named: list[tuple[int, str, Any]],
    world: int,
    label: str = "",
) -> None:
    """The buffers of the OffloadAdamW over ``named`` whose process group has ``world``
    ranks, as its own plan lists them (:func:`moestack.optim.offload_plan.plan_offload`), for
    the rank with the largest shard; the native kernel is assumed to load."""
    if not named:
        return
    tensors = [p for _, _, p in named]
    layout = plan_offload(
        _specs(tensors, plan.device, pdtype),
        [gi for gi, _, _ in named],
        expert_flags(tensors, [n for _, n, _ in named], None, DEFAULT_EXPERT_PATTERN),
        world_size=world,
        rank=None,
        shard=cfg.optim.shard,
        fused_step=cfg.optim.fused_step,
        moment_dtype=parse_moment_dtype(cfg.optim.moment_dtype),
        update_delay=cfg.optim.update_delay,
        pipeline=cfg.optim.pipeline,
        overlap=cfg.optim.overlap,
        skip_idle_experts=cfg.optim.skip_idle_experts,
        reduce_on_device=cfg.optim.reduce_on_device,
        backend=("nccl" if plan.device == "cuda" else "gloo") if world > 1 else None,
        native=lambda: True,
    )
    _host_lines(plan, layout, label)
    if layout.in_place:
        plan.notes.append(_IN_PLACE if not label else f"{label.strip(' ()')}: {_IN_PLACE_GROUP}")
    for n in layout.device_scratch.values():
        plan.lines.append(
            Line(
                "device",
                "offload dtype scratch" + label,
                4 * n,
                f"min(largest param {_mib(n)}, 2^24) x 4 B",
            )
        )
    if layout.device_reduce:
        size = layout.grad_dtype.itemsize
        plan.lines.append(
            Line(
                "device",
                "offload device collectives" + label,
                size * layout.device_comm,
                f"({world} + 1) shards of {_mib(layout.shards.stride)} x {size} B",
            )
        )


_IN_PLACE = (
    "offload_adamw on one CPU process with fp32 weights steps them in "
    "place: no master copy, no gradient buffers"
)
_IN_PLACE_GROUP = (
    "their offload_adamw has one process (ep = ranks) and fp32 CPU weights, so it steps "
    "them in place: no master copy, no gradient buffers"
)
_SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _host_lines(plan: MemoryPlan, layout: OffloadPlan, label: str) -> None:
    """One line per kind of host buffer in ``layout.host``, with its formula."""
    host, shards = layout.host, layout.shards.num_shards
    size, moment = host["exp_avg"][0], host["exp_avg"][1].itemsize
    where = f"sharded over {shards} ranks (largest shard)" if shards > 1 else "not sharded"
    plan.lines.append(
        Line(
            "host",
            "optimizer moments" + label,
            _bytes(host, "exp_avg", "exp_avg_sq"),
            f"2 x {_mib(size)} x {moment} B, {where}",
        )
    )
    if "master" in host:
        n, dtype = host["master"]
        what, formula = "optimizer master weights", f"{_mib(n)} x {dtype.itemsize} B"
        if layout.split:
            what += ", low halves"
            formula += " (their bf16 halves are the weights; 4 B without a C++ compiler)"
        plan.lines.append(Line("host", what + label, _bytes(host, "master"), formula))
    if "grad_comm" in host:
        comm, gsize = host["grad_comm"][0], host["grad_comm"][1].itemsize
        formula = f"{_mib(comm)} x {gsize} B"
        if "grad_shard" in host:
            stride = host["grad_shard"][0]
            formula = f"({shards} x {_mib(stride)} + {_mib(stride)}) x {gsize} B"
        pack = _bytes(host, "grad_comm", "grad_shard")
        plan.lines.append(Line("host", "gradient pack buffers" + label, pack, formula))
    if "grad_spare" in host:
        n, dtype = host["grad_spare"]
        plan.lines.append(
            Line(
                "host",
                "delayed update: spare gradient buffer" + label,
                _bytes(host, "grad_spare"),
                f"{_mib(n)} x {dtype.itemsize} B (optim.update_delay=1)",
            )
        )
    if "weight_staging" in host:
        n, dtype = host["weight_staging"]
        plan.lines.append(
            Line(
                "host",
                f"weight staging ({_SHORT.get(dtype, dtype)})" + label,
                _bytes(host, "weight_staging"),
                f"{_mib(n)} x {dtype.itemsize} B",
            )
        )


def _bytes(sizes: dict[str, tuple[int, torch.dtype]], *roles: str) -> int:
    """Bytes of the buffers ``roles`` of ``sizes`` (those it has)."""
    return sum(n * dtype.itemsize for role, (n, dtype) in sizes.items() if role in roles)


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
    cfg: TrainConfig,
    ranks: int,
    device: torch.device,
    table: bool = True,
    model: torch.nn.Module | None = None,
) -> MemoryPlan | None:
    """Log the plan at the start of a run (moestack's models and transformers folders
    alike): its table, or with ``table=False`` (a sweep's later jobs) its totals in one
    line. ``model``: the run's model as built (see :func:`plan_memory`), so that it is not
    built again."""
    plan = plan_memory(cfg, ranks, device.type, model)
    if table:
        log.info("memory plan (per rank):\n%s", plan.format())
    else:
        log.info("memory plan (per rank): device %.2f MiB, host %.2f MiB (`moestack plan` for "
                 "the table)", plan.total("device") / 2**20, plan.total("host") / 2**20)  # fmt: skip
    return plan


GIB = 2**30  # --gpu-gb counts in GiB: a "24 GB" or "80 GB" card holds about that many GiB


def gpu_fit(plan: MemoryPlan, gpu_gb: float, cfg: TrainConfig) -> str:
    """One line: whether the plan's device total (per rank, one GPU each) fits a GPU of
    ``gpu_gb`` GiB (``moestack plan --gpu-gb``), by how much, and what is not counted; when
    it does not fit, the settings of ``cfg`` that would move memory off the device."""
    total, card = plan.total("device"), gpu_gb * GIB
    what = f"a GPU of {gpu_gb:g} GiB: {total / 2**20:.2f} MiB planned per device"
    if total <= card:
        return (
            f"device: fits {what}, {(card - total) / GIB:.2f} GiB left (not counted: the CUDA "
            "context and the backward's transient buffers)"
        )
    fixes = ["optim=tiered or offload_adamw"] if cfg.optim.name == "adamw" else []
    fixes += ["trainable=lora or routers"] if cfg.trainable == "all" else []
    if cfg.trainable != "all" and cfg.offload_experts == "off":  # frozen experts
        fixes.append("offload_experts=host or disk")
    if "lora" in cfg.trainable and cfg.lora.base_dtype == "float32":
        fixes.append("lora.base_dtype=bfloat16")
    if not cfg.model.is_transformers and cfg.model.checkpointing != "block":
        fixes.append("model.checkpointing=block")
    smaller = [f"a {name} below {n}" for name, n in
               (("batch_size", cfg.batch_size), ("data.seq_len", cfg.data.seq_len)) if n > 1]  # fmt: skip
    fixes += [" or ".join(smaller)] if smaller else []
    return (
        f"device: does not fit {what}, {(total - card) / GIB:.2f} GiB over; less on the "
        f"device: {', '.join(fixes)}"
    )


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
