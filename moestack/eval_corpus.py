"""The validation split of a run's corpus alone, for evaluation.

``moestack.data.load_corpus`` packs both splits; tokenising the training split with a
transformers tokenizer is most of its time (the standard library's 95%: about 77 of 105 s
on two cores, the first time), and evaluation never reads it. ``validation_tokens`` reads
the same documents (``DataConfig.documents``), splits them by the same rule (``data._split_documents``, and the chunked
fallback when a split would be empty) and packs only the validation split, through the same
token cache (``data._pack``): its ids are exactly ``load_corpus(...).val``.
"""

from __future__ import annotations

import logging

import numpy as np

from moestack import data
from moestack.config import TrainConfig
from moestack.errors import MoestackError

log = logging.getLogger(__name__)


def validation_tokens(cfg: TrainConfig) -> np.ndarray:
    """The validation split of ``cfg``'s corpus as its model reads text (bytes for
    moestack's models, the folder's tokenizer for ``model.path``), equal to
    ``runs.run_corpus(cfg).val`` without tokenising the training split. ``cfg`` is resolved
    (``TrainConfig.resolve``)."""
    tokenizer = cfg.model.tokenizer()
    documents, name = cfg.data.documents()
    packer, pending = data._split_documents(documents, cfg.data)
    chunked = not packer.both_filled()
    if chunked:  # load_corpus's fallback: split chunks of the documents
        if not pending:
            raise MoestackError(f"data: no text found in {name}; point data.paths at text files")
        empty = "training" if packer.parts["val"] else "validation"
        packer = data._split_chunks(pending, cfg.data, name, empty)
    parts = packer.parts["val"]
    val = data._pack(parts, tokenizer, "val")
    if len(val) < cfg.data.seq_len + 1:
        unit = "bytes" if tokenizer is None else "tokens"
        raise MoestackError(
            f"data: the validation split of {name} has {len(val)} {unit}, fewer than "
            f"data.seq_len+1={cfg.data.seq_len + 1}; add text or shorten data.seq_len"
        )
    log.info("corpus %s: val %d %s / %d tokens (the training split left untokenised)",
             name, len(parts), "chunks" if chunked else "docs", len(val))  # fmt: skip
    return val
