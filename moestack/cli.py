"""The ``moestack`` command: verbs around training runs (training itself is moestack-train).

    moestack eval RUN_DIR [--checkpoint PATH] [--batches N]   validation loss and perplexity

Each verb prints its result; bad input ends with one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from omegaconf import OmegaConf

from moestack import checkpoint
from moestack.config import TrainConfig
from moestack.errors import MoestackError

log = logging.getLogger("moestack")


def load_run_config(run_dir: Path | str) -> TrainConfig:
    """The resolved config a training run wrote into ``run_dir/config.yaml``."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise MoestackError(f"{path} not found: {run_dir} is not a moestack run directory")
    merged = OmegaConf.merge(OmegaConf.structured(TrainConfig), OmegaConf.load(path))
    return OmegaConf.to_object(merged)


def resolve_checkpoint(run_dir: Path, checkpoint_path: str | None) -> Path:
    if checkpoint_path:
        return Path(checkpoint_path)
    latest = checkpoint.latest_checkpoint(run_dir / "checkpoints")
    if latest is None:
        raise MoestackError(f"{run_dir / 'checkpoints'} holds no checkpoint")
    return latest


def cmd_eval(args: argparse.Namespace) -> dict:
    from moestack.data import eval_batches, load_corpus
    from moestack.model import MoETransformer
    from moestack.train import evaluate, resolve_device

    run_dir = Path(args.run_dir)
    cfg = load_run_config(run_dir)
    ckpt = resolve_checkpoint(run_dir, args.checkpoint)
    device = resolve_device(args.device or cfg.device)
    model = MoETransformer(cfg.model)
    checkpoint.load_model_weights(ckpt, model, cfg.model)
    model.to(device)
    corpus = load_corpus(cfg.data)
    batches = eval_batches(
        corpus.val, cfg.batch_size, cfg.data.seq_len, args.batches or cfg.eval_batches
    )
    result = {"checkpoint": str(ckpt), **evaluate(model, batches, device)}
    print(json.dumps(result, indent=2))
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moestack", description=__doc__.split("\n")[0])
    verbs = parser.add_subparsers(dest="verb", required=True)

    p = verbs.add_parser("eval", help="validation loss and perplexity of a run's checkpoint")
    p.add_argument("run_dir", help="a moestack-train output directory")
    p.add_argument("--checkpoint", help="a checkpoint folder (default: the run's newest)")
    p.add_argument("--batches", type=int, default=0, help="validation batches (default: the run's)")
    p.add_argument("--device", default="", help="cpu or cuda (default: the run's)")
    p.set_defaults(func=cmd_eval)
    return parser


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (MoestackError, ValueError) as err:
        print(f"moestack {args.verb}: error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
