"""Text corpora as byte-level tokens, split into train and validation, and a seeded loader.

Documents are byte strings joined by a 0 byte (the document separator; 0 bytes inside a
document are dropped). A document goes to validation when a hash of its name (its path
relative to the corpus root, or ``path:row`` for jsonl/parquet rows) falls below
``val_fraction``, so the split is the same on every machine and never mixes one file into
both sides. The default corpus is the Python standard library of the running interpreter:
real code and docstrings, on every machine, with no network.

Batches are windows of ``seq_len + 1`` tokens at random offsets drawn from a generator
seeded by ``(seed, batch index)``: batch i is the same whatever happened before it, so the
loader's whole state is the index of the next batch, and a resumed run sees the same data.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from moestack.config import DataConfig
from moestack.errors import MoestackError

log = logging.getLogger(__name__)

SEPARATOR = 0  # byte that separates documents in the packed token stream
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".c", ".h", ".json", ".csv", ".html", ".tex")


@dataclass
class Corpus:
    """Packed byte tokens of the two splits and how many documents each holds."""

    train: np.ndarray  # uint8 [N_train]
    val: np.ndarray  # uint8 [N_val]
    train_docs: int
    val_docs: int
    name: str


def is_validation(name: str, val_fraction: float) -> bool:
    """Deterministic split: a document is held out when its name hashes below the fraction."""
    digest = hashlib.sha256(name.encode("utf-8", "surrogateescape")).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < val_fraction


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_documents() -> Iterator[tuple[str, bytes]]:
    root = stdlib_root()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        for filename in sorted(filenames):
            if filename.endswith(".py"):
                path = Path(dirpath) / filename
                yield str(path.relative_to(root)), path.read_bytes()


def _expand(paths: list[str]) -> list[tuple[Path, Path]]:
    """(root, file) pairs for every file named or found under a named folder."""
    found = []
    for entry in paths:
        path = Path(entry).expanduser()
        if not path.exists():
            raise MoestackError(
                f"data.paths: {entry} does not exist; give text, jsonl or parquet files or folders"
            )
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
            found.extend((path, f) for f in files)
        else:
            found.append((path.parent, path))
    return found


def _file_documents(paths: list[str], text_field: str) -> Iterator[tuple[str, bytes]]:
    for root, path in _expand(paths):
        name = str(path.relative_to(root))
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            with path.open("rb") as f:
                for row, line in enumerate(f):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as err:
                        raise MoestackError(
                            f"{path}:{row + 1}: not valid JSON ({err.msg})"
                        ) from None
                    if not isinstance(record, dict) or text_field not in record:
                        raise MoestackError(
                            f"{path}:{row + 1}: no field {text_field!r}; set data.text_field"
                        )
                    yield f"{name}:{row}", str(record[text_field]).encode("utf-8")
        elif suffix == ".parquet":
            yield from _parquet_documents(path, name, text_field)
        elif suffix in TEXT_SUFFIXES or suffix == "":
            yield name, path.read_bytes()


def _parquet_documents(path: Path, name: str, text_field: str) -> Iterator[tuple[str, bytes]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise MoestackError(
            f"{path}: reading parquet needs pyarrow (pip install pyarrow)"
        ) from None
    try:
        table = pq.read_table(path, columns=[text_field])
    except Exception as err:  # pyarrow raises several types for bad files and columns
        raise MoestackError(f"{path}: cannot read column {text_field!r} ({err})") from None
    for row, text in enumerate(table.column(text_field).to_pylist()):
        if text:
            yield f"{name}:{row}", str(text).encode("utf-8")


def _hf_documents(cfg: DataConfig) -> Iterator[tuple[str, bytes]]:
    try:
        import datasets
    except ImportError:
        raise MoestackError(
            "data.source=hf needs the datasets package (pip install moestack[hf])"
        ) from None
    try:
        dataset = datasets.load_dataset(cfg.hf_name, split=cfg.hf_split)
    except Exception as err:  # network, missing dataset, bad split
        raise MoestackError(f"data.hf_name={cfg.hf_name!r}: cannot load ({err})") from None
    if cfg.text_field not in dataset.column_names:
        raise MoestackError(f"data.text_field={cfg.text_field!r} is not a column of {cfg.hf_name}")
    for row, record in enumerate(dataset):
        yield f"{row}", str(record[cfg.text_field]).encode("utf-8")


def load_corpus(cfg: DataConfig) -> Corpus:
    """Read the configured documents and pack each split into one byte array."""
    if cfg.source == "stdlib":
        documents, name = _stdlib_documents(), f"stdlib:{stdlib_root()}"
    elif cfg.source == "files":
        documents, name = _file_documents(list(cfg.paths), cfg.text_field), ",".join(cfg.paths)
    else:
        documents, name = _hf_documents(cfg), f"hf:{cfg.hf_name}"
    parts: dict[str, list[bytes]] = {"train": [], "val": []}
    # With max_bytes, each split fills its share of the budget; later documents of a full
    # split are skipped, so a small budget still yields a validation split.
    budget = {
        "train": cfg.max_bytes * (1 - cfg.val_fraction),
        "val": cfg.max_bytes * cfg.val_fraction,
    }
    used = {"train": 0, "val": 0}
    for doc_name, text in documents:
        split = "val" if is_validation(doc_name, cfg.val_fraction) else "train"
        if cfg.max_bytes and used[split] >= budget[split]:
            if all(used[k] >= budget[k] for k in used):
                break
            continue
        text = text.replace(b"\0", b"")
        if not text.strip():
            continue
        parts[split].append(text)
        used[split] += len(text) + 1
    if not parts["train"] and not parts["val"]:
        raise MoestackError(f"data: no text found in {name}; point data.paths at text files")
    if not parts["val"]:
        raise MoestackError(
            f"data: the validation split of {name} is empty ({len(parts['train'])} documents); "
            "add documents or raise data.val_fraction"
        )
    if not parts["train"]:
        raise MoestackError(f"data: the training split of {name} is empty; lower data.val_fraction")
    sep = bytes([SEPARATOR])
    train = np.frombuffer(bytearray(sep.join(parts["train"]) + sep), dtype=np.uint8)
    val = np.frombuffer(bytearray(sep.join(parts["val"]) + sep), dtype=np.uint8)
    for split, tokens in (("training", train), ("validation", val)):
        if len(tokens) < cfg.seq_len + 1:
            raise MoestackError(
                f"data: the {split} split of {name} has {len(tokens)} bytes, fewer than "
                f"data.seq_len+1={cfg.seq_len + 1}; add text or shorten data.seq_len"
            )
    log.info(
        "corpus %s: train %d docs / %.1f MB, val %d docs / %.1f MB",
        name, len(parts["train"]), len(train) / 1e6, len(parts["val"]), len(val) / 1e6,
    )  # fmt: skip
    return Corpus(train, val, len(parts["train"]), len(parts["val"]), name)


class BatchLoader:
    """Random windows of a token array; batch ``i`` depends only on ``(seed, i)``."""

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int) -> None:
        if len(tokens) < seq_len + 1:
            raise MoestackError(f"{len(tokens)} tokens cannot fill one sequence of {seq_len}")
        self.tokens = torch.from_numpy(np.asarray(tokens))
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.position = 0  # index of the next batch

    def get(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each int64 [batch_size, seq_len]."""
        rng = np.random.default_rng([self.seed, index])
        starts = rng.integers(0, len(self.tokens) - self.seq_len, size=self.batch_size)
        offsets = torch.from_numpy(starts)[:, None] + torch.arange(self.seq_len + 1)
        window = self.tokens[offsets].long()
        return window[:, :-1], window[:, 1:]

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.get(self.position)
        self.position += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])
        self.seed = int(state["seed"])


def eval_batches(
    tokens: np.ndarray, batch_size: int, seq_len: int, num_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed validation batches: evenly spaced windows covering the split, same every call."""
    tokens_t = torch.from_numpy(np.asarray(tokens))
    count = batch_size * num_batches
    last_start = len(tokens_t) - seq_len - 1
    starts = torch.linspace(0, max(last_start, 0), count).long()
    window = tokens_t[starts[:, None] + torch.arange(seq_len + 1)].long()
    batches = window.view(num_batches, batch_size, seq_len + 1)
    return [(b[:, :-1], b[:, 1:]) for b in batches]
