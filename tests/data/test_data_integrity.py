"""Issue 13 for data loading: no record trained on as "None", no binary file read as text,
one big file usable, and the default corpus exactly as before."""

import hashlib
import json
import logging
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from helpers.paths import REPO

from moestack.config import DataConfig
from moestack.data import CHUNK_BYTES, SEPARATOR, is_validation, load_corpus, stdlib_root
from moestack.errors import MoestackError

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta"]  # no "None" in any of them
BEFORE_ISSUE_13 = "54a1a75"  # the commit whose moestack/data.py the default corpus must match


def _text(rng, words):
    return " ".join(rng.choice(WORDS, size=words))


def _lines(rng, count):
    return "".join(_text(rng, int(rng.integers(1, 16))) + "\n" for _ in range(count))


def _pieces(tokens):
    return bytes(tokens).split(bytes([SEPARATOR]))[:-1]


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


# --- 1. null or non-string text --------------------------------------------------------------


def test_null_jsonl_text_is_skipped_with_one_warning(tmp_path, caplog):
    rng = np.random.default_rng(13)
    values = [_text(rng, 60) for _ in range(40)] + [None] * 7 + [12, ["x"], {"a": 1}]
    order = rng.permutation(len(values))
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps({"text": values[i]}) + "\n" for i in order))
    with caplog.at_level(logging.WARNING, logger="moestack.data"):
        corpus = load_corpus(
            DataConfig(source="files", paths=[str(path)], val_fraction=0.2, seq_len=16)
        )
    tokens = bytes(corpus.train) + bytes(corpus.val)
    assert b"None" not in tokens and b"12" not in tokens
    assert corpus.train_docs + corpus.val_docs == 40
    warned = [m for m in _warnings(caplog) if "mixed.jsonl" in m]
    assert len(warned) == 1 and "10 of 50" in warned[0]


def test_null_parquet_text_is_skipped(tmp_path, caplog):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rng = np.random.default_rng(14)
    rows = [_text(rng, 50) if rng.random() < 0.7 else None for _ in range(60)]
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"body": rows}), path)
    cfg = DataConfig(
        source="files", paths=[str(path)], text_field="body", val_fraction=0.25, seq_len=16
    )
    with caplog.at_level(logging.WARNING, logger="moestack.data"):
        corpus = load_corpus(cfg)
    assert b"None" not in bytes(corpus.train) + bytes(corpus.val)
    usable = sum(r is not None for r in rows)
    assert corpus.train_docs + corpus.val_docs == usable
    assert [m for m in _warnings(caplog) if f"{60 - usable} of 60" in m]


def test_file_without_usable_record_is_refused(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"text": f"line {i} " * 30}) + "\n" for i in range(30)))
    bad = tmp_path / "nulls.jsonl"
    bad.write_text('{"text": null}\n{"text": 3}\n')
    cfg = DataConfig(source="files", paths=[str(good), str(bad)], val_fraction=0.2, seq_len=16)
    with pytest.raises(MoestackError, match="nulls.jsonl") as err:
        load_corpus(cfg)
    assert "\n" not in str(err.value) and "data.text_field" in str(err.value)


# --- 2. binary files ---------------------------------------------------------------------------


def _binary_files(folder, rng):
    elf = b"\x7fELF\x02\x01\x01\x00" + rng.integers(0, 256, 4000, dtype=np.uint8).tobytes()
    high = rng.integers(0x80, 0x100, 4000, dtype=np.uint8).tobytes()  # no 0 byte, not UTF-8
    (folder / "a.out").write_bytes(elf)  # suffix ".out": not a text suffix, skipped by name
    (folder / "tool").write_bytes(elf)
    (folder / "blob").write_bytes(high)
    (folder / "libx.so").write_bytes(elf)
    (folder / "model.txt").write_bytes(elf)  # a text suffix on binary content: still binary


def test_binary_files_in_a_folder_are_skipped_with_a_warning(tmp_path, caplog):
    rng = np.random.default_rng(15)
    folder = tmp_path / "data"
    folder.mkdir()
    for i in range(30):
        (folder / f"doc{i:02d}.txt").write_text(_lines(rng, 20))
    (folder / "README").write_text(_lines(rng, 20))  # suffix-less text is still read
    cfg = DataConfig(source="files", paths=[str(folder)], val_fraction=0.2, seq_len=16)
    clean = load_corpus(cfg)
    _binary_files(folder, rng)
    with caplog.at_level(logging.WARNING, logger="moestack.data"):
        corpus = load_corpus(cfg)
    assert np.array_equal(corpus.train, clean.train) and np.array_equal(corpus.val, clean.val)
    assert clean.train_docs + clean.val_docs == 31
    warned = " ".join(_warnings(caplog))
    assert all(name in warned for name in ("tool", "blob", "model.txt")) and "binary" in warned
    assert "libx.so" in warned or "a.out" in warned  # the suffix summary names examples


@pytest.mark.parametrize("name", ["tool", "blob", "model.txt"])
def test_named_binary_file_is_refused(tmp_path, name):
    rng = np.random.default_rng(16)
    folder, stray = tmp_path / "texts", tmp_path / "stray"
    folder.mkdir()
    stray.mkdir()
    for i in range(30):
        (folder / f"doc{i:02d}.txt").write_text(_lines(rng, 20))
    _binary_files(stray, rng)
    cfg = DataConfig(source="files", paths=[str(folder), str(stray / name)], seq_len=16)
    with pytest.raises(MoestackError) as err:
        load_corpus(cfg)
    message = str(err.value)
    assert str(stray / name) in message and "\n" not in message
    assert "binary" in message.replace(str(tmp_path), "")


# --- 3. one big file ---------------------------------------------------------------------------


def _assert_partition(data, corpus):
    """Every byte of data in exactly one split: data is an interleaving of the two splits'
    pieces, in order, each piece a contiguous run."""
    train, val = _pieces(corpus.train), _pieces(corpus.val)
    i = j = pos = 0
    while pos < len(data):
        if i < len(train) and data.startswith(train[i], pos):
            pos, i = pos + len(train[i]), i + 1
        elif j < len(val) and data.startswith(val[j], pos):
            pos, j = pos + len(val[j]), j + 1
        else:
            raise AssertionError(f"byte {pos} of the file is in neither split")
    assert (i, j) == (len(train), len(val))


@pytest.mark.parametrize("val_fraction", [0.01, 0.05, 0.5, 0.99])
def test_one_big_file_gives_both_splits(tmp_path, val_fraction, caplog):
    rng = np.random.default_rng(17)
    path = tmp_path / "book.txt"
    path.write_text(_lines(rng, 30_000))
    data = path.read_bytes()
    cfg = DataConfig(source="files", paths=[str(path)], val_fraction=val_fraction, seq_len=64)
    with caplog.at_level(logging.WARNING, logger="moestack.data"):
        corpus = load_corpus(cfg)
    assert corpus.chunked and corpus.train_docs > 0 and corpus.val_docs > 0
    assert any("chunks" in m for m in _warnings(caplog))
    _assert_partition(data, corpus)
    pieces = _pieces(corpus.train) + _pieces(corpus.val)
    assert max(len(p) for p in pieces) <= CHUNK_BYTES
    assert sum(p.endswith(b"\n") for p in pieces) >= len(pieces) - 1  # cut at newlines
    again = load_corpus(cfg)
    assert np.array_equal(again.train, corpus.train) and np.array_equal(again.val, corpus.val)


def test_big_file_with_max_bytes_keeps_both_splits(tmp_path):
    rng = np.random.default_rng(18)
    path = tmp_path / "book.txt"
    path.write_text(_lines(rng, 30_000))
    corpus = load_corpus(
        DataConfig(source="files", paths=[str(path)], max_bytes=300_000, seq_len=64)
    )
    assert corpus.train_docs > 0 and corpus.val_docs > 0
    assert len(corpus.train) + len(corpus.val) < 300_000 + 2 * CHUNK_BYTES


def test_few_files_on_one_side_are_chunked(tmp_path):
    rng = np.random.default_rng(19)
    names = [f"n{i}.txt" for i in range(40) if not is_validation(f"n{i}.txt", 0.02)][:3]
    for name in names:
        (tmp_path / name).write_text(_lines(rng, 100))
    corpus = load_corpus(DataConfig(source="files", paths=[str(tmp_path)], val_fraction=0.02))
    assert corpus.chunked and (corpus.train_docs, corpus.val_docs) == (2, 1)


def test_too_little_text_gives_one_actionable_error(tmp_path):
    path = tmp_path / "one.txt"
    path.write_text("x" * 500)
    messages = set()
    for val_fraction in (0.01, 0.99):  # the file lands on either side: the same advice
        with pytest.raises(MoestackError) as err:
            load_corpus(
                DataConfig(source="files", paths=[str(path)], val_fraction=val_fraction, seq_len=16)
            )
        messages.add(str(err.value))
    assert len(messages) == 1
    (message,) = messages
    assert "val_fraction" not in message and "add text" in message and str(path) in message


# --- 4. the default corpus is unchanged ---------------------------------------------------------


def _reference_stdlib(val_fraction):
    """The whole-document split of the standard library, written out independently."""
    root = stdlib_root()
    parts = {True: [], False: []}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        for filename in sorted(f for f in filenames if f.endswith(".py")):
            path = Path(dirpath) / filename
            name = str(path.relative_to(root))
            text = path.read_bytes().replace(b"\0", b"")
            if text.strip():
                digest = hashlib.sha256(name.encode("utf-8", "surrogateescape")).digest()
                parts[int.from_bytes(digest[:8], "little") / 2**64 < val_fraction].append(text)
    return b"\0".join(parts[False]) + b"\0", b"\0".join(parts[True]) + b"\0"


def test_default_corpus_is_the_whole_document_split():
    corpus = load_corpus(DataConfig())
    train, val = _reference_stdlib(DataConfig().val_fraction)
    assert not corpus.chunked
    assert corpus.train.tobytes() == train and corpus.val.tobytes() == val


def _original_data_module():
    try:
        source = subprocess.run(
            ["git", "show", f"{BEFORE_ISSUE_13}:moestack/data.py"],
            cwd=REPO, capture_output=True, check=True, text=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        pytest.skip(f"git or commit {BEFORE_ISSUE_13} not available")
    module = types.ModuleType("moestack_data_before_issue_13")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    try:
        exec(compile(source, "data_before_issue_13.py", "exec"), module.__dict__)
    finally:
        del sys.modules[module.__name__]
    return module


@pytest.mark.parametrize(
    "cfg",
    [DataConfig(), DataConfig(seq_len=32, max_bytes=1_000_000)],
    ids=["default", "max_bytes"],
)
def test_default_corpus_matches_the_original_implementation(cfg):
    original = _original_data_module().load_corpus(cfg)
    corpus = load_corpus(cfg)
    assert np.array_equal(corpus.train, original.train)
    assert np.array_equal(corpus.val, original.val)
    assert (corpus.train_docs, corpus.val_docs) == (original.train_docs, original.val_docs)


def test_folder_corpus_matches_the_original_implementation(tmp_path):
    rng = np.random.default_rng(20)
    for i in range(50):
        (tmp_path / f"doc{i:02d}.md").write_text(_lines(rng, int(rng.integers(5, 400))))
    cfg = DataConfig(source="files", paths=[str(tmp_path)], val_fraction=0.2, seq_len=32)
    original = _original_data_module().load_corpus(cfg)
    corpus = load_corpus(cfg)
    assert np.array_equal(corpus.train, original.train)
    assert np.array_equal(corpus.val, original.val)


def test_a_tokenizer_packs_ids_with_its_separator(tmp_path):
    from moestack.data import Tokenizer

    (tmp_path / "a.txt").write_text("hello world " * 40)
    (tmp_path / "b.txt").write_text("héllo again " * 40)
    vocab: dict[str, int] = {}

    def encode(texts):  # a word-level tokenizer, ids in order of first sight
        return [[vocab.setdefault(w, len(vocab) + 1) for w in t.split()] for t in texts]

    cfg = DataConfig(source="files", paths=[str(tmp_path)], seq_len=8, val_fraction=0.5)
    corpus = load_corpus(cfg, Tokenizer(encode, separator=0))
    assert corpus.train.dtype == np.int32 and corpus.val.dtype == np.int32
    both = np.concatenate([corpus.train, corpus.val])
    assert sorted(np.flatnonzero(both == 0) + 1)[-1] == len(both)  # each doc ends with 0
    assert (both == 0).sum() == 2 and len(both) == 2 * 80 + 2
    assert set(both.tolist()) == {0, vocab["hello"], vocab["world"], vocab["héllo"], vocab["again"]}
