"""A transformers model folder's own tokenizer, in the form moestack's corpus packing uses.

The tokenizer is probed as it is loaded: a folder without tokenizer files still loads (as an
empty tokenizer that encodes every text to no tokens), and training on it would train on
nothing. So ``load_tokenizer`` encodes a short fixed text and refuses, naming the folder, a
tokenizer that gives no tokens for it or whose decoding loses all of it. Training (the
corpus) and ``moestack eval`` (the corpus, ``--generate``) both load it here.

``tokenizer_files`` names the files a folder's tokenizer is read from (what an export
copies); their sha256, with config.json's (transformers may read the tokenizer's class from
it) and the tokenizer libraries' versions, is the tokenizer's identity
(``tokenizer_digest``), which keys the corpus's token cache (``moestack.interop.token_cache``).
"""

from __future__ import annotations

import hashlib
from importlib import metadata
from pathlib import Path
from typing import Any

from moestack.data import Tokenizer
from moestack.errors import MoestackError

PROBE = "The quick brown fox jumps over the lazy dog. 0123456789"
TOKENIZER_PATTERNS = (
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "*.model",
    "*.tiktoken",
    "chat_template*",
)  # the files of a model folder that its tokenizer may be read from


def tokenizer_files(folder: str | Path) -> list[str]:
    """The names of ``folder``'s tokenizer files (``TOKENIZER_PATTERNS``), sorted."""
    folder = Path(folder)
    return sorted(
        {f.name for pattern in TOKENIZER_PATTERNS for f in folder.glob(pattern) if f.is_file()}
    )


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "none"


def tokenizer_digest(folder: str | Path) -> str:
    """Hex sha256 naming what the tokenizer of ``folder`` computes: the name and sha256 of
    each tokenizer file and of config.json, and the transformers and tokenizers versions."""
    folder = Path(folder)
    names = tokenizer_files(folder) + (
        ["config.json"] if (folder / "config.json").is_file() else []
    )
    digest = hashlib.sha256()
    for package in ("transformers", "tokenizers"):
        digest.update(f"{package}=={_version(package)}\0".encode())
    for name in names:
        file_sha = hashlib.sha256((folder / name).read_bytes()).hexdigest()
        digest.update(f"{name}\0{file_sha}\0".encode())
    return digest.hexdigest()


def _refuse(path: str | Path, what: str) -> MoestackError:
    return MoestackError(
        f"{path}: its tokenizer {what} the probe text {PROBE!r}: the folder has no usable "
        "tokenizer; save the model's tokenizer files (tokenizer.json, tokenizer_config.json) "
        "into it"
    )


def check_tokenizer(tokenizer: Any, path: str | Path) -> None:
    """Refuse a tokenizer that encodes ``PROBE`` to no tokens, or whose decoding of them
    (special tokens skipped) keeps none of it."""
    ids = tokenizer(PROBE, add_special_tokens=False)["input_ids"]
    if not ids:
        raise _refuse(path, "encodes to no tokens")
    if not tokenizer.decode(ids, skip_special_tokens=True).strip():
        raise _refuse(path, "decodes to nothing")


def load_tokenizer(path: str | Path) -> Any:
    """The transformers tokenizer saved in ``path`` (offline), probed (``check_tokenizer``)."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise MoestackError(
            "transformers models need the transformers package: pip install 'moestack[hf]'"
        ) from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as err:
        raise MoestackError(
            f"{path}: no tokenizer could be loaded ({str(err).splitlines()[0]}); save the "
            "model's tokenizer files (tokenizer.json, tokenizer_config.json) into the folder"
        ) from None
    check_tokenizer(tokenizer, path)
    return tokenizer


def hf_tokenizer(path: str | Path, separator: int) -> Tokenizer:
    """The tokenizer saved in ``path`` (offline, probed), encoding without special tokens;
    documents are separated by ``separator`` (the model's EOS). Its ``digest``
    (``tokenizer_digest``) lets the corpus cache its ids."""
    tokenizer = load_tokenizer(path)

    def encode(texts: list[str]) -> list[list[int]]:
        return tokenizer(texts, add_special_tokens=False)["input_ids"]

    return Tokenizer(encode, separator, tokenizer_digest(path))
