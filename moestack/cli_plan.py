"""The ``moestack plan`` verb: the memory plan of a run, for moestack's own models and for
transformers folders (``model=hf model.path=DIR``, planned from config.json alone), and
with ``--gpu-gb N`` whether it fits a GPU of N GiB. ``moestack.cli`` registers it."""

from __future__ import annotations

import argparse
import math
from typing import Any

from moestack.errors import MoestackError


def cmd_plan(args: argparse.Namespace) -> None:
    from moestack.memory_plan import gpu_fit, plan_memory
    from moestack.overrides import check_overrides
    from moestack.prereg.compose import compose_config

    device = args.device
    if args.gpu_gb is not None:
        if device == "cpu":
            raise MoestackError(
                f"--gpu-gb {args.gpu_gb:g} asks whether the run fits a GPU, but --device cpu "
                "plans a CPU run: drop --device cpu (--gpu-gb plans for cuda)"
            )
        device = "cuda"
    check_overrides(args.overrides, sweep=False)  # the rule moestack-train applies
    cfg = compose_config(args.overrides).resolve()  # a folder's sizes from its config.json
    plan = plan_memory(cfg, ranks=args.ranks, device=device)
    print(
        f"memory plan: model={cfg.model.describe()} optim={cfg.optim.name} "
        f"trainable={cfg.trainable} checkpointing={cfg.model.checkpointing} "
        f"ranks={plan.ranks} device={plan.device}"
    )
    print(plan.format())
    if args.gpu_gb is not None:
        print(gpu_fit(plan, args.gpu_gb, cfg))


def gpu_gb_arg(text: str) -> float:
    """An argparse type: a GPU's memory in GiB, a finite number above 0 (24, 80, 141)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GiB, such as 24") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: give a GPU's GiB above 0, such as 24 or 80")
    return value


def plan_parser(verbs: Any) -> None:
    p = verbs.add_parser(
        "plan",
        help="bytes of weights, gradients, optimizer state and activations of a run",
        description="The memory plan of a moestack-train run, per rank: one line per figure "
        "with its formula (docs/memory.md). model=hf model.path=DIR plans a transformers "
        "folder from its config.json alone (no weight file read).",
    )
    p.add_argument(
        "overrides",
        nargs="*",
        help="hydra overrides as for moestack-train, e.g. model=m137 optim=offload_adamw, or "
        "model=hf model.path=DIR (default: none, the default run)",
    )
    p.add_argument(
        "--ranks",
        type=int,
        default=1,
        help="data-parallel ranks: ZeRO-1 shards of offload_adamw, batch split (default: %(default)s)",
    )
    p.add_argument(
        "--device",
        choices=("", "cpu", "cuda"),
        default="",
        help="plan for this device (default: the run's device; auto is cuda when present; "
        "cuda with --gpu-gb)",
    )
    p.add_argument(
        "--gpu-gb",
        type=gpu_gb_arg,
        default=None,
        metavar="N",
        help="also say whether the device total fits a GPU of N GiB (2^30 bytes), one per "
        "rank, e.g. 24 or 80; plans for cuda (default: none)",
    )
    p.set_defaults(func=cmd_plan)
