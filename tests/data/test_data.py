"""Corpus split, packing and the seeded loader."""

import json

import numpy as np
import pytest

from moestack.config import DataConfig
from moestack.data import SEPARATOR, BatchLoader, eval_batches, is_validation, load_corpus
from moestack.errors import MoestackError


def _write_docs(folder, count, size=400):
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        words = rng.choice(["alpha", "beta", "gamma", "delta"], size=size // 5)
        (folder / f"doc{i:03d}.txt").write_text(" ".join(words))
    return folder


def test_split_is_deterministic_and_by_name():
    names = [f"pkg/mod{i}.py" for i in range(2000)]
    first = [is_validation(n, 0.1) for n in names]
    assert first == [is_validation(n, 0.1) for n in names]
    assert 0.07 < sum(first) / len(first) < 0.13


def test_files_corpus_packs_documents_with_separators(tmp_path):
    docs = _write_docs(tmp_path / "docs", 60)
    cfg = DataConfig(source="files", paths=[str(docs)], val_fraction=0.2, seq_len=32)
    corpus = load_corpus(cfg)
    assert corpus.train_docs + corpus.val_docs == 60
    assert corpus.val_docs > 0
    assert (corpus.train == SEPARATOR).sum() == corpus.train_docs
    # Same split on a second read.
    again = load_corpus(cfg)
    assert np.array_equal(again.train, corpus.train) and np.array_equal(again.val, corpus.val)
    # Every validation document is whole and absent from train.
    val_docs = bytes(corpus.val).split(b"\0")[:-1]
    train_docs = set(bytes(corpus.train).split(b"\0")[:-1])
    assert all(doc not in train_docs for doc in val_docs)


def test_jsonl_records_are_documents(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(
        "".join(json.dumps({"text": f"record number {i} " * 20}) + "\n" for i in range(50))
    )
    corpus = load_corpus(
        DataConfig(source="files", paths=[str(path)], val_fraction=0.2, seq_len=16)
    )
    assert corpus.train_docs + corpus.val_docs == 50


def test_parquet_records_are_documents(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"body": [f"row {i} " * 30 for i in range(40)]}), path)
    corpus = load_corpus(
        DataConfig(
            source="files", paths=[str(path)], text_field="body", val_fraction=0.25, seq_len=16
        )
    )
    assert corpus.train_docs + corpus.val_docs == 40


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda p: str(p / "missing"), "does not exist"),
        (lambda p: (p / "empty").mkdir() or str(p / "empty"), "no text found"),
        (
            lambda p: (p / "one.txt").write_text("x" * 500) and str(p / "one.txt"),
            "validation split",
        ),
        (
            lambda p: (p / "bad.jsonl").write_text("{not json\n") and str(p / "bad.jsonl"),
            "not valid JSON",
        ),
    ],
)
def test_bad_data_paths_give_clear_errors(tmp_path, setup, message):
    path = setup(tmp_path)
    with pytest.raises(MoestackError, match=message):
        load_corpus(DataConfig(source="files", paths=[path], val_fraction=0.01, seq_len=16))


def test_loader_batches_depend_only_on_seed_and_index():
    tokens = np.random.default_rng(1).integers(0, 256, 5000).astype(np.uint8)
    a, b = BatchLoader(tokens, 4, 32, seed=7), BatchLoader(tokens, 4, 32, seed=7)
    for _ in range(3):
        a.next()
    b.load_state_dict(a.state_dict())
    x_a, y_a = a.next()
    x_b, y_b = b.next()
    assert (x_a == x_b).all() and (y_a == y_b).all()
    assert (x_a[:, 1:] == y_a[:, :-1]).all()  # targets are inputs shifted by one
    other = BatchLoader(tokens, 4, 32, seed=8).get(3)
    assert not (other[0] == x_a).all()


def test_eval_batches_are_fixed_and_in_range():
    tokens = np.arange(1000, dtype=np.int64) % 256
    batches = eval_batches(tokens.astype(np.uint8), 2, 10, 3)
    assert len(batches) == 3 and batches[0][0].shape == (2, 10)
    again = eval_batches(tokens.astype(np.uint8), 2, 10, 3)
    assert all((a[0] == b[0]).all() for a, b in zip(batches, again, strict=True))
