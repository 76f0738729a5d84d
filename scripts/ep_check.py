"""The expert-parallel MoE layer on NCCL against the single-process layer (scripts/gpu_check.sh,
phase ep_check): outputs, input gradients and every parameter gradient, fp32.

One process per GPU (mp.spawn, NCCL), as tests/parallel/test_ep_layer.py does with gloo on
the CPU: every rank builds the same seeded layer and tokens, runs the single-process layer
over all ranks' tokens as the reference, then its experts sharded over an EP group
(``moestack.parallel.shard_experts``) on its own tokens, and compares its slice of the
outputs and input gradients, and its gradients after ``average_gradients``, with the
reference's (parameter gradients divided by the world: the mean of the ranks' losses). Cases:
ragged token counts, one token per rank, ranks without tokens, experts nobody picks (a rank
without rows at the largest ep), top_k = num_experts, and 512 tokens of width 64. Layouts:
every ep in 2, 4, 8 up to the world (the largest power of two <= GPUs, at most 8), with the
torch expert impl and, on CUDA, the Triton one. The max abs error per rank, case and layout
goes to ``--json``; the exit status is 1 when one exceeds ``atol + rtol x max |reference|``.

With fewer than 2 GPUs (or no NCCL) it writes and prints that it skipped, and why, and exits
0. ``--backend gloo --world N`` runs the same check on CPU processes (the tests use it).

    python scripts/ep_check.py --json out/ep_check.json [--backend nccl|gloo] [--world N]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from moestack import MoE, MoEConfig, RouterConfig, distributed
from moestack.parallel import average_gradients, build_mesh, shard_experts

ATOL, RTOL = 1e-5, 1e-4  # fp32; the reference differs only in summation order
# How long one collective (and the process-group set-up, which waits for every rank to start)
# may wait for the other ranks: a deadlock fails instead of hanging, and gloo ranks starting
# on a loaded 2-core machine have time to arrive (on GPUs gpu_check.sh caps the whole phase).
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)


def case_specs(world: int) -> dict[str, dict[str, Any]]:
    """name -> num_experts, top_k, d_model, d_ff, tokens of each rank, experts never chosen."""
    ragged = [7 + 2 * r for r in range(world)]
    some_empty = [0 if r % 2 else 5 + r for r in range(world)]
    small = {"num_experts": 8, "d_model": 12, "d_ff": 10, "idle": ()}
    return {
        "random": small | {"top_k": 2, "tokens": ragged},
        "one_token": small | {"top_k": 3, "tokens": [1] * world},
        "empty_ranks": small | {"top_k": 2, "tokens": some_empty},
        "idle_experts": small | {"top_k": 2, "tokens": ragged, "idle": (1, 6, 7)},
        "top_k_all": small | {"top_k": 8, "tokens": ragged},
        "wide": {"num_experts": 8, "top_k": 2, "d_model": 64, "d_ff": 128, "idle": (),
                 "tokens": [512] * world},
    }  # fmt: skip


class OneLayer(nn.Module):
    """One MoE layer, the smallest model ``shard_experts`` accepts."""

    def __init__(self, spec: dict[str, Any], impl: str) -> None:
        super().__init__()
        idle = spec["idle"]
        router = RouterConfig(bias_update_rate=0.01 if idle else 0.0, load_balance=0.0)
        moe = MoEConfig(spec["num_experts"], spec["top_k"], spec["d_ff"], impl=impl)
        self.moe = MoE(spec["d_model"], moe, router)
        with torch.no_grad():
            self.moe.router.weight.normal_(std=0.5)  # spread the routing
            for e in idle:  # the selection bias keeps these experts out of every top-k
                self.moe.router.expert_bias[e] = -1e4

    @property
    def moe_layers(self) -> list[MoE]:
        return [self.moe]


def build_case(
    spec: dict[str, Any], impl: str, device: torch.device, seed: int
) -> tuple[OneLayer, list[torch.Tensor], list[torch.Tensor]]:
    """The layer, and every rank's tokens and output cotangents (seeded, built on the CPU)."""
    torch.manual_seed(seed)
    model = OneLayer(spec, impl)
    xs = [torch.randn(t, spec["d_model"]).to(device) for t in spec["tokens"]]
    gs = [torch.randn(t, spec["d_model"]).to(device) for t in spec["tokens"]]
    return model.to(device), xs, gs


def _max_err(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(max |got - want|, max |want|); zeros for empty tensors."""
    if want.numel() == 0:
        return 0.0, 0.0
    return float((got - want).abs().max()), float(want.abs().max())


def check_case(spec: dict, impl: str, mesh: Any, device: torch.device, seed: int) -> dict:
    """This rank's errors against the single-process layer: y, x_grad, parameter gradients."""
    world, rank = mesh.world_size, dist.get_rank()
    ref_model, xs, gs = build_case(spec, impl, device, seed)
    x_all = torch.cat(xs).requires_grad_()
    y_all = ref_model.moe(x_all)
    (y_all * torch.cat(gs)).sum().backward()
    lo = sum(spec["tokens"][:rank])
    part = slice(lo, lo + spec["tokens"][rank])

    model, _, _ = build_case(spec, impl, device, seed)
    shard_experts(model, mesh)
    x = xs[rank].clone().requires_grad_()
    y = model.moe(x)
    (y * gs[rank]).sum().backward()
    average_gradients(model)

    errs = {"y": _max_err(y.detach(), y_all.detach()[part])}
    errs["x_grad"] = _max_err(x.grad, x_all.grad[part])
    first, last = mesh.expert_range(spec["num_experts"])
    worst = (0.0, 0.0)
    for name, p in ref_model.named_parameters():
        want = p.grad / world  # the mean over ranks of each rank's loss
        if name.endswith(("w1", "w2")):
            want = want[first:last]
        err = _max_err(dict(model.named_parameters())[name].grad, want)
        worst = (max(worst[0], err[0]), max(worst[1], err[1]))
    errs["grads"] = worst
    return {k: {"max_abs_err": e, "ref_max_abs": s} for k, (e, s) in errs.items()}


def layouts(world: int) -> list[int]:
    """The EP degrees checked: 2, 4, 8 up to the world."""
    return [ep for ep in (2, 4, 8) if ep <= world]


def _worker(rank: int, world: int, backend: str, init: str, impls: list[str], out: str) -> None:
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 on both sides
    dist.init_process_group(
        backend,
        init_method=f"file://{init}",
        rank=rank,
        world_size=world,
        timeout=COLLECTIVE_TIMEOUT,
    )
    try:
        _check_layouts(rank, world, device, impls, out)
        dist.barrier()
    finally:  # the layouts' meshes are gone: every group ends, with its threads
        distributed.close_process_groups()


def _check_layouts(rank: int, world: int, device: torch.device, impls: list[str], out: str) -> None:
    rows = []
    for ep in layouts(world):
        mesh = build_mesh(world, rank, ep)
        for impl in impls:
            cases = {
                name: check_case(spec, impl, mesh, device, seed)
                for seed, (name, spec) in enumerate(case_specs(world).items())
            }
            rows.append({"ep": ep, "impl": impl, "rank": rank, "cases": cases})
    every: list[Any] = [None] * world
    dist.all_gather_object(every, rows)
    if rank == 0:
        Path(out).write_text(json.dumps([row for rank_rows in every for row in rank_rows]))


def verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per rank and layout the worst error of each kind, and whether all are within
    ``atol + rtol x max |reference|``."""
    failures, summary = [], []
    for row in rows:
        worst = {}
        for case, errs in row["cases"].items():
            for kind, e in errs.items():
                if e["max_abs_err"] > ATOL + RTOL * e["ref_max_abs"]:
                    failures.append(
                        f"ep={row['ep']} {row['impl']} rank {row['rank']} {case} {kind}"
                    )
                worst[kind] = max(worst.get(kind, 0.0), e["max_abs_err"])
        summary.append({k: row[k] for k in ("ep", "impl", "rank")} | {"max_abs_err": worst})
    return {"ok": not failures, "failures": failures, "per_rank": summary}


def gpus_or_reason(backend: str, world: int) -> tuple[int, str]:
    """The world to check and "" , or 0 and why the check is skipped."""
    if backend == "gloo":
        return world, ""
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < 2:
        return 0, f"needs >= 2 GPUs, found {found}"
    if not dist.is_nccl_available():
        return 0, "needs NCCL, which this torch build lacks"
    return min(8, 1 << (found.bit_length() - 1)), ""  # a power of two: ep divides 8 experts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="write the errors (or the skip) here")
    parser.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    parser.add_argument("--world", type=int, default=2, help="processes with --backend gloo")
    parser.add_argument(
        "--impls", default="", help="expert impls (default: torch, +triton on CUDA)"
    )
    args = parser.parse_args()
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    world, reason = gpus_or_reason(args.backend, args.world)
    if reason:
        out.write_text(json.dumps({"skipped": True, "reason": reason}, indent=1))
        print(f"ep_check: skipped, {reason}")
        return 0
    impls = args.impls.split(",") if args.impls else ["torch"]
    if not args.impls and args.backend == "nccl" and importlib.util.find_spec("triton"):
        impls.append("triton")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        rows_path = Path(tmp) / "rows.json"
        mp.spawn(_worker, args=(world, args.backend, f"{tmp}/init", impls, str(rows_path)),
                 nprocs=world)  # fmt: skip
        rows = json.loads(rows_path.read_text())
    result = verdict(rows)
    devices = (
        [torch.cuda.get_device_name(i) for i in range(world)] if args.backend == "nccl" else []
    )
    report = {"skipped": False, "backend": args.backend, "world": world, "devices": devices,
              "layouts": layouts(world), "impls": impls, "atol": ATOL, "rtol": RTOL,
              "seconds": time.perf_counter() - start, **result, "rows": rows}  # fmt: skip
    out.write_text(json.dumps(report, indent=1))
    for r in sorted(result["per_rank"], key=lambda r: (r["ep"], r["impl"], r["rank"])):
        errs = ", ".join(f"{k} {v:.1e}" for k, v in r["max_abs_err"].items())
        print(f"  ep={r['ep']} {r['impl']:<6} rank {r['rank']}: max abs error {errs}")
    for failure in result["failures"]:
        print(f"  beyond atol {ATOL} + rtol {RTOL} x max|ref|: {failure}")
    state = "ok" if result["ok"] else "FAILED"
    print(f"ep_check: {state}, {args.backend}, {world} ranks, ep {layouts(world)}, impls "
          f"{','.join(impls)}, {len(rows) // world} layouts x {len(rows[0]['cases'])} cases, "
          f"{report['seconds']:.0f} s")  # fmt: skip
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
