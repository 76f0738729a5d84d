"""A transformers tokenizer's token ids of a corpus split, tokenised once and cached on disk.

Tokenising the default corpus (the standard library, about 30 MB of text) with a model's
own tokenizer takes tens of seconds, on every training run and every ``moestack eval``.
``cached_tokens`` keeps the packed ids of each split in a file named by a digest of what
determines them: the documents' bytes as they enter tokenisation, in order, and their split;
the tokenizer's identity (``Tokenizer.digest``: its files' sha256 and the tokenizer
libraries' versions); the separator token; and ``FORMAT``, the cache's own version. Any
change to one of them is another file, so a cache file is never stale; nothing is evicted
(delete the folder to clear it).

The folder is ``$MOESTACK_DATA_CACHE`` if set, else ``moestack/tokens`` under
``$XDG_CACHE_HOME`` when that is absolute, else under ``~/.cache``; it is created with mode
0o700 and used only while it belongs to this user and no one else can write it (else the
ids are computed without a cache, with one warning). A file is written whole (a temporary
file beside it, then renamed) and read only when the sha256 of its ids matches the one
recorded in it: a corrupt file is tokenised again and replaced, with a warning, never used.
Each split logs one line, a hit (its path, the tokens, the seconds to read) or a miss (the
documents tokenised, the seconds, where they were cached).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from moestack import atomic, user_cache

log = logging.getLogger(__name__)

FORMAT = 1  # moestack's token-cache format: part of every key; bump it when the ids change
ENV = "MOESTACK_DATA_CACHE"  # names the cache folder
_TENSOR = "ids"
_WARNED: set[str] = set()  # reasons a cache folder was refused, each warned of once


def cache_folder() -> Path:
    """The folder the environment names (:func:`moestack.user_cache.cache_folder`):
    ``$MOESTACK_DATA_CACHE``, else ``moestack/tokens`` under the user's cache."""
    return user_cache.cache_folder(ENV, "tokens")


def _usable_folder() -> tuple[Path | None, str]:
    """(the cache folder, "") made with mode 0o700 if missing, or (None, why not) when it
    cannot be made, is not a folder, or is not this user's alone
    (:func:`moestack.user_cache.private_folder`)."""
    try:
        folder = cache_folder()
    except user_cache.NotPrivate as err:
        return None, str(err)
    try:
        return user_cache.private_folder(folder), ""
    except user_cache.NotPrivate as err:
        return None, f"{folder}: {err}"


def corpus_key(
    documents: Sequence[bytes], tokenizer_digest: str, separator: int, split: str
) -> str:
    """Hex sha256 of what a split's ids depend on: the format, the tokenizer's digest, the
    separator, the split's name and every document's bytes in order (each preceded by its
    length, so documents never run together)."""
    digest = hashlib.sha256(
        f"moestack-tokens:{FORMAT}\0{tokenizer_digest}\0{separator}\0{split}\0".encode()
    )
    for doc in documents:
        digest.update(len(doc).to_bytes(8, "little"))
        digest.update(doc)
    return digest.hexdigest()


def _ids_sha256(ids: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(ids).tobytes()).hexdigest()


def read_ids(path: Path) -> np.ndarray:
    """The ids stored in ``path``; ValueError, saying why, unless the file is whole: its
    format is ``FORMAT`` and its ids have the sha256 recorded beside them."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
            ids = f.get_tensor(_TENSOR)
    except (SafetensorError, KeyError) as err:
        raise ValueError(f"unreadable ({type(err).__name__}: {err})") from None
    if meta.get("format") != str(FORMAT):
        raise ValueError(f"format {meta.get('format')!r}, not {FORMAT}")
    if ids.dtype != np.int32 or ids.ndim != 1:
        raise ValueError(f"holds {ids.dtype} {list(ids.shape)}, not int32 ids")
    if meta.get("sha256") != _ids_sha256(ids):
        raise ValueError("its ids do not match their recorded sha256")
    return ids


def write_ids(path: Path, ids: np.ndarray) -> None:
    """Store ``ids`` (int32) and their sha256 in ``path``, whole or not at all: a private
    temporary file beside it, fsynced, renamed over it."""
    from safetensors.numpy import save

    ids = np.ascontiguousarray(ids, dtype=np.int32)
    blob = save({_TENSOR: ids}, metadata={"format": str(FORMAT), "sha256": _ids_sha256(ids)})
    atomic.write_bytes(path, blob)


def cached_tokens(
    documents: Sequence[bytes],
    tokenizer_digest: str,
    separator: int,
    split: str,
    tokenise: Callable[[], np.ndarray],
) -> np.ndarray:
    """The ids of ``documents`` (one split): read from the cache when a whole file holds
    them, else ``tokenise()`` (and cached). Logs one line either way."""
    folder, why = _usable_folder()
    path = None
    if folder is not None:
        path = folder / f"{corpus_key(documents, tokenizer_digest, separator, split)}.safetensors"
        if path.is_file():
            start = time.perf_counter()
            try:
                ids = read_ids(path)
            except (OSError, ValueError) as err:
                log.warning("tokens: cache file %s is corrupt (%s): tokenising again", path, err)
            else:
                log.info(
                    "tokens: cache hit %s: %d tokens, read in %.2f s",
                    path, len(ids), time.perf_counter() - start,
                )  # fmt: skip
                return ids
    start = time.perf_counter()
    ids = tokenise()
    seconds = time.perf_counter() - start
    if path is None:
        where = "not cached"
        if why not in _WARNED:
            _WARNED.add(why)
            log.warning(
                "tokens: no token cache: %s; set %s to a folder only this user can write",
                why, ENV,
            )  # fmt: skip
    else:
        try:
            write_ids(path, ids)
            where = f"cached at {path}"
        except OSError as err:  # a full disk, say: the run goes on, tokenising next time too
            where = "not cached"
            log.warning("tokens: cannot write %s (%s): not cached", path, err.strerror or err)
    log.info(
        "tokens: tokenised %d %s documents in %.2f s; %s", len(documents), split, seconds, where
    )
    return ids
