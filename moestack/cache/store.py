"""ExpertStore: every expert's weights as safetensors on disk, readable one expert at a time.

The directory layout, the index and the single-file helpers are in
``moestack.cache.store_format``; the index's structure is checked by
``moestack.cache.store_schema``. ``ExpertStore(path)`` checks the index's structure, that
every file it names stays inside the store folder, and every file's size and safetensors
header against the index before serving anything; the first time each file is opened its
checksum is verified (once per file per store, so a flipped byte is never served silently).
``load(layer, expert)`` reads one expert's byte range only, with positional reads on file
descriptors opened once. ``open_or_write_store`` reuses a valid store written from the same
weights, else rewrites it.

Writing is atomic: files go into a temporary sibling directory, each is fsynced and its
checksum recorded, the index is written last, and the directory is renamed into place; on
any error (a full disk included) the temporary directory is removed, so nothing
half-written looks like a store. Only a missing or empty folder or an existing store is
ever replaced: anything else given as the store folder (a run folder) is refused untouched.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import nn

from moestack.atomic import install_dir, recover_dir, temp_dir
from moestack.cache.store_format import (
    CHECKSUM,
    DTYPES,
    INDEX_FILE,
    LAYOUTS,
    ExpertEntry,
    TensorEntry,  # noqa: F401  (re-exported: importable from moestack.cache.store as before)
    check_layer,
    check_replaceable,
    entry_from_json,
    expert_json,
    expert_tensors,
    fd_digest,
    index_json,
    layer_files,
    parse_header,
    pread_exact,
)
from moestack.cache.store_format import digest as _digest

# Every byte the store writes goes through this module's ``_write_file`` (tests patch it here
# to simulate a full disk).
from moestack.cache.store_format import write_file as _write_file
from moestack.cache.store_schema import check_index, header_matches, member_path
from moestack.errors import MoestackError
from moestack.model import ModelConfig

log = logging.getLogger(__name__)

_CHUNK = 1 << 20  # larger experts are read as parallel chunks of this size


def _save_tensors(
    root: Path, name: str, tensors: dict[str, torch.Tensor]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Write one safetensors file at ``root / name``: its ``files`` record (with the
    checksum of the bytes written) and its header."""
    blob = safetensors.torch.save(tensors, metadata={"format": "pt"})
    start, header = parse_header(root / name, blob)
    (root / name).parent.mkdir(exist_ok=True)
    _write_file(root / name, blob)
    record = {"file": name, "size": len(blob), "data_start": start, CHECKSUM: _digest(blob)}
    return record, header


def _write_layer(
    root: Path,
    layer: int,
    w1: torch.Tensor,
    w2: torch.Tensor,
    layout: str,
    files: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    """Write one layer's safetensors files (records appended to ``files``); return its
    experts' index entries. Holds no view of the layer once it returns."""
    row: list[dict[str, Any]] = []
    for name, tensors, prefixes in layer_files(layer, w1.to("cpu"), w2.to("cpu"), layout):
        record, header = _save_tensors(root, name, tensors)
        files.append(record)
        row.extend(expert_json(name, header, record["data_start"], p) for p in prefixes)
    return row


class ExpertStore:
    """Read-only view of an expert store directory; ``load(layer, expert)`` reads one expert.

    ``model_cfg`` (optional) is checked against the store's model shape. Loads are positional
    reads on file descriptors opened once, so one store is safe to share between threads.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        model_cfg: ModelConfig | None = None,
        *,
        read_workers: int = 8,
        verify_loads: bool = False,
    ) -> None:
        """``verify_loads=True`` checks every ``load`` against its file's checksum (the
        ``per_expert`` layout only, where a file is one expert: a byte flipped on disk after
        the store was opened is refused at the next load of it); by default each file is
        verified once, the first time it is read."""
        self.path = Path(path)
        self._read_workers = max(1, int(read_workers))
        self._pool: ThreadPoolExecutor | None = None
        self._nowait = hasattr(os, "RWF_NOWAIT")
        self._fds: dict[str, int] = {}
        self._fd_lock = threading.Lock()
        self._open_locks: dict[str, threading.Lock] = {}  # one per file: first open verifies
        index = self._read_index()
        self.index = index
        model = index["model"]
        self.version: int = index["version"]
        self.layout: str = index["layout"]
        self.num_layers: int = model["num_layers"]
        self.num_experts: int = model["num_experts"]
        self.d_model: int = model["d_model"]
        self.d_ff: int = model["d_ff"]
        self.top_k: int | None = model.get("top_k")
        self.dtype: torch.dtype = DTYPES[model["dtype"]]
        self.meta: dict[str, Any] = dict(index.get("meta", {}))
        self.expert_bytes: int = index["expert_bytes"]
        self._entries: list[list[ExpertEntry]] = [
            [entry_from_json(e) for e in layer] for layer in index["experts"]
        ]
        # file name -> expected checksum; a name leaves the dict once its file is verified
        self._unverified: dict[str, str] = {
            f["file"]: f[CHECKSUM] for f in index["files"] if CHECKSUM in f
        }
        if self.version < 2:
            log.warning(
                "expert store %s is format version %d, which has no checksums: its files are "
                "read unverified; rebuild it (delete it and rerun `moestack eval RUN "
                "--offload`) to get checksums",
                self.path,
                self.version,
            )
            self._unverified.clear()
        self._verify_files()
        if model_cfg is not None:
            self.check_model(model_cfg)
        # file name -> (checksum, bytes before the expert's data) where every load is checked
        self._per_load: dict[str, tuple[str, int]] = {}
        if verify_loads:
            self._per_load = self._per_load_checks()
            self._unverified.clear()  # each load hashes its whole file: no first-open pass

    def _per_load_checks(self) -> dict[str, tuple[str, int]]:
        """What ``load`` checks each file against with ``verify_loads``; refused in one line
        where a file holds more than its expert (``per_layer``: a load would hash the
        layer)."""
        if self.layout != "per_expert":
            raise MoestackError(
                f"expert store {self.path} is {self.layout}: checking every load needs one "
                "expert per file; rewrite it with ExpertStore.write(..., layout='per_expert')"
            )
        return {
            f["file"]: (f[CHECKSUM], f["data_start"]) for f in self.index["files"] if CHECKSUM in f
        }

    def _read_index(self) -> dict[str, Any]:
        """The parsed index, its structure checked (``store_schema.check_index``)."""
        index_path = self.path / INDEX_FILE
        if not self.path.is_dir():
            raise MoestackError(
                f"expert store {self.path} does not exist; write it with ExpertStore.write"
            )
        try:
            index = json.loads(index_path.read_text())
        except FileNotFoundError:
            raise MoestackError(
                f"{index_path} is missing: {self.path} is not a complete expert store; "
                "rewrite it with ExpertStore.write"
            ) from None
        except (ValueError, OSError, RecursionError) as err:  # JSONDecodeError, UnicodeDecodeError
            raise MoestackError(
                f"{index_path} is not valid JSON ({type(err).__name__}): the store is corrupt; "
                f"delete {self.path} and rebuild it (rerun `moestack eval RUN --offload`)"
            ) from None
        return check_index(index, index_path)

    # ------------------------------------------------------------------ writing
    @classmethod
    def write(
        cls,
        model_or_state_dict: nn.Module | Mapping[str, torch.Tensor],
        path: str | os.PathLike[str],
        layout: str = "per_expert",  # cold loads: 97% of a sequential read vs 72-76% per layer
        *,
        model_cfg: ModelConfig | None = None,
        meta: Mapping[str, Any] | None = None,
        overwrite: bool = False,
    ) -> ExpertStore:
        """Write every expert of a MoETransformer (or its state_dict) to ``path`` atomically.

        ``model_cfg`` records top_k (taken from the model when it is a MoETransformer);
        ``meta`` is free-form JSON kept in the index (e.g. the source checkpoint). ``path``
        may be missing or an empty folder; an existing store is replaced only with
        ``overwrite=True``, and a folder that is not a store is never replaced.
        """
        w1s, w2s, cfg = expert_tensors(model_or_state_dict)
        return cls.write_layers(
            zip(w1s, w2s, strict=True), path, layout, model_cfg=model_cfg or cfg, meta=meta,
            overwrite=overwrite,
        )  # fmt: skip

    @classmethod
    def write_layers(
        cls,
        layers: Iterable[tuple[torch.Tensor, torch.Tensor]],
        path: str | os.PathLike[str],
        layout: str = "per_expert",
        *,
        model_cfg: ModelConfig | None = None,
        meta: Mapping[str, Any] | None = None,
        overwrite: bool = False,
    ) -> ExpertStore:
        """Write a store from ``(w1 [E, D, 2F], w2 [E, F, D])`` per MoE layer, taken one layer
        at a time (a generator keeps only one layer in memory: a model larger than memory
        can be stored from its checkpoint files), atomically, like ``write``."""
        if layout not in LAYOUTS:
            raise ValueError(f"layout={layout!r} is unknown; use one of {LAYOUTS}")
        path = Path(path)
        recover_dir(path)  # what a writer killed midway left beside it
        check_replaceable(path, overwrite)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = temp_dir(path)
        try:
            index = cls._write_files(tmp, layers, layout, model_cfg, dict(meta or {}))
            _write_file(tmp / INDEX_FILE, json.dumps(index, indent=1).encode())
            install_dir(tmp, path)
        except OSError as err:
            shutil.rmtree(tmp, ignore_errors=True)
            if err.errno == errno.ENOSPC:
                raise MoestackError(
                    f"disk full while writing the expert store {path}; nothing was kept: free "
                    "space or choose another store_dir"
                ) from err
            raise
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log.info(
            "wrote expert store %s (%d layers, layout %s)",
            path,
            index["model"]["num_layers"],
            layout,
        )
        return cls(path)

    @staticmethod
    def _write_files(
        root: Path,
        layers: Iterable[tuple[torch.Tensor, torch.Tensor]],
        layout: str,
        cfg: ModelConfig | None,
        meta: dict[str, Any],
    ) -> dict[str, Any]:
        """Write every layer's safetensors files under ``root``; return the index to write."""
        files: list[dict[str, Any]] = []
        experts: list[list[dict[str, Any]]] = []
        first: torch.Tensor | None = None
        for layer, (w1, w2) in enumerate(layers):
            if first is None:  # shape and dtype only: no layer is kept past its turn
                first = torch.empty_like(w1, device="meta")
            if w1.shape != first.shape or w1.dtype != first.dtype:
                raise MoestackError(
                    f"layer {layer}: w1 {tuple(w1.shape)} {w1.dtype} differs from layer 0's; "
                    "every MoE layer must have the same expert shape"
                )
            check_layer(layer, w1, w2)
            experts.append(_write_layer(root, layer, w1, w2, layout, files))
            del w1, w2  # a generator's layer is freed before it makes the next one
        if first is None:
            raise MoestackError("no MoE layer to store: the model has no expert weights")
        return index_json(layout, [first] * len(experts), cfg, meta, files, experts)

    # ------------------------------------------------------------------ checking
    def _verify_files(self) -> None:
        """Each file exists, has the indexed size, and its header matches the index."""
        want_w1 = (self.d_model, 2 * self.d_ff)
        want_w2 = (self.d_ff, self.d_model)
        by_file: dict[str, list[tuple[int, int, ExpertEntry]]] = {}
        for layer, row in enumerate(self._entries):
            for e, entry in enumerate(row):
                by_file.setdefault(entry.file, []).append((layer, e, entry))
                if entry.w1.shape != want_w1 or entry.w2.shape != want_w2:
                    raise MoestackError(
                        f"{self.path / INDEX_FILE}: layer {layer} expert {e} has shapes "
                        f"{entry.w1.shape} / {entry.w2.shape}, expected {want_w1} / {want_w2}"
                    )
        for f in self.index["files"]:
            file = member_path(self.path, f["file"], self.path / INDEX_FILE)
            try:
                size = file.stat().st_size
            except FileNotFoundError:
                raise MoestackError(
                    f"expert file {file} is missing; rewrite the store with ExpertStore.write"
                ) from None
            if size != f["size"]:
                raise MoestackError(
                    f"expert file {file} is {size} bytes, the index says {f['size']}: it is "
                    "truncated or was replaced; rewrite the store with ExpertStore.write"
                )
            start, header = parse_header(file)
            if start != f["data_start"]:
                raise MoestackError(f"{file}: header size differs from the index; corrupt store")
            for layer, e, entry in by_file.pop(f["file"], []):
                prefix = f"e{e:04d}." if self.layout == "per_layer" else ""
                for t, te in (("w1", entry.w1), ("w2", entry.w2)):
                    h = header.get(prefix + t)
                    if not header_matches(h, te, start):
                        raise MoestackError(
                            f"{file}: tensor {prefix + t} (layer {layer}, expert {e}) does not "
                            f"match the index (header {h}); the store is corrupt: rewrite it"
                        )
                if entry.w2.offset != entry.w1.offset + entry.w1.nbytes:
                    raise MoestackError(f"{file}: w1 and w2 of expert {e} are not adjacent")
        if by_file:
            raise MoestackError(
                f"{self.path / INDEX_FILE} names files not listed in 'files': {sorted(by_file)}"
            )

    def check_model(self, model_cfg: ModelConfig) -> None:
        """Refuse a store written for another model shape, naming the differing field."""
        pairs = (
            ("model.n_layers", self.num_layers, model_cfg.n_layers),
            ("model.moe.num_experts", self.num_experts, model_cfg.moe.num_experts),
            ("model.d_model", self.d_model, model_cfg.d_model),
            ("model.moe.d_ff", self.d_ff, model_cfg.moe.d_ff),
        )
        for field, stored, current in pairs:
            if stored != current:
                raise MoestackError(
                    f"expert store {self.path} was written for {field}={stored}, this model has "
                    f"{current}; rewrite the store from this model (ExpertStore.write)"
                )

    # ------------------------------------------------------------------ reading
    def entry(self, layer: int, expert: int) -> ExpertEntry:
        """Index entry of one expert; ValueError for an out-of-range id."""
        if not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(
                f"layer={layer!r} out of range: the store has {self.num_layers} layers"
            )
        if not isinstance(expert, int) or not 0 <= expert < self.num_experts:
            raise ValueError(
                f"expert={expert!r} out of range: the store has {self.num_experts} experts per layer"
            )
        return self._entries[layer][expert]

    def files(self) -> list[Path]:
        """Every data file of the store (for page-cache control in benchmarks)."""
        return [self.path / f["file"] for f in self.index["files"]]

    def _fd(self, name: str) -> int:
        """The descriptor of store file ``name``, opened once; the first open of each file
        verifies its checksum (once per file per store: later loads only read)."""
        fd = self._fds.get(name)
        if fd is not None:
            return fd
        with self._fd_lock:
            lock = self._open_locks.setdefault(name, threading.Lock())
        with lock:  # per file, so verifying one file does not hold up opening the others
            fd = self._fds.get(name)
            if fd is None:
                fd = self._open_verified(name)
                with self._fd_lock:
                    self._fds[name] = fd
        return fd

    def _open_verified(self, name: str) -> int:
        """Open ``name`` read-only and, if not yet done, check its bytes against the index's
        checksum; MoestackError naming the file and the rebuild otherwise."""
        path = self.path / name
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise MoestackError(f"expert file {path} is missing; rewrite the store") from None
        want = self._unverified.get(name)
        if want is None:
            return fd
        try:
            got = fd_digest(fd, os.fstat(fd).st_size, path)
        except BaseException:
            os.close(fd)
            raise
        if got != want:
            os.close(fd)
            raise MoestackError(
                f"expert file {path} fails its checksum ({CHECKSUM} {got[:16]}..., the index "
                f"says {want[:16]}...): its bytes changed on disk; rebuild the store: delete "
                f"{self.path} and rerun `moestack eval RUN --offload` (or ExpertStore.write)"
            )
        self._unverified.pop(name, None)
        return fd

    def load(self, layer: int, expert: int, *, pin_memory: bool = False) -> dict[str, torch.Tensor]:
        """``{"w1": [D, 2F], "w2": [F, D]}`` of one expert: positional reads of its byte
        range only (one read; larger experts as parallel 1 MiB chunks).

        ``pin_memory`` reads into page-locked host memory (fast, async copies to a GPU).
        """
        entry = self.entry(layer, expert)
        buf = torch.empty(entry.nbytes, dtype=torch.uint8, pin_memory=pin_memory)
        view = memoryview(buf.numpy())
        fd = self._fd(entry.file)
        path = self.path / entry.file
        offset = entry.w1.offset
        done = 0
        if entry.nbytes > _CHUNK and self._read_workers > 1:
            done = self._read_cached(fd, view, offset)  # warm: one copy from the page cache
        if done < entry.nbytes:
            chunks = [
                (lo, min(lo + _CHUNK, entry.nbytes)) for lo in range(done, entry.nbytes, _CHUNK)
            ]
            if len(chunks) > 1 and self._read_workers > 1:
                # Several reads in flight: a cold expert reads at the device's sequential speed.
                pool = self._reader_pool()
                futures = [
                    pool.submit(pread_exact, fd, view[lo:hi], offset + lo, path)
                    for lo, hi in chunks
                ]
                for fut in futures:
                    fut.result()
            else:
                pread_exact(fd, view[done:], offset + done, path)
        if entry.file in self._per_load:
            self._check_load(fd, entry, buf, path)
        split = entry.w1.nbytes
        return {
            "w1": buf[:split].view(entry.w1.dtype).view(entry.w1.shape),
            "w2": buf[split:].view(entry.w2.dtype).view(entry.w2.shape),
        }

    def _check_load(self, fd: int, entry: ExpertEntry, buf: torch.Tensor, path: Path) -> None:
        """The file's header, read again, and the expert's bytes just read hash to the
        file's checksum (a per_expert file is exactly those); MoestackError naming the file
        otherwise."""
        want, start = self._per_load[entry.file]
        header = bytearray(start)
        pread_exact(fd, memoryview(header), 0, path)
        h = hashlib.blake2b(header, digest_size=32)
        h.update(memoryview(buf.numpy()))  # hashlib releases the GIL on large buffers
        got = h.hexdigest()
        if got != want or start + entry.nbytes != os.fstat(fd).st_size:
            raise MoestackError(
                f"expert file {path} fails its checksum at this load ({CHECKSUM} {got[:16]}..., "
                f"the index says {want[:16]}...): its bytes changed on disk; rebuild the store: "
                f"delete {self.path} and rerun (or ExpertStore.write)"
            )

    def _read_cached(self, fd: int, view: memoryview, offset: int) -> int:
        """Bytes read without waiting for the disk (RWF_NOWAIT: only what is in the page
        cache); 0 where the flag is unsupported."""
        if not self._nowait:
            return 0
        try:
            return max(0, os.preadv(fd, [view], offset, os.RWF_NOWAIT))
        except BlockingIOError:
            return 0
        except OSError:  # EOPNOTSUPP / EINVAL: the filesystem does not support it
            self._nowait = False
            return 0

    def _reader_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            with self._fd_lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(
                        self._read_workers, thread_name_prefix="expert-read"
                    )
        return self._pool

    def close(self) -> None:
        """Close the open file descriptors and reader threads (loads reopen on demand)."""
        with self._fd_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __enter__(self) -> ExpertStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown
            self.close()

    def __repr__(self) -> str:
        return (
            f"ExpertStore({str(self.path)!r}, layers={self.num_layers}, experts={self.num_experts}, "
            f"layout={self.layout!r}, expert_bytes={self.expert_bytes})"
        )


def open_or_write_store(
    model: nn.Module,
    path: str | os.PathLike[str],
    model_cfg: ModelConfig,
    *,
    source: str = "",
    layout: str = "per_expert",
    layers: Iterable[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> ExpertStore:
    """The store at ``path`` if it is valid and was written from ``source``; else (re)write it,
    from ``model``'s experts or, given ``layers``, from those (``write_layers``: e.g. read
    one expert at a time from a transformers checkpoint).

    ``source`` identifies the weights (e.g. the checkpoint path): a store from another
    checkpoint or model shape is rewritten, so offloaded evaluation never mixes weights.
    Only a store is rewritten: a ``path`` that is neither missing, empty nor an expert store
    (a run folder, say) is refused and left untouched (``ExpertStore.write``).
    """
    path = Path(path)
    if (path / INDEX_FILE).is_file():
        try:
            store = ExpertStore(path, model_cfg)
            if store.meta.get("source") == source:
                return store
            log.info(
                "expert store %s is from %r, rewriting from %r",
                path,
                store.meta.get("source"),
                source,
            )
            store.close()
        except MoestackError as err:
            log.warning("rewriting expert store %s: %s", path, err)
    if layers is not None:
        return ExpertStore.write_layers(
            layers, path, layout, model_cfg=model_cfg, meta={"source": source}, overwrite=True
        )
    return ExpertStore.write(
        model, path, layout, model_cfg=model_cfg, meta={"source": source}, overwrite=True
    )
