"""A transformers tokenizer's corpus is tokenised once: the second read of the same documents
with the same tokenizer is a cache hit (one log line, the tokenizer not called, the same ids
as the tokenizer's own), another document or tokenizer file is a miss, and a corrupt cache
file is tokenised again with a warning, never used."""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")

from helpers.hf import tiny_tokenizer  # noqa: E402

from moestack.config import DataConfig  # noqa: E402
from moestack.data import Tokenizer, load_corpus  # noqa: E402
from moestack.interop import token_cache  # noqa: E402
from moestack.interop.hf_tokenizer import hf_tokenizer  # noqa: E402

LOGGER = "moestack.interop.token_cache"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenizer folder (read-only: copy it to change it)."""
    folder = tmp_path_factory.mktemp("tok") / "tok"
    tiny_tokenizer(folder)
    return folder


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv(token_cache.ENV, str(folder))
    return folder


def _docs(folder: Path, texts: list[str]) -> DataConfig:
    folder.mkdir(parents=True, exist_ok=True)
    for i, text in enumerate(texts):
        (folder / f"doc{i:02d}.txt").write_text(text)
    return DataConfig(source="files", paths=[str(folder)], val_fraction=0.3, seq_len=8)


TEXTS = [f"def f{i}(x):\n    return x * {i}  # the quick brown fox {i}\n" * 3 for i in range(12)]


class Spy:
    """A tokenizer's encode that counts its calls."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.inner, self.calls = tokenizer, 0

    def encode(self, texts: list[str]) -> list[list[int]]:
        self.calls += 1
        return self.inner.encode(texts)

    def tokenizer(self) -> Tokenizer:
        return Tokenizer(self.encode, self.inner.separator, self.inner.digest)


def _expected(tok_dir: Path, corpus_docs: list[bytes], separator: int) -> np.ndarray:
    """The split as the transformers tokenizer itself encodes each document, plus the
    separator: the reference the cached ids must equal."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    ids = []
    for doc in corpus_docs:
        ids += hf(doc.decode(), add_special_tokens=False)["input_ids"] + [separator]
    return np.asarray(ids, dtype=np.int32)


def _split_docs(cfg: DataConfig, split: str) -> list[bytes]:
    """The documents of ``split``, as bytes (byte-level read: the separator is 0)."""
    corpus = load_corpus(cfg)
    return bytes(getattr(corpus, split)).split(b"\0")[:-1]


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_second_read_hits_the_cache_without_calling_the_tokenizer(tok_dir, cache, tmp_path, caplog):
    cfg = _docs(tmp_path / "docs", TEXTS)
    spy = Spy(hf_tokenizer(tok_dir, 0))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        first = load_corpus(cfg, spy.tokenizer())
    assert spy.calls > 0
    misses = _messages(caplog)
    assert len(misses) == 2 and all(m.startswith("tokens: tokenised ") for m in misses)
    assert all("; cached at " + str(cache) in m for m in misses)
    caplog.clear()
    spy.calls = 0
    with caplog.at_level(logging.INFO, logger=LOGGER):
        second = load_corpus(cfg, spy.tokenizer())
    assert spy.calls == 0  # every id read from the cache
    hits = _messages(caplog)
    assert len(hits) == 2 and all(m.startswith(f"tokens: cache hit {cache}") for m in hits)
    assert f": {len(second.train)} tokens, read in " in " ".join(hits)
    for split in ("train", "val"):
        reference = _expected(tok_dir, _split_docs(cfg, split), 0)
        assert np.array_equal(getattr(first, split), reference)
        assert np.array_equal(getattr(second, split), reference)
        assert getattr(second, split).dtype == np.int32
    assert stat.S_IMODE(os.stat(cache).st_mode) == 0o700


def test_a_changed_document_misses(tok_dir, cache, tmp_path, caplog):
    cfg = _docs(tmp_path / "docs", TEXTS)
    tok = hf_tokenizer(tok_dir, 0)
    load_corpus(cfg, tok)
    (tmp_path / "docs" / "doc03.txt").write_text(TEXTS[3] + "one more line\n")
    spy = Spy(tok)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        corpus = load_corpus(cfg, spy.tokenizer())
    lines = _messages(caplog)
    assert spy.calls > 0
    assert sum(m.startswith("tokens: tokenised ") for m in lines) == 1  # doc03's split
    assert sum(m.startswith("tokens: cache hit ") for m in lines) == 1  # the other one
    for split in ("train", "val"):
        reference = _expected(tok_dir, _split_docs(cfg, split), 0)
        assert np.array_equal(getattr(corpus, split), reference)


def test_a_changed_tokenizer_file_or_separator_misses(tok_dir, cache, tmp_path, caplog):
    cfg = _docs(tmp_path / "docs", TEXTS)
    load_corpus(cfg, hf_tokenizer(tok_dir, 0))
    other = tmp_path / "tok2"
    shutil.copytree(tok_dir, other)
    config_path = other / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["model_max_length"] = 12345  # the same ids, but another file: another key
    config_path.write_text(json.dumps(config))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        load_corpus(cfg, hf_tokenizer(other, 0))
        load_corpus(cfg, hf_tokenizer(tok_dir, 1))
    lines = _messages(caplog)
    assert len(lines) == 4 and all(m.startswith("tokens: tokenised ") for m in lines)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_corrupt_cache_file_is_rebuilt_with_a_warning(tok_dir, cache, tmp_path, caplog, damage):
    cfg = _docs(tmp_path / "docs", TEXTS)
    tok = hf_tokenizer(tok_dir, 0)
    clean = load_corpus(cfg, tok)
    files = sorted(cache.glob("*.safetensors"))
    assert len(files) == 2
    for path in files:
        data = bytearray(path.read_bytes())
        if damage == "flip":
            data[-3] ^= 0x55  # inside the ids: the header still parses
        else:
            data = data[: len(data) // 2]
        path.write_bytes(bytes(data))
    spy = Spy(tok)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        corpus = load_corpus(cfg, spy.tokenizer())
    assert spy.calls > 0
    warned = [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
    assert len(warned) == 2 and all("is corrupt" in r.getMessage() for r in warned)
    assert np.array_equal(corpus.train, clean.train) and np.array_equal(corpus.val, clean.val)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        load_corpus(cfg, tok)  # the rebuilt files are whole again
    assert all(m.startswith("tokens: cache hit ") for m in _messages(caplog))


def test_the_cache_folder_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(token_cache.ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert token_cache.cache_folder() == tmp_path / "xdg" / "moestack" / "tokens"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # invalid: ignored
    assert token_cache.cache_folder() == tmp_path / "home" / ".cache" / "moestack" / "tokens"
    monkeypatch.setenv(token_cache.ENV, str(tmp_path / "mine"))
    assert token_cache.cache_folder() == tmp_path / "mine"


def test_a_folder_others_can_write_is_not_used(tok_dir, cache, tmp_path, caplog):
    cache.mkdir(mode=0o700)
    os.chmod(cache, 0o777)
    cfg = _docs(tmp_path / "docs", TEXTS)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        corpus = load_corpus(cfg, hf_tokenizer(tok_dir, 0))
    assert not list(cache.iterdir())
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("writable by group or others" in m for m in warned)
    assert np.array_equal(corpus.val, _expected(tok_dir, _split_docs(cfg, "val"), 0))


def test_byte_level_corpora_are_not_cached(cache, tmp_path):
    load_corpus(_docs(tmp_path / "docs", TEXTS))
    assert not cache.exists()
