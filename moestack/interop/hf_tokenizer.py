"""A transformers model folder's own tokenizer, in the form moestack's corpus packing uses."""

from __future__ import annotations

from pathlib import Path

from moestack.data import Tokenizer
from moestack.errors import MoestackError


def hf_tokenizer(path: str | Path, separator: int) -> Tokenizer:
    """The tokenizer saved in ``path`` (offline), encoding without special tokens; documents
    are separated by ``separator`` (the model's EOS)."""
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

    def encode(texts: list[str]) -> list[list[int]]:
        return tokenizer(texts, add_special_tokens=False)["input_ids"]

    return Tokenizer(encode, separator)
