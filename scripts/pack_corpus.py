"""Write this interpreter's standard-library corpus (``data=stdlib``) as one jsonl file, so a
study can train on the same bytes on another machine (``data=files data.paths=[FILE]``).

The standard library differs between Python versions, so ``data=stdlib`` on a GPU machine
with another interpreter is another corpus. Packed once here, the file (about 35 MB for
Python 3.11: under the 64 MiB a run can bring to a lent GPU machine) is the corpus wherever
it goes: one row ``{"name": <path in the stdlib>, "text": <its text>}`` per file, in
``moestack.data.stdlib_documents``'s order, bytes that are not UTF-8 replaced by U+FFFD.
Validation then goes by a hash of ``FILE:row`` (moestack.data), fixed by the file. Prints
the file's sha256 and size, to state in the study that trains on it.

    python scripts/pack_corpus.py corpus/stdlib.jsonl
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

from moestack import atomic
from moestack.data import stdlib_documents


def pack(out: Path) -> tuple[int, int]:
    """Write the corpus to ``out`` (atomically: a stopped run leaves no partial file);
    (rows, bytes)."""
    lines = [
        json.dumps({"name": name, "text": data.decode("utf-8", "replace")}, ensure_ascii=False)
        for name, data in stdlib_documents()
    ]
    payload = ("\n".join(lines) + "\n").encode("utf-8")
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_bytes(out, payload)
    return len(lines), len(payload)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="the jsonl file to write (e.g. corpus/stdlib.jsonl)")
    args = parser.parse_args()
    out = Path(args.out)
    rows, size = pack(out)
    print(
        f"{out}: {rows} files of the Python {platform.python_version()} standard library "
        f"({sys.implementation.name}), {size:,} bytes, sha256 {atomic.sha256_file(out)}"
    )


if __name__ == "__main__":
    main()
