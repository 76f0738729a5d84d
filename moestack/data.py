"""Text corpora as byte-level tokens, split into train and validation, and a seeded loader.

Documents are byte strings joined by a 0 byte (the document separator; 0 bytes inside a
document are dropped). A document goes to validation when a hash of its name (its path
relative to the corpus root, or ``path:row`` for jsonl/parquet rows) falls below
``val_fraction``, so the split is the same on every machine and never mixes one file into
both sides. The default corpus is the Python standard library of the running interpreter:
real code and docstrings, on every machine, with no network.

Only when that whole-document split leaves a side empty (a corpus of one big file, or of a
few files that all hash to one side) are the documents cut into chunks and the chunks split
instead: a document of ``L`` bytes becomes ``ceil(L / CHUNK_BYTES)`` pieces of about equal
size (at most ``CHUNK_BYTES`` = 64 KiB), each cut after the last newline in the second half
of its window when there is one, named ``<doc name>#<chunk index>``. The
``round(val_fraction * chunks)`` chunks whose names hash lowest (at least one, at most all
but one) go to validation, so any corpus of two chunks or more has both splits, every byte
lands in exactly one of them, and the split is still the same on every machine. A corpus
that splits by document (the standard library does) is never chunked.

``data.max_bytes`` (0 = no cap) caps the corpus in whole documents, not in bytes: documents
are read in order, and each goes to its split while that split holds fewer bytes than its
share of the cap (training ``max_bytes * (1 - val_fraction)``, validation ``max_bytes *
val_fraction``; a document counts its bytes and one separator). The document that reaches a
split's share is kept whole, so a split may exceed its share by up to one document (a chunk,
when the corpus is chunked) and the corpus the cap by up to two; a document for a full split
is skipped, and reading stops once both are full. With a cap small beside the documents the
splits' shares can differ much from ``val_fraction``: ``max_bytes=100`` keeps one file of
the standard library for each split (8355 bytes with Python 3.11's, 38% in validation).
With a tokenizer the cap counts the text's bytes, before tokenising.

Records whose text is null or not a string are skipped, with one warning per file giving
the count; a file without one usable record is refused. Text files (by suffix, or without
one) whose content is binary (a 0 byte in the first 8 KiB, or most of it not UTF-8) are
skipped with a warning when found in a folder and refused when named in ``data.paths``: a
``.txt`` name does not make a file text.

``DataConfig`` (the ``data`` section of a run's config) sits here beside the corpus it
describes, and builds it (``DataConfig.build``).

With a model's own tokenizer (``Tokenizer``: transformers models) each split is its token
ids instead, the separator the model's EOS; a tokenizer with a ``digest`` has them cached on
disk, keyed by the documents, the split and the tokenizer (``moestack.interop.token_cache``),
so the corpus is tokenised once, not on every run.

Batches are windows of ``seq_len + 1`` tokens at random offsets drawn from a generator
seeded by ``(seed, batch index)``: batch i is the same whatever happened before it, so the
loader's whole state is the index of the next batch, and a resumed run sees the same data.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import sysconfig
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from moestack.checks import check
from moestack.errors import MoestackError
from moestack.metrics import human_count

log = logging.getLogger(__name__)

SEPARATOR = 0  # byte that separates documents in the packed token stream
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".c", ".h", ".json", ".csv", ".html", ".tex")
RECORD_SUFFIXES = (".jsonl", ".parquet")
CHUNK_BYTES = 64 * 1024  # largest chunk when documents must be cut to fill both splits
BINARY_PROBE = 8192  # bytes of a text file inspected for binary content
DATA_SOURCES = ("stdlib", "files", "hf")  # data.source


@dataclass
class DataConfig:
    """Where training text comes from and how it is cut into sequences."""

    source: str = "stdlib"  # "stdlib" (Python's own library), "files" (paths), "hf" (a hub dataset)
    paths: list[str] = field(default_factory=list)  # source=files: .txt/.py/.md, .jsonl, .parquet
    text_field: str = "text"  # jsonl/parquet/hf: the column holding the text
    hf_name: str = ""  # source=hf: dataset name, e.g. "roneneldan/TinyStories" (needs network)
    hf_split: str = "train"  # source=hf: split to read
    val_fraction: float = 0.05  # share of documents (by hash of their name) held out
    seq_len: int = 256  # tokens per training sequence
    # cap on the corpus in whole documents (0 = all of it): each split takes documents until
    # it holds its share (validation val_fraction of it), its last document kept whole
    max_bytes: int = 0

    def __post_init__(self) -> None:
        check(
            self.source in DATA_SOURCES,
            f"data.source={self.source!r} is unknown; use one of {DATA_SOURCES}",
        )
        check(
            self.source != "files" or len(self.paths) > 0,
            "data.source=files needs data.paths=[...] (text, jsonl or parquet files or folders)",
        )
        check(
            self.source != "hf" or bool(self.hf_name),
            "data.source=hf needs data.hf_name=<dataset>",
        )
        check(0 < self.val_fraction < 1, f"data.val_fraction={self.val_fraction} not in (0, 1)")
        check(self.seq_len >= 2, f"data.seq_len={self.seq_len} must be >= 2")
        check(self.max_bytes >= 0, f"data.max_bytes={self.max_bytes} must be >= 0")

    def build(self, tokenizer: Tokenizer | None = None) -> Corpus:
        """The corpus this section describes, both splits packed (``load_corpus``): bytes,
        or ``tokenizer``'s ids (a model's own, ``ModelConfig.tokenizer``)."""
        return load_corpus(self, tokenizer)

    def documents(self) -> tuple[Iterator[tuple[str, bytes]], str]:
        """The configured documents, ``(name, bytes)`` in reading order, and the corpus's
        name: the one reading rule of ``load_corpus`` and the validation split alone
        (``moestack.eval_corpus``)."""
        if self.source == "stdlib":
            return stdlib_documents(), f"stdlib:{stdlib_root()}"
        if self.source == "files":
            return _file_documents(list(self.paths), self.text_field), ",".join(self.paths)
        return _hf_documents(self), f"hf:{self.hf_name}"


@dataclass
class Corpus:
    """Packed byte tokens of the two splits and how many documents each holds."""

    train: np.ndarray  # uint8 [N_train] bytes, or int32 token ids with a tokenizer
    val: np.ndarray  # uint8 [N_val], or int32
    train_docs: int  # documents (chunks, when chunked) in train: its separator count
    val_docs: int
    name: str
    chunked: bool = False  # split by chunk of document rather than by whole document


def _hash_fraction(name: str) -> float:
    digest = hashlib.sha256(name.encode("utf-8", "surrogateescape")).digest()
    return int.from_bytes(digest[:8], "little") / 2**64


def is_validation(name: str, val_fraction: float) -> bool:
    """Deterministic split: a document is held out when its name hashes below the fraction."""
    return _hash_fraction(name) < val_fraction


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_documents() -> Iterator[tuple[str, bytes]]:
    """The standard library's .py files as (path relative to its root, bytes), in a fixed order."""
    root = stdlib_root()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        for filename in sorted(filenames):
            if filename.endswith(".py"):
                path = Path(dirpath) / filename
                yield str(path.relative_to(root)), path.read_bytes()


def _expand(paths: list[str]) -> list[tuple[Path, Path, bool]]:
    """(root, file, named in data.paths) for every file named or readable under a folder."""
    found, other = [], []
    for entry in paths:
        path = Path(entry).expanduser()
        if not path.exists():
            raise MoestackError(
                f"data.paths: {entry} does not exist; give text, jsonl or parquet files or folders"
            )
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
            readable = TEXT_SUFFIXES + RECORD_SUFFIXES + ("",)
            found.extend((path, f, False) for f in files if f.suffix.lower() in readable)
            other.extend(f for f in files if f.suffix.lower() not in readable)
        else:
            found.append((path.parent, path, True))
    if other:
        examples = ", ".join(str(p) for p in other[:3])
        log.warning(
            "data: skipped %d files under data.paths whose suffix is not text, jsonl or "
            "parquet (e.g. %s)", len(other), examples,
        )  # fmt: skip
    return found


def _looks_binary(data: bytes) -> bool:
    """A 0 byte in the first BINARY_PROBE bytes, or most of them not decoding as UTF-8."""
    head = data[:BINARY_PROBE]
    if b"\0" in head:
        return True
    text = head.decode("utf-8", "replace")
    return len(text) > 0 and text.count("\ufffd") > 0.3 * len(text)


def _file_documents(paths: list[str], text_field: str) -> Iterator[tuple[str, bytes]]:
    for root, path, named in _expand(paths):
        name = str(path.relative_to(root))
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            yield from _text_records(path, _jsonl_rows(path, name, text_field), text_field)
        elif suffix == ".parquet":
            yield from _text_records(path, _parquet_rows(path, name, text_field), text_field)
        else:
            data = path.read_bytes()
            if _looks_binary(data):  # a text suffix does not make a file text
                if named:
                    raise MoestackError(
                        f"data.paths: {path} is binary, not text; remove it from data.paths "
                        "(text, jsonl or parquet files or folders)"
                    )
                log.warning("data: skipped %s: binary content, not text", path)
                continue
            yield name, data


def _text_records(
    source: object, rows: Iterable[tuple[str, object]], text_field: str
) -> Iterator[tuple[str, bytes]]:
    """The string values of rows; null or non-string ones are counted and skipped."""
    usable = skipped = 0
    try:
        for doc_name, value in rows:
            if isinstance(value, str):
                usable += 1
                yield doc_name, value.encode("utf-8", "replace")
            else:
                skipped += 1
        if skipped and not usable:
            raise MoestackError(
                f"{source}: none of its {skipped} records has a string {text_field!r} (all "
                "null or not text); fix the data or set data.text_field to the text column"
            )
    finally:  # also when reading stops early (data.max_bytes)
        if skipped and usable:
            log.warning(
                "%s: skipped %d of %d records whose %r is null or not a string",
                source, skipped, skipped + usable, text_field,
            )  # fmt: skip


def _jsonl_rows(path: Path, name: str, text_field: str) -> Iterator[tuple[str, object]]:
    with path.open("rb") as f:
        for row, line in enumerate(f):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise MoestackError(f"{path}:{row + 1}: not valid JSON ({err.msg})") from None
            if not isinstance(record, dict) or text_field not in record:
                raise MoestackError(
                    f"{path}:{row + 1}: no field {text_field!r}; set data.text_field"
                )
            yield f"{name}:{row}", record[text_field]


def _parquet_rows(path: Path, name: str, text_field: str) -> Iterator[tuple[str, object]]:
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
        yield f"{name}:{row}", text


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
    rows = ((f"{row}", record[cfg.text_field]) for row, record in enumerate(dataset))
    yield from _text_records(f"data.hf_name={cfg.hf_name}", rows, cfg.text_field)


class _Packer:
    """The two splits being filled; with data.max_bytes each takes whole documents until it
    holds its share of the cap (the last one kept whole: it may overshoot by one document)."""

    def __init__(self, cfg: DataConfig) -> None:
        self.parts: dict[str, list[bytes]] = {"train": [], "val": []}
        self.used = {"train": 0, "val": 0}
        self.budget = {
            "train": cfg.max_bytes * (1 - cfg.val_fraction),
            "val": cfg.max_bytes * cfg.val_fraction,
        }
        self.capped = cfg.max_bytes > 0

    def full(self, split: str) -> bool:
        return self.capped and self.used[split] >= self.budget[split]

    def add(self, split: str, text: bytes) -> None:
        # A full split skips later documents, so a small budget still yields a validation split.
        if not self.full(split):
            self.parts[split].append(text)
            self.used[split] += len(text) + 1

    def both_filled(self) -> bool:
        return bool(self.parts["train"]) and bool(self.parts["val"])


def _chunks(text: bytes, limit: int = CHUNK_BYTES) -> list[bytes]:
    """ceil(len / limit) pieces of about equal size, each cut after a newline where possible."""
    size = math.ceil(len(text) / math.ceil(len(text) / limit))
    pieces, start = [], 0
    while len(text) - start > size:
        end = text.rfind(b"\n", start + size // 2, start + size) + 1 or start + size
        pieces.append(text[start:end])
        start = end
    pieces.append(text[start:])
    return pieces


def _split_documents(
    documents: Iterator[tuple[str, bytes]], cfg: DataConfig
) -> tuple[_Packer, list[tuple[str, bytes]]]:
    """Whole documents split by name; also every document read while one side was empty."""
    packer = _Packer(cfg)
    pending: list[tuple[str, bytes]] = []  # kept for chunking until both splits have text
    try:
        for doc_name, text in documents:
            if packer.full("train") and packer.full("val"):
                break
            text = text.replace(b"\0", b"")
            if not text.strip():
                continue
            packer.add("val" if is_validation(doc_name, cfg.val_fraction) else "train", text)
            if not packer.both_filled():
                pending.append((doc_name, text))
            elif pending:
                pending = []
    finally:  # a generator stopped early still reports what it skipped
        getattr(documents, "close", lambda: None)()
    return packer, pending


def _split_chunks(
    documents: list[tuple[str, bytes]], cfg: DataConfig, name: str, empty: str
) -> _Packer:
    """Chunks of the documents, the lowest-hashing share of them to validation."""
    chunks = [(f"{doc}#{i}", c) for doc, text in documents for i, c in enumerate(_chunks(text))]
    if len(chunks) < 2:
        size = sum(len(text) for _, text in documents)
        raise MoestackError(
            f"data: {name} holds {size} bytes of text in one document, too little for both a "
            f"training and a validation split (documents are cut into chunks of up to "
            f"{CHUNK_BYTES // 1024} KiB when needed); add text or documents to data.paths"
        )
    by_hash = sorted(range(len(chunks)), key=lambda i: (_hash_fraction(chunks[i][0]), i))
    count = min(max(round(cfg.val_fraction * len(chunks)), 1), len(chunks) - 1)
    held_out = set(by_hash[:count])
    log.warning(
        "data: split by document, %s leaves the %s split empty; cut its %d document(s) into %d "
        "chunks of up to %d KiB and split those (%d to validation)",
        name, empty, len(documents), len(chunks), CHUNK_BYTES // 1024, count,
    )  # fmt: skip
    packer = _Packer(cfg)
    for i, (_, chunk) in enumerate(chunks):
        packer.add("val" if i in held_out else "train", chunk)
    return packer


@dataclass(frozen=True)
class Tokenizer:
    """A model's own tokenizer, as the corpus needs it (byte tokens when there is none)."""

    encode: Callable[[list[str]], list[list[int]]]  # texts -> token ids, no special tokens
    separator: int  # the token that ends a document (the model's EOS)
    # what the tokenizer computes (moestack.interop.hf_tokenizer.tokenizer_digest): with one,
    # a split's ids are cached on disk (moestack.interop.token_cache); "" = never cached
    digest: str = ""


TOKENIZE_BATCH = 64  # documents encoded per call: small id lists, a progress bar that moves


def _tokenise(documents: list[bytes], tokenizer: Tokenizer, split: str) -> np.ndarray:
    """``documents`` as ``tokenizer``'s ids (int32), each followed by the separator, with a
    progress bar over their bytes (shown on a terminal only)."""
    from tqdm.auto import tqdm

    pieces = []
    total = sum(len(d) for d in documents)
    with tqdm(
        total=total, unit="B", unit_scale=True, desc=f"tokenising {split}", disable=None,
        leave=False,
    ) as bar:  # fmt: skip
        for start in range(0, len(documents), TOKENIZE_BATCH):
            batch = documents[start : start + TOKENIZE_BATCH]
            texts = [d.decode("utf-8", "replace") for d in batch]
            for ids in tokenizer.encode(texts):
                pieces.append(np.asarray([*ids, tokenizer.separator], dtype=np.int32))
            bar.update(sum(len(d) for d in batch))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)


def _pack(documents: list[bytes], tokenizer: Tokenizer | None, split: str) -> np.ndarray:
    """One split as one token array, each document followed by the separator: bytes
    (uint8, separator 0) by default, the tokenizer's ids (int32) when one is given, read
    from the token cache when the tokenizer has a digest and the cache holds them."""
    if tokenizer is None:
        sep = bytes([SEPARATOR])
        return np.frombuffer(bytearray(sep.join(documents) + sep), dtype=np.uint8)
    if not tokenizer.digest:
        return _tokenise(documents, tokenizer, split)
    from moestack.interop.token_cache import cached_tokens

    return cached_tokens(
        documents, tokenizer.digest, tokenizer.separator, split,
        lambda: _tokenise(documents, tokenizer, split),
    )  # fmt: skip


def split_size(tokens: int, tokenized: bool) -> str:
    """A split's size for the corpus line: its token count where a tokenizer made the tokens
    (``7.41M tokens``: a token is no byte), its bytes where the tokens are bytes (``29.1 MB``)."""
    if tokenized:
        return f"{human_count(tokens)} tokens"
    return f"{tokens / 1e6:.1f} MB" if tokens >= 100_000 else f"{tokens / 1e3:.1f} kB"


def load_corpus(cfg: DataConfig, tokenizer: Tokenizer | None = None) -> Corpus:
    """Read the configured documents and pack each split into one token array: bytes by
    default, or ``tokenizer``'s ids with its separator between documents."""
    documents, name = cfg.documents()
    packer, pending = _split_documents(documents, cfg)
    chunked = not packer.both_filled()
    if chunked:
        if not pending:
            raise MoestackError(f"data: no text found in {name}; point data.paths at text files")
        empty = "training" if packer.parts["val"] else "validation"
        packer = _split_chunks(pending, cfg, name, empty)
    parts = packer.parts
    train = _pack(parts["train"], tokenizer, "train")
    val = _pack(parts["val"], tokenizer, "val")
    unit = "bytes" if tokenizer is None else "tokens"
    for split, tokens in (("training", train), ("validation", val)):
        if len(tokens) < cfg.seq_len + 1:
            raise MoestackError(
                f"data: the {split} split of {name} has {len(tokens)} {unit}, fewer than "
                f"data.seq_len+1={cfg.seq_len + 1}; add text or shorten data.seq_len"
            )
    pieces = "chunks" if chunked else "docs"
    log.info(
        "corpus %s: train %d %s / %s, val %d %s / %s",
        name, len(parts["train"]), pieces, split_size(len(train), tokenizer is not None),
        len(parts["val"]), pieces, split_size(len(val), tokenizer is not None),
    )  # fmt: skip
    return Corpus(train, val, len(parts["train"]), len(parts["val"]), name, chunked)


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
