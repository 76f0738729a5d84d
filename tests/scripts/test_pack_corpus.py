"""scripts/pack_corpus.py: a corpus packed as jsonl reads back, through data=files, as the
same documents (bytes that are not UTF-8 as U+FFFD), each one whole on one side."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from helpers.paths import SCRIPTS

from moestack.config import DataConfig
from moestack.data import load_corpus

DOCS = [
    ("a.py", b"import os\nprint('x')\n"),
    ("pkg/b.py", b'"""doc\\ with "quotes" and \\\\ backslashes"""\n'),
    ("pkg/c.py", b"latin1 \xe9 byte\n"),
    ("d.py", "r\u00e9sum\u00e9 = 1  # UTF-8\n".encode()),
] + [(f"many/{i}.py", f"x_{i} = {i * i}\n".encode()) for i in range(40)]


def test_packed_corpus_reads_back_as_its_documents(tmp_path: Path, monkeypatch) -> None:
    spec = importlib.util.spec_from_file_location("pack_corpus", SCRIPTS / "pack_corpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "stdlib_documents", lambda: iter(DOCS))
    out = tmp_path / "corpus" / "stdlib.jsonl"
    rows, size = module.pack(out)
    assert (rows, size) == (len(DOCS), out.stat().st_size)
    names = [json.loads(line)["name"] for line in out.read_text().splitlines()]
    assert names == [name for name, _ in DOCS]
    corpus = load_corpus(DataConfig(source="files", paths=[str(out)], val_fraction=0.1, seq_len=8))
    want = sorted(text.decode("utf-8", "replace").encode() for _, text in DOCS)
    got = [bytes(d) for part in (corpus.train, corpus.val) for d in part.tobytes().split(b"\0")]
    assert sorted(d for d in got if d) == want
    assert corpus.train_docs + corpus.val_docs == len(DOCS) and corpus.val_docs > 0
    assert not corpus.chunked
