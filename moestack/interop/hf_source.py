"""The transformers folder a ``model=hf`` run reads, recorded when it starts and compared
whenever the run is resumed or loaded.

A run of a transformers folder keeps only the weights in its checkpoints: the architecture,
routing and tokenizer are read from the folder each time. So a start writes the sha256 of
the folder's config and tokenizer files into the run (``SOURCE_FILE``, ``write_source``),
and a resume (``check_resume_source``) or a load for eval or export (``check_run_source``)
refuses a folder whose files changed since, in one line naming them. moestack's own model
has no such folder: nothing is written or compared.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from moestack.atomic import sha256_file
from moestack.errors import MoestackError
from moestack.interop.hf_config import check_model_dir
from moestack.metrics import write_json

log = logging.getLogger(__name__)

SOURCE_FILE = "source_model.json"  # model=hf: the digests of the folder's config files
_SOURCE_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model",
)  # fmt: skip


def source_record(folder: Path) -> dict[str, Any]:
    """The transformers folder a ``model=hf`` run started from: its path and the sha256 of
    each config and tokenizer file it has (the weights are in the run's checkpoints)."""
    files = {name: sha256_file(folder / name) for name in _SOURCE_FILES
             if (folder / name).is_file()}  # fmt: skip
    return {"path": str(folder), "sha256": files}


def write_source(model_cfg: Any, out_dir: Path) -> None:
    """Record the source folder of a new run of a transformers model (``model_cfg``, the
    run's model config) in ``out_dir/SOURCE_FILE``; nothing for moestack's own model."""
    if model_cfg.is_transformers:
        write_json(out_dir / SOURCE_FILE, source_record(Path(model_cfg.pretrained_path)))


def _changed_source_files(model_cfg: Any, out_dir: Path, fix: str) -> list[str]:
    """The config and tokenizer files of a ``model=hf`` run's source folder whose sha256
    differs from the run's record (``SOURCE_FILE``; added or removed ones too), sorted; none
    for moestack's own model or a run started before the record (a warning says so). A
    record that cannot be read is one MoestackError line ending in ``fix``."""
    recorded = out_dir / SOURCE_FILE
    if not model_cfg.is_transformers:
        return []
    if not recorded.is_file():
        log.warning("%s has no %s (started before it was recorded): the source folder %s is "
                    "not compared", out_dir, SOURCE_FILE, model_cfg.path)  # fmt: skip
        return []
    try:
        before = json.loads(recorded.read_text())["sha256"]
        if not isinstance(before, dict):
            raise TypeError("sha256 is not a mapping")
    except (OSError, ValueError, KeyError, TypeError):
        raise MoestackError(f"{recorded} cannot be read; {fix}") from None
    now = source_record(check_model_dir(model_cfg.path))["sha256"]  # a folder gone: one line
    return sorted(n for n in set(before) | set(now) if before.get(n) != now.get(n))


def check_resume_source(model_cfg: Any, out_dir: Path) -> None:
    """Refuse to resume a ``model=hf`` run whose source folder's config or tokenizer files
    changed since it started: the same shapes may hide another architecture or tokenizer."""
    changed = _changed_source_files(model_cfg, out_dir, "start a new out_dir")
    if changed:
        raise MoestackError(
            f"resume=true but {', '.join(changed)} in model.path={model_cfg.path} changed since "
            f"the run started ({out_dir / SOURCE_FILE}); resume with the folder as it was, or "
            "start a new out_dir"
        )


def check_run_source(model_cfg: Any, run_dir: Path) -> None:
    """Refuse to load (evaluate, export) a ``model=hf`` run whose source folder's config or
    tokenizer files changed since it trained: the run's checkpoints hold only its weights,
    the architecture, routing and tokenizer are read from that folder, so a change there
    (``norm_topk_prob`` flipped, another tokenizer) would give another model in silence."""
    changed = _changed_source_files(model_cfg, run_dir, "train the run again")
    if changed:
        raise MoestackError(
            f"{', '.join(changed)} in model.path={model_cfg.path} changed since the run "
            f"{run_dir} trained ({run_dir / SOURCE_FILE}); put the folder back as it was, or "
            "train a new run of the changed folder"
        )
