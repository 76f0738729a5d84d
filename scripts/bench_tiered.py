"""Benchmark optim=tiered against AdamW: state bytes counted, and the update and training step timed.

1. bytes: the optimizer state per population, counted from the shapes of model=tiny (and
   tiny with 16 experts, tiny_e16: the prereg_tiered study's model), small, m137 and a Qwen3-30B-A3B-shaped transformers config (built on the meta device), for
   tiered with master=none against AdamW's two fp32 moments (fp32 weights) and
   mixed-precision AdamW's moments and fp32 master (12 bytes a parameter); and the training
   bytes per expert parameter (bf16 weights and gradients, and the experts' state), with the
   gradients all held (a step after backward) and with ``optim.update_in_backward`` (those of
   the largest MoE layer held at once);
2. grads: the same bytes measured, in a real CPU training step of the default model (bf16,
   master=none) with and without ``optim.update_in_backward``: the peak bytes torch's profiler
   files as parameters, gradients and optimizer state;
3. update: the optimizer step alone on fp32 parameters with gradients set, TieredAdamW
   (default policy) against torch.optim.AdamW(fused=True), on the default (tiny) and m137
   models, interleaved rounds;
4. train_step: a whole training step (forward, backward, clip, step) of the default model
   with master=none (bf16 weights, stochastic rounding) against master=float32 (fp32
   weights), and unclipped with and without ``optim.update_in_backward``, interleaved rounds.

  python scripts/bench_tiered.py [--only bytes,grads,update,train_step] [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import platform
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml

from moestack import bench
from moestack.config import ModelConfig, MoEConfig, OptimConfig
from moestack.optim import build_optimizer
from moestack.optim.tiered_backward import held_gradient_numel
from moestack.optim.tiered_bytes import planned_state_bytes
from moestack.populations import classify

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "model"


def model_config(name: str, num_experts: int | None = None) -> ModelConfig:
    """moestack's model ``name`` as its config group file sets it (``num_experts`` if given)."""
    fields = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
    moe = {**fields.pop("moe", {}), "impl": "torch"}
    moe = MoEConfig(**(moe if num_experts is None else {**moe, "num_experts": num_experts}))
    return ModelConfig(**fields, moe=moe)


def qwen3_30b_a3b(layers: int = 48) -> torch.nn.Module:
    """A transformers Qwen3-MoE model of Qwen3-30B-A3B's shapes, on the meta device."""
    import transformers

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, tie_word_embeddings=False,
    )  # fmt: skip
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cfg)


def state_bytes(model: torch.nn.Module) -> dict[str, Any]:
    """Counted bytes of tiered's state (master=none) against AdamW's, and per expert parameter."""
    cfg = OptimConfig(name="tiered")
    named = list(model.named_parameters())
    info = classify(model)
    tiered = planned_state_bytes(named, info, cfg.policy, "none", torch.bfloat16)
    params = sum(p.numel() for _, p in named)
    experts = sum(p.numel() for n, p in named if info[n].population == "experts")
    held = held_gradient_numel(model, only={n for n, _ in named if info[n].population == "experts"})
    total = sum(tiered.values())
    return {
        "params": params,
        "expert_params": experts,
        "tiered_state_bytes": tiered,
        "tiered_total": total,
        "adamw_fp32_state": 8 * params,
        "adamw_mixed_state": 12 * params,
        "ratio_vs_adamw_fp32": total / (8 * params),
        "ratio_vs_adamw_mixed": total / (12 * params),
        "expert_training_bytes_per_param": (4 * experts + tiered["experts"]) / max(experts, 1),
        "expert_gradients_held_in_backward": held,
        "expert_training_bytes_per_param_in_backward": (
            (2 * experts + 2 * held + tiered["experts"]) / max(experts, 1)
        ),
    }


def bytes_section() -> dict[str, Any]:
    out = {}
    # tiny_e16: tiny with 16 experts, the model of the prereg_tiered study (its H1)
    for key, name, experts in (("tiny", "tiny", None), ("tiny_e16", "tiny", 16),
                               ("small", "small", None), ("m137", "m137", None)):  # fmt: skip
        with torch.device("meta"):
            model = model_config(name, experts).build()
        out[key] = state_bytes(model)
    out["qwen3_30b_a3b"] = state_bytes(qwen3_30b_a3b())
    return out


def _profiled_peaks(in_backward: bool) -> dict[str, int]:
    """Peak bytes per category of torch's memory profiler over two training steps of the
    default model (bf16, master=none, no global clip) after a first one."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action

    from moestack.optim import apply_param_dtype

    torch.manual_seed(0)
    model = model_config("tiny").build()
    cfg = OptimConfig(name="tiered", grad_clip=0.0, update_in_backward=in_backward)
    apply_param_dtype(model, cfg, torch.device("cpu"))
    opt = build_optimizer(model, cfg)
    tokens = torch.randint(0, 256, (4, 65), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        opt.backward(model(tokens[:, :-1], targets=tokens[:, 1:]).loss)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:  # fmt: skip
        step()
        step()
    memory = prof._memory_profile()
    live: dict[str, int] = {}
    peak: dict[str, int] = {}
    for _, action, (key, version), size in memory.timeline:
        category = memory._categories.get(key, version)
        name = category.name.lower() if category else "unknown"
        if action in (Action.CREATE, Action.PREEXISTING):
            live[name] = live.get(name, 0) + size
        elif action == Action.DESTROY:
            live[name] = live.get(name, 0) - size
        peak[name] = max(peak.get(name, 0), live.get(name, 0))
    params = sum(p.numel() for p in model.parameters())
    return {**peak, "params": params, "counted_held_gradients": 2 * held_gradient_numel(model)}


def grads_section() -> dict[str, Any]:
    out = {"after_backward": _profiled_peaks(False), "in_backward": _profiled_peaks(True)}
    for r in out.values():
        r["bytes_per_param"] = (r["parameter"] + r["gradient"] + r["optimizer_state"]) / r["params"]
    return out


def interleaved(contenders: dict[str, Callable[[], None]], rounds: int, reps: int) -> dict:
    """Each contender's seconds per call: ``reps`` calls a round, rounds interleaved (one
    warm-up call each first); median and range over rounds, and the ratio to the first."""
    for fn in contenders.values():
        fn()
    batched = {name: (lambda fn=fn: [fn() for _ in range(reps)]) for name, fn in contenders.items()}
    rounds_s = bench.interleave(batched, rounds, rotate=False)
    spreads = {name: bench.spread([t / reps for t in ts]) for name, ts in rounds_s.items()}
    base = next(iter(spreads.values()))["median"]
    return {
        name: {
            "median_s": sp["median"],
            "min_s": sp["min"],
            "max_s": sp["max"],
            "ratio": sp["median"] / base,
        }  # fmt: skip
        for name, sp in spreads.items()
    }


def _step_of(model: torch.nn.Module, cfg: OptimConfig) -> Callable[[], None]:
    """An optimizer over ``model`` whose step reuses gradients set once (seeded)."""
    gen = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen) * 1e-2
    opt = build_optimizer(model, cfg)
    return opt.step


def update_section(rounds: int) -> dict[str, Any]:
    out = {}
    for name, reps in (("tiny", 20), ("m137", 2)):
        torch.manual_seed(0)
        a, b = model_config(name).build(), model_config(name).build()
        contenders = {
            "adamw_fused": _step_of(a, OptimConfig(name="adamw")),
            "tiered": _step_of(b, OptimConfig(name="tiered", master="float32")),  # fp32 weights
        }
        out[name] = interleaved(contenders, rounds, reps)
    return out


def _train_step_of(
    master: str, param_dtype: str = "auto", clip: bool = True, in_backward: bool = False
) -> Callable[[], None]:
    """A training step of the default model with tiered at ``master``, its weights as a
    training run holds them (``apply_param_dtype``: bf16 without a master, or with
    ``param_dtype=float32`` fp32 values on the bf16 grid; buffers fp32); the gradients
    clipped to a global norm of 1 (``clip``) or each tensor stepped in backward."""
    from moestack.optim import apply_param_dtype

    torch.manual_seed(0)
    model = model_config("tiny").build()
    cfg = OptimConfig(name="tiered", master=master, param_dtype=param_dtype,
                      grad_clip=1.0 if clip else 0.0, update_in_backward=in_backward)  # fmt: skip
    apply_param_dtype(model, cfg, torch.device("cpu"))
    opt = build_optimizer(model, cfg)
    tokens = torch.randint(0, 256, (16, 256), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        out = model(tokens[:, :-1], targets=tokens[:, 1:])
        opt.backward(out.loss)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    return step


def train_step_section(rounds: int) -> dict[str, Any]:
    contenders = {
        "master_float32": _train_step_of("float32"),
        "master_none": _train_step_of("none"),
        "master_none_fp32": _train_step_of("none", "float32"),  # the bf16 grid, fp32 storage
        # bf16 weights unclipped: the step after backward, and each tensor stepped in it
        "master_none_unclipped": _train_step_of("none", clip=False),
        "master_none_in_backward": _train_step_of("none", clip=False, in_backward=True),
    }
    return interleaved(contenders, rounds, 2)


def _device_run(
    name: str, optim: OptimConfig, steps: int, batch: int, seq_len: int
) -> dict[str, Any]:
    """Peak memory and step times of ``steps`` training steps of model ``name`` on the GPU
    (else the CPU) with ``optim``, after two warm-up steps."""
    from moestack.device import autocast_context
    from moestack.optim import apply_param_dtype

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    cfg = model_config(name)
    if device.type == "cuda":
        cfg.moe.impl = "auto"
    model = cfg.build().to(device)
    dtype = apply_param_dtype(model, optim, device)
    opt = build_optimizer(model, optim)
    seq = min(cfg.max_seq_len, seq_len)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), device=device)
    losses: list[torch.Tensor] = []

    def step() -> None:
        with autocast_context(device):
            loss = model(tokens[:, :-1], targets=tokens[:, 1:]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses[:] = [loss]

    bench.times(step, device, repeats=2)  # warm-up, then the peak of steady-state steps
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = bench.times(step, device, repeats=steps)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    model = opt = None  # the closure's cells too: freed before empty_cache
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "param_dtype": str(dtype), "peak_bytes": peak, "median_s": statistics.median(times),
        "min_s": min(times), "max_s": max(times), "loss": float(losses[0].detach()),
    }  # fmt: skip


def device_section(steps: int, batch: int, seq_len: int = 512) -> dict[str, Any]:
    name = "m137" if torch.cuda.is_available() else "tiny"
    out = {"model": name, "device": "cuda" if torch.cuda.is_available() else "cpu (dry run)"}
    out["adamw"] = _device_run(name, OptimConfig(name="adamw"), steps, batch, seq_len)
    out["tiered"] = _device_run(name, OptimConfig(name="tiered"), steps, batch, seq_len)
    a, t = out["adamw"], out["tiered"]
    out["time_ratio"] = t["median_s"] / a["median_s"]
    if a["peak_bytes"]:
        out["memory_ratio"] = t["peak_bytes"] / a["peak_bytes"]
        out["targets_met"] = {"memory<=0.45x": out["memory_ratio"] <= 0.45,
                              "time<=1.05x": out["time_ratio"] <= 1.05}  # fmt: skip
    return out


def print_tables(results: dict[str, Any]) -> None:
    if "bytes" in results:
        print(f"{'model':14} {'params':>9} {'tiered MB':>10} {'AdamW fp32 MB':>14} "
              f"{'ratio':>6} {'vs mixed':>8} {'B/expert param':>14}")  # fmt: skip
        for name, r in results["bytes"].items():
            print(f"{name:14} {r['params'] / 1e6:8.1f}M {r['tiered_total'] / 1e6:10.2f} "
                  f"{r['adamw_fp32_state'] / 1e6:14.1f} {r['ratio_vs_adamw_fp32']:6.3f} "
                  f"{r['ratio_vs_adamw_mixed']:8.3f} {r['expert_training_bytes_per_param']:14.3f}"
                  f" {r['expert_training_bytes_per_param_in_backward']:8.3f} in backward")  # fmt: skip
    if "grads" in results:
        print(f"{'grads (tiny)':16} {'params MB':>10} {'grads MB':>9} {'state MB':>9} "
              f"{'counted grads MB':>17} {'B/param':>8}")  # fmt: skip
        for name, r in results["grads"].items():
            print(f"{name:16} {r['parameter'] / 1e6:10.3f} {r['gradient'] / 1e6:9.3f} "
                  f"{r['optimizer_state'] / 1e6:9.3f} {r['counted_held_gradients'] / 1e6:17.3f} "
                  f"{r['bytes_per_param']:8.3f}")  # fmt: skip
    if "device" in results:
        r = results["device"]
        for name in ("adamw", "tiered"):
            c = r[name]
            peak = f"{c['peak_bytes'] / 2**30:.2f} GiB" if c["peak_bytes"] else "n/a"
            print(f"device     {r['model']:6} {name:15} {c['median_s'] * 1e3:9.2f} ms "
                  f"[{c['min_s'] * 1e3:.2f}, {c['max_s'] * 1e3:.2f}]  peak {peak}")  # fmt: skip
        print(
            f"device     time x{r['time_ratio']:.3f}, memory x{r.get('memory_ratio', float('nan')):.3f}"
        )
    for section in ("update", "train_step"):
        if section not in results:
            continue
        rows = results[section] if section == "update" else {"tiny": results[section]}
        for model, contenders in rows.items():
            for name, r in contenders.items():
                print(f"{section:10} {model:6} {name:15} {r['median_s'] * 1e3:9.2f} ms "
                      f"[{r['min_s'] * 1e3:.2f}, {r['max_s'] * 1e3:.2f}]  x{r['ratio']:.3f}")  # fmt: skip


def main() -> None:
    ap = bench.parser(__doc__, rounds=5, json="")
    ap.add_argument("--only", default="bytes,grads,update,train_step", help="sections to run")
    ap.add_argument("--device-steps", type=int, default=10, help="device: timed training steps")
    ap.add_argument("--batch", type=int, default=16, help="device: sequences a step")
    args = ap.parse_args()
    sections = {"bytes": bytes_section, "grads": grads_section, "update": lambda: update_section(args.rounds),
                "train_step": lambda: train_step_section(args.rounds),
                "device": lambda: device_section(args.device_steps, args.batch)}  # fmt: skip
    results: dict[str, Any] = {
        "machine": {
            "platform": platform.platform(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
        },  # fmt: skip
    }
    for name in args.only.split(","):
        results[name] = sections[name]()
    print_tables(results)
    if args.json:
        bench.write_json(args.json, results, indent=1)


if __name__ == "__main__":
    main()
