"""Expert parallelism at scale on this machine: does any process hold more than its shard?

A synthetic transformers Qwen3-MoE folder (``--gb``, about 3 GB of bf16 weights by default,
saved in shards with their index as from_pretrained expects, the experts in the hub's
per-expert layout, a byte-level tokenizer) is fine-tuned by 4 gloo processes on this machine:

1. ``ep4``: ep=4 (one EP group of 4), ``--steps`` steps, then a checkpoint;
2. ``ep2``: ep=2 (two data-parallel groups of 2 EP ranks), the same;
3. ``resume``: the ep4 run's checkpoint resumed at ep=2, ``--steps`` more steps.

Each phase runs in fresh processes (``mp.spawn``, one torch thread each), built and stepped as
``moestack-train model=hf parallel.ep=P`` builds them (``trainer.build_run``,
``Trainer.train_step``, ``callbacks.save``). ``--start-method forkserver`` forks them instead
from one server process that imported the run's modules (torch, transformers, dynamo,
moestack) once: at a toy size, the 12 processes' own imports are most of the run's time. For
every process it records:

- peak resident memory: ``VmHWM`` of /proc/self/status (which counts the pages of the
  memory-mapped safetensors files being read, page cache the kernel may drop), and the peak
  of anonymous memory (``RssAnon``, sampled every 10 ms by a thread), above the process's
  before the run was built (the interpreter and its libraries, transformers' model code
  and torch._dynamo, which the optimizer imports, already loaded);
- bytes read: the bytes of every tensor (or slice) moestack's safetensors readers returned,
  from the model folder and from the checkpoint, counted by wrapping ``safe_open`` in this
  script (the library keeps no counter);

against the process's ideal share, computed from the folder's headers alone: the backbone
(every rank's), 1/ep of the experts, and the gradients and AdamW moments of what it trains
(``--trainable``: ``routers`` by default, so that 4 processes fit in this machine's memory;
``all`` with a smaller ``--gb``). Ratios above 1 are what a process holds beyond its share.

An expert-parallel run fixes glibc's mmap threshold itself (``parallel.host_mmap_threshold_kb``,
128 by default: freed blocks of 128 KiB and more go back to the system instead of staying in
glibc's heaps, :mod:`moestack.host_allocator`); ``--host-mmap-threshold-kb 0`` runs with
glibc's adaptive default instead, ``--mmap-threshold N`` sets ``MALLOC_MMAP_THRESHOLD_`` in
the processes' environment (which the run then keeps). BENCHMARKS.md compares them.

    python scripts/bench_shards.py [--gb 3] [--steps 3] [--trainable routers] [--json out.json]
        [--max-bytes 400000] [--start-method spawn]
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import math
import multiprocessing
import multiprocessing.forkserver
import os
import re
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moestack import bench

GB = 1e9
EOS, PAD = "<|endoftext|>", "<pad>"
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=20)  # a deadlock fails instead of hanging
_EXPERT = re.compile(r"\.layers\.\d+\.mlp\.experts\.")
_ROUTER = re.compile(r"\.layers\.\d+\.mlp\.gate\.weight$")
# Code the build imports (the optimizer imports torch._dynamo): imported by each process
# before it measures its start, and by the fork server (--start-method forkserver) once.
BUILD_MODULES = ("torch._dynamo", "transformers.models.qwen3_moe.modeling_qwen3_moe")
WORKER_MODULES = (*BUILD_MODULES, "moestack.distributed", "moestack.trainer",
                  "moestack.prereg.compose")  # fmt: skip


# --------------------------------------------------------------------------- the folder
def shapes_for(gb: float, d_model: int = 1024, experts: int = 64) -> dict[str, int]:
    """Qwen3-MoE shapes whose bf16 weights come to about ``gb`` GB: ``experts`` experts top-8
    (64: the granularity of Qwen3-30B-A3B) of width d_model / 2, 8 heads of d_model / 8, as
    many layers as the size needs."""
    d, f, head = d_model, d_model // 2, d_model // 8
    per_layer = 2 * (experts * 3 * d * f + 2 * d * 8 * head + 2 * d * 4 * head + experts * d)
    return {"d_model": d, "d_ff": f, "experts": experts, "top_k": 8, "heads": 8, "kv_heads": 4,
            "head_dim": head, "layers": max(1, round(gb * GB / per_layer))}  # fmt: skip


def write_tokenizer(folder: Path) -> Any:
    """A byte-level tokenizer without merges: the 256 byte symbols, EOS and pad."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD)
    fast.save_pretrained(folder)
    return fast


def write_folder(folder: Path, s: dict[str, int], shard_bytes: float = 0.5 * GB) -> None:
    """config.json, a tokenizer and random bf16 weights (N(0, 0.02), norms at one; seeded
    per tensor) in safetensors shards of about ``shard_bytes`` with their index."""
    import safetensors.torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    folder.mkdir(parents=True)
    tok = write_tokenizer(folder)
    config = Qwen3MoeConfig(
        vocab_size=len(tok), hidden_size=s["d_model"], num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"],
        intermediate_size=4 * s["d_model"], moe_intermediate_size=s["d_ff"],
        num_experts=s["experts"], num_experts_per_tok=s["top_k"], norm_topk_prob=True,
        max_position_embeddings=512, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, bos_token_id=None, tie_word_embeddings=False,
        output_router_logits=False, dtype="bfloat16",
    )  # fmt: skip
    config.save_pretrained(folder)
    with torch.device("meta"):  # names and shapes only
        meta = AutoModelForCausalLM.from_config(config)
    shapes = {n: tuple(p.shape) for n, p in meta.named_parameters() if ".mlp.experts." not in n}
    for layer in range(s["layers"]):
        for e in range(s["experts"]):
            base = f"model.layers.{layer}.mlp.experts.{e}"
            shapes[f"{base}.gate_proj.weight"] = (s["d_ff"], s["d_model"])
            shapes[f"{base}.up_proj.weight"] = (s["d_ff"], s["d_model"])
            shapes[f"{base}.down_proj.weight"] = (s["d_model"], s["d_ff"])
    files = _shard_names(shapes, shard_bytes)
    total = 0
    for file in sorted(set(files.values())):
        tensors = {n: _draw(n, shapes[n]) for n in shapes if files[n] == file}
        safetensors.torch.save_file(tensors, str(folder / file), metadata={"format": "pt"})
        total += sum(t.numel() * 2 for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": files}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def _shard_names(shapes: dict[str, tuple[int, ...]], shard_bytes: float) -> dict[str, str]:
    """Each tensor's shard file, in order, a new file once one holds ``shard_bytes``."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * 2
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    n = len(groups)
    return {name: f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            for i, group in enumerate(groups) for name in group}  # fmt: skip


def _draw(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(int.from_bytes(name.encode()[-8:], "little") % 2**63)
    return (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)


# --------------------------------------------------------------------------- the ideal share
def ideal(folder: Path, ep: int, trainable: str) -> dict[str, float]:
    """A process's share at EP degree ``ep``, from the folder's headers alone: what it must
    hold in memory (fp32 weights of the backbone and 1/ep of the experts, gradients and two
    AdamW moments of what it trains) and read from the folder (those weights as stored)."""
    from moestack.interop.hf_weights import folder_tensors

    tensors = folder_tensors(folder)
    elems = {"backbone": 0, "experts": 0, "routers": 0}
    disk = {"backbone": 0, "experts": 0}
    for name, header in tensors.items():
        kind = "experts" if _EXPERT.search(name) else "backbone"
        elems[kind] += math.prod(header.shape)
        disk[kind] += header.end - header.start
        if _ROUTER.search(name):
            elems["routers"] += math.prod(header.shape)
    held = elems["backbone"] + elems["experts"] / ep
    trained = {"routers": elems["routers"], "all": held}[trainable]
    return {
        "memory": 4 * held + 12 * trained,
        "weights": 4 * held,
        "folder_read": disk["backbone"] + disk["experts"] / ep,
        "checkpoint_read": 4 * held,
        "whole_model": 4 * (elems["backbone"] + elems["experts"]),
    }


# --------------------------------------------------------------------------- one process
def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    return 0


class _PeakAnon:
    """The peak of this process's anonymous resident memory, sampled by a daemon thread."""

    def __init__(self, every_s: float = 0.01) -> None:
        self.peak = _status_kb("RssAnon")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, args=(every_s,), daemon=True)
        self._thread.start()

    def _sample(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            self.peak = max(self.peak, _status_kb("RssAnon"))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, _status_kb("RssAnon"))


class _Counted:
    """A safetensors file handle that adds the bytes of what it returns to ``counts``."""

    def __init__(self, handle: Any, path: str, counts: dict[str, int]) -> None:
        self._handle, self._path, self._counts = handle, path, counts

    def _add(self, tensor: torch.Tensor) -> torch.Tensor:
        self._counts[self._path] = self._counts.get(self._path, 0) + tensor.nbytes
        return tensor

    def __enter__(self) -> _Counted:
        self._handle.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._handle.__exit__(*exc)

    def get_tensor(self, key: str) -> torch.Tensor:
        return self._add(self._handle.get_tensor(key))

    def get_slice(self, key: str) -> Any:
        owner, sliced = self, self._handle.get_slice(key)

        class Slice:
            def __getitem__(self, index: Any) -> torch.Tensor:
                return owner._add(sliced[index])

            def __getattr__(self, name: str) -> Any:
                return getattr(sliced, name)

        return Slice()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)


def _count_reads(counts: dict[str, int], hashed: dict[str, int]) -> None:
    """Wrap ``safe_open`` where moestack's readers call it (the model folder's meta loader,
    the checkpoint's reader), and the checkpoint's checksum (every byte of a file it writes
    or verifies), in this process only."""
    import safetensors

    from moestack import checkpoint, checkpoint_format, checkpoint_load, meta_load

    real = safetensors.safe_open
    real_sha256 = checkpoint.sha256_file

    def counted(path: Any, *args: Any, **kwargs: Any) -> _Counted:
        return _Counted(real(path, *args, **kwargs), str(path), counts)

    def counted_sha256(path: Any) -> str:
        hashed[str(path)] = hashed.get(str(path), 0) + Path(path).stat().st_size
        return real_sha256(path)

    checkpoint.sha256_file = counted_sha256  # the files it writes
    checkpoint_format.sha256_file = counted_sha256  # the files it verifies before a resume
    meta_load.safe_open = counted
    checkpoint_load.safe_open = counted  # reading a checkpoint back


def _worker(rank: int, world: int, init: str, phase: dict[str, Any], out: str) -> None:
    from moestack import callbacks, distributed, trainer
    from moestack.prereg.compose import compose_config

    torch.set_num_threads(1)
    counts: dict[str, int] = {}
    hashed: dict[str, int] = {}
    _count_reads(counts, hashed)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=COLLECTIVE_TIMEOUT)  # fmt: skip
    info = distributed.DistInfo(rank=rank, world_size=world, local_rank=rank)
    try:
        cfg = compose_config(phase["overrides"]).resolve()
        for module in BUILD_MODULES:
            importlib.import_module(module)  # code the build imports: counted in the start

        before, anon_before = _status_kb("VmRSS"), _status_kb("RssAnon")
        anon = _PeakAnon()
        start = time.perf_counter()
        run = trainer.build_run(cfg, Path(phase["out_dir"]), info)
        # bytes hashed to verify the checkpoint it resumes from (not those it writes later)
        verified = sum(n for p, n in hashed.items() if "/checkpoints/" in p)
        built = {"hwm": _status_kb("VmHWM"), "s": time.perf_counter() - start}
        stages = {"built": anon.peak}
        stepping = time.perf_counter()
        for _ in range(phase["steps"]):
            run.train_step()  # the scheduler steps inside
            run.state.step += 1
        steps_s = time.perf_counter() - stepping
        stages["stepped"] = anon.peak
        callbacks.save(run, run.state.step)
        stages["saved"] = anon.peak
        record = {
            "rank": rank, "rss_before": before, "hwm_built": built["hwm"], "build_s": built["s"],
            "steps_s": steps_s,
            "hwm": _status_kb("VmHWM"), "wall_s": time.perf_counter() - start,
            "anon_before": anon_before, "anon_peak": anon.stop(), "anon_stages": stages,
            "folder_read": sum(n for p, n in counts.items() if p.startswith(phase["folder"])),
            "checkpoint_read": sum(n for p, n in counts.items() if "/checkpoints/" in p),
            "checkpoint_verified": verified,
            "held_bytes": sum(p.numel() * p.element_size() for p in run.model.parameters()),
        }  # fmt: skip
        del run
        every: list[Any] = [None] * world
        dist.all_gather_object(every, record)
        if rank == 0:
            Path(out).write_text(json.dumps(every))
    finally:
        distributed.close_process_groups()


# --------------------------------------------------------------------------- phases
def run_phase(name: str, overrides: list[str], args: Any, tmp: Path, folder: Path) -> list[dict]:
    out_dir = tmp / ("ep4" if name == "resume" else name)
    phase = {"overrides": [*overrides, f"out_dir={out_dir}"], "steps": args.steps,
             "out_dir": str(out_dir), "folder": str(folder)}  # fmt: skip
    out = tmp / f"{name}.json"
    init = tmp / f"init-{name}"
    print(f"[{name}] {args.ranks} processes ...", flush=True)
    mp.start_processes(_worker, args=(args.ranks, str(init), phase, str(out)),
                       nprocs=args.ranks, start_method=args.start_method)  # fmt: skip
    return json.loads(out.read_text())


def overrides_for(folder: Path, ep: int, args: Any, resume: bool) -> list[str]:
    return [
        "model=hf", f"model.path={folder}", f"parallel.ep={ep}", f"trainable={args.trainable}",
        "optim=adamw", "telemetry=off", "wandb_mode=disabled", "progress=false", "threads=1",
        "eval_every=0", "eval_batches=1", "ckpt_every=0", "log_every=1000",
        "model.moe.impl=torch", f"batch_size={args.ranks * 2}", "data.seq_len=64",
        f"data.max_bytes={args.max_bytes}", f"steps={2 * args.steps}",  # resume: to the end
        f"resume={str(resume).lower()}", "keep_last=1",
        *([f"parallel.host_mmap_threshold_kb={args.host_mmap_threshold_kb}"]
          if args.host_mmap_threshold_kb is not None else []),
    ]  # fmt: skip


def summarize(records: list[dict], share: dict[str, float], kind: str) -> dict[str, Any]:
    anon = max(r["anon_peak"] - r["anon_before"] for r in records)
    read = max(r[kind] for r in records)
    return {
        "peak_rss_gb": max(r["hwm"] for r in records) / GB,
        "hwm_above_start_gb": max(r["hwm"] - r["rss_before"] for r in records) / GB,
        "anon_above_start_gb": anon / GB,
        "ideal_gb": share["memory"] / GB,
        "rss_ratio": anon / share["memory"],
        "hwm_ratio": max(r["hwm"] - r["rss_before"] for r in records) / share["memory"],
        "read_gb": read / GB,
        "ideal_read_gb": share[kind] / GB,
        "read_ratio": read / share[kind],
        "verified_gb": max(r["checkpoint_verified"] for r in records) / GB,
        "steps_s": max(r["steps_s"] for r in records),
        "whole_model_gb": share["whole_model"] / GB,
        "records": records,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = bench.parser(__doc__, steps=3, json="")
    parser.add_argument("--gb", type=float, default=3.0, help="bf16 weights of the folder, GB")
    parser.add_argument("--d-model", type=int, default=1024, help="the model's width")
    parser.add_argument("--experts", type=int, default=64, help="experts per layer (top-8)")
    parser.add_argument("--ranks", type=int, default=4, help="processes")
    parser.add_argument("--trainable", default="routers", choices=("routers", "all"))
    parser.add_argument("--folder", default="", help="reuse (or keep) the model folder here")
    parser.add_argument(
        "--max-bytes", type=int, default=400_000,
        help="bytes of the corpus the runs read and tokenise (data.max_bytes; default 400000)",
    )  # fmt: skip
    parser.add_argument(
        "--start-method", default="spawn", choices=("spawn", "forkserver"),
        help="how the processes start (default spawn: each imports everything itself; "
        "forkserver: forked from one server that imported the run's modules once)",
    )  # fmt: skip
    parser.add_argument(
        "--mmap-threshold", type=int, default=0,
        help="MALLOC_MMAP_THRESHOLD_ for the processes (glibc then returns freed blocks above "
        "it to the system; default 0: glibc's adaptive default)",
    )  # fmt: skip
    parser.add_argument(
        "--host-mmap-threshold-kb", type=int, default=None,
        help="parallel.host_mmap_threshold_kb of the runs (default: the config's, 128; 0: "
        "glibc's adaptive threshold)",
    )  # fmt: skip
    return parser


def main() -> None:
    args = build_parser().parse_args()
    start, load0 = time.perf_counter(), os.getloadavg()
    if args.mmap_threshold:  # read by glibc when each spawned process starts
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    if args.start_method == "forkserver":  # it imports them while the folder is written
        multiprocessing.set_forkserver_preload(["__main__", *WORKER_MODULES])
        multiprocessing.forkserver.ensure_running()
    with tempfile.TemporaryDirectory(prefix="bench_shards.") as tmp_name:
        tmp = Path(tmp_name)
        folder = Path(args.folder) if args.folder else tmp / "model"
        shapes = shapes_for(args.gb, args.d_model, args.experts)
        if not (folder / "config.json").is_file():
            print(f"writing a {args.gb:g} GB Qwen3-MoE folder into {folder} ...", flush=True)
            write_folder(folder, shapes)
        disk = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        results = run_phases(folder, args, tmp)
        if not args.folder:
            shutil.rmtree(folder, ignore_errors=True)
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "cpu": bench.machine(),
                    "torch": torch.__version__, "load_before": load0, "load_after": os.getloadavg()},
        "args": vars(args), "shapes": shapes, "folder_gb": disk / GB,
        "wall_s": time.perf_counter() - start, "phases": results,
    }  # fmt: skip
    print_table(report)
    if args.json:
        bench.write_json(args.json, report, indent=1)


def run_phases(folder: Path, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """ep=4 and ep=2 from the folder, then a resume at ep=2 from ep=2's checkpoint: each
    phase's processes' records against the ideal share of the folder (or checkpoint)."""
    phases = {
        "ep4": (4, overrides_for(folder, 4, args, resume=False), "folder_read"),
        "ep2": (2, overrides_for(folder, 2, args, resume=False), "folder_read"),
        "resume": (2, overrides_for(folder, 2, args, resume=True), "checkpoint_read"),
    }
    results: dict[str, Any] = {}
    for name, (ep, overrides, kind) in phases.items():
        records = run_phase(name, overrides, args, tmp, folder)
        results[name] = {"ep": ep, **summarize(records, ideal(folder, ep, args.trainable), kind)}
    return results


def print_table(report: dict[str, Any]) -> None:
    s = report["shapes"]
    print(f"\nQwen3-MoE folder: {report['folder_gb']:.2f} GB bf16, {s['layers']} layers, "
          f"{s['experts']} experts top-{s['top_k']}, d_model {s['d_model']}; "
          f"{report['args']['ranks']} gloo processes, trainable={report['args']['trainable']}")  # fmt: skip
    head = ("phase", "ep", "VmHWM", "VmHWM above start", "anon above start", "ideal", "ratio",
            "read", "ideal read", "ratio", "whole model")  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name, r in report["phases"].items():
        print(f"| {name} | {r['ep']} | {r['peak_rss_gb']:.2f} GB | {r['hwm_above_start_gb']:.2f} "
              f"GB | {r['anon_above_start_gb']:.2f} GB | {r['ideal_gb']:.2f} GB | "
              f"{r['rss_ratio']:.2f}x | {r['read_gb']:.2f} GB | "
              f"{r['ideal_read_gb']:.2f} GB | {r['read_ratio']:.3f}x | {r['whole_model_gb']:.2f} GB |")  # fmt: skip
    for name, r in report["phases"].items():
        print(f"{name}: the slowest process's {report['args']['steps']} steps took "
              f"{r['steps_s']:.1f} s; a process hashed {r['verified_gb']:.2f} GB of the "
              "checkpoint it resumed from")  # fmt: skip
    print(f"\nwall time {report['wall_s']:.0f} s; peak RSS and reads are the largest of the "
          "processes; 'above start' subtracts the process's before the run was built; ratio: "
          "anonymous memory above start / ideal; "
          "reads: the folder's tensors (ep4, ep2), the checkpoint's (resume)")  # fmt: skip


if __name__ == "__main__":
    main()
