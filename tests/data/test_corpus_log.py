"""The corpus line counts a tokenizer's tokens as tokens, and bytes only where tokens are
bytes (it printed a BPE model's token count as MB)."""

from __future__ import annotations

import logging
import re

from moestack.config import DataConfig
from moestack.data import Tokenizer, load_corpus, split_size


def _write_docs(folder, count: int) -> int:
    """``count`` text files of 3 to 12 words each; returns the words in all."""
    folder.mkdir()
    words = 0
    for i in range(count):
        n = 3 + i % 10
        (folder / f"doc{i:03d}.txt").write_text(" ".join(f"w{i}x{j}" for j in range(n)))
        words += n
    return words


def _corpus_line(caplog) -> str:
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("corpus ")]
    assert len(lines) == 1, lines
    return lines[0]


def test_a_tokenizer_corpus_is_logged_in_tokens(tmp_path, caplog):
    words = _write_docs(tmp_path / "docs", 60)
    words_tokenizer = Tokenizer(encode=lambda texts: [[1] * len(t.split()) for t in texts],
                                separator=0)  # fmt: skip
    cfg = DataConfig(source="files", paths=[str(tmp_path / "docs")], val_fraction=0.2, seq_len=8)
    with caplog.at_level(logging.INFO, logger="moestack.data"):
        corpus = load_corpus(cfg, words_tokenizer)
    line = _corpus_line(caplog)
    counts = [int(n) for n in re.findall(r"/ (\d+) tokens", line)]
    # one token a word, one separator a document: counted here, not by the corpus
    assert sum(counts) == words + 60
    assert counts == [len(corpus.train), len(corpus.val)]
    assert "MB" not in line and "kB" not in line


def test_a_byte_corpus_is_logged_in_bytes(tmp_path, caplog):
    _write_docs(tmp_path / "docs", 60)
    cfg = DataConfig(source="files", paths=[str(tmp_path / "docs")], val_fraction=0.2, seq_len=8)
    with caplog.at_level(logging.INFO, logger="moestack.data"):
        corpus = load_corpus(cfg)
    line = _corpus_line(caplog)
    assert f"/ {len(corpus.train) / 1e3:.1f} kB, val" in line
    assert "tokens" not in line


def test_split_sizes_by_hand():
    assert split_size(29_100_000, tokenized=False) == "29.1 MB"
    assert split_size(41_200, tokenized=False) == "41.2 kB"
    assert split_size(1_234_567, tokenized=True) == "1.23M tokens"
    assert split_size(640, tokenized=True) == "640 tokens"
