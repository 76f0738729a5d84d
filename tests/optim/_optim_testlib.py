"""Shared pieces of the optimizer tests: a tiny MoE model, data, schedule, reference runs."""

from __future__ import annotations

import math
from typing import Any

import torch
from helpers.multiprocess import run_gloo_rank
from torch import nn

E, D, F = 4, 8, 12
IDLE = E - 1  # the router never picks this expert: its gradient slice is exactly zero
STEPS, ACCUM, BATCH = 20, 2, 8  # optimizer steps, micro-batches per step, global micro-batch
LR, MAX_NORM = 1e-2, 0.05


class TinyMoE(nn.Module):
    """Linear -> scale -> top-1 routed experts with stacked weights w1 [E,D,F], w2 [E,F,D]."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.inp = nn.Linear(D, D)
        self.scale = nn.Parameter(torch.ones(D))
        self.router = nn.Linear(D, E, bias=False)
        self.moe = nn.Module()
        self.moe.w1 = nn.Parameter(torch.randn(E, D, F, generator=g) * 0.3)
        self.moe.w2 = nn.Parameter(torch.randn(E, F, D, generator=g) * 0.3)
        with torch.no_grad():
            self.inp.weight.copy_(torch.randn(D, D, generator=g) * 0.3)
            self.inp.bias.copy_(torch.randn(D, generator=g) * 0.1)
            self.router.weight.copy_(torch.randn(E, D, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x) * self.scale
        logits = self.router(h)
        logits[:, IDLE] = float("-inf")
        probs = logits.softmax(-1)
        gate, idx = probs.max(-1)
        y = torch.relu(torch.bmm(h[:, None], self.moe.w1[idx])).bmm(self.moe.w2[idx])[:, 0]
        return y * gate[:, None]


def batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global micro-batch (BATCH rows) of a step; ranks take contiguous slices of it."""
    g = torch.Generator().manual_seed(1000 + 10 * step + micro)
    return torch.randn(BATCH, D, generator=g), torch.randn(BATCH, D, generator=g)


def lr_lambda(step: int) -> float:
    """Linear warm-up over 3 steps, then cosine to 10%."""
    if step < 3:
        return (step + 1) / 3
    t = (step - 3) / max(1, STEPS - 3)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))


def groups(model: nn.Module) -> list[dict[str, Any]]:
    """Two named groups with different weight decay."""
    named = list(model.named_parameters())
    return [
        {"params": [(n, p) for n, p in named if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [(n, p) for n, p in named if p.ndim < 2], "weight_decay": 0.01},
    ]


def micro_step(model: nn.Module, step: int, rows: slice = slice(None)) -> None:
    """Forward/backward of ACCUM micro-batches on the given rows (grads accumulate)."""
    for micro in range(ACCUM):
        x, y = batch(step, micro)
        loss = (model(x[rows]) - y[rows]).square().mean() / ACCUM
        loss.backward()


def reference_run() -> list[dict[str, Any]]:
    """torch.optim.AdamW on the full batch: params and state after every step."""
    model = TinyMoE()
    opt = torch.optim.AdamW(groups(model), lr=LR, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    names = dict(model.named_parameters())
    out = []
    for step in range(STEPS):
        micro_step(model, step)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        sched.step()
        opt.zero_grad()
        snap = {
            "params": {n: p.detach().clone() for n, p in names.items()},
            "state": {},
            "norm": float(norm),
        }
        for n, p in names.items():
            st = opt.state[p]
            snap["state"][n] = {
                "exp_avg": st["exp_avg"].clone(),
                "exp_avg_sq": st["exp_avg_sq"].clone(),
                "step": int(st["step"]),
            }
        out.append(snap)
    return out


def ours_state(sd: dict[str, Any], name: str, key: str) -> torch.Tensor:
    """Reassemble one parameter's state tensor from an OffloadAdamW state dict."""
    state = sd["state"]
    if name in state:
        return state[name][key]
    return torch.stack([state[f"{name}/expert{e}"][key] for e in range(E)])


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, what: str, tol: float) -> None:
    """Relative error max|a - b| / max|b| at most tol."""
    scale = expected.abs().max().clamp_min(1e-30)
    err = float((actual - expected).abs().max() / scale)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:g}"


DIST_CONFIGS = {
    "shard": {},
    "replicate": {"shard": False},
    "skip": {"skip_idle_experts": True},
    "delayed": {"update_delay": 1},
    # the collectives on the "devices" (the CPU parameters' gloo group), exact and delayed
    "device": {"reduce_on_device": True},
    "device_delayed": {"reduce_on_device": True, "update_delay": 1},
}


def dist_worker(rank: int, world: int, init_method: str, out_dir: str) -> None:
    """One rank of a gloo run per DIST_CONFIGS entry: its slice of every global batch.

    The "shard" run also saves a checkpoint (collective state_dict) at STEPS // 2.
    """
    torch.set_num_threads(1)
    run_gloo_rank(rank, world, init_method, _dist_runs, rank, world, out_dir)


def _dist_runs(rank: int, world: int, out_dir: str) -> None:
    from moestack.optim import OffloadAdamW

    for config, kw in DIST_CONFIGS.items():
        model = TinyMoE()
        opt = OffloadAdamW(groups(model), lr=LR, betas=(0.9, 0.95), eps=1e-8, **kw)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
        per = BATCH // world
        rows = slice(rank * per, (rank + 1) * per)
        history = []
        for step in range(STEPS):
            if step == STEPS // 2 and config == "shard":
                sd = opt.state_dict()  # collective: every rank calls it
                if rank == 0:
                    torch.save(
                        {"model": model.state_dict(), "optim": sd, "sched": sched.state_dict()},
                        f"{out_dir}/ckpt.pt",
                    )
            micro_step(model, step, rows)
            norm = float(opt.clip_grad_norm_(MAX_NORM))
            opt.step()
            sched.step()
            opt.zero_grad()
            snap = {n: p.detach().clone() for n, p in model.named_parameters()}
            history.append({"params": snap, "norm": norm})
        bufs = opt.host_buffers()
        state_bytes = sum(
            bufs[k].numel() * bufs[k].element_size() for k in ("master", "exp_avg", "exp_avg_sq")
        )
        opt.synchronize()  # a delayed run's last update (a no-op for the others)
        history.append({"params": {n: p.detach().clone() for n, p in model.named_parameters()}})
        spare = bufs.get("grad_spare")
        spare_bytes = 0 if spare is None else spare.numel() * spare.element_size()
        host = {role: t.numel() * t.element_size() for role, t in bufs.items()}
        device = {r: t.numel() * t.element_size() for r, t in opt.device_buffers().items()}
        torch.save(
            {"history": history, "state_bytes": state_bytes, "shards": opt.num_shards,
             "spare_bytes": spare_bytes, "host_bytes": host, "device_bytes": device,
             "stride": opt._plan.stride},
            f"{out_dir}/{config}{rank}.pt",
        )  # fmt: skip


def _copy_weights(src: nn.Module, dst: nn.Module) -> None:
    with torch.no_grad():
        for s, d in zip(src.parameters(), dst.parameters(), strict=True):
            d.copy_(s)


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def delayed_reference(
    warmup: int, clip: bool, synced_after: frozenset[int] = frozenset()
) -> list[dict[str, torch.Tensor]]:
    """The equations of a one-step-delayed update in plain torch: the weights the forward
    sees after every step, then after the final synchronize. ``torch.optim.AdamW`` steps a
    master copy with each step's gradients (clipped, at that step's learning rate); from step
    ``warmup`` on, the seen weights take the master's *before* each update (the previous one
    applied), before it exactly after; and after the steps in ``synced_after`` (a checkpoint's
    synchronize) also after it."""
    seen, master = TinyMoE(), TinyMoE()
    opt = torch.optim.AdamW(groups(master), lr=LR, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    out = []
    for step in range(STEPS):
        micro_step(seen, step)
        for s, m in zip(seen.parameters(), master.parameters(), strict=True):
            m.grad = None if s.grad is None else s.grad.clone()
        seen.zero_grad()
        if clip:
            torch.nn.utils.clip_grad_norm_(master.parameters(), MAX_NORM)
        delayed = step >= warmup
        if delayed:
            _copy_weights(master, seen)
        opt.step()
        sched.step()
        opt.zero_grad()
        if not delayed or step in synced_after:
            _copy_weights(master, seen)
        out.append(_snapshot(seen))
    _copy_weights(master, seen)
    return [*out, _snapshot(seen)]


def delayed_run(
    warmup: int,
    clip: bool,
    fused_step: str = "auto",
    synced_after: frozenset[int] = frozenset(),
    rows: slice = slice(None),
    **kw: Any,
) -> list[dict[str, torch.Tensor]]:
    """OffloadAdamW(update_delay=1, **kw) on one process (or one rank's ``rows``), recorded
    as :func:`delayed_reference` records the reference."""
    from moestack.optim import OffloadAdamW

    model = TinyMoE()
    opt = OffloadAdamW(
        groups(model), lr=LR, betas=(0.9, 0.95), eps=1e-8,
        update_delay=1, delay_warmup=warmup, fused_step=fused_step, **kw,
    )  # fmt: skip
    assert opt.pipelined == bool(kw.get("pipeline", False))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    out = []
    for step in range(STEPS):
        micro_step(model, step, rows)
        if clip:
            opt.clip_grad_norm_(MAX_NORM)
        opt.step()
        sched.step()
        opt.zero_grad()
        if step in synced_after:
            opt.synchronize()
        out.append(_snapshot(model))
    opt.synchronize()
    return [*out, _snapshot(model)]


def bf16_device_worker(rank: int, world: int, init_method: str, out_dir: str) -> None:
    """One rank of 5 steps of TinyMoE in bf16 with the collectives on the devices and on the
    host; what each holds and its weights after every step."""
    torch.set_num_threads(1)
    run_gloo_rank(rank, world, init_method, _bf16_device_runs, rank, world, out_dir)


def _bf16_device_runs(rank: int, world: int, out_dir: str) -> None:
    from moestack.optim import OffloadAdamW
    from moestack.optim.offload_plan import plan_offload
    from moestack.optim.plan import ParamSpec

    out: dict[str, Any] = {}
    for on_device in (True, False):
        model = TinyMoE().bfloat16()
        opt = OffloadAdamW(groups(model), lr=LR, betas=(0.9, 0.95), reduce_on_device=on_device)
        per = BATCH // world
        rows = slice(rank * per, (rank + 1) * per)
        history = []
        for step in range(5):
            for micro in range(ACCUM):
                x, y = batch(step, micro)
                loss = (model(x[rows].bfloat16()).float() - y[rows]).square().mean() / ACCUM
                loss.backward()
            opt.clip_grad_norm_(MAX_NORM)
            opt.step()
            opt.zero_grad()
            history.append({n: p.detach().clone() for n, p in model.named_parameters()})
        layout = plan_offload(
            [ParamSpec.of(p) for p in opt._params],
            *(opt._group_of, opt._is_expert),
            world_size=world,
            rank=rank,
            reduce_on_device=on_device,
            backend="gloo",
        )
        held = {r: (t.numel(), t.dtype) for r, t in opt.host_buffers().items()}
        out[str(on_device)] = {"history": history, "held": held, "planned": dict(layout.host)}
    torch.save(out, f"{out_dir}/bf16_{rank}.pt")


def stall_transfers(monkeypatch: Any) -> None:
    """Make every OffloadAdamW copy between host and device first sleep ~10 ms of GPU time
    on the stream doing it (CUDA): a missing wait then reads stale values."""
    from moestack.optim import OffloadAdamW

    to_host, to_device = OffloadAdamW._to_host, OffloadAdamW._to_device

    def slow_to_host(self: Any, dst: Any, src: Any, non_blocking: bool) -> None:
        torch.cuda._sleep(20_000_000)
        to_host(self, dst, src, non_blocking)

    def slow_to_device(self: Any, dst: Any, src: Any, non_blocking: bool) -> None:
        torch.cuda._sleep(20_000_000)
        to_device(self, dst, src, non_blocking)

    monkeypatch.setattr(OffloadAdamW, "_to_host", slow_to_host)
    monkeypatch.setattr(OffloadAdamW, "_to_device", slow_to_device)


COLLECTIVES = ("all_gather_into_tensor", "all_gather", "all_gather_object", "all_reduce",
               "reduce_scatter_tensor", "broadcast", "barrier")  # fmt: skip


def own_state_worker(rank: int, world: int, init_method: str, out_dir: str) -> None:
    """One rank of delayed runs (host and "device" collectives): the collectives issued
    while ``own_expert_state``/``own_shard_state`` run with an update in flight, their
    entries against ``state_dict``'s, and the weights after more steps against a twin run
    that never called them (both take a state_dict then, which applies the update)."""
    torch.set_num_threads(1)
    run_gloo_rank(rank, world, init_method, _own_state_runs, rank, world, out_dir)


def _own_state_runs(rank: int, world: int, out_dir: str) -> None:
    import torch.distributed as dist

    from moestack.optim import OffloadAdamW

    calls: list[str] = []
    for name in COLLECTIVES:
        real = getattr(dist, name)
        setattr(
            dist,
            name,
            lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw),
        )
    per = BATCH // world
    rows = slice(rank * per, (rank + 1) * per)
    out: dict[str, Any] = {}
    for config, kw in {"host": {}, "device": {"reduce_on_device": True}}.items():
        weights, counted, entries = [], [], {}
        for ask in (True, False):
            model = TinyMoE()
            opt = OffloadAdamW(groups(model), lr=LR, betas=(0.9, 0.95), update_delay=1, **kw)
            for step in range(5):
                if step == 3 and ask:  # an update launched at step 2 is in flight
                    before = len(calls)
                    entries = opt.own_expert_state()
                    shard = opt.own_shard_state()
                    counted = calls[before:]
                if step == 3:  # collective, on every rank; it applies the update (both runs)
                    full = opt.state_dict()["state"]
                    if ask:
                        same = all(
                            torch.equal(v, full[key][field])
                            for key, entry in entries.items()
                            for field, v in entry.items()
                            if isinstance(v, torch.Tensor)
                        )
                micro_step(model, step, rows)
                opt.clip_grad_norm_(MAX_NORM)
                opt.step()
                opt.zero_grad()
            opt.synchronize()
            weights.append(_snapshot(model))
        out[config] = {
            "collectives": counted,
            "entries": len(entries),
            "shard_pieces": len(shard),
            "entries_match_state_dict": same,
            "weights_match": all(torch.equal(p, weights[1][n]) for n, p in weights[0].items()),
            "shards": opt.num_shards,
        }
    torch.save(out, f"{out_dir}/own_{rank}.pt")
