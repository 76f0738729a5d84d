"""A run's folder: preparing it for training, and loading a run back from it.

``prepare_out_dir`` checks ``out_dir`` against ``resume`` (a resumed run keeps its config and
its transformers source; leftovers of a killed run are removed; a corrupt newest checkpoint
falls back to the newest one that verifies), and ``start_out_dir`` writes the run's config once the start's checks passed. ``load_run`` serves
``moestack eval``, ``moestack export``, the pre-registered analysis and offloaded evaluation,
so that they all rebuild a run the same way; it too refuses a run whose transformers source
folder changed since it trained (``moestack.interop.hf_source``). A run that streamed its
experts (``offload_experts``) has none in its checkpoints: ``open_run_store`` opens the store
it trained with, each load checked, refused in one line naming it when gone or altered.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from moestack import atomic, checkpoint, distributed, lora
from moestack.config import DataConfig, HFModelConfig, TrainConfig, to_yaml
from moestack.data import Corpus
from moestack.device import move_resident, resolve_device
from moestack.errors import MoestackError
from moestack.interop.hf_source import check_resume_source, check_run_source, write_source
from moestack.model import RoutedLM

if TYPE_CHECKING:
    from moestack.cache import ExpertStore

log = logging.getLogger(__name__)

# Settings a resumed run may change: how it logs, evaluates, checkpoints and where it runs.
# Everything else (model, router, optim, data, seed, batch, steps) is the run's identity.
# What the launch decides, not the run: a resume takes them from its own command line and
# defaults (a checkpoint saved at one parallel layout resumes at any other).
LAUNCH_SECTIONS = ("parallel",)
RESUME_MAY_CHANGE = (
    "resume", "out_dir", "progress", "log_every", "eval_every", "eval_batches", "ckpt_every",
    "keep_last", "max_bad_steps", "threads", "device", "wandb_project", "wandb_mode",
    "telemetry.", "cache.", "parallel.",
)  # fmt: skip


@dataclass
class LoadedRun:
    """A run rebuilt from disk: its config and the model holding one checkpoint's weights."""

    run_dir: Path
    cfg: TrainConfig  # the config the run wrote (config.yaml), resolved
    model: RoutedLM  # on the CPU unless load_run was given a device
    checkpoint: Path  # the checkpoint folder whose weights the model holds
    step: int  # the optimizer step that checkpoint was written at


def run_corpus(cfg: TrainConfig) -> Corpus:
    """The run's corpus as its model reads text: bytes for moestack's models, the
    transformers model's own tokenizer (EOS between documents) for ``model.path``. ``cfg``
    is resolved (``TrainConfig.resolve``): the separator is the folder's EOS."""
    return cfg.data.build(cfg.model.tokenizer())


def load_run_config(run_dir: Path | str) -> TrainConfig:
    """The config a training run wrote into ``run_dir/config.yaml``, resolved (a
    transformers model's architecture read from its folder, ``TrainConfig.resolve``)."""
    return _read_run_config(run_dir).resolve()


def _read_run_config(run_dir: Path | str) -> TrainConfig:
    """``run_dir/config.yaml`` as written, not resolved (nothing else is read); one
    MoestackError line naming the file when it is missing or is no run config (not YAML,
    unknown keys, values of the wrong type or out of range)."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise MoestackError(f"{path} not found: {run_dir} is not a moestack run directory")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(TrainConfig), OmegaConf.load(path))
        return OmegaConf.to_object(merged)
    except (yaml.YAMLError, OmegaConfBaseException, ValueError, OSError) as err:
        raise _unreadable_config(path, err) from None


def _unreadable_config(path: Path, err: BaseException) -> MoestackError:
    reason = " ".join(str(err).split()) or type(err).__name__
    return MoestackError(
        f"{path} cannot be read as a run config ({reason}); put back the config.yaml "
        "that training wrote, or train the run again"
    )


def resumed_config(out_dir: Path, composed: Any, overrides: Sequence[str]) -> TrainConfig:
    """The config of a ``moestack-train ... resume=true`` start: the run's own (``out_dir``/
    config.yaml), as a checkpoint resume takes it (Lightning's ``ckpt_path``, torchtitan's),
    with only the fields its command line gives (``overrides``: a field, a section, a config
    group's option) and the launch's own sections (``LAUNCH_SECTIONS``: the parallel layout
    of this start) taken from hydra's ``composed`` config; ``check_resume_config`` then
    refuses those that change the run. The defaults and the run's first overrides are never
    compared. Without a config.yaml (nothing to resume, refused later), hydra's config."""
    path = out_dir / "config.yaml"
    if not path.is_file():
        return OmegaConf.to_object(composed)
    try:
        stored = OmegaConf.to_container(OmegaConf.load(path))
        if not isinstance(stored, dict):
            raise ValueError("not a mapping")
    except (yaml.YAMLError, OmegaConfBaseException, ValueError, OSError) as err:
        raise _unreadable_config(path, err) from None
    given = OmegaConf.to_container(composed, resolve=True)
    for key in (*LAUNCH_SECTIONS, *given_keys(overrides)):
        _copy_field(given, stored, key.split("."))
    if isinstance(stored.get("model"), dict):  # model.router is router's copy (TrainConfig)
        stored["model"].pop("router", None)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(TrainConfig), stored)
    except OmegaConfBaseException as err:
        raise _unreadable_config(path, err) from None
    return OmegaConf.to_object(merged)  # a value given that does not fit: one line


def given_keys(overrides: Sequence[str]) -> list[str]:
    """The config keys ``overrides`` set: a field or section (``optim.lr``, ``model.moe``), or
    a config group's name for its option (``model=small`` sets the ``model`` section);
    hydra's own settings and what hydra cannot parse are left out."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    keys = []
    for text in overrides:
        try:
            override = parser.parse_override(text)
        except HydraException:
            continue
        key = override.key_or_group
        if not (key == "hydra" or key.startswith(("hydra.", "hydra/")) or override.is_delete()):
            keys.append(key)
    return keys


def _copy_field(source: dict[str, Any], target: dict[str, Any], parts: list[str]) -> None:
    """``target[a][b]... = source[a][b]...`` for the dotted key ``parts`` (sections made as
    needed); nothing when ``source`` holds no such key."""
    for part in parts[:-1]:
        source = source.get(part) if isinstance(source, dict) else None
        if not isinstance(source, dict):
            return
        if not isinstance(target.get(part), dict):
            target[part] = {}
        target = target[part]
    if isinstance(source, dict) and parts[-1] in source:
        target[parts[-1]] = copy.deepcopy(source[parts[-1]])


def resolve_checkpoint(run_dir: Path | str, checkpoint_path: Path | str | None = None) -> Path:
    """``checkpoint_path`` if given, else the run's newest complete checkpoint; newer
    incomplete ones (no meta.json) are named in a warning, never passed over in silence."""
    if checkpoint_path:
        return Path(checkpoint_path)
    root = Path(run_dir) / "checkpoints"
    latest = checkpoint.latest_checkpoint(root)
    newer = [
        p.name for p in checkpoint.incomplete_checkpoints(root) if latest is None or p > latest
    ]
    if latest is None:
        held = f" (only incomplete ones, without {checkpoint.META_FILE}: {newer})" if newer else ""
        raise MoestackError(f"{root} holds no checkpoint{held}")
    if newer:
        log.warning(
            "%s: newer checkpoints %s have no %s (incomplete): using %s (step %s)",
            root, newer, checkpoint.META_FILE, latest.name, latest.name.removeprefix(checkpoint.PREFIX),
        )  # fmt: skip
    return latest


def is_transformers_dir(path: Path | str) -> bool:
    """A transformers model folder (config.json) rather than a moestack run (config.yaml)."""
    path = Path(path)
    return (path / "config.json").is_file() and not (path / "config.yaml").is_file()


def _load_transformers_dir(
    path: Path, device: str | torch.device | None, experts: bool
) -> LoadedRun:
    """A transformers MoE model folder as a run at step 0: the default run config with
    ``model.path`` set (its data, batch and evaluation settings; sequences no longer than
    the model takes), the model patched (``experts=False``: routed experts left unread)."""
    model_cfg = HFModelConfig(path=str(path)).resolve()
    seq_len = min(DataConfig().seq_len, model_cfg.max_seq_len)
    cfg = TrainConfig(model=model_cfg, data=DataConfig(seq_len=seq_len))
    model = cfg.model.build(experts=experts)
    if device is not None:
        move_resident(model, resolve_device(cfg.device if device == "auto" else str(device)))
    return LoadedRun(path, cfg, model, path, 0)


def load_run(
    run_dir: Path | str,
    checkpoint_path: Path | str | None = None,
    *,
    device: str | torch.device | None = None,
    experts: bool = True,
) -> LoadedRun:
    """Config, model and weights of the newest (or the named) checkpoint of ``run_dir``;
    a transformers model folder loads as a run at step 0 (its checkpoint is the folder).

    ``device`` moves the model there ("auto" = the run's own device setting resolved here);
    None leaves it on the CPU (offloaded evaluation writes the expert store from there).
    ``experts=False`` leaves the routed experts unread (meta tensors, served from an expert
    store written from the checkpoint or folder: ``checkpoint.iter_expert_layers``,
    ``iter_hf_expert_layers``); only the other weights are read.
    """
    run_dir = Path(run_dir)
    if is_transformers_dir(run_dir):
        return _load_transformers_dir(run_dir, device, experts)
    written = _read_run_config(run_dir)
    check_run_source(written.model, run_dir)  # before the source's config.json is read
    cfg = written.resolve()
    ckpt = resolve_checkpoint(run_dir, checkpoint_path)
    streamed = experts and cfg.offload_experts != "off"  # its checkpoints hold no experts
    if streamed:
        experts = False
    if experts:
        model = cfg.model.build()
        lora.add_adapters_for(model, cfg.trainable, cfg.lora, cfg.seed)
        meta = checkpoint.load_model_weights(ckpt, model, cfg.model)
    else:
        model = cfg.model.build_for_checkpoint()  # on meta, each tensor read once below
        lora.add_adapters_for(model, cfg.trainable, cfg.lora, cfg.seed)
        meta = checkpoint.load_model_weights_without_experts(ckpt, model, cfg.model)
    if streamed:
        _experts_from_store(model, cfg, run_dir)
    if device is not None:
        move_resident(model, resolve_device(cfg.device if device == "auto" else str(device)))
    return LoadedRun(run_dir, cfg, model, ckpt, int(meta["step"]))


def _experts_from_store(model: torch.nn.Module, cfg: TrainConfig, run_dir: Path) -> None:
    """A streamed run's frozen experts (offload_experts) read back from its expert store,
    each file checked against its checksum (``open_run_store``)."""
    from moestack.cache.offload import restore_experts

    with open_run_store(cfg, run_dir) as store, run_store_checked(cfg, run_dir):
        restore_experts(model, store, "cpu")


def open_run_store(cfg: TrainConfig, run_dir: str | Path) -> ExpertStore:
    """The expert store a streamed run trained with (``store_path``), each load checked
    against its file's checksum: what evaluation and export read its experts from (its
    checkpoints hold none). A store that is gone, or fails its checks, is refused in one
    line naming the run and the folder (``run_store_checked``)."""
    from moestack.cache import ExpertStore
    from moestack.cache.streaming import store_path

    path = store_path(cfg, run_dir)
    if not path.is_dir():
        raise MoestackError(
            f"{run_dir} streamed its experts (offload_experts={cfg.offload_experts}) from "
            f"{path}, which is gone; its checkpoints hold no experts: put the store back"
        )
    with run_store_checked(cfg, run_dir):
        return ExpertStore(path, cfg.model.store_shape, verify_loads=True)


@contextlib.contextmanager
def run_store_checked(cfg: TrainConfig, run_dir: str | Path) -> Iterator[None]:
    """Inside, a check of the streamed run's store that fails (a file missing, of another
    size, or whose bytes changed, found when it is opened or loaded) is refused in one line
    naming the run and the store, without the store's own advice to rewrite it: nothing
    else holds the run's experts."""
    from moestack.cache.streaming import store_path

    path = store_path(cfg, run_dir)
    try:
        yield
    except MoestackError as err:
        if str(path) not in str(err):
            raise
        reason = str(err).rsplit("; ", 1)[0]  # what failed, not the generic fix
        raise MoestackError(
            f"{run_dir} streamed its experts (offload_experts={cfg.offload_experts}) from "
            f"the expert store {path}, which fails its checks ({reason}); its checkpoints hold "
            "no experts: put back the store the run trained with"
        ) from None


def prepare_out_dir(
    cfg: TrainConfig, out_dir: Path, dist_info: distributed.DistInfo
) -> Path | None:
    """Check ``out_dir`` against ``resume`` and remove a killed run's leftovers (a save cut
    short); returns the checkpoint to resume from (None for a new run). The run's own files
    are written by ``start_out_dir``, once every check of the start passed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt_root = out_dir / "checkpoints"
    if dist_info.is_main:
        checkpoint.clean_partial(ckpt_root)
    distributed.barrier(dist_info)
    latest = checkpoint.latest_checkpoint(ckpt_root)
    if cfg.resume and latest is None:
        raise MoestackError(f"resume=true but {ckpt_root} holds no checkpoint; start a new run")
    if not cfg.resume and latest is not None:
        raise MoestackError(
            f"{out_dir} already holds checkpoints; pass resume=true to continue it or pick "
            "another out_dir"
        )
    resume_from = None
    if cfg.resume:
        check_resume_config(cfg, out_dir)
        check_resume_source(cfg.model, out_dir)
        resume_from = checkpoint.newest_verified(
            ckpt_root,
            *(dist_info.rank, dist_info.world_size),
            gather=lambda value: distributed.gather_objects(value, dist_info),
        )
        if resume_from is None:
            raise MoestackError(
                f"resume=true but no checkpoint under {ckpt_root} verifies (see the warnings "
                "above); start a new run"
            )
        if resume_from != latest:
            log.warning("resuming from %s: the newer %s does not verify", resume_from, latest)
    elif (out_dir / "metrics.jsonl").exists():
        log.warning("%s holds metrics of a run that never checkpointed: starting clean", out_dir)
    distributed.barrier(dist_info)  # every rank has checked out_dir before rank 0 writes
    return resume_from


def start_out_dir(cfg: TrainConfig, out_dir: Path, dist_info: distributed.DistInfo) -> None:
    """Write the run's files a start begins with (rank 0): the resolved config, and for a new
    run the digests of its transformers source; a new run over the metrics of one that never
    checkpointed gets a new wandb run (its metrics are truncated when opened). Called once
    every check passed and the model (a resumed run's weights) is built, so that a refused
    start leaves the folder's files as they were."""
    if not dist_info.is_main:
        return
    if not cfg.resume:
        if (out_dir / "metrics.jsonl").exists():
            (out_dir / "wandb_id.txt").unlink(missing_ok=True)
        write_source(cfg.model, out_dir)
    write_run_config(cfg, out_dir, dist_info)


def write_run_config(cfg: TrainConfig, out_dir: Path, dist_info: distributed.DistInfo) -> None:
    """Write the resolved config (config.yaml) on rank 0 (``start_out_dir`` calls it once the
    start's checks passed: a resume refused for a config that does not fit the checkpoint,
    another lora.rank, leaves the folder's config as it was)."""
    if dist_info.is_main:
        atomic.write_text(out_dir / "config.yaml", to_yaml(cfg))


def check_resume_config(cfg: TrainConfig, out_dir: Path) -> None:
    """Refuse to resume with a config that differs from the run's own (config.yaml) in
    anything but ``RESUME_MAY_CHANGE``: the optimizer, scheduler and data state in the
    checkpoint would silently win over, or clash with, the new values."""
    if not (out_dir / "config.yaml").is_file():
        return
    try:
        saved = _flat(dataclasses.asdict(load_run_config(out_dir)))
    except Exception as err:  # a config.yaml from another moestack version, or edited by hand
        raise MoestackError(
            f"{out_dir / 'config.yaml'} cannot be read ({err}); start a new out_dir"
        ) from None
    now = _flat(dataclasses.asdict(cfg))
    changed = [
        f"{key} {saved.get(key)!r} -> {now.get(key)!r}"
        for key in sorted(set(saved) | set(now))
        if saved.get(key) != now.get(key) and not key.startswith(RESUME_MAY_CHANGE)
    ]
    if changed:
        raise MoestackError(
            f"resume=true with a changed config ({'; '.join(changed)}): a resumed run keeps the "
            f"config in {out_dir / 'config.yaml'}; resume without these overrides, or start a new "
            "out_dir"
        )


def check_same_config_on_every_rank(cfg: TrainConfig, dist_info: distributed.DistInfo) -> None:
    """Refuse, on every rank at once, ranks started with different configs (a different
    ``optim.lr`` trains on silently; different shapes end in a collective's abort): the
    first collective of a run compares every rank's resolved config with rank 0's."""
    configs = distributed.gather_objects(_flat(dataclasses.asdict(cfg)), dist_info)
    differ = {
        rank: sorted(k for k in set(mine) | set(configs[0]) if mine.get(k) != configs[0].get(k))
        for rank, mine in enumerate(configs)
    }
    differ = {rank: keys for rank, keys in differ.items() if keys}
    if differ:
        rank, keys = next(iter(differ.items()))
        shown = "; ".join(
            f"{k} {configs[0].get(k)!r} on rank 0, {configs[rank].get(k)!r}" for k in keys[:3]
        )
        raise MoestackError(
            f"ranks {sorted(differ)} started with another config than rank 0 ({shown} on "
            f"rank {rank}); start every rank with the same command line"
        )


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = list(value) if isinstance(value, tuple) else value
    return out
